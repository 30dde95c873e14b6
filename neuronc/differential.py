"""`neuronc bisect` / `neuronc.bisect`: the first op whose result the NEFF gets wrong, and the pass that broke it.

How (the simplest honest design we found):

* Reference: the StableHLO module the frontend made, changed to return every value it computes besides its
  results, run once on the user's inputs by a reference executor (reference.py: XLA on CPU through jaxlib,
  or the StableHLO interpreter for small graphs).
* NEFF: compiled from the same module, without the compile cache. The importer numbers every StableHLO
  value, and the node computing it carries the number (`Node.origin`) through the passes: `Graph.rewrite`
  hands it to the node that replaces it. After the passes, every node with a number whose value the NEFF
  keeps in HBM (a kernel's output, or a reshape of one) is watched: the runtime calls back when the
  kernel's last instruction has completed (`LoadedProgram.run_observed`), and the value is read from HBM
  there, before a later kernel can reuse that memory. Values that live only on chip, inside a fused kernel,
  are not seen: the NEFF never materialises them, so a fault inside a fused kernel shows at its output.
  Nothing is added to the program: the NEFF watched is the NEFF the compiler makes.
* Comparison: each watched value with its reference value, within the tolerance of its dtype
  (tolerances.py; with auto-cast, a float's within that of the type it was computed in). The first in
  program order (the StableHLO value numbering) outside it is the first divergence: its op, source line,
  the kernel it sits in, and its largest absolute and relative errors.
* Pass bisection: the pipeline of the -O level with only a prefix of its optional passes (those that -O0
  does without; the passes every compile needs always run) is compiled, run and compared like the whole; the
  first prefix that diverges ends with the pass after which the result diverges. Prefixes are searched by
  bisection: a later pass repairing what an earlier one broke is not looked for. A program that diverges
  even with no optional pass is wrong in a pass every compile needs, in codegen or in the runtime.
"""
from __future__ import annotations

import copy
import dataclasses
import os

import numpy as np

from neuronc import ir
from neuronc.compiler import CompileOptions
from neuronc.errors import InputMismatchError, NeuronCompileError
from neuronc.neff.program import DebugLoc


@dataclasses.dataclass
class Value:
    """A StableHLO value: its number, the op that makes it (as text), and where it came from."""

    number: int
    text: str
    loc: DebugLoc


@dataclasses.dataclass
class DebugProgram:
    """What the bisection needs of a program: the imported graph (nodes numbered), the StableHLO values, and
    the reference module: the program returning `returned` (value numbers) after its own `results` results."""

    graph: ir.Graph
    values: list  # of Value, by number
    reference_module: str
    results: int
    returned: list
    weights: dict  # parameter name -> array, for the arguments stored in the NEFF (kind "weight")
    origin: str

    def reference_arguments(self, inputs: list) -> list:
        """The arguments of func @main: the user's inputs and the weights, in parameter order."""
        user = iter(inputs)
        arguments = []
        for param in self.graph.params:
            arguments.append(self.weights[param.attrs["name"]] if param.attrs["kind"] == "weight" else next(user))
        return arguments


@dataclasses.dataclass
class Divergence:
    value: Value
    kernel: str  # the kernel computing it, with the ops fused into it
    max_abs: float
    max_rel: float
    outside: int  # elements outside the tolerance
    size: int
    tolerance: dict
    dtype: str


@dataclasses.dataclass
class _Run:
    compared: int  # values compared
    divergences: list  # Divergence, in program order
    kernels: int


