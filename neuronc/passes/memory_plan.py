"""Memory planning: where in the core's HBM every tensor of a legalised graph lives.

Inputs, outputs, weights and constants become entries of the NEFF's tensor table; intermediates
get scratch space. A RESHAPE is an alias: it shares its operand's bytes. Splat constants only need
memory when a consumer reads them as a tensor (elementwise kernels take them as immediates).

Scratch buffers are reused by liveness. Kernels run in the order of ``graph.nodes()`` (codegen emits
them so); an intermediate lives from its kernel to the last kernel reading it (through its RESHAPE
aliases). Each goes into a slot whose last tenant is dead and whose tenants have its row width (the
bytes of its last dimension; 0 for a 1-D tensor): the smallest such free slot it fits, else the largest
one, grown, else a new slot. Tenants of a slot all start at the slot's offset (the sync pass tracks hazards
by start offset, and orders a new tenant's writes after the old one's reads); a slot is as long as its
longest tenant. One row width a slot: the sync pass tracks a slot of one width by rows by bytes of a row,
exactly, one of mixed widths only by bytes, where a tenant's column strips (one head's columns of every
row, as the flash backward stores dq, dk and dv) all overlap and wait for each other
(docs/performance.md, issue 16, part 35). Inputs, outputs, weights and constants keep bytes of their own.

A custom kernel (``Op.CUSTOM_KERNEL``) writes all its outputs and its HBM scratch tensors when it runs: the
buffers of its other outputs (its ``KERNEL_OUTPUT`` readers, or scratch nobody reads) and of its scratch are
taken at its position, found in ``placement`` under ``(node, index)`` and ``(node, "scratch", index)``. So
does a matmul with an ``outputs`` attribute (its A's sums over K, passes/matmul_column_sums.py).
"""
from __future__ import annotations

from neuronc import ir
from neuronc.ir import Op
from neuronc.neff.program import TensorEntry, TensorKind
from neuronc.plans import MemoryPlan  # noqa: F401 (the plan type, beside the planner)

COOLING = 4  # nodes: a slot freed this recently is not reused, so that a kernel's stores need not wait for
# the loads of the kernel just before it (the sync pass orders a new tenant's writes after the old one's reads)
ALIGNMENT = 64  # bytes; keeps every tensor's start aligned for any dtype and for DMA descriptors


def _needs_buffer(node: ir.Node, consumers: dict, outputs) -> bool:
    if node.op is not Op.CONSTANT or not node.is_splat:
        return True
    return node in outputs or any(c.op not in ir.ELEMENTWISE for c in consumers.get(node, ()))


def _last_reads(nodes: list) -> dict:
    """node owning a buffer -> position (in `nodes`) of the last node reading it, directly or through RESHAPEs."""
    last = {}
    for position, n in enumerate(nodes):
        if n.op is Op.RESHAPE:
            continue
        for x in n.inputs:
            last[ir.unreshaped(x)] = position
    return last


def row_bytes(shape: tuple, dtype) -> int:
    """The bytes of a tensor's rows (its last dimension), as codegen.sync's grid reads them; 0 for fewer than 2 dims."""
    return int(shape[-1]) * dtype.itemsize if len(shape) >= 2 else 0


class _Slots:
    """Scratch slots: each a length, the row width of its tenants, and whether a live tensor holds it."""

    def __init__(self):
        self.sizes, self.widths, self.free = [], [], []  # free: (position freed, slot), oldest first

    def take(self, nbytes: int, width: int, position: int) -> int:
        cooled = [slot for freed, slot in self.free  # oldest first
                  if freed < position - COOLING and self.widths[slot] == width]
        fitting = [slot for slot in cooled if self.sizes[slot] >= nbytes]
        if fitting:
            slot = fitting[0]
        elif cooled:
            slot = max(cooled, key=self.sizes.__getitem__)
            self.sizes[slot] = nbytes  # grown: no cooled slot is long enough
        else:
            self.sizes.append(nbytes)
            self.widths.append(width)
            return len(self.sizes) - 1
        self.free = [f for f in self.free if f[1] != slot]
        return slot

    def give_back(self, slot: int, position: int) -> None:
        self.free.append((position, slot))


