"""Ops torch-mlir cannot lower, compiled with neuronc's own lowerings (frontend/decompositions.py, and the product
tree of stablehlo_import.py), each against eager PyTorch on CPU at the fp32 tolerance: found missing by
benchmarks/opinfo.py (issue 21). Special functions are checked over wide ranges, poles and signs included."""
from __future__ import annotations

import pytest
import torch

from neuronc.tolerances import TOLERANCES
from tests.conftest import assert_matches_eager, run_compiled

pytestmark = pytest.mark.usefixtures("strictly_on_the_device")


def _matches_eager(fn, *inputs):
    """Each output has eager's shape and dtype, within the fp32 tolerance, NaN exactly where eager's is."""
    got, want = run_compiled(fn, *inputs), fn(*inputs)
    got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, f"{g.dtype}{list(g.shape)} != eager {w.dtype}{list(w.shape)}"
        torch.testing.assert_close(g, w, equal_nan=True, **TOLERANCES[w.dtype])


@pytest.fixture
def x():
    return torch.randn(4, 5, 6, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("offset, dims", [(0, (0, 1)), (2, (1, 2)), (-1, (2, 0)), (-3, (0, 2))])
def test_diagonal_is_a_strided_slice(x, offset, dims):
    _matches_eager(lambda t: torch.diagonal(t, offset, *dims), x)


def test_diagonal_past_the_matrix_is_empty(x):
    _matches_eager(lambda t: torch.diagonal(t, 7, 1, 2) + 1, x)


def _gradient(fn, t, weights):
    t = t.clone().requires_grad_(True)
    (fn(t) * weights).sum().backward()
    return t.grad


def test_diagonal_gradient_lands_on_the_diagonal(x):
    diagonal = lambda t: torch.diagonal(t, 1, 1, 2)  # noqa: E731 - the op under test
    weights = torch.randn(4, 5)
    torch._dynamo.reset()
    assert_matches_eager(_gradient(torch.compile(diagonal, backend="neuron"), x, weights),
                         _gradient(diagonal, x, weights))


def test_diagonal_scatter_writes_only_the_diagonal(x):
    _matches_eager(lambda t, s: torch.diagonal_scatter(t, s, -1, 0, 1), x, torch.randn(6, 3))


@pytest.mark.parametrize("dim, size, step", [(0, 2, 1), (1, 3, 2), (-1, 6, 1), (2, 1, 4)])
def test_unfold_stacks_strided_windows(x, dim, size, step):
    _matches_eager(lambda t: t.unfold(dim, size, step), x)


def test_unfold_gradient_sums_overlapping_windows(x):
    unfold = lambda t: t.unfold(1, 3, 2)  # noqa: E731 - the op under test
    weights = torch.randn(4, 2, 6, 3)
    torch._dynamo.reset()
    assert_matches_eager(_gradient(torch.compile(unfold, backend="neuron"), x, weights), _gradient(unfold, x, weights))


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_cumprod_is_a_running_product(x, dim):
    _matches_eager(lambda t: torch.cumprod(t, dim), x * 0.5 + 1)


def test_cumprod_of_integers_is_int64_like_eager():
    _matches_eager(lambda t: torch.cumprod(t, 0), torch.tensor([3, -2, 5, 1, 7], dtype=torch.int32))


@pytest.mark.parametrize("dims", [None, 0, 1, (0, 2)])
def test_prod_is_a_tree_of_multiplications(x, dims):
    t = x * 0.3 + 1
    if dims is None:
        _matches_eager(lambda a: a.prod(), t)
    elif isinstance(dims, int):
        _matches_eager(lambda a: a.prod(dims, keepdim=True), t)
    else:
        _matches_eager(lambda a: torch.prod(a.prod(dims[1]), dims[0]), t)


@pytest.mark.parametrize("name", ["cummax", "cummin"])
def test_cummax_and_cummin_take_the_latest_of_ties(name):
    t = torch.tensor([[1.0, 3.0, 3.0, 0.0, 5.0, 5.0, -1.0], [2.0, 2.0, 1.0, 1.0, 0.0, 4.0, 4.0]])
    _matches_eager(lambda a: getattr(torch, name)(a, 1), t)


def test_fmax_and_fmin_broadcast_and_skip_nans():
    a = torch.tensor([[1.0], [float("nan")], [-2.0]])
    b = torch.tensor([0.5, float("nan"), 3.0, -4.0])
    _matches_eager(lambda p, q: (torch.fmax(p, q), torch.fmin(p, q)), a, b)


def test_max_over_a_dim_of_a_scalar_is_the_scalar_at_index_zero():
    _matches_eager(lambda a: torch.max(a, 0), torch.tensor(2.5))


def test_empty_compiles_and_has_its_shape_and_dtype(x):
    got = run_compiled(lambda t: torch.empty(3, 4, dtype=torch.int32).fill_(2) + t.shape[0], x)
    assert_matches_eager(got, torch.full((3, 4), 6, dtype=torch.int32))


@pytest.mark.parametrize("reduce", ["sum", "prod", "mean", "amax", "amin"])
@pytest.mark.parametrize("include_self", [True, False])
def test_scatter_reduce_modes(reduce, include_self):
    g = torch.Generator().manual_seed(1)
    base, src = torch.randn(3, 5, generator=g), torch.randn(2, 6, generator=g)
    index = torch.tensor([[0, 4, 0, 2, 4, 0], [1, 1, 3, 3, 1, 0]])  # column 2 of row 1 gets nothing
    _matches_eager(lambda b, s: b.scatter_reduce(1, index, s, reduce, include_self=include_self), base, src)


@pytest.mark.parametrize("accumulate", [False, True])
def test_a_boolean_mask_writes_one_value_where_it_is_true(accumulate):
    """x[mask] = v (index_put with a bool index): elementwise, whatever the mask holds; a mask of leading dims too."""
    x = torch.randn(6, 5)
    value = torch.tensor(2.5)
    _matches_eager(lambda t: t.index_put((t > 0,), value, accumulate=accumulate), x)
    _matches_eager(lambda t: t.index_put((t[:, 0] > 0,), value, accumulate=accumulate), x)
    _matches_eager(lambda t: t.long().index_put((t > 0,), torch.tensor(7), accumulate=accumulate), x)


@pytest.mark.parametrize("reduce", ["prod", "mean", "amax", "amin"])
def test_index_reduce_modes(reduce):
    g = torch.Generator().manual_seed(2)
    base, source = torch.randn(4, 3, generator=g), torch.randn(5, 3, generator=g)
    index = torch.tensor([0, 2, 0, 3, 2])
    _matches_eager(lambda b, s: b.index_reduce(0, index, s, reduce), base, source)


_WIDE = torch.cat([torch.linspace(-30, 30, 241), torch.tensor([1e-4, 0.5, 1.0, 2.0, 1.4616, 35.0, 200.0, 1e4])])


@pytest.mark.parametrize("name, inputs", [
    ("erfc", torch.linspace(-6, 9, 151)),
    ("lgamma", torch.cat([_WIDE + 0.25, torch.tensor([0.0, -1.0, -7.0, float("inf"), float("-inf")])])),
    ("digamma", torch.cat([_WIDE + 0.25, torch.tensor([0.0, -0.0, -1.0, -3.0, float("inf")])])),
])
def test_special_functions_match_eager_over_wide_ranges(name, inputs):
    _matches_eager(getattr(torch, name), inputs)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_polygamma_matches_eager_over_wide_ranges(n):
    inputs = torch.cat([torch.linspace(-8.65, 30.35, 131), torch.tensor([1e-3, 0.5, 1.0, 3.0, 100.0])])
    _matches_eager(lambda t: torch.polygamma(n, t), inputs)


@pytest.mark.parametrize("n, sign", [(1, 1), (2, -1), (3, 1)])
def test_polygamma_is_infinite_at_its_poles(n, sign):
    """Where eager's trigamma returns pi^2 / sin(pi x)^2 of a rounded pi x (3.2e14 at -2), the pole is kept."""
    poles = torch.tensor([0.0, -1.0, -2.0, -5.0])
    assert torch.equal(run_compiled(lambda t: torch.polygamma(n, t), poles), torch.full((4,), sign * float("inf")))


@pytest.mark.parametrize("name", ["bessel_j0", "bessel_j1", "bessel_y0", "bessel_y1", "modified_bessel_i0",
                                  "modified_bessel_i1", "modified_bessel_k0", "modified_bessel_k1",
                                  "scaled_modified_bessel_k0", "scaled_modified_bessel_k1", "spherical_bessel_j0",
                                  "i1", "i1e", "i0e"])
def test_bessel_functions_match_eager_over_wide_ranges(name):
    """Every branch of ATen's forms: the series near 0, each side of the switch (2, 5, 8), the asymptotic form
    far out, overflow, +-inf, NaN, and the pole or NaN of K and Y at and below 0."""
    edges = [0.0, 1e-6, 0.499, 0.5, -0.5, 1.999, 2.0, 2.001, 4.999, 5.0, 5.001, -5.0, 7.999, 8.0, 8.001, 1e4]
    inputs = torch.cat([torch.linspace(-60, 60, 481), torch.tensor(edges + [float("inf"), float("-inf"), float("nan")])])
    _matches_eager(getattr(torch.special, name), inputs)


@pytest.mark.parametrize("reduce", ["sum", "mean", "prod", "max", "min"])
@pytest.mark.parametrize("initial", [None, 2.0])
def test_segment_reduce_over_lengths_and_offsets_with_empty_segments(reduce, initial):
    data = torch.randn(6, 3, generator=torch.Generator().manual_seed(3))
    data[3, 1] = float("nan")  # propagates through its segment as in eager
    lengths = torch.tensor([2, 0, 3, 1, 0])
    offsets = torch.cat([torch.zeros(1, dtype=lengths.dtype), lengths.cumsum(0)])
    _matches_eager(lambda d, n: torch.segment_reduce(d, reduce, lengths=n, initial=initial), data, lengths)
    _matches_eager(lambda d, o: torch.segment_reduce(d, reduce, offsets=o, initial=initial), data, offsets)


def test_segment_reduce_along_an_inner_axis():
    data = torch.randn(2, 6, 3, generator=torch.Generator().manual_seed(4))
    lengths = torch.tensor([[1, 2, 3], [0, 6, 0]])
    _matches_eager(lambda d, n: torch.segment_reduce(d, "mean", lengths=n, axis=1, initial=1.0), data, lengths)


@pytest.mark.parametrize("name, fn", [
    ("argmax", lambda t: torch.argmax(t, 1)), ("argmin", lambda t: torch.argmin(t, 1, keepdim=True)),
    ("max.dim", lambda t: torch.max(t, 1)), ("min of where of scalars", lambda t: torch.where(t > 0, 0, 1).amin(1)),
])
def test_index_reductions_over_a_dim_of_one_find_index_0(name, fn):
    """The iota of a size-1 dim folds to the constant 0: its select of two scalars once shared one tile (gave 1)."""
    _matches_eager(fn, torch.randn(3, 1, generator=torch.Generator().manual_seed(5)))


def test_a_row_softmax_of_a_select_of_two_scalars():
    _matches_eager(lambda t: torch.softmax(torch.where(t > 0, 0.5, 2.0), -1), torch.randn(4, 8))


@pytest.mark.parametrize("name, fn", [
    ("sum", lambda t: t.sum(0, keepdim=True)), ("mean", lambda t: t.mean(-1)), ("nanmean", lambda t: t.nanmean(0)),
    ("amax", lambda t: t.amax(0, keepdim=True)), ("argmax", lambda t: t.argmax(0, keepdim=True)),
    ("var", lambda t: t.var(0)), ("std_mean", lambda t: torch.std_mean(t, [0], correction=0, keepdim=True)),
    ("count", lambda t: (t > 0).sum(0)), ("logsumexp", lambda t: t.logsumexp(0, keepdim=True)),
])
def test_reductions_over_dim_0_of_a_scalar(name, fn):
    """torch-mlir crashes on these (SIGSEGV): they reduce the scalar as a 1-element vector."""
    _matches_eager(fn, torch.tensor(1.5))


@pytest.mark.parametrize("name, fn, shapes", [
    ("mm", lambda a, b: a @ b.mT, [(3, 0), (4, 0)]),  # linalg.pinv.singular's first sample: pinv(a @ b.mT)
    ("bmm", torch.bmm, [(2, 3, 0), (2, 0, 5)]),
    ("addmm", lambda c, a, b: torch.addmm(c, a, b), [(3, 5), (3, 0), (0, 5)]),
])
def test_a_product_over_an_empty_dimension_is_zero(name, fn, shapes):
    """The sum of nothing: the kernel accumulated no tile into PSUM and read it unwritten (refused at load)."""
    inputs = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(shapes)]
    _matches_eager(fn, *inputs)