@dataclasses.dataclass
class BisectReport:
    origin: str
    options: CompileOptions
    reference: str
    values: int  # StableHLO values in the program
    compared: int
    first: Divergence | None
    culprit: str = ""  # the pass after which it diverges, or why none is named
    levels: dict = dataclasses.field(default_factory=dict)  # -O level -> whether it diverges

    @property
    def diverges(self) -> bool:
        return self.first is not None

    def __str__(self) -> str:
        o = self.options
        lines = [f"{self.origin}: {o.target} at -O{o.opt_level}, reference {_REFERENCE_NAMES[self.reference]}",
                 f"  compared {self.compared} values the NEFF keeps in HBM (of {self.values} StableHLO values; "
                 "the others live only on chip, inside fused kernels)"]
        if self.first is None:
            lines.append("  no divergence: every value is within the tolerance of its dtype")
            return "\n".join(lines)
        d = self.first
        lines += [f"  first divergence: {d.value.text}",
                  f"    at {d.value.loc}",
                  f"    in kernel {d.kernel}",
                  f"    max abs error {d.max_abs:.4g}, max rel error {d.max_rel:.4g}; {d.outside} of {d.size} elements "
                  f"outside the {d.dtype} tolerance (rtol {d.tolerance['rtol']:g}, atol {d.tolerance['atol']:g})",
                  f"  {self.culprit}"]
        if self.levels:
            lines.append("  by level: " + ", ".join(f"-O{level} {'diverges' if bad else 'agrees'}"
                                                    for level, bad in sorted(self.levels.items())))
        return "\n".join(lines)


_REFERENCE_NAMES = {"xla": "XLA on CPU (jaxlib)", "interpreter": "the StableHLO reference interpreter"}


class Bisection(list):
    """The reports of every graph a torch.compile'd function ran (one per graph)."""

    @property
    def diverges(self) -> bool:
        return any(report.diverges for report in self)

    def __str__(self) -> str:
        return "\n".join(str(report) for report in self) if self else "no graph was compiled"


# -- the pipeline, behind one small interface (passes/pipeline.py decides what each level runs) ----------------

def pipeline(options: CompileOptions) -> list:
    """The passes of the options' level, in order."""
    from neuronc.passes.pipeline import passes_for

    return list(passes_for(options.opt_level))


def required(options: CompileOptions) -> list:
    """The passes no compile can do without: -O0's, and the level's own tiling pass (codegen reads its plans)."""
    from neuronc.passes.pipeline import passes_for
    from neuronc.passes.tiling import search_matmul_tiles, tile_matmuls

    tiling = [p for p in pipeline(options) if p in (tile_matmuls, search_matmul_tiles)]
    return [*passes_for(0), *tiling[-1:]]


def run_passes(graph: ir.Graph, passes: list, options: CompileOptions) -> ir.Graph:
    from neuronc.passes.context import PassContext
    from neuronc.targets import get_target

    ctx = PassContext(get_target(options.target), options.opt_level, options.cast)
    for step in passes:
        graph = step(graph, ctx)
    return graph


def _pass_name(passes: list, index: int) -> str:
    name = getattr(passes[index], "__name__", type(passes[index]).__name__)
    runs = sum(getattr(p, "__name__", type(p).__name__) == name for p in passes[:index + 1])
    return name if runs == 1 else f"{name} (its run #{runs})"


# -- bisection --------------------------------------------------------------------------------------------------

def bisect_program(program: DebugProgram, inputs: list, options: CompileOptions | None = None,
                   reference: str = "xla") -> BisectReport:
    """Compare every value the NEFF of `program` keeps in HBM with the reference executor's, on `inputs`
    (numpy arrays, the program's inputs in order), and name the pass after which the first divergence appears."""
    from neuronc.reference import run_reference

    options = options or CompileOptions()
    inputs = [np.asarray(x) for x in inputs]
    expected_count = sum(p.attrs["kind"] == "input" for p in program.graph.params)
    if len(inputs) != expected_count:
        raise InputMismatchError(f"{program.origin} takes {expected_count} inputs, got {len(inputs)}",
                                 hint="give each input of the program, in order (--input x.npy, repeated)")
    results = run_reference(program.reference_module, program.reference_arguments(inputs), reference)
    expected = dict(zip(program.returned, results[program.results:]))
    passes = pipeline(options)
    whole = _compile_and_compare(program, inputs, expected, passes, options)
    report = BisectReport(program.origin, options, reference, len(program.values), whole.compared,
                          whole.divergences[0] if whole.divergences else None)
    if report.first is not None:
        report.culprit = _find_pass(program, inputs, expected, passes, options)
        report.levels = {level: _diverges(program, inputs, expected, pipeline(dataclasses.replace(options, opt_level=level)),
                                          options) for level in range(options.opt_level + 1)}
    return report


