"""Matmul chains: a matmul whose result is read only by one other matmul, as its left operand, is computed
with it as one kernel, the intermediate kept on chip.

In a transformer's MLP (h = gelu(x W1 + b1), y = h W2 + b2) the intermediate h is the pair's largest tensor:
stored to HBM and loaded back, it moves more bytes than both weights (the reader loads h transposed, K on
partitions: a strided DMA at half a queue's bandwidth), and the second kernel idles until the first one's
last store. Chained, the first matmul is computed transposed, h^T = W1^T x^T: its output tiles are [hidden,
tokens], the hidden axis on partitions as the second matmul's stationary operand wants it, and a bias of one
value per hidden unit is one value per partition, added by the epilogue's first pass (no rank-1 matmul). So
a chain needs as many tokens as its first matmul's output tiles are wide (512 for a wide layer): with fewer,
the transposed tiles are narrower and the epilogue's instructions more.
h^T stays in SBUF and the second matmul multiplies it by W2 from there, its K tiles as soon as each is made.

The chained node is the second matmul's MATMUL node: its inputs are the first matmul's (its operands swapped,
then its epilogue's inputs) followed by the second one's but A; attrs["chain"] (a `Chain`, passes/tiling.py) says how to
split them and holds the first matmul's shape and attributes. `stages` rebuilds the two matmuls from it, for the
tiling pass, which plans the chain's kernel (a `ChainPlan`). A chain is made when h^T and both matmuls' tiles fit in SBUF.
"""
from __future__ import annotations

import dataclasses

from neuronc import ir
from neuronc.ir import Op
from neuronc.passes.context import PassContext
from neuronc.passes.legalize import dense_strides
from neuronc.passes.tiling import Chain, chain_sbuf_bytes, stages  # noqa: F401 (stages: how a chain is read)
from neuronc.targets import Target

KEPT_BYTES_PER_PARTITION = 64 * 1024  # the most SBUF a kept intermediate may take (of 192-256 KiB)


def _transposed_view(view, shape) -> tuple:
    """(offset, strides) reading a [B, X, Y] operand seen through `view` as its [B, Y, X] transpose."""
    offset, (sb, sx, sy) = view or (0, dense_strides(shape))
    return offset, (sb, sy, sx)


def transposed(node: ir.Node) -> ir.Node:
    """The matmul computing `node`'s result transposed: [B, N, M] = B^T [B, N, K] @ A^T [B, K, M], its epilogue
    reading its inputs transposed; a bias row (one value per column) becomes a bias column."""
    batch, m, n = node.shape
    k = node.attrs["k"]
    a, b, *extras = node.inputs
    views = node.attrs.get("views") or (None,) * len(node.inputs)
    swapped = [_transposed_view(views[1], (batch, k, n)), _transposed_view(views[0], (batch, m, k))]
    swapped += [_transposed_view(view, node.shape) for view in views[2:]]
    attrs = {key: value for key, value in node.attrs.items() if key not in ("views", "bias_row", "tiling")}
    column = _bias_row(node)
    if column is not None:
        body = node.attrs["epilogue"]
        attrs.update(bias_column=column, epilogue=(body[0]._replace(op=Op.CONVERT, args=(("input", 0),)),) + body[1:])
    return ir.node(Op.MATMUL, [b, a, *extras], (batch, n, m), node.dtype, node.loc, views=tuple(swapped), **attrs)


def _producer(reader: ir.Node, consumers: dict, outputs: set) -> ir.Node | None:
    """The matmul whose result `reader` (a matmul) reads densely as A, directly or through RESHAPEs, when
    nothing else reads it and both have one batch; else None."""
    views = reader.attrs.get("views") or (None,) * len(reader.inputs)
    if (reader.op is not Op.MATMUL or reader.attrs.get("chain") or views[0] is not None or reader.shape[0] != 1
            or "outputs" in reader.attrs):  # a second output (passes/shared_epilogues.py) only a plain kernel stores
        return None
    x, path = reader.inputs[0], []
    while x.op is Op.RESHAPE:
        path.append(x)
        x = x.inputs[0]
    if (x.op is not Op.MATMUL or x.attrs.get("chain") or "outputs" in x.attrs or x.shape[0] != 1 or not _reads_no_tiles(x)
            or (1, reader.shape[1], reader.attrs["k"]) != x.shape or reader.inputs.count(reader.inputs[0]) != 1):
        return None
    for y in (x, *path):
        if y in outputs or len(consumers.get(y, ())) != 1:
            return None
    return x


