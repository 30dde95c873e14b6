"""The prefetch step (codegen.schedule) judges whether a load writes what its kernel's first steps read once per
(those reads, the spans of the load's destination): a repeated layer's copies of a kernel are judged once, as are
the loads of one kernel into one box of cells through different patterns, with the answer a judgement per load
gives."""
from __future__ import annotations

import torch

from neuronc import codegen
from neuronc.codegen import schedule
from neuronc.compiler import CompileOptions, compile_exported
from tests import zoo


def test_a_repeated_layers_loads_are_judged_once_per_kernel_reads_and_destination(monkeypatch):
    programs = []

    def capturing(instructions, grid):
        programs.append((list(instructions), grid))
        return schedule.prefetch_loads(instructions, grid)

    monkeypatch.setattr(codegen, "prefetch_loads", capturing)
    torch.manual_seed(0)
    model = zoo.GPT2(vocab=64, width=64, layers=3, heads=2, context=32).eval()
    compile_exported(torch.export.export(model, (torch.randint(0, 64, (1, 32)),)), CompileOptions(opt_level=2))
    instructions, grid = programs[-1]  # the whole program: kernels timed by the passes (choice_time) come first

    judged = []
    touches = schedule._touches
    monkeypatch.setattr(schedule, "_touches", lambda merged, spans: judged.append(1) or touches(merged, spans))
    placements = schedule._placements(instructions, grid, every_load=True)

    needs = schedule._first_reads(instructions, grid)
    loads = [(p, inst) for p, inst in enumerate(instructions) if schedule._is_load(inst) and inst.kernel in needs]
    pairs = {(tuple(map(tuple, needs[inst.kernel])), id(grid.access(inst)[1])) for _, inst in loads}
    assert len(judged) == len(pairs) < len(loads)  # once per distinct pair: the layers' copies share them
    by_pattern = {(tuple(map(tuple, needs[inst.kernel])), id(inst.operands[0])) for _, inst in loads}
    assert len(pairs) < len(by_pattern)  # patterns of one box (the other parity's, say) share their spans
    # each placed load's flag is what judging that load alone says
    placed = [(p, inst) for p, inst in loads if p in placements]
    assert len(placed) > 10
    for position, inst in placed:
        assert placements[position].first_step == touches(needs[inst.kernel], grid.access(inst)[1])
    assert {touches(needs[inst.kernel], grid.access(inst)[1]) for _, inst in loads} == {True, False}  # not all alike