def _find_pass(program, inputs, expected, passes, options) -> str:
    needed = required(options)
    optional = [i for i, step in enumerate(passes) if step not in needed]

    def variant(count: int) -> list:
        return [step for i, step in enumerate(passes) if step in needed or i in optional[:count]]

    def diverges(count: int):
        return _diverges(program, inputs, expected, variant(count), options)

    baseline = diverges(0)
    if baseline is None:
        return "no pass named: the pipeline without its optional passes does not compile for this program"
    if baseline:
        return ("it diverges with no optional pass: the fault is in a pass every compile needs (" +
                ", ".join(dict.fromkeys(getattr(p, "__name__", type(p).__name__) for p in needed)) +
                "), in codegen or in the runtime")
    low, high = 0, len(optional)  # variant(low) agrees, variant(high) (the whole pipeline) diverges
    while high - low > 1:
        middle = (low + high) // 2
        verdict = diverges(middle)
        probe = middle
        while verdict is None and probe + 1 < high:  # a prefix that does not compile: try a longer one
            probe += 1
            verdict = diverges(probe)
        if verdict is None:
            break
        low, high = (low, probe) if verdict else (probe, high)
    index = optional[high - 1]
    if high - low > 1:
        return (f"it first diverges after one of the passes {_pass_name(passes, optional[low])} .. "
                f"{_pass_name(passes, index)} (the prefixes between them do not compile)")
    return f"it first diverges after pass {_pass_name(passes, index)} (pass {index + 1} of {len(passes)} at -O{options.opt_level})"


def _diverges(program, inputs, expected, passes, options):
    """Whether the NEFF of these passes diverges (None: it does not compile)."""
    try:
        return bool(_compile_and_compare(program, inputs, expected, passes, options).divergences)
    except NeuronCompileError:
        return None


def _compile_and_compare(program: DebugProgram, inputs: list, expected: dict, passes: list,
                         options: CompileOptions) -> _Run:
    from neuronc.codegen import generate
    from neuronc.codegen.kernels import kernel_for
    from neuronc.passes.memory_plan import plan_memory
    from neuronc.targets import get_target
    from runtime import NeuronCore

    graph = copy.deepcopy(program.graph)
    for param in graph.params:
        if param.attrs["kind"] == "weight":
            param.attrs["data"] = program.weights[param.attrs["name"]]
    graph = run_passes(graph, passes, options)
    plan = plan_memory(graph)
    neff = generate(graph, plan, get_target(options.target), options.name, prefetch=options.opt_level >= 2)
    kernel_of, count = {}, 0
    for node in graph.nodes():  # codegen emits one kernel per node that has one, in this order
        if kernel_for(node, plan) is not None:
            kernel_of[node] = count
            count += 1
    watched: dict = {}  # kernel number -> nodes whose value its output holds
    for node in graph.nodes():
        root = ir.unreshaped(node)
        if node.origin >= 0 and node.origin in expected and root in kernel_of and plan.has_buffer(root):
            watched.setdefault(kernel_of[root], []).append(node)
    seen: dict = {}  # node -> its value read from HBM

    def observe(kernel: int, hbm: np.ndarray) -> None:
        for node in watched.get(kernel, ()):
            seen[node] = _read(hbm, plan.placement[ir.unreshaped(node)], node)

    NeuronCore(options.target).load(neff).run_observed(inputs, observe)
    divergences, compared = [], set()
    for node, got in seen.items():
        want = expected[node.origin]
        if got is None or got.shape != want.shape:
            continue
        compared.add(node.origin)
        divergence = _compare(got, want, node, options)
        if divergence is not None:
            k = neff.kernels[kernel_of[ir.unreshaped(node)]]
            divergences.append(dataclasses.replace(
                divergence, value=program.values[node.origin], kernel=f"{k.name} ({', '.join(k.ops)})"))
    divergences.sort(key=lambda d: d.value.number)
    return _Run(len(compared), divergences, count)


