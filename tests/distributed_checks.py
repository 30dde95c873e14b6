"""What one rank of the "neuron" process group observes in each scenario of tests/test_distributed.py:

    python -m tests.distributed_checks collectives mismatch late_rank dead_rank   # as each rank of a torchrun-style launch (2 ranks)

The scenarios named run one after the other in one process; it prints one JSON line of what each saw; the test compares the ranks' lines with what PyTorch computes
on the CPU, and with the interconnect model.
"""
from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {e}"


def collectives(rank: int, world: int, device) -> dict:
    from neuronc.pytorch import device_memory
    from neuronc.targets import get_target

    out = {"backend": dist.get_backend(), "group_name": dist.group.WORLD.group_name}
    x = (torch.arange(6, dtype=torch.float32) + 10 * rank).to(device)
    dist.all_reduce(x)
    out["all_reduce"] = x.cpu().tolist()
    m = torch.full((4,), float(rank + 2)).to(device)
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    out["all_reduce_max"] = m.cpu().tolist()
    a = torch.full((4,), float(rank + 1)).to(device)
    dist.all_reduce(a, op=dist.ReduceOp.AVG)
    out["all_reduce_avg"] = a.cpu().tolist()
    h = torch.full((3,), 1.0 + rank / 256, dtype=torch.bfloat16).to(device)
    dist.all_reduce(h)
    out["all_reduce_bf16"] = h.float().cpu().tolist()
    b = torch.full((3,), float(rank), dtype=torch.bfloat16).to(device)
    dist.broadcast(b, src=1)
    out["broadcast_bf16"] = b.float().cpu().tolist()
    gathered = [torch.empty(2).to(device) for _ in range(world)]
    dist.all_gather(gathered, torch.full((2,), float(rank)).to(device))
    out["all_gather"] = [g.cpu().tolist() for g in gathered]
    part = torch.empty(2).to(device)
    dist.reduce_scatter_tensor(part, (torch.arange(4, dtype=torch.float32) * (rank + 1)).to(device))
    out["reduce_scatter"] = part.cpu().tolist()
    swapped = torch.empty(4).to(device)
    dist.all_to_all_single(swapped, (torch.arange(4, dtype=torch.float32) + 10 * rank).to(device))
    out["all_to_all"] = swapped.cpu().tolist()
    message = torch.arange(5, dtype=torch.float32).to(device) if rank == 0 else torch.zeros(5).to(device)
    dist.send(message, dst=1) if rank == 0 else dist.recv(message, src=0)
    out["recv"] = message.cpu().tolist()

    # the functional collectives (DTensor's, compiled graphs') and DeviceMesh / DTensor
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    out["functional"] = funcol.all_reduce(torch.full((3,), rank + 1.0).to(device), "sum", dist.group.WORLD).cpu().tolist()
    mesh = init_device_mesh("neuron", (world,))
    out["mesh"] = [mesh.device_type, mesh.get_group().group_name != ""]
    whole = torch.arange(8.0).reshape(4, 2)
    sharded = distribute_tensor(whole, mesh, [Shard(0)])
    out["shard"] = sharded.to_local().cpu().tolist()
    out["replicated"] = sharded.redistribute(mesh, [Replicate()]).to_local().cpu().tolist()
    out["local_device"] = str(sharded.to_local().device)

    # the interconnect model on the emulated clock: a blocking all-reduce holds the current stream for its time
    # (of 1, 2 and 3 x 64 KiB); an async one overlaps with what the stream does before wait()
    start, end = torch.Event(enable_timing=True), torch.Event(enable_timing=True)
    out["all_reduce_ns"] = []
    for rows in (256, 512, 768):
        y = torch.randn(rows, 64).to(device)
        dist.all_reduce(y)  # the first call of each shape may compile; time the second
        start.record()
        dist.all_reduce(y)
        end.record()
        end.synchronize()
        out["all_reduce_ns"].append(start.elapsed_time(end) * 1e6)
    out["all_reduce_bytes"] = 256 * 64 * 4
    target = get_target(device_memory.target())
    out["hbm_gbps"], out["collective_hop_ns"] = target.hbm_gbps * target.cores_per_chip, target.collective_hop_ns
    y = torch.randn(256, 64).to(device)
    z = torch.randn(512, 512).to(device)
    (z @ z).cpu()  # compiled once
    start.record()
    z @ z
    end.record()
    end.synchronize()
    out["matmul_ns"] = start.elapsed_time(end) * 1e6
    start.record()
    work = dist.all_reduce(y, async_op=True)
    z @ z
    work.wait()
    end.record()
    end.synchronize()
    out["overlapped_ns"] = start.elapsed_time(end) * 1e6

    try:
        dist.all_reduce(torch.zeros(4, 4).to(device).t())
    except Exception as e:  # noqa: BLE001 - reported to the test
        out["non_contiguous"] = _error(e)

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to(device)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    batch = torch.randn(2 * world, 8, generator=torch.Generator().manual_seed(1))
    ddp(batch[2 * rank:2 * rank + 2].to(device)).pow(2).sum().backward()
    out["ddp_grads"] = [p.grad.cpu().tolist() for p in model.parameters()]
    out["ddp_grad_device"] = str(model[0].weight.grad.device)
    return out


