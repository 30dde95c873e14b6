"""The compiler driver: graph in, NEFF out, one readable pipeline.

    import (frontend) -> passes (per optimisation level) -> memory plan -> codegen -> Neff

Used by the CLI (`neuronc compile`), the torch.compile backend and the tests alike.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import time
from typing import TYPE_CHECKING

from neuronc import debug_dir, ir, kernel_timing
from neuronc.cc_flags import compile_flags
from neuronc.codegen import generate
from neuronc.collector import collector_paused
from neuronc.errors import NeuronConfigError
from neuronc.isa import DType
from neuronc.neff.program import Neff
from neuronc.passes.auto_cast import AutoCast
from neuronc.passes.context import PassContext
from neuronc.passes.memory_plan import check_capacity, plan_memory
from neuronc.passes.pipeline import passes_for, run_pipeline
from neuronc.targets import get_target

if TYPE_CHECKING:  # torch is imported only by the frontend, when a program is compiled
    import torch

    from neuronc.frontend.torch_import import ImportedGraph

log = logging.getLogger("neuronc")

@dataclasses.dataclass
class CompileOptions:
    target: str = "trn2"
    opt_level: int = 2
    name: str = "main"
    auto_cast: str = "none"  # none | matmult | all: which fp32 ops compute in auto_cast_type; fp64-to-fp32 (alone
    # or after a comma): float64 inputs and outputs accepted, computed in fp32 (passes/auto_cast.py VALUES)
    auto_cast_type: str = "bf16"  # bf16 | fp16 | fp8_e4m3

    def __post_init__(self):
        get_target(self.target)
        passes_for(self.opt_level)  # an unknown level or auto-cast option is refused here, not mid-compile
        AutoCast.from_option(self.auto_cast, self.auto_cast_type)

    @property
    def cast(self) -> AutoCast:
        return AutoCast.from_option(self.auto_cast, self.auto_cast_type)

    @classmethod
    def from_dict(cls, options: dict | None) -> "CompileOptions":
        """From torch.compile's `options={...}`, with NEURON_CC_FLAGS applied underneath."""
        merged = dict(flags_from_env())
        merged.update(options or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(merged) - known)
        if unknown:
            raise NeuronConfigError(f"unknown compile option(s): {', '.join(unknown)}",
                                    hint=f"known options: {', '.join(sorted(known))}")
        return cls(**merged)


def flags_from_env() -> dict:
    """Options from NEURON_CC_FLAGS (`--target trn1 -O1 --auto-cast matmult --auto-cast-type bf16`), the
    real toolchain's convention; an unknown flag or a bad value is refused (see neuronc/cc_flags.py)."""
    return compile_flags()


