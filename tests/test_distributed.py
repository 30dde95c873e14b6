"""The "neuron" backend of torch.distributed, between two processes on `neuron` tensors: collectives give what
they give on the CPU (gloo's, for the same collectives on CPU tensors); the process group is a c10d Backend with a
name, so DeviceMesh, DTensor and the functional collectives work; DDP averages gradients as one process would; a
collective lasts a latency plus a transfer time on the emulated clock and overlaps with compute until waited for; ranks that disagree on a collective, a
rank that dies and one that comes too late give every surviving rank a clear error instead of a hang. The rank
program is tests/distributed_checks.py."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import TOLERANCES, run_ranks
from tests.distributed_checks import TIMEOUT_S

WORLD = 2

pytestmark = pytest.mark.slow("one 2-rank job (~45 s): the only tests of the neuron process group between real processes: "
                               "collectives against gloo, DDP, failures that must not hang, compiled DP/TP collectives")


@pytest.fixture(scope="module")
def job():
    """What each of two ranks observed in every scenario (one job, one process per rank: starting a rank costs more
    than its scenarios, and each compiles its device programs once); the two that break a group come last, each in
    a group of its own, rank 1 leaving the job in the very last."""
    return run_ranks(["-m", "tests.distributed_checks", "collectives", "other_collectives", "mismatch", "compiled",
                      "partitioned", "late_rank", "dead_rank"], ranks=WORLD, timeout=1800)


@pytest.fixture(scope="module")
def ranks(job):
    return [rank["collectives"] for rank in job]


@pytest.fixture(scope="module")
def compiled_ranks(job):
    """Each rank's eager and compiled runs of DDP, FSDP2, SimpleFSDP and tensor parallelism."""
    return [rank["compiled"] for rank in job]


def test_collectives_and_messages_on_neuron_tensors_give_what_they_give_on_the_cpu(ranks):
    inputs = [torch.arange(6, dtype=torch.float32) + 10 * r for r in range(WORLD)]
    for out in ranks:
        assert out["all_reduce"] == sum(inputs).tolist()
        assert out["all_reduce_max"] == [float(WORLD + 1)] * 4
        assert out["all_reduce_avg"] == [1.5] * 4
        assert out["all_reduce_bf16"] == [torch.tensor(2 + 1 / 256, dtype=torch.bfloat16).item()] * 3
        assert out["broadcast_bf16"] == [1.0] * 3
        assert out["all_gather"] == [[float(r)] * 2 for r in range(WORLD)]
        assert out["recv"] == [0.0, 1.0, 2.0, 3.0, 4.0]
    total = sum(torch.arange(4, dtype=torch.float32) * (r + 1) for r in range(WORLD))
    assert [out["reduce_scatter"] for out in ranks] == [total[2 * r:2 * r + 2].tolist() for r in range(WORLD)]
    sent = [torch.arange(4, dtype=torch.float32) + 10 * r for r in range(WORLD)]
    assert [out["all_to_all"] for out in ranks] == [torch.cat([s[2 * r:2 * r + 2] for s in sent]).tolist()
                                                    for r in range(WORLD)]


@pytest.fixture(scope="module")
def other_collectives(job):
    return [rank["other_collectives"] for rank in job]