def _each_collective(rank: int, world: int, device, group, reductions: tuple) -> dict:
    """reduce (with each of ``reductions``), gather, scatter, all_to_all (of lists), barrier, all_gather_into_tensor
    and reduce_scatter of a list, run on ``device``'s tensors in ``group``; what each left, as lists."""
    def tensor(values, dtype=torch.float32):
        return torch.tensor(values, dtype=dtype).to(device)

    def listed(t):
        return t.float().cpu().tolist()

    out = {}
    for op in reductions:
        x = tensor([1.0 + rank, 10.0 - 3 * rank, 0.5 * rank])
        dist.reduce(x, dst=1, op=getattr(dist.ReduceOp, op), group=group)
        out[f"reduce_{op.lower()}"] = listed(x)  # the root's result; on the others, unspecified
    h = tensor([1.0, 1.0 + rank / 128], torch.bfloat16)
    dist.reduce(h, dst=0, group=group)
    out["reduce_bf16"] = listed(h)
    gathered = [torch.zeros(3).to(device) for _ in range(world)] if rank == 0 else None
    dist.gather(tensor([rank, rank * 2.0, -rank]), gathered, dst=0, group=group)
    out["gather"] = [listed(g) for g in gathered] if rank == 0 else None
    piece = torch.zeros(2).to(device)
    pieces = [tensor([10.0 * r, 10.0 * r + 1]) for r in range(world)] if rank == 1 else None
    dist.scatter(piece, pieces, src=1, group=group)
    out["scatter"] = listed(piece)
    received = [torch.zeros(2).to(device) for _ in range(world)]
    dist.all_to_all(received, [tensor([100.0 * rank + r, -(100.0 * rank + r)]) for r in range(world)], group=group)
    out["all_to_all"] = [listed(t) for t in received]
    whole = torch.zeros(2 * world).to(device)
    dist.all_gather_into_tensor(whole, tensor([rank, rank + 0.5]), group=group)
    out["all_gather_into_tensor"] = listed(whole)
    part = torch.zeros(2).to(device)
    dist.reduce_scatter(part, [tensor([r + rank, r * rank]) for r in range(world)], group=group)
    out["reduce_scatter_list"] = listed(part)
    dist.barrier(group=group)
    out["barrier"] = True
    return out


