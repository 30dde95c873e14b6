"""The SVD, symmetric eigendecomposition, pseudo-inverse, histograms, Householder QR, Cholesky solves and LDL^T
torch-mlir cannot lower, compiled with
neuronc's own lowerings (frontend/linalg_decompositions.py), strictly on the device, against eager on CPU.

Unique outputs (singular values, eigenvalues, pinv, rank, norms, histograms) are held to the fp32 tolerance.
Singular vectors and eigenvectors are unique only up to sign (and, for a repeated value, up to a rotation of its
space): they are held to what defines them (A = U diag(S) Vh, orthonormal columns), to eager's up to sign where
the value is simple, and to neuronc's documented sign convention."""
from __future__ import annotations

import pytest
import torch

from neuronc.frontend import linalg_decompositions
from neuronc.tolerances import TOLERANCES
from tests.conftest import run_compiled

pytestmark = pytest.mark.usefixtures("strictly_on_the_device")

FP32 = TOLERANCES[torch.float32]


def _generator():
    return torch.Generator().manual_seed(0)


def _rank_two(m, n, g):
    return torch.randn(m, 2, generator=g) @ torch.randn(2, n, generator=g)


def _batch_with_rank_deficient():
    """[3, 4, 3]: two random matrices and one of rank 2 (3 columns: an odd count, padded by a zero column)."""
    g = _generator()
    return torch.stack([torch.randn(4, 3, generator=g) * 3, _rank_two(4, 3, g), torch.randn(4, 3, generator=g)])


def _wide():
    return torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1))


def _two_columns():
    """[3, 3, 2]: two random matrices and one of rank 1. Two columns take one rotation (`sweeps(2)`): cheap to
    compile, for the values torch builds on the SVD (how the sweeps converge is checked above and below)."""
    g = torch.Generator().manual_seed(2)
    return torch.stack([torch.randn(3, 2, generator=g) * 3, torch.randn(3, 1, generator=g) @ torch.randn(1, 2, generator=g),
                        torch.randn(3, 2, generator=g)])


def _assert_orthonormal_columns(q):
    eye = torch.eye(q.shape[-1]).expand(q.shape[:-2] + (q.shape[-1], q.shape[-1]))
    torch.testing.assert_close(q.mT @ q, eye, rtol=0, atol=1e-5)


def _assert_sign_convention(vectors):
    """neuronc's convention: each column's largest-magnitude entry is positive."""
    at = vectors.abs().argmax(-2, keepdim=True)
    assert bool((torch.gather(vectors, -2, at) > 0).all())


def _assert_simple_columns_equal_up_to_sign(got, want, values, ordered_by):
    """|got| == |want| for the columns whose value is simple (away from its neighbours)."""
    gaps = torch.diff(values, dim=-1).abs()
    inf = torch.full(values.shape[:-1] + (1,), float("inf"))
    simple = torch.minimum(torch.cat([inf, gaps], -1), torch.cat([gaps, inf], -1)) > 1e-3 * ordered_by
    close = torch.isclose(got.abs(), want.abs(), **FP32).all(-2)
    assert bool(close[simple].all()), f"{int((~close & simple).sum())} simple columns differ beyond sign"


def _svd_cases(x, wide, y):
    """Every SVD case of this file in one program (one compile: the unrolled Jacobi sweeps make compiling the
    costly part): linalg.svd with full_matrices, torch.svd of a wide matrix, and the values built on the SVD
    (svdvals, matrix_rank, pinv, the 2- and nuclear norms, cond)."""
    return (torch.linalg.svd(x, full_matrices=True), torch.svd(wide),
            (torch.linalg.svdvals(y), torch.linalg.matrix_rank(y), torch.linalg.pinv(y),
             torch.linalg.matrix_norm(y, 2), torch.linalg.matrix_norm(y, "nuc"), torch.linalg.norm(y.mT, 2, (-2, -1)),
             torch.linalg.cond(y[..., :2, :])))


