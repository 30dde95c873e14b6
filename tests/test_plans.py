"""Kernel plans (neuronc/plans.py): each kernel's decisions are frozen data its pass attaches and codegen reads;
codegen imports nothing from the passes, and the passes import each other without loops."""
from __future__ import annotations

import ast
import dataclasses
import pathlib

import pytest

import neuronc
from neuronc.codegen.access import HbmTensor
from neuronc.compiler import CompileOptions, compile_graph
from neuronc.ir import Op
from neuronc.isa import DType, Space
from neuronc.plans import MatmulPlan, View
from tests.conftest import zoo_graph

PACKAGE = pathlib.Path(neuronc.__file__).parent


def _runtime_nodes(tree: ast.AST):
    """Every node of `tree` but those under `if TYPE_CHECKING:` (imports for annotations only)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            continue
        yield node
        yield from _runtime_nodes(node)


def _imports(path: pathlib.Path) -> set:
    """The neuronc modules a source file imports when it runs (at any depth: lazy imports count)."""
    found = set()
    for node in _runtime_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("neuronc"):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("neuronc"))
    return found


def test_codegen_imports_nothing_from_the_passes():
    for path in sorted((PACKAGE / "codegen").glob("*.py")):
        assert not {m for m in _imports(path) if m.startswith("neuronc.passes")}, path.name


def test_the_passes_import_each_other_without_loops():
    modules = {p.stem: p for p in (PACKAGE / "passes").glob("*.py") if p.stem != "__init__"}
    edges = {name: {m.split(".")[2] for m in _imports(path) if m.startswith("neuronc.passes.")} & set(modules)
             for name, path in modules.items()}

    def reaches(start: str, goal: str, seen: set) -> bool:
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in edges[start])

    loops = sorted(name for name in modules if reaches(name, name, {name}))
    assert loops == []


@pytest.fixture(scope="module")
def gpt2_graph():
    """The optimised IR of the zoo's GPT-2, compiled for real (compile_graph does not consult the compile cache,
    whose hit holds no graph) from the graph the session imported once (conftest.zoo_graph)."""
    return compile_graph(zoo_graph("gpt2"), CompileOptions(opt_level=2)).graph


def test_every_kernel_of_an_optimised_graph_carries_a_frozen_plan(gpt2_graph):
    kinds = set()
    for node in gpt2_graph.nodes():
        if node.op in (Op.PARAMETER, Op.RESHAPE, Op.CONSTANT, Op.VIEW, Op.PAD, Op.CONCATENATE):
            continue
        plan = node.attrs.get("plan")
        assert plan is not None, node.op
        assert dataclasses.is_dataclass(plan) and type(plan).__dataclass_params__.frozen
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(plan, dataclasses.fields(plan)[0].name, None)
        kinds.add(type(plan).__name__)
    assert {"MatmulPlan", "RowwisePlan", "AttentionPlan", "ElementwisePlan"} <= kinds


def test_a_matmul_plan_holds_what_its_kernel_allocates(gpt2_graph):
    matmuls = [n for n in gpt2_graph.nodes() if n.op is Op.MATMUL and isinstance(n.attrs["plan"], MatmulPlan)]
    assert matmuls
    for node in matmuls:
        plan = node.attrs["plan"]
        assert (plan.batch, plan.m, plan.n) == node.shape and plan.k == node.attrs["k"]
        assert plan.tiling == node.attrs["tiling"]
        assert {"a", "b"} <= {p.name for p in plan.operand_pools}
        assert {"result", "constants"} <= {p.name for p in plan.epilogue_pools}
        assert len(plan.slots) == len(plan.epilogue) and plan.slots[-1] is None  # the last step writes the result


def test_an_hbm_tensor_is_addressed_by_slices_as_nki_kernels_address_it():
    x = HbmTensor(DType.BF16, 1024, ((4 * 6, 3), (6, 4), (1, 6)))  # a dense [3, 4, 6] bf16 tensor at byte 1024
    tile = x[1, 2:4, 1:5].ap
    assert tile.space == Space.HBM and tile.dtype == DType.BF16
    assert tile.offset == 1024 + (1 * 24 + 2 * 6 + 1) * 2 and tile.dims == ((6, 2), (1, 4))
    assert x[2].T.ap.dims == ((1, 6), (6, 4))  # [6, 4]: the transpose of batch 2
    assert x[0, 0:4, :].tiled(2).ap.dims == ((6, 2), (12, 2), (1, 6))  # rows as two tiles side by side
    assert x[0, 1:3, 0].column.ap.dims == ((6, 2), (1, 1))


def test_a_view_of_none_reads_densely():
    assert View.of(None, (2, 3, 4)) == View(0, (12, 4, 1))
    assert View.of((5, (0, 0, 1)), (2, 3, 4)) == View(5, (0, 0, 1))