def other_collectives(rank: int, world: int, device) -> dict:
    """Each collective of :func:`_each_collective` on `neuron` tensors in the neuron process group and on CPU
    tensors in a gloo group of the same ranks (PyTorch's own CPU backend: the reference), and that a barrier
    waits for every rank: what rank 1 stores before it, rank 0 finds after it, though rank 1 arrives late."""
    gloo = dist.new_group(backend="gloo")
    out = {"neuron": _each_collective(rank, world, device, None, ("SUM", "MAX", "AVG")),
           "gloo": _each_collective(rank, world, torch.device("cpu"), gloo, ("SUM", "MAX"))}  # gloo has no AVG
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:
        time.sleep(1.0)
        store.set("before_barrier", "rank 1 was here")
    dist.barrier()
    if rank == 0:  # the store's host (rank 1 may not reach it once rank 0 has left)
        out["seen_after_barrier"] = store.check(["before_barrier"])
    return out


def mismatch(rank: int, world: int, device) -> dict:
    """Ranks that disagree on a collective: every rank is told, and the group still works afterwards."""
    out = {}
    x = torch.ones(4 + rank).to(device)
    try:
        dist.all_reduce(x)
    except Exception as e:  # noqa: BLE001
        out["shape"] = _error(e)
    out["untouched"] = x.cpu().tolist()
    try:
        dist.all_reduce(torch.ones(2).to(device)) if rank == 0 else dist.broadcast(torch.ones(2).to(device), src=0)
    except Exception as e:  # noqa: BLE001
        out["op"] = _error(e)
    y = torch.ones(3, dtype=torch.float32 if rank == 0 else torch.bfloat16).to(device)
    try:
        dist.all_reduce(y)
    except Exception as e:  # noqa: BLE001
        out["dtype"] = _error(e)
    z = torch.full((2,), rank + 1.0).to(device)
    dist.all_reduce(z)
    out["after"] = z.cpu().tolist()
    return out


def _short_lived_group():
    """A neuron process group of every rank with a timeout of TIMEOUT_S, for a scenario that breaks it: made once
    every rank is done with the scenario before (in the default group, whose timeout is 10 minutes), so that its
    own short timeout counts only the scenario."""
    dist.barrier()
    group = dist.new_group(backend="neuron", timeout=timedelta(seconds=TIMEOUT_S))
    dist.barrier(group=group)  # every rank has made it
    return group


LEAVES = "leaves"  # what a rank's scenario returns when the rank must end the job there (main prints and exits)


def dead_rank(rank: int, world: int, device) -> dict | str:
    """Rank 1 dies before the collective (it leaves the job with os._exit, as a crash does: nothing closes its
    groups); rank 0 must fail, not hang. The last scenario of a job."""
    group, x = _short_lived_group(), torch.ones(4).to(device)
    if rank == 1:
        return LEAVES
    start = time.monotonic()
    try:
        dist.all_reduce(x, group=group)
        return {"error": None}
    except Exception as e:  # noqa: BLE001
        return {"error": _error(e), "seconds": time.monotonic() - start}


def late_rank(rank: int, world: int, device) -> dict:
    """Rank 1 reaches the collective after the group's timeout: rank 0 fails when it expires, rank 1 after."""
    group, x = _short_lived_group(), torch.ones(4).to(device)
    if rank == 1:
        time.sleep(TIMEOUT_S * 2.5)
    start = time.monotonic()
    try:
        dist.all_reduce(x, group=group)
        return {"error": None}
    except Exception as e:  # noqa: BLE001
        return {"error": _error(e), "seconds": time.monotonic() - start}


def _train(model, forward, device, x, steps: int = 2, backward=contextlib.nullcontext) -> list:
    """Losses of ``steps`` SGD steps of ``forward`` (the model, wrapped or compiled) on ``x``: the negative
    log-likelihood of class 0 (gradients of order one, so that the steps move the parameters). ``backward`` is the
    context the backward pass runs in (compiled autograd's, for compiled DDP)."""
    opt, losses = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False), []  # DTensor and Tensor parameters
    for _ in range(steps):
        opt.zero_grad()
        loss = -forward(x.to(device))[:, 0].log().mean()
        with backward():
            loss.backward()
        opt.step()
        losses.append(loss.detach().float().cpu().item())
    return losses


def _params(model) -> list:
    return [(p.full_tensor() if hasattr(p, "full_tensor") else p).detach().cpu().tolist() for p in model.parameters()]


