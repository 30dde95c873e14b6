"""A widening float convert's readers widen on load instead: no kernel writes the fp32 copy.

AOTAutograd's bf16 layer-norm backward converts x to fp32 once and reads the copy from three kernels (the row
sum, the variance's row reduction, x - mean). The convert is a kernel of its own that writes twice the bytes it
reads, and each reader then loads the wide copy. A widening convert is exact, so each reader may read the narrow
tensor and widen it as the first step of its body or prologue (the same fp32 values): applied, after the
fusions, when every reader is an elementwise kernel (FUSED) or a row reduction, directly or (a plain row
reduction) through a reshape; a row-wise kernel reading it keeps the convert.
"""
from __future__ import annotations

from neuronc import ir
from neuronc.ir import Op, Step
from neuronc.isa import DType
from neuronc.passes.context import PassContext
from neuronc.passes.cost_model import fits_sbuf
from neuronc.passes.rowwise import rebuilt_rowwise
from neuronc.passes.rowwise_plan import BUF_CHOICES, rowwise_sbuf_bytes


def _widening(node, outputs: set) -> bool:
    return (node.op is Op.CONVERT and node.dtype == DType.F32 and node not in outputs
            and node.inputs[0].dtype in (DType.BF16, DType.F16))


def _readers(convert, consumers: dict, outputs: set) -> list | None:
    """The nodes reading `convert` (a plain row reduction possibly through a reshape read by it alone), or None
    when one cannot widen on load."""
    found = []
    for reader in consumers.get(convert, ()):
        if reader.op is Op.RESHAPE and reader not in outputs and len(consumers.get(reader, ())) == 1:
            (reduction,) = consumers[reader]
            if reduction.op is Op.REDUCE_LAST and "cols" not in reduction.attrs \
                    and reduction.inputs[0].shape[-1] == convert.shape[-1]:
                found.append(reduction)
                continue
            return None
        if reader.op is Op.FUSED or (reader.op is Op.REDUCE_LAST and (
                "cols" in reader.attrs or reader.inputs[0].shape[-1] == convert.shape[-1])):
            found.append(reader)
        else:
            return None
    return found


def _widened(body: tuple | None, positions: list) -> tuple:
    """`body` reading its inputs at `positions` widened: a convert step for each, first, the rest renumbered."""
    first = tuple(Step(Op.CONVERT, (("input", i),), DType.F32, {}) for i in positions)
    if body is None:  # a reduction reading its one input as it is
        return first
    shift = len(first)

    def arg(kind, ref):
        if kind == "step":
            return "step", ref + shift
        if kind == "input" and ref in positions:
            return "step", positions.index(ref)
        return kind, ref

    return first + tuple(s._replace(args=tuple(arg(*a) for a in s.args)) for s in body)


def widen_on_read(graph: ir.Graph, ctx: PassContext) -> ir.Graph:
    """Each widening convert read only by kernels that can widen on load is read through them from its input."""
    consumers, outputs = graph.consumers(), set(graph.outputs)
    converts = {}
    for node in graph.nodes():
        if _widening(node, outputs):
            readers = _readers(node, consumers, outputs)
            if readers:
                converts[node] = readers
    if not converts:
        return graph
    readers = {r for found in converts.values() for r in found}

    def widen(node, inputs):
        if node not in readers:
            return None
        if node.op is Op.REDUCE_LAST and "cols" not in node.attrs:  # reads convert or reshape(convert)
            source = inputs[0].inputs[0] if inputs[0].op is Op.CONVERT else inputs[0].inputs[0].inputs[0]
            cols = node.inputs[0].shape[-1]
            return ir.node(Op.REDUCE_LAST, [source], node.shape, node.dtype, node.loc, **node.attrs, cols=cols,
                           prologue=_widened(None, [0]), views=((0, (cols, 1)),))
        positions = [i for i, x in enumerate(node.inputs) if x in converts]
        sources = [x.inputs[0] if i in positions else x for i, x in enumerate(inputs)]
        key = "body" if node.op is Op.FUSED else "prologue"
        return ir.node(node.op, sources, node.shape, node.dtype, node.loc,
                       **{**node.attrs, key: _widened(node.attrs.get(key), positions)})

    return graph.rewrite(widen)


