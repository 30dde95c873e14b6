"""How long a collective lasts on the target's interconnect: the one model that times the collective engine's
instructions in the runtime and the `neuron` process group's eager collectives.

The model follows AWS's description of Neuron's collectives (aws-neuron-sdk, neuron-runtime/explore/
intranode-collective-comm.rst); every number is the target's (:mod:`neuronc.targets`):

* "The execution time of a collective communication operation consists of two portions: latency + data
  transfer time": steps x ``collective_hop_ns`` + bytes / bandwidth.
* Ranks are NeuronCores, packed onto chips in order (``cores_per_chip`` to a chip, as one process per core
  places them): a group of N ranks has k ranks on each of c chips.
* The collective runs in two stages, as the documented RDH and Mesh algorithms do: within each chip (the
  cores' DMA through HBM) and between chips (NeuronLink). A reduce-scatter reduces within the chip first,
  then across chips; an all-gather gathers across chips first, then within the chip; an all-reduce is a
  reduce-scatter then an all-gather.
* Steps of a stage of n ranks: log2 n when n is a power of two (recursive doubling/halving, the docs' RDH,
  a tree), else n - 1 (the ring, the docs' fallback).
* Within a chip, a rank moves its bytes at its DMA rate, no faster than its share of the chip's HBM divided by
  the HBM accesses each byte costs: a copy reads and writes it (1R1W: 2), a reduction reads two and writes one
  (2R1W: 3), as the docs count them.
* Between chips, a chip's traffic crosses its NeuronLink at half of ``neuronlink_gbps`` (the figure is per
  chip, both directions; see targets.py), shared by its ranks; a message between two ranks on different chips
  uses one of the chip's ``neuronlink_links`` links (the 2D torus's neighbours).

So each rank's bytes are those of the bandwidth-optimal algorithms (a ring's (N-1)/N of the buffer per phase);
a group on one chip never touches NeuronLink.
"""
from __future__ import annotations

import math

from neuronc.isa import CollectiveOp
from neuronc.targets import Target

COPY_TOUCHES, REDUCE_TOUCHES = 2, 3  # HBM accesses per byte moved: 1R1W, 2R1W


def steps(n: int) -> int:
    """Steps of a collective stage over ``n`` ranks: recursive doubling/halving when n is a power of two."""
    if n <= 1:
        return 0
    return int(math.log2(n)) if n & (n - 1) == 0 else n - 1


def chip_layout(ranks: int, target: Target) -> tuple:
    """(ranks per chip, chips) of a group of ``ranks`` NeuronCores packed onto chips in order."""
    per_chip = min(ranks, target.cores_per_chip)
    return per_chip, math.ceil(ranks / per_chip)


def on_chip_gbps(touches: int, target: Target) -> float:
    """The rate (GB/s, bytes per ns) at which a rank moves bytes to another core of its chip."""
    return min(target.dma_queues * target.dma_gbps_per_queue, target.hbm_gbps / touches)


def _link_gbps(target: Target) -> float:
    """What a chip sends over NeuronLink per ns (half the per-chip figure, which counts both directions)."""
    return target.neuronlink_gbps / 2


def _stage_ns(n: int, nbytes: float, gbps: float, target: Target) -> float:
    return steps(n) * target.collective_hop_ns + nbytes / gbps if n > 1 else 0.0


def _gather_ns(nbytes: int, per_chip: int, chips: int, touches: int, target: Target) -> float:
    """An all-gather (touches=2) or reduce-scatter (touches=3) whose whole buffer is ``nbytes``: within
    each chip, a rank moves (k-1)/k of the buffer; between chips, each chip (c-1)/c of it."""
    within = _stage_ns(per_chip, nbytes * (per_chip - 1) / per_chip, on_chip_gbps(touches, target), target)
    across = _stage_ns(chips, nbytes * (chips - 1) / chips, _link_gbps(target), target)
    return within + across


