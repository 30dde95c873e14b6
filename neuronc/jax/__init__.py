"""`neuronc.jax.jit`: a JAX function compiled for the (emulated) NeuronCore, called as `jax.jit`'s is.

    import neuronc.jax
    step = neuronc.jax.jit(train_step, target="trn2", opt_level=2)
    params, loss = step(params, batch)       # pytrees of JAX (or numpy) arrays in, of JAX arrays out

Each call flattens its arguments as JAX does; the first call with a new pytree structure, shape or dtype
exports the function with `jax.export` (JAX's own lowering to StableHLO, for the CPU platform), and
neuronc compiles that module (frontend/stablehlo_program.py, through the compile cache, as torch graphs
are) and loads it on an emulated NeuronCore of its own; later calls with the same signature only run it.
Inputs are copied in, outputs come back as JAX arrays in the function's output pytree. JAX drops
arguments the function does not use; they are not copied. The process's JAX settings are left alone:
64-bit types exist only if the user turned on `jax_enable_x64` (JAX's default makes int32/float32).
"""
from __future__ import annotations

import logging

import numpy as np

log = logging.getLogger("neuronc")


def jit(fun, *, static_argnums=(), static_argnames=(), target: str | None = None, opt_level: int | None = None,
        **options):
    """`fun` compiled for the NeuronCore: `target` trn1 | trn2 | trn3 (default trn2), `opt_level` 0-3 (default
    2), and the other compile options (`auto_cast`, `auto_cast_type`) as torch.compile's `options` take them;
    NEURON_CC_FLAGS gives those not passed. `static_argnums` / `static_argnames` as `jax.jit` takes them: those
    arguments are Python values baked into the program (hashable; each new value compiles a new program)."""
    given = {"target": target, "opt_level": opt_level}
    return Jitted(fun, {**{k: v for k, v in given.items() if v is not None}, **options},
                  _as_tuple(static_argnums), _as_tuple(static_argnames))


def _as_tuple(value) -> tuple:
    return (value,) if isinstance(value, (int, str)) else tuple(value or ())


class Jitted:
    """A jitted function: one compiled program per input signature (pytree structure, shapes, dtypes, and the
    values of the static arguments)."""

    def __init__(self, fun, options: dict, static_argnums: tuple = (), static_argnames: tuple = ()):
        from neuronc.compiler import CompileOptions

        self.fun = fun
        self.name = getattr(fun, "__name__", "jax_function").strip("<>") or "jax_function"
        self.options = CompileOptions.from_dict({**options, "name": self.name})
        self.static_argnums, self.static_argnames = static_argnums, static_argnames
        self.programs: dict = {}  # signature -> _Program
        self.last_run = None  # the last RunResult (outputs as numpy, and the estimated device timeline)

    def __call__(self, *args, **kwargs):
        import jax

        static_positions = {i % len(args) for i in self.static_argnums if -len(args) <= i < len(args)}
        static = (tuple((i, args[i]) for i in sorted(static_positions)),
                  tuple(sorted((k, v) for k, v in kwargs.items() if k in self.static_argnames)))
        _check_hashable(static)
        dynamic = (tuple(a for i, a in enumerate(args) if i not in static_positions),
                   {k: v for k, v in kwargs.items() if k not in self.static_argnames})
        leaves, tree = jax.tree_util.tree_flatten(dynamic)
        arrays = [_as_array(leaf) for leaf in leaves]
        signature = (static, tree, tuple((a.shape, a.dtype) for a in arrays))
        program = self.programs.get(signature)
        if program is None:
            program = self.programs[signature] = self._compile(args, kwargs)
        self.last_run = program.loaded.run([arrays[i] for i in program.kept_inputs])
        outputs = [_as_jax(o, aval) for o, aval in zip(self.last_run.outputs, program.out_avals)]
        return jax.tree_util.tree_unflatten(program.out_tree, outputs)

    def compile_count(self) -> int:
        return len(self.programs)

    def _compile(self, args, kwargs) -> "_Program":
        import jax

        from neuronc.compiler import compile_stablehlo
        from neuronc.frontend.stablehlo_program import exported_program

        jitted = jax.jit(self.fun, static_argnums=self.static_argnums, static_argnames=self.static_argnames)
        with _without_shardy():
            exported = jax.export.export(jitted, platforms=["cpu"])(*args, **kwargs)
        compiled = compile_stablehlo(exported_program(exported, f"the JAX function {self.name}"), self.options,
                                     store_after_load=True)
        loaded = _load(compiled, self.options.target)  # before the estimate is read: the load settles it
        log.info("neuronc: JAX function %s compiled for %s (%d kernels, estimated %.1f us%s); inputs %s",
                 self.name, self.options.target, len(compiled.neff.kernels), compiled.neff.estimated_ns / 1e3,
                 " (from the compile cache)" if compiled.cache_hit else "",
                 ", ".join(aval.str_short() for aval in exported.in_avals))
        return _Program(compiled, loaded, tuple(exported.module_kept_var_idx), exported.out_tree,
                        tuple(exported.out_avals))