@pytest.fixture
def signed_specials():
    """Values whose sign only the bits tell (-0.0, -NaN) among ordinary ones, over more than one tile."""
    t = torch.randn(300, 700, generator=torch.Generator().manual_seed(1))
    t[0, :6] = torch.tensor([-0.0, 0.0, float("nan"), -float("nan"), float("inf"), -float("inf")])
    return t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_signbit_reads_the_sign_bit_of_zeros_and_nans(signed_specials, dtype):
    _matches_eager(torch.signbit, signed_specials.to(dtype))


def test_copysign_takes_the_sign_bit_of_negative_zero(signed_specials):
    _matches_eager(torch.copysign, signed_specials.flip(1), signed_specials)


@pytest.mark.parametrize("src, dst", [(torch.float32, torch.int32), (torch.int32, torch.float32),
                                      (torch.bfloat16, torch.float16)])
def test_a_view_as_another_dtype_of_its_width_keeps_the_bytes(signed_specials, src, dst):
    x = signed_specials[:4].to(src) if src.is_floating_point else signed_specials[:4].view(torch.int32)
    _matches_eager(lambda t: t.view(dst) + 1 if dst == torch.int32 else t.view(dst) * 2, x)


POLYNOMIALS = [f"{shifted}chebyshev_polynomial_{kind}" for kind in "tuvw" for shifted in ("", "shifted_")] + [
    "hermite_polynomial_h", "hermite_polynomial_he"]


