"""The JAX frontend: `neuronc.jax.jit`, and StableHLO / jax.export files through `neuronc compile` and `check`.
Goldens come from jax.jit on CPU."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import neuronc.jax
from neuronc.errors import ModelLoadError, NeuronCompileError, NeuronConfigError
from neuronc.reference import run_xla
from neuronc.tolerances import tolerance
from tests import jax_programs
from tests.conftest import line_of


def assert_matches_jax(got, want):
    """Same pytree structure; each leaf a JAX array of jax.jit's shape and dtype, within its dtype's tolerance."""
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert isinstance(g, jax.Array)
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, g.dtype, w.shape, w.dtype)
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), **tolerance(w.dtype))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", jax_programs.PROGRAMS)
def test_jax_programs_match_jax_jit_on_cpu(name, dtype):
    function, args = jax_programs.build(name, dtype)
    assert_matches_jax(neuronc.jax.jit(function)(*args), jax.jit(function)(*args))


def test_a_training_loop_follows_jax_step_by_step():
    function, (params, x, y) = jax_programs.build("sgd_step")
    ours, theirs = neuronc.jax.jit(function), jax.jit(function)
    mine = golden = params
    for _ in range(3):
        (mine, loss), (golden, golden_loss) = ours(mine, x, y), theirs(golden, x, y)
        assert_matches_jax((mine, loss), (golden, golden_loss))
    assert ours.compile_count() == 1


def test_a_new_shape_recompiles_and_a_seen_one_does_not():
    function, (params, x) = jax_programs.build("mlp")
    jitted = neuronc.jax.jit(function, opt_level=0)
    jitted(params, x)
    jitted(params, x + 1)
    assert jitted.compile_count() == 1
    longer = jnp.concatenate([x, x])
    assert_matches_jax(jitted(params, longer), jax.jit(function)(params, longer))
    assert jitted.compile_count() == 2


def test_numpy_inputs_python_numbers_and_unused_arguments():
    def scaled(x, unused, factor):
        return {"y": x * factor, "n": jnp.sum(x > 0)}

    x = np.arange(-3, 5, dtype=np.float32).reshape(2, 4)
    got = neuronc.jax.jit(scaled)(x, np.ones(3, np.float32), 2.5)
    assert_matches_jax(got, jax.jit(scaled)(x, np.ones(3, np.float32), 2.5))


def test_unsupported_ops_are_all_listed_with_their_jax_lines():
    def uses_two_unsupported_ops(x):
        y = jax.lax.linalg.tridiagonal_solve(x[0, :4], x[1, :4], x[2, :4], x[:, :1])  # marker: gtsv
        return y.sum() + jax.lax.while_loop(lambda v: v < x.sum(), lambda v: v * 2, 1.0)  # marker: loop on the data

    with pytest.raises(NeuronCompileError) as caught:
        neuronc.jax.jit(uses_two_unsupported_ops)(jnp.ones((4, 8)))
    message = str(caught.value)
    assert "2 op(s)" in message
    assert f"depends on the data; neuronc unrolls loops whose count is known when compiling (scan, fori_loop with " \
           f"constant bounds)) at {__file__}:{line_of(__file__, 'marker: loop on the data')}" in message
    assert "LAPACK's gtsv has no lowering in neuronc" in message
    assert f"on the CPU) at {__file__}:{line_of(__file__, 'marker: gtsv')}" in message


def test_is_finite_is_false_for_inf_and_nan_only():
    def finite(x):
        return jax.lax.is_finite(x), jax.nn.logsumexp(x, axis=1)  # logsumexp asks is_finite of its max

    x = jnp.array([[0.0, -1.5, 3e38, jnp.inf], [-jnp.inf, jnp.nan, 1e-30, -2.0]])
    got, want = neuronc.jax.jit(finite)(x), jax.jit(finite)(x)
    assert np.array_equal(np.asarray(got[0]), np.asarray(want[0]))
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), **tolerance(jnp.float32))


def test_products_and_running_products_match_jax():
    def products(x):  # cumprod is a 'mul' reduce_window, prod a 'mul' reduce; an odd length pads the product tree
        return jnp.cumprod(x, axis=1), jnp.prod(x, axis=0), jnp.prod(x[:, :5], axis=1), jnp.cumprod(x[0])

    x = jnp.asarray(np.random.default_rng(0).uniform(0.5, 1.5, (3, 7)), jnp.float32)
    assert_matches_jax(neuronc.jax.jit(products)(x), jax.jit(products)(x))


def test_jax_sorts_with_their_canonicalising_comparator_match_jax():
    def sorts(x):  # JAX's float comparator makes -0 equal to 0 and every NaN one NaN before comparing
        return jnp.sort(x, axis=1), jnp.argsort(x, axis=1), jnp.sort(x, axis=1, descending=True), \
            jax.lax.sort((x, -x), num_keys=1)

    x = jnp.array([[3.0, -0.0, 0.0, -2.0, 3.0, jnp.inf], [5.0, 4.0, -1.0, -1.0, 0.0, -jnp.inf]])
    for got, want in zip(jax.tree_util.tree_leaves(neuronc.jax.jit(sorts)(x)), jax.tree_util.tree_leaves(jax.jit(sorts)(x))):
        assert np.array_equal(np.asarray(got), np.asarray(want))  # a stable sort: ties keep their order


def test_static_arguments_are_baked_in_and_each_new_value_compiles_once():
    def fold(x, rows, *, reduce="sum"):
        y = jnp.reshape(x, (rows, -1)) * rows
        return y.sum(0) if reduce == "sum" else y.max(0)

    ours = neuronc.jax.jit(fold, static_argnums=1, static_argnames="reduce")
    theirs = jax.jit(fold, static_argnums=1, static_argnames="reduce")
    x = jnp.arange(24.0)
    for rows, reduce in ((2, "sum"), (3, "sum"), (2, "max"), (2, "sum")):
        assert_matches_jax(ours(x, rows, reduce=reduce), theirs(x, rows, reduce=reduce))
    assert ours.compile_count() == 3
    with pytest.raises(NeuronConfigError, match="static argument 1 is a list, which is not hashable"):
        ours(x, [2])


def test_cond_and_switch_select_the_branch_the_runtime_index_names():
    def choose(x, i):
        flipped = jax.lax.cond(x.sum() > 0, lambda v: v * 2.0, lambda v: -v, x)
        return jax.lax.switch(i, [lambda v: v + 1.0, lambda v: v * 3.0, jnp.sin], flipped)

    ours = neuronc.jax.jit(choose)
    x = jnp.arange(-6.0, 6.0).reshape(3, 4)
    for sign, index in ((1.0, 0), (-1.0, 1), (1.0, 2), (-1.0, 7)):  # both cond branches; 7: lax.switch clamps
        assert_matches_jax(ours(sign * x + 0.5, jnp.int32(index)), jax.jit(choose)(sign * x + 0.5, jnp.int32(index)))
    assert ours.compile_count() == 1  # one program: the index and the predicate are run-time values


def test_windows_at_runtime_indices_are_clamped_as_jax_clamps_them():
    def window_and_paste(x, update, i):
        return jax.lax.dynamic_slice(x, (i, 1), (3, 2)), jax.lax.dynamic_update_slice(x, update, (i, 2))

    ours = neuronc.jax.jit(window_and_paste)
    x, update = jnp.arange(40.0).reshape(10, 4), -jnp.ones((2, 2))
    for i in (4, 9, -3):  # inside, past the end, before the start
        assert_matches_jax(ours(x, update, jnp.int32(i)), jax.jit(window_and_paste)(x, update, jnp.int32(i)))


def test_nested_loops_with_constant_bounds_are_unrolled():
    def nested(x):
        def row(carry, r):
            inner = jax.lax.fori_loop(0, 3, lambda j, v: v * 0.5 + r * j, carry)
            return inner, inner.sum()
        return jax.lax.scan(row, jnp.zeros(4), x, reverse=True)

    x = jnp.arange(20.0).reshape(5, 4) / 10
    assert_matches_jax(neuronc.jax.jit(nested)(x), jax.jit(nested)(x))


def test_a_loop_whose_trip_count_depends_on_the_data_is_refused_with_its_line():
    def doubling(x):
        return jax.lax.while_loop(lambda v: v.sum() < 100.0, lambda v: v * 2.0, x)  # marker: data loop

    with pytest.raises(NeuronCompileError) as caught:
        neuronc.jax.jit(doubling)(jnp.ones(4))
    message = str(caught.value)
    assert "stablehlo.while (a loop whose trip count depends on the data" in message
    assert f"{__file__}:{line_of(__file__, 'marker: data loop')}" in message


def _write_forms(tmp_path, function, args) -> dict:
    """The program as each file `neuronc compile` reads: StableHLO text, a portable artifact, a jax.export artifact."""
    exported = jax.export.export(jax.jit(function), platforms=["cpu"])(*args)
    paths = {"mlir": tmp_path / "program.mlir", "mlirbc": tmp_path / "program.mlirbc", "jax": tmp_path / "program.jax"}
    paths["mlir"].write_text(jax.jit(function).lower(*args).as_text(debug_info=True))
    paths["mlirbc"].write_bytes(bytes(exported.mlir_module_serialized))
    paths["jax"].write_bytes(bytes(exported.serialize()))
    return paths


@pytest.mark.parametrize("form", ["mlir", "mlirbc", "jax"])
def test_cli_compiles_stablehlo_and_jax_export_files(cli, tmp_path, form):
    function, (params, x) = jax_programs.build("mlp")
    path = _write_forms(tmp_path, function, (params, x))[form]
    assert "stablehlo.dot_general" in cli("hlo", path).output
    assert cli("compile", path, "-o", tmp_path / "mlp.neff", "-O1").exit_code == 0
    inputs = jax.tree_util.tree_leaves((params, x))  # the module's arguments, in JAX's flattening order
    for i, array in enumerate(inputs):
        np.save(tmp_path / f"in{i}.npy", np.asarray(array))
    result = cli("run", tmp_path / "mlp.neff", *[a for i in range(len(inputs)) for a in ("-i", tmp_path / f"in{i}.npy")],
                 "-o", tmp_path / "out.npz")
    assert result.exit_code == 0, result.output
    got = np.load(tmp_path / "out.npz")["output0"]
    np.testing.assert_allclose(got, np.asarray(jax.jit(function)(params, x)), **tolerance(np.float32))


def test_cli_check_lists_every_unsupported_op_of_a_stablehlo_file(cli, tmp_path):
    def program(x, n):
        y = jax.lax.while_loop(lambda v: v.sum() < x.sum(), lambda v: v * 2, x[0])  # marker: check loop
        return y + jax.lax.linalg.tridiagonal_solve(n[0], n[1], n[2], n[:, :1]).sum()  # marker: check gtsv

    path = _write_forms(tmp_path, program, (jnp.ones((4, 8)), jnp.eye(4)))["mlir"]
    result = cli("check", path)
    assert result.exit_code == 1, result.output
    assert "stablehlo.while (1 of 1 uses)" in result.output, result.output
    assert "stablehlo.custom_call (1 of 1 uses)" in result.output
    assert f"{__file__}:{line_of(__file__, 'marker: check loop')}" in result.output
    assert f"{__file__}:{line_of(__file__, 'marker: check gtsv')}" in result.output
    compiled = cli("compile", path, "-o", tmp_path / "out.neff")
    assert compiled.exit_code == 1 and "2 op(s)" in compiled.output  # the loop, gtsv
    assert not (tmp_path / "out.neff").exists()


def test_cli_check_asks_the_passes_too_not_only_the_importer(cli, tmp_path):
    def program(x, init):  # the importer takes the pooling; legalize refuses its run-time initial value
        return jax.lax.reduce_window(x, init, jax.lax.max, (2, 2), (1, 1), "VALID") + 1  # marker: legalize refuses

    result = cli("check", _write_forms(tmp_path, program, (jnp.ones((4, 4)), jnp.float32(0.5)))["mlir"])
    assert result.exit_code == 1
    assert "stablehlo.reduce_window (1 of 1 uses): a pooling window with a non-constant initial value is not " \
           "supported yet" in result.output
    assert f"test_jax.py:{line_of(__file__, 'marker: legalize refuses')}" in result.output
    assert "stablehlo.add" not in result.output


def test_cli_check_passes_a_supported_program(cli, tmp_path):
    function, args = jax_programs.build("transformer_block")
    result = cli("check", _write_forms(tmp_path, function, args)["jax"])
    assert result.exit_code == 0, result.output
    assert "compile for trn2 at -O2" in result.output


@pytest.mark.parametrize("damage", ["truncated text", "truncated artifact", "garbage"])
def test_a_damaged_stablehlo_file_is_refused_with_a_message(cli, tmp_path, damage):
    function, args = jax_programs.build("mlp")
    paths = _write_forms(tmp_path, function, args)
    bad = tmp_path / "bad.mlir" if damage == "truncated text" else tmp_path / "bad.bin"
    if damage == "truncated text":
        bad.write_text(paths["mlir"].read_text()[:300])
    elif damage == "truncated artifact":
        bad.write_bytes(paths["jax"].read_bytes()[:200])
    else:
        bad.write_bytes(bytes(range(256)) * 4)
    result = cli("compile", bad, "-o", tmp_path / "bad.neff")
    assert result.exit_code == 1
    assert f"error: {bad}" in result.output and "hint:" in result.output
    assert not (tmp_path / "bad.neff").exists()


def test_shape_polymorphic_exports_are_refused():
    from neuronc.frontend.stablehlo_program import exported_program

    batch, = jax.export.symbolic_shape("b")
    exported = jax.export.export(jax.jit(jnp.tanh), platforms=["cpu"])(jax.ShapeDtypeStruct((batch, 4), jnp.float32))
    with pytest.raises(NeuronCompileError, match="one program per shape"):
        exported_program(exported, "tanh")


def test_read_program_names_a_missing_file(tmp_path):
    from neuronc.frontend.stablehlo_program import read_program

    with pytest.raises(ModelLoadError, match="no such file"):
        read_program(tmp_path / "nope.mlir")


def test_a_jitted_function_is_compiled_once_across_jit_objects_through_the_compile_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("NEURON_CC_FLAGS", "")
    monkeypatch.setenv("NEURON_COMPILE_CACHE_URL", str(tmp_path / "cache"))
    function, args = jax_programs.build("mlp")
    first, second = neuronc.jax.jit(function), neuronc.jax.jit(function)
    first(*args)
    got = second(*args)
    hits = [program.compiled.cache_hit for jitted in (first, second) for program in jitted.programs.values()]
    assert hits == [False, True]
    assert_matches_jax(got, jax.jit(function)(*args))


def _dropout_with_noise(key, x):
    k1, k2 = jax.random.split(key)
    mask = jax.random.bernoulli(k1, 0.9, x.shape)
    return jnp.where(mask, x / 0.9, 0.0) + jax.random.normal(k2, x.shape) * 0.01


def _draws(key):
    k1, k2, k3, k4, k5 = jax.random.split(key, 5)
    return {"uniform": jax.random.uniform(k1, (3, 5)), "normal": jax.random.normal(k2, (64,)),
            "randint": jax.random.randint(k3, (2, 7), -5, 100), "fold_in": jax.random.fold_in(k4, 7), "bits": jax.random.bits(k5, (4,)), "permutation": jax.random.permutation(k5, 10)}


def assert_same_draws(got, want):
    """Integer draws (keys, bits, randint, permutations) bit for bit; floats within fp32's tolerance."""
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for g, w in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert g.dtype == w.dtype and g.shape == w.shape
        if jnp.issubdtype(w.dtype, jnp.floating):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), **tolerance(w.dtype))
        else:
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_dropout_and_noise_drawn_inside_jit_match_jax():
    key, x = jax.random.PRNGKey(0), np.ones((4, 8), np.float32)
    assert_same_draws(neuronc.jax.jit(_dropout_with_noise)(key, x), jax.jit(_dropout_with_noise)(key, x))


