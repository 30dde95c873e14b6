"""Adaptive eager (opt-in, experimental): the queued ops between two synchronisation points are batched
into one NEFF before they run.

With it on (``torch.neuron.set_adaptive_eager(True)`` or ``TORCH_NEURONX_ADAPTIVE_EAGER=1``), every
functional eager op is queued as a :class:`Launch` that remembers its op, arguments and operands. When a
device synchronises (:mod:`neuronc.pytorch.queues`), each run of consecutive launches on one stream (in
the order they run) becomes one graph: the ops are replayed with make_fx, an operand produced earlier in
the run read from its producer (through ``as_strided`` when it is a view of it), the others as the
graph's inputs; a result is an output of the graph only if its tensor is still held or later queued work
may read its bytes (so intermediates nobody holds are fused away, never written). The graph is compiled
like a ``torch.compile`` graph (so the compiler fuses across the ops), cached by the run's ops and wiring,
and launched once. A run that cannot be compiled runs op by op, and is remembered as such.

In-place and ``out=`` ops join a run when the tensors they write are contiguous (the run's later ops then
read their new values; its earlier ops read the old, as the NEFF reads its inputs first). A run ends at
anything else (copies, fills, writes to strided views), at a change of stream, and at an operand that reads
bytes of the run in a way no view of one result can express (another dtype, or straddling). Printing a tensor synchronises, so it ends the batch there. It is off under
``torch.use_deterministic_algorithms(True)``: batching changes the fusion, hence the rounding.
"""
from __future__ import annotations

import collections
import logging
import os

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef

log = logging.getLogger("neuronc")

ENABLED = os.environ.get("TORCH_NEURONX_ADAPTIVE_EAGER", "") not in ("", "0")
stats: collections.Counter = collections.Counter()  # batches, batched ops, results not written, compiled, refused
_batches: dict = {}  # (device, run key) -> EagerProgram of the batch, or the reason it runs op by op


def set_enabled(enabled: bool) -> None:
    global ENABLED
    ENABLED = bool(enabled)