@pytest.fixture
def polynomial_grid():
    """x at the branch points of ATen's forms (+-1, 0, |x| just past 1, large, +-inf) against degrees at theirs
    (negative, fractional, the closed-form thresholds, the unrolled steps' end, Hermite's limit of 128, large,
    non-finite, beyond int64). Not x = NaN: ATen's U, V, W return an uninitialised variable there (its loop
    stops at once on NaN and returns `r` unset: values like 7.8e-30 in eager); neuronc gives NaN (tested apart)."""
    nan, inf = float("nan"), float("inf")
    xs = torch.tensor([0.0, 1.0, -1.0, 0.5, -0.5, 0.999, -0.999, 1.0001, -1.0001, 1.5, -1.5, 3.0, -10.0, 1e5, -1e5,
                       1e30, inf, -inf, 0.25, 0.75, 1 - 2 ** -24])
    ns = torch.tensor([-3.0, -0.5, 0.0, 0.7, 1.0, 2.0, 3.0, 5.0, 6.0, 7.0, 8.0, 9.0, 12.0, 16.0, 17.0, 18.0, 25.0,
                       40.0, 100.0, 127.0, 128.0, 129.0, 1000.0, inf, -inf, nan, 1e19])
    return torch.meshgrid(xs, ns, indexing="ij")


@pytest.mark.parametrize("name", POLYNOMIALS)
def test_orthogonal_polynomial_lowering_follows_atens_branches(polynomial_grid, name):
    """neuronc's decomposition, run op by op in eager, against ATen's kernel: recurrence, closed forms, limits."""
    from neuronc.frontend.decompositions import OWN
    op = getattr(torch.ops.aten, f"special_{name}").default
    x, n = polynomial_grid
    torch.testing.assert_close(OWN[op](x, n), op(x, n), equal_nan=True, **TOLERANCES[torch.float32])


@pytest.mark.parametrize("name", POLYNOMIALS)
def test_orthogonal_polynomial_of_nan_is_nan(name):
    from neuronc.frontend.decompositions import OWN
    op = getattr(torch.ops.aten, f"special_{name}").default
    assert OWN[op](torch.tensor([float("nan")] * 3), torch.tensor([0.0, 5.0, 1000.0]))[1:].isnan().all()


def test_orthogonal_polynomials_compile_on_the_device(polynomial_grid):
    """Degrees as a tensor (a data-dependent trip count for ATen's loop): the unrolled recurrence, the
    trigonometric and hyperbolic forms and Hermite's 128 steps, compiled in one graph."""
    x, n = polynomial_grid
    n = n.clamp(max=1000.0)  # cos(n acos x) at n = 1e6 amplifies one ulp of acos past the tolerance, in both
    _matches_eager(lambda a, b: (torch.special.chebyshev_polynomial_t(a, b),
                                 torch.special.shifted_chebyshev_polynomial_w(a, b),
                                 torch.special.hermite_polynomial_h(a, b)), x, n)


BOUNDED_POLYNOMIALS = ["laguerre_polynomial_l", "legendre_polynomial_p"]


@pytest.mark.parametrize("name", BOUNDED_POLYNOMIALS)
def test_laguerre_and_legendre_lowering_follows_atens_recurrence_to_degree_128(polynomial_grid, name):
    """The same grid as the other polynomials' but for the degrees past 128 (tested apart): x = 0 and |x| = 1
    (ATen's special cases), large and infinite x, negative, fractional and non-finite degrees."""
    from neuronc.frontend.decompositions import OWN
    op = getattr(torch.ops.aten, f"special_{name}").default
    x, n = polynomial_grid
    kept = ~((n > 128) & n.isfinite() & (n < 1e19))  # 129 and 1000: NaN by design (next test); 1e19 is < 0 in int64
    torch.testing.assert_close(OWN[op](x[kept], n[kept]), op(x[kept], n[kept]), equal_nan=True,
                               **TOLERANCES[torch.float32])


@pytest.mark.parametrize("name", BOUNDED_POLYNOMIALS)
def test_laguerre_and_legendre_past_degree_128_are_nan_not_a_wrong_number(name):
    from neuronc.frontend.decompositions import OWN
    op = getattr(torch.ops.aten, f"special_{name}").default
    assert OWN[op](torch.tensor([0.3, -0.7]), torch.tensor([129.0, 1000.0])).isnan().all()


def test_laguerre_and_legendre_polynomials_compile_on_the_device(polynomial_grid):
    x, n = polynomial_grid
    n = n.clamp(max=128.0)
    _matches_eager(lambda a, b: (torch.special.laguerre_polynomial_l(a, b),
                                 torch.special.legendre_polynomial_p(a, b)), x, n)


