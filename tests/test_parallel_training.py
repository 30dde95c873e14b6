"""The zoo's GPT-2 trained for 5 AdamW steps on `neuron` tensors with each way of spreading it over ranks — DDP,
FSDP2 (fp32 and bf16 mixed precision), tensor parallelism with sequence parallelism and loss_parallel, FSDP2 x
TP on a 2x2 mesh, a 2-stage pipeline with the 1F1B and the GPipe schedules, manual stages or split by tracing
(`torch.distributed.pipelining.pipeline()`) — gives the losses and parameters
of one process on the whole batch (eager PyTorch on the CPU), within the fp32 tolerance (bf16's for mixed precision); so do DDP and tensor parallelism
under torch.compile(backend="neuron"), their collectives instructions of the compiled NEFFs, FSDP2 with each
block compiled inside fully_shard, FSDP2 x TP with its tensor-parallel blocks compiled, and the 1F1B pipeline
with each stage's module compiled. The rank program is
tests/parallel_training.py; every run is loopback only, and bounded in time."""
from __future__ import annotations

import pytest
import torch

from tests import parallel_training
from tests.conftest import EAGER_ERROR_MULTIPLIER, TOLERANCES, _rmse, run_ranks

DATA_AND_TENSOR_PARALLEL = ["ddp", "fsdp2", "fsdp2_bf16", "tp", "ddp_compiled", "tp_compiled", "fsdp2_compiled"]
PIPELINES = ["pp_1f1b", "pp_gpipe", "pp_traced", "pp_1f1b_compiled"]

pytestmark = pytest.mark.slow("one 2-rank and one 4-rank job (~115 s of the suite): the only tests that a model trained over "
                               "ranks, each way PyTorch spreads it, eager and compiled, ends as one process on the whole batch")


@pytest.fixture(scope="module")
def reference():
    return parallel_training.reference()


@pytest.fixture(scope="module")
def job():
    """One job of four processes (starting a rank costs more than its steps): all four train FSDP2 x TP on a 2x2
    mesh, eager then with compiled blocks, then ranks 0 and 1 the data and tensor parallel configurations in a group of two, while ranks 2 and 3
    train the pipelines in another (each rank compiles its device programs once)."""
    return run_ranks(["-m", "tests.parallel_training", "fsdp2_tp,fsdp2_tp_compiled", "0,1:" + ",".join(DATA_AND_TENSOR_PARALLEL),
                      "2,3:" + ",".join(PIPELINES)], ranks=4, timeout=1800)


@pytest.fixture(scope="module")
def two_ranks(job):
    """Per two-rank configuration, the results of the two ranks that ran it."""
    return {name: [rank[name] for rank in job if name in rank] for name in DATA_AND_TENSOR_PARALLEL + PIPELINES}


def _assert_trains_as_one_process(results: list, reference: dict, tolerance: dict) -> None:
    for result in results:
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), **tolerance)
    seen = {}
    for result in results:  # every rank holds every parameter (a pipeline stage: its own)
        for name, value in result["params"].items():
            torch.testing.assert_close(torch.tensor(value), reference["params"][name], **tolerance, msg=name)
            seen[name] = True
    assert set(seen) == set(reference["params"])  # together the ranks hold the whole model


@pytest.mark.parametrize("name", ["ddp", "fsdp2", "tp", "pp_1f1b", "pp_gpipe", "pp_traced", "ddp_compiled",
                                  "tp_compiled", "fsdp2_compiled", "pp_1f1b_compiled"])
def test_gpt2_trains_on_two_ranks_as_one_process_on_the_whole_batch(two_ranks, reference, name):
    assert len(two_ranks[name]) == 2
    _assert_trains_as_one_process(two_ranks[name], reference, TOLERANCES[torch.float32])