def _read(hbm: np.ndarray, entry, node: ir.Node):
    """The value of `node` in its kernel's output tensor `entry`, or None if it is not stored densely there."""
    root = ir.unreshaped(node)
    if entry.nbytes != node.nbytes:
        return None
    dtype = node.dtype.numpy
    if root.op is ir.Op.ROWWISE and tuple(root.attrs["out_strides"]) != (root.attrs["cols"], 1):
        flat = np.ndarray((root.size,), dtype, buffer=hbm, offset=entry.offset)  # written through out_strides
        rows, cols = root.attrs["rows"], root.attrs["cols"]
        strides = tuple(s * dtype.itemsize for s in root.attrs["out_strides"])
        return np.lib.stride_tricks.as_strided(flat, (rows, cols), strides).reshape(node.shape).copy()
    return np.ndarray(node.shape, dtype, buffer=hbm, offset=entry.offset).copy()


def _compare(got: np.ndarray, want: np.ndarray, node: ir.Node, options: CompileOptions) -> Divergence | None:
    from neuronc.isa import DType
    from neuronc.tolerances import tolerance

    dtype = node.dtype
    if dtype.is_float and options.cast.mode != "none":  # computed in the narrower type
        dtype = {"bf16": DType.BF16, "fp16": DType.F16}.get(options.auto_cast_type, DType.BF16)
    try:
        limits = tolerance(dtype.numpy)
    except (KeyError, AttributeError, TypeError):
        limits = tolerance(DType.BF16.numpy)  # fp8 and the like: no row of their own
    g, w = got.astype(np.float64), want.astype(np.float64)
    with np.errstate(invalid="ignore"):  # inf - inf: compared below as equal infinities
        error = np.abs(g - w)
    same_nan = np.isnan(g) & np.isnan(w)
    same_inf = np.isinf(g) & (g == w)
    outside = ~(same_nan | same_inf | (error <= limits["atol"] + limits["rtol"] * np.abs(w)))
    if not outside.any():
        return None
    finite = np.isfinite(error)
    max_abs = float(error[finite].max()) if finite.any() else float("inf")
    scale = np.abs(w)
    relative = np.divide(error, scale, out=np.full_like(error, np.inf), where=scale > 0)
    max_rel = float(relative[finite & (scale > 0)].max()) if (finite & (scale > 0)).any() else float("inf")
    return Divergence(None, "", max_abs if not (~finite).any() else float("inf"), max_rel, int(outside.sum()),
                      int(outside.size), limits, dtype.name.lower())


# -- programs from each frontend --------------------------------------------------------------------------------

def debug_fx(gm, params: list, weights: dict, name: str = "main", origin: str = "") -> DebugProgram:
    """A DebugProgram of a stateless FX graph whose placeholders are `params` ((name, kind) pairs)."""
    from neuronc.frontend.isolate import run_isolated
    from neuronc.frontend.torch_import import check_static_shapes, node_locations

    check_static_shapes(gm)
    program = run_isolated(_fx_in_child, gm, params, node_locations(gm), name, what="the torch-mlir import")
    program.graph.renumbered()
    program.weights, program.origin = weights, origin or name
    return program


