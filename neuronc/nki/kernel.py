"""A traced kernel: its instructions with on-chip addresses chosen, ready to be placed in a program.

A :class:`TracedKernel` keeps its HBM operands symbolic (the storages of its arguments, outputs and scratch
tensors), so the same kernel can be a program of its own (``to_neff``: for ``nki.simulate_kernel`` and
``nki.benchmark``) or one kernel among the compiler's in a graph's NEFF (``instructions`` with the graph's
tensors' offsets, see ``neuronc/codegen/custom.py``).
"""
from __future__ import annotations

import dataclasses

import numpy as np

from neuronc import __version__
from neuronc.affine_fit import affine_fit
from neuronc.codegen.sync import insert_waits
from neuronc.isa import DESTINATIONS, Instruction, Space
from neuronc.neff.program import KernelInfo, Neff, TensorEntry, TensorKind
from neuronc.nki.alloc import allocate
from neuronc.nki.schedule import schedule
from neuronc.nki.trace import Trace
from neuronc.passes.cost_model import estimate_streams
from neuronc.targets import Target

ALIGNMENT = 64


@dataclasses.dataclass
class TracedKernel:
    name: str
    target: Target
    instrs: list  # of trace.Emitted, program order
    inputs: list  # HBM Storages of the array arguments, in argument order
    outputs: list  # HBM Storages the kernel returns, in order
    scratch: list  # other HBM Storages (nl.ndarray in HBM not returned)
    debug_locs: list
    written_inputs: tuple  # positions (among inputs) of arguments the kernel writes
    returns_tuple: bool = False  # the kernel returns a tuple (or list) of tensors

    @classmethod
    def from_trace(cls, trace: Trace, inputs: list, outputs: list) -> "TracedKernel":
        trace.flush()
        allocate(trace.storages, trace.target)
        instrs = schedule(trace.instrs, trace.target)
        outputs_ids = {s.id for s in outputs}
        input_ids = {s.id for s in inputs}
        scratch = [s for s in trace.hbm if s.id not in outputs_ids and s.id not in input_ids]
        written = set()
        for e in trace.instrs:
            for storage, _ in e.operands[:_destinations(e)]:
                if storage.id in input_ids:
                    written.add(next(i for i, s in enumerate(inputs) if s.id == storage.id))
        return cls(trace.name, trace.target, instrs, list(inputs), list(outputs), scratch,
                   list(trace.debug_locs), tuple(sorted(written)))

    # -- instructions at addresses -----------------------------------------------------------------------
    def instructions(self, hbm_offsets: dict, kernel: int = 0, debug: list | None = None,
                     views: dict | None = None) -> list:
        """The kernel's instructions in program order, HBM operands at ``hbm_offsets`` ({storage id: byte offset}),
        of kernel number ``kernel``; ``debug`` maps the kernel's debug locations to the program's table; ``views``
        ({storage id: (offset, strides)}) accesses a storage's elements at those positions of the tensor at its
        offset: an input read through a view, an output written in place in a larger tensor (``read_through``:
        ``reads_input_through``'s or ``writes_output_through``'s check passed)."""
        out = []
        for e in self.instrs:
            operands = []
            for storage, ap in e.operands:
                base = hbm_offsets[storage.id] if storage.space == Space.HBM else storage.base
                if views and storage.id in views:
                    ap = read_through(ap, storage.shape, *views[storage.id])
                operands.append(dataclasses.replace(ap, offset=ap.offset + base))
            out.append(Instruction(e.opcode, e.engine, tuple(operands), queue=e.queue, kernel=kernel,
                                   debug=debug[e.debug] if debug is not None else e.debug, **e.fields))
        return out

    def reads_input_through(self, position: int, offset: int, strides: tuple) -> bool:
        """Whether input ``position`` may be read through a view (element ``offset`` and ``strides`` per dim of
        the input's shape, in a tensor of its dtype): the kernel does not write it and each access of it is one
        access pattern of the viewed tensor (``read_through``)."""
        if position in self.written_inputs:
            return False
        return self._accesses_map_through(self.inputs[position], offset, strides)

    def writes_output_through(self, index: int, offset: int, strides: tuple) -> bool:
        """Whether output ``index`` may be written in place in a larger tensor (its elements at element ``offset``
        and ``strides`` per dim of the output's shape there): each access of it (its stores, and any load of what
        it stored) is one access pattern of that tensor (``read_through``)."""
        return self._accesses_map_through(self.outputs[index], offset, strides)

    def _accesses_map_through(self, storage, offset: int, strides: tuple) -> bool:
        return all(read_through(ap, storage.shape, offset, strides) is not None
                   for e in self.instrs for s, ap in e.operands if s.id == storage.id)

    @property
    def instruction_count(self) -> int:
        return len(self.instrs)

    # -- as a program of its own --------------------------------------------------------------------------
    def to_neff(self) -> Neff:
        """The kernel as a program of its own. An argument the kernel writes (NKI updates it in place) is an
        input and, after the kernel's own outputs, an output: a program writes no input, so its first
        instruction copies the input into the output entry, where the kernel's instructions read and write it."""
        tensors, offsets, cursor = [], {}, 0
        written = [self.inputs[position] for position in self.written_inputs]
        copies = []
        for kind, storages in ((TensorKind.INPUT, self.inputs), (TensorKind.OUTPUT, self.outputs + written),
                               (TensorKind.SCRATCH, self.scratch)):
            for index, s in enumerate(storages):
                name = s.name
                if kind == TensorKind.OUTPUT and index >= len(self.outputs):
                    name = f"{s.name} (written)"
                    copies.append((cursor, offsets[s.id], s))
                offsets[s.id] = cursor
                tensors.append(TensorEntry(name, kind, s.dtype, tuple(s.shape), cursor,
                                           index if kind != TensorKind.SCRATCH else -1))
                cursor += -(-max(s.hbm_bytes, 1) // ALIGNMENT) * ALIGNMENT
        instructions = [_hbm_copy(dst, src, s) for dst, src, s in copies] + self.instructions(offsets)
        streams = insert_waits(instructions, tensors, self.target)
        makespan, kernel_ns = estimate_streams(streams, self.target)
        info = KernelInfo(name=self.name, ops=("nki_kernel",), debug=0, estimated_ns=kernel_ns.get(0, makespan))
        return Neff(name=self.name, target=self.target.name, tensors=tensors, streams=streams, hbm_size=max(cursor, 64),
                    debug_locs=list(self.debug_locs), kernels=[info], estimated_ns=makespan,
                    compiler_version=__version__)


@dataclasses.dataclass(frozen=True)
class KernelRef:
    """How a graph's CUSTOM_KERNEL node names its traced kernel (printable IR text): the kernel's name and the
    key under which this process registered it (``register``)."""

    name: str
    key: str


_REGISTRY: dict = {}  # key -> TracedKernel


def register(traced: TracedKernel) -> KernelRef:
    """A reference to ``traced`` for a graph node, keyed by the kernel's instructions (the same trace, the same key)."""
    import hashlib

    digest = hashlib.sha256(repr([(e.opcode, e.engine, e.queue, sorted(e.fields.items()),
                                   [(s.id, ap) for s, ap in e.operands]) for e in traced.instrs]).encode())
    key = f"{traced.name}-{digest.hexdigest()[:16]}-{id(traced):x}"
    _REGISTRY[key] = traced
    return KernelRef(traced.name, key)


def traced_kernel(ref: KernelRef) -> TracedKernel:
    if ref.key not in _REGISTRY:
        raise KeyError(f"no traced kernel {ref.name} ({ref.key}) in this process")
    return _REGISTRY[ref.key]


def _register_ir_text() -> None:
    from neuronc import ir_text

    ir_text.register(KernelRef)


_register_ir_text()


def _hbm_copy(dst: int, src: int, storage) -> Instruction:
    """A DMA copying the HBM tensor ``storage`` (dense) from byte offset ``src`` to ``dst``."""
    from neuronc.isa import AccessPattern, Engine, Opcode

    n = max(int(np.prod(storage.shape, dtype=np.int64)), 1)
    ap = AccessPattern(Space.HBM, storage.dtype, 0, ((n, 1), (1, n)))
    return Instruction(Opcode.DMA_COPY, Engine.DMA, (dataclasses.replace(ap, offset=dst),
                                                      dataclasses.replace(ap, offset=src)))


def read_through(ap, shape: tuple, offset: int, strides: tuple):
    """``ap``, an access of a dense tensor of ``shape``, as the same elements of a tensor that holds them at
    ``offset + index . strides`` (elements): the access pattern of the same dims (sizes) over the other tensor, or
    None when its positions there are not one affine map (a run that crosses a dim the view reorders)."""
    size = ap.dtype.itemsize
    if ap.offset % size:
        return None
    grid = np.indices(ap.shape, dtype=np.int64)
    dense = ap.offset // size + sum(g * stride for g, (stride, _) in zip(grid, ap.dims))
    if dense.size and (dense.min() < 0 or dense.max() >= max(int(np.prod(shape, dtype=np.int64)), 1)):
        return None
    index = np.unravel_index(dense, tuple(shape))
    fitted = affine_fit(offset + sum(i * s for i, s in zip(index, strides)))
    if fitted is None:
        return None
    base, steps = fitted
    return dataclasses.replace(ap, offset=base * size, dims=tuple((step, n) for step, (_, n) in zip(steps, ap.dims)))


def _destinations(e) -> int:
    return DESTINATIONS.get(e.opcode, 1)


def as_numpy(x) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    if type(x).__module__.startswith("torch"):
        t = x.detach().cpu()
        import torch

        if t.dtype == torch.bfloat16:
            import ml_dtypes

            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()
    return np.asarray(x)
