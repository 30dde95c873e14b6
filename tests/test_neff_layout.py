"""The NEFF writer's fast path (neuronc/neff/layout.py) writes, byte for byte, what flatbuffers' Builder writes
(writer._encode_program_with_builder), on compiled programs and on programs made to reach every field, value
and alignment; values it does not take as the Builder does go to the Builder."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from neuronc.compiler import CompileOptions, compile_graph
from neuronc.errors import NeffFormatError
from neuronc.isa import AccessPattern, ActFunc, AluOp, DType, Engine, Instruction, Opcode, Space, Wait
from neuronc.neff import decode, encode, writer
from neuronc.neff.program import DebugLoc, KernelInfo, Neff, TensorEntry, TensorKind
from neuronc.pytorch import backend
from tests import zoo
from tests.conftest import zoo_graph
from tests.test_neff import full_neff


def assert_builder_bytes(neff: Neff) -> bytes:
    """The fast path's program bytes (it must not fall back) equal the Builder's; returns them."""
    fast = writer._encode_program_fast(neff)
    assert fast == writer._encode_program_with_builder(neff)
    return fast


def _operand(i: int, dims=((1, 128), (1, 64))) -> AccessPattern:
    return AccessPattern(Space.SBUF, DType.F32, offset=4 * i, dims=dims)


def _program(*instructions, debug_locs=(), kernels=(), tensors=()) -> Neff:
    streams = {}
    for inst in instructions:
        streams.setdefault(inst.stream, []).append(inst)
    return Neff("p", "trn1", list(tensors), streams, 1 << 20, list(debug_locs), list(kernels), estimated_ns=1.0)


@pytest.mark.parametrize("name", sorted(zoo.ZOO))
def test_every_zoo_model_compiles_to_the_builders_bytes(name):
    neff = compile_graph(zoo_graph(name), CompileOptions()).neff
    assert sum(map(len, neff.streams.values())) > 0
    assert_builder_bytes(neff)


def test_the_forward_and_backward_programs_of_a_training_step_encode_to_the_builders_bytes():
    model, inputs = zoo.build("transformer_block")
    model.train()
    before = len(backend.compiled_graphs)
    torch.compile(model, backend="neuron")(*inputs).pow(2).mean().backward()
    forward, backward = backend.compiled_graphs[before:]
    for function in (forward, backward):
        assert_builder_bytes(function.compiled.neff)


def test_a_program_using_every_opcode_enum_field_dtype_and_tensor_kind_encodes_to_the_builders_bytes():
    neff = full_neff()
    assert neff.debug_locs and any(inst.debug >= 0 for stream in neff.streams.values() for inst in stream)
    assert_builder_bytes(neff)
    assert decode(encode(neff)).streams == neff.streams


def test_an_empty_program_and_one_instruction_programs_encode_to_the_builders_bytes():
    assert_builder_bytes(Neff("empty", "trn1", [], {}, 0))
    assert_builder_bytes(_program(Instruction(Opcode.MEMSET, Engine.GPSIMD, (_operand(0),))))
    assert_builder_bytes(_program(Instruction(Opcode.MEMSET, Engine.GPSIMD, ())))  # no operand, all defaults
    assert_builder_bytes(Neff("no instructions", "trn1", [], {(Engine.DMA, 3): []}, 0))


@pytest.mark.parametrize("value", [0.0, -0.0, math.nan, -math.nan, math.inf, -math.inf, 5e-324, -1e308, 1, 0])
def test_float_fields_encode_to_the_builders_bytes(value):
    inst = Instruction(Opcode.TENSOR_SCALAR, Engine.VECTOR, (_operand(0), _operand(1)), imm0=value, imm1=-value)
    neff = _program(inst, kernels=[KernelInfo("k", ("aten.add",), -1, value)])
    neff.estimated_ns = value
    assert_builder_bytes(neff)


@pytest.mark.parametrize("dims", [(), ((1, 1),), ((1, 128), (-5, 3), (0, 7), (1 << 40, 2), (-(1 << 62), 1))])
@pytest.mark.parametrize("space", list(Space))
def test_operands_of_every_space_and_shape_encode_to_the_builders_bytes(space, dims):
    operands = [AccessPattern(space, dtype, offset=offset, dims=dims, partition=partition)
                for dtype in DType for offset, partition in ((0, 0), (1, 127), ((1 << 40) + 3, 64))]
    instructions = [
        Instruction(Opcode.TENSOR_TENSOR, Engine.VECTOR, tuple(operands[i:i + count]), alu=AluOp.ADD)
        for count in range(6) for i in range(0, len(operands), 7)
    ]
    assert_builder_bytes(_program(*instructions))


def test_shared_operands_and_repeated_instructions_encode_to_the_builders_bytes():
    shared = _operand(3)
    equal_but_another_object = _operand(3)
    instructions = [Instruction(Opcode.TENSOR_COPY, Engine.SCALAR, (shared, equal_but_another_object, _operand(i % 4)))
                    for i in range(50)]
    assert_builder_bytes(_program(*instructions))


@pytest.mark.parametrize("count", [0, 1, 2, 3, 5])
def test_instructions_with_any_number_of_waits_encode_to_the_builders_bytes(count):
    waits = tuple(Wait(engine, queue, 7 * queue - (1 << 40)) for engine in Engine for queue in (0, 1, 15))[:count]
    instructions = [Instruction(Opcode.DMA_COPY, Engine.DMA, (_operand(i), _operand(i + 1)), queue=i % 3, waits=waits)
                    for i in range(9)]
    assert_builder_bytes(_program(*instructions))


def test_a_program_aligned_to_8_bytes_only_by_a_wait_encodes_to_the_builders_bytes():
    # The Builder pads the finished buffer to its widest alignment: here the wait's 8 (found by hypothesis)
    inst = Instruction(Opcode.DMA_COPY, Engine.TENSOR, (), waits=(Wait(Engine.TENSOR, 0, 0),))
    assert_builder_bytes(_program(inst, debug_locs=[DebugLoc("f.py", 1, "m", "op")], kernels=[KernelInfo("k")]))


def test_tensors_of_every_kind_dtype_and_rank_encode_to_the_builders_bytes():
    tensors = []
    for i, dtype in enumerate(DType):
        for kind in TensorKind:
            shape = ((), (3,), (2, 0, 5), (1,) * 9)[i % 4]
            data = np.zeros(shape, dtype=dtype.numpy) if kind in (TensorKind.WEIGHT, TensorKind.CONSTANT) else None
            tensors.append(TensorEntry(f"t{i}_{kind.name}", kind, dtype, shape, 8 * i, i - 1, data))
    assert_builder_bytes(_program(tensors=tensors))


def test_debug_locations_and_kernels_of_any_text_encode_to_the_builders_bytes():
    locs = [DebugLoc(), DebugLoc("ünï.py", 2**31 - 1, "a" * 1001, "aten.mm"), DebugLoc("x", -7, "b", "")]
    kernels = [KernelInfo("", (), 2, 0.0), KernelInfo("k" * 3, ("a", "ünï", "", "x" * 13), 0, 1.5)]
    insts = [Instruction(Opcode.MATMUL, Engine.TENSOR, (_operand(0), _operand(1), _operand(2)), kernel=k, debug=d)
             for k in (-1, 0, 1) for d in (-1, 0, 2)]
    assert_builder_bytes(_program(*insts, debug_locs=locs, kernels=kernels))


_instructions = st.builds(
    Instruction,
    opcode=st.sampled_from(Opcode),
    engine=st.sampled_from(Engine),
    operands=st.lists(st.builds(_operand, st.integers(0, 5), st.sampled_from([(), ((1, 2),), ((1, 2), (3, 4))])),
                      max_size=4).map(tuple),
    queue=st.sampled_from([0, 1, -1, 2**31 - 1]),
    alu=st.sampled_from(AluOp),
    alu1=st.sampled_from(AluOp),
    func=st.sampled_from(ActFunc),
    imm0=st.floats(allow_nan=True) | st.just(-0.0),
    imm1=st.floats(allow_nan=True) | st.just(-0.0),
    accumulate=st.booleans(),
    reverse=st.booleans(),
    waits=st.lists(st.builds(Wait, st.sampled_from(Engine), st.integers(0, 3), st.integers(0, 2**40)),
                   max_size=3).map(tuple),
    kernel=st.sampled_from([-1, 0]),
    debug=st.sampled_from([-1, 0]),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(_instructions, max_size=12))
def test_any_sequence_of_instructions_encodes_to_the_builders_bytes(instructions):
    neff = _program(*instructions, debug_locs=[DebugLoc("f.py", 1, "m", "op")], kernels=[KernelInfo("k")])
    assert_builder_bytes(neff)


def test_a_value_the_fast_path_does_not_take_is_encoded_by_the_builder():
    # The Builder takes 0 and 1 for a bool field (and writes them as bools); the fast path only bools.
    inst = Instruction(Opcode.MATMUL, Engine.TENSOR, (_operand(0), _operand(1), _operand(2)), accumulate=1)
    neff = _program(inst)
    with pytest.raises(TypeError):
        writer._encode_program_fast(neff)
    as_bool = _program(dataclasses.replace(inst, accumulate=True))
    assert writer._encode_program(neff) == writer._encode_program_with_builder(as_bool)


@pytest.mark.parametrize("field, value", [("queue", 2**31), ("alu", 256), ("accumulate", 2), ("imm0", "1.0")])
def test_a_value_neither_path_takes_is_a_format_error(field, value):
    inst = dataclasses.replace(Instruction(Opcode.MATMUL, Engine.TENSOR, (_operand(0),)), **{field: value})
    with pytest.raises(NeffFormatError, match="wrong type or out of range"):
        encode(_program(inst))