def debug_exported(program, name: str = "main") -> tuple:
    """(DebugProgram, example inputs or None) of a torch.export ExportedProgram, or of the path of a saved one."""
    from torch.export.graph_signature import InputKind

    from neuronc.frontend.exported import check_inference_only, decompose, is_baked_input, load_exported_program
    from neuronc.frontend.tensors import to_numpy

    origin = os.fspath(program) if isinstance(program, (str, os.PathLike)) else name
    if isinstance(program, (str, os.PathLike)):
        program = load_exported_program(program)
    examples = getattr(program, "example_inputs", None)
    examples = [to_numpy(x) for x in examples[0]] if examples and not examples[1] else None
    program = decompose(program)
    check_inference_only(program)
    state = {**program.state_dict, **program.constants}
    params, weights = [], {}
    for spec in program.graph_signature.input_specs:
        if is_baked_input(spec):
            continue
        if spec.kind == InputKind.USER_INPUT:
            params.append((spec.arg.name, "input"))
        else:
            params.append((spec.target, "weight"))
            weights[spec.target] = to_numpy(state[spec.target])
    return debug_fx(program.graph_module, params, weights, name, origin), examples


def debug_stablehlo(program) -> DebugProgram:
    """A DebugProgram of a StableHLO program (frontend.stablehlo_program.StableHLOProgram, or a file's path)."""
    from neuronc.frontend.isolate import run_isolated
    from neuronc.frontend.stablehlo_program import read_program

    if isinstance(program, (str, os.PathLike)):
        program = read_program(program)
    debug = run_isolated(_stablehlo_in_child, program, what="the StableHLO import")
    debug.graph.renumbered()
    return debug


def _fx_in_child(gm, params, locations, name) -> DebugProgram:
    from neuronc.frontend.stablehlo_import import import_module
    from neuronc.frontend.torch_import import lower

    module = lower(gm, name)
    graph = import_module(module, params, locations, name, semantics="pytorch")
    return _with_reference(module, graph, locations, name)


def _stablehlo_in_child(program) -> DebugProgram:
    from neuronc.frontend.stablehlo_import import import_module
    from neuronc.frontend.stablehlo_program import parse, signature

    module = parse(program)
    graph = import_module(module, signature(module), None, "main", semantics="stablehlo")
    return _with_reference(module, graph, None, program.origin)


def _with_reference(module, graph: ir.Graph, locations, origin: str) -> DebugProgram:
    """The DebugProgram of an imported module: its values described, and the module changed (in place) to
    return each of them after its own results."""
    from torch_mlir import ir as mlir
    from torch_mlir.dialects import func as func_d

    from neuronc.frontend.stablehlo_import import location_of, main_function, values

    function = main_function(module)
    block = function.regions[0].blocks[0]
    numbered = values(block)
    described = [Value(n, _describe(v), location_of(v.owner, locations)) for n, v in enumerate(numbered)]
    returned = [n for n, v in enumerate(numbered) if _is_static_tensor(v)]
    old_return = list(block.operations)[-1].operation
    results = list(old_return.operands)
    with module.context, old_return.location, mlir.InsertionPoint(old_return):
        func_d.ReturnOp(results + [numbered[n] for n in returned])
        old_return.erase()
        result_types = [v.type for v in results] + [numbered[n].type for n in returned]
        function.attributes["function_type"] = mlir.TypeAttr.get(
            mlir.FunctionType.get([a.type for a in block.arguments], result_types))
        if "res_attrs" in function.attributes:
            del function.attributes["res_attrs"]
        function.attributes["sym_name"] = mlir.StringAttr.get("main")  # XLA runs @main
    return DebugProgram(graph, described, module.operation.get_asm(), len(results), returned, {}, origin)


def _is_static_tensor(value) -> bool:
    from torch_mlir import ir as mlir

    try:
        return mlir.RankedTensorType(value.type).has_static_shape
    except ValueError:
        return False


def _describe(value) -> str:
    """`%name = op %operands : type`, the first line of the op that makes the value."""
    text = value.owner.get_asm(large_elements_limit=4, skip_regions=True).strip().splitlines()[0]
    return text if len(text) <= 200 else text[:197] + "..."


