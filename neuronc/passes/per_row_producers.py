"""A per-row elementwise kernel read only through broadcasts is computed by its readers instead.

The layer-norm backward rounds its recomputed mean, `convert(convert(mean) : bf16) : f32` over [512, 1], and reads
the rounded mean only in x-hat, `(x - mean) * rstd`, broadcast along each row. The rounding is a kernel of its own
on the critical path (a launch, a 2 KB load and store, ~3-6 us) for two instructions. Its reader loads a per-row
operand as a [rows, 1] column anyway (codegen/elementwise.py), so it reads the unrounded mean there and computes
the two steps itself: the same float steps on the same values, element by element (the same bits). Applied, after
the fusions, to an elementwise kernel of float arithmetic whose inputs have its own shape and are read as they
lie, whose last dimension is 1 (one value a row), read by elementwise kernels alone, each through a view.
"""
from __future__ import annotations

from neuronc import ir
from neuronc.ir import Op
from neuronc.passes.context import PassContext
from neuronc.passes.fusion import MAX_INPUTS, MAX_STEPS
from neuronc.passes.reduction_epilogues import ARITHMETIC

# a reader recomputes the producer's steps for every element of its rows: only a few steps are worth a kernel
MAX_FOLDED_STEPS = 2


def _per_row_producer(node, outputs: set) -> bool:
    """A FUSED kernel of a few float arithmetic steps over one value a row, reading its inputs as they lie."""
    if node.op is not Op.FUSED or node in outputs or node.shape[-1:] != (1,) or not node.dtype.is_float:
        return False
    body = node.attrs["body"]
    return (len(body) <= MAX_FOLDED_STEPS and all(view is None for view in node.attrs.get("views") or ())
            and all(x.shape == node.shape for x in node.inputs)
            and all(s.op in ARITHMETIC and s.dtype.is_float for s in body))


def _readers(producer, consumers: dict) -> list | None:
    """The FUSED kernels reading `producer`, each once and through a view (a broadcast), or None."""
    readers = consumers.get(producer, ())
    for reader in readers:
        views = reader.attrs.get("views") or ()
        slots = [i for i, x in enumerate(reader.inputs) if x is producer]
        if reader.op is not Op.FUSED or len(slots) != 1 or len(views) <= slots[0] or views[slots[0]] is None:
            return None
    return list(readers) or None


def with_producer(reader_inputs: list, views: list, body: tuple, slot: int, producer_inputs: list,
                  producer_views: list, producer_body: tuple) -> tuple:
    """(inputs, views, body) of a reader whose input `slot` is computed from `producer_inputs` (read through
    `producer_views`, in the reader's terms) by `producer_body`, its steps first; input `slot` is then read by no
    step (`dropped` takes it out)."""
    inputs, views = list(reader_inputs), list(views)
    first = []
    for s in producer_body:
        args = []
        for kind, ref in s.args:
            if kind == "input":
                inputs.append(producer_inputs[ref])
                views.append(producer_views[ref])
                kind, ref = "input", len(inputs) - 1
            args.append((kind, ref))
        first.append(s._replace(args=tuple(args)))
    shift = len(first)

    def arg(kind, ref):
        if kind == "step":
            return "step", ref + shift
        if kind == "input" and ref == slot:
            return "step", shift - 1
        return kind, ref

    return inputs, views, tuple(first) + tuple(s._replace(args=tuple(arg(*a) for a in s.args)) for s in body)


def dropped(inputs: list, views: list, body: tuple, slot: int) -> tuple:
    """(inputs, views, body) without input `slot` (read by no step any more), the later inputs renumbered."""
    def arg(kind, ref):
        return (kind, ref - 1) if kind == "input" and ref > slot else (kind, ref)

    return (inputs[:slot] + inputs[slot + 1:], views[:slot] + views[slot + 1:],
            tuple(s._replace(args=tuple(arg(*a) for a in s.args)) for s in body))


def fold_per_row_producers(graph: ir.Graph, ctx: PassContext) -> ir.Graph:
    """Each per-row elementwise kernel read only through broadcasts is computed by each of its readers."""
    consumers, outputs = graph.consumers(), set(graph.outputs)
    producers, readers = set(), set()
    for node in graph.nodes():
        if _per_row_producer(node, outputs):
            found = _readers(node, consumers)
            if found:
                producers.add(node)
                readers.update(found)
    if not producers:
        return graph

    def fold(node, inputs):
        if node not in readers:
            return None
        new_inputs, views, body = list(inputs), list(node.attrs["views"]), node.attrs["body"]
        slots = [i for i, x in enumerate(node.inputs) if x in producers]
        for slot in slots:
            producer = inputs[slot]  # rebuilt: its new inputs
            new_inputs, views, body = with_producer(new_inputs, views, body, slot, list(producer.inputs),
                                                    [views[slot]] * len(producer.inputs), producer.attrs["body"])
        for slot in reversed(slots):
            new_inputs, views, body = dropped(new_inputs, views, body, slot)
        if len(new_inputs) > MAX_INPUTS or len(body) > MAX_STEPS:
            return None  # the reader keeps reading the producer's kernel
        return ir.node(Op.FUSED, new_inputs, node.shape, node.dtype, node.loc,
                       **{**node.attrs, "body": body, "views": tuple(views)})

    return graph.rewrite(fold)
