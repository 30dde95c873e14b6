"""neuronc's own lowerings of the iterative linear algebra torch-mlir cannot lower: the SVD (`_linalg_svd`, which
torch.svd, linalg.svd/svdvals, matrix_rank, cond and the 2/nuclear norms reach), the symmetric eigendecomposition
(`_linalg_eigh`: eigh, eigvalsh), the pseudo-inverse, and histograms (histc, histogram). Decompositions into
elementwise ops, reductions, slices and sorts, registered like decompositions.OWN (torch_import and aten_lowering
merge `OWN` here after it).

Shapes are static and the IR has no loop, so an iterative algorithm is a fixed number of unrolled sweeps of
parallel (Brent-Luk ordered) Jacobi rotations: `sweeps(n)` below, chosen so fp32 converges for the sizes
PyTorch's OpInfo samples use (n <= 16) and documented as the limit. Each sweep is n - 1 rounds (n made even by a
zero column) in which n / 2 disjoint pairs rotate at once, elementwise.

Singular vectors and eigenvectors are unique only up to sign: LAPACK's signs come from its Householder
reductions and no Jacobi method reproduces them. The convention here is deterministic: the largest-magnitude entry
(the first one of equals) of each right singular vector / eigenvector is positive (U follows from A V = U S).
Singular values and eigenvalues are unique and match LAPACK's (descending / ascending order).
"""
from __future__ import annotations

import math

import torch

aten = torch.ops.aten

MAX_MEASURED_SIZE = 16  # sweeps(n) was measured to converge in fp32 up to this n


def sweeps(n: int) -> int:
    """Jacobi sweeps for an n-column problem (n even). Measured in fp32 (random, graded and rank-deficient
    matrices, singular values and eigenvalues against LAPACK in fp64): rounding level after 3 sweeps for n <= 4,
    4 for n <= 8, 5 for n <= 16; two sweeps more are taken as margin. Beyond 16, one sweep more per doubling of n
    (not measured: the documented limit of this lowering)."""
    if n <= 2:
        return 1 if n == 2 else 0
    if n <= 8:
        return 6
    if n <= MAX_MEASURED_SIZE:
        return 7
    return 7 + math.ceil(math.log2(n / MAX_MEASURED_SIZE))


def _round_robin(n: int) -> list:
    """Brent-Luk's movement between rounds, in positions of the half layout [top..., bottom...] (pairs (k, h + k)):
    the new order, as position lists. After n - 1 rounds every pair has met once."""
    h = n // 2
    return [0, h, *range(1, h - 1), *range(h + 1, n), h - 1] if h > 1 else [0, 1]


def _take(x, dim: int, order: list):
    """x's slices along dim in `order`, as a concatenation of runs of consecutive positions (no gather)."""
    runs, start = [], 0
    for i in range(1, len(order) + 1):
        if i == len(order) or order[i] != order[i - 1] + 1:
            runs.append(x.narrow(dim, order[start], i - start))
            start = i
    return runs[0] if len(runs) == 1 else torch.cat(runs, dim)


def _rotation(alpha, beta, gamma):
    """(c, s) of the Jacobi rotation that zeroes gamma of the 2x2 symmetric [[alpha, gamma], [gamma, beta]]
    (Rutishauser's t, the smaller angle); the identity where gamma is 0 (a zero pad stays exactly zero)."""
    zero = gamma == 0
    zeta = (beta - alpha) / (2 * torch.where(zero, 1.0, gamma))
    t = torch.where(zeta >= 0, 1.0, -1.0) / (zeta.abs() + torch.sqrt(1 + zeta * zeta))
    c = torch.rsqrt(1 + t * t)
    return torch.where(zero, 1.0, c), torch.where(zero, 0.0, c * t)


def _rotate(x, dim: int, c, s):
    """Rotate the pairs (k, h + k) of x's positions along dim by (c_k, s_k): p' = c p - s q, q' = s p + c q."""
    h = x.shape[dim] // 2
    p, q = x.narrow(dim, 0, h), x.narrow(dim, h, h)
    shape = [1] * x.dim()
    shape[dim] = h
    shape[:c.dim() - 1] = c.shape[:-1]
    c, s = c.reshape(shape), s.reshape(shape)
    return torch.cat([c * p - s * q, s * p + c * q], dim)