@dataclasses.dataclass
class Compiled:
    neff: Neff
    stablehlo: str
    graph: ir.Graph | None  # the optimised graph (None when the NEFF came from the cache)
    seconds: dict  # time spent per stage: totals ("import", "passes", "codegen", ...) and, under keys
    # with a "/", their parts ("import/torch-mlir", "pass/legalize", "codegen/sync", ...)
    output_layout: list | None = None  # FX graphs: per output, its NEFF output index, None for a None, or
    # ("input", i) for an argument returned as it is (an object the program does not take, see input_mask, or
    # with compile_fx's inputs_returned_as_given a tensor input returned)
    cache_hit: bool = False
    cache_entry: tuple | None = None  # (CompileCache, key) where the NEFF is stored, when the cache is on
    pending_store: tuple | None = None  # (CompileCache, key) where the NEFF goes after its first load (`loaded`)
    input_mask: list | None = None  # FX graphs: per placeholder, whether the program takes it (None: all)
    collective_groups: list = dataclasses.field(default_factory=list)  # FX graphs: the process group of each
    # group number its collective instructions name (frontend/collectives.py)
    decisions: dict = dataclasses.field(default_factory=dict)  # priced pass -> (ns with it, ns without it)
    random_draws: int = 0  # FX graphs with random ops: numbers of the generator's stream a call uses; the NEFF's
    # last input is then the generator state (seed, offset) (frontend/random_draws.py)
    float64_outputs: tuple = ()  # with --auto-cast fp64-to-fp32: the NEFF outputs the program returns as float64
    # (fp32 in the NEFF; the host casts them back); float64 inputs are fp32 inputs of the NEFF, cast by the host

    def checked_by(self) -> str | None:
        """The runtime access check this NEFF passed in an earlier load, as its cache entry records."""
        return self.cache_entry[0].checked_by(self.cache_entry[1]) if self.cache_entry else None

    def mark_checked(self, checker: str) -> None:
        """Record in the cache entry that the NEFF passed the runtime access check `checker`."""
        if self.cache_entry:
            self.cache_entry[0].mark_checked(self.cache_entry[1], checker)

    def loaded(self, checker: str | None) -> None:
        """After a load of the NEFF (`checker`: the runtime access check it passed there, if it ran one): the NEFF
        stored in the cache if its store waited for this load (`store_after_load`), the verdict in the same write;
        else the verdict recorded in the entry. The first load settles a pending estimate (codegen.generate), so
        the store's encoding reads it instead of computing it: one simulation of the program, not two."""
        if self.pending_store is None:
            if checker is not None:
                self.mark_checked(checker)
            return
        (cache, key), self.pending_store = self.pending_store, None
        start = time.perf_counter()
        if cache.put(key, self.neff, checked_by=checker) is not None:
            self.cache_entry = (cache, key)
        self.seconds["cache store"] = time.perf_counter() - start  # NEFF serialisation + write


def compile_imported(imported: ImportedGraph, options: CompileOptions, timings: dict,
                     store_after_load: bool = False) -> Compiled:
    """Compile an imported graph, through the persistent cache (see neuronc/cache.py). With `store_after_load`, a
    new NEFF is stored by its caller's `Compiled.loaded` after the first load instead of here."""
    timings = {**timings, **imported.seconds}
    float64_outputs = tuple(i for i, o in enumerate(imported.graph.outputs) if o.dtype is DType.F64)
    compiled = _compile_imported(imported, options, timings, store_after_load)
    compiled.float64_outputs = float64_outputs
    return compiled


def _compile_imported(imported: ImportedGraph, options: CompileOptions, timings: dict,
                      store_after_load: bool) -> Compiled:
    from neuronc.cache import CompileCache, cache_key

    cache = CompileCache.from_env()
    key = None
    if cache is not None:
        start = time.perf_counter()
        weights = {p.attrs["name"]: p.attrs["data"] for p in imported.graph.params if p.attrs["kind"] == "weight"}
        key = cache_key(imported.fingerprint, dataclasses.asdict(options), weights)
        neff = cache.get(key)
        timings["cache lookup"] = time.perf_counter() - start
        if neff is not None:
            log.info("neuronc: %s: compile cache hit (%s)", options.name, cache.directory)
            return Compiled(neff, imported.stablehlo, None, timings, cache_hit=True, cache_entry=(cache, key))
    compiled = compile_graph(imported.graph, options, imported.stablehlo, timings)
    if key is not None and store_after_load:
        compiled.pending_store = (cache, key)
    elif key is not None:
        start = time.perf_counter()
        if cache.put(key, compiled.neff) is not None:
            compiled.cache_entry = (cache, key)
        compiled.seconds["cache store"] = time.perf_counter() - start  # NEFF serialisation + write
    return compiled


