"""The cost model: how long a scheduled program takes on the target, without running it.

Prices each instruction with `neuronc.instruction_cost` (the same rule the emulator's clock uses)
and replays the streams' semaphore waits, so the estimate is the emulator's timeline makespan.
Passes ask it to choose between alternatives; the NEFF header records its estimate.
"""
from __future__ import annotations

from neuronc.instruction_cost import dma_transfer_ns, dma_transpose_ns, engine_pass_ns, matmul_pass_ns
from neuronc.isa import Engine
from neuronc.placement import SBUF_PAGE_BYTES, dma_slice_count, partition_group, transpose_chunks  # noqa: F401
from neuronc.stream_timing import estimate_streams, kernel_spans, replay  # noqa: F401 (the replay of programs)
from neuronc.targets import Target


def fits_sbuf(bytes_per_partition: int, target: Target) -> bool:
    """Whether a kernel's tiles, `bytes_per_partition` on each partition, fit the target's SBUF."""
    return bytes_per_partition <= target.sbuf_bytes_per_partition


# Choosing among a kernel's candidate plans ----------------------------------------------------------------

# Instructions the planners may emit, over all the candidates of one kernel, to time them on the emulator's clock
# (neuronc.kernel_timing) before choosing: a stated compile-time budget. The 4096^3 matmul's candidates take about
# 10,600 instructions each, so only the formula's best is timed; GPT-2-small's LM head's about 5,500 (two timed); a
# GPT-2-small layer's a few hundred to 1,300 (its MLP chain: about 11 of its 28 pairs). Kernels of the same plan
# are timed once per process. Measured (issue 16 part 6): the 12-layer GPT-2-small forward's compile took 4.6 s of
# CPU with the formulas alone, 14.2 s with a budget of 20,000, 11.6 s with this one, for the same program time.
TIMED_INSTRUCTIONS = 10_000
# An option whose formula price is more than this many times the least time found so far is not timed: on the
# candidates measured, `matmul_ns` overestimates by at most 2.2x (`python -m benchmarks.tiling_model`) and `conv_ns`
# underestimates (0.85-0.98 of the timed price, the ResNet block's convolutions); the tile-by-tile baseline, 5-10x
# slower than the others, is the option this spares. A stated margin above that.
FORMULA_MARGIN = 3.0


def cheapest(options: list, formula, timed=None, tie=lambda option: ()):
    """The option of least time: each one's emitted kernel timed by ``timed(option) -> (ns, instructions)`` (the
    emulator's clock of the kernel compiled alone), in order of the cheapest ``formula(option)`` first (the
    analytic prices below: an order, not a verdict) until TIMED_INSTRUCTIONS are spent or the formula prices the
    next option above FORMULA_MARGIN times the least time found (at least one option is timed); without ``timed``
    (no compiler around), the least ``formula``. Equal times: the least ``tie``, then the formula's order."""
    # Each option's formula evaluated once (it replays the kernel's schedule step by step: most of tile_matmuls'
    # time at -O2), in the options' order, so equal prices keep their order as a stable sort would.
    estimates = [formula(option) for option in options]
    order = sorted(range(len(options)), key=estimates.__getitem__)
    if timed is None:
        return options[min(order, key=lambda i: (estimates[i], tie(options[i])))]
    priced, spent = {}, 0
    for i in order:
        option = options[i]
        if priced and (spent >= TIMED_INSTRUCTIONS or estimates[i] > FORMULA_MARGIN * min(priced.values())):
            break
        priced[option], instructions = timed(option)
        spent += instructions
    return min(priced, key=lambda option: (priced[option], tie(option)))


# Pricing a matmul tiling before its instructions exist --------------------------------------------------