def test_fsdp2_with_bf16_mixed_precision_trains_as_accurately_as_bf16_on_the_cpu(two_ranks, reference):
    """Every parameter within bf16's tolerance of the fp32 reference, and none further from it than the same mixed
    precision computed by eager PyTorch on the CPU (parallel_training.reference_mixed_precision) allows: RMSE at most
    3x its (torch._dynamo.utils.same's multiplier for bf16), with no absolute slack."""
    cpu_bf16 = parallel_training.reference_mixed_precision(ranks=2)
    tolerance = TOLERANCES[torch.bfloat16]
    for result in two_ranks["fsdp2_bf16"]:
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), **tolerance)
        assert result["params"].keys() == reference["params"].keys()
        for name, value in result["params"].items():
            got, ref = torch.tensor(value), reference["params"][name]
            torch.testing.assert_close(got, ref, **tolerance, msg=name)
            ours, eagers = _rmse(got, ref), _rmse(cpu_bf16["params"][name], ref)
            assert ours <= EAGER_ERROR_MULTIPLIER * eagers, \
                f"{name}: RMSE against the fp32 reference {ours:.3g} > {EAGER_ERROR_MULTIPLIER} x the CPU's {eagers:.3g}"
    losses = torch.tensor(two_ranks["fsdp2_bf16"][0]["losses"])
    assert not torch.equal(losses, torch.tensor(two_ranks["fsdp2"][0]["losses"]))  # it did compute in bf16


def test_fsdp2_times_tensor_parallelism_on_a_2x2_mesh_trains_as_one_process(job, reference):
    _assert_trains_as_one_process([rank["fsdp2_tp"] for rank in job], reference, TOLERANCES[torch.float32])


def test_fsdp2_times_compiled_tensor_parallel_blocks_trains_as_one_process_its_sequence_collectives_in_the_neffs(
        job, reference):
    """Each tensor-parallel block compiled, then fully_shard over the mesh's dp dimension (torchtitan's 2-D order):
    trains as one process; sequence parallelism's all-gathers and reduce-scatters are collective instructions of
    the blocks' NEFFs, which run whole on the device (FSDP2's own collectives stay in its eager hooks)."""
    results = [rank["fsdp2_tp_compiled"] for rank in job]
    _assert_trains_as_one_process(results, reference, TOLERANCES[torch.float32])
    for result in results:
        assert result["partitioned"] == 0
        assert {"ALL_GATHER", "REDUCE_SCATTER"} <= set(result["collectives"])
        assert result["launches"] == 2 * parallel_training.CONFIG["layers"] * parallel_training.STEPS



def test_compiled_ddp_of_gpt2_holds_the_gradients_all_reduce_in_its_neff(two_ranks):
    """DDP under torch.compile with its backward under compiled autograd (the Python reducer): one forward and one
    backward graph, the gradients' all-reduces collective instructions of the backward NEFF."""
    for result in two_ranks["ddp_compiled"]:
        assert result["partitioned"] == 0  # every graph whole on the device
        assert result["graphs"] == 2
        assert result["collectives"] == ["ALL_REDUCE"]


def test_compiled_tensor_parallel_gpt2_runs_whole_on_the_device_its_collectives_in_the_neff(two_ranks):
    """Sequence parallelism's all-gathers and reduce-scatters and loss_parallel's all-reduces are collective
    instructions; no part of a graph falls back to the CPU."""
    for result in two_ranks["tp_compiled"]:
        assert result["partitioned"] == 0
        assert {"ALL_GATHER", "REDUCE_SCATTER", "ALL_REDUCE"} <= set(result["collectives"])


def test_fsdp2_with_compiled_blocks_runs_every_blocks_forward_and_backward_as_neffs(two_ranks):
    """torchtitan's way (each block compiled, then sharded with fully_shard): every block's forward and backward of
    every step is a launch of a compiled graph, whole on the device; FSDP2's all-gathers and reduce-scatters stay in
    its hooks, which torch 2.13 keeps out of Dynamo, so the NEFFs hold no collective."""
    steps, blocks = parallel_training.STEPS, parallel_training.CONFIG["layers"]
    for result in two_ranks["fsdp2_compiled"]:
        assert result["partitioned"] == 0
        assert result["graphs"] >= 2  # a forward and a backward graph at least
        assert result["launches"] == 2 * blocks * steps
        assert result["collectives"] == []


def test_a_1f1b_pipeline_of_compiled_stages_runs_every_micro_batch_as_neffs(two_ranks):
    """Each stage's module under torch.compile: every micro-batch's forward and backward on each stage is a launch
    of the stage's compiled graphs (PipelineStage may run one more forward to learn its output's shape), whole on
    the device; the activations and gradients between stages go through the process group (P2P)."""
    micro_batches, steps = 2, parallel_training.STEPS
    for result in two_ranks["pp_1f1b_compiled"]:
        assert result["partitioned"] == 0
        assert result["graphs"] >= 2  # a forward and a backward graph at least
        assert result["launches"] >= 2 * micro_batches * steps