def compile_graph(graph: ir.Graph, options: CompileOptions, stablehlo: str = "", timings: dict | None = None) -> Compiled:
    """`graph` compiled to a NEFF. Below -O3 its estimated_ns are computed when first read, or settled by its first
    load (codegen.generate: no decision of those levels reads them)."""
    timings = dict(timings or {})
    target = get_target(options.target)
    t = time.perf_counter()
    ctx = PassContext(target, options.opt_level, options.cast, verify=options.opt_level == 0 or debug_dir.verifying())
    emitted = {}  # id of a finished graph -> (the graph, its NEFF, its stages' seconds): the priced decisions'

    def price(candidate: ir.Graph) -> float:
        """The cost model's time of the program a finished graph compiles to (emitted once, kept if chosen)."""
        if id(candidate) not in emitted:
            seconds, start = {}, time.perf_counter()
            plan = plan_memory(candidate)
            check_capacity(plan, target)
            seconds["memory plan"], start = time.perf_counter() - start, time.perf_counter()
            neff = generate(candidate, plan, target, options.name, seconds, prefetch=options.opt_level >= 2,
                            idle_queue_time=options.opt_level >= 3)
            seconds["codegen"] = time.perf_counter() - start
            emitted[id(candidate)] = (candidate, neff, seconds)
        return emitted[id(candidate)][1].estimated_ns

    ctx.price = price
    if options.opt_level >= 2:  # a folded norm's few best-priced schedules, each in its kernel timed (a few small
        # kernels per distinct norm: passes/norm_prologue.py PROLOGUE_TIMED; GPT-2-small's block +0.3-0.5 CPU s), and an
        # attention's first heads from rows or not (passes/attention.py: two kernels per distinct attention)
        ctx.choice_time = lambda node: kernel_timing.kernel_time(node, target, prefetch=True)
    if options.opt_level >= 3:  # each tiling candidate emitted alone and timed: ~2.5x the compile time of a model
        # (12-layer GPT-2-small bf16, 4.6 -> 11.6 CPU s), so at -O3 only, where compile time is traded for search
        ctx.kernel_time = lambda node: kernel_timing.kernel_time(node, target, prefetch=options.opt_level >= 2)
    graph = run_pipeline(graph, ctx, timings)
    if id(graph) in emitted:  # priced (passes/pipeline.py PRICED): emitted already; the others' stages are "pricing"
        _, neff, seconds = emitted[id(graph)]
        timings.update(seconds)
        timings["pricing"] = sum(s["memory plan"] + s["codegen"] for g, _, s in emitted.values() if g is not graph)
        timings["passes"] = time.perf_counter() - t - timings["pricing"] - seconds["memory plan"] - seconds["codegen"]
        return Compiled(neff, stablehlo, graph, timings, decisions=ctx.decisions)
    timings["passes"] = time.perf_counter() - t
    t = time.perf_counter()
    plan = plan_memory(graph)
    check_capacity(plan, target)
    timings["memory plan"] = time.perf_counter() - t
    t = time.perf_counter()
    # -O3: loads placed into idle DMA queue time, from the estimated timeline, at the price of a second sync pass and
    # estimate (+15-40% of codegen for a 12-layer GPT-2; its estimate -0.2%, gpt2_train's -2%: docs/performance.md)
    neff = generate(graph, plan, target, options.name, timings, prefetch=options.opt_level >= 2,
                    idle_queue_time=options.opt_level >= 3)
    timings["codegen"] = time.perf_counter() - t
    return Compiled(neff, stablehlo, graph, timings, decisions=ctx.decisions)


def compile_exported(program: torch.export.ExportedProgram | str | os.PathLike, options: CompileOptions | None = None) -> Compiled:
    """Compile a torch.export ExportedProgram (or the path of a saved one)."""
    from neuronc.frontend.exported import import_exported_program, load_exported_program

    options = options or CompileOptions()
    t = time.perf_counter()
    if isinstance(program, (str, os.PathLike)):
        program = load_exported_program(program)
    with collector_paused():
        imported, weights = import_exported_program(program, options.name)
        for param in imported.graph.params:
            if param.attrs["kind"] == "weight":
                param.attrs["data"] = weights[param.attrs["name"]]
        compiled = compile_imported(imported, options, {"import": time.perf_counter() - t})
    debug_dir.keep(compiled, program.graph_module.code)
    return compiled