def test_reduce_gather_scatter_all_to_all_and_barrier_on_neuron_tensors_give_what_gloo_gives_on_the_cpu(
        other_collectives):
    """Each rank's results on `neuron` tensors in the neuron group equal, bit for bit, the same collectives' on CPU
    tensors in a gloo group of the same ranks (reduce's on its root; gather's on its root), and what they must be."""
    root_only = {"reduce_sum": 1, "reduce_max": 1, "reduce_avg": 1, "reduce_bf16": 0, "gather": 0}
    for rank, out in enumerate(other_collectives):
        for name, gloo in out["gloo"].items():
            if root_only.get(name, rank) == rank:
                assert out["neuron"][name] == gloo, name
    inputs = [[1.0 + r, 10.0 - 3 * r, 0.5 * r] for r in range(WORLD)]
    root = other_collectives[1]["neuron"]
    assert root["reduce_sum"] == [sum(v) for v in zip(*inputs)]
    assert root["reduce_max"] == [max(v) for v in zip(*inputs)]
    assert root["reduce_avg"] == [sum(v) / WORLD for v in zip(*inputs)]
    bf16 = sum(torch.tensor([1.0, 1.0 + r / 128], dtype=torch.bfloat16) for r in range(WORLD))
    assert other_collectives[0]["neuron"]["reduce_bf16"] == bf16.float().tolist()
    assert other_collectives[0]["neuron"]["gather"] == [[r, r * 2.0, -r] for r in range(WORLD)]
    for rank, out in enumerate(o["neuron"] for o in other_collectives):
        assert out["scatter"] == [10.0 * rank, 10.0 * rank + 1]
        assert out["all_to_all"] == [[100.0 * r + rank, -(100.0 * r + rank)] for r in range(WORLD)]
        assert out["all_gather_into_tensor"] == [v for r in range(WORLD) for v in (r, r + 0.5)]
        assert out["reduce_scatter_list"] == [sum(rank + r for r in range(WORLD)), sum(rank * r for r in range(WORLD))]
        assert out["barrier"]
    assert other_collectives[0]["seen_after_barrier"]  # rank 1 stored it a second late, before its barrier


def test_the_group_is_a_named_backend_so_device_mesh_dtensor_and_functional_collectives_work(ranks):
    whole = torch.arange(8.0).reshape(4, 2)
    for rank, out in enumerate(ranks):
        assert out["backend"] == "neuron" and out["group_name"]
        assert out["functional"] == [3.0] * 3
        assert out["mesh"] == ["neuron", True]
        assert out["shard"] == whole[2 * rank:2 * rank + 2].tolist()
        assert out["replicated"] == whole.tolist()
        assert out["local_device"].startswith("neuron:")


def test_ddp_on_neuron_averages_gradients_as_one_process_on_the_whole_batch(ranks):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    batch = torch.randn(2 * WORLD, 8, generator=torch.Generator().manual_seed(1))
    (model(batch).pow(2).sum() / WORLD).backward()
    for out in ranks:
        assert out["ddp_grad_device"].startswith("neuron:")
        for grad, expected in zip(out["ddp_grads"], model.parameters()):
            torch.testing.assert_close(torch.tensor(grad), expected.grad, **TOLERANCES[torch.float32])


def test_a_collective_lasts_latency_plus_transfer_time_and_overlaps_with_compute_until_waited_for(ranks):
    """AWS's description of a collective's time (neuron-runtime/explore/intranode-collective-comm.rst): "latency +
    data transfer time". On the emulated clock an all-reduce of 1, 2 and 3 x 64 KiB lasts an affine function of
    its bytes, whose fixed part is the latency of a reduce-scatter's and an all-gather's step between two ranks,
    "about 1-2 us" each, and whose bytes move no faster than the chip's HBM; run asynchronously, it lasts beside a
    matmul, not after it."""
    for out in ranks:
        one, two, three = out["all_reduce_ns"]
        per_64k = two - one
        assert per_64k > 0 and three - two == pytest.approx(per_64k, rel=1e-4)
        assert 2 * 1000 <= one - per_64k <= 2 * 2000
        assert per_64k >= out["all_reduce_bytes"] / out["hbm_gbps"]
        collective, compute = one, out["matmul_ns"]
        assert out["overlapped_ns"] == pytest.approx(max(collective, compute))  # side by side, not one after the other


def test_a_non_contiguous_tensor_is_refused_with_the_way_out(ranks):
    for out in ranks:
        error = out["non_contiguous"]
        assert error.startswith("NeuronDeviceError") and "non-contiguous" in error and ".contiguous()" in error
        assert "distributed_checks.py:" in error  # the line of the rank program that asked


def test_ranks_that_disagree_on_a_collective_all_raise_saying_what_each_passed_and_the_group_survives(job):
    for rank, out in enumerate(rank["mismatch"] for rank in job):
        for key in ("shape", "op", "dtype"):
            assert out[key].startswith("CollectiveMismatchError"), out[key]
        assert "rank 0: all_reduce SUM of float32[4]" in out["shape"] and "rank 1: all_reduce SUM of float32[5]" in \
            out["shape"]
        assert "rank 1: broadcast from rank 0" in out["op"] and "bfloat16[3]" in out["dtype"]
        assert out["untouched"] == [1.0] * (4 + rank)  # nothing was moved
        assert out["after"] == [3.0, 3.0]  # the next collective the ranks agree on works