def _without_shardy():
    """A scope exporting with XLA's sharding annotations rather than Shardy's: JAX annotates every typed PRNG key
    (`jax.random.key`) with a sharding, and the MLIR that reads modules here (torch-mlir's) cannot read Shardy's
    dialect from bytecode; XLA's annotation is a custom call the importer reads as its operand. The process's
    setting is left as it was (JAX without the switch: the export as it is)."""
    import contextlib

    from jax._src import config

    switch = getattr(config, "use_shardy_partitioner", None)
    return switch(False) if switch is not None else contextlib.nullcontext()


def _check_hashable(static: tuple) -> None:
    from neuronc.errors import NeuronConfigError

    for where, value in (*static[0], *static[1]):
        try:
            hash(value)
        except TypeError:
            raise NeuronConfigError(f"static argument {where!r} is a {type(value).__name__}, which is not hashable",
                                    hint="pass a hashable value (a tuple rather than a list), or make the argument "
                                    "dynamic (an array)") from None


class _Program:
    def __init__(self, compiled, loaded, kept_inputs: tuple, out_tree, out_avals: tuple):
        self.compiled, self.loaded, self.kept_inputs, self.out_tree = compiled, loaded, kept_inputs, out_tree
        self.out_avals = out_avals


def _as_array(leaf) -> np.ndarray:
    """A pytree leaf as the numpy array JAX would make of it: Python and numpy numbers in JAX's default
    types (float32 and int32 unless jax_enable_x64 is on); a typed PRNG key (`jax.random.key`) as its key data
    (uint32 words), which is what the exported module takes for it."""
    import jax

    if _is_key(getattr(leaf, "dtype", None)):
        leaf = jax.random.key_data(leaf)
    array = np.asarray(leaf)
    dtype = jax.dtypes.canonicalize_dtype(array.dtype)
    return array if array.dtype == dtype else array.astype(dtype)


def _is_key(dtype) -> bool:
    import jax

    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def _as_jax(output: np.ndarray, aval):
    """An output as a JAX array of the exported function's result type: a typed PRNG key is rewrapped from its
    key data."""
    import jax

    if _is_key(aval.dtype):
        return jax.random.wrap_key_data(output, impl=aval.dtype._impl)
    return jax.numpy.asarray(output)


def _load(compiled, target: str):
    """The NEFF loaded on a NeuronCore of its own; the runtime's access check is skipped when the compile
    cache says the NEFF passed it, and recorded there when it passes now; a new NEFF is stored in the cache now
    (compile_stablehlo's ``store_after_load``), with the estimate this load settled."""
    from runtime import NeuronCore
    loaded = NeuronCore(target).load(compiled.neff, checked_by=compiled.checked_by())
    compiled.loaded(loaded.checked_now)
    return loaded