def _pad_even(x, dims):
    for dim in dims:
        if x.shape[dim] % 2:
            pad = list(x.shape)
            pad[dim] = 1
            x = torch.cat([x, x.new_zeros(pad)], dim)
    return x


def _positive_largest(vectors):
    """Signs making each column's largest-magnitude entry (the first of equals) positive."""
    at = vectors.abs().argmax(-2, keepdim=True)
    return torch.where(torch.gather(vectors, -2, at) < 0, -1.0, 1.0).to(vectors.dtype)


def _order_columns(x, order):
    return torch.gather(x, -1, order.unsqueeze(-2).expand(x.shape))


# -- the SVD: one-sided (Hestenes) Jacobi on the columns ---------------------------------------------------------

def _one_sided_jacobi(a):
    """(W, V) with W = A V of mutually orthogonal columns, V orthogonal: a[..., m, n], n columns made even by a zero
    column; the columns come back in their original order and the pad removed."""
    n = a.shape[-1]
    w = _pad_even(a, [-1])
    size = w.shape[-1]
    v = _pad_even(torch.eye(n, dtype=a.dtype, device=a.device).expand(a.shape[:-2] + (n, n)), [-2, -1])
    position = list(range(size))  # position[k]: the original column now at k
    move = _round_robin(size)
    h = size // 2
    for _ in range(sweeps(size)):
        for _ in range(size - 1):
            p, q = w[..., :h], w[..., h:]
            alpha, beta, gamma = (p * p).sum(-2), (q * q).sum(-2), (p * q).sum(-2)
            negligible = gamma.abs() <= torch.finfo(a.dtype).eps * torch.sqrt(alpha * beta)
            c, s = _rotation(alpha, beta, torch.where(negligible, 0.0, gamma))
            w, v = _rotate(w, -1, c, s), _rotate(v, -1, c, s)
            w, v = _take(w, -1, move), _take(v, -1, move)
            position = [position[k] for k in move]
    back = [position.index(k) for k in range(n)]
    return _take(w, -1, back), _take(v, -1, back)[..., :n, :]


def _complete(u, rank):
    """u[..., m, k] with its first `rank` columns orthonormal (rank[...] data-dependent) and the rest anything:
    the same first columns, the others an orthonormal completion (Gram-Schmidt, twice, of the unit vectors in
    turn: one whose remainder is long enough takes the next free column). m + k steps, unrolled."""
    m, k = u.shape[-2], u.shape[-1]
    columns = torch.arange(k, device=u.device)
    kept = columns < rank.unsqueeze(-1)  # [..., k]
    basis = torch.where(kept.unsqueeze(-2), u, 0.0)
    filled = rank
    identity = torch.eye(m, dtype=u.dtype, device=u.device)
    threshold = 0.5 / math.sqrt(m)  # some unit vector keeps at least 1/sqrt(m) of its length while basis < m
    for i in range(m):
        e = identity[:, i].expand(u.shape[:-2] + (m,))
        r = e
        for _ in range(2):
            r = r - (basis * (basis * r.unsqueeze(-1)).sum(-2, keepdim=True)).sum(-1)
        norm = torch.sqrt((r * r).sum(-1, keepdim=True))
        take = (norm.squeeze(-1) > threshold) & (filled < k)
        slot = (columns == filled.unsqueeze(-1)) & take.unsqueeze(-1)  # [..., k]
        basis = basis + torch.where(slot.unsqueeze(-2), (r / torch.where(norm > 0, norm, 1.0)).unsqueeze(-1), 0.0)
        filled = filled + take.to(filled.dtype)
    return basis


def _svd_tall(a, full_matrices: bool, compute_uv: bool):
    """U, S, Vh of a[..., m, n] with m >= n."""
    m, n = a.shape[-2], a.shape[-1]
    w, v = _one_sided_jacobi(a)
    norms = torch.sqrt((w * w).sum(-2))
    s, order = torch.sort(norms, dim=-1, descending=True)
    if not compute_uv:
        return s
    v = _order_columns(v, order)
    w = _order_columns(w, order)
    sign = _positive_largest(v)
    v, w = v * sign, w * sign
    tiny = s <= s[..., :1] * (torch.finfo(a.dtype).eps * max(m, n))
    u = w / torch.where(tiny, 1.0, s).unsqueeze(-2)
    rank = (~tiny).sum(-1)
    if full_matrices and m > n:
        u = torch.cat([u, u.new_zeros(u.shape[:-1] + (m - n,))], -1)
    u = _complete(u, rank)
    return u, s, v.mT


