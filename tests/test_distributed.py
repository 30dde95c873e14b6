"""The "neuron" backend of torch.distributed, between two processes on `neuron` tensors: collectives give what
they give on the CPU; the process group is a c10d Backend with a name, so DeviceMesh, DTensor and the functional
collectives work; DDP averages gradients as one process would; a collective lasts the interconnect model's time
on the emulated clock and overlaps with compute until it is waited for; ranks that disagree on a collective, a
rank that dies and one that comes too late give every surviving rank a clear error instead of a hang. The rank
program is tests/distributed_checks.py."""
from __future__ import annotations

import pytest
import torch

from tests.conftest import TOLERANCES, run_ranks
from tests.distributed_checks import TIMEOUT_S

WORLD = 2


@pytest.fixture(scope="module")
def job():
    """What each of two ranks observed in the scenarios that leave the group working (one job, one process per
    rank: each compiles its device programs once)."""
    return run_ranks(["-m", "tests.distributed_checks", "collectives", "mismatch", "compiled"], ranks=WORLD,
                     timeout=1800)


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


def test_a_collective_lasts_the_interconnect_models_time_and_overlaps_with_compute_until_waited_for(ranks):
    for out in ranks:
        assert out["all_reduce_ns"] == pytest.approx(out["model_ns"])
        collective, compute = out["model_ns"], out["matmul_ns"]
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
def test_a_rank_that_dies_gives_the_others_a_collective_error_not_a_hang():
    survivor, dead = run_ranks(["-m", "tests.distributed_checks", "dead_rank"], ranks=WORLD, timeout=240,
                               may_fail=True)
    assert dead is None
    survivor = survivor["dead_rank"]
    assert survivor["error"].startswith("CollectiveError") and "another rank died or left" in survivor["error"]


def test_a_rank_that_comes_after_the_timeout_fails_on_every_rank():
    results = run_ranks(["-m", "tests.distributed_checks", "late_rank"], ranks=WORLD, timeout=240)
    for out in (rank["late_rank"] for rank in results):
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


@pytest.mark.parametrize("name", ["ddp", "simple_fsdp"])
def test_compiled_data_parallel_collectives_overlap_with_compute_on_the_emulated_timeline(compiled_ranks, name):
    """The collective stream runs beside the compute engines: a gradient's all-reduce or reduce-scatter starts
    while the gradients of earlier layers are still being computed."""
    for out in compiled_ranks:
        assert out[name]["compiled"]["overlap_ns"] > 0
