"""The cost model: how long a scheduled program takes on the target, without running it.

Prices each instruction with `neuronc.instruction_cost` (the same rule the emulator's clock uses)
and replays the streams' semaphore waits, so the estimate is the emulator's timeline makespan.
Passes ask it to choose between alternatives; the NEFF header records its estimate.
"""
from __future__ import annotations

from neuronc.instruction_cost import instruction_cost_ns
from neuronc.targets import Target

# On-chip tiles are placed on pages of this many bytes per partition (the sync pass tracks hazards per
# page, so two tiles never share one): a placement granularity of codegen, not a hardware number.
SBUF_PAGE_BYTES = 1024


def fits_sbuf(bytes_per_partition: int, target: Target) -> bool:
    """Whether a kernel's tiles, `bytes_per_partition` on each partition, fit the target's SBUF."""
    return bytes_per_partition <= target.sbuf_bytes_per_partition


def estimate_streams(streams: dict, target: Target) -> tuple:
    """(makespan in ns, {kernel index: ns summed over its instructions}) of scheduled streams."""
    done = {s: [] for s in streams}  # stream -> end time of each completed instruction
    cursor = {s: 0 for s in streams}
    kernel_ns: dict = {}
    progressed = True
    while progressed:
        progressed = False
        for stream, instructions in streams.items():
            i = cursor[stream]
            while i < len(instructions):
                inst = instructions[i]
                ready = 0.0
                for wait in inst.waits:
                    finished = done.get((wait.engine, wait.queue), [])
                    if len(finished) < wait.count:
                        break
                    ready = max(ready, finished[wait.count - 1])
                else:
                    start = max(ready, done[stream][-1] if done[stream] else 0.0)
                    cost = instruction_cost_ns(inst, target)
                    done[stream].append(start + cost)
                    kernel_ns[inst.kernel] = kernel_ns.get(inst.kernel, 0.0) + cost
                    i += 1
                    progressed = True
                    continue
                break
            cursor[stream] = i
    makespan = max((ends[-1] for ends in done.values() if ends), default=0.0)
    return makespan, kernel_ns


# Pricing a matmul tiling before its instructions exist --------------------------------------------------

def _dma_piece_ns(nbytes: int, contiguous: bool, target: Target) -> float:
    return target.dma_fixed_ns + nbytes / (target.dma_gbps_per_queue / (1 if contiguous else 2))