# -- entry points -----------------------------------------------------------------------------------------------

def bisect(fn, *args, reference: str = "xla", **options) -> Bisection:
    """`neuronc.bisect(fn, *args)`: run `fn` on `args` as torch.compile(fn, backend="neuron") would compile it, and
    bisect every graph it compiles on the inputs that graph gets (a report per graph). `fn` may also be a JAX
    function of JAX arrays. `options`: target, opt_level, auto_cast, auto_cast_type."""
    compile_options = CompileOptions.from_dict({**options, "name": getattr(fn, "__name__", type(fn).__name__)})
    if _is_jax_call(args):
        return Bisection([_bisect_jax(fn, args, compile_options, reference)])
    return _bisect_torch(fn, args, compile_options, reference)


def _is_jax_call(args) -> bool:
    import sys

    if "jax" not in sys.modules:
        return False
    import jax

    return any(isinstance(leaf, jax.Array) for leaf in jax.tree_util.tree_leaves(args))


def _bisect_jax(fn, args, options, reference) -> BisectReport:
    import jax

    from neuronc.frontend.stablehlo_program import exported_program

    exported = jax.export.export(jax.jit(fn), platforms=["cpu"])(*args)
    program = debug_stablehlo(exported_program(exported, f"the JAX function {options.name}"))
    leaves = jax.tree_util.tree_leaves(args)
    return bisect_program(program, [np.asarray(leaves[i]) for i in exported.module_kept_var_idx], options, reference)


def _bisect_torch(fn, args, options, reference) -> Bisection:
    import torch
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func

    from neuronc.frontend.tensors import to_numpy
    from neuronc.frontend.torch_import import decomposition_table, drop_none_outputs

    reports = Bisection()

    def graph_compiler(gm, example_inputs):
        def run(*inputs):
            outputs = gm(*inputs)  # the program's values, as eager computes them, for the caller
            graph = copy.deepcopy(gm)
            drop_none_outputs(graph)
            params = [(n.name, "input") for n in graph.graph.nodes if n.op == "placeholder"]
            name = f"{options.name} graph {len(reports)}"
            program = debug_fx(graph, params, {}, options.name, name)
            reports.append(bisect_program(program, [to_numpy(x) for x in inputs], options, reference))
            return outputs

        return make_boxed_func(run)

    compiled = torch.compile(fn, backend=aot_autograd(fw_compiler=graph_compiler, decompositions=decomposition_table()),
                             dynamic=False)
    with torch.no_grad():
        compiled(*args)
    return reports


def bisect_file(path, input_paths, options: CompileOptions, reference: str = "xla") -> BisectReport:
    """`neuronc bisect`: a saved ExportedProgram (.pt2) or a StableHLO program (.mlir, .mlirbc, jax.export
    artifact), on the arrays of `input_paths` (.npy/.npz files, checked against the program's inputs before
    they are read; for a .pt2 without them, the example inputs saved with it)."""
    from neuronc.frontend.stablehlo_program import is_stablehlo_file
    from neuronc.input_files import load_inputs
    from neuronc.neff.program import TensorEntry, TensorKind

    if is_stablehlo_file(path):
        program, inputs = debug_stablehlo(path), None
    else:
        program, inputs = debug_exported(path, options.name)
    if input_paths:
        entries = [TensorEntry(p.attrs["name"], TensorKind.INPUT, p.dtype, p.shape, 0) for p in program.graph.params
                   if p.attrs["kind"] == "input"]
        inputs = load_inputs(input_paths, entries, program.origin)
    if inputs is None:
        raise InputMismatchError(f"{os.fspath(path)} needs inputs to be bisected",
                                 hint="give each input as a .npy file: --input x.npy (repeat in order)")
    return bisect_program(program, inputs, options, reference)
