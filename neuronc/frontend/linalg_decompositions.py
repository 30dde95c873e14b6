"""neuronc's own lowerings of the iterative linear algebra torch-mlir cannot lower: the SVD (`_linalg_svd`, which
torch.svd, linalg.svd/svdvals, matrix_rank, cond and the 2/nuclear norms reach), the symmetric eigendecomposition
(`_linalg_eigh`: eigh, eigvalsh), the pseudo-inverse, histograms (histc, histogram, histogramdd), Householder QR
(geqrf, linalg.qr, householder_product, ormqr), Cholesky and triangular solves, LDL^T with Bunch-Kaufman pivoting
(ldl_factor, ldl_solve); `NOT_BUILT` says why eig of a general matrix is refused. Decompositions into
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


# -- Householder QR (LAPACK's geqrf / orgqr / ormqr): geqrf, householder_product, ormqr, linalg.qr -------------
# Unlike an iterative method these are exact sequences of min(m, n) reflections, unrolled; LAPACK's dlarfg
# convention (beta = -sign(alpha) ||x||, tau = (beta - alpha) / beta, v = x / (alpha - beta) below a unit
# diagonal, tau = 0 where the column below the diagonal is zero) makes every output unique, so R, the packed
# vectors, tau and Q match LAPACK's to rounding. Norms are sqrt of sums of squares (no dnrm2 scaling: values
# whose squares overflow fp32, |x| > ~1e19, are a documented limit).

def _reflector_vector(a, j: int):
    """v of the j-th reflector stored in a[..., :, j] (a unit at j, zeros above, a's entries below)."""
    rows = torch.arange(a.shape[-2], device=a.device)
    return torch.where(rows == j, 1.0, torch.where(rows > j, a[..., :, j], 0.0)).to(a.dtype)


def _reflect_left(c, v, tau):
    """H c with H = I - tau v v^T, v[..., m], c[..., m, r]."""
    w = (v.unsqueeze(-1) * c).sum(-2, keepdim=True)
    return c - tau[..., None, None] * v.unsqueeze(-1) * w


def _reflect_right(c, v, tau):
    """c H, c[..., r, m]."""
    w = (c * v.unsqueeze(-2)).sum(-1, keepdim=True)
    return c - tau[..., None, None] * w * v.unsqueeze(-2)


def _geqrf(a):
    m, n = a.shape[-2], a.shape[-1]
    k = min(m, n)
    if a.numel() == 0 or k == 0:
        return a + 0, a.new_zeros(a.shape[:-2] + (k,))
    rows, cols = torch.arange(m, device=a.device), torch.arange(n, device=a.device)
    taus = []
    for j in range(k):
        x = a[..., :, j]
        alpha = x[..., j]
        below = rows > j
        xnorm = torch.sqrt(torch.where(below, x * x, 0.0).sum(-1))
        trivial = xnorm == 0
        r = torch.sqrt(alpha * alpha + xnorm * xnorm)
        beta = torch.where(alpha >= 0, -r, r)
        tau = torch.where(trivial, 0.0, (beta - alpha) / torch.where(trivial, 1.0, beta))
        scale = 1.0 / torch.where(trivial, 1.0, alpha - beta)
        v = torch.where(rows == j, 1.0, torch.where(below, x * scale.unsqueeze(-1), 0.0))
        updated = _reflect_left(a, v, tau)
        column = torch.where(rows == j, torch.where(trivial, alpha, beta).unsqueeze(-1), torch.where(below, v, x))
        a = torch.where(cols == j, column.unsqueeze(-1), torch.where(cols > j, updated, a))
        taus.append(tau)
    return a, torch.stack(taus, -1)


def _householder_product(a, tau):
    """Q = H_1 ... H_k applied to the first n columns of the identity (orgqr), a[..., m, n], tau[..., k]."""
    m, n = a.shape[-2], a.shape[-1]
    batch = torch.broadcast_shapes(a.shape[:-2], tau.shape[:-1])
    q = torch.eye(m, n, dtype=a.dtype, device=a.device).expand(batch + (m, n)) + 0
    if q.numel() == 0:
        return q
    for j in reversed(range(tau.shape[-1])):
        q = _reflect_left(q, _reflector_vector(a, j), tau[..., j])
    return q


def _ormqr(a, tau, c, left=True, transpose=False):
    """Q c, Q^T c, c Q or c Q^T with Q = H_1 ... H_k of a's reflectors (ormqr)."""
    batch = torch.broadcast_shapes(a.shape[:-2], tau.shape[:-1], c.shape[:-2])
    c = c.expand(batch + c.shape[-2:]) + 0
    if c.numel() == 0:
        return c
    order = list(range(tau.shape[-1]))
    if left != transpose:  # Q c = H_1 (... (H_k c)); c Q^T = (c H_k) ... H_1
        order.reverse()
    reflect = _reflect_left if left else _reflect_right
    for j in order:
        c = reflect(c, _reflector_vector(a, j), tau[..., j])
    return c


def _linalg_qr(a, mode="reduced"):
    m, n = a.shape[-2], a.shape[-1]
    k = min(m, n)
    packed, tau = _geqrf(a)
    columns = m if mode == "complete" else k
    r = torch.triu(packed[..., :columns, :]) if packed.numel() else a.new_zeros(a.shape[:-2] + (columns, n))
    if mode == "r":
        return a.new_zeros((0,)), r
    if columns > n:  # complete with m > n: the reflectors' columns padded; tau has min(m, n) of them
        packed = torch.cat([packed, packed.new_zeros(packed.shape[:-1] + (columns - n,))], -1)
    return _householder_product(packed[..., :, :columns], tau), r


# -- Cholesky solves (cholesky_solve, cholesky_inverse): triangular substitutions ------------------------------

def _cholesky_solve(b, factor, upper=False):
    """X with A X = B, A = L L^T (or U^T U with upper): two substitutions."""
    from neuronc.frontend.decompositions import _substitute
    batch = torch.broadcast_shapes(b.shape[:-2], factor.shape[:-2])
    b, factor = b.expand(batch + b.shape[-2:]), factor.expand(batch + factor.shape[-2:])
    if b.numel() == 0:
        return b.new_zeros(b.shape)
    lower = factor.mT if upper else factor
    lower = torch.tril(lower)
    y = _substitute(lower, b, lower=True, unit=False)
    return _substitute(lower.mT, y, lower=False, unit=False)


def _triangular_solve(b, a, upper=True, transpose=False, unitriangular=False):
    """torch.triangular_solve (the older form of linalg.solve_triangular): X with A X = B (A^T X = B with
    transpose), reading only A's triangle, and A broadcast to the batch (LAPACK trtrs' "cloned coefficient")."""
    from neuronc.frontend.decompositions import _linalg_solve_triangular
    batch = torch.broadcast_shapes(b.shape[:-2], a.shape[:-2])
    a, b = a.expand(batch + a.shape[-2:]), b.expand(batch + b.shape[-2:])
    coefficients = a.mT if transpose else a
    solution = _linalg_solve_triangular(coefficients, b, upper=upper != transpose, unitriangular=unitriangular)
    return solution, a.clone()


def _cholesky_inverse(factor, upper=False):
    n = factor.shape[-1]
    identity = torch.eye(n, dtype=factor.dtype, device=factor.device).expand(factor.shape)
    return _cholesky_solve(identity, factor, upper)


# -- LDL^T with Bunch-Kaufman pivoting (LAPACK's sytf2, lower) and its solve (sytrs) -------------------------
# The pivoting is data-dependent (1 x 1 or 2 x 2 blocks, symmetric interchanges): unrolled over the n columns,
# each step computing both block forms and selecting by mask; a column that is the second of a 2 x 2 block is a
# step that does nothing. Pivots in LAPACK's format (from 1, negative for both columns of a 2 x 2 block), info
# the first zero column, as LAPACK's; the strict upper triangle zero, as torch's.

_BUNCH_KAUFMAN_ALPHA = (1.0 + math.sqrt(17.0)) / 8.0


def _mirror_lower(w):
    return torch.tril(w) + torch.tril(w, -1).mT


def _swap_order(n: int, i, j, device):
    """Index order exchanging positions i and j (i, j[...] int64): order[..., n]."""
    index = torch.arange(n, device=device)
    return torch.where(index == i.unsqueeze(-1), j.unsqueeze(-1), torch.where(index == j.unsqueeze(-1),
                                                                                i.unsqueeze(-1), index))


def _ldl_factor(a):
    n = a.shape[-1]
    batch = a.shape[:-2]
    rows = torch.arange(n, device=a.device)
    info = torch.zeros(batch, dtype=torch.int32, device=a.device)
    if a.numel() == 0:
        return a.new_zeros(a.shape), torch.zeros(batch + (n,), dtype=torch.int32, device=a.device), info
    w = _mirror_lower(a)  # the working matrix: symmetric in its trailing part, L's columns left of it
    skip = torch.zeros(batch, dtype=torch.bool, device=a.device)
    pivots, previous = [], None
    for k in range(n):
        active = ~skip
        absakk = w[..., k, k].abs()
        if k < n - 1:
            below = w[..., k + 1:, k].abs()
            colmax, at = below.max(-1)
            imax = at + (k + 1)
        else:
            colmax, imax = torch.zeros_like(absakk), torch.full(batch, k, dtype=torch.int64, device=a.device)
        zero = torch.maximum(absakk, colmax) == 0
        row = torch.gather(w, -2, imax[..., None, None].expand(batch + (1, n))).squeeze(-2)
        rowmax = torch.where((rows >= k) & (rows != imax.unsqueeze(-1)), row.abs(), 0.0).amax(-1)
        safe_rowmax = torch.where(rowmax > 0, rowmax, 1.0)
        keep = zero | (absakk >= _BUNCH_KAUFMAN_ALPHA * colmax) | \
            (absakk >= _BUNCH_KAUFMAN_ALPHA * colmax * (colmax / safe_rowmax))
        diagonal_at_imax = torch.gather(torch.diagonal(w, 0, -2, -1), -1, imax.unsqueeze(-1)).squeeze(-1).abs()
        swap_one = ~keep & (diagonal_at_imax >= _BUNCH_KAUFMAN_ALPHA * rowmax)
        two = active & ~keep & ~swap_one
        kk = torch.where(two, k + 1, k)
        kp = torch.where(keep | ~active, kk, imax)
        order = _swap_order(n, kk, kp, a.device)
        swapped = torch.gather(w, -2, order.unsqueeze(-1).expand(w.shape))
        swapped = torch.gather(swapped, -1, order.unsqueeze(-2).expand(w.shape))
        trailing = (rows.unsqueeze(-1) >= k) & (rows >= k)
        w = torch.where(trailing, swapped, w)
        # a 1 x 1 block at k
        d = w[..., k, k]
        d = torch.where(zero, 1.0, d)
        x = torch.where(rows > k, w[..., :, k], 0.0)
        one = w - x.unsqueeze(-1) * (x / d.unsqueeze(-1)).unsqueeze(-2)
        one = torch.where((rows.unsqueeze(-1) > k) & (rows == k), (x / d.unsqueeze(-1)).unsqueeze(-1), one)
        # a 2 x 2 block at k, k + 1
        if k < n - 1:
            d21 = w[..., k + 1, k]
            safe_d21 = torch.where(two, d21, 1.0)
            d11 = w[..., k + 1, k + 1] / safe_d21
            d22 = w[..., k, k] / safe_d21
            t = 1.0 / torch.where(two, d11 * d22 - 1.0, 1.0)
            d21 = t / safe_d21
            later = rows > k + 1
            ak, ak1 = torch.where(later, w[..., :, k], 0.0), torch.where(later, w[..., :, k + 1], 0.0)
            wk = d21.unsqueeze(-1) * (d11.unsqueeze(-1) * ak - ak1)
            wkp1 = d21.unsqueeze(-1) * (d22.unsqueeze(-1) * ak1 - ak)
            pair = w - (ak.unsqueeze(-1) * wk.unsqueeze(-2) + ak1.unsqueeze(-1) * wkp1.unsqueeze(-2))
            pair = torch.where(later.unsqueeze(-1) & (rows == k), wk.unsqueeze(-1), pair)
            pair = torch.where(later.unsqueeze(-1) & (rows == k + 1), wkp1.unsqueeze(-1), pair)
            step = torch.where(two[..., None, None], pair, one)
        else:
            step = one
        step = torch.where(zero[..., None, None], w, step)
        w = _mirror_lower(torch.where(active[..., None, None], step, w))
        info = torch.where((info == 0) & active & zero, k + 1, info)
        pivot = torch.where(two, -(kp + 1), kp + 1)
        pivot = pivot if previous is None else torch.where(skip, previous, pivot)
        pivots.append(pivot)
        previous = pivot
        skip = two
    return torch.tril(w), torch.stack(pivots, -1).to(torch.int32), info


def _linalg_ldl_factor_ex(a, *, hermitian=False, check_errors=False):
    return _ldl_factor(a)


def _rows_swapped(b, i, j):
    order = _swap_order(b.shape[-2], i, j, b.device)
    return torch.gather(b, -2, order.unsqueeze(-1).expand(b.shape))


def _linalg_ldl_solve(ld, pivots, b, *, hermitian=False):
    """sytrs (lower): L D L^T X = B with the interchanges in LAPACK's interleaved order."""
    batch = torch.broadcast_shapes(ld.shape[:-2], pivots.shape[:-1], b.shape[:-2])
    ld, b = ld.expand(batch + ld.shape[-2:]), b.expand(batch + b.shape[-2:]) + 0
    pivots = pivots.expand(batch + pivots.shape[-1:]).to(torch.int64)
    n = ld.shape[-1]
    if b.numel() == 0 or n == 0:
        return b.new_zeros(b.shape)
    rows = torch.arange(n, device=b.device)
    negative = pivots < 0
    starts, previous = [], torch.zeros(batch, dtype=torch.bool, device=b.device)
    for k in range(n):
        previous = negative[..., k] & ~previous
        starts.append(previous)
    second = [negative[..., k] & ~starts[k] for k in range(n)]
    target = torch.where(negative, -pivots, pivots) - 1
    for k in range(n):  # L D y = P b
        one = ~negative[..., k]
        kp = target[..., k]
        x = _rows_swapped(b, torch.full_like(kp, k), kp)
        x = x - torch.where(rows > k, ld[..., :, k], 0.0).unsqueeze(-1) * x[..., k:k + 1, :]
        d = torch.where(one, ld[..., k, k], 1.0)
        x = torch.where((rows == k).unsqueeze(-1), x / d[..., None, None], x)
        result = torch.where(one[..., None, None], x, b)
        if k < n - 1:
            y = _rows_swapped(b, torch.full_like(kp, k + 1), kp)
            later = (rows > k + 1).unsqueeze(-1)
            y = y - torch.where(later, ld[..., :, k:k + 1] * y[..., k:k + 1, :] + ld[..., :, k + 1:k + 2]
                                * y[..., k + 1:k + 2, :], 0.0)
            akm1k = torch.where(starts[k], ld[..., k + 1, k], 1.0)[..., None]
            akm1 = ld[..., k, k][..., None] / akm1k
            ak = ld[..., k + 1, k + 1][..., None] / akm1k
            denom = akm1 * ak - 1.0
            bkm1, bk = y[..., k, :] / akm1k, y[..., k + 1, :] / akm1k
            y = torch.where((rows == k).unsqueeze(-1), ((ak * bkm1 - bk) / denom).unsqueeze(-2), y)
            y = torch.where((rows == k + 1).unsqueeze(-1), ((akm1 * bk - bkm1) / denom).unsqueeze(-2), y)
            result = torch.where(starts[k][..., None, None], y, result)
        b = result
    for k in reversed(range(n)):  # L^T x = y, then the interchange
        kp = target[..., k]
        tail = torch.where(rows > k, 1.0, 0.0).to(b.dtype).unsqueeze(-1)
        x = b - torch.where((rows == k).unsqueeze(-1), (ld[..., :, k:k + 1] * tail * b).sum(-2, keepdim=True), 0.0)
        x = torch.where(second[k][..., None, None] & (rows == k - 1).unsqueeze(-1),
                        b - (ld[..., :, k - 1:k] * tail * b).sum(-2, keepdim=True), x) if k > 0 else x
        x = _rows_swapped(x, torch.full_like(kp, k), kp)
        b = torch.where(starts[k][..., None, None], b, x)
    return b


# -- histogramdd (ATen's histogramdd kernels, D dimensions) ---------------------------------------------------

def _dd_edges(x, bins, range_):
    """Each dimension's edges: linspace over range (or the data's extremes, widened by 0.5 if equal)."""
    flat = x.reshape(-1, x.shape[-1])
    edges = []
    for d, count in enumerate(bins):
        low, high = (float(range_[2 * d]), float(range_[2 * d + 1])) if range_ is not None else (0.0, 0.0)
        left, right = _outer_edges(flat[:, d], low, high, 0.5)
        edges.append(_linspace_edges(left, right, int(count) + 1, x.dtype))
    return edges


def _histogramdd_counts(x, edges, weight, density):
    flat = x.reshape(-1, x.shape[-1])
    sizes = [e.shape[0] - 1 for e in edges]
    total = math.prod(sizes)
    index = torch.zeros(flat.shape[0], dtype=torch.int64, device=x.device)
    inside = torch.ones(flat.shape[0], dtype=torch.bool, device=x.device)
    for d, e in enumerate(edges):
        column = flat[:, d]
        inside = inside & (column >= e[0]) & (column <= e[-1])
        position = (column.unsqueeze(-1) >= e).sum(-1) - 1
        position = torch.where(position >= sizes[d], sizes[d] - 1, position)
        index = index * sizes[d] + position.clamp(min=0)
    member = (index.unsqueeze(-1) == torch.arange(total, device=x.device)) & inside.unsqueeze(-1)
    values = torch.ones_like(flat[:, 0]) if weight is None else weight.reshape(-1).to(x.dtype)
    hist = torch.where(member, values.unsqueeze(-1), 0.0).sum(0).reshape(sizes)
    if density:
        hist = hist / hist.sum()
        for d, e in enumerate(edges):
            shape = [1] * len(sizes)
            shape[d] = sizes[d]
            hist = hist / (e[1:] - e[:-1]).reshape(shape)
    return hist


def _histogramdd_bin_edges(x, bins, *, range=None, weight=None, density=False):
    return _dd_edges(x, bins, range)


def _histogramdd_from_bin_cts(x, bins, *, range=None, weight=None, density=False):
    return _histogramdd_counts(x, _dd_edges(x, bins, range), weight, density)


def _histogramdd_from_bin_tensors(x, bins, *, weight=None, density=False):
    return _histogramdd_counts(x, [e.to(x.dtype) for e in bins], weight, density)


OWN = {
    aten._linalg_svd.default: _linalg_svd,
    aten._linalg_eigh.default: _linalg_eigh,
    aten.linalg_pinv.atol_rtol_tensor: _linalg_pinv,
    aten.histc.default: _histc,
    aten.histogram.bin_ct: _histogram_bin_ct,
    aten.histogram.bins_tensor: _histogram_bins_tensor,
    aten.geqrf.default: _geqrf,
    aten.linalg_householder_product.default: _householder_product,
    aten.ormqr.default: _ormqr,
    aten.linalg_qr.default: _linalg_qr,
    aten.cholesky_solve.default: _cholesky_solve,
    aten.cholesky_inverse.default: _cholesky_inverse,
    aten.triangular_solve.default: _triangular_solve,
    aten.linalg_ldl_factor_ex.default: _linalg_ldl_factor_ex,
    aten.linalg_ldl_solve.default: _linalg_ldl_solve,
    aten._histogramdd_bin_edges.default: _histogramdd_bin_edges,
    aten._histogramdd_from_bin_cts.default: _histogramdd_from_bin_cts,
    aten._histogramdd_from_bin_tensors.default: _histogramdd_from_bin_tensors,
}


_EIG = ("torch-mlir cannot lower it and neuronc has no lowering of its own: a general (non-symmetric) matrix's "
        "eigenvalues are complex, in the order LAPACK's shifted QR iteration (geev) deflates them, after a number "
        "of steps that depends on the data (not built, issue 21); for a symmetric matrix use torch.linalg.eigh / "
        "eigvalsh (compiled), else let this op run on the CPU (the fallback: unset "
        "TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION) or keep it outside the compiled region (torch.compiler.disable)")
NOT_BUILT = {  # op -> why it cannot be compiled and the way out, for ops of this family left unbuilt
    "aten.linalg_eig.default": _EIG,
}