def _matrices(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _singular():
    """A zero column at the second step (info = 2 in LAPACK) and a repeated row."""
    a = _matrices(2, 4, 4, seed=3)
    a[0, :, 1] = 0.0
    a[1, 2] = a[1, 0]
    return a


LU_INPUTS = {"square": lambda: _matrices(4, 4), "batched": lambda: _matrices(2, 3, 5, 5), "wide": lambda: _matrices(3, 5),
             "tall": lambda: _matrices(2, 5, 3), "one": lambda: _matrices(1, 1), "empty": lambda: _matrices(0, 0),
             "empty batch": lambda: _matrices(0, 3, 3), "singular": _singular,
             "large and tiny": lambda: _matrices(4, 4) * torch.tensor([1e30, 1.0, 1e-30, 1.0])}


@pytest.mark.parametrize("name", LU_INPUTS)
def test_lu_factor_pivots_as_lapack(name):
    """LU, pivots and info as LAPACK's getrf (the first largest |a| of the column is the pivot), and lu's P, L, U."""
    from neuronc.frontend.decompositions import OWN
    aten, a = torch.ops.aten, LU_INPUTS[name]()
    for op in (aten.linalg_lu_factor_ex.default, aten.linalg_lu.default):
        for got, want in zip(OWN[op](a), op(a)):
            assert got.dtype == want.dtype
            torch.testing.assert_close(got, want, equal_nan=True)


@pytest.mark.parametrize("name", [n for n in LU_INPUTS if n not in ("wide", "tall")])
def test_det_slogdet_inv_solve_on_lu(name):
    from neuronc.frontend.decompositions import OWN
    aten, a = torch.ops.aten, LU_INPUTS[name]()
    b = _matrices(*a.shape[:-1], 2, seed=1)
    cases = [(aten._linalg_det.default, (a,), {}), (aten._linalg_slogdet.default, (a,), {}),
             (aten.linalg_inv_ex.default, (a,), {}), (aten._linalg_solve_ex.default, (a, b), {}),
             (aten._linalg_solve_ex.default, (a, b.mT), {"left": False}),
             (aten._linalg_solve_ex.default, (a, b[..., 0]), {})]  # a vector right-hand side
    for op, args, kwargs in cases:
        outputs = list(zip(OWN[op](*args, **kwargs), op(*args, **kwargs)))
        if name == "singular" and op in (aten.linalg_inv_ex.default, aten._linalg_solve_ex.default):
            # of a singular matrix, the solution is what each left of its partial work: only info is a contract
            outputs = [(got, want) for got, want in outputs if want.dtype == torch.int32]
            assert outputs and outputs[-1][1].tolist() == [2, 4]  # the repeated row leaves a zero last pivot
        elif name == "singular":
            # the determinant is 0 (to rounding); LU, pivots, sign and log|det| past the exactly dependent row are
            # rounding noise, which differs between LAPACK builds (MKL's AVX-512 path leaves a pivot of -2.5e-8
            # where ours is 0): the contract is the determinant, sign * exp(log|det|) for slogdet
            got, want = OWN[op](*args, **kwargs), op(*args, **kwargs)
            outputs = [(got[0], want[0])] if op == aten._linalg_det.default else \
                [(got[0] * got[1].exp(), want[0] * want[1].exp())]
        for got, want in outputs:
            torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("left, adjoint", [(True, False), (True, True), (False, False), (False, True)])
def test_lu_solve_and_unpack(left, adjoint):
    from neuronc.frontend.decompositions import OWN
    aten, a = torch.ops.aten, _matrices(2, 5, 5)
    b = _matrices(2, 5, 3, seed=1) if left else _matrices(2, 3, 5, seed=1)
    lu, pivots, _ = aten.linalg_lu_factor_ex(a)
    torch.testing.assert_close(OWN[aten.linalg_lu_solve.default](lu, pivots, b, left=left, adjoint=adjoint),
                               aten.linalg_lu_solve(lu, pivots, b, left=left, adjoint=adjoint), rtol=1e-4, atol=1e-4)
    for got, want in zip(OWN[aten.lu_unpack.default](lu, pivots), aten.lu_unpack(lu, pivots)):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("upper, left, unit", [(True, True, False), (False, True, True), (True, False, True),
                                               (False, False, False)])
def test_solve_triangular_reads_only_its_triangle(upper, left, unit):
    from neuronc.frontend.decompositions import OWN
    aten, a = torch.ops.aten, _matrices(2, 4, 4) + 4 * torch.eye(4)  # the other triangle is not zero: unread
    b = _matrices(1, 4, 3, seed=1) if left else _matrices(3, 4, seed=1)  # broadcast over a's batch
    torch.testing.assert_close(OWN[aten.linalg_solve_triangular.default](a, b, upper=upper, left=left,
                                                                         unitriangular=unit),
                               aten.linalg_solve_triangular(a, b, upper=upper, left=left, unitriangular=unit),
                               rtol=1e-4, atol=1e-4)


def test_lu_gradient_solves_triangles_on_the_device():
    a, weights = _matrices(2, 4, 4), _matrices(3, 2, 4, 4, seed=1)

    def lu(m):  # P, L, U weighted: the backward solves with L and U (linalg_solve_triangular)
        p, low, up = torch.linalg.lu(m)
        return p * weights[0] + low * weights[1] + up * weights[2]

    torch._dynamo.reset()
    a_compiled = a.clone().requires_grad_(True)
    torch.compile(lu, backend="neuron", fullgraph=True)(a_compiled).sum().backward()
    a_eager = a.clone().requires_grad_(True)
    lu(a_eager).sum().backward()
    torch.testing.assert_close(a_compiled.grad, a_eager.grad, rtol=1e-4, atol=1e-5)


def test_lu_family_compiles_on_the_device():
    a, b = _matrices(2, 4, 4), _matrices(2, 4, 3, seed=1)
    _matches_eager(lambda m, r: (*torch.linalg.lu_factor_ex(m), torch.linalg.det(m), *torch.linalg.solve_ex(m, r),
                                 *torch.linalg.lu(m)), a, b)


def test_lu_of_nothing_compiles():
    """An empty matrix, and a right-hand side of no columns: nothing to factor or solve (OpInfo's samples)."""
    lu, pivots = torch.linalg.lu_factor(_matrices(3, 3))
    _matches_eager(lambda a, b: (*torch.linalg.inv_ex(a), torch.linalg.lu_solve(lu, pivots, b)),
                   _matrices(0, 0), _matrices(3, 0))


def test_determinants_of_nothing_are_one():
    """det and slogdet of a 0 x 0 matrix (OpInfo's first sample) and of an empty batch: 1, and sign 1, log 0."""
    _matches_eager(lambda a, b: (*torch.linalg.slogdet(a), torch.linalg.det(a), *torch.linalg.slogdet(b)),
                   torch.zeros(0, 0), torch.zeros(0, 2, 2))


def _gradients(fn, *inputs):
    """The gradients of every float input of ``fn`` (outputs weighted by fixed random numbers)."""
    inputs = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
    output = fn(*inputs)
    (output * torch.randn(output.shape, generator=torch.Generator().manual_seed(1))).sum().backward()
    return [t.grad for t in inputs if t.is_floating_point()]


def _matches_eager_gradients(fn, *inputs):
    torch._dynamo.reset()
    assert_matches_eager(_gradients(torch.compile(fn, backend="neuron"), *inputs), _gradients(fn, *inputs))


F = torch.nn.functional
CONVOLUTIONS = {  # (fn, input shape, weight shape)
    "plain, strided": (lambda x, w: F.conv2d(x, w, None, 2, 1), (2, 4, 10, 9), (6, 4, 3, 3)),
    "grouped": (lambda x, w: F.conv2d(x, w, None, 1, 1, 1, 2), (2, 4, 6, 6), (6, 2, 3, 3)),
    "depthwise, strided": (lambda x, w: F.conv2d(x, w, None, 2, 1, 1, 4), (2, 4, 7, 7), (4, 1, 3, 3)),
    "dilated, strided": (lambda x, w: F.conv2d(x, w, None, 2, 1, 2), (2, 4, 10, 9), (6, 4, 3, 3)),
    "1-d": (lambda x, w: F.conv1d(x, w, None, 2, 1), (2, 4, 9), (6, 4, 3)),
    "3-d": (lambda x, w: F.conv3d(x, w, None, 1, 1), (1, 2, 4, 4, 4), (3, 2, 3, 3, 3)),
    "transposed, output padding": (lambda x, w: F.conv_transpose2d(x, w, None, 2, 1, 1), (2, 4, 5, 6), (4, 6, 3, 3)),
    "transposed, grouped": (lambda x, w: F.conv_transpose2d(x, w, None, 3, 2, 2, 2), (2, 4, 5, 6), (4, 3, 4, 4)),
    "transposed, dilated": (lambda x, w: F.conv_transpose1d(x, w, None, 2, 1, 1, 1, 2), (2, 4, 7), (4, 6, 3)),
    "transposed, output padding past the stride": (  # OpInfo's sample: allowed below the dilation
        lambda x, w: F.conv_transpose2d(x, w, None, (3, 2), (1, 2), (2, 3), 2, (4, 4)), (2, 2, 4, 4), (2, 2, 4, 5)),
}


@pytest.mark.parametrize("form", CONVOLUTIONS)
def test_convolution_gradients_compile_in_every_form(form):
    fn, x_shape, w_shape = CONVOLUTIONS[form]
    _matches_eager_gradients(fn, torch.randn(x_shape), torch.randn(w_shape))


@pytest.mark.parametrize("mode, padding_idx, last_offset, sample_weights", [
    ("sum", None, False, False), ("sum", 4, True, True), ("mean", 4, False, False), ("max", 4, True, False)])
def test_embedding_bag_gradients_compile(mode, padding_idx, last_offset, sample_weights):
    indices = torch.tensor([1, 2, 4, 5, 4, 3, 4, 0])
    offsets = torch.tensor([0, 3, 3, 6, 8] if last_offset else [0, 3, 3, 6])  # bag 1 is empty

    def bags(weight, *per_sample):
        return F.embedding_bag(indices, weight, offsets, mode=mode, padding_idx=padding_idx,
                               include_last_offset=last_offset, per_sample_weights=per_sample[0] if per_sample else None)
    _matches_eager_gradients(bags, torch.randn(10, 3), *([torch.randn(8)] if sample_weights else []))


def _inverse_and_solution(a, b):
    return torch.linalg.inv(a) @ b + torch.linalg.solve(a, b)


def test_inv_and_solve_compile_whole_and_train():
    """torch's singular-matrix check is no device op: it is made on the host after the program (host_checks)."""
    a, b = _matrices(4, 4) + 4 * torch.eye(4), _matrices(4, 3, seed=1)
    _matches_eager(_inverse_and_solution, a, b)
    weights = torch.randn(4, 3)
    torch._dynamo.reset()
    assert_matches_eager(_gradient(lambda t: torch.compile(_inverse_and_solution, backend="neuron")(t, b), a, weights),
                         _gradient(lambda t: _inverse_and_solution(t, b), a, weights))


def test_a_singular_matrix_raises_eagers_error_from_the_compiled_graph():
    singular, b = torch.ones(4, 4), _matrices(4, 3, seed=1)
    with pytest.raises(torch.linalg.LinAlgError) as eager:
        _inverse_and_solution(singular, b)
    torch._dynamo.reset()
    compiled = torch.compile(_inverse_and_solution, backend="neuron")
    compiled(_matrices(4, 4) + 4 * torch.eye(4), b)  # compiled for these shapes, then called on a singular one
    with pytest.raises(torch.linalg.LinAlgError) as neuron:
        compiled(singular, b)
    assert str(neuron.value) == str(eager.value)


def _encoder(norm_first: bool, activation: str):
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, activation=activation, batch_first=True,
                                             norm_first=norm_first)
    return torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()


