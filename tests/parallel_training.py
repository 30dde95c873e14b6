"""The zoo's GPT-2 trained with AdamW by one rank of a parallel run on `neuron` tensors, or by one process on the
whole batch on the CPU (the reference): the rank program of tests/test_parallel_training.py.

    python -m tests.parallel_training fsdp2_tp 0,1:ddp,tp 2,3:pp_1f1b   # as each rank of a torchrun-style launch

Each argument is a list of configurations run by every rank of the job, or, after "RANKS:", by the ranks listed,
in a process group of their own (so one job of four processes runs the four-rank configurations and two pairs'
two-rank ones, side by side). A rank runs its configurations one after the other (so the device programs the
first compiles serve the others) and prints one JSON line: per configuration, the loss of every step (the mean
over the whole batch) and every parameter after the last step, whole (gathered from the shards or stages).

The model is small (2 layers, width 16, 8 tokens of a 32-word vocabulary, a batch of 4 sequences), trained for 5
steps (each configuration's programs compile in the first; the later ones show the ranks agree on the updated
parameters and the optimizer's state), and AdamW's eps is 1e-4: the gradient of attention's key bias is zero in exact arithmetic (softmax ignores a per-row shift),
and what autograd computes is rounding noise that a small eps would turn into full steps of arbitrary sign, as
tests/test_device.py explains; a larger eps keeps the comparison about the computation.
"""
from __future__ import annotations

import contextlib

import json
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests import zoo

CONFIG = dict(vocab=32, width=16, layers=2, heads=2, context=8)
BATCH, STEPS = 4, 5  # the AdamW steps the issue asks for; the later ones start from the first's state


def data() -> tuple:
    generator = torch.Generator().manual_seed(1)
    shape = (BATCH, CONFIG["context"])
    return (torch.randint(0, CONFIG["vocab"], shape, generator=generator),
            torch.randint(0, CONFIG["vocab"], shape, generator=generator))


def model() -> zoo.GPT2:
    torch.manual_seed(0)
    return zoo.GPT2(**CONFIG)


def optimizer(parameters, **options) -> torch.optim.Optimizer:
    return torch.optim.AdamW(parameters, lr=1e-2, eps=1e-4, **options)


def reference() -> dict:
    """One process, the whole batch, on the CPU."""
    m, (idx, targets) = model(), data()
    opt, losses = optimizer(m.parameters()), []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = m(idx, targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "params": {k: v.detach() for k, v in m.named_parameters()}}


def reference_mixed_precision(ranks: int) -> dict:
    """The CPU's eager counterpart of FSDP2 with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) over
    ``ranks`` ranks: fp32 master parameters; each step every rank's share of the batch runs forward and backward on a
    bf16 copy of them, the gradients are averaged in fp32 and AdamW updates the fp32 masters. A bf16 run must be held
    to a bf16 computation: against the fp32 reference, AdamW turns bf16's rounding of near-zero gradients into whole
    steps of either sign (lr 1e-2), a difference of training in bf16, not of the device."""
    import copy

    m, (idx, targets) = model(), data()
    opt, losses, per = optimizer(m.parameters()), [], BATCH // ranks
    for _ in range(STEPS):
        opt.zero_grad()
        grads, step_losses = [torch.zeros_like(p) for p in m.parameters()], []
        for rank in range(ranks):
            low = copy.deepcopy(m).to(torch.bfloat16)  # deepcopy keeps the tied embedding and head one Parameter
            loss = low(idx[rank * per:(rank + 1) * per], targets[rank * per:(rank + 1) * per])
            loss.backward()
            for g, p in zip(grads, low.parameters()):
                g += p.grad.float() / ranks
            step_losses.append(loss.float().item())
        for p, g in zip(m.parameters(), grads):
            p.grad = g
        opt.step()
        losses.append(sum(step_losses) / ranks)
    return {"losses": losses, "params": {k: v.detach() for k, v in m.named_parameters()}}


def _whole(p: torch.Tensor) -> list:
    p = p.detach()
    p = p.full_tensor() if hasattr(p, "full_tensor") else p
    return p.float().cpu().tolist()