def test_jax_random_draws_from_a_raw_key_match_jax_bit_for_bit():
    key = jax.random.PRNGKey(3)
    assert_same_draws(neuronc.jax.jit(_draws)(key), jax.jit(_draws)(key))


_ALGORITHMS = [jax.lax.RandomAlgorithm.RNG_DEFAULT, jax.lax.RandomAlgorithm.RNG_THREE_FRY,
               jax.lax.RandomAlgorithm.RNG_PHILOX]


def _assert_bits_equal(got, want):
    """Each output of jax.jit's dtype and shape, its bits equal."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (g.dtype, g.shape, w.dtype, w.shape)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("algorithm", _ALGORITHMS, ids=["default", "three_fry", "philox"])
def test_rng_bit_generator_gives_xla_cpus_bits_and_new_state_for_each_algorithm(algorithm):
    def draws(key):  # 5 x 7: no even dimension (ThreeFry's halves) and 35 words, not a multiple of Philox's 4
        outputs = []
        for shape, dtype in [((5, 7), jnp.uint32), ((2, 3, 4), jnp.uint32), ((), jnp.uint32), ((3, 5), jnp.uint8),
                             ((7,), jnp.uint16)]:
            outputs.extend(jax.lax.rng_bit_generator(key, shape, dtype=dtype, algorithm=algorithm))
        return outputs

    key = np.array([0x12345678, 0x9ABCDEF0, 0xDEADBEEF, 0x0BADF00D], np.uint32)
    _assert_bits_equal(neuronc.jax.jit(draws)(key), jax.jit(draws)(key))


@pytest.mark.parametrize("algorithm", _ALGORITHMS, ids=["default", "three_fry", "philox"])
def test_rng_bit_generator_64_bit_bits_and_a_counter_past_2_to_the_64(algorithm):
    def draws(key):
        return [*jax.lax.rng_bit_generator(key, (3, 5), dtype=jnp.uint64, algorithm=algorithm),
                *jax.lax.rng_bit_generator(key, (9,), dtype=jnp.uint32, algorithm=algorithm)]

    with jax.enable_x64(True):
        for key in (np.array([7, 9, 0xFFFFFFFE, 0xFFFFFFFF], np.uint32),  # the counter's low half wraps mid-draw
                    np.array([0x0123456789ABCDEF, 2 ** 64 - 3], np.uint64)):  # JAX's older u64[2] key
            _assert_bits_equal(neuronc.jax.jit(draws)(key), jax.jit(draws)(key))


def test_a_stablehlo_files_philox_state_of_three_words_advances_as_xlas(cli, tmp_path):
    module = """
    func.func @main(%state: tensor<3xui64>) -> (tensor<3xui64>, tensor<5x3xui32>, tensor<3xui64>, tensor<4xui64>) {
      %0:2 = stablehlo.rng_bit_generator %state, algorithm = PHILOX : (tensor<3xui64>) -> (tensor<3xui64>, tensor<5x3xui32>)
      %1:2 = stablehlo.rng_bit_generator %0#0, algorithm = PHILOX : (tensor<3xui64>) -> (tensor<3xui64>, tensor<4xui64>)
      return %0#0, %0#1, %1#0, %1#1 : tensor<3xui64>, tensor<5x3xui32>, tensor<3xui64>, tensor<4xui64>
    }"""
    state = np.array([0x0123456789ABCDEF, 2 ** 64 - 5, 41], np.uint64)  # the counter's low word wraps in the second draw
    want = run_xla(module, [state])  # XLA's CPU
    (tmp_path / "rng.mlir").write_text(module)
    np.save(tmp_path / "state.npy", state)
    assert cli("compile", tmp_path / "rng.mlir", "-o", tmp_path / "rng.neff").exit_code == 0
    result = cli("run", tmp_path / "rng.neff", "-i", tmp_path / "state.npy", "-o", tmp_path / "out.npz")
    assert result.exit_code == 0, result.output
    got = np.load(tmp_path / "out.npz")
    assert want[2][2] == 42  # the carry reached the counter's high word
    for i, expected in enumerate(want):
        np.testing.assert_array_equal(got[f"output{i}"], expected)
        assert got[f"output{i}"].dtype == expected.dtype


def _rbg_draws(key):
    k1, k2, k3, k4 = jax.random.split(key, 4)
    return {"uniform": jax.random.uniform(k1, (3, 5)), "normal": jax.random.normal(k2, (7,)),
            "randint": jax.random.randint(k3, (2, 7), -5, 100), "bits": jax.random.bits(k4, (5,), jnp.uint8),
            "fold_in": jax.random.key_data(jax.random.fold_in(k4, 7)), "permutation": jax.random.permutation(k1, 10),
            "keys": jax.random.key_data(jax.random.split(k2, 3))}


@pytest.mark.parametrize("impl", ["rbg", "unsafe_rbg"])
def test_jax_random_draws_with_the_rbg_implementations_match_jax_bit_for_bit(impl):
    key = jax.random.key(42, impl=impl)
    assert_same_draws(neuronc.jax.jit(_rbg_draws)(key), jax.jit(_rbg_draws)(key))


def test_the_default_prng_implementation_set_to_rbg_is_followed():
    def dropout(x):
        key = jax.random.key(0)  # made inside: the process's default implementation
        return jnp.where(jax.random.bernoulli(key, 0.5, x.shape), x, 0.0), jax.random.key_data(key)

    x = np.arange(1, 41, dtype=np.float32).reshape(5, 8)
    with jax.default_prng_impl("rbg"):
        got, want = neuronc.jax.jit(dropout)(x), jax.jit(dropout)(x)
    assert want[1].shape == (4,)  # an rbg key, not threefry's (2,)
    assert_same_draws(got, want)


def test_a_bitcast_to_a_type_of_another_width_is_little_endian_as_xla():
    def bitcasts(x, words):
        return (jax.lax.bitcast_convert_type(x, jnp.uint8), jax.lax.bitcast_convert_type(x, jnp.int16),
                jax.lax.bitcast_convert_type(words, jnp.float32), jax.lax.bitcast_convert_type(words[:, :2], jnp.int16))

    x = np.array([[1.5, -0.0, np.inf], [3e-39, -2.75, 1e30]], np.float32)
    words = np.arange(24, dtype=np.uint8).reshape(6, 4) * 11
    _assert_bits_equal(neuronc.jax.jit(bitcasts)(x, words), jax.jit(bitcasts)(x, words))


def test_a_typed_key_goes_in_and_comes_back_out_as_a_typed_key():
    def step(key):
        key, sub = jax.random.split(key)
        return jax.random.uniform(sub, (4,)), jax.random.fold_in(key, 1)

    key = jax.random.key(9)
    (got, got_key), (want, want_key) = neuronc.jax.jit(step)(key), jax.jit(step)(key)
    assert jnp.issubdtype(got_key.dtype, jax.dtypes.prng_key)
    np.testing.assert_array_equal(np.asarray(jax.random.key_data(got_key)), np.asarray(jax.random.key_data(want_key)))
    assert_same_draws(got, want)


def test_unsigned_integer_ops_wrap_and_shift_as_jax_does():
    def ops(a, s, i):
        return (~a, a << s, a >> s, a * jnp.uint32(2654435761) + a, (a - 5).astype(jnp.uint16),
                jax.lax.shift_right_arithmetic(i, s.astype(jnp.int32)), jax.lax.bitcast_convert_type(a, jnp.float32))

    a = np.array([0, 1, 2 ** 31, 2 ** 32 - 1, 12345678, 7, 3, 99], np.uint32)
    s = np.array([0, 1, 31, 32, 40, 5, 3, 16], np.uint32)  # 32 and 40: past the width, 0 (sign fill for arithmetic)
    i = np.array([-1, 5, -2 ** 31, 2 ** 31 - 1, -77, 123, -3, 0], np.int32)
    for got, want in zip(neuronc.jax.jit(ops)(a, s, i), jax.jit(ops)(a, s, i)):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8), np.asarray(want).view(np.uint8))  # the bits


def test_a_jax_export_with_shardy_annotations_is_refused_with_the_setting_that_avoids_them():
    from neuronc.frontend.stablehlo_program import exported_program, import_program

    def draw(key):
        return jax.random.uniform(key, (4,))

    exported = jax.export.export(jax.jit(draw), platforms=["cpu"])(jax.random.key(9))  # JAX's default: Shardy
    with pytest.raises(ModelLoadError, match="jax_use_shardy_partitioner"):
        import_program(exported_program(exported, "draw"))


def test_gathers_clamp_and_scatters_drop_indices_outside_the_operand_as_jax_does():
    def indexing(x, i, u):
        return (jnp.take(x, i, axis=0, mode="clip"), jnp.take(x, i, axis=0, mode="fill", fill_value=0.5),
                x.at[i].set(u), x.at[i].add(u), x.at[i].get(), x.at[i, 1:].set(u[:, :3]))

    x, u = jnp.arange(24.0).reshape(6, 4), -jnp.ones((4, 4))
    i = np.array([-9, 2, 6, 40], np.int32)  # before the start (past -6), inside, one past the end, far past it
    for got, want in zip(neuronc.jax.jit(indexing)(x, i, u), jax.jit(indexing)(x, i, u)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_searches_with_unsigned_indices_compile_and_match_jax():
    grid = jnp.linspace(-2.0, 2.0, 9)

    def search(sorted_values, v):  # jnp.searchsorted and jnp.interp index with uint32 positions
        return jnp.searchsorted(sorted_values, v), jnp.interp(v, grid, jnp.sin(grid)), jnp.digitize(v, grid)

    sorted_values = np.sort(np.random.default_rng(0).standard_normal(20).astype(np.float32))
    v = np.array([-5.0, -1.5, 0.0, 0.3, 1.99, 2.0, 7.0], np.float32)  # outside the grid both ways, on its edge
    assert_matches_jax(neuronc.jax.jit(search)(sorted_values, v), jax.jit(search)(sorted_values, v))


@pytest.mark.parametrize("source", [jnp.float32, jnp.bfloat16], ids=["fp32", "bf16"])
def test_float_to_integer_conversion_saturates_as_xla_does(source):
    def convert(x):
        x = x.astype(source)
        return tuple(x.astype(t) for t in (jnp.int32, jnp.uint32, jnp.int16, jnp.int8, jnp.uint8))

    x = np.array([np.nan, np.inf, -np.inf, 3e9, -3e9, 2.0 ** 31, -2.0 ** 31, 70000.0, -300.0, 255.9, 256.0, -0.9,
                  -1.0, 127.5, -128.7, 1.5], np.float32)
    for got, want in zip(neuronc.jax.jit(convert)(x), jax.jit(convert)(x)):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("pooling", ["max 2x2 stride 2", "max 3x3 stride 2 same", "min 3x3 stride 1 same"])
def test_pooling_gradients_choose_the_position_jax_chooses(pooling):
    kind, size, stride = pooling.split()[0], int(pooling.split()[1][0]), int(pooling.split()[3])
    reduce, init = (jax.lax.max, -jnp.inf) if kind == "max" else (jax.lax.min, jnp.inf)

    def loss(w, x):  # a convolution, then pooling: its gradient is one stablehlo.select_and_scatter
        h = jax.nn.relu(jax.lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")))
        pooled = jax.lax.reduce_window(h, init, reduce, (1, size, size, 1), (1, stride, stride, 1),
                                       "SAME" if "same" in pooling else "VALID")
        return jnp.sum(pooled ** 2)

    rng = np.random.default_rng(1)
    w, x = rng.standard_normal((3, 3, 2, 4)).astype(np.float32), rng.standard_normal((2, 9, 9, 2)).astype(np.float32)
    x[0, :3, :3] = 0.0  # windows of equal values (after the ReLU): the first is chosen
    grad = jax.grad(loss, argnums=(0, 1))
    assert_matches_jax(neuronc.jax.jit(grad)(w, x), jax.jit(grad)(w, x))


def test_scatters_combining_by_max_min_and_product_match_jax():
    def combine(x, i, u, data, segments, xi, ui):
        return (x.at[i].max(u), x.at[i].min(u), x.at[i].multiply(u), jax.ops.segment_max(data, segments, 5),
                jax.ops.segment_min(data, segments, 5), xi.at[i].max(ui), xi.at[i].multiply(ui))

    rng = np.random.default_rng(2)
    i = np.array([1, 1, 3, 9, -8], np.int32)  # a repeated row; 9 and -8 are outside: dropped
    u = rng.standard_normal(5).astype(np.float32)
    u[0] = np.nan  # max and min propagate it
    args = (rng.standard_normal(6).astype(np.float32), i, u, rng.standard_normal((10, 3)).astype(np.float32),
            np.array([0, 0, 1, 4, 4, 4, 2, 2, 0, 7], np.int32), rng.integers(-100, 100, 6).astype(np.int32),
            rng.integers(-10 ** 5, 10 ** 5, 5).astype(np.int32))  # the int32 product wraps
    got, want = neuronc.jax.jit(combine)(*args), jax.jit(combine)(*args)
    assert_matches_jax(got[2], want[2])  # a float product, formed in another order
    for g, w in zip(got[:2] + got[3:], want[:2] + want[3:]):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_tan_cbrt_and_rounding_away_from_zero_match_jax():
    def ops(x):
        return jnp.tan(x), jnp.cbrt(x), jax.lax.round(x, jax.lax.RoundingMethod.AWAY_FROM_ZERO)

    x = np.array([0.5, -0.5, 1.5, 2.5, -2.5, 0.49999997, -0.3, 8.0, -27.0, 1e-30, 3e38, 1.2, -3.7, np.inf, -np.inf,
                  np.nan], np.float32)  # 0.49999997 + 0.5 rounds to 1 in fp32: the fraction must be compared exactly
    assert_matches_jax(neuronc.jax.jit(ops)(x), jax.jit(ops)(x))


def test_zeros_keep_their_sign_through_sign_rounding_cube_roots_and_floor_division_as_in_jax():
    """StableHLO's sign(-0.0) is -0.0 (the IR's SIGN, PyTorch's, gives +0.0): sign, round away from zero, cbrt and
    jnp.floor_divide (rounded away from zero at its end) of -0.0 gave +0.0."""
    def ops(x, y):
        return jnp.sign(x), jax.lax.round(x), jnp.cbrt(x), jnp.floor_divide(x, y), jnp.negative(x), jnp.sqrt(x)

    x = np.array([0.0, -0.0, -0.0, 0.0, -0.3, 2.5, np.nan, -np.inf], np.float32)
    y = np.array([1.0, -1.0, 2.0, -3.0, 1.0, -2.0, 1.0, 2.0], np.float32)
    got, want = neuronc.jax.jit(ops)(x, y), jax.jit(ops)(x, y)
    assert_matches_jax(got, want)
    for g, w in zip(got, want):
        numbers = ~np.isnan(np.asarray(w))
        assert np.array_equal(np.signbit(np.asarray(g))[numbers], np.signbit(np.asarray(w))[numbers])


@pytest.mark.parametrize("dtype", [np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32])
def test_population_count_and_leading_zeros_match_jax(dtype):
    info = np.iinfo(dtype)
    edges = [0, 1, info.max, info.min] + ([-1] if info.min < 0 else [2])
    x = np.concatenate([np.random.default_rng(3).integers(info.min, info.max, 60, endpoint=True), edges]).astype(dtype)

    def bits(x):
        return jax.lax.population_count(x), jax.lax.clz(x)

    for got, want in zip(neuronc.jax.jit(bits)(x), jax.jit(bits)(x)):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_padding_with_a_run_time_value_and_cropping_after_interior_padding_match_jax():
    def padded(x, v):
        return (jax.lax.pad(x, v, ((1, 2, 1), (0, 1, 0))), jax.lax.pad(x, v, ((-1, 2, 1), (1, -2, 2))),
                jax.lax.pad(x, np.float32(-7.0), ((0, 0, 0), (-2, -2, 4))))

    x = np.arange(1.0, 7.0, dtype=np.float32).reshape(2, 3)
    assert_matches_jax(neuronc.jax.jit(padded)(x, np.float32(9.5)), jax.jit(padded)(x, np.float32(9.5)))


def test_a_reduction_of_several_operands_each_reduced_on_its_own_matches_jax():
    def max_and_min(x, y):
        return jax.lax.reduce((x, y), (np.float32(3.0), np.int32(3)),
                              lambda a, b: (jnp.maximum(a[0], b[0]), jnp.minimum(a[1], b[1])), (0,))

    x, y = np.random.default_rng(4).standard_normal((4, 6)).astype(np.float32) * 4, np.arange(24, dtype=np.int32).reshape(4, 6) - 9
    assert_matches_jax(neuronc.jax.jit(max_and_min)(x, y), jax.jit(max_and_min)(x, y))


def test_approximate_top_k_is_the_exact_top_k_as_on_the_cpu():
    def nearest(x):
        return jax.lax.approx_max_k(x, 5), jax.lax.approx_min_k(x, 3, reduction_dimension=0)

    x = np.random.default_rng(5).permutation(24 * 40).astype(np.float32).reshape(24, 40)  # distinct: no tie order
    for got, want in zip(jax.tree_util.tree_leaves(neuronc.jax.jit(nearest)(x)),
                         jax.tree_util.tree_leaves(jax.jit(nearest)(x))):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_window_reductions_with_other_bodies_match_jax():
    def windows(x, t):
        pool = lambda v: jax.lax.reduce_window(v, -jnp.inf, jax.lax.max, (2, 2), (1, 2), "SAME")  # noqa: E731
        return jax.lax.cumlogsumexp(x, axis=1), jax.jvp(pool, (x,), (t,))  # logaddexp; a max-pool's JVP: pairs

    rng = np.random.default_rng(6)
    x, t = rng.standard_normal((5, 9)).astype(np.float32) * 3, rng.standard_normal((5, 9)).astype(np.float32)
    assert_matches_jax(neuronc.jax.jit(windows)(x, t), jax.jit(windows)(x, t))


def test_dilated_window_reductions_match_jax():
    def dilated(x):
        return (jax.lax.reduce_window(x, 0.0, jax.lax.add, (2, 2), (1, 1), "VALID", window_dilation=(1, 2)),
                jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (2, 3), (2, 1), ((1, 0), (0, 2)), base_dilation=(2, 1)))

    x = np.random.default_rng(7).standard_normal((5, 9)).astype(np.float32)
    assert_matches_jax(neuronc.jax.jit(dilated)(x), jax.jit(dilated)(x))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16], ids=["bf16", "fp16"])
def test_16_bit_running_sums_and_pools_round_every_step_as_xla_does(dtype):
    def running(x):
        return jnp.cumsum(x, axis=0), jnp.cumprod(x * 0.5, axis=1), \
            jax.lax.reduce_window(x, 0.0, jax.lax.add, (3, 3), (1, 1), "SAME")

    x = (np.random.default_rng(8).standard_normal((8, 9)) * 4).astype(dtype)  # sums that cancel
    for got, want in zip(neuronc.jax.jit(running)(x), jax.jit(running)(x)):
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))  # the bits


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=["fp32", "bf16", "fp16"])
def test_reduce_precision_gives_xla_s_bits(dtype):
    def narrowed(x):
        return tuple(jax.lax.reduce_precision(x, e, m) for e, m in ((5, 10), (8, 7), (4, 3), (5, 2)))

    rng = np.random.default_rng(9)
    x = np.concatenate([rng.standard_normal(120) * 10.0 ** rng.integers(-8, 8, 120),  # past fp8's and fp16's range
                        [0.0, -0.0, np.inf, -np.inf, np.nan, 65504, 65520, 1.00048828125, 1.000244140625]])
    x = x.astype(dtype)
    for got, want in zip(neuronc.jax.jit(narrowed)(x), jax.jit(narrowed)(x)):
        np.testing.assert_array_equal(np.asarray(got).view(f"u{x.itemsize}"), np.asarray(want).view(f"u{x.itemsize}"))