def collective_ns(op: CollectiveOp, nbytes: int, ranks: int, target: Target) -> float:
    """Estimated duration of collective ``op`` over ``ranks`` NeuronCores of ``target``. ``nbytes``: the whole
    buffer: the tensor all-reduced, broadcast, reduced or sent; the output of an all-gather; the input of a
    reduce-scatter or an all-to-all."""
    if ranks <= 1 and op not in (CollectiveOp.SEND, CollectiveOp.RECV):
        return 0.0
    per_chip, chips = chip_layout(ranks, target)
    if op == CollectiveOp.ALL_GATHER:
        return _gather_ns(nbytes, per_chip, chips, COPY_TOUCHES, target)
    if op == CollectiveOp.REDUCE_SCATTER:
        return _gather_ns(nbytes, per_chip, chips, REDUCE_TOUCHES, target)
    if op in (CollectiveOp.ALL_REDUCE, CollectiveOp.REDUCE):  # a reduce is priced as the all-reduce it is at most
        return (_gather_ns(nbytes, per_chip, chips, REDUCE_TOUCHES, target)
                + _gather_ns(nbytes, per_chip, chips, COPY_TOUCHES, target))
    if op == CollectiveOp.BROADCAST:  # a pipelined tree: the buffer once through each stage
        return (_stage_ns(per_chip, nbytes, on_chip_gbps(COPY_TOUCHES, target), target)
                + _stage_ns(chips, nbytes, _link_gbps(target), target))
    if op == CollectiveOp.ALL_TO_ALL:  # one step (Mesh): each rank keeps 1/N and sends the rest
        within = nbytes * (per_chip - 1) / ranks / on_chip_gbps(COPY_TOUCHES, target)
        across = per_chip * nbytes * (chips - 1) / chips / _link_gbps(target) if chips > 1 else 0.0
        return target.collective_hop_ns + within + across
    if op in (CollectiveOp.SEND, CollectiveOp.RECV):
        return p2p_ns(nbytes, same_chip=chips == 1, target=target)
    if op == CollectiveOp.BARRIER:
        return steps(per_chip) * target.collective_hop_ns + steps(chips) * target.collective_hop_ns
    raise ValueError(f"no cost for collective {op!r}")


def collective_hbm_bytes(op: CollectiveOp, nbytes: int, ranks: int, target: Target) -> int:
    """The HBM accesses of one rank's core during a collective (what it shares its HBM bandwidth with its DMA
    queues for): per byte it moves within the chip, 2 (a copy) or 3 (a reduction); per byte it sends or
    receives over NeuronLink, 1."""
    if ranks <= 1:
        return 0
    per_chip, chips = chip_layout(ranks, target)
    within, across = nbytes * (per_chip - 1) / per_chip, nbytes * (chips - 1) / chips / per_chip
    touches = {CollectiveOp.ALL_GATHER: COPY_TOUCHES, CollectiveOp.REDUCE_SCATTER: REDUCE_TOUCHES,
               CollectiveOp.ALL_REDUCE: COPY_TOUCHES + REDUCE_TOUCHES, CollectiveOp.REDUCE: COPY_TOUCHES + REDUCE_TOUCHES,
               CollectiveOp.ALL_TO_ALL: COPY_TOUCHES, CollectiveOp.BROADCAST: COPY_TOUCHES}.get(op, 0)
    passes = 2 if op in (CollectiveOp.ALL_REDUCE, CollectiveOp.REDUCE) else 1
    return int(touches * within + passes * across)


def p2p_ns(nbytes: int, *, same_chip: bool, target: Target) -> float:
    """One message of ``nbytes`` between two ranks: one hop, at a core's on-chip rate or over one NeuronLink."""
    gbps = on_chip_gbps(COPY_TOUCHES, target) if same_chip else target.neuronlink_gbps / 2 / target.neuronlink_links
    return target.collective_hop_ns + nbytes / gbps
