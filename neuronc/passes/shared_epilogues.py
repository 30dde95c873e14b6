"""A matmul whose result has more readers than one elementwise kernel computes that kernel as its epilogue, and
stores its own result as its second output.

Epilogue fusion (passes/fusion.py) takes an elementwise group only when it is the matmul's one reader. In a
training graph the pre-activation of an MLP, h = x W1 + b1, is saved for the backward (a graph output) and read by
the GELU: h is stored, loaded back by the GELU's kernel, and gelu(h) stored again (GPT-2-small at 512 tokens: 3.15
MB loaded and a kernel of its own). Here the GELU's body becomes the matmul's epilogue after h's own steps, and the
step that made h (`MatmulPlan.stored_step`) is stored from its SBUF tile as the kernel's second output: h is
written once and never loaded. The same steps compute the same values in the same order (h rounded to its dtype,
then the reader's body from it): the bits of the two kernels."""
from __future__ import annotations

from neuronc import ir
from neuronc.ir import Op, Step
from neuronc.passes.context import PassContext
from neuronc.passes.fusion import MAX_INPUTS, MAX_STEPS
from neuronc.passes.legalize import dense_strides, reshaped_strides


def _sharing_reader(matmul: ir.Node, consumers: dict, outputs: set) -> ir.Node | None:
    """The one elementwise kernel of the matmul's shape reading its result densely, when the matmul can take it
    (a plain matmul: no chain, no second output yet) and others read the result too; else None."""
    if matmul.op is not Op.MATMUL or matmul.attrs.get("chain") or "outputs" in matmul.attrs:
        return None
    readers = [r for r in consumers.get(matmul, ()) if r.op in ir.ELEMENTWISE | {Op.FUSED}]
    if len(readers) != 1 or (len(consumers[matmul]) == 1 and matmul not in outputs):
        return None
    reader = readers[0]
    views = reader.attrs.get("views") or (None,) * len(reader.inputs)
    positions = [p for p, x in enumerate(reader.inputs) if x is matmul]
    if reader.shape != matmul.shape or len(positions) != 1 or views[positions[0]] is not None:
        return None
    return reader


def _fused(matmul: ir.Node, reader: ir.Node, inputs: dict) -> ir.Node | None:
    """The matmul (its inputs rewritten in `inputs`) with `reader`'s body as the rest of its epilogue, the step
    making its own result stored as output 1; None when the reader's other inputs cannot be read as the matmul's
    tiles or the epilogue would be too long."""
    position = reader.inputs.index(matmul)
    views = reader.attrs.get("views") or (None,) * len(reader.inputs)
    body = ir.body_of(reader)
    read = {a[1] for step in body for a in step.args if a[0] == "input"}
    matmul_views = matmul.attrs.get("views") or (None,) * len(matmul.inputs)
    extra, extra_views, index = [inputs[x] for x in matmul.inputs[2:]], list(matmul_views[2:]), {}
    for j, (x, view) in enumerate(zip(reader.inputs, views)):
        if j == position or j not in read:
            continue
        offset, strides = view or (0, dense_strides(reader.shape))
        strides = reshaped_strides(reader.shape, strides, matmul.shape)
        if strides is None or ir.depends_on(x, matmul):
            return None
        index[j] = 1 + len(extra)
        extra.append(inputs[x])
        extra_views.append((offset, strides))
    steps = list(matmul.attrs.get("epilogue") or (Step(Op.CONVERT, (("input", 0),), matmul.dtype, {}),))
    if steps[-1].dtype is not matmul.dtype:
        return None
    stored = len(steps) - 1
    for step in body:
        steps.append(step._replace(args=tuple(
            (("step", stored) if a[1] == position else ("input", index[a[1]])) if a[0] == "input"
            else ("step", stored + 1 + a[1]) if a[0] == "step" else a for a in step.args)))
    if len(steps) > MAX_STEPS or len(extra) > MAX_INPUTS:
        return None
    return ir.node(Op.MATMUL, [inputs[x] for x in matmul.inputs[:2]] + extra, matmul.shape, reader.dtype, matmul.loc,
                   **{**matmul.attrs, "views": tuple(matmul_views[:2]) + tuple(extra_views), "epilogue": tuple(steps),
                      "stored_step": stored,
                      "outputs": ((reader.shape, reader.dtype), (matmul.shape, matmul.dtype))})


def fuse_shared_epilogues(graph: ir.Graph, ctx: PassContext) -> ir.Graph:
    """Each matmul read by one elementwise kernel and by others computes that kernel as its epilogue, its own
    result its second output (KERNEL_OUTPUT 1)."""
    consumers, outputs = graph.consumers(), set(graph.outputs)
    taken = {}  # reader -> its matmul
    for node in graph.nodes():
        reader = _sharing_reader(node, consumers, outputs)
        if reader is not None:
            taken[reader] = node
    if not taken:
        return graph
    made = {}  # old matmul -> the fused node that now makes its value as output 1
    new: dict = {}

    def fuse(node, inputs):
        new[node] = ir.with_inputs(node, inputs)
        if node in taken:
            fused = _fused(taken[node], node, new)
            if fused is not None:
                made[taken[node]] = fused
                new[node] = fused
        return new[node]

    graph = graph.rewrite(fuse)
    if not made:
        return graph
    second = {new[matmul]: fused for matmul, fused in made.items()}

    def outputs_of(node, inputs):
        if node in second:
            return ir.node(Op.KERNEL_OUTPUT, [second[node]], node.shape, node.dtype, node.loc, index=1)
        return None

    return graph.rewrite(outputs_of)