def strip_load_ns(rows: int, nbytes: int, contiguous: bool, target: Target) -> tuple:
    """(queue time summed, time until loaded) of one DMA of `nbytes` over `rows` partitions, split by
    partitions over the queues as codegen's loads are (pieces of at least the efficient DMA size). A busy queue
    prepares its next transfer while one moves data (`instruction_cost.remaining_latency_ns`, the emulator's
    rule), so of each piece's fixed cost only what its data does not cover takes queue time: max(data, fixed)
    per piece; the time until loaded pays the whole fixed cost."""
    pieces = dma_slice_count(rows, nbytes, target)
    one = dma_transfer_ns(nbytes / pieces, contiguous, target, -(-rows // pieces))
    return pieces * max(one - target.dma_fixed_ns, target.dma_fixed_ns), one


def _epilogue_ns(epilogue, tile_n: int, target: Target) -> tuple:
    """(engine time per output tile shared by the engines that take epilogue steps, its latency) of an
    epilogue body (no body: the copy of the result out of PSUM). Codegen spreads the steps over the Vector,
    Scalar and (for steps that read no PSUM) GpSimd engines, whichever is least busy."""
    steps = [sum(1 for kind, _ in step.args if kind != "imm") for step in epilogue] or [1]
    latency = sum(engine_pass_ns(Engine.VECTOR, tile_n, max(1, inputs), target) for inputs in steps)
    engines = 2 if len(steps) == 1 else 3
    return latency / engines, latency


class Servers:
    """The busy-until times of the resources matmul kernels share, carried from one matmul to the next in a
    chain (passes/matmul_chain.py): the Tensor engine, the epilogue's engines (one server at their combined
    rate), the DMA queues (one server at their combined rate, no faster than the core's HBM, each load
    lasting at least its slowest piece), the PSUM banks, the last store and the last end."""

    def __init__(self, target: Target, banks: int | None = None):
        self.tensor = self.epilogue = self.dma = self.stored = self.end = 0.0
        self.banks = [0.0] * (banks or target.psum_banks)  # when each PSUM bank is free again (its epilogue done)
        self.turn = 0


def _queues_ns(total: float, nbytes: float, target: Target) -> float:
    """The DMA queues' combined time for transfers of `nbytes` taking `total` ns of queue time: spread over the
    queues, and no faster than the core's HBM bandwidth (`instruction_cost.HbmChannel`)."""
    return max(total / target.dma_queues, nbytes / target.hbm_sustained_gbps)  # bytes / (GB/s) = ns


def strip_ns(k: int, tile_k: int, width: int, itemsize: int, contiguous: bool, bias_itemsize: int,
             target: Target, by_k_tile: bool = False) -> tuple:
    """(the DMA queues' combined time, latency, one piece's time) of loading a strip of all K tiles of `width`
    columns of an operand, and its part of the bias (`bias_itemsize` per column; 0: none), as codegen does:
    one DMA, or one per K tile (`by_k_tile`: passes/tiling.py `loads_a_by_k_tile`)."""
    nbytes = k * width * itemsize
    loads = [min(tile_k, k - k0) for k0 in range(0, k, tile_k)] if by_k_tile else [k]
    priced = [strip_load_ns(min(rows, tile_k), rows * width * itemsize, contiguous, target) for rows in loads]
    total, one = sum(t for t, _ in priced), max(o for _, o in priced)
    if bias_itemsize:
        total += dma_transfer_ns(width * bias_itemsize, True, target)
        nbytes += width * bias_itemsize
    occupancy = _queues_ns(total, nbytes, target)
    return occupancy, max(one, occupancy), one


def transposed_strip_ns(k: int, tile_k: int, width: int, itemsize: int, bias_itemsize: int, target: Target) -> tuple:
    """`strip_ns` of a strip loaded as DMA transposes (MatmulTiling.transposes): each whole K tile's columns by
    `transpose_chunks`, one DMA each on its own queue, a K tail by a strided DMA; a busy queue hides a
    transfer's fixed cost behind the one before, as `strip_load_ns` prices it."""
    whole, tail = divmod(k, tile_k)
    chunks = [dma_transpose_ns(tile_k, c1 - c0, itemsize, target) for c0, c1 in transpose_chunks(width, itemsize)]
    pieces = [one for one in chunks for _ in range(whole)]
    if tail:
        pieces.append(dma_transfer_ns(tail * width * itemsize, False, target, tail))
    total = sum(max(one - target.dma_fixed_ns, target.dma_fixed_ns) for one in pieces)
    nbytes = k * width * itemsize
    if bias_itemsize:
        total += dma_transfer_ns(width * bias_itemsize, True, target)
        nbytes += width * bias_itemsize
    occupancy = _queues_ns(total, nbytes, target)
    one = max(pieces)  # the last of the pieces on a queue of their own: the queues move them side by side
    latency = -(-len(pieces) // target.dma_queues) * (one - target.dma_fixed_ns) + target.dma_fixed_ns
    return occupancy, max(latency, occupancy), one


def matmul_ns(shape, k: int, a_dtype, b_dtype, out_dtype, extras_bytes: int, epilogue, tiling, target: Target,
              contiguous: tuple = (False, True), bias_row: bool = False, bias_column: bool = False,
              servers: Servers | None = None, a_kept: bool = False, sink: bool = False, preloaded: int = 0,
              meanwhile_ns: float = 0.0, a_by_k_tile: bool = False, second_bytes: int = 0) -> float:
    """Estimated time of a [B, M, K] x [B, K, N] matmul kernel under `tiling` (passes/tiling.py), with the
    per-instruction rules of `neuronc.instruction_cost`, replaying the schedule codegen emits step by step:
    strips loaded in order of use, `stream_bufs - 1` steps ahead, each into a buffer freed by the last step
    that read it; a step's output tiles on the Tensor engine once its strips are in, each tile's epilogue on
    the other engines once its PSUM bank is full (8 banks: the Tensor engine runs at most that far ahead),
    its store on the DMA queues. `contiguous` says whether A^T's and B's strips are contiguous loads (a
    transposed operand is a strided DMA at half bandwidth). With `bias_row`, each tile also gets a bias row
    added into PSUM by one more matmul (its columns loaded with B's strips); with `bias_column`, a bias column
    (its rows loaded with A's strips, each tile's part widened to fp32 on an epilogue engine) that the first
    epilogue step adds on its way. The first streamed strip loads before the first resident one when the tiling
    says so (`streamed_first`); the kernel's last store is cut over half the queues. `servers` carries the
    resources' state in from a matmul before (and out to one after); with `a_kept`, A^T is in SBUF already (a chain's second matmul) and is not loaded; with
    `sink`, the result stays in SBUF (a chain's first matmul) and is not stored; `preloaded`: how many of the
    first streamed strips were loaded before (during a chain's first matmul); `meanwhile_ns`: the DMA queues'
    time of those loads, spread over this matmul's output tiles; with `a_by_k_tile`, A^T's strips load one DMA
    per K tile (passes/tiling.py `loads_a_by_k_tile`); `second_bytes`: bytes per element of an epilogue step each
    tile also stores (a second output, passes/shared_epilogues.py), split by rows over queues as the result."""
    from neuronc.isa import DType

    batch, m, n = shape
    tm, tn, tk = tiling.tile_m, tiling.tile_n, tiling.tile_k
    m_tiles, n_tiles, k_tiles = -(-m // tm), -(-n // tn), -(-k // tk)
    fp32 = DType.F32 in (a_dtype, b_dtype)
    instr = matmul_pass_ns(min(tn, n), fp32, target)
    rows_k = min(tk, k)
    clock = servers or Servers(target)

    def tile_ns(rows, columns):
        """(Tensor engine time, epilogue engines' share, epilogue latency, DMA queues' share, store latency) of
        a [rows, columns] output tile: its K tiles' matmuls, its epilogue, its store split by rows over queues
        and its epilogue's other inputs (none stored with `sink`)."""
        out_tile = rows * columns
        stored_total, store = strip_load_ns(rows, out_tile * out_dtype.itemsize, True, target)
        stored_bytes = out_tile * (out_dtype.itemsize + extras_bytes)
        if sink:
            stored_total, store, stored_bytes = 0.0, 0.0, out_tile * extras_bytes
        stored_total += strip_load_ns(rows, out_tile * extras_bytes, True, target)[0] if extras_bytes else 0.0
        if second_bytes:
            stored_total += strip_load_ns(rows, out_tile * second_bytes, True, target)[0]
            stored_bytes += out_tile * second_bytes
        share, latency = _epilogue_ns(epilogue, columns, target)
        if bias_column:
            share += engine_pass_ns(Engine.VECTOR, 1, 1, target) / 3
        tensor = (k_tiles + bias_row) * matmul_pass_ns(columns, fp32, target)
        return tensor, share, latency, _queues_ns(stored_total, stored_bytes, target), store

    _, epilogue_share, epilogue_latency, stored_share, store = tile_ns(min(tm, m), min(tn, n))

    if tiling.resident == "none":  # both operands tile by tile on demand: `stream_bufs` loads of each in flight
        a_one = dma_transfer_ns(rows_k * min(tm, m) * a_dtype.itemsize, contiguous[0], target, rows_k)
        b_one = dma_transfer_ns(rows_k * min(tn, n) * b_dtype.itemsize, contiguous[1], target, rows_k)
        k_bytes = rows_k * (min(tm, m) * a_dtype.itemsize + min(tn, n) * b_dtype.itemsize)
        per_k = max(instr, max(a_one, b_one) / tiling.stream_bufs, _queues_ns(a_one + b_one, k_bytes, target))
        tiles = batch * m_tiles * n_tiles
        bias = (bias_row * min(tn, n) + bias_column * min(tm, m)) * out_dtype.itemsize  # a tile's, loaded with it
        bias_share = _queues_ns(dma_transfer_ns(bias, True, target), bias, target) if bias else 0.0
        clock.end = clock.dma + tiles * max(k_tiles * per_k + bias_row * instr, epilogue_share,
                                            stored_share + bias_share) + epilogue_latency + store
        clock.tensor = clock.dma = clock.epilogue = clock.stored = clock.end
        return clock.end

    def load(width, item, is_contiguous, bias, operand):  # (queue time, latency, a piece's time) of a strip
        if operand in tiling.transposes:
            return transposed_strip_ns(k, tk, width, item, bias and out_dtype.itemsize, target)
        return strip_ns(k, tk, width, item, is_contiguous, bias and out_dtype.itemsize, target,
                        operand == "a" and a_by_k_tile)

    # The steps of codegen's loop: (strip pool, load), then the [rows, columns] of the output tiles the step
    # completes.
    steps = []
    resident, streamed = ("a", "b") if tiling.resident == "a" else ("b", "a")
    size = {"a": (m, tm, a_dtype.itemsize, contiguous[0], bias_column),
            "b": (n, tn, b_dtype.itemsize, contiguous[1], bias_row)}
    extent, tile, item, cont, bias = size[resident]
    s_extent, s_tile, s_item, s_cont, s_bias = size[streamed]
    kept = {"a": a_kept, "b": False}
    for _ in range(batch):
        for r0 in range(0, extent, tiling.block * tile):
            width = min(tiling.block * tile, extent - r0)
            steps.append((resident, (0.0, 0.0, 0.0) if kept[resident]
                          else load(width, item, cont, bias, resident), 0, None))
            owner = len(steps) - 1
            for s0 in range(0, s_extent, s_tile):
                s_width = min(s_tile, s_extent - s0)
                before = len(steps) - 1 < preloaded  # (the steps so far: the resident strip, then streamed ones)
                strip = ((0.0, 0.0, 0.0) if kept[streamed] or before
                         else load(s_width, s_item, s_cont, s_bias, streamed))
                if resident == "a":  # (first row, rows, columns) of each output tile
                    sizes = [(r0 + r, min(tile, width - r), s_width) for r in range(0, width, tile)]
                else:
                    sizes = [(s0, s_width, min(tile, width - c)) for c in range(0, width, tile)]
                steps.append((streamed, strip, sizes, owner))
    if tiling.streamed_first and not kept[resident] and len(steps) > 1:
        (_, first_load, _, _), (_, second_load, tiles, _) = steps[:2]  # as codegen's `_streamed_first`
        steps = [(streamed, second_load, [], None), (resident, first_load, tiles, 0),
                 *((pool, load_, tiles_, 1 if owner == 0 else owner) for pool, load_, tiles_, owner in steps[2:])]
    bufs = {resident: 2, streamed: tiling.stream_bufs}
    free = {}  # step -> time its strip's buffer is free again (its last reader's matmuls are done)
    loaded_at = {}
    issued = 0
    banks = clock.banks
    same_pool = {name: [j for j, st in enumerate(steps) if st[0] == name] for name in ("a", "b")}
    position = {j: i for name in same_pool for i, j in enumerate(same_pool[name])}
    costs = {}  # [rows, columns] -> tile_ns
    stored_rows = {}  # first row of a tile -> when the last store of its rows is done
    last_turn = clock.turn + sum(len(tiles) for _, _, tiles, _ in steps if tiles) - 1
    for i, (pool, _, tiles, owner) in enumerate(steps):
        while issued < min(len(steps), i + tiling.stream_bufs):
            name, (occupancy, latency, piece), _, _ = steps[issued]
            earlier = position[issued] - bufs[name]
            ready = free.get(same_pool[name][earlier], clock.tensor) if earlier >= 0 else 0.0
            start = max(clock.dma, ready)
            clock.dma = start + occupancy
            # a queue runs in order: the piece queued behind the last store waits for that store
            loaded_at[issued] = max(start + latency, clock.stored + piece) if occupancy else 0.0
            issued += 1
        if not tiles:
            continue
        start = max(clock.tensor, loaded_at[i], loaded_at[owner])
        for row, rows, columns in tiles:
            tensor, epilogue_share, epilogue_latency, stored_share, store = costs.get((rows, columns)) or \
                costs.setdefault((rows, columns), tile_ns(rows, columns))
            start = max(start, banks[clock.turn % len(banks)])
            done = start + tensor
            epilogue_start = max(clock.epilogue, done)
            clock.epilogue = epilogue_start + epilogue_share
            banks[clock.turn % len(banks)] = epilogue_start + epilogue_latency
            clock.dma += stored_share + meanwhile_ns / (batch * m_tiles * n_tiles)  # the queues' other work
            # the stores of tiles of the same rows wait for each other (their HBM pages overlap)
            if not sink:
                if clock.turn == last_turn:  # the kernel's last store goes by rows over half the queues
                    pieces = min(rows, target.dma_queues // 2)
                    store = dma_transfer_ns(rows * columns * out_dtype.itemsize / pieces, True, target,
                                            -(-rows // pieces))
                stored_after = max(epilogue_start + epilogue_latency, stored_rows.get(row, 0.0))
                clock.stored = stored_rows[row] = stored_after + store
            clock.end = max(clock.end, epilogue_start + epilogue_latency, clock.stored)
            clock.turn += 1
            start = done
        clock.tensor = start
        free[i] = start
        free[owner] = start
    clock.end = max(clock.end, clock.tensor, clock.dma)
    return clock.end


def conv_ns(geometry, tiling, taps, x_dtype, out_dtype, element_extras_bytes: int, element_steps: int,
            target: Target) -> float:
    """Estimated time of an implicit-GEMM convolution kernel (passes/conv.py) under `tiling` and `taps` (a TapPlan),
    with the rules of `neuronc.instruction_cost`: the busiest of the Tensor engine (a matmul per entry of the plan,
    C tile and block of rows x pitch, or of row pairs x pitch), the DMA queues (each band's input rows per C tile, the result
    and per-element epilogue inputs per block, the weights once) and the epilogue's two ALU engines, plus the first
    band's load."""
    from neuronc.isa import DType

    g, rows, band = geometry, tiling.rows, tiling.band
    oh, ow = g.out
    fp32 = x_dtype == DType.F32
    co_tiles = -(-g.out_channels // target.matmul_max_m)
    bands = -(-oh // band)
    blocks = [min(rows, oh - r) for r in range(0, oh, rows)]
    # A matmul per entry, C tile and block: N = the block's rows (pairs of rows with `halves` 2) x pitch.
    per_block = [matmul_pass_ns(r // tiling.halves * g.pitch, fp32, target) for r in blocks]
    tensor = g.batch * co_tiles * g.c_tiles * len(taps.matmuls) * sum(per_block)
    partitions = min(g.channels, target.partitions)
    band_bytes = partitions * g.phases * g.plane_elements(band) * x_dtype.itemsize
    band_total, band_first = strip_load_ns(partitions, band_bytes, g.strides[1] == 1, target)
    loads = g.batch * bands * g.c_tiles * band_total * taps.copies
    out_rows = min(g.out_channels, target.partitions)
    stores = g.batch * co_tiles * sum(
        dma_transfer_ns(out_rows * r * ow * (out_dtype.itemsize + element_extras_bytes), True, target, out_rows)
        for r in blocks)
    weights, _ = strip_load_ns(partitions, taps.copies * partitions * g.c_tiles * g.out_channels * len(g.taps)
                               * x_dtype.itemsize, True, target)
    dma = (loads + stores + weights) / target.dma_queues
    epilogue = g.batch * co_tiles * sum(max(1, element_steps) * engine_pass_ns(Engine.VECTOR, r * ow, 2, target)
                                        for r in blocks) / 2
    return max(tensor, dma, epilogue) + band_first * g.c_tiles
