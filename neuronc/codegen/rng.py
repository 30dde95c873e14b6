"""Programs for random ops: the GpSimd engine's RNG instruction, and the few steps that turn its uniform draws
into the op's distribution, tile by tile.

A random op has no graph to optimise (one draw, a handful of elementwise steps), so its program is built
here directly rather than through the importer and the passes: a `neuron` tensor's ``normal_`` compiles in
milliseconds. Every program takes the generator's state as its first input, an int64 ``(seed, offset)``
pair, so one program per (recipe, parameters, shape, dtypes) serves every draw: element ``e`` of the
output (row-major) is number ``offset + e`` of the seed's stream (``offset + n + e`` for a second draw,
as Box-Muller's), which makes the values independent of how the output is tiled.

Each recipe is a function ``(emit, draw, x, params) -> output tiles`` over one block of the flattened output;
:data:`RECIPES` lists them with the numbers they draw per element and the inputs and outputs they have.
"""
from __future__ import annotations

import dataclasses
import math

from neuronc import __version__
from neuronc.codegen.blocks import blocks
from neuronc.codegen.emitter import Emitter, hbm
from neuronc.codegen.sync import insert_waits
from neuronc.isa import ActFunc, AluOp, DType, Engine, Opcode
from neuronc.neff.program import DebugLoc, Neff, TensorEntry, TensorKind
from neuronc.stream_timing import estimate_streams
from neuronc.targets import Target

MAX_FREE = 1024  # elements per partition of a tile (eight tiles of each dtype fit in SBUF)
ALIGNMENT = 64  # bytes between the program's HBM tensors


@dataclasses.dataclass(frozen=True)
class Recipe:
    emit: object  # (Block, params) -> None, see the recipes below
    draws: int  # numbers drawn per output element
    takes_input: bool  # a tensor operand of the output's shape (probabilities, or the dropout input)
    mask: bool = False  # a second output: the bool mask (dropout)


class _Block:
    """One tile of every operand of a recipe: what a recipe emits its instructions on."""

    def __init__(self, em: Emitter, pools: dict, state, shape: tuple, first: int, stride: int, n: int):
        self.em, self.pools, self.state, self.shape = em, pools, state, shape
        self.first, self.stride, self.n = first, stride, n
        self.x = self.mask = None

    def tile(self, dtype: DType):
        return self.pools[dtype].next().ap(*self.shape, dtype=dtype)

    def draw(self, k: int, dtype: DType = DType.F32):
        """Uniform numbers in [0, 1) for this block's elements, from the k-th draw of n (a fresh tile)."""
        tile = self.tile(dtype)
        self.em.emit(Opcode.RNG, Engine.GPSIMD, tile, self.state, imm0=float(k * self.n + self.first),
                     imm1=float(self.stride))
        return tile

    def act(self, dst, src, func: ActFunc, scale: float = 1.0, bias: float = 0.0):
        self.em.emit(Opcode.ACTIVATE, Engine.SCALAR, dst, src, func=func, imm0=scale, imm1=bias)
        return dst

    def alu(self, dst, a, b, alu: AluOp):
        if isinstance(b, float):
            self.em.emit(Opcode.TENSOR_SCALAR, Engine.VECTOR, dst, a, alu=alu, imm0=b)
        else:
            self.em.emit(Opcode.TENSOR_TENSOR, Engine.VECTOR, dst, a, b, alu=alu)
        return dst


def _uniform(b: _Block, out, low: float, high: float):
    """u * (high - low) + low, u drawn with the output's precision (so that (0, 1) never gives 1)."""
    b.act(out, b.draw(0, out.dtype if out.dtype.is_float else DType.F32), ActFunc.IDENTITY, high - low, low)


def _normal(b: _Block, out, mean: float, std: float):
    """Box-Muller: sqrt(-2 log(1 - u1)) * cos(2 pi u2) * std + mean."""
    radius = b.act(b.tile(DType.F32), b.draw(0), ActFunc.LOG, -1.0, 1.0)
    radius = b.act(b.tile(DType.F32), radius, ActFunc.SQRT, -2.0)
    angle = b.act(b.tile(DType.F32), b.draw(1), ActFunc.COS, 2.0 * math.pi)
    b.act(out, b.alu(b.tile(DType.F32), radius, angle, AluOp.MULTIPLY), ActFunc.IDENTITY, std, mean)


def _bernoulli(b: _Block, out, p: float):
    b.alu(out, b.draw(0), p, AluOp.LT)


def _bernoulli_tensor(b: _Block, out):
    b.alu(out, b.draw(0), b.x, AluOp.LT)


def _dropout(b: _Block, out, p: float):
    """mask = u < 1 - p; out = x * mask * (1 / (1 - p)), as PyTorch's native_dropout."""
    b.alu(b.mask, b.draw(0), 1.0 - p, AluOp.LT)
    b.alu(out, b.alu(b.tile(DType.F32), b.x, b.mask, AluOp.MULTIPLY), 1.0 / (1.0 - p), AluOp.MULTIPLY)


