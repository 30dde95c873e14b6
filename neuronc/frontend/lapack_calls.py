"""JAX's LAPACK custom calls (`lapack_{s,d}<kernel>_ffi`, what jax.jit's CPU export makes of jnp.linalg and
jax.scipy.linalg) lowered with neuronc's own linear algebra: each kernel's operand / result contract written as a
function of ATen ops (the ones the PyTorch frontend lowers: LU with partial pivoting and Cholesky in
decompositions.py, Jacobi SVD / eigh and Householder QR in linalg_decompositions.py), lowered by
aten_lowering.lower_function and spliced into the imported graph.

The operand layouts JAX declares are column-major: the logical StableHLO tensor is the matrix LAPACK sees, so no
transpose is needed. Leading dimensions are batch dimensions (`num_batch_dims`). `info` is what LAPACK sets where
neuronc can say it: getrf's first zero pivot, potrf's first minor that is not positive definite; the Jacobi
syevd / gesdd report 0 (they have no failure to converge, only the documented size limit n <= 16,
linalg_decompositions.MAX_MEASURED_SIZE). Complex kernels (c, z) and the kernels below not in KERNELS are
refused."""
from __future__ import annotations

import re

import torch

from neuronc import ir
from neuronc.frontend import linalg_decompositions
from neuronc.isa import DType
from neuronc.ir import Op

aten = torch.ops.aten

_TARGET = re.compile(r"lapack_([sdcz])(\w+?)_ffi$")
_TORCH = {DType.F32: torch.float32, DType.F64: torch.float64}


def is_lapack(target: str) -> bool:
    return _TARGET.match(target) is not None


def _chars(config: str) -> dict:
    """The ui8 character attributes of `mhlo.backend_config` (uplo = 76 : ui8 -> {"uplo": "L"})."""
    return {key: chr(int(value)) for key, value in re.findall(r"(\w+) = (\d+) : ui8", config)}


def _getrf(config, a):
    """(LU, pivots from 1 as int32, info as int32): LAPACK's getrf, partial pivoting."""
    return aten.linalg_lu_factor_ex(a)


def _potrf(config, a):
    """(factor, info): the factor in the uplo triangle, the other triangle a's (LAPACK leaves it)."""
    upper = config.get("uplo", "L") == "U"
    factor, info = aten.linalg_cholesky_ex(a, upper=upper)
    n = a.shape[-1]
    keep = torch.ones(n, n, dtype=torch.bool).triu(1) if not upper else torch.ones(n, n, dtype=torch.bool).tril(-1)
    return torch.where(keep, a, factor), info


def _trsm(config, a, b):
    """X with op(A) X = B (side L) or X op(A) = B (side R), op(A) = A or A^T (trans_x T or C: real here), only A's
    uplo triangle read, a unit diagonal assumed with diag U."""
    upper = config.get("uplo", "L") == "U"
    if config.get("trans_x", "N") != "N":
        a, upper = a.mT, not upper
    return (aten.linalg_solve_triangular(a, b, upper=upper, left=config.get("side", "L") == "L",
                                         unitriangular=config.get("diag", "N") == "U"),)


def _geqrf(config, a):
    """(reflectors packed below R, tau)."""
    return linalg_decompositions._geqrf(a)


def _orgqr(config, a, tau):
    """Q's first n columns from the reflectors (a[..., m, n], tau[..., k])."""
    return (aten.linalg_householder_product(a, tau),)


def _syevd(config, a):
    """(eigenvectors as columns, eigenvalues ascending, info): the uplo triangle read."""
    values, vectors = aten._linalg_eigh(a, config.get("uplo", "L"), True)
    return vectors, values, _zero_info(a)


def _gesdd(config, a):
    """(a's overwritten storage, s descending, U, V^T, info); mode A: full U and V^T, S: reduced, N: none (JAX
    reads only s; U and V^T are zeros of the shapes it declares, which differ between its callers: config's
    "results")."""
    mode = config.get("mode", "A")
    if mode == "N":
        s = aten._linalg_svd(a, False, False)[1]
        u_shape, vh_shape = config["results"][2:4]
        return a + 0, s, a.new_zeros(u_shape), a.new_zeros(vh_shape), _zero_info(a)
    u, s, vh = aten._linalg_svd(a, mode == "A", True)
    return a + 0, s, u, vh, _zero_info(a)


