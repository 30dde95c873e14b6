"""`neuronc check`: every op of a saved program the backend cannot compile, before compiling it.

Support is not read from a list. Each distinct use of an op (the op, its operands' dtypes and
ranks, its other arguments) is compiled alone through the real frontend, passes and codegen
(`unsupported_ops` with the compiler as its judge), so the answer changes when the compiler does,
and a use the passes refuse (an integer matmul, say) is caught as well as one torch-mlir cannot
lower or the importer has no converter for.
"""
from __future__ import annotations

import collections
import dataclasses
import operator
import os

import numpy as np

from neuronc.compiler import CompileOptions, compile_graph
from neuronc.frontend import control_flow
from neuronc.frontend.exported import check_inference_only, decompose, load_exported_program
from neuronc.frontend.op_probe import UnsupportedOp, unsupported_ops
from neuronc.frontend.torch_import import check_static_shapes, node_locations, op_name
from neuronc import ir
from neuronc.errors import NeuronCompileError


@dataclasses.dataclass
class CheckReport:
    uses: collections.Counter  # op name -> how often the graph uses it
    unsupported: list  # UnsupportedOp, in graph order

    @property
    def ok(self) -> bool:
        return not self.unsupported


def check_program(program, options: CompileOptions | None = None) -> CheckReport:
    """Probe every op of an ExportedProgram (or the path of a saved one, or of a StableHLO program: .mlir,
    .mlirbc, a jax.export artifact) for these options."""
    from neuronc.frontend.stablehlo_program import is_stablehlo_file, read_program

    options = options or CompileOptions()
    if isinstance(program, (str, os.PathLike)) and is_stablehlo_file(program):
        return check_stablehlo(read_program(program), options)
    if not hasattr(program, "graph_module"):
        program = load_exported_program(program)
    program = decompose(program)
    check_inference_only(program)
    return check_graph(program.graph_module, options)


def check_graph(gm, options: CompileOptions | None = None) -> CheckReport:
    """Probe every op of a decomposed ATen FX graph (an ExportedProgram's, or AOTAutograd's)."""
    options = options or CompileOptions()
    check_static_shapes(gm)
    control_flow.inline_conditionals(gm)  # as compiling does: a cond's branches are probed op by op
    uses = collections.Counter(op_name(n) for n in gm.graph.nodes
                               if n.op == "call_function" and n.target is not operator.getitem)
    unsupported = unsupported_ops(gm, node_locations(gm), accept=lambda graph: compile_graph(graph, options))
    return CheckReport(uses, unsupported)


def check_stablehlo(program, options: CompileOptions | None = None) -> CheckReport:
    """Probe every op of a StableHLO program (frontend.stablehlo_program.StableHLOProgram): the ops the
    importer cannot convert, and each distinct use of what it converts to (op, operand shapes and dtypes,
    attributes), compiled alone through the passes and codegen. Ops are named as StableHLO names them."""
    from neuronc.frontend.stablehlo_program import survey

    options = options or CompileOptions()
    uses, graph, problems = survey(program)
    failures: dict = {}
    for problem in problems:
        failures.setdefault(problem.op, UnsupportedOp(problem.op, problem.why, [])).places.append(problem.loc)
    verdicts: dict = {}
    for node in graph.nodes():
        if node.op in (ir.Op.PARAMETER, ir.Op.CONSTANT):  # (zero constants stand in for what failed to import)
            continue
        key = _use(node)
        if key not in verdicts:
            verdicts[key] = _probe_alone(node, options)
        if verdicts[key]:
            failure = failures.setdefault(node.loc.op, UnsupportedOp(node.loc.op, verdicts[key], []))
            if node.loc not in failure.places:
                failure.places.append(node.loc)
    return CheckReport(uses, list(failures.values()))


def _use(node: ir.Node) -> tuple:
    """What decides whether a node compiles: its op, attributes, and its operands' and result's types."""
    def describe(value):
        return ("array", value.shape, str(value.dtype)) if isinstance(value, np.ndarray) else repr(value)

    attrs = tuple(sorted((k, describe(v)) for k, v in node.attrs.items()))
    operands = tuple((x.shape, x.dtype, x.scalar if x.op is ir.Op.CONSTANT else None) for x in node.inputs)
    return node.op, attrs, operands, node.shape, node.dtype


def _probe_alone(node: ir.Node, options: CompileOptions) -> str:
    """Why `node` cannot be compiled alone ("" if it can): its non-constant operands become inputs."""
    params, inputs = [], []
    for x in node.inputs:
        if x.op is ir.Op.CONSTANT:
            inputs.append(x)
            continue
        params.append(ir.node(ir.Op.PARAMETER, [], x.shape, x.dtype, None, index=len(params), name=f"in{len(params)}",
                              kind="input"))
        inputs.append(params[-1])
    probe = ir.Node(node.op, tuple(inputs), node.shape, node.dtype, dict(node.attrs), node.loc)
    try:
        compile_graph(ir.Graph(params, [probe], "probe"), options)
    except NeuronCompileError as err:
        return err.message
    except Exception as err:  # noqa: BLE001 - a pass or kernel that fails on it is a missing lowering
        return f"neuronc fails on it ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
    return ""
