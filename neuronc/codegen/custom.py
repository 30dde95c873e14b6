"""Custom kernels (``Op.CUSTOM_KERNEL``): a kernel written in the NKI-compatible language (``neuronc.nki``), traced
by the user's code, placed in the program as it is.

Its instructions are the ones it was traced to, with on-chip addresses it chose itself; only its HBM operands
are bound here, to the graph's tensors: its inputs to the buffers of the node's inputs, its outputs to the
node's buffer and its ``KERNEL_OUTPUT`` readers' (or all to their places in the node's buffer, a concatenation of
them: ``output_views``, passes/concatenation_in_place.py), its HBM scratch to the memory plan's scratch. The sync pass
then orders it with the compiler's kernels around it like any kernel.
"""
from __future__ import annotations

from neuronc.codegen.emitter import Emitter
from neuronc.errors import NeuronCompileError
from neuronc.ir import Node
from neuronc.plans import MemoryPlan


def custom_kernel(em: Emitter, node: Node, plan: MemoryPlan) -> None:
    from neuronc.nki.kernel import traced_kernel  # (imported here: neuronc.nki builds on codegen's sync pass)

    kernel = traced_kernel(node.attrs["kernel"])
    offsets, views = {}, {}
    shapes = node.attrs.get("shapes") or [x.shape for x in node.inputs]  # inputs read through views
    for storage, source, shape, view in zip(kernel.inputs, node.inputs, shapes,
                                            node.attrs.get("views") or [None] * len(node.inputs)):
        if tuple(storage.shape) != tuple(shape) or storage.dtype != source.dtype:
            raise NeuronCompileError(f"custom kernel {kernel.name} was traced for {storage.dtype.name}"
                                     f"{list(storage.shape)} but is given {source.dtype.name}{list(shape)}",
                                     location=str(node.loc))
        offsets[storage.id] = plan.offset(source)
        if view is not None:  # passes/kernel_views.py
            views[storage.id] = view
    in_place = node.attrs.get("output_views")  # passes/concatenation_in_place.py: all in the node's buffer
    for index, storage in enumerate(kernel.outputs):
        if in_place is not None:
            offsets[storage.id] = plan.offset(node)
            views[storage.id] = in_place[index]
        else:
            offsets[storage.id] = plan.offset(node) if index == 0 else plan.placement[(node, index)].offset
    for index, storage in enumerate(kernel.scratch):
        offsets[storage.id] = plan.placement[(node, "scratch", index)].offset
    debug = [em._debug(loc) for loc in kernel.debug_locs]
    em.instructions.extend(kernel.instructions(offsets, kernel=len(em.kernels) - 1, debug=debug, views=views))