def _zero_info(a):
    return torch.zeros(a.shape[:-2], dtype=torch.int32)


KERNELS = {  # LAPACK kernel -> its lowering (config, *operands) -> results
    "getrf": _getrf, "potrf": _potrf, "trsm": _trsm, "geqrf": _geqrf, "orgqr": _orgqr, "syevd": _syevd,
    "gesdd": _gesdd, "gesvd": _gesdd,
}


def refusal(target: str, inputs: list) -> str | None:
    """Why the LAPACK call `target` cannot be lowered, or None."""
    kind, kernel = _TARGET.match(target).groups()
    if kind in "cz":
        return (f"custom call {target}: complex LAPACK kernels are not lowered (neuronc's linear algebra is real: "
                f"use a real (float32 / float64) matrix, or run this part with jax.jit on the CPU)")
    if kernel not in KERNELS:
        return (f"custom call {target}: LAPACK's {kernel} has no lowering in neuronc (lowered: "
                f"{', '.join(sorted(KERNELS))}; eig, schur, hessenberg, tridiagonal and qr with pivoting are not); "
                f"run this part with jax.jit on the CPU")
    if any(x.dtype not in _TORCH for x in inputs if x.dtype.is_float):
        return f"custom call {target} on {[x.dtype.name for x in inputs]}"
    return None


def layout_refusal(target: str, layouts: str, batch_dims: int, inputs: list) -> str | None:
    """None when every operand has the layout JAX declares (`operand_layouts`, minor to major): a matrix (its
    `batch_dims` leading dimensions, then two) column-major, [rank - 2, rank - 1, batch dims from the last], so the
    logical matrix is the one LAPACK reads; a vector (tau, a batch of them) its last dimension minor."""
    found = [[int(d) for d in re.findall(r"\d+", dims)] for dims in re.findall(r"dense<([^>]*)>", layouts)]
    for x, layout in zip(inputs, found):
        rank = len(x.shape)
        batch = list(range(min(batch_dims, rank) - 1, -1, -1))
        want = [rank - 2, rank - 1] + batch if rank - batch_dims == 2 else list(range(rank - 1, -1, -1))
        if layout != want:
            return f"custom call {target} with an operand layout {layout} (JAX declares {want})"
    return None


def lowered(target: str, config: str, inputs: list, results: list, loc) -> tuple:
    """The nodes of the call's results (`results`: their (shape, dtype)), the kernel's graph spliced in."""
    from neuronc.frontend.aten_lowering import lower_function

    kernel = KERNELS[_TARGET.match(target).group(2)]
    chars = {**_chars(config), "results": [tuple(shape) for shape, _ in results]}
    examples = [torch.empty(x.shape, dtype=_TORCH.get(x.dtype, torch.int32), device="meta") for x in inputs]
    def function(*operands):
        with torch._C._AutoDispatchBelowADInplaceOrView():  # (the decompositions are called as from a dispatch)
            return kernel(chars, *operands)

    graph = lower_function(function, examples, target)
    outputs = _spliced(graph, inputs, loc)
    done = []
    for node, (shape, dtype) in zip(outputs, results):
        if node.dtype != dtype:
            node = ir.node(Op.CONVERT, [node], node.shape, dtype, loc)
        if tuple(node.shape) != tuple(shape):
            raise AssertionError(f"{target}: a result of shape {node.shape}, declared {shape}")
        done.append(node)
    return tuple(done)


def _spliced(graph: ir.Graph, inputs: list, loc) -> list:
    """graph's outputs computed from `inputs` in place of its params, every new node at `loc`."""
    given = dict(zip(graph.params, inputs))

    def substitute(node, new_inputs):
        if node in given:
            return given[node]
        new = ir.with_inputs(node, new_inputs)
        new.loc = loc
        return new

    return graph.rewrite(substitute).outputs
