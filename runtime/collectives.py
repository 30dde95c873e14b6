"""The collective engine: how a program's collective instructions reach the other ranks of their group.

The runtime knows nothing of processes, sockets or PyTorch: a collective instruction (ALL_REDUCE, ALL_GATHER,
REDUCE_SCATTER, ALL_TO_ALL; see :mod:`neuronc.isa`) is executed, at its place in the schedule, by a
:class:`Transport` the host gives the loaded program (``LoadedProgram.transport``). A transport runs one
collective of one group and returns when every rank's part is in: the PyTorch layer's moves the bytes through
a torch.distributed process group (between processes, gloo on the host); :class:`LocalGroup` here joins the
NeuronCores of one process, each running its program on its own thread (:func:`run_on_cores`).

Every transport computes what the ISA says, through :func:`combine`: reductions in fp32 for floats (their own
type for integers), rounded once to the destination's dtype.
"""
from __future__ import annotations

import threading
from typing import Protocol

import numpy as np

from neuronc.errors import CollectiveError
from neuronc.isa import AluOp, CollectiveOp

_REDUCE = {AluOp.ADD: np.add, AluOp.MAX: np.maximum, AluOp.MIN: np.minimum, AluOp.MULTIPLY: np.multiply}


class Transport(Protocol):
    """What the collective engine asks of the host: run one collective of group ``group`` (an index into the
    host's table of groups) of ``ranks`` ranks, reading ``src`` and writing ``dst`` (this rank's operands, flat
    numpy views of its HBM) as the ISA defines it; raise :class:`CollectiveError` when it cannot."""

    def collective(self, op: CollectiveOp, group: int, ranks: int, reduce: AluOp, dst: np.ndarray,
                   src: np.ndarray) -> None: ...


def reduce_in_order(arrays: list, reduce: AluOp) -> np.ndarray:
    """The reduction of same-shaped arrays, rank 0 first, in fp32 for floats (their own type for integers)."""
    dtype = np.float32 if arrays[0].dtype.kind == "f" or arrays[0].dtype.name == "bfloat16" else arrays[0].dtype
    total = np.array(arrays[0], dtype=dtype)
    for a in arrays[1:]:
        _REDUCE[reduce](total, a.astype(dtype, copy=False), out=total)
    return total


def combine(op: CollectiveOp, rank: int, srcs: list, reduce: AluOp, dst: np.ndarray) -> None:
    """Write into ``dst`` what rank ``rank`` of a collective gets, given every rank's flat ``srcs``."""
    n = len(srcs)
    if op == CollectiveOp.ALL_REDUCE:
        dst[...] = reduce_in_order(srcs, reduce).astype(dst.dtype)
    elif op == CollectiveOp.ALL_GATHER:
        dst[...] = np.concatenate(srcs)
    elif op == CollectiveOp.REDUCE_SCATTER:
        dst[...] = np.split(reduce_in_order(srcs, reduce), n)[rank].astype(dst.dtype)
    elif op == CollectiveOp.ALL_TO_ALL:
        dst[...] = np.concatenate([np.split(src, n)[rank] for src in srcs])
    else:
        raise CollectiveError(f"the collective engine does not run {op.name}")


class LocalGroup:
    """A group of NeuronCores of one process (one thread per core): each rank's :class:`LocalTransport` meets
    the others here. A collective that some rank does not reach within ``timeout_s`` raises
    :class:`CollectiveError` on the ranks that did."""

    def __init__(self, ranks: int, timeout_s: float = 60.0):
        self.ranks, self.timeout_s = ranks, timeout_s
        self._barrier = threading.Barrier(ranks)
        self._srcs: list = [None] * ranks
        self._what: list = [None] * ranks

    def transport(self, rank: int, group: int = 0) -> "LocalTransport":
        """Rank ``rank``'s transport, with this group as its group number ``group``."""
        return LocalTransport(rank, {group: self})

    def run(self, rank: int, op: CollectiveOp, reduce: AluOp, dst: np.ndarray, src: np.ndarray) -> None:
        self._srcs[rank], self._what[rank] = src, (op, reduce, src.dtype, src.shape)
        self._wait(rank, op)  # every rank's source is in
        if len(set(self._what)) != 1:
            ranks = "; ".join(f"rank {r}: {o.name} {a.name} of {d}{list(s)}" for r, (o, a, d, s) in
                              enumerate(self._what))
            self._wait(rank, op)
            raise CollectiveError(f"the cores of a group ran different collectives ({ranks})",
                                  hint="every core must run the same program")
        combine(op, rank, self._srcs, reduce, dst)
        self._wait(rank, op)  # every rank has read every source: they may be overwritten

    def _wait(self, rank: int, op: CollectiveOp) -> None:
        try:
            self._barrier.wait(self.timeout_s)
        except threading.BrokenBarrierError:
            raise CollectiveError(
                f"{op.name} on core {rank} of a group of {self.ranks}: another core did not reach it within "
                f"{self.timeout_s:g} s, or failed", hint="every core of the group must run the same program"
            ) from None


class LocalTransport:
    """The transport of one rank of :class:`LocalGroup` s (several, one per group number)."""

    def __init__(self, rank: int, groups: dict):
        self.rank, self.groups = rank, groups

    def collective(self, op: CollectiveOp, group: int, ranks: int, reduce: AluOp, dst: np.ndarray,
                   src: np.ndarray) -> None:
        local = self.groups.get(group)
        if local is None or local.ranks != ranks:
            raise CollectiveError(f"the program's group {group} of {ranks} ranks is not one this transport has",
                                  hint="give the transport a group of that size under that number")
        local.run(self.rank, op, reduce, dst, src)


def run_on_cores(programs: list, inputs: list, group: LocalGroup | None = None) -> list:
    """Run one loaded program per NeuronCore of this process (rank r: ``programs[r]`` on ``inputs[r]``), each on
    its own thread, their collectives joined by ``group`` (default: a group of them all, as group 0). Returns each
    rank's RunResult; the first failure is raised after every thread ended."""
    group = group or LocalGroup(len(programs))
    results, errors = [None] * len(programs), [None] * len(programs)

    def run(rank: int) -> None:
        try:
            programs[rank].transport = group.transport(rank)
            results[rank] = programs[rank].run(inputs[rank])
        except BaseException as e:  # noqa: BLE001 - re-raised below, on the caller's thread
            errors[rank] = e
            group._barrier.abort()  # the others stop waiting for this rank

    threads = [threading.Thread(target=run, args=(r,), name=f"neuron core {r}") for r in range(len(programs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = next((e for e in errors if e is not None and not _is_abort(e)), None) or next(
        (e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results


def _is_abort(error: BaseException) -> bool:
    """A rank's failure that only says another rank failed first."""
    return isinstance(error, CollectiveError) and "did not reach it" in error.message