def _linalg_svd(a, full_matrices=False, compute_uv=True, *, driver=None):
    m, n = a.shape[-2], a.shape[-1]
    k = min(m, n)
    batch = a.shape[:-2]
    if a.numel() == 0 or k == 0:
        s = a.new_zeros(batch + (k,))
        if not compute_uv:
            return a.new_zeros((0,)), s, a.new_zeros((0,))
        eye = (lambda r, c: torch.eye(r, c, dtype=a.dtype, device=a.device).expand(batch + (r, c)) + 0)
        return (eye(m, m if full_matrices else k), s, eye(n if full_matrices else k, n))
    if m >= n:
        result = _svd_tall(a, full_matrices, compute_uv)
        if not compute_uv:
            return a.new_zeros((0,)), result, a.new_zeros((0,))
        return result
    result = _svd_tall(a.mT, full_matrices, compute_uv)
    if not compute_uv:
        return a.new_zeros((0,)), result, a.new_zeros((0,))
    u, s, vh = result
    return vh.mT, s, u.mT


# -- the symmetric eigendecomposition: two-sided (classical) Jacobi ----------------------------------------------

def _jacobi_eigh(a):
    """(eigenvalues ascending, eigenvectors) of the symmetric a[..., n, n]."""
    n = a.shape[-1]
    x = _pad_even(a, [-2, -1])
    size = x.shape[-1]
    v = _pad_even(torch.eye(n, dtype=a.dtype, device=a.device).expand(a.shape), [-2, -1])
    position = list(range(size))
    move = _round_robin(size)
    h = size // 2
    for _ in range(sweeps(size)):
        for _ in range(size - 1):
            diagonal = torch.diagonal(x, 0, -2, -1)
            alpha, beta = diagonal[..., :h], diagonal[..., h:]
            gamma = torch.diagonal(x[..., :h, h:], 0, -2, -1)
            c, s = _rotation(alpha, beta, gamma)
            x = _rotate(_rotate(x, -1, c, s), -2, c, s)
            v = _rotate(v, -1, c, s)
            x, v = _take(_take(x, -1, move), -2, move), _take(v, -1, move)
            position = [position[k] for k in move]
    back = [position.index(k) for k in range(n)]
    values = _take(torch.diagonal(x, 0, -2, -1), -1, back)
    vectors = _take(v, -1, back)[..., :n, :]
    values, order = torch.sort(values, dim=-1)
    vectors = _order_columns(vectors, order)
    return values, vectors * _positive_largest(vectors)


def _symmetric(a, uplo: str):
    """The symmetric matrix of a's UPLO triangle (LAPACK reads only that one)."""
    lower = torch.tril(a) if uplo.upper() == "L" else torch.triu(a).mT
    return lower + torch.tril(lower, -1).mT


def _linalg_eigh(a, UPLO="L", compute_v=True):
    n = a.shape[-1]
    if a.numel() == 0:
        values = a.new_zeros(a.shape[:-1])
        return values, (a.new_zeros(a.shape) if compute_v else a.new_zeros((0,)))
    if n == 1:
        return a[..., 0] + 0, (torch.ones_like(a) if compute_v else a.new_zeros((0,)))
    values, vectors = _jacobi_eigh(_symmetric(a, UPLO))
    return values, (vectors if compute_v else a.new_zeros((0,)))


# -- the pseudo-inverse (ATen's linalg_pinv, whose tensor overload is not composite) --------------------------

def _linalg_pinv(a, *, atol=None, rtol=None, hermitian=False):
    m, n = a.shape[-2], a.shape[-1]
    if a.numel() == 0:
        return a.new_zeros(a.shape[:-2] + (n, m))
    zero = a.new_zeros(())
    atol_t = zero if atol is None else atol.to(a.dtype)
    if rtol is not None:
        rtol_t = rtol.to(a.dtype)
    else:
        default = torch.full((), torch.finfo(a.dtype).eps * max(m, n), dtype=a.dtype, device=a.device)
        rtol_t = default if atol is None else torch.where(atol > 0, zero, default)
    if not hermitian:
        u, s, vh = _linalg_svd(a, False)
        tol = torch.maximum(atol_t.unsqueeze(-1), rtol_t.unsqueeze(-1) * s[..., :1])
        inverse = torch.where(s > tol, s.reciprocal(), zero)
        return torch.matmul(vh.mT * inverse.unsqueeze(-2), u.mT)
    s, u = _linalg_eigh(a)
    magnitude = s.abs()
    tol = torch.maximum(atol_t.unsqueeze(-1), rtol_t.unsqueeze(-1) * magnitude.amax(-1, keepdim=True))
    inverse = torch.where(magnitude > tol, s.reciprocal(), zero)
    return torch.matmul(u * inverse.unsqueeze(-2), u.mT)


