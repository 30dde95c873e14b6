"""The functional collectives of a graph (DTensor, FSDP2, tensor parallelism under torch.compile) as collective
ops of the graph IR, which codegen turns into instructions of the collective engine.

torch-mlir has no lowering for ``_c10d_functional`` ops, and StableHLO's collectives name replica groups, not
torch.distributed's process groups. So before the import each collective is cut out of the FX graph
(:func:`cut_collectives`): its input becomes an extra output of the graph and its (waited) result an extra
input, leaving a graph of compute alone for torch-mlir. After the import :func:`splice_collectives` joins each
extra input to its extra output through an ``Op.COLLECTIVE`` node, and drops both: the IR graph computes what
the FX graph did, collectives included.

A collective names its process group by its group number: the position of its group among the graph's
distinct groups (:attr:`Cut.group`), so the NEFF is the same whatever the groups are called; the host maps the
numbers back to groups (``Collectives.groups``) when it runs the program. ``avg`` is a sum divided by the
group's size (an FX division after the cut).
"""
from __future__ import annotations

import dataclasses

from neuronc import ir
from neuronc.errors import NeuronCompileError
from neuronc.frontend.torch_import import new_last_placeholder
from neuronc.isa import AluOp, CollectiveOp

_REDUCTIONS = {"sum": AluOp.ADD, "avg": AluOp.ADD, "max": AluOp.MAX, "min": AluOp.MIN, "product": AluOp.MULTIPLY}


@dataclasses.dataclass(frozen=True)
class Cut:
    """One collective cut out of an FX graph."""

    op: CollectiveOp
    reduce: AluOp  # NONE for the collectives that do not reduce
    group: int  # its group's number in the graph (Collectives.groups)
    ranks: int


@dataclasses.dataclass
class Collectives:
    """The collectives of a graph, in the order of its extra inputs and outputs, and its groups by number."""

    cuts: list
    groups: list  # process group names, by group number

    def fingerprint(self) -> str:
        """What the NEFF depends on (the cache key adds it to the StableHLO's): the collectives, not the names."""
        return repr([(c.op.name, c.reduce.name, c.group, c.ranks) for c in self.cuts])


def _functional_ops() -> dict:
    import torch

    f = torch.ops._c10d_functional
    return {f.all_reduce.default: CollectiveOp.ALL_REDUCE, f.all_gather_into_tensor.default: CollectiveOp.ALL_GATHER,
            f.reduce_scatter_tensor.default: CollectiveOp.REDUCE_SCATTER,
            f.all_to_all_single.default: CollectiveOp.ALL_TO_ALL}


def is_collective(node) -> bool:
    """A node of torch.distributed's (a collective, functional or not, or the wait for one)."""
    return node.op == "call_function" and \
        str(getattr(node.target, "namespace", "")) in ("_c10d_functional", "c10d_functional", "c10d")


def has_collectives(gm) -> bool:
    return any(is_collective(n) for n in gm.graph.nodes)


def refusal(node) -> str:
    """Why the collective node ``node`` cannot be a collective instruction of a NEFF ("" if it can): compile_fx's
    verdict (`compiler.compiled_apart`), which the partition fallback takes instead of probing the collective
    through torch-mlir (which lowers none). A wait is compiled with the collective it waits for."""
    import torch

    ops = _functional_ops()
    if node.target is torch.ops._c10d_functional.wait_tensor.default:
        source = node.args[0]
        return refusal(source) if getattr(source, "op", None) == "call_function" and is_collective(source) else ""
    if node.target not in ops:
        return f"neuronc compiles all_reduce, all_gather_into_tensor, reduce_scatter_tensor and all_to_all_single, " \
               f"not {node.target}"
    op, args = ops[node.target], node.args[1:]
    reduce_name = args[0] if op in (CollectiveOp.ALL_REDUCE, CollectiveOp.REDUCE_SCATTER) else None
    if reduce_name is not None and reduce_name not in _REDUCTIONS:
        return f"the {op.name.lower()} reduction {reduce_name!r} cannot be compiled (use one of {', '.join(_REDUCTIONS)})"
    if op == CollectiveOp.ALL_TO_ALL and any(s is not None and len(set(s)) > 1 for s in args[:2]):
        return "an all_to_all_single with unequal splits cannot be compiled"
    return ""