def _widening_epilogue(node, outputs: set) -> bool:
    """A matmul whose epilogue ends by widening its narrow float result to fp32 (AOTAutograd's bf16 `mm` read
    through a convert: the grad-input matmul of a layer-norm backward)."""
    epilogue = node.attrs.get("epilogue") or () if node.op is Op.MATMUL else ()
    if len(epilogue) < 2 or node in outputs or node.dtype != DType.F32:
        return False
    last = epilogue[-1]
    return (last.op is Op.CONVERT and last.args == (("step", len(epilogue) - 2),)
            and epilogue[-2].dtype in (DType.BF16, DType.F16))


def _result_readers(matmul, consumers: dict, outputs: set, target) -> list | None:
    """The kernels reading `matmul` that can widen its narrow result on load: elementwise and row-wise kernels,
    reductions with a prologue or read transposed, and sums over tokens reading it through a reshape (then in the
    list too); None when one cannot."""
    found = []
    for reader in consumers.get(matmul, ()):
        if reader.op is Op.RESHAPE and reader not in outputs and consumers.get(reader) and all(
                r.op is Op.REDUCE_LAST and "cols" in r.attrs for r in consumers[reader]):
            found += [reader, *consumers[reader]]
        elif reader.op is Op.FUSED or (reader.op is Op.REDUCE_LAST and (
                "cols" in reader.attrs or reader.attrs.get("prologue"))):
            found.append(reader)
        elif reader.op is Op.ROWWISE and _rowwise_fits(reader, matmul, target):
            found.append(reader)
        else:
            return None
    return found


def _rowwise_fits(reader, matmul, target) -> bool:
    """Whether row-wise `reader` still fits SBUF reading `matmul`'s narrow result and widening it."""
    narrow = _narrowed_dtype(matmul)
    positions = [i for i, x in enumerate(reader.inputs) if x is matmul]
    dtypes = [narrow if x is matmul else x.dtype for x in reader.inputs]
    body = _widened(reader.attrs["body"], positions)
    return any(fits_sbuf(rowwise_sbuf_bytes(body, reader.attrs["views"], dtypes, reader.dtype, reader.attrs["cols"],
                                            bufs), target) for bufs in BUF_CHOICES)


def _narrowed_dtype(matmul) -> DType:
    return matmul.attrs["epilogue"][-2].dtype


def widen_matmul_results_on_read(graph: ir.Graph, ctx: PassContext) -> ir.Graph:
    """A matmul whose epilogue widens its rounded result to fp32 stores the narrow result instead, when every
    kernel reading it can widen it on load: the same fp32 values read (a widening convert is exact), half the
    bytes stored and loaded. The layer-norm backward's grad-input matmuls: dy as bf16, not fp32, for the row-wise
    grad-input kernel and the norm weight's and bias's sums over tokens."""
    consumers, outputs = graph.consumers(), set(graph.outputs)
    narrowed, readers = set(), set()
    for node in graph.nodes():
        if _widening_epilogue(node, outputs):
            found = _result_readers(node, consumers, outputs, ctx.target)
            if found:
                narrowed.add(node)
                readers.update(found)
    if not narrowed:
        return graph

    def widen(node, inputs):
        if node in narrowed:
            return ir.node(Op.MATMUL, inputs, node.shape, _narrowed_dtype(node), node.loc,
                           **{**node.attrs, "epilogue": node.attrs["epilogue"][:-1]})
        if node not in readers:
            return None
        if node.op is Op.RESHAPE:  # of a narrowed matmul, read by sums over tokens
            return ir.node(Op.RESHAPE, inputs, node.shape, inputs[0].dtype, node.loc, **node.attrs)
        positions = [i for i, (old, new) in enumerate(zip(node.inputs, inputs)) if new.dtype != old.dtype]
        key = "prologue" if node.op is Op.REDUCE_LAST else "body"
        body = _widened(node.attrs.get(key), positions)
        if node.op is Op.ROWWISE:  # its schedule chosen again for the narrow input (it fits: _rowwise_fits)
            return rebuilt_rowwise(node, list(inputs), node.attrs["views"], body, ctx.target)
        return ir.node(node.op, inputs, node.shape, node.dtype, node.loc, **{**node.attrs, key: body})

    return graph.rewrite(widen)