def _mlp(device):
    from tests import zoo

    torch.manual_seed(0)
    return zoo.MLP().to(device)


class _ReplicateComputation(torch.nn.Module):
    """SimpleFSDP's parametrization (torchtitan's experiments/simple_fsdp; torch 2.13 does not ship SimpleFSDP):
    a parameter is held as a Shard(0) DTensor and gathered whole where it is used; its gradient, a Partial
    average, is reduce-scattered back to the shard. Under torch.compile both collectives are in the graphs."""

    def forward(self, shard):
        from torch.distributed.tensor import Partial, Replicate

        return shard.redistribute(placements=(Replicate(),)).to_local(grad_placements=(Partial("avg"),))


def simple_fsdp(model, mesh):
    """Every parameter of ``model`` sharded over ``mesh`` and parametrized by :class:`_ReplicateComputation`."""
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.nn.utils.parametrize import register_parametrization

    for module in list(model.modules()):
        own = dict(module.named_parameters(recurse=False))
        for name, p in own.items():
            module.register_parameter(name, torch.nn.Parameter(distribute_tensor(p, mesh, (Shard(0),))))
            register_parametrization(module, name, _ReplicateComputation(), unsafe=True)
    return model


def _collectives(functions, device) -> dict:
    """Of the compiled graphs ``functions``: the opcodes of their collective-engine instructions, and the time
    their collective stream overlaps the other streams on the emulated timeline of the run on ``device``."""
    from neuronc.isa import Engine

    opcodes, overlap_ns = [], 0.0
    for f in functions:
        opcodes += [i.opcode.name for (e, _), s in f.compiled.neff.streams.items() if e == Engine.COLLECTIVE for i in s]
        events = f.on_device[device.index][0].time().events
        communicating = [(e.start_ns, e.end_ns) for e in events if e.stream[0] == Engine.COLLECTIVE]
        computing = [(e.start_ns, e.end_ns) for e in events if e.stream[0] != Engine.COLLECTIVE]
        overlap_ns += sum(max(0.0, min(b, d) - max(a, c)) for a, b in _union(communicating) for c, d in _union(computing))
    return {"collectives": sorted(set(opcodes)), "collective_instructions": len(opcodes), "overlap_ns": overlap_ns}


def _union(spans: list) -> list:
    merged = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return merged


def compiled(rank: int, world: int, device) -> dict:
    """DDP, FSDP2, SimpleFSDP and tensor parallelism under torch.compile(backend="neuron") against the same in
    eager, and which collectives the compiled graphs hold: compiled DDP runs its backward under compiled autograd
    with the Python reducer (``optimize_ddp = "python_reducer"``), so its gradients' all-reduces are traced into
    the backward graph; SimpleFSDP's all-gathers are in the forward graph and its reduce-scatters in the backward;
    tensor parallelism's row-wise all-reduce in the forward. FSDP2's (fully_shard) collectives run in its hooks,
    outside the graphs. Data parallel ranks train on batches of their own, tensor parallel ones on the same batch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from neuronc.pytorch import backend

    mesh, out = init_device_mesh("neuron", (world,)), {}
    for name in ("ddp", "fsdp2", "simple_fsdp", "tp"):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(0 if name == "tp" else 1 + rank))
        runs = []
        for compile_it in (False, True):
            model, backward = _mlp(device), contextlib.nullcontext
            if name == "ddp":
                torch._dynamo.config.optimize_ddp = "python_reducer" if compile_it else True  # read by DDP's init
                forward = torch.nn.parallel.DistributedDataParallel(model)
                if compile_it:
                    backward = functools.partial(torch._dynamo.compiled_autograd._enable,
                                                 torch.compile(backend="neuron"), dynamic=False)
            elif name == "fsdp2":
                for layer in (model.fc1, model.fc2, model.fc3):
                    fully_shard(layer, mesh=mesh)
                forward = fully_shard(model, mesh=mesh)
            elif name == "simple_fsdp":
                forward = simple_fsdp(model, mesh)
            else:
                forward = parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
            before = len(backend.compiled_graphs)
            if compile_it:
                torch._dynamo.reset()
                forward = torch.compile(forward, backend="neuron")
            losses = _train(model, forward, device, x, backward=backward)
            torch._dynamo.config.optimize_ddp = True  # the default again
            runs.append({"losses": losses, "params": _params(model),
                         "graphs": len(backend.compiled_graphs) - before,
                         **_collectives(backend.compiled_graphs[before:], device)})
        out[name] = {"eager": runs[0], "compiled": runs[1]}
    return out


def _through_igammac(module, inputs, output):
    """A forward hook that puts an op the device cannot run (neither torch-mlir nor neuronc lowers ``igammac``)
    into the graph, right after the row-wise layer's all-reduce: the compiled graph is partitioned around it."""
    corner = output[:2, :2]
    positive = (corner @ corner.T + 2 * torch.eye(2, device=output.device)).abs()
    return output + torch.igammac(torch.full_like(positive, 2.0), positive).sum()