def _mean_over(value: torch.Tensor, group=None) -> float:
    value = value.detach().float().clone()
    dist.all_reduce(value, op=dist.ReduceOp.AVG, group=group)
    return value.item()


def _on_device(m, device):
    m = m.to(device)
    m.head.weight = m.tokens.weight  # .to() of a PrivateUse1 module makes new Parameters: tie them again
    return m


def _data_parallel_loop(m, forward, device, group, opt, backward=contextlib.nullcontext) -> list:
    idx, targets = data()
    rank, ranks = dist.get_rank(group), group.size()
    per, losses = BATCH // ranks, []
    for _ in range(STEPS):
        opt.zero_grad()
        with device:  # GPT2.forward makes its positions with torch.arange
            loss = forward(idx[rank * per:(rank + 1) * per].to(device), targets[rank * per:(rank + 1) * per].to(device))
        with backward():
            loss.backward()
        opt.step()
        losses.append(_mean_over(loss, group))
    return losses


def _mesh(group):
    """The 1-D DeviceMesh of ``group``'s ranks."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, "neuron")


def ddp(device, group) -> dict:
    m = _on_device(model(), device)
    wrapped = torch.nn.parallel.DistributedDataParallel(m, process_group=group)
    losses = _data_parallel_loop(m, wrapped, device, group, optimizer(m.parameters()))
    return {"losses": losses, "params": {k: _whole(v) for k, v in m.named_parameters()}}


def _compiled_graphs(before: int, partitioned_before: int) -> dict:
    """How many graphs neuronc compiled since ``before``, the collective-engine opcodes of their NEFFs, how many
    times they ran on the device, and how many graphs ran in part on the CPU since ``partitioned_before`` (the
    partition fallback; the test asserts none: conftest's guard sees only its own process)."""
    from neuronc.isa import Engine
    from neuronc.pytorch import backend, partition

    graphs = backend.compiled_graphs[before:]
    opcodes = {i.opcode.name for f in graphs for (e, _), s in f.compiled.neff.streams.items()
               if e == Engine.COLLECTIVE for i in s}
    return {"graphs": len(graphs), "collectives": sorted(opcodes), "launches": sum(f.device_launches for f in graphs),
            "partitioned": partition.partitioned_graphs - partitioned_before}


def ddp_compiled(device, group) -> dict:
    """DDP under torch.compile(backend="neuron"): the forward compiled, the backward under compiled autograd with
    the Python reducer, so the gradients' all-reduces are collective instructions of the backward NEFF."""
    import functools

    from neuronc.pytorch import backend, partition

    torch._dynamo.reset()
    before, partitioned_before = len(backend.compiled_graphs), partition.partitioned_graphs
    torch._dynamo.config.optimize_ddp = "python_reducer"  # read by DDP's init
    try:
        m = _on_device(model(), device)
        wrapped = torch.compile(torch.nn.parallel.DistributedDataParallel(m, process_group=group), backend="neuron")
        compiled_autograd = functools.partial(torch._dynamo.compiled_autograd._enable,
                                              torch.compile(backend="neuron"), dynamic=False)
        losses = _data_parallel_loop(m, wrapped, device, group, optimizer(m.parameters()), backward=compiled_autograd)
    finally:
        torch._dynamo.config.optimize_ddp = True
    return {"losses": losses, "params": {k: _whole(v) for k, v in m.named_parameters()}, **_compiled_graphs(before, partitioned_before)}


def _fsdp2(device, group, mixed: bool) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = _mesh(group)
    m = _on_device(model(), device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else \
        MixedPrecisionPolicy()
    for block in m.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=True)
    fully_shard(m, mesh=mesh, mp_policy=policy)
    losses = _data_parallel_loop(m, m, device, group, optimizer(m.parameters()))
    return {"losses": losses, "params": {k: _whole(v) for k, v in m.named_parameters()}}


def fsdp2(device, group) -> dict:
    return _fsdp2(device, group, mixed=False)


def fsdp2_compiled(device, group) -> dict:
    """FSDP2 with compiled blocks, torchtitan's way: torch 2.13 keeps FSDP2's hooks out of Dynamo (each is
    ``torch._dynamo.disable``d), so each transformer block is compiled (torch.compile, fullgraph) and then sharded
    with ``fully_shard``, as is the root: the blocks' forward and backward run as NEFFs on the all-gathered
    parameters, FSDP2's all-gathers and reduce-scatters run in its hooks, through the process group."""
    from torch.distributed.fsdp import fully_shard

    from neuronc.pytorch import backend, partition

    torch._dynamo.reset()
    before, partitioned_before = len(backend.compiled_graphs), partition.partitioned_graphs
    mesh = _mesh(group)
    m = _on_device(model(), device)
    for i, block in enumerate(m.blocks):
        m.blocks.register_module(str(i), torch.compile(block, backend="neuron", fullgraph=True))
        fully_shard(m.blocks[i], mesh=mesh, reshard_after_forward=True)
    fully_shard(m, mesh=mesh)
    losses = _data_parallel_loop(m, m, device, group, optimizer(m.parameters()))
    return {"losses": losses, "params": {k.replace("._orig_mod", ""): _whole(v) for k, v in m.named_parameters()},
            **_compiled_graphs(before, partitioned_before)}


def fsdp2_bf16(device, group) -> dict:
    return _fsdp2(device, group, mixed=True)


def tensor_parallel_plan(m) -> dict:
    """Megatron-style tensor parallelism with sequence parallelism for the zoo's GPT-2: the vocabulary-sharded
    embedding and head (tied: one Shard(0) weight) with loss_parallel, each MLP column- then row-wise, the layer
    norms sequence-parallel; attention (its heads come from the width) computed whole on every rank."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInputOutput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel)

    plan = {
        "tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "positions": PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0),
                                         use_local_output=True),
        "ln_f": SequenceParallel(),
        "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    for i in range(len(m.blocks)):
        plan.update({
            f"blocks.{i}.ln1": SequenceParallel(),
            f"blocks.{i}.attn": PrepareModuleInputOutput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
                output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=True),
            f"blocks.{i}.ln2": SequenceParallel(),
            f"blocks.{i}.mlp.0": ColwiseParallel(input_layouts=Shard(1)),
            f"blocks.{i}.mlp.2": RowwiseParallel(output_layouts=Shard(1)),
        })
    return plan


def _tensor_parallel(m, mesh):
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(m, mesh, tensor_parallel_plan(m))
    m.head.weight = m.tokens.weight  # one vocabulary-sharded weight for both
    return m


def _loss_parallel_loop(m, device, idx, targets, opt) -> list:
    from torch.distributed.tensor.parallel import loss_parallel

    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        with device, loss_parallel():
            loss = m(idx.to(device), targets.to(device))
            loss.backward()
        opt.step()
        losses.append(loss.full_tensor())
    return losses


def tp(device, group, compiled: bool = False) -> dict:
    from neuronc.pytorch import backend, partition

    m = _tensor_parallel(_on_device(model(), device), _mesh(group))
    before, partitioned_before = len(backend.compiled_graphs), partition.partitioned_graphs
    if compiled:
        torch._dynamo.reset()
    forward = torch.compile(m, backend="neuron") if compiled else m
    # foreach AdamW (the default on an accelerator) refuses a mix of DTensor and plain parameters (attention's)
    losses = _loss_parallel_loop(forward, device, *data(), optimizer(m.parameters(), foreach=False))
    return {"losses": [loss.item() for loss in losses], "params": {k: _whole(v) for k, v in m.named_parameters()},
            **(_compiled_graphs(before, partitioned_before) if compiled else {})}


def tp_compiled(device, group) -> dict:
    """Tensor parallelism (with sequence parallelism and loss_parallel) under torch.compile(backend="neuron")."""
    return tp(device, group, compiled=True)


def fsdp2_tp(device, group, compiled: bool = False) -> dict:
    """FSDP2 over the first dimension of a 2 x (ranks/2) mesh of the job's ranks, tensor parallelism over the
    second; with ``compiled``, each tensor-parallel block compiled before fully_shard (as in fsdp2_compiled)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from neuronc.pytorch import backend, partition

    if group.size() != dist.get_world_size():
        raise ValueError("fsdp2_tp runs on every rank of the job")
    mesh = init_device_mesh("neuron", (2, group.size() // 2), mesh_dim_names=("dp", "tp"))
    m = _tensor_parallel(_on_device(model(), device), mesh["tp"])
    before, partitioned_before = len(backend.compiled_graphs), partition.partitioned_graphs
    if compiled:
        torch._dynamo.reset()
    for i, block in enumerate(m.blocks):
        if compiled:
            m.blocks.register_module(str(i), torch.compile(block, backend="neuron", fullgraph=True))
        fully_shard(m.blocks[i], mesh=mesh["dp"])
    fully_shard(m, mesh=mesh["dp"])
    idx, targets = data()
    dp, per = mesh["dp"].get_local_rank(), BATCH // 2
    losses = _loss_parallel_loop(m, device, idx[dp * per:(dp + 1) * per], targets[dp * per:(dp + 1) * per],
                                 optimizer(m.parameters(), foreach=False))
    return {"losses": [_mean_over(loss, mesh["dp"].get_group()) for loss in losses],
            "params": {k.replace("._orig_mod", ""): _whole(v) for k, v in m.named_parameters()},
            **(_compiled_graphs(before, partitioned_before) if compiled else {})}


def fsdp2_tp_compiled(device, group) -> dict:
    return fsdp2_tp(device, group, compiled=True)


class _FirstStage(torch.nn.Module):
    """Embeddings and the first block."""

    def __init__(self, m):
        super().__init__()
        self.tokens, self.positions, self.block = m.tokens, m.positions, m.blocks[0]

    def forward(self, idx):
        return self.block(self.tokens(idx) + self.positions(torch.arange(idx.shape[1], device=idx.device)))


class _LastStage(torch.nn.Module):
    """The second block, the final norm and the head (its own copy of the tied weight)."""

    def __init__(self, m):
        super().__init__()
        self.block, self.ln_f = m.blocks[1], m.ln_f
        self.head = torch.nn.Linear(CONFIG["width"], CONFIG["vocab"], bias=False)
        self.head.weight = torch.nn.Parameter(m.tokens.weight.detach().clone())

    def forward(self, x):
        return self.head(self.ln_f(self.block(x)))


_STAGE_NAMES = ({"tokens.": "tokens.", "positions.": "positions.", "block.": "blocks.0."},
                {"block.": "blocks.1.", "ln_f.": "ln_f.", "head.": "tokens."})


def _pipeline(device, group, schedule_class, compiled: bool = False) -> dict:
    """Two pipeline stages, two micro-batches, the schedule of ``schedule_class``; with ``compiled``, each stage's
    module under torch.compile(backend="neuron"). The embedding and the head share one weight across the stages:
    each stage keeps a copy and their gradients are summed before the step (as Megatron does)."""
    from torch.distributed.pipelining import PipelineStage

    from neuronc.pytorch import backend, partition

    rank, ranks = dist.get_rank(group), group.size()
    stage_module = (_FirstStage if rank == 0 else _LastStage)(model()).to(device)
    before, partitioned_before = len(backend.compiled_graphs), partition.partitioned_graphs
    if compiled:
        torch._dynamo.reset()
    stage = PipelineStage(torch.compile(stage_module, backend="neuron", fullgraph=True) if compiled else stage_module,
                          rank, ranks, device, group=group)
    schedule = schedule_class(stage, n_microbatches=2,
                              loss_fn=lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()))
    tied = stage_module.tokens.weight if rank == 0 else stage_module.head.weight
    opt = optimizer(stage_module.parameters())
    losses = _stage_steps(schedule, opt, tied, data(), device, group, scope=lambda: device)
    params = {}
    for name, value in stage_module.named_parameters():
        prefix = next(p for p in _STAGE_NAMES[rank] if name.startswith(p))
        params[_STAGE_NAMES[rank][prefix] + name[len(prefix):]] = _whole(value)
    return {"losses": losses, "params": params, **(_compiled_graphs(before, partitioned_before) if compiled else {})}


def _stage_steps(schedule, opt, tied, batch, device, group, scope=contextlib.nullcontext) -> list:
    """STEPS steps of a two-stage pipeline ``schedule`` (run inside ``scope()``): the tied embedding/head weight's
    gradients summed over the stages before each step; the losses, the last stage's mean over micro-batches."""
    idx, targets = batch
    rank, ranks, losses = dist.get_rank(group), group.size(), []
    for _ in range(STEPS):
        opt.zero_grad()
        with scope():
            if rank == 0:
                schedule.step(idx.to(device))
                loss = torch.zeros((), device=device)
            else:
                per_microbatch = []
                schedule.step(target=targets.to(device), losses=per_microbatch)
                loss = torch.stack(per_microbatch).mean().detach()
        dist.all_reduce(tied.grad, group=group)
        opt.step()
        dist.broadcast(loss, group=group, group_src=ranks - 1)
        losses.append(loss.item())
    return losses


def pp_traced(device, group) -> dict:
    """``torch.distributed.pipelining.pipeline()``: the whole model traced on the CPU and split before the second
    block, each rank building its stage; the GPipe schedule. Both stages hold the tied embedding and head weight
    (as the split makes them): their gradients are summed before the step, as in :func:`_pipeline`."""
    from torch.distributed.pipelining import ScheduleGPipe, SplitPoint, pipeline

    idx, targets = data()
    rank = dist.get_rank(group)
    pipe = pipeline(model(), mb_args=(idx[:BATCH // 2],), split_spec={"blocks.1": SplitPoint.BEGINNING})
    stage_module = pipe.get_stage_module(rank).to(device)
    stage = pipe.build_stage(rank, device, group=group)
    schedule = ScheduleGPipe(stage, n_microbatches=2,
                             loss_fn=lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()))
    # the split leaves the first stage a "head.weight" it does not use: its own parameters are the others
    own = {name: p for name, p in stage_module.named_parameters() if rank == 1 or name != "head.weight"}
    tied = own["tokens.weight" if rank == 0 else "head.weight"]
    losses = _stage_steps(schedule, optimizer(own.values()), tied, (idx, targets), device, group)
    params = {"tokens.weight" if value is tied else name: _whole(value) for name, value in own.items()}
    return {"losses": losses, "params": params}


def pp_1f1b(device, group) -> dict:
    from torch.distributed.pipelining import Schedule1F1B

    return _pipeline(device, group, Schedule1F1B)


def pp_1f1b_compiled(device, group) -> dict:
    from torch.distributed.pipelining import Schedule1F1B

    return _pipeline(device, group, Schedule1F1B, compiled=True)


def pp_gpipe(device, group) -> dict:
    from torch.distributed.pipelining import ScheduleGPipe

    return _pipeline(device, group, ScheduleGPipe)


CONFIGURATIONS = {f.__name__: f for f in (ddp, ddp_compiled, fsdp2, fsdp2_compiled, fsdp2_bf16, tp, tp_compiled, fsdp2_tp, fsdp2_tp_compiled, pp_1f1b,
                                           pp_1f1b_compiled, pp_gpipe, pp_traced)}


def _plan(arguments: list, world: int) -> list:
    """[(the ranks of a group, its configurations)] of the command line's arguments, "[RANKS:]NAME,NAME"."""
    plan = []
    for argument in arguments:
        ranks, _, names = argument.rpartition(":")
        plan.append((sorted(map(int, ranks.split(","))) if ranks else list(range(world)), names.split(",")))
    return plan


def main(arguments: list) -> None:
    dist.init_process_group("neuron")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("neuron", rank % torch.neuron.device_count())
    torch.neuron.set_device(device.index)
    plan = _plan(arguments, world)
    # every rank makes every group (dist.new_group is collective), then runs the configurations of its own
    groups = [dist.group.WORLD if len(ranks) == world else dist.new_group(ranks) for ranks, _ in plan]
    results = {name: CONFIGURATIONS[name](device, group)
               for (ranks, names), group in zip(plan, groups) if rank in ranks for name in names}
    dist.barrier()  # no rank leaves while another still runs
    dist.destroy_process_group()
    print(json.dumps({"rank": rank, **results}))


if __name__ == "__main__":
    main(sys.argv[1:])