def _aligned(nbytes: int) -> int:
    return -(-max(nbytes, 1) // ALIGNMENT) * ALIGNMENT


def _entry(n: ir.Node, output_index: dict, input_count: int) -> TensorEntry:
    """The tensor-table entry of node `n` (its offset set by the caller); `input_count` inputs came before."""
    if n in output_index:
        index, out = output_index[n]
        return TensorEntry(f"output{index}", TensorKind.OUTPUT, out.dtype, out.shape, 0, index)
    if n.op is Op.PARAMETER and n.attrs["kind"] == "input":
        return TensorEntry(n.attrs["name"], TensorKind.INPUT, n.dtype, n.shape, 0, input_count)
    if n.op is Op.PARAMETER:
        return TensorEntry(n.attrs["name"], TensorKind.WEIGHT, n.dtype, n.shape, 0, -1, n.attrs["data"])
    if n.op is Op.CONSTANT and not n.is_splat:
        return TensorEntry(f"const{n.id}", TensorKind.CONSTANT, n.dtype, n.shape, 0, -1,
                           n.attrs["value"].reshape(n.shape))
    return TensorEntry(f"t{n.id}_{n.op.name.lower()}", TensorKind.SCRATCH, n.dtype, n.shape, 0)


def plan_memory(graph: ir.Graph) -> MemoryPlan:
    nodes = graph.nodes()
    consumers = graph.consumers()
    # An output that reshapes a value is that value's bytes: the value is placed in the output.
    # (legalize guarantees that each output's root is its own, not a parameter or constant.)
    output_index = {}
    for i, o in enumerate(graph.outputs):
        output_index[ir.unreshaped(o)] = (i, o)
    last_read = _last_reads(nodes)
    dying: dict = {}  # position -> scratch slots whose tenant is last read there
    slots, scratch = _Slots(), []  # scratch: (entry, slot)
    tensors, placement, cursor = [], {}, 0
    input_count = 0

    def take_scratch(entry: TensorEntry, dies_at: int) -> TensorEntry:
        scratch.append((entry, slots.take(_aligned(entry.nbytes), row_bytes(entry.shape, entry.dtype), position)))
        dying.setdefault(dies_at, []).append(scratch[-1][1])
        tensors.append(entry)
        return entry

    for position, n in enumerate(nodes):
        if n.op is Op.RESHAPE:
            placement[n] = placement[n.inputs[0]]
            continue
        if n.op is Op.KERNEL_OUTPUT:  # placed with its kernel, below
            continue
        if n.op is Op.CUSTOM_KERNEL or "outputs" in n.attrs:  # a matmul's too (passes/matmul_column_sums.py)
            readers = {r.attrs["index"]: r for r in consumers.get(n, ()) if r.op is Op.KERNEL_OUTPUT}
            for index, (shape, dtype) in enumerate(n.attrs["outputs"][1:], 1):
                reader = readers.get(index)
                if reader is None:
                    placement[(n, index)] = take_scratch(
                        TensorEntry(f"t{n.id}_out{index}", TensorKind.SCRATCH, dtype, shape, 0), position)
                elif reader in output_index:
                    entry = _entry(reader, output_index, input_count)
                    entry.offset = cursor
                    cursor += _aligned(entry.nbytes)
                    tensors.append(entry)
                    placement[reader] = placement[(n, index)] = entry
                else:
                    placement[reader] = placement[(n, index)] = take_scratch(
                        _entry(reader, output_index, input_count), last_read.get(reader, position))
            for index, (shape, dtype) in enumerate(n.attrs.get("scratch", ())):
                placement[(n, "scratch", index)] = take_scratch(
                    TensorEntry(f"t{n.id}_scratch{index}", TensorKind.SCRATCH, dtype, shape, 0), position)
        if _needs_buffer(n, consumers, output_index):
            entry = _entry(n, output_index, input_count)
            input_count += entry.kind is TensorKind.INPUT
            if entry.kind is TensorKind.SCRATCH:
                scratch.append((entry, slots.take(_aligned(entry.nbytes), row_bytes(entry.shape, entry.dtype), position)))
                dying.setdefault(last_read.get(n, position), []).append(scratch[-1][1])
            else:
                entry.offset = cursor
                cursor += _aligned(entry.nbytes)
            tensors.append(entry)
            placement[n] = entry
        for slot in dying.pop(position, ()):  # after the kernel's own buffer is taken: it reads them
            slots.give_back(slot, position)
    starts = []
    for size in slots.sizes:
        starts.append(cursor)
        cursor += size
    for entry, slot in scratch:
        entry.offset = starts[slot]
    return MemoryPlan(sorted(tensors, key=lambda t: t.offset), placement, cursor)


def check_capacity(plan: MemoryPlan, target) -> None:
    """Refuse a program whose tensors need more HBM than one NeuronCore of ``target`` has, before code is
    generated for it (and before anything would try to hold its bytes)."""
    if plan.hbm_size <= target.hbm_bytes:
        return
    from neuronc.errors import NeuronCompileError

    gib = 2**30
    largest = sorted(plan.tensors, key=lambda t: t.nbytes, reverse=True)[:5]
    raise NeuronCompileError(
        f"the program needs {plan.hbm_size / gib:.2f} GiB of HBM, but a {target.name} NeuronCore has "
        f"{target.hbm_bytes / gib:.2f} GiB",
        problems=[f"{t.kind.name.lower()} {t.name}: {t.dtype.name}{list(t.shape)}, {t.nbytes / gib:.2f} GiB"
                  for t in largest],
        hint="use a smaller batch or sequence, cast weights to bf16 (--auto-cast all), or a target with more "
        "HBM per core")