def strip_load_ns(rows: int, nbytes: int, contiguous: bool, target: Target) -> tuple:
    """(queue time summed, time until loaded) of one DMA of `nbytes` over `rows` partitions, split by
    partitions over the queues as codegen's loads are (pieces of at least the efficient DMA size)."""
    smallest = target.dma_efficient_bytes_per_partition * target.partitions // target.dma_queues
    pieces = max(1, min(rows, target.dma_queues, nbytes // smallest))
    one = _dma_piece_ns(nbytes / pieces, contiguous, target)
    return pieces * one, one


def _matmul_instr_ns(tile_n: int, fp32: bool, target: Target) -> float:
    cycles = max(tile_n, target.matmul_min_interval_cycles) * (target.matmul_fp32_slowdown if fp32 else 1)
    return cycles / target.tensor_ghz


def _vector_ns(elements: int, inputs: int, target: Target) -> float:
    cycles = target.elementwise_fixed_cycles + target.onchip_access_cycles + elements * max(1, inputs)
    return cycles / target.vector_ghz


def matmul_ns(shape, k: int, a_dtype, b_dtype, out_dtype, extras_bytes: int, epilogue_steps: int, tiling,
              target: Target) -> float:
    """Estimated time of a [B, M, K] x [B, K, N] matmul kernel under `tiling` (passes/tiling.py), with the
    per-instruction rules of `neuronc.instruction_cost`: the busiest of the Tensor engine, the DMA queues
    (their summed time shared by all queues) and the epilogue's engine, plus the time to load the first
    strips before the Tensor engine can start."""
    from neuronc.isa import DType

    batch, m, n = shape
    tm, tn, tk = tiling.tile_m, tiling.tile_n, tiling.tile_k
    m_tiles, n_tiles, k_tiles = -(-m // tm), -(-n // tn), -(-k // tk)
    tiles = batch * m_tiles * n_tiles
    fp32 = DType.F32 in (a_dtype, b_dtype)
    tensor = tiles * k_tiles * _matmul_instr_ns(tn, fp32, target)
    a_item, b_item, c_item = a_dtype.itemsize, b_dtype.itemsize, out_dtype.itemsize
    rows_k = min(tk, k)

    def a_strip(rows):  # A^T: K on partitions, the rows of A along the free axis (a strided read)
        return strip_load_ns(rows_k, k * min(rows, m) * a_item, False, target)

    def b_strip(cols):
        return strip_load_ns(rows_k, k * min(cols, n) * b_item, True, target)

    if tiling.resident == "a":
        blocks = -(-m_tiles // tiling.block)
        a_total, a_first = a_strip(tiling.block * tm)
        b_total, b_first = b_strip(tn)
        loads = batch * blocks * (a_total + n_tiles * b_total)
        first = a_first + b_first
    elif tiling.resident == "b":
        blocks = -(-n_tiles // tiling.block)
        b_total, b_first = b_strip(tiling.block * tn)
        a_total, a_first = a_strip(tm)
        loads = batch * blocks * (b_total + m_tiles * a_total)
        first = a_first + b_first
    else:
        a_one = _dma_piece_ns(min(tk, k) * min(tm, m) * a_item, False, target)
        b_one = _dma_piece_ns(min(tk, k) * min(tn, n) * b_item, True, target)
        loads = tiles * k_tiles * (a_one + b_one)
        first = a_one + b_one
    out_tile = min(tm, m) * min(tn, n)
    stores = tiles * _dma_piece_ns(out_tile * (c_item + extras_bytes), True, target)
    dma = (loads + stores) / target.dma_queues
    epilogue = tiles * epilogue_steps * _vector_ns(min(tn, n), 2, target)
    return max(tensor, dma, epilogue) + first


def conv_ns(geometry, tiling, taps, x_dtype, out_dtype, element_extras_bytes: int, element_steps: int,
            target: Target) -> float:
    """Estimated time of an implicit-GEMM convolution kernel (passes/conv.py) under `tiling` and `taps` (a TapPlan),
    with the rules of `neuronc.instruction_cost`: the busiest of the Tensor engine (a matmul per entry of the plan,
    C tile and block of rows x pitch, or pair of rows), the DMA queues (each band's input rows per C tile, the result
    and per-element epilogue inputs per block, the weights once) and the epilogue's two ALU engines, plus the first
    band's load."""
    from neuronc.isa import DType

    g, rows, band = geometry, tiling.rows, tiling.band
    oh, ow = g.out
    fp32 = x_dtype == DType.F32
    co_tiles = -(-g.out_channels // target.matmul_max_m)
    bands = -(-oh // band)
    blocks = [min(rows, oh - r) for r in range(0, oh, rows)]
    if tiling.halves == 2:  # a matmul per pair of rows, N = pitch
        per_block = [r // 2 * _matmul_instr_ns(g.pitch, fp32, target) for r in blocks]
    else:
        per_block = [_matmul_instr_ns(r * g.pitch, fp32, target) for r in blocks]
    tensor = g.batch * co_tiles * g.c_tiles * len(taps.matmuls) * sum(per_block)
    partitions = min(g.channels, target.partitions)
    band_bytes = partitions * g.phases * g.plane_elements(band) * x_dtype.itemsize
    band_total, band_first = strip_load_ns(partitions, band_bytes, g.strides[1] == 1, target)
    loads = g.batch * bands * g.c_tiles * band_total * taps.copies
    out_rows = min(g.out_channels, target.partitions)
    stores = g.batch * co_tiles * sum(
        _dma_piece_ns(out_rows * r * ow * (out_dtype.itemsize + element_extras_bytes), True, target) for r in blocks)
    weights, _ = strip_load_ns(partitions, taps.copies * partitions * g.c_tiles * g.out_channels * len(g.taps)
                               * x_dtype.itemsize, True, target)
    dma = (loads + stores + weights) / target.dma_queues
    epilogue = g.batch * co_tiles * sum(max(1, element_steps) * _vector_ns(r * ow, 2, target) for r in blocks) / 2
    return max(tensor, dma, epilogue) + band_first * g.c_tiles