def _compiled_and_eager(fn, *inputs):
    """(compiled, eager) results of ``fn``, compiled strictly on the device (for module-scoped fixtures, which the
    function-scoped strict fixture does not reach)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION", "1")
        got = run_compiled(fn, *inputs)
    return got, fn(*inputs)


@pytest.fixture(scope="module")
def svd_cases():
    return _compiled_and_eager(_svd_cases, _batch_with_rank_deficient(), _wide(), _two_columns())


def test_svd_reconstructs_with_eagers_singular_values_and_vectors_up_to_sign(svd_cases):
    a = _batch_with_rank_deficient()
    (u, s, vh), (want_u, want_s, want_vh) = svd_cases[0][0], svd_cases[1][0]
    assert u.shape == want_u.shape and s.shape == want_s.shape and vh.shape == want_vh.shape
    torch.testing.assert_close(s, want_s, **FP32)
    torch.testing.assert_close(u[..., :3] * s.unsqueeze(-2) @ vh, a, rtol=0, atol=2e-5)
    _assert_orthonormal_columns(u)  # the full 4 x 4 U: completed past the rank and past n
    _assert_orthonormal_columns(vh.mT)
    _assert_sign_convention(vh.mT)
    scale = want_s[..., :1]
    _assert_simple_columns_equal_up_to_sign(vh.mT, want_vh.mT, want_s, scale)
    nonzero = (want_s > 1e-3 * scale)
    _assert_simple_columns_equal_up_to_sign(u[..., :3], torch.where(nonzero.unsqueeze(-2), want_u[..., :3], u[..., :3]),
                                            want_s, scale)


def test_svd_of_a_wide_matrix_and_torch_svd(svd_cases):
    a = _wide()
    (u, s, v), (want_u, want_s, _) = svd_cases[0][1], svd_cases[1][1]
    torch.testing.assert_close(s, want_s, **FP32)
    torch.testing.assert_close(u * s.unsqueeze(-2) @ v.mT, a, rtol=0, atol=2e-5)
    _assert_orthonormal_columns(u)
    _assert_orthonormal_columns(v)
    _assert_simple_columns_equal_up_to_sign(u, want_u, want_s, want_s[..., :1])


def test_values_built_on_the_svd_match_eager(svd_cases):
    """svdvals, matrix_rank, pinv, the 2- and nuclear norms, cond: unique, held to the fp32 tolerance."""
    got, want = svd_cases[0][2], svd_cases[1][2]
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
    torch.testing.assert_close(got[1], want[1])
    assert want[1].tolist() == [2, 1, 2]
    for g, w in zip(got[:1] + got[2:6], want[:1] + want[2:6]):
        torch.testing.assert_close(g, w, **FP32)
    torch.testing.assert_close(got[6][[0, 2]], want[6][[0, 2]], **FP32)  # cond of the rank-2 one: 1/rounding


def _with_a_repeated_eigenvalue():
    g = _generator()
    q, _ = torch.linalg.qr(torch.randn(2, 3, 3, generator=g))  # 3: an odd size, padded by a zero row and column
    values = torch.tensor([[1.0, 1.0, -2.0], [0.5, -4.0, 0.5]])
    a = q @ torch.diag_embed(values) @ q.mT
    return (a + a.mT) / 2


def _not_symmetric():
    return torch.randn(2, 2, generator=_generator())  # one rotation (`sweeps(2)`): cheap to compile


def _eigh_cases(a, x):
    """Every compiled eigh case of this file in one program: eigh of a matrix with a repeated eigenvalue, eigvalsh
    of each triangle of a matrix that is not symmetric, pinv and matrix_rank with hermitian=True."""
    s = x + x.mT
    return (torch.linalg.eigh(a), (torch.linalg.eigvalsh(x, UPLO="U"), torch.linalg.eigvalsh(x, UPLO="L"),
                                   torch.linalg.pinv(s, hermitian=True), torch.linalg.matrix_rank(s, hermitian=True)))


@pytest.fixture(scope="module")
def eigh_cases():
    return _compiled_and_eager(_eigh_cases, _with_a_repeated_eigenvalue(), _not_symmetric())


def test_eigh_with_a_repeated_eigenvalue(eigh_cases):
    a = _with_a_repeated_eigenvalue()
    (got_values, got_vectors), (want_values, want_vectors) = eigh_cases[0][0], eigh_cases[1][0]
    torch.testing.assert_close(got_values, want_values, **FP32)
    _assert_orthonormal_columns(got_vectors)
    _assert_sign_convention(got_vectors)
    torch.testing.assert_close(got_vectors * got_values.unsqueeze(-2) @ got_vectors.mT, a, rtol=0, atol=2e-5)
    _assert_simple_columns_equal_up_to_sign(got_vectors, want_vectors, want_values, want_values.abs().amax(-1, True))


def test_eigvalsh_reads_one_triangle_and_pinv_and_rank_of_a_hermitian_matrix(eigh_cases):
    got, want = eigh_cases[0][1], eigh_cases[1][1]
    assert not torch.equal(want[0], want[1])  # each UPLO reads its own triangle
    for g_, w in zip(got, want):
        torch.testing.assert_close(g_, w, **FP32)


def test_empty_matrices():
    a = torch.zeros(0, 5, 5)
    got = run_compiled(lambda x: (torch.linalg.svd(x), torch.linalg.eigh(x), torch.linalg.pinv(x) + 1), a)
    want = (torch.linalg.svd(a), torch.linalg.eigh(a), torch.linalg.pinv(a) + 1)
    for g, w in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
        assert g.shape == w.shape


def test_histograms_count_as_eager():
    g = _generator()
    x = torch.cat([torch.randn(40, generator=g) * 3, torch.tensor([float("nan"), 10.0, -10.0, 0.0, 2.0])])
    weight = torch.rand(45, generator=g)
    edges = torch.tensor([-3.0, -1.0, 0.0, 0.5, 4.0])

    def fn(t, w, e):
        return (torch.histc(t, 7, -2, 2), torch.histc(t.nan_to_num(), 5), *torch.histogram(t, 6, range=(-4.0, 4.0)),
                *torch.histogram(t, e, weight=w, density=True))

    got, want = run_compiled(fn, x, weight, edges), fn(x, weight, edges)
    for g_, w in zip(got, want):
        assert g_.shape == w.shape and g_.dtype == w.dtype
        torch.testing.assert_close(g_, w, **FP32)


@pytest.mark.parametrize("n", [3, 8, 16])
def test_the_unrolled_sweeps_converge_in_fp32_up_to_the_documented_size(n):
    """The decompositions run eagerly on CPU against LAPACK in fp64, on random, graded and rank-deficient
    matrices: the limit documented by `sweeps` (no compile, so the sizes are cheap). n = 3 (padded to 4) and 8: the
    largest sizes of 6 sweeps, odd and even; 16: the largest measured size. The 12 trials of a size run as 3
    batches (one per row count n, n + 1, n + 2): each matrix of a batch is rotated on its own."""
    g = _generator()
    for extra in range(3):
        trials = [trial for trial in range(12) if trial % 3 == extra]
        batch = []
        for trial in trials:
            a = torch.randn(n + extra, n, generator=g) * 5
            if trial % 3 == 1:
                a = a * torch.logspace(0, -4, n)
            if trial % 4 == 3:
                a = _rank_two(n + extra, n, g)
            batch.append(a)
        a = torch.stack(batch)
        _, s, _ = linalg_decompositions._linalg_svd(a, False, False)
        exact = torch.linalg.svdvals(a.double())
        assert float(((s.double() - exact).abs() / exact[:, :1]).max()) < 1e-5
        symmetric = a.mT @ a
        values, _ = linalg_decompositions._linalg_eigh(symmetric)
        exact = torch.linalg.eigvalsh(symmetric.double())
        assert float(((values.double() - exact).abs() / exact.abs().amax(-1, keepdim=True)).max()) < 1e-5


def _assert_all_close(got, want):
    for g_, w in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
        assert g_.shape == w.shape and g_.dtype == w.dtype
        if w.is_floating_point():
            torch.testing.assert_close(g_, w, **FP32)
        else:
            assert torch.equal(g_, w)


def test_householder_qr_geqrf_householder_product_and_ormqr_match_eager():
    """LAPACK's reflections are unique (dlarfg's sign convention): R, the packed vectors, tau and Q all equal
    eager's, every mode of linalg.qr, tall, wide and a column that is zero below the diagonal (tau = 0)."""
    g = _generator()
    tall = torch.randn(5, 3, generator=g)
    tall[2:, 1] = 0.0
    wide = torch.randn(2, 3, 4, generator=g)
    tau = torch.randn(3, generator=g)
    c = torch.randn(5, 2, generator=g)

    def fn(x, y, t, z):
        return (torch.geqrf(x), torch.linalg.qr(x), torch.linalg.qr(x, "complete"), torch.linalg.qr(y, "r")[1],
                torch.linalg.qr(y, "complete"), torch.linalg.householder_product(x, t),
                [torch.ormqr(x, t, z if left else z.mT, left, transpose) for left in (True, False)
                 for transpose in (True, False)])

    _assert_all_close(run_compiled(fn, tall, wide, tau, c), fn(tall, wide, tau, c))