class Launch:
    """One functional eager op in a queue, with what batching needs to replay it."""

    __slots__ = ("entry", "op", "runtime", "args", "kwargs", "operands", "inputs", "outputs", "flat_outputs",
                 "identities", "produced", "results")

    def __init__(self, entry, op, runtime, args, kwargs, operands, inputs, outputs, flat_outputs, results):
        """``op`` is the functional form of the op called; ``results`` the tensors it writes (contiguous).
        No tensor is kept, only a weak reference to each result's storage: a result whose storage nothing
        holds any more need not be written by a batch. The storage, not the Python tensor: autograd keeps
        what it saves for the backward, and ``.grad`` what it accumulates, as other tensors of the same
        storage, so a result whose own tensor object is gone may still be read later."""
        self.entry, self.op, self.runtime = entry, op, runtime
        self.args, self.kwargs = _skeleton(args), _skeleton(kwargs)
        self.operands = [(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x for x in operands]
        self.inputs, self.outputs, self.flat_outputs = inputs, outputs, flat_outputs
        self.identities = [_identity(x) for x in operands]
        self.produced = [(t.data_ptr(), t.numel() * t.element_size(), t.dtype) for t in results]
        self.results = [StorageWeakRef(t.untyped_storage()) for t in results]

    def __call__(self) -> None:
        self.entry.run(self.inputs, self.outputs)


def _skeleton(values):
    """``values`` (args or kwargs) with each tensor replaced by eager.OPERAND."""
    from neuronc.pytorch.eager import OPERAND

    def strip(value):
        if isinstance(value, torch.Tensor):
            return OPERAND
        if isinstance(value, (list, tuple)):
            return type(value)(strip(v) for v in value)
        return value

    if isinstance(values, dict):
        return {k: strip(v) for k, v in values.items()}
    return tuple(strip(v) for v in values)


def _identity(x):
    """(data pointer, shape, strides, dtype, bytes spanned) of a device tensor operand; None for numbers and
    host tensors."""
    if isinstance(x, torch.Tensor) and not x.is_cpu:
        span = (sum((n - 1) * s for n, s in zip(x.shape, x.stride())) + 1) * x.element_size() if x.numel() else 0
        return x.data_ptr(), tuple(x.shape), tuple(x.stride()), x.dtype, span
    return None


def batch(queue: list, device: int) -> list:
    """The queue (in run order) with each run of two or more consecutive launches on one stream replaced by
    one batched launch."""
    if not ENABLED or torch.are_deterministic_algorithms_enabled():
        return queue
    segments, run, wiring = [], [], []  # segments: (items, wiring of each launch)
    for item in queue:
        launch, stream = item[2], item[4][1]
        wires = _wiring(run, launch) if isinstance(launch, Launch) and run and stream == run[0][4][1] else None
        if wires is not None:
            run.append(item)
            wiring.append(wires)
            continue
        if run:
            segments.append((run, wiring))
        run, wiring = ([item], [_wiring([], launch)]) if isinstance(launch, Launch) else ([], [])
        if not run:
            segments.append(([item], None))
    if run:
        segments.append((run, wiring))
    batched, later_reads = [], []  # from the last segment back: the bytes the work after it may read
    for items, wiring in reversed(segments):
        if len(items) < 2:
            batched.extend(reversed(items))
        else:
            start, sequence, _, _, (_, stream, caller) = items[0]
            launches = [item[2] for item in items]
            batched.append((start, sequence, Batch(launches, wiring, device, _needed(launches, later_reads)), (),
                            (f"a batch of {len(launches)} ops", stream, caller)))
        for item in items:
            later_reads += _reads(item)
    batched.reverse()
    return batched


def _reads(item) -> list:
    """(address, bytes) of what a queued item may read (for a launch, its operands; else any array it has)."""
    if isinstance(item[2], Launch):
        return [(i[0], i[4]) for i in item[2].identities if i is not None]
    if isinstance(item[2], Batch):
        return [(i[0], i[4]) for launch in item[2].launches for i in launch.identities if i is not None]
    return [_span(a) for a in _arrays(item[3])]


def _needed(launches: list, reads: list) -> tuple:
    """Per result of the launches, whether the batch must write it: its tensor is still held, or later
    queued work may read its bytes."""
    return tuple(not ref.expired() or any(p < base + nbytes and base < p + span for p, span in reads)
                 for launch in launches for ref, (base, nbytes, _) in zip(launch.results, launch.produced))


def _arrays(value) -> list:
    if isinstance(value, np.ndarray):
        return [value]
    if isinstance(value, (list, tuple)):
        return [a for v in value for a in _arrays(v)]
    return []


def _span(array: np.ndarray) -> tuple:
    """(first byte address, bytes spanned) of a numpy view."""
    if array.size == 0:
        return 0, 0
    low = sum((n - 1) * s for n, s in zip(array.shape, array.strides) if s < 0)
    high = sum((n - 1) * s for n, s in zip(array.shape, array.strides) if s > 0)
    return array.__array_interface__["data"][0] + low, high - low + array.itemsize


def _wiring(run: list, launch: Launch):
    """How ``launch``'s operands connect to the run: per operand ("in", identity) or ("out", producer,
    output, shape, strides, offset) from the run's last writer of those bytes; None if one reads bytes of
    the run as no view of one result can (other dtype, or part in and part out of it)."""
    wires = []
    for identity in launch.identities:
        if identity is None:
            wires.append(("in", None))
            continue
        pointer, shape, strides, dtype, span = identity
        found = None
        for j, item in enumerate(run):
            for m, (base, nbytes, produced_dtype) in enumerate(item[2].produced):
                if pointer >= base + nbytes or pointer + span <= base:
                    continue  # disjoint
                if produced_dtype != dtype or pointer < base or pointer + span > base + nbytes:
                    return None
                found = ("out", j, m, shape, strides, (pointer - base) // dtype.itemsize)
        wires.append(found or ("in", identity))
    return wires


class Batch:
    """Consecutive launches of one stream run as one NEFF (compiled on first use of their key)."""

    def __init__(self, launches: list, wiring: list, device: int, needed: tuple):
        self.launches, self.wiring, self.device, self.needed = launches, wiring, device, needed

    def __call__(self) -> None:
        externals, inputs, key = {}, [], []
        for launch, wires in zip(self.launches, self.wiring):
            keyed = []
            for wire, array, operand in zip(wires, launch.inputs, launch.operands):
                if wire[0] == "out":
                    keyed.append(wire)
                    continue
                identity = wire[1] if wire[1] is not None else ("number", len(inputs))
                if identity not in externals:
                    externals[identity] = len(inputs)
                    inputs.append((array, operand))
                keyed.append(("in", externals[identity]))
            key.append((id(launch.entry), tuple(keyed)))  # entries live as long as the process: ids are keys
        device = self.device
        cache_key = (device, tuple(key), self.needed)
        program = _batches.get(cache_key)
        if program is None:
            program = _batches[cache_key] = _compile(self.launches, [k for _, k in key], inputs, device,
                                                     self.needed)
        if isinstance(program, str):
            for launch in self.launches:
                launch()
            return
        stats["batches"] += 1
        stats["batched ops"] += len(self.launches)
        outputs = [array for launch in self.launches for array in launch.flat_outputs]
        outputs = [array for array, wanted in zip(outputs, self.needed) if wanted]
        stats["results not written"] += self.needed.count(False)
        stats["device ns saved"] += sum(launch.entry.duration_ns for launch in self.launches) - program.duration_ns
        program.run([array for array, _ in inputs], program.arrange(outputs) if program.permuted else outputs)


def _view_of(source: torch.Tensor, shape: tuple, strides: tuple, offset: int) -> torch.Tensor:
    """The view (shape, strides, offset) of the bytes of ``source`` (a contiguous result), as a reshape and
    a permutation when it is one (what view/transpose/permute make, which the compiler reads in place),
    else as_strided."""
    if shape == tuple(source.shape) and strides == tuple(source.stride()) and offset == 0:
        return source
    order = sorted(range(len(shape)), key=lambda d: -strides[d])  # dimensions from outermost in memory
    expected, contiguous = 1, True
    for d in reversed(order):
        if shape[d] != 1 and strides[d] != expected:
            contiguous = False
        expected *= shape[d]
    if contiguous and offset == 0 and expected == source.numel():
        physical = source.reshape([shape[d] for d in order])
        return physical.permute([order.index(d) for d in range(len(shape))])
    return torch.as_strided(source, shape, strides, offset)


def _lowered(replay, examples: list, options):
    """The batch lowered straight to the IR (neuronc/frontend/aten_lowering.py) and compiled, or None."""
    from neuronc.collector import collector_paused
    from neuronc.compiler import compile_graph
    from neuronc.frontend.aten_lowering import NotLowered, lower_function

    try:
        graph = lower_function(replay, examples, options.name)
    except NotLowered as why:
        log.debug("neuronc: an adaptive batch is traced through torch-mlir: %s", why)
        return None
    with collector_paused():
        compiled = compile_graph(graph, options)
    compiled.output_layout = list(range(len(graph.outputs)))
    return compiled


def _compile(launches: list, wiring: list, inputs: list, device: int, needed: tuple):
    """The EagerProgram of the batch, or why it runs op by op."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from neuronc.compiler import CompileOptions, compile_fx
    from neuronc.errors import NeuronError
    from neuronc.frontend.torch_import import decomposition_table
    from neuronc.pytorch import eager
    from neuronc.pytorch.device_memory import core

    def example(operand):
        if isinstance(operand, tuple):  # (shape, dtype) of a tensor
            return torch.zeros(operand[0], dtype=operand[1])
        return eager._scalar_tensor(operand)

    def replay(*values):
        produced, flat = [], []
        for launch, wires in zip(launches, wiring):
            operands = []
            for wire in wires:
                if wire[0] == "in":
                    operands.append(values[wire[1]])
                    continue
                _, j, m, shape, strides, offset = wire
                operands.append(_view_of(produced[j][m], shape, strides, offset))
            results = eager.call_with_operands(launch.op, launch.args, launch.kwargs, launch.runtime, operands,
                                               [dtype for _, dtype in launch.entry.outputs])
            produced.append(results)
            flat.extend(results)
        return tuple(t for t, wanted in zip(flat, needed) if wanted)

    examples = [example(operand) for _, operand in inputs]
    options = CompileOptions.from_dict({"name": f"adaptive_{len(launches)}_ops"})
    try:
        compiled = _lowered(replay, examples, options)  # the ops' own lowerings, as plain eager's programs
        if compiled is None:  # an op without one: traced and compiled through torch-mlir
            gm = make_fx(replay, decomposition_table=decomposition_table())(*examples)
            compiled = compile_fx(gm, options)
        program = core(device).load(compiled.neff)
    except NeuronError as e:
        stats["refused"] += 1
        log.info("neuronc: adaptive eager runs a batch of %d ops op by op: %s", len(launches), e.message)
        return e.message
    except Exception as e:  # tracing or importing failed: op by op, remembered
        stats["refused"] += 1
        log.info("neuronc: adaptive eager runs a batch of %d ops op by op: %s", len(launches), e)
        return f"{type(e).__name__}: {e}"
    stats["compiled"] += 1
    outputs = [entry for launch in launches for entry in launch.entry.outputs]
    outputs = [entry for entry, wanted in zip(outputs, needed) if wanted]
    return eager.EagerProgram(program, compiled.output_layout, outputs, torch.utils._pytree.tree_flatten(0)[1],
                              program.time().estimated_ns)