def _integers(b: _Block, out, low: int, span: int):
    """low + floor(u * span), u in fp32 (so span <= 2**24), clamped below span against rounding up."""
    scaled = b.act(b.tile(DType.F32), b.draw(0), ActFunc.IDENTITY, float(span))
    b.alu(scaled, scaled, float(span - 1), AluOp.MIN)
    whole = b.tile(out.dtype)
    b.em.emit(Opcode.TENSOR_COPY, Engine.VECTOR, whole, scaled)  # float to integer truncates: the floor here
    b.alu(out, whole, float(low), AluOp.ADD)


MAX_INTEGER_SPAN = 2 ** 24  # what _integers draws exactly from an fp32 uniform

RECIPES = {
    "uniform": Recipe(_uniform, draws=1, takes_input=False),
    "normal": Recipe(_normal, draws=2, takes_input=False),
    "bernoulli": Recipe(_bernoulli, draws=1, takes_input=False),
    "bernoulli_tensor": Recipe(_bernoulli_tensor, draws=1, takes_input=True),
    "dropout": Recipe(_dropout, draws=1, takes_input=True, mask=True),
    "integers": Recipe(_integers, draws=1, takes_input=False),
}


def random_program(recipe: str, params: tuple, shape: tuple, dtype: DType, target: Target,
                   input_dtype: DType | None = None) -> Neff:
    """The NEFF of ``recipe`` with ``params`` writing a ``dtype`` tensor of ``shape``: inputs (state I64[2],
    [x input_dtype[shape]]), outputs (out[shape], [mask BOOL[shape]])."""
    spec = RECIPES[recipe]
    n = math.prod(shape)
    tensors: list = []

    def add(name, kind, tensor_dtype, tensor_shape, index):
        offset = tensors[-1].offset + -(-max(tensors[-1].nbytes, 1) // ALIGNMENT) * ALIGNMENT if tensors else 0
        tensors.append(TensorEntry(name, kind, tensor_dtype, tuple(tensor_shape), offset, index))
        return tensors[-1]

    state = add("state", TensorKind.INPUT, DType.I64, (2,), 0)
    x = add("x", TensorKind.INPUT, input_dtype, shape, 1) if spec.takes_input else None
    out = add("out", TensorKind.OUTPUT, dtype, shape, 0)
    mask = add("mask", TensorKind.OUTPUT, DType.BOOL, shape, 1) if spec.mask else None
    hbm_size = tensors[-1].offset + -(-max(tensors[-1].nbytes, 1) // ALIGNMENT) * ALIGNMENT

    em = Emitter(target)
    em.begin_kernel(f"rng_{recipe}", (recipe,), DebugLoc(op=f"random {recipe}"))
    state_tile = em.sbuf_pool(DType.I64, 2, bufs=1).next().ap(1, 2)
    em.dma(state_tile, hbm(DType.I64, state.offset, ((2, 1), (1, 2))))
    pools = {d: em.sbuf_pool(d, MAX_FREE, bufs=8)
             for d in {DType.F32, dtype, DType.BOOL, *([input_dtype] if x else [])}}
    for block in blocks((n,), [(1,)], MAX_FREE, target.partitions):
        tile_shape = (block.partitions, *block.free)
        b = _Block(em, pools, state_tile, tile_shape, block.offsets[0], block.dims[0][0][0], n)

        def at(entry, block=block):
            return hbm(entry.dtype, entry.offset + block.offsets[0] * entry.dtype.itemsize, block.dims[0])

        if x is not None:
            b.x = b.tile(input_dtype)
            em.dma(b.x, at(x))
        if mask is not None:
            b.mask = b.tile(DType.BOOL)
        result = b.tile(dtype)
        spec.emit(b, result, *params)
        em.dma(at(out), result)
        if mask is not None:
            em.dma(at(mask), b.mask)
    streams = insert_waits(em.instructions, tensors, target)
    makespan, kernel_ns = estimate_streams(streams, target)
    em.kernels[0].estimated_ns = kernel_ns.get(0, makespan)
    return Neff(name=f"rng_{recipe}", target=target.name, tensors=tensors, streams=streams, hbm_size=hbm_size,
                debug_locs=em.debug_locs, kernels=em.kernels, estimated_ns=makespan, compiler_version=__version__)


def random_kernel(em: Emitter, node, plan) -> None:
    """A graph's RANDOM node (neuronc/ir.py): uniform floats in [0, 1) of the node's shape and dtype, element e
    (row-major) the draw number offset + first + e of the stream of the state's seed. The state, an I64[2]
    input of the NEFF, is loaded once; each block of the flattened output is one RNG instruction on the GpSimd
    engine and one DMA out, so the numbers do not depend on the tiling (as the eager programs above)."""
    (state,) = node.inputs
    n = math.prod(node.shape)
    state_tile = em.sbuf_pool(DType.I64, 2, bufs=1).next().ap(1, 2)
    em.dma(state_tile, hbm(DType.I64, plan.offset(state), ((2, 1), (1, 2))))
    tiles = em.sbuf_pool(node.dtype, MAX_FREE, bufs=3)
    first, out = node.attrs["first"], plan.offset(node)
    for block in blocks((n,), [(1,)], MAX_FREE, em.target.partitions):
        tile = tiles.next().ap(block.partitions, *block.free)
        em.emit(Opcode.RNG, Engine.GPSIMD, tile, state_tile, imm0=float(first + block.offsets[0]),
                imm1=float(block.dims[0][0][0]))
        em.dma(hbm(node.dtype, out + block.offsets[0] * node.dtype.itemsize, block.dims[0]), tile)
