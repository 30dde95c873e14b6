"""The collective engine: its instructions compute what the ISA says on every rank, through the NEFF codec; they
last the interconnect model's time on their own stream, beside the other engines; the runtime refuses
malformed ones and programs that have no way to the other ranks; the cores of one process run a collective
program together (runtime.collectives.run_on_cores) and `torch.neuron.comm` joins their tensors; `neuronc
profile` draws the collective track. The model itself: its steps, stages and what it reads of the target."""
from __future__ import annotations

import dataclasses
import json

import ml_dtypes
import numpy as np
import pytest
import torch
from click.testing import CliRunner

from neuronc.cli import main
from neuronc.collective_cost import collective_ns, steps
from neuronc.errors import CollectiveError, NeuronRuntimeError
from neuronc.isa import AccessPattern, AluOp, CollectiveOp, DType, Engine, Instruction, Opcode, Space, Wait
from neuronc.neff import decode, encode, save
from neuronc.neff.program import Neff, TensorEntry, TensorKind
from neuronc.targets import get_target
from runtime import NeuronCore
from runtime.collectives import LocalGroup, run_on_cores

TRN2 = get_target("trn2")


def _flat(t: TensorEntry) -> AccessPattern:
    return AccessPattern(Space.HBM, t.dtype, t.offset, ((1, int(np.prod(t.shape))),))