def _needing_every_pivot():
    """[3, 5, 5] symmetric: small diagonals, a zero first diagonal, a zero row and column (2 x 2 blocks, 1 x 1
    interchanges, info set)."""
    g = _generator()
    a = torch.randn(3, 5, 5, generator=g)
    a = a + a.mT
    a[0, torch.arange(5), torch.arange(5)] *= 0.01
    a[1, 0, 0] = 0.0
    a[2, :, 2] = 0.0
    a[2, 2, :] = 0.0
    return a


def test_ldl_factor_pivots_as_lapack_eagerly():
    """The unrolled sytf2 run eagerly on CPU against LAPACK (no compile, so many matrices are cheap): pivots and
    info equal, LD within the fp32 tolerance, on random symmetric matrices of 2..8 with small diagonals."""
    g = _generator()
    blocks = 0
    for n in range(2, 9):
        a = torch.randn(40, n, n, generator=g)
        a = a + a.mT
        a[::2, torch.arange(n), torch.arange(n)] *= 0.01
        ld, pivots, info = linalg_decompositions._ldl_factor(a)
        want_ld, want_pivots, want_info = torch.linalg.ldl_factor_ex(a)
        assert torch.equal(pivots, want_pivots) and torch.equal(info, want_info)
        torch.testing.assert_close(ld, want_ld, rtol=1e-4, atol=1e-4)  # several pivoting steps of rounding
        blocks += int((want_pivots < 0).sum())
    assert blocks > 100  # 2 x 2 blocks were met


