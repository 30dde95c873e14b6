"""The "neuron" backend of torch.distributed: collectives between two processes on `neuron` tensors give
what the same collectives give on the CPU, DistributedDataParallel averages gradients as one process
would, and a collective lasts its ring traffic's DMA time on the stream clock."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

WORLD = 2

_RANK = textwrap.dedent("""
    import json, sys, torch, torch.distributed as dist
    from neuronc.instruction_cost import copy_ns
    from neuronc.targets import get_target
    rank, store = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("neuron", init_method="file://" + store, rank=rank, world_size=%(world)d)
    world, out = dist.get_world_size(), {}

    x = (torch.arange(6, dtype=torch.float32) + 10 * rank).to("neuron")
    dist.all_reduce(x)
    out["all_reduce"] = x.cpu().tolist()
    m = torch.full((4,), float(rank + 2)).to("neuron")
    dist.all_reduce(m, op=dist.ReduceOp.MAX)
    out["all_reduce_max"] = m.cpu().tolist()
    b = torch.full((3,), float(rank), dtype=torch.bfloat16).to("neuron")
    dist.broadcast(b, src=1)
    out["broadcast_bf16"] = b.float().cpu().tolist()
    gathered = [torch.empty(2).to("neuron") for _ in range(world)]
    dist.all_gather(gathered, torch.full((2,), float(rank)).to("neuron"))
    out["all_gather"] = [g.cpu().tolist() for g in gathered]
    part = torch.empty(2).to("neuron")
    dist.reduce_scatter_tensor(part, (torch.arange(4, dtype=torch.float32) * (rank + 1)).to("neuron"))
    out["reduce_scatter"] = part.cpu().tolist()

    message = torch.arange(5, dtype=torch.float32).to("neuron") if rank == 0 else torch.zeros(5).to("neuron")
    dist.send(message, dst=1) if rank == 0 else dist.recv(message, src=0)
    out["recv"] = message.cpu().tolist()

    y = torch.randn(256, 64).to("neuron")
    dist.all_reduce(y)  # the first call of each op compiles; time the second
    start, end = torch.Event(enable_timing=True), torch.Event(enable_timing=True)
    start.record(); dist.all_reduce(y); end.record(); end.synchronize()
    out["all_reduce_ns"] = start.elapsed_time(end) * 1e6
    out["ring_ns"] = copy_ns(int(2 * (world - 1) / world * y.numel() * 4), get_target("trn2"))

    try:
        dist.all_reduce(torch.zeros(4, 4).to("neuron").t())
    except Exception as e:
        out["non_contiguous"] = f"{type(e).__name__}: {e}"

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to("neuron")
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    batch = torch.randn(2 * world, 8, generator=torch.Generator().manual_seed(1))
    ddp(batch[2 * rank:2 * rank + 2].to("neuron")).pow(2).sum().backward()
    out["ddp_grads"] = [p.grad.cpu().tolist() for p in model.parameters()]
    out["ddp_grad_device"] = str(model[0].weight.grad.device)
    dist.destroy_process_group()
    print(json.dumps(out))
""") % {"world": WORLD}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """What each of two ranks observed (one run of the script above per rank, side by side)."""
    tmp = tmp_path_factory.mktemp("dist")
    script = tmp / "rank.py"
    script.write_text(_RANK)
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(tmp / "store")], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(WORLD)]
    results = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=600)
        assert p.returncode == 0, stderr[-3000:]
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    return results


def test_collectives_and_messages_on_neuron_tensors_give_what_they_give_on_the_cpu(ranks):
    inputs = [torch.arange(6, dtype=torch.float32) + 10 * r for r in range(WORLD)]
    for out in ranks:
        assert out["all_reduce"] == sum(inputs).tolist()
        assert out["all_reduce_max"] == [float(WORLD + 1)] * 4
        assert out["broadcast_bf16"] == [1.0] * 3
        assert out["all_gather"] == [[float(r)] * 2 for r in range(WORLD)]
        assert out["recv"] == [0.0, 1.0, 2.0, 3.0, 4.0]
    total = sum(torch.arange(4, dtype=torch.float32) * (r + 1) for r in range(WORLD))
    assert [out["reduce_scatter"] for out in ranks] == [total[2 * r:2 * r + 2].tolist() for r in range(WORLD)]


def test_ddp_on_neuron_averages_gradients_as_one_process_on_the_whole_batch(ranks):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    batch = torch.randn(2 * WORLD, 8, generator=torch.Generator().manual_seed(1))
    (model(batch).pow(2).sum() / WORLD).backward()
    for out in ranks:
        assert out["ddp_grad_device"] == "neuron:0"
        for grad, expected in zip(out["ddp_grads"], model.parameters()):
            torch.testing.assert_close(torch.tensor(grad), expected.grad, rtol=1e-4, atol=1e-5)


def test_a_collective_lasts_the_dma_time_of_its_ring_traffic_on_the_stream(ranks):
    for out in ranks:
        assert out["all_reduce_ns"] == pytest.approx(out["ring_ns"])


def test_a_non_contiguous_tensor_is_refused_with_the_way_out(ranks):
    for out in ranks:
        error = out["non_contiguous"]
        assert error.startswith("NeuronDeviceError") and "non-contiguous" in error and ".contiguous()" in error
        assert "rank.py:" in error  # the line of the user's script that asked