def collective_neff(opcode: Opcode, n_in: int, n_out: int, ranks: int, alu=AluOp.NONE, dtype=DType.F32,
                    group: int = 0) -> Neff:
    """x (n_in) -> y (n_out) by one collective instruction, through the NEFF codec."""
    x = TensorEntry("x", TensorKind.INPUT, dtype, (n_in,), 0, 0)
    y = TensorEntry("y", TensorKind.OUTPUT, dtype, (n_out,), 64 * ((n_in * dtype.itemsize + 63) // 64), 0)
    instr = Instruction(opcode, Engine.COLLECTIVE, (_flat(y), _flat(x)), alu=alu, imm0=ranks, imm1=group)
    neff = Neff("collective", "trn2", [x, y], {(Engine.COLLECTIVE, 0): [instr]}, y.offset + y.nbytes)
    return decode(encode(neff))


def _run(neff: Neff, inputs: list) -> list:
    programs = [NeuronCore("trn2").load(neff) for _ in inputs]
    return run_on_cores(programs, [[x] for x in inputs])


CASES = [  # opcode, input and output elements, reduction, what rank r gets from the inputs xs
    (Opcode.ALL_REDUCE, 6, 6, AluOp.ADD, lambda xs, r: sum(xs)),
    (Opcode.ALL_REDUCE, 6, 6, AluOp.MAX, lambda xs, r: np.maximum.reduce(xs)),
    (Opcode.ALL_GATHER, 2, 6, AluOp.NONE, lambda xs, r: np.concatenate(xs)),
    (Opcode.REDUCE_SCATTER, 6, 2, AluOp.ADD, lambda xs, r: sum(xs)[2 * r:2 * r + 2]),
    (Opcode.ALL_TO_ALL, 6, 6, AluOp.NONE, lambda xs, r: np.concatenate([x[2 * r:2 * r + 2] for x in xs])),
]


@pytest.mark.parametrize("opcode, n_in, n_out, alu, expected", CASES, ids=lambda c: getattr(c, "name", ""))
def test_each_collective_gives_every_rank_what_the_isa_says(opcode, n_in, n_out, alu, expected):
    xs = [np.random.default_rng(r).standard_normal(n_in).astype(np.float32) for r in range(3)]
    results = _run(collective_neff(opcode, n_in, n_out, 3, alu), xs)
    for rank, result in enumerate(results):
        np.testing.assert_allclose(result.outputs[0], expected(xs, rank), rtol=1e-6)


def test_a_bf16_reduction_is_done_in_fp32_and_rounded_once():
    bf16 = ml_dtypes.bfloat16
    xs = [np.full(4, v, bf16) for v in (256.0, 1.0, 1.0)]  # bf16 sums pairwise would lose the ones: 256 + 1 = 256
    results = _run(collective_neff(Opcode.ALL_REDUCE, 4, 4, 3, AluOp.ADD, DType.BF16), xs)
    assert results[0].outputs[0].tolist() == [258.0] * 4


def test_a_collective_lasts_the_interconnect_models_time_on_the_collective_stream():
    neff = collective_neff(Opcode.ALL_GATHER, 4096, 8192, 2)
    timeline = NeuronCore("trn2").load(neff).time()
    (event,) = timeline.events
    assert event.stream == (Engine.COLLECTIVE, 0)
    assert event.end_ns - event.start_ns == pytest.approx(collective_ns(CollectiveOp.ALL_GATHER, 8192 * 4, 2, TRN2))


def test_compute_that_does_not_wait_for_a_collective_runs_beside_it():
    x = TensorEntry("x", TensorKind.INPUT, DType.F32, (1 << 20,), 0, 0)
    y = TensorEntry("y", TensorKind.OUTPUT, DType.F32, (1 << 20,), x.nbytes, 0)
    z = TensorEntry("z", TensorKind.OUTPUT, DType.F32, (128, 512), 2 * x.nbytes, 1)
    tile = AccessPattern(Space.SBUF, DType.F32, 0, ((1, 128), (1, 512)))
    streams = {
        (Engine.COLLECTIVE, 0): [Instruction(Opcode.ALL_REDUCE, Engine.COLLECTIVE, (_flat(y), _flat(x)), alu=AluOp.ADD,
                                             imm0=2)],
        (Engine.GPSIMD, 0): [Instruction(Opcode.MEMSET, Engine.GPSIMD, (tile,), imm0=1.0)],
        (Engine.DMA, 0): [Instruction(Opcode.DMA_COPY, Engine.DMA, (AccessPattern(Space.HBM, DType.F32, z.offset, (
            (512, 128), (1, 512))), tile), waits=(Wait(Engine.GPSIMD, 0, 1),))],
    }
    timeline = NeuronCore("trn2").load(Neff("overlap", "trn2", [x, y, z], streams, 3 * x.nbytes)).time()
    busy = timeline.busy_ns()
    assert timeline.estimated_ns < busy[(Engine.COLLECTIVE, 0)] + busy[(Engine.GPSIMD, 0)] + busy[(Engine.DMA, 0)]
    assert timeline.estimated_ns == pytest.approx(max(busy[(Engine.COLLECTIVE, 0)],
                                                      busy[(Engine.GPSIMD, 0)] + busy[(Engine.DMA, 0)]), rel=0.05)


@pytest.mark.parametrize("change, problem", [
    (dict(imm0=0), "whole number of ranks"),
    (dict(alu=AluOp.SUBTRACT), "does not reduce by SUBTRACT"),
    (dict(operands=lambda i: (i.operands[0], dataclasses.replace(i.operands[1], dims=((1, 5),)))), "gives 5"),
    (dict(operands=lambda i: (i.operands[0], dataclasses.replace(i.operands[1], dims=((2, 3),)))), "dense"),
    (dict(operands=lambda i: (i.operands[0], dataclasses.replace(i.operands[1], dtype=DType.BF16))), "one dtype"),
    (dict(engine=Engine.DMA), "cannot run on the DMA engine"),
    (dict(queue=1), "one instruction queue"),
    # the NEFF rules of every instruction (neuronc/neff/rules.py): inputs are read-only, HBM is the table's
    (dict(operands=lambda i: (i.operands[1], i.operands[1])), "read-only"),
    (dict(operands=lambda i: (dataclasses.replace(i.operands[0], offset=24), i.operands[1])), "no tensor"),  # x ends at 24
])
def test_the_runtime_refuses_a_malformed_collective(change, problem):
    neff = collective_neff(Opcode.ALL_REDUCE, 6, 6, 2, AluOp.ADD)
    (instr,) = neff.streams[(Engine.COLLECTIVE, 0)]
    fields = {k: (v(instr) if callable(v) else v) for k, v in change.items()}
    bad = dataclasses.replace(instr, **fields)
    neff.streams = {bad.stream: [bad]}
    with pytest.raises(NeuronRuntimeError, match=problem):
        NeuronCore("trn2").load(neff)


def test_a_program_with_collectives_and_no_transport_says_how_to_run_it():
    program = NeuronCore("trn2").load(collective_neff(Opcode.ALL_REDUCE, 4, 4, 2, AluOp.ADD))
    with pytest.raises(CollectiveError, match="no transport") as raised:
        program.run([np.ones(4, np.float32)])
    assert "torch.distributed" in raised.value.hint and "run_on_cores" in raised.value.hint


def test_a_core_that_never_reaches_the_collective_fails_the_others_at_the_groups_timeout():
    program = NeuronCore("trn2").load(collective_neff(Opcode.ALL_REDUCE, 4, 4, 2, AluOp.ADD))
    program.transport = LocalGroup(2, timeout_s=0.2).transport(0)
    with pytest.raises(CollectiveError, match="did not reach it within 0.2 s"):
        program.run([np.ones(4, np.float32)])


def test_neuronc_profile_draws_the_collective_track(tmp_path):
    path = tmp_path / "collective.neff"
    save(collective_neff(Opcode.ALL_GATHER, 1024, 2048, 2), str(path))
    trace, html = tmp_path / "trace.json", tmp_path / "report.html"
    result = CliRunner().invoke(main, ["profile", str(path), "-o", str(trace), "--html", str(html)])
    assert result.exit_code == 0, result.output
    names = {e["args"]["name"] for e in json.loads(trace.read_text())["traceEvents"] if e.get("name") == "thread_name"}
    assert "Collective" in names
    assert ">Collective<" in html.read_text()


# ---- the interconnect model ------------------------------------------------------------------------

def test_steps_are_recursive_halving_for_powers_of_two_and_a_ring_otherwise():
    assert [steps(n) for n in (1, 2, 4, 8, 3, 6)] == [0, 1, 2, 3, 2, 5]


def test_an_all_reduce_is_a_reduce_scatter_then_an_all_gather():
    for ranks in (2, 8, 32):
        assert collective_ns(CollectiveOp.ALL_REDUCE, 1 << 24, ranks, TRN2) == pytest.approx(
            collective_ns(CollectiveOp.REDUCE_SCATTER, 1 << 24, ranks, TRN2)
            + collective_ns(CollectiveOp.ALL_GATHER, 1 << 24, ranks, TRN2))


def test_a_group_within_one_chip_never_crosses_neuronlink_and_one_across_chips_does():
    slower_link = dataclasses.replace(TRN2, neuronlink_gbps=TRN2.neuronlink_gbps / 4)
    within, across = TRN2.cores_per_chip, 2 * TRN2.cores_per_chip
    assert collective_ns(CollectiveOp.ALL_GATHER, 1 << 24, within, slower_link) == \
        collective_ns(CollectiveOp.ALL_GATHER, 1 << 24, within, TRN2)
    assert collective_ns(CollectiveOp.ALL_GATHER, 1 << 24, across, slower_link) > \
        collective_ns(CollectiveOp.ALL_GATHER, 1 << 24, across, TRN2)


def test_a_small_collective_costs_its_hops_and_a_large_one_its_bytes():
    small, large = (collective_ns(CollectiveOp.ALL_REDUCE, n, 8, TRN2) for n in (64, 1 << 28))
    assert small == pytest.approx(2 * steps(8) * TRN2.collective_hop_ns, rel=1e-3)
    assert large > 100 * small


# ---- the cores of one process ----------------------------------------------------------------------

@pytest.fixture
def two_cores():
    torch.neuron._lazy_init()
    return [torch.device("neuron", 0), torch.device("neuron", 1)]


def test_torch_neuron_comm_joins_tensors_of_the_cores_of_one_process(two_cores):
    xs = [torch.randn(4, 3, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    on = [x.to(d) for x, d in zip(xs, two_cores)]
    gathered = torch.neuron.comm.all_gather(on)
    assert [g.device for g in gathered] == two_cores
    for g in gathered:
        torch.testing.assert_close(g.cpu(), torch.cat(xs))
    scattered = torch.neuron.comm.reduce_scatter(on)
    for r, part in enumerate(scattered):
        torch.testing.assert_close(part.cpu(), (xs[0] + xs[1])[2 * r:2 * r + 2])
    swapped = torch.neuron.comm.all_to_all(on)
    for r, part in enumerate(swapped):
        torch.testing.assert_close(part.cpu(), torch.cat([x[2 * r:2 * r + 2] for x in xs]))
    torch.neuron.comm.all_reduce(on, op="max")
    for t in on:
        torch.testing.assert_close(t.cpu(), torch.maximum(*xs))


def test_torch_neuron_comm_lasts_the_models_time_for_that_many_cores(two_cores):
    on = [torch.ones(1024).to(d) for d in two_cores]
    torch.neuron.comm.all_reduce(on)  # (nothing compiles; the first call is like the second)
    start, end = torch.Event(enable_timing=True), torch.Event(enable_timing=True)
    start.record()
    torch.neuron.comm.all_reduce(on)
    end.record()
    end.synchronize()
    assert start.elapsed_time(end) * 1e6 == pytest.approx(collective_ns(CollectiveOp.ALL_REDUCE, 4096, 2, TRN2))


def test_torch_neuron_comm_refuses_two_tensors_on_one_core(two_cores):
    with pytest.raises(RuntimeError, match="one neuron tensor per core"):
        torch.neuron.comm.all_reduce([torch.ones(2).to(two_cores[0]), torch.ones(2).to(two_cores[0])])