def partitioned(rank: int, world: int, device) -> dict:
    """Tensor parallelism with one op the device cannot run, eager and compiled: the compiled forward graph is
    partitioned (device pieces as NEFFs, the singular values on the CPU), and the device piece holding the row-wise layer
    keeps its all-reduce as a collective instruction of its NEFF."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from neuronc.pytorch import backend, partition

    mesh, runs = init_device_mesh("neuron", (world,)), {}
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(0))
    for compile_it in (False, True):
        model = _mlp(device)
        forward = parallelize_module(model, mesh, {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
        model.fc2.register_forward_hook(_through_igammac)  # after the layer's own hooks: on its all-reduced output
        before, partitioned_before = len(backend.compiled_graphs), partition.partitioned_graphs
        if compile_it:
            torch._dynamo.reset()
            forward = torch.compile(forward, backend="neuron")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            losses = _train(model, forward, device, x)
        runs["compiled" if compile_it else "eager"] = {
            "losses": losses, "params": _params(model), "graphs": len(backend.compiled_graphs) - before,
            "partitioned": partition.partitioned_graphs - partitioned_before,
            "on_the_cpu": sorted({str(w.message).split(" runs on the CPU")[0].removeprefix("neuronc: ")
                                  for w in caught if "runs on the CPU in this compiled graph" in str(w.message)}),
            **_collectives(backend.compiled_graphs[before:], device)}
    return runs


TIMEOUT_S = 3
SCENARIOS = {f.__name__: f for f in (collectives, other_collectives, mismatch, dead_rank, late_rank, compiled,
                                     partitioned)}


def _all_ready(rank: int, world: int) -> dist.Store:
    """The job's store, returned once every rank has imported and reached it: no timeout then counts how much later
    a loaded machine starts one rank than another."""
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0,
                          timeout=timedelta(minutes=10))
    store.set(f"ready/{rank}", "1")
    store.wait([f"ready/{r}" for r in range(world)])
    return store


def main(names: list) -> None:
    """Run the scenarios ``names`` one after the other in one process group (the ones that break a group, late_rank
    and dead_rank, in groups of their own with a short timeout; dead_rank last) and print one JSON line: each
    scenario's observations."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("neuron", rank % torch.neuron.device_count())
    torch.neuron.set_device(device.index)
    torch.ones(4).to(device)  # the first device op, before any clock runs
    store = _all_ready(rank, world)
    dist.init_process_group("neuron", store=store, rank=rank, world_size=world, timeout=timedelta(minutes=10))
    seen = {}
    for name in names:
        seen[name] = SCENARIOS[name](rank, world, device)
        if seen[name] == LEAVES:
            break
    print(json.dumps(seen), flush=True)
    os._exit(0)  # not destroy_process_group: in the failure scenarios a group is broken, or a rank gone


if __name__ == "__main__":
    main(sys.argv[1:])
