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

from neuronc.compiler import CompileOptions, compile_graph
from neuronc.frontend.exported import check_inference_only, decompose, load_exported_program
from neuronc.frontend.op_probe import unsupported_ops
from neuronc.frontend.torch_import import check_static_shapes, node_locations, op_name


@dataclasses.dataclass
class CheckReport:
    uses: collections.Counter  # op name -> how often the graph uses it
    unsupported: list  # UnsupportedOp, in graph order

    @property
    def ok(self) -> bool:
        return not self.unsupported


def check_program(program, options: CompileOptions | None = None) -> CheckReport:
    """Probe every op of an ExportedProgram (or the path of a saved one) for these options."""
    options = options or CompileOptions()
    if not hasattr(program, "graph_module"):
        program = load_exported_program(program)
    program = decompose(program)
    check_inference_only(program)
    return check_graph(program.graph_module, options)


def check_graph(gm, options: CompileOptions | None = None) -> CheckReport:
    """Probe every op of a decomposed ATen FX graph (an ExportedProgram's, or AOTAutograd's)."""
    options = options or CompileOptions()
    check_static_shapes(gm)
    uses = collections.Counter(op_name(n) for n in gm.graph.nodes
                               if n.op == "call_function" and n.target is not operator.getitem)
    unsupported = unsupported_ops(gm, node_locations(gm), accept=lambda graph: compile_graph(graph, options))
    return CheckReport(uses, unsupported)