# -- histograms (ATen's histogramdd kernels, one dimension) ---------------------------------------------------

def _linspace_edges(left, right, count: int, dtype):
    """torch.linspace(left, right, count) as ATen's CPU kernel computes it: from both ends, halfway each."""
    left, right = left.to(dtype), right.to(dtype)
    step = (right - left) / (count - 1)
    index = torch.arange(count, device=left.device).to(dtype)
    from_right = torch.arange(count - 1, -1, -1, device=left.device).to(dtype)
    return torch.where(torch.arange(count, device=left.device) < count // 2, left + step * index,
                       right - step * from_right)


def _bin_counts(x, edges, position, weight):
    """hist[b] = the (weighted) number of elements at `position` b, elements outside [edges[0], edges[-1]] and NaN
    left out; the last bin holds its right edge. A dense one-hot: memory elements x bins."""
    bins = edges.shape[0] - 1
    inside = (x >= edges[0]) & (x <= edges[-1])
    position = torch.where(position >= bins, bins - 1, position)
    member = (position.unsqueeze(-1) == torch.arange(bins, device=x.device)) & inside.unsqueeze(-1)
    values = torch.ones_like(x) if weight is None else weight.reshape(-1).to(x.dtype)
    return torch.where(member, values.unsqueeze(-1), 0.0).sum(0)


def _outer_edges(x, low, high, widen: float):
    """(left, right) as 0-d tensors: the data's extremes when low == high (ATen reads them with .item()), widened
    by `widen` on each side if still equal."""
    if low == high and x.numel() > 0:
        left, right = x.min(), x.max()
    else:
        left, right = torch.scalar_tensor(low, dtype=x.dtype), torch.scalar_tensor(high, dtype=x.dtype)
    same = left == right
    return torch.where(same, left - widen, left), torch.where(same, right + widen, right)


def _histc(x, bins=100, min=0, max=0):
    """ATen's histc: bin = trunc((x - left) * bins / (right - left)), no search (LINEAR_INTERPOLATION)."""
    flat = x.reshape(-1)
    left, right = _outer_edges(flat, float(min), float(max), 1.0)
    edges = _linspace_edges(left, right, bins + 1, x.dtype)
    left, right = edges[0], edges[-1]
    position = ((flat - left) * float(bins) / (right - left)).clamp(min=0).to(torch.int64)
    return _bin_counts(flat, edges, position, None)


def _histogram_of_edges(x, edges, weight, density):
    flat = x.reshape(-1)
    position = (flat.unsqueeze(-1) >= edges).sum(-1) - 1  # upper_bound over the edges: the binary search's answer
    hist = _bin_counts(flat, edges, position, weight)
    if density:
        hist = hist / hist.sum() / (edges[1:] - edges[:-1])
    return hist, edges


def _histogram_bin_ct(x, bins=100, *, range=None, weight=None, density=False):
    """ATen's histogram of `bins` equal bins (LINEAR_INTERPOLATION_WITH_LOCAL_SEARCH: the division's guess
    corrected against the edges, i.e. the bin the edges say; computed here by counting edges <= x)."""
    flat = x.reshape(-1)
    low, high = (float(range[0]), float(range[1])) if range is not None else (0.0, 0.0)
    left, right = _outer_edges(flat, low, high, 0.5)
    return _histogram_of_edges(x, _linspace_edges(left, right, bins + 1, x.dtype), weight, density)


def _histogram_bins_tensor(x, bins, *, weight=None, density=False):
    return _histogram_of_edges(x, bins.to(x.dtype), weight, density)


OWN = {
    aten._linalg_svd.default: _linalg_svd,
    aten._linalg_eigh.default: _linalg_eigh,
    aten.linalg_pinv.atol_rtol_tensor: _linalg_pinv,
    aten.histc.default: _histc,
    aten.histogram.bin_ct: _histogram_bin_ct,
    aten.histogram.bins_tensor: _histogram_bins_tensor,
}
