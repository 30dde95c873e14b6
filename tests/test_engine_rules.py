"""The documented rules of the NeuronCore's engines (TRAINIUM.md, "Corrections and additions"): GpSimd never
reaches PSUM (refused at load, and never chosen by codegen)."""
from __future__ import annotations

import dataclasses

import pytest

from neuronc.errors import NeuronRuntimeError
from neuronc.isa import Engine, Opcode, Space
from neuronc.neff.program import DebugLoc
from neuronc.targets import get_target
from runtime import NeuronCore
from tests.test_runtime import Program, chip

TRN2 = get_target("trn2")


def _load(p: Program, target: str):
    return NeuronCore(target, check_uninitialised=False).load(dataclasses.replace(p.neff(), target=target))


@pytest.mark.parametrize("opcode, operands", [
    (Opcode.MEMSET, (chip((128, 64), space=Space.PSUM),)),
    (Opcode.TENSOR_COPY, (chip((128, 64)), chip((128, 64), space=Space.PSUM))),
], ids=["writes-psum", "reads-psum"])
def test_a_gpsimd_instruction_with_a_psum_operand_is_refused_at_load(opcode, operands):
    p = Program()
    p.emit(opcode, Engine.GPSIMD, *operands)
    with pytest.raises(NeuronRuntimeError, match="in PSUM, which the GPSIMD engine cannot reach") as err:
        _load(p, "trn2")
    assert "VECTOR" in err.value.hint  # the way out: an engine that reaches PSUM


def test_the_same_instruction_on_the_vector_engine_loads():
    p = Program()
    p.emit(Opcode.MEMSET, Engine.VECTOR, chip((128, 64), space=Space.PSUM))
    _load(p, "trn2")


def test_codegen_never_places_a_psum_operand_on_gpsimd():
    from neuronc.codegen.elementwise import Balancer
    from neuronc.codegen.emitter import Emitter
    from neuronc.isa import AluOp

    em = Emitter(TRN2)
    em.begin_kernel("k", (), DebugLoc())
    balancer = Balancer(em)
    balancer.busy[Engine.VECTOR] = 1e9  # GpSimd is far less busy: it would be chosen if it could reach PSUM
    psum, sbuf = chip((128, 64), space=Space.PSUM), chip((128, 64))
    balancer.emit(Opcode.TENSOR_SCALAR, sbuf, psum, alu=AluOp.MULTIPLY, imm0=2.0)
    balancer.emit(Opcode.TENSOR_SCALAR, sbuf, sbuf, alu=AluOp.MULTIPLY, imm0=2.0)
    assert [i.engine for i in em.instructions] == [Engine.VECTOR, Engine.GPSIMD]


def test_compiled_attention_puts_no_psum_operand_on_gpsimd():
    import math

    import torch

    from neuronc.compiler import CompileOptions, compile_exported

    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
            mask = torch.ones(q.shape[-2], q.shape[-2], dtype=torch.bool).tril()
            return torch.softmax(scores.masked_fill(~mask, float("-inf")), -1) @ v

    inputs = tuple(torch.randn(1, 2, 256, 64, dtype=torch.bfloat16) for _ in range(3))
    neff = compile_exported(torch.export.export(Attention(), inputs), CompileOptions(opt_level=2, name="attn")).neff
    gpsimd = neff.streams[(Engine.GPSIMD, 0)]
    assert gpsimd  # the kernel still uses GpSimd, on SBUF
    assert not [i for i in gpsimd if any(ap.space == Space.PSUM for ap in i.operands)]
    assert any(n.name.startswith("attention") for n in neff.kernels)