# A hang fails these two: run_ranks kills a job that outlives its timeout.
def test_a_rank_that_dies_gives_the_others_a_collective_error_not_a_hang(job):
    survivor, dead = (rank["dead_rank"] for rank in job)
    assert dead == "leaves"
    assert survivor["error"].startswith("CollectiveError") and "another rank died or left" in survivor["error"]
    assert f"timeout ({TIMEOUT_S} s)" in survivor["error"]  # its own group's, not the default group's 10 minutes


def test_a_rank_that_comes_after_the_timeout_fails_on_every_rank(job):
    for out in (rank["late_rank"] for rank in job):
        assert out["error"].startswith("CollectiveError") and f"timeout ({TIMEOUT_S} s)" in out["error"]


@pytest.mark.parametrize("name", ["ddp", "fsdp2", "simple_fsdp", "tp"])
def test_data_and_tensor_parallelism_compiled_for_neuron_train_as_they_do_in_eager(compiled_ranks, name):
    for out in compiled_ranks:
        eager, compiled = out[name]["eager"], out[name]["compiled"]
        assert compiled["graphs"] >= 2  # it was compiled: a forward and a backward graph at least
        assert eager["losses"][1] < eager["losses"][0]  # the steps trained
        torch.testing.assert_close(torch.tensor(compiled["losses"]), torch.tensor(eager["losses"]),
                                   **TOLERANCES[torch.float32])
        for got, expected in zip(compiled["params"], eager["params"]):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), **TOLERANCES[torch.float32])


@pytest.mark.parametrize("name, collectives", [
    ("ddp", ["ALL_REDUCE"]),  # the gradients' all-reduces, in compiled autograd's backward graph
    ("simple_fsdp", ["ALL_GATHER", "REDUCE_SCATTER"]),  # parameters gathered in the forward, gradients scattered
    ("tp", ["ALL_REDUCE"]),  # the row-wise layer's, in the forward graph
])
def test_the_collectives_of_compiled_data_and_tensor_parallelism_are_instructions_of_the_neff(compiled_ranks, name,
                                                                                              collectives):
    for out in compiled_ranks:
        assert out[name]["compiled"]["collectives"] == collectives
        assert out[name]["eager"]["collective_instructions"] == 0  # eager's ran through the process group


def test_a_partitioned_compiled_graph_keeps_its_collectives_as_instructions_of_its_device_pieces(job):
    """Tensor parallelism with an op the device cannot run right after the row-wise layer's all-reduce: the forward
    graph is partitioned, igammac alone runs on the CPU, and the all-reduce stays in the NEFF of the piece
    before it (it used to run through the process group from the host, the piece cut in two around it)."""
    for out in (rank["partitioned"] for rank in job):
        eager, compiled = out["eager"], out["compiled"]
        assert eager["partitioned"] == 0 and compiled["partitioned"] == 1
        assert "aten.igammac.default" in compiled["on_the_cpu"]
        assert not [op for op in compiled["on_the_cpu"] if "c10d" in op]
        assert compiled["collectives"] == ["ALL_REDUCE"]
        torch.testing.assert_close(torch.tensor(compiled["losses"]), torch.tensor(eager["losses"]),
                                   **TOLERANCES[torch.float32])
        for got, expected in zip(compiled["params"], eager["params"], strict=True):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), **TOLERANCES[torch.float32])


@pytest.mark.parametrize("name", ["ddp", "simple_fsdp"])
def test_compiled_data_parallel_collectives_overlap_with_compute_on_the_emulated_timeline(compiled_ranks, name):
    """The collective stream runs beside the compute engines: a gradient's all-reduce or reduce-scatter starts
    while the gradients of earlier layers are still being computed."""
    for out in compiled_ranks:
        assert out[name]["compiled"]["overlap_ns"] > 0