def _bias_row(node: ir.Node) -> int | None:
    """The epilogue input that is a bias row (one value per column) added to the accumulator by the first step
    and read by nothing else: added into PSUM by a rank-1 matmul (16-bit biases, attrs["bias_row"]), or by
    that step (others); None if there is none."""
    if node.attrs.get("bias_row") is not None:
        return node.attrs["bias_row"]
    body = node.attrs.get("epilogue") or ()
    views = node.attrs.get("views") or (None,) * len(node.inputs)
    if not body or body[0].op is not Op.ADD or ("input", 0) not in body[0].args:
        return None
    others = [ref for kind, ref in body[0].args if kind == "input" and ref != 0]
    if len(others) != 1 or any(("input", others[0]) in step.args for step in body[1:]):
        return None
    view = views[1 + others[0]]
    return others[0] if view is not None and tuple(view[1]) == (0, 0, 1) else None


def _reads_no_tiles(producer: ir.Node) -> bool:
    """Whether the producer's epilogue reads no input but a bias row: transposed, an [M, N] input of the
    epilogue would be read a strided element at a time (SwiGLU's gate, say), costing more than the chain saves."""
    return len(producer.inputs) == 2 or (len(producer.inputs) == 3 and _bias_row(producer) == 1)


def _wide_enough(producer: ir.Node, target: Target) -> bool:
    """Whether the transposed producer's output tiles [N rows, M columns] are as wide as its own [M, N]: with
    fewer rows M (tokens) than that, its epilogue would take more, narrower instructions, each paying the
    engines' fixed cost (at 128 tokens a GELU epilogue costs more than the chain saves)."""
    _, m, n = producer.shape
    return m >= min(n, target.matmul_max_n, target.psum_bank_bytes // 4)


def _fits(node: ir.Node, target: Target) -> bool:
    return chain_sbuf_bytes(node, target) <= target.sbuf_bytes_per_partition


def _chained(reader: ir.Node, inputs: tuple, producer: ir.Node, new: dict, target: Target) -> ir.Node | None:
    """`reader` (its inputs rewritten to `inputs`) chained with `producer` (rewritten inputs in `new`), or None
    if the chain's tiles do not fit in SBUF."""
    first = transposed(dataclasses.replace(producer, inputs=tuple(new[x] for x in producer.inputs)))
    chain = Chain(len(first.inputs), first.shape, first.dtype, dict(first.attrs), first.loc)
    fused = ir.node(Op.MATMUL, [*first.inputs, *inputs[1:]], reader.shape, reader.dtype, reader.loc,
                    **{**reader.attrs, "chain": chain})
    return fused if _fits(fused, target) else None


def chain_matmuls(graph: ir.Graph, ctx: PassContext) -> ir.Graph:
    """Each matmul read only by another matmul as its A operand is computed with that reader as one kernel,
    its result kept in SBUF transposed, when it and the tiles of both fit."""
    target = ctx.target
    consumers, outputs = graph.consumers(), set(graph.outputs)
    producers = {}  # reader -> the matmul it chains with
    for node in graph.nodes():
        producer = _producer(node, consumers, outputs)
        if producer is None or producer.shape[2] % target.partitions or not _wide_enough(producer, target):
            continue
        kept = producer.shape[2] // target.partitions * producer.shape[1] * producer.dtype.itemsize
        if kept <= KEPT_BYTES_PER_PARTITION and producer not in producers:  # chains of two, not of three
            producers[node] = producer
    if not producers:
        return graph
    new: dict = {}

    def chain(node, inputs):
        result = _chained(node, inputs, producers[node], new, target) if node in producers else None
        if result is None:
            result = ir.with_inputs(node, inputs)
        new[node] = result
        return result

    return graph.rewrite(chain)
