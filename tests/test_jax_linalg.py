"""jnp.linalg and jax.scipy.linalg through `neuronc.jax.jit`: JAX's CPU export makes them LAPACK custom calls
(lapack_sgetrf_ffi, ...), lowered by neuronc/frontend/lapack_calls.py. Goldens from jax.jit on CPU (LAPACK).
Eigenvectors and singular vectors are unique up to sign only: compared after matching each column's sign to the
golden's. Matrices are small (to 8 x 8) and each test compiles one program holding its variants (a compile is the
cost); the Jacobi sweeps' convergence to 16 x 16 is test_linalg_decompositions.py's."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import numpy as np
import pytest

import neuronc.jax
from neuronc.errors import NeuronCompileError
from neuronc.tolerances import tolerance
from tests.conftest import line_of

def assert_close(got, want):
    got, want = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, g.dtype, w.shape, w.dtype)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), **tolerance(w.dtype))


def same_columns_up_to_sign(got, want):
    """got's columns (last axis) with the signs making each agree with want's column best."""
    got, want = np.asarray(got), np.asarray(want)
    signs = np.where((got * want).sum(-2, keepdims=True) < 0, -1, 1)
    np.testing.assert_allclose(got * signs, want, **tolerance(want.dtype))


def both(function, *args):
    return neuronc.jax.jit(function)(*args), jax.jit(function)(*args)


def matrix(*shape, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def positive_definite(n, *batch, seed=0):
    a = matrix(*batch, n, n, seed=seed)
    return (a @ np.swapaxes(a, -1, -2) + n * np.eye(n, dtype=np.float32)).astype(np.float32)


def test_inv_solve_det_slogdet_match_lapack():
    matrices = [matrix(4, 4), matrix(2, 3, 3, seed=1)]  # one and a batch
    right_sides = [matrix(4, 2, seed=2), matrix(2, 3, 2, seed=3)]
    assert_close(*both(lambda matrices, right_sides: [
        (jnp.linalg.inv(a), jnp.linalg.solve(a, b), jnp.linalg.det(a), jnp.linalg.slogdet(a))
        for a, b in zip(matrices, right_sides)], matrices, right_sides))


def test_lu_gives_lapacks_pivots_and_factors():
    matrices = [matrix(5, 5), matrix(3, 5, seed=1), matrix(5, 3, seed=2)]
    got, want = both(lambda matrices: [(jax.lax.linalg.lu(a), jsl.lu(a)) for a in matrices], matrices)
    for ((lu, pivots, permutation), scipy_lu), ((want_lu, want_pivots, want_permutation), want_scipy_lu) in zip(
            got, want):
        np.testing.assert_array_equal(np.asarray(pivots), np.asarray(want_pivots))  # (int32: exact)
        np.testing.assert_array_equal(np.asarray(permutation), np.asarray(want_permutation))
        assert_close(lu, want_lu)
        assert_close(scipy_lu, want_scipy_lu)


def test_lu_of_a_singular_matrix_is_not_nan_as_in_jax():
    a = matrix(4, 4)
    a[:, 1] = 0.0  # getrf's info = 2: JAX keeps the factors (only a negative info makes them NaN)
    got, want = both(jsl.lu_factor, a)
    assert np.isfinite(np.asarray(want[0])).all()
    assert_close(got, want)


def test_cholesky_and_cho_solve_match_lapack():
    matrices = [positive_definite(5), positive_definite(4, 2, seed=1)]  # one and a batch
    right_sides = [matrix(5, 3, seed=2), matrix(2, 4, 3, seed=3)]
    assert_close(*both(lambda matrices, right_sides: [
        (jnp.linalg.cholesky(a), jsl.cholesky(a), jsl.cho_solve(jsl.cho_factor(a, lower=True), b))  # lower, upper
        for a, b in zip(matrices, right_sides)], matrices, right_sides))


def test_cholesky_of_a_matrix_that_is_not_positive_definite_is_nan_as_in_jax():
    a = np.diag(np.array([4.0, -1.0, 2.0], np.float32))
    got, want = both(jnp.linalg.cholesky, a)  # potrf's info = 2: JAX makes the lower triangle NaN
    assert np.isnan(np.asarray(want)[np.tril_indices(3)]).all()
    assert_close(got, want)  # (NaN where the golden is NaN)


def test_solve_triangular_reads_its_triangle_transposed_or_not():
    a = matrix(4, 4) + 4 * np.eye(4, dtype=np.float32)  # both triangles full: only uplo's may be read
    b = matrix(4, 3, seed=1)
    variants = [(lower, trans, unit) for lower in (True, False) for trans in (0, 1) for unit in (False, True)]
    assert_close(*both(lambda a, b: [jsl.solve_triangular(a, b, lower=lower, trans=trans, unit_diagonal=unit)
                                     for lower, trans, unit in variants], a, b))


def test_triangular_solve_from_the_right_batched():
    a = matrix(2, 4, 4) + 4 * np.eye(4, dtype=np.float32)
    b = matrix(2, 3, 4, seed=1)
    assert_close(*both(lambda a, b: [jax.lax.linalg.triangular_solve(a, b, left_side=False, lower=lower,
                                                                     transpose_a=transpose_a)
                                     for lower in (True, False) for transpose_a in (False, True)], a, b))


def test_qr_matches_lapacks_householder_signs():
    matrices = [matrix(5, 3), matrix(3, 5, seed=1), matrix(2, 4, 4, seed=2)]  # tall, wide, a batch
    assert_close(*both(lambda matrices: [jnp.linalg.qr(a, mode=mode) for a in matrices
                                         for mode in ("reduced", "complete", "r")], matrices))


def test_eigh_values_and_vectors_up_to_sign():
    a = matrix(5, 5)  # not symmetric: only the UPLO triangle is read, by LAPACK and by neuronc
    got, want = both(lambda a: [jnp.linalg.eigh(a, UPLO=uplo) for uplo in ("L", "U")], a)
    for (values, vectors), (want_values, want_vectors) in zip(got, want):
        assert_close(values, want_values)
        same_columns_up_to_sign(vectors, want_vectors)


def test_eigh_batched_and_eigvalsh():
    a = positive_definite(4, 3)
    ((values, vectors), eigvalsh), ((want_values, want_vectors), want_eigvalsh) = both(
        lambda a: (jnp.linalg.eigh(a), jnp.linalg.eigvalsh(a)), a)
    assert_close(values, want_values)
    same_columns_up_to_sign(vectors, want_vectors)
    assert_close(eigvalsh, want_eigvalsh)


@pytest.mark.parametrize("shape", [(6, 4), (2, 3, 5)], ids=["6x4", "batch3x5"])
def test_svd_values_and_vectors_up_to_sign(shape):
    a = matrix(*shape)
    got, want = both(lambda a: [jnp.linalg.svd(a, full_matrices=full) for full in (False, True)], a)
    for full, (u, s, vh), (want_u, want_s, want_vh) in zip((False, True), got, want):
        assert u.shape == want_u.shape and vh.shape == want_vh.shape
        assert_close(s, want_s)
        k = min(shape[-2:])  # a full U's / V^T's columns past k span a complement, unique only as a space
        same_columns_up_to_sign(u[..., :k], want_u[..., :k])
        same_columns_up_to_sign(np.swapaxes(vh, -1, -2)[..., :k], np.swapaxes(want_vh, -1, -2)[..., :k])
        if full:
            for q in (u, np.swapaxes(vh, -1, -2)):
                q = np.asarray(q)
                eye = np.broadcast_to(np.eye(q.shape[-1], dtype=q.dtype), q.shape[:-2] + (q.shape[-1],) * 2)
                np.testing.assert_allclose(np.swapaxes(q, -1, -2) @ q, eye, **tolerance(q.dtype))


def test_singular_values_lstsq_pinv_matrix_rank():
    """svd without vectors and matrix_rank (gesdd mode N, each declaring its unused U and V^T otherwise) of a wide
    matrix; lstsq and pinv of a tall one."""
    a, b = matrix(6, 4), matrix(6, 2, seed=1)
    assert_close(*both(lambda a, b: (jnp.linalg.svd(a.T, compute_uv=False), jnp.linalg.matrix_rank(a.T),
                                     jnp.linalg.lstsq(a, b)[0], jnp.linalg.pinv(a)), a, b))


def test_float64_under_x64_imports_the_d_kernels_and_stops_only_at_float64():
    """The d kernels (x64) are lowered like the s ones; the program then meets the NeuronCore's lack of float64
    (the error every float64 program gets), not a refused custom call."""
    with jax.enable_x64(True):
        a = matrix(3, 3, dtype=np.float64)
        function = lambda a: (jnp.linalg.inv(a), jnp.linalg.eigh(a), jnp.linalg.svd(a), jnp.linalg.qr(a),  # noqa: E731
                              jnp.linalg.cholesky(a))
        text = jax.jit(function).lower(a).as_text()
        assert "lapack_d" in text and "lapack_s" not in text
        with pytest.raises(NeuronCompileError, match="the NeuronCore has no float64") as caught:
            neuronc.jax.jit(function)(a)
        assert "custom call" not in str(caught.value)


def test_lapack_kernels_without_a_lowering_are_refused_by_name_with_their_line():
    def program(a):
        values = jnp.linalg.eig(a)[0].real  # marker: geev
        return values.sum() + jsl.schur(a)[0].sum()  # marker: gees

    with pytest.raises(NeuronCompileError) as caught:
        neuronc.jax.jit(program)(matrix(3, 3))
    message = str(caught.value)
    for kernel, marker in (("geev", "marker: geev"), ("gees", "marker: gees")):
        assert f"custom call lapack_s{kernel}_ffi: LAPACK's {kernel} has no lowering in neuronc" in message
        assert f"run this part with jax.jit on the CPU) at {__file__}:{line_of(__file__, marker)}" in message


def test_cli_check_passes_the_lowered_kernels_and_lists_the_others(cli, tmp_path):
    def program(a):
        return jnp.linalg.cholesky(a).sum() + jnp.linalg.eigh(a)[0].sum() + jsl.hessenberg(a).sum()  # marker: all

    path = tmp_path / "program.mlir"
    path.write_text(jax.jit(program).lower(positive_definite(3)).as_text(debug_info=True))
    result = cli("check", path)
    assert result.exit_code == 1, result.output
    assert "stablehlo.custom_call (1 of 3 uses)" in result.output, result.output
    assert "LAPACK's gehrd has no lowering in neuronc" in result.output
    assert "potrf_ffi" not in result.output and "syevd_ffi" not in result.output
    assert f"{__file__}:{line_of(__file__, 'marker: all')}" in result.output


def test_a_stablehlo_file_with_gesvd_compiles_and_runs(cli, tmp_path):
    """svd's QR algorithm (gesvd) has no jax.export compatibility guarantee, so neuronc.jax.jit never meets it; a
    StableHLO file can hold one."""
    def program(a):
        u, s, _ = jax.lax.linalg.svd(a, full_matrices=False, algorithm=jax.lax.linalg.SvdAlgorithm.QR)
        return s, u

    a = matrix(5, 3)
    text = jax.jit(program).lower(a).as_text()
    assert "lapack_sgesvd_ffi" in text
    (tmp_path / "program.mlir").write_text(text)
    np.save(tmp_path / "a.npy", a)
    assert cli("compile", tmp_path / "program.mlir", "-o", tmp_path / "out.neff").exit_code == 0
    result = cli("run", tmp_path / "out.neff", "-i", tmp_path / "a.npy", "-o", tmp_path / "out.npz")
    assert result.exit_code == 0, result.output
    got, (want_s, want_u) = np.load(tmp_path / "out.npz"), jax.jit(program)(a)
    np.testing.assert_allclose(got["output0"], np.asarray(want_s), **tolerance(np.float32))
    same_columns_up_to_sign(got["output1"], want_u)
