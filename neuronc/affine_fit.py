"""Whether a grid of element positions is one affine map (offset + index . strides), and which.

Views composed numerically (passes/attention.py's head views, passes/view_chains.py) and NKI kernels' accesses read
through a view (nki/kernel.py) both need it; it lives below both layers.
"""
from __future__ import annotations

import numpy as np


def affine_fit(positions: np.ndarray):
    """(offset, strides) with positions[i] == offset + i . strides for every index i, or None."""
    base = int(positions.reshape(-1)[0])
    strides = []
    for axis, size in enumerate(positions.shape):
        step = [0] * positions.ndim
        step[axis] = 1 if size > 1 else 0
        strides.append(int(positions[tuple(step)]) - base if size > 1 else 0)
    grid = np.indices(positions.shape, dtype=np.int64)
    if not np.array_equal(positions, base + sum(g * s for g, s in zip(grid, strides))):
        return None
    return base, tuple(strides)