def test_ldl_factor_and_solve_and_cholesky_solves_match_eager():
    a = _needing_every_pivot()
    b = torch.randn(3, 5, 2, generator=_generator())
    spd = a[1] @ a[1].mT + torch.eye(5)
    factor = torch.linalg.cholesky(spd)

    def fn(x, y, f):
        ld, pivots, info = torch.linalg.ldl_factor_ex(x)
        return (ld, pivots, info, torch.linalg.ldl_solve(ld[:2], pivots[:2], y[:2]), torch.cholesky_solve(y, f),
                torch.cholesky_inverse(f.mT, upper=True))

    want = fn(a, b, factor)
    positive_moved = (want[1] > 0) & (want[1] != torch.arange(1, 6, dtype=torch.int32))
    assert (want[1] < 0).any() and positive_moved.any()  # 2 x 2 blocks and 1 x 1 interchanges are met
    assert want[2].tolist() == [0, 0, 3]  # the zero column sets info
    _assert_all_close(run_compiled(fn, a, b, factor), want)


def test_histogramdd_counts_as_eager():
    g = _generator()
    x = torch.cat([torch.randn(20, 2, generator=g), torch.tensor([[float("nan"), 0.0], [5.0, 5.0]])])
    weight = torch.rand(22, generator=g)
    edges = torch.tensor([-1.0, 0.0, 1.5])

    def fn(t, w, e):
        return (torch.histogramdd(t.nan_to_num(), [2, 3], weight=w, density=True),
                torch.histogramdd(t, [3, 2], range=[-2.0, 2.0, -1.0, 1.0]), torch.histogramdd(t, [e, e.flip(0)]))

    _assert_all_close(run_compiled(fn, x, weight, edges), fn(x, weight, edges))


def test_eig_of_a_general_matrix_is_refused_with_the_cause_and_the_way_out():
    with pytest.raises(Exception) as refused:
        run_compiled(lambda x: torch.linalg.eigvals(x), torch.randn(3, 3, generator=_generator()))
    text = str(refused.value)
    assert "NeuronCompileError" in text and "aten.linalg_eig.default" in text
    assert "torch.linalg.eigh" in text and "TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION" in text
