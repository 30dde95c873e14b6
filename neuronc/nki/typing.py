"""``nki.typing`` (``nt``): the annotation ``nt.tensor[shape...]`` NKI kernels write on tiles (documentation only)."""
from __future__ import annotations


class _TensorType:
    def __getitem__(self, shape):
        return self


tensor = _TensorType()