def _group_size(name: str) -> int:
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name).size()


def cut_collectives(gm) -> Collectives:
    """In place: cut every functional collective out of ``gm`` (see the module docstring)."""
    import torch

    ops, wait = _functional_ops(), torch.ops._c10d_functional.wait_tensor.default
    graph = gm.graph
    output = next(n for n in graph.nodes if n.op == "output")
    cuts, groups, extra_outputs, waited = [], [], [], set()
    for node in list(graph.nodes):
        if not is_collective(node) or node in waited:
            continue
        if node.target is wait:  # a piece of a partitioned graph waits for a collective an earlier piece ran
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            continue
        why = refusal(node)
        if why:
            raise NeuronCompileError(f"the collective {node.target} cannot be compiled into a NEFF: {why}",
                                     problems=[f"{node.name}: {node.target}"],
                                     hint="keep it outside the compiled region (or let the partition fallback run it "
                                     "through the process group)")
        op = ops[node.target]
        source, args = node.args[0], node.args[1:]
        group_name = args[-1]
        ranks = _group_size(group_name)
        reduce_name = args[0] if op in (CollectiveOp.ALL_REDUCE, CollectiveOp.REDUCE_SCATTER) else None
        if group_name not in groups:
            groups.append(group_name)
        cuts.append(Cut(op, _REDUCTIONS[reduce_name] if reduce_name else AluOp.NONE, groups.index(group_name), ranks))
        waits = [u for u in node.users if u.target is wait]
        waited.update(waits)
        result = waits[0] if waits else node
        arrived = new_last_placeholder(graph, f"collective{len(cuts) - 1}")
        arrived.meta.update(result.meta)
        value = arrived
        if reduce_name == "avg":
            with graph.inserting_after(result):
                value = graph.call_function(torch.ops.aten.div.Scalar, (arrived, ranks))
            with result.meta["val"].fake_mode:
                value.meta.update(result.meta, val=result.meta["val"] / ranks)
        for w in waits[1:]:
            w.replace_all_uses_with(value)
            graph.erase_node(w)
        result.replace_all_uses_with(value)
        if result is not node:
            graph.erase_node(result)
        graph.erase_node(node)
        extra_outputs.append(source)
    if cuts:
        results = output.args[0]
        results = tuple(results) if isinstance(results, (tuple, list)) else (results,)
        output.args = (results + tuple(extra_outputs),)
    graph.lint()
    gm.recompile()
    return Collectives(cuts, groups)


def splice_collectives(graph: ir.Graph, collectives: Collectives) -> ir.Graph:
    """The IR graph of a cut FX graph with each collective joined back (see the module docstring)."""
    n = len(collectives.cuts)
    if not n:
        return graph
    params, arrived = graph.params[:-n], graph.params[-n:]
    outputs, sources = graph.outputs[:-n], graph.outputs[-n:]
    joined = {p: cut for p, cut in zip(arrived, collectives.cuts)}
    source_of = dict(zip(arrived, sources))
    new: dict = {}
    # Iterative post-order: an arrived value's node needs its source built first, which may need other arrivals.
    for root in outputs:
        stack = [(root, False)]
        while stack:
            node, expanded = stack.pop()
            if node in new:
                continue
            deps = (source_of[node],) if node in joined else node.inputs
            if not expanded:
                stack.append((node, True))
                stack.extend((d, False) for d in reversed(deps) if d not in new)
                continue
            if node in joined:
                cut = joined[node]
                new[node] = ir.node(ir.Op.COLLECTIVE, [new[source_of[node]]], node.shape, node.dtype, node.loc,
                                    collective=cut.op, reduce=cut.reduce, ranks=cut.ranks, group=cut.group)
            else:
                inputs = tuple(new[i] for i in node.inputs)
                new[node] = ir.with_inputs(node, inputs)
    for p in params:
        new.setdefault(p, p)
    return ir.Graph([new[p] for p in params], [new[o] for o in outputs], graph.name)