@pytest.mark.parametrize("norm_first, activation", [(False, "relu"), (True, "gelu")])
@pytest.mark.parametrize("masks", ["none", "padding", "causal and padding"])
def test_transformer_encoder_inference_fast_path_compiles(norm_first, activation, masks):
    # nn.TransformerEncoderLayer in eval under no_grad calls one fused op, aten._transformer_encoder_layer_fwd
    # (masks merged and typed by nn.MultiheadAttention.merge_masks); neuronc computes it as ATen's C++ does
    encoder, x = _encoder(norm_first, activation), torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1))
    padding = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    causal = torch.ones(6, 6, dtype=torch.bool).triu(1)
    kwargs = {"none": {}, "padding": {"src_key_padding_mask": padding},
              "causal and padding": {"mask": causal, "src_key_padding_mask": padding, "is_causal": True}}[masks]
    with torch.no_grad():
        _matches_eager(lambda t: encoder(t, **kwargs), x)


def test_multi_head_attention_inference_fast_path_gives_weights_like_eager():
    torch.manual_seed(0)
    attention = torch.nn.MultiheadAttention(16, 4, batch_first=True).eval()
    x = torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))
    padding = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    with torch.no_grad():
        _matches_eager(lambda t: attention(t, t, t, key_padding_mask=padding), x)
        _matches_eager(lambda t: attention(t, t, t, average_attn_weights=False), x)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("descending", [False, True])
def test_a_sort_of_integer_keys_past_fp32s_significand_is_exact_and_stable(dtype, descending):
    # TOPK compares in fp32: 16777217 and 16777216 are one value there, and negating INT_MIN overflows; such keys
    # are sorted by 16-bit digits (passes/indexing.py)
    info = torch.iinfo(dtype)
    edges = [5, info.min, 0, 1, info.max, 16777217, 16777216, -16777217, -16777216, 5, info.min + 1, 2 ** 24 + 2]
    rows = torch.randint(info.min, info.max, (3, len(edges)), generator=torch.Generator().manual_seed(3), dtype=dtype)
    x = torch.cat([torch.tensor([edges], dtype=dtype), rows, rows[:, :6].repeat(1, 2)[:, :len(edges)]])
    for dim in (1, 0):
        _matches_eager(lambda t, dim=dim: torch.sort(t, dim=dim, descending=descending, stable=True), x)


