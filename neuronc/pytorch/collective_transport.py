"""The transport of compiled graphs' collective instructions: torch.distributed process groups.

The runtime executes a NEFF's collective instructions at their place in the schedule by calling its transport
(:class:`runtime.collectives.Transport`); for a graph compiled by ``torch.compile`` this one runs each through
the process group the graph's collective named (by group number: ``Compiled.collective_groups``), on host
views of the core's HBM (CPU tensors, so through the "neuron" backend's gloo, with its agreement check and its
errors). Reductions of floats narrower than fp32 are done in fp32 and rounded once, as the ISA defines them.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from neuronc.errors import CollectiveError
from neuronc.isa import AluOp, CollectiveOp
from neuronc.pytorch.device_memory import NUMPY_DTYPES

_REDUCE_OPS = {AluOp.ADD: dist.ReduceOp.SUM, AluOp.MAX: dist.ReduceOp.MAX, AluOp.MIN: dist.ReduceOp.MIN,
               AluOp.MULTIPLY: dist.ReduceOp.PRODUCT}
_TORCH_DTYPES = {np_dtype: torch_dtype for torch_dtype, np_dtype in NUMPY_DTYPES.items()}
_BITS = {1: np.uint8, 2: np.int16}  # the integers of a width, to carry bf16 and fp8 bytes


def _tensor(array: np.ndarray) -> torch.Tensor:
    """A CPU tensor over a numpy array's bytes (no copy; bf16 and fp8 through integers of their width)."""
    dtype = _TORCH_DTYPES[array.dtype]
    if dtype in (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2):  # dtypes numpy has only through ml_dtypes
        return torch.from_numpy(array.view(_BITS[array.dtype.itemsize])).view(dtype)
    return torch.from_numpy(array)


class ProcessGroupTransport:
    """Collectives of a loaded program through the process groups named ``group_names`` (by group number)."""

    def __init__(self, group_names: list):
        self.group_names = list(group_names)

    def _group(self, group: int, ranks: int):
        from torch.distributed.distributed_c10d import _resolve_process_group

        if group >= len(self.group_names):
            raise CollectiveError(f"the program names group {group}, but it was compiled with "
                                  f"{len(self.group_names)} process groups")
        pg = _resolve_process_group(self.group_names[group])
        if pg.size() != ranks:
            raise CollectiveError(f"process group {self.group_names[group]!r} has {pg.size()} ranks; the program was "
                                  f"compiled for {ranks}", hint="recompile for this group")
        return pg

    @torch.compiler.disable  # called by the runtime, maybe while a compiled function runs: never traced
    def collective(self, op: CollectiveOp, group: int, ranks: int, reduce: AluOp, dst: np.ndarray,
                   src: np.ndarray) -> None:
        pg = self._group(group, ranks)
        source, out = _tensor(src), _tensor(dst)
        if op in (CollectiveOp.ALL_REDUCE, CollectiveOp.REDUCE_SCATTER):
            wide = source.float() if source.is_floating_point() and source.element_size() < 4 else source.clone()
            if op == CollectiveOp.ALL_REDUCE:
                dist.all_reduce(wide, op=_REDUCE_OPS[reduce], group=pg)
                out.copy_(wide)
            else:
                part = wide.new_empty(out.shape)
                dist.reduce_scatter_tensor(part, wide, op=_REDUCE_OPS[reduce], group=pg)
                out.copy_(part)
        elif op == CollectiveOp.ALL_GATHER:
            dist.all_gather_into_tensor(out, source, group=pg)
        elif op == CollectiveOp.ALL_TO_ALL:
            dist.all_to_all_single(out, source, group=pg)
        else:
            raise CollectiveError(f"the collective engine does not run {op.name}")
