"""torch.cond under torch.compile and in exported programs: both branches computed, the result selected by the
predicate at run time (JAX's cond, scan and fori_loop are in test_jax.py). Goldens from PyTorch eager on CPU."""
from __future__ import annotations

import copy

import torch

from neuronc.check import check_program
from neuronc.compiler import CompileOptions, compile_exported
from runtime import run_neff
from tests.conftest import OnDevice, assert_matches_eager


class Branching(torch.nn.Module):
    """A cond on the input's sign, then a cond whose true branch holds another cond."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(5, 5)

    def forward(self, x):
        y = torch.cond(x.sum() > 0, lambda v: self.linear(v).sin() * 2, lambda v: v.cos() - 1, (x,))
        return torch.cond(y.mean() > 0.1,
                          lambda v: torch.cond(v.max() > 1, lambda u: u * 3, lambda u: u / 3, (v,)),
                          lambda v: v + 10, (y,))


def _inputs() -> list:
    """Inputs taking each branch of Branching's outer conds."""
    torch.manual_seed(0)
    return [torch.rand(4, 5) + 0.5, -torch.rand(4, 5) - 0.5, torch.full((4, 5), -0.01)]


def test_a_cond_is_compiled_once_and_takes_the_branch_its_predicate_names_at_run_time():
    model = Branching()
    compiled = OnDevice(model)
    for x in _inputs():
        assert_matches_eager(compiled(x), model(x))
    assert len(compiled.graphs) == 1  # the predicate is a run-time value: no recompile, no graph break


def test_gradients_flow_through_the_branch_taken():
    model = Branching()
    twin = copy.deepcopy(model)
    compiled = OnDevice(twin)
    for x in _inputs()[:2]:
        model.zero_grad()
        twin.zero_grad()
        model(x).pow(2).sum().backward()
        compiled(x).pow(2).sum().backward()
        assert_matches_eager([twin.linear.weight.grad, twin.linear.bias.grad],
                             [model.linear.weight.grad, model.linear.bias.grad])


def test_an_exported_program_with_cond_compiles_to_a_neff_and_checks_clean():
    model = Branching().eval()
    positive, negative, _ = _inputs()
    assert check_program(torch.export.export(model, (positive,))).ok
    compiled = compile_exported(torch.export.export(model, (positive,)), CompileOptions())
    for x in (positive, negative):
        assert_matches_eager(torch.from_numpy(run_neff(compiled.neff, [x.numpy()]).outputs[0]), model(x))