def _float_keys(dtype):
    """Rows of float keys with every value TOPK cannot compare alone: NaN (several, one negative), +-inf next to
    +-the largest finite value, -0 next to 0, the smallest subnormal, ties; then random rows with repeats."""
    info = torch.finfo(dtype)
    nan, inf, tiny = float("nan"), float("inf"), info.smallest_normal * info.eps
    edges = [1.0, nan, -inf, info.max, -0.0, inf, -info.max, 0.0, -nan, tiny, -tiny, 1.0, nan, -1.0, 0.0, -0.0]
    rows = torch.randn(3, len(edges), generator=torch.Generator().manual_seed(5)).to(dtype)
    rows[1, ::3] = nan
    rows[2, 1::2] = rows[2, ::2]  # every value twice
    return torch.cat([torch.tensor([edges], dtype=dtype), rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("descending", [False, True])
def test_a_sort_of_float_keys_puts_nan_largest_and_keeps_ties_in_order(dtype, descending):
    # PyTorch orders NaN above +inf and -0 equal to 0; TOPK cannot find a NaN and ties +-inf with +-FLT_MAX: float
    # keys are sorted by an integer key in that order (passes/indexing.py)
    x = _float_keys(dtype)
    for dim in (1, 0):
        _matches_eager(lambda t, dim=dim: torch.sort(t, dim=dim, descending=descending, stable=True), x)


def test_argsort_and_msort_of_keys_with_nan_match_eager():
    x = _float_keys(torch.float32)
    _matches_eager(lambda t: torch.argsort(t, dim=1, descending=True, stable=True), x)
    _matches_eager(torch.msort, x)


@pytest.mark.parametrize("largest", [True, False])
def test_topk_counts_nan_as_the_largest_value(largest):
    # one NaN per row and no other ties: eager's top-k orders tied values as it likes
    x = torch.randn(4, 12, generator=torch.Generator().manual_seed(6))
    x[0, 3], x[1, 0], x[2, 11] = float("nan"), float("inf"), float("-inf")
    x[3, 5], x[3, 6] = torch.finfo(torch.float32).max, float("inf")
    x[2, 4] = float("nan")
    _matches_eager(lambda t: torch.topk(t, 5, dim=1, largest=largest), x)


def _rows_with_nan_and_ties():
    """Rows of few distinct values (ties everywhere), one of them all NaN, one without NaN."""
    x = torch.randint(0, 4, (6, 9), generator=torch.Generator().manual_seed(7)).float()
    x[x == 3] = float("nan")
    x[0], x[1] = float("nan"), torch.tensor([2.0, 1, 1, 0, 2, 2, 1, 0, 5])
    return x


def test_median_and_nanmedian_match_aten_at_ties_and_nan():
    # ATen: median of a row with a NaN is its first NaN; nanmedian the lower median of the numbers; at ties the
    # index a stable sort puts at that rank (its partition orders by value, then index)
    x = _rows_with_nan_and_ties()
    _matches_eager(lambda t: (torch.median(t), torch.nanmedian(t), torch.median(t[1:2]), *torch.median(t, 1),
                              *torch.nanmedian(t, 1, keepdim=True), *torch.median(t, 0), *torch.nanmedian(t, 0)), x)


@pytest.mark.parametrize("n", [4, 9, 40])
def test_nanmedian_of_a_row_of_nans_returns_atens_index(n):
    # every NaN compares equal there: ATen's index is where std::nth_element's partition left one
    x = torch.full((2, n), float("nan"))
    x[1, : n // 2] = 1.0
    _matches_eager(lambda t: torch.nanmedian(t, 1), x)


def test_median_of_integers_matches_eager():
    x = torch.randint(-3, 3, (5, 8), generator=torch.Generator().manual_seed(8))
    _matches_eager(lambda t: (torch.median(t), *torch.median(t, 0), *torch.nanmedian(t, 1)), x)


def test_kthvalue_is_the_kth_smallest_with_nan_largest():
    x = torch.randn(5, 11, generator=torch.Generator().manual_seed(9))
    x[0, 4], x[2, 0] = float("nan"), float("-inf")
    _matches_eager(lambda t: (*torch.kthvalue(t, 1, 1), *torch.kthvalue(t, 11, 1), *torch.kthvalue(t, 3, 0)), x)


def test_kthvalue_at_ties_gives_eagers_value_and_an_index_holding_it():
    # ATen's quickselect picks one of tied indices by its own pivots (not reproduced): the stable sort's is given
    x = _rows_with_nan_and_ties()
    got_values, got_indices = run_compiled(lambda t: torch.kthvalue(t, 4, 1), x)
    want_values, _ = torch.kthvalue(x, 4, 1)
    torch.testing.assert_close(got_values, want_values, equal_nan=True)
    torch.testing.assert_close(x.gather(1, got_indices[:, None])[:, 0], want_values, equal_nan=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_mode_is_the_smallest_most_frequent_value_at_its_last_index(dtype):
    x = torch.randint(0, 4, (6, 10), generator=torch.Generator().manual_seed(10)).to(dtype)
    x[0] = torch.arange(10)  # every value once: the smallest, index 0
    for dim in (1, 0):
        _matches_eager(lambda t, dim=dim: torch.mode(t, dim), x)


def test_quantiles_of_rows_with_nan_match_eager():
    x = _rows_with_nan_and_ties()
    q = torch.tensor([0.0, 0.3, 0.5, 1.0])
    _matches_eager(lambda t: (torch.quantile(t, q, dim=1), torch.nanquantile(t, q, dim=1),
                              torch.nanquantile(t, 0.5, dim=0, interpolation="lower")), x)


def test_searchsorted_replays_atens_binary_search():
    # rows with NaNs at the end, NaN values, both sides, a sorter, a 1-d sequence shared by every row
    seq = torch.sort(torch.randint(0, 6, (3, 7), generator=torch.Generator().manual_seed(11)).float(), 1).values
    seq[2, -2:] = float("nan")
    values = torch.tensor([[-1.0, 0, 2, 5, 9, float("nan")]] * 3)
    perm = torch.argsort(torch.rand(3, 7, generator=torch.Generator().manual_seed(12)), 1)
    shuffled = seq.gather(1, torch.argsort(perm, 1))  # shuffled[perm] is seq
    _matches_eager(lambda s, u, v: (torch.searchsorted(s, v), torch.searchsorted(s, v, right=True, out_int32=True),
                                    torch.searchsorted(s[0], v, side="right"), torch.searchsorted(u, v, sorter=perm),
                                    torch.bucketize(v, s[1])), seq, shuffled, values)


def test_a_bf16_polygamma_of_an_order_without_a_lowering_still_declines():
    # an order past _POLYGAMMA_MAX_ORDER has no lowering: NotImplemented (then named as an op that cannot be
    # compiled), not an AttributeError
    from neuronc.frontend.decompositions import _POLYGAMMA_MAX_ORDER, OWN
    order = _POLYGAMMA_MAX_ORDER + 1
    assert OWN[torch.ops.aten.polygamma.default](order, torch.ones(3, dtype=torch.bfloat16)) is NotImplemented


def test_special_functions_of_bf16_compute_in_fp32_like_aten():
    # evaluated in bf16 step by step, trigamma at -8.06 was 239 where eager's (fp32, rounded once) is 260
    x = torch.linspace(-8.45, 8.45, 60).to(torch.bfloat16)
    x = x[(x > 0) | (x != torch.round(x))]  # not at the poles (there eager's pi / sin(pi x) is finite, neuronc's inf)
    _matches_eager(lambda t: torch.polygamma(1, t), x)


def test_argmax_and_argmin_of_a_row_with_nan_point_at_its_first_nan():
    # the REDUCE gives NaN there, which equals nothing: the index was one past the row, silently
    x = torch.tensor([[1.0, float("nan"), 3.0, float("nan")], [2.0, 5.0, -1.0, float("nan")], [0.0, 1.0, 2.0, 3.0]])
    _matches_eager(lambda t: (t.argmax(1), t.argmin(1), *t.max(1), *t.min(1), t.argmax(), t.argmin(0)), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32])
@pytest.mark.parametrize("descending", [True, False])
def test_a_top_k_of_few_wide_keys_matches_the_stable_sorts_first_k(dtype, descending):
    # k < n / 3 of fp32 (or int32) keys: 4 TOPKs of k, not a whole-row digit pass (passes/indexing.py); the eager
    # device's lowering emits such TOPKs (torch-mlir sorts the whole row then slices), so the node is built here
    import numpy as np

    from neuronc import ir
    from neuronc.compiler import CompileOptions, compile_graph
    from neuronc.ir import Op
    from neuronc.isa import DType
    from runtime import run_neff

    x = torch.randint(-3, 3, (6, 40), generator=torch.Generator().manual_seed(13)).to(dtype)
    if dtype.is_floating_point:
        x = x * torch.tensor([1e-40, 1, 1e30, 65536.0, 1.0000001, 3.4e38])[:, None]
        x[0, 5], x[1, 7], x[1, 9], x[2, ::7], x[3, 3] = float("nan"), float("inf"), float("-inf"), float("nan"), -0.0
    else:
        x = x * 1000003 + torch.iinfo(dtype).max // 4 * torch.tensor([0, 1, -1, 2, -2, 3])[:, None].to(dtype)
    for k, dim in ((1, 1), (13, 1), (1, 0)):
        p = ir.node(Op.PARAMETER, [], tuple(x.shape), DType.from_numpy(x.numpy().dtype), index=0, name="x",
                    kind="input")
        shape = tuple(k if d == dim else s for d, s in enumerate(x.shape))
        top = ir.node(Op.TOPK, [p], shape, DType.I32, dimension=dim, k=k, descending=descending)
        got = run_neff(compile_graph(ir.Graph([p], [top]), CompileOptions()).neff, [x.numpy()]).outputs[0]
        want = torch.sort(x, dim=dim, descending=descending, stable=True)[1].narrow(dim, 0, k)
        assert torch.equal(torch.from_numpy(np.asarray(got)).long(), want)


@pytest.mark.parametrize("p", [0.0, 0.5, 1.0, 2.0, 3.0, float("inf")])
@pytest.mark.parametrize("rows", [4, 30])
def test_cdist_matches_eager_forward_and_backward(p, rows):
    """torch.cdist (no torch-mlir lowering) for every kind of p, below and past ATen's 25-row switch to the
    matmul form for p = 2, with a repeated row (a zero distance: its gradient is zero, not NaN)."""
    generator = torch.Generator().manual_seed(rows)
    a, b = torch.randn(2, rows, 5, generator=generator), torch.randn(2, 7, 5, generator=generator)
    b[:, 3] = a[:, 1]
    weights = torch.randn(2, rows, 7, generator=generator)
    _matches_eager(lambda u, v: torch.cdist(u, v, p), a, b)

    def gradients(fn):
        u, v = a.clone().requires_grad_(True), b.clone().requires_grad_(True)
        (fn(u, v) * weights).sum().backward()
        return u.grad, v.grad

    distances = lambda u, v: torch.cdist(u, v, p)  # noqa: E731 - the op under test
    torch._dynamo.reset()
    for got, want in zip(gradients(torch.compile(distances, backend="neuron")), gradients(distances)):
        assert_matches_eager(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("op", [torch.fmod, torch.remainder])
def test_fmod_and_remainder_of_floats_are_exact(op, dtype):
    """C's fmod is exact; torch-mlir's a - trunc(a / b) * b rounds twice (fp32 fmod(1e7 + 1, 3) off by units, bf16
    fmod(-212, 1.5) 0 instead of -0.5): both ops equal eager's bits, broadcast and with a Python scalar divisor."""
    generator = torch.Generator().manual_seed(0)
    a = torch.cat([torch.randn(4, 250, generator=generator) * 1e4, torch.tensor([[1e7 + 1, -212, 33.25, -7.5]] * 4)], 1)
    b = torch.randn(4, 1, generator=generator) * 3
    a, b = a.to(dtype), b.to(dtype)
    for fn, inputs in ((op, (a, b)), (lambda t: op(t, 1.5), (a,))):
        torch._dynamo.reset()
        got, want = torch.compile(fn, backend="neuron", fullgraph=True)(*inputs), fn(*inputs)
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_grid_sample_with_reflection_padding_matches_eager():
    """Reflection padding folds coordinates with fmod by a Python scalar (fmod.Scalar: no torch-mlir lowering)."""
    generator = torch.Generator().manual_seed(0)
    image, grid = torch.randn(2, 3, 8, 8, generator=generator), torch.rand(2, 5, 5, 2, generator=generator) * 2.4 - 1.2
    for mode in ("bilinear", "nearest", "bicubic"):
        _matches_eager(lambda x, g, mode=mode: torch.nn.functional.grid_sample(
            x, g, mode=mode, padding_mode="reflection", align_corners=False), image, grid)

def _gradients_match_eager(fn, *inputs):
    """The compiled function's gradients with respect to every floating input are eager autograd's."""
    weights = fn(*inputs)
    weights = torch.randn(weights.shape, generator=torch.Generator().manual_seed(20))

    def gradients(f):
        leaves = [t.clone().requires_grad_(t.is_floating_point()) for t in inputs]
        (f(*leaves) * weights).sum().backward()
        return [t.grad for t in leaves if t.requires_grad]

    torch._dynamo.reset()
    for got, want in zip(gradients(torch.compile(fn, backend="neuron")), gradients(fn)):
        assert_matches_eager(got, want)


def _seeded(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_addmv_scales_both_terms_and_beta_zero_ignores_nan_in_input():
    vec, mat = _seeded(5, seed=1), _seeded(3, 5, seed=2)
    poisoned = torch.tensor([float("nan"), float("inf"), 1.0])
    _matches_eager(lambda s, m, v: (torch.addmv(s, m, v), torch.addmv(s, m, v, beta=0.5, alpha=-2.0),
                                    torch.addmv(s[:1], m, v, beta=2)), _seeded(3), mat, vec)
    _matches_eager(lambda s, m, v: torch.addmv(s, m, v, beta=0, alpha=3.0), poisoned, mat, vec)
    _gradients_match_eager(lambda s, m, v: torch.addmv(s, m, v, beta=0.5, alpha=-2.0), _seeded(3), mat, vec)


@pytest.mark.parametrize("upper", [False, True])
def test_cholesky_of_a_batch_of_positive_definite_matrices_and_its_gradient(upper):
    a = _seeded(2, 5, 5, seed=3)
    spd = a @ a.mT + 5 * torch.eye(5)
    _matches_eager(lambda t: torch.cholesky(t, upper=upper), spd)
    _matches_eager(lambda t: torch.linalg.cholesky(t, upper=upper), spd)
    _gradients_match_eager(lambda t: torch.cholesky(t @ t.mT + 5 * torch.eye(5), upper=upper), a)


def test_clamp_by_tensors_propagates_nan_from_input_and_bounds():
    x = torch.tensor([[-2.0, 0.5, float("nan"), 3.0, 1.0], [0.0, -1.0, 2.0, 9.0, -9.0]])
    lo = torch.tensor([-1.0, float("nan"), 0.0, 0.0, 2.0])
    hi = torch.tensor([[1.0], [float("nan")]])
    _matches_eager(lambda t, a, b: (torch.clamp(t, a, b), torch.clamp(t, min=a), torch.clamp(t, max=b),
                                    torch.clamp_min(t, a), torch.clamp_max(t, b)), x, lo, hi)
    # bounds wider than the input: the result takes the broadcast shape (torch-mlir's lowering keeps the input's)
    _matches_eager(lambda t, a, b: (torch.clamp_max(t, a), torch.clamp_min(t, a), torch.clamp(t, a, b[:1])),
                   x[:1].T, lo, hi)
    _gradients_match_eager(lambda t, a, b: torch.clamp(t, a, b), _seeded(4, 5), _seeded(5, seed=1) - 1,
                           _seeded(4, 1, seed=2) + 1)


@pytest.mark.parametrize("accumulate", [False, True])
def test_put_writes_flat_indices_counting_negative_ones_from_the_end(accumulate):
    index = torch.tensor([[0, -1], [7, -12]]) if not accumulate else torch.tensor([0, -1, 5, 0, -1])
    source = _seeded(*index.shape, seed=4)
    _matches_eager(lambda t, s: torch.put(t, index, s, accumulate), _seeded(3, 4), source)
    _gradients_match_eager(lambda t, s: torch.put(t, index, s, accumulate), _seeded(3, 4), source)


def test_bilinear_contracts_both_inputs_with_the_weight():
    x1, x2, w, b = _seeded(6, 3, seed=5), _seeded(6, 4, seed=6), _seeded(2, 3, 4, seed=7), _seeded(2, seed=8)
    _matches_eager(lambda p, q, r, s: torch.nn.functional.bilinear(p, q, r, s), x1, x2, w, b)
    _matches_eager(lambda p, q, r: torch.nn.functional.bilinear(p, q, r), x1[:1].expand(6, 3), x2, w)
    _matches_eager(lambda p, q, r, s: torch.nn.functional.bilinear(p, q, r, s), x1[:0], x2[:0], w, b)  # no rows
    _gradients_match_eager(lambda p, q, r, s: torch.nn.functional.bilinear(p, q, r, s), x1, x2, w, b)


@pytest.mark.parametrize("p", [0.0, 1.0, 2.0, 0.5, 3.0, float("inf")])
def test_pdist_is_the_upper_triangle_of_row_distances(p):
    x = _seeded(5, 3, seed=9)
    x[3] = x[1]  # one zero distance (its gradient is 0, as eager's)
    x[4, 0] = x[0, 0]  # one zero difference in a nonzero distance (for p < 1 its gradient is 0, as eager's)
    _matches_eager(lambda t: torch.nn.functional.pdist(t, p), x)
    _gradients_match_eager(lambda t: torch.nn.functional.pdist(t, p), x)


@pytest.mark.parametrize("output_size", [(2, 3, 1), (3, 3, 5)])
def test_adaptive_3d_pools_use_overlapping_floor_ceil_windows(output_size):
    x = _seeded(2, 3, 5, 4, 7, seed=10)
    _matches_eager(lambda t: torch.nn.functional.adaptive_avg_pool3d(t, output_size), x)
    _matches_eager(lambda t: torch.nn.functional.adaptive_max_pool3d(t, output_size, return_indices=True), x)
    _gradients_match_eager(lambda t: torch.nn.functional.adaptive_avg_pool3d(t, output_size), x)
    _gradients_match_eager(lambda t: torch.nn.functional.adaptive_max_pool3d(t, output_size), x)


def test_as_strided_scatter_replaces_only_the_strided_view():
    x = _seeded(4, 5, seed=11)
    _matches_eager(lambda t, s: torch.as_strided_scatter(t, s, (2, 3), (5, 2), 1), x, _seeded(2, 3, seed=12))
    _matches_eager(lambda t, s: torch.as_strided_scatter(t, s, (3, 2), (1, 7), 4), x, _seeded(3, 2, seed=13))
    _matches_eager(lambda t, s: torch.as_strided_scatter(t, s, (4,), (1,)), x.T, _seeded(4, seed=14))
    _gradients_match_eager(lambda t, s: torch.as_strided_scatter(t, s, (3, 2), (1, 7), 4), x, _seeded(3, 2, seed=13))


def test_reflect_padding_of_an_empty_batch_and_other_empty_gathers_give_eagers_empty_shape():
    # OpInfo's nn.functional.pad.reflect sample [0, 3, 3]: its aten.index.Tensor gathers nothing
    rows, nothing = torch.tensor([[2, 0, 1]]), torch.zeros(0, 1, dtype=torch.int64)
    _matches_eager(lambda t: torch.nn.functional.pad(t, (1, 2), mode="reflect"), torch.randn(0, 3, 3))
    _matches_eager(lambda t: (t[rows], t[rows, :, rows], t[..., rows]), torch.randn(3, 0, 4))
    _matches_eager(lambda t: (t[nothing, :, rows] + 1, t[:, nothing, rows]), torch.randn(3, 2, 4))


@pytest.mark.parametrize("bias, class_weights", [(False, False), (True, True)])
def test_chunked_linear_cross_entropy_without_reduction_gives_each_rows_loss(bias, class_weights):
    """reduction='none' with options is its own chunked custom op (the per-row losses): a target equal to
    ignore_index gives 0, class weights scale each row."""
    generator = torch.Generator().manual_seed(5)
    x, w = torch.randn(8, 3, generator=generator), torch.randn(4, 3, generator=generator)
    b = torch.randn(4, generator=generator) if bias else None
    weight = torch.rand(4, generator=generator) + 0.5 if class_weights else None
    target = torch.tensor([3, 0, 1, -100, 3, 3, 2, 1])
    options = torch.nn.LinearCrossEntropyOptions(batch_chunk_size=2)
    loss = lambda x, w: torch.nn.functional.linear_cross_entropy(  # noqa: E731 - the op under test
        x, w, target, linear_bias=b, weight=weight, reduction="none", options=options)
    _matches_eager(loss, x, w)


def test_the_copy_forms_of_view_ops_compile_on_the_device():
    aten = torch.ops.aten
    x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(8))
    _matches_eager(lambda t: (aten.view_copy(t, [6, 4]), aten.permute_copy(t, [2, 0, 1]), aten.narrow_copy(t, 1, 1, 2),
                              aten.as_strided_copy(t, [3, 2], [4, 1], 1), *aten.unbind_copy(t, 1)), x)