def compiled_apart(node) -> str | None:
    """compile_fx's verdict on an op it cuts out of the graph before torch-mlir (which lowers neither): a functional
    collective (a collective instruction, or why it cannot be one) and a random op (a draw of the device's
    generator); None for the others."""
    from neuronc.frontend import collectives, random_draws

    if collectives.is_collective(node):
        return collectives.refusal(node)
    return "" if random_draws.is_random(node) else None


def compile_fx(gm: torch.fx.GraphModule, options: CompileOptions | None = None,
               inputs_returned_as_given: bool = False, store_after_load: bool = False) -> Compiled:
    """Compile a stateless FX graph (every placeholder an input), e.g. from AOTAutograd. With
    ``inputs_returned_as_given``, an output that is an input is no NEFF output: output_layout says which argument
    the caller returns (torch.compile's backend does; a caller reading the NEFF's outputs alone must not ask).
    ``store_after_load``: see compile_imported (a caller that loads the NEFF and then calls `Compiled.loaded`)."""
    from neuronc.frontend.collectives import Collectives, cut_collectives, has_collectives, splice_collectives
    from neuronc.frontend.random_draws import Draws, cut_random_ops, has_random_ops, splice_draws
    from neuronc.frontend.torch_import import (drop_none_outputs, drop_opaque_values, import_fx, node_locations,
                                               placeholders_first)

    options = options or CompileOptions()
    t = time.perf_counter()
    with collector_paused():
        placeholders_first(gm)
        mask, passed = drop_opaque_values(gm, inputs_returned_as_given)
        computed = drop_none_outputs(gm)
        rest = iter(computed)
        layout = [("input", passed[i]) if i in passed else next(rest) for i in range(len(passed) + len(computed))]
        draws = cut_random_ops(gm, node_locations(gm)) if has_random_ops(gm) else Draws([])
        collectives = cut_collectives(gm) if has_collectives(gm) else Collectives([], [])
        params = [(n.name, "input") for n in gm.graph.nodes if n.op == "placeholder"]
        imported = import_fx(gm, params, options.name)
        if collectives.cuts:
            imported.graph = splice_collectives(imported.graph, collectives)
            imported.fingerprint = hashlib.sha256((imported.fingerprint + collectives.fingerprint()).encode()).hexdigest()
        if draws.draws:
            imported.graph = splice_draws(imported.graph, draws)
            imported.fingerprint = hashlib.sha256((imported.fingerprint + draws.fingerprint()).encode()).hexdigest()
        compiled = compile_imported(imported, options, {"import": time.perf_counter() - t}, store_after_load)
    compiled.output_layout = layout
    compiled.input_mask = None if all(mask) else mask
    compiled.collective_groups = collectives.groups
    compiled.random_draws = draws.count
    debug_dir.keep(compiled, lambda: gm.code)  # (the FX code made only to be kept: a lazy module has none yet)
    return compiled


def compile_stablehlo(program, options: CompileOptions | None = None, store_after_load: bool = False) -> Compiled:
    """Compile a StableHLO program: a `.mlir`/`.mlirbc` file or jax.export artifact (its path), or a
    frontend.stablehlo_program.StableHLOProgram (a JAX function's, from neuronc.jax). Every argument of
    its func @main is a NEFF input. ``store_after_load``: see compile_imported."""
    from neuronc.frontend.stablehlo_program import import_program, read_program

    options = options or CompileOptions()
    t = time.perf_counter()
    if isinstance(program, (str, os.PathLike)):
        program = read_program(program)
    with collector_paused():
        imported = import_program(program, options.name)
        compiled = compile_imported(imported, options, {"import": time.perf_counter() - t}, store_after_load)
    debug_dir.keep(compiled)
    return compiled


def compile_file(path, options: CompileOptions | None = None) -> Compiled:
    """`neuronc compile`: a saved ExportedProgram (.pt2), or StableHLO (.mlir, .mlirbc, a jax.export artifact)."""
    from neuronc.frontend.stablehlo_program import is_stablehlo_file

    return compile_stablehlo(path, options) if is_stablehlo_file(path) else compile_exported(path, options)
