"""How long one instruction takes on a target: the single pricing rule shared by the runtime's clock
and the compiler's cost model, so the estimate the compiler optimises is the time the emulator reports.

Every number comes from the :class:`~neuronc.targets.Target`; the rules are the instruction-level
rules of thumb of `shared/TRAINIUM.md` ("Instruction-level rules of thumb"):

* DMA_COPY — the fixed cost of every DMA transfer (``Target.dma_fixed_ns``: descriptor setup, synchronisation,
  semaphore-to-start latency, ~1300 ns; descriptors precomputed, see targets.py) plus the bytes moved at one DMA
  engine's achievable rate (``dma_gbps_per_queue``: 17 / 23 / 33 B/ns on trn1 / trn2 / trn3), scaled by the
  payload curve (:func:`payload_efficiency`: a transfer moving few bytes per partition runs far below the rate).
  Bandwidth is halved when either operand's innermost dimension is not element-contiguous (TRAINIUM.md: "an
  innermost stride above 16 bytes halves bandwidth"; we take any non-unit element stride, which is what the
  DMA descriptors see as a gather/scatter).
* DMA_TRANSPOSE — the fixed cost, and its destination as whole [partitions, 16] units (the tile the DMA engines
  co-operate on) at the documented fraction of a queue's rate: 0.9 from HBM, 0.5 from SBUF (targets.py).
* DMA_GATHER / DMA_SCATTER — an indirect DMA: the fixed cost, and its bytes at half a queue's bandwidth since
  the rows come from (or go to) scattered addresses, as a strided DMA, scaled by the payload curve of a row;
  a scatter that adds moves each row twice (read, then write).
* MATMUL — "initiation interval about max(N, 64) cycles" of the Tensor engine clock, N being the
  moving operand's free size; "fp32 operands run at 1/4 of the bf16 rate".
* Vector / Scalar / GpSimd — "about N cycles for N elements per partition with one input, about 2N
  with two", never less than the minimum initiation interval (MIN_II, ~64 cycles), at the engine's own clock;
  the Vector engine's performance mode (trn2+) divides the N part for 16-bit operands (:func:`vector_speedup`).
  The ~100-cycle static overhead and ~60-cycle SRAM access show only between dependent instructions: one
  reading what its engine's previous instruction wrote starts ``dependent_spacing_cycles`` after that one ends
  (the docs' measured 264-cycle spacing of dependent activations), and a Scalar-engine activation needing
  another function's table loads it first (:func:`stream_costs`; a stated cost). Compile-time planners price the
  instructions they have not emitted yet with the same rules (:class:`PlannedStreams`, :func:`perf_mode_speedup`).
  N is the largest free size among the operands (a reduction reads more than it writes); instructions without an input (MEMSET, IOTA) make one pass over their destination.
  ACTIVATE_BIAS_REDUCE makes one pass, as ACTIVATE: its bias is one value per partition, and its row sum
  accumulates as the outputs stream by; so does ACTIVATE_SCALED (NKI's activation with a [P, 1] scale tile): its scale
  and bias are one value per partition each, held for the pass as ACTIVATE's immediates are. TENSOR_SCALAR_REDUCE likewise (NKI documents its reduction "at a
  small additional performance cost"). RNG makes one pass over its destination too (an assumption:
  TRAINIUM.md gives no rate for the GpSimd engine's random-number generator; its state is one tile of
  two values). TENSOR_ALU2 (two ALU ops in one pass) makes a pass per source it streams: a per-partition
value (a [p, 1] tile read with stride 0 along the free axes, NKI's tensor_scalar operand) is held, not
streamed, and a source read twice (as both operands) is streamed once. TENSOR_TENSOR_SCAN (NKI's tensor_tensor_scan,
no documented cost) is priced as TENSOR_TENSOR, a stated choice (targets.py): a pass per streamed data source, its
initial value held, no performance mode.

The DMA queues share the core's HBM: :class:`HbmChannel` serves every transfer's HBM bytes at the core's
sustained HBM bandwidth (``Target.hbm_sustained_gbps``: "HBM per core: divide the chip figure by the cores",
times the sustained fraction), in order of their starts, so 16 queues at 23 GB/s each do not move more than
the ~326 GB/s a trn2 core sustains. A transfer ends when both
its queue and its share of the channel are done. The runtime's clock and the cost model's replay both
take their DMA ends from it.

Collective-engine instructions (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, ALL_TO_ALL) last what the interconnect
model says (:func:`neuronc.collective_cost.collective_ns`) for the group's ``imm0`` ranks and their buffer
(the larger of the two operands), and occupy the HBM channel for the core's accesses of the collective
(:func:`~neuronc.collective_cost.collective_hbm_bytes`).

A copy of a whole tensor by the runtime (the `neuron` device's host <-> device and device <-> device copies,
its fills) is priced by :func:`copy_ns`: one DMA issue, the bytes spread over every DMA queue, no faster
than the core's HBM bandwidth.
"""
from __future__ import annotations

from neuronc.collective_cost import collective_hbm_bytes, collective_ns
from neuronc.isa import COLLECTIVES, ActFunc, AluOp, DType, Engine, Instruction, Opcode, Space
from neuronc.targets import Target


def _contiguous(ap) -> bool:
    stride, size = ap.dims[-1]
    return stride == 1 or size == 1


def payload_efficiency(bytes_per_partition: float, target: Target) -> float:
    """The fraction of a DMA engine's achievable rate a transfer of ``bytes_per_partition`` per partition gets:
    b / (b + half), normalised to 1 at the efficient payload (4 KiB) and above (targets.py: the payload curve)."""
    half, full = target.dma_half_rate_bytes, target.dma_efficient_bytes_per_partition
    if bytes_per_partition >= full:
        return 1.0
    b = max(bytes_per_partition, 1.0)
    return (b / (b + half)) / (full / (full + half))


def dma_transfer_ns(nbytes: float, contiguous: bool, target: Target, partitions: int | None = None) -> float:
    """One DMA on one queue: its fixed cost, then its bytes at the queue's rate (half when strided), scaled by the
    payload curve of its bytes per partition (``partitions``: the rows it spans; default all of the target's)."""
    per_partition = nbytes / max(1, partitions or target.partitions)
    bytes_per_ns = target.dma_gbps_per_queue / (1 if contiguous else 2) * payload_efficiency(per_partition, target)
    return target.dma_fixed_ns + nbytes / bytes_per_ns  # 1 GB/s is 1 byte/ns


def dma_partitions(instr: Instruction) -> int:
    """The partitions (rows) a DMA's payload is spread over: its on-chip side's, or its destination's outer dim."""
    side = next((ap for ap in instr.operands[:2] if ap.space != Space.HBM), instr.dst)
    return side.dims[0][1] if side.dims else 1


def _dma_ns(instr: Instruction, target: Target) -> float:
    src = instr.srcs[0]
    return dma_transfer_ns(src.num_elements * src.dtype.itemsize, all(_contiguous(ap) for ap in instr.operands),
                           target, dma_partitions(instr))


def matmul_pass_ns(moving_free: int, fp32: bool, target: Target) -> float:
    """One matmul whose moving operand has `moving_free` elements per partition (fp32 operands: the slow rate)."""
    cycles = max(moving_free, target.matmul_min_interval_cycles) * (target.matmul_fp32_slowdown if fp32 else 1)
    return cycles / target.tensor_ghz


def _matmul_ns(instr: Instruction, target: Target) -> float:
    _dst, stationary, moving = instr.operands
    return matmul_pass_ns(moving.free_elements, DType.F32 in (stationary.dtype, moving.dtype), target)


_CLOCK_GHZ = {
    Engine.TENSOR: lambda t: t.tensor_ghz,
    Engine.VECTOR: lambda t: t.vector_ghz,
    Engine.SCALAR: lambda t: t.scalar_ghz,
    Engine.GPSIMD: lambda t: t.gpsimd_ghz,
}


# Opcodes making fewer passes over the elements than they have sources.
_PASSES = {Opcode.ACTIVATE_BIAS_REDUCE: 1, Opcode.ACTIVATE_SCALED: 1, Opcode.TENSOR_SCALAR_REDUCE: 1, Opcode.RNG: 1}


def _streamed(ap) -> bool:
    """Whether a source is read element by element (not one value per partition held for the pass)."""
    return any(stride and size > 1 for stride, size in ap.dims[1:])


def _alu2_passes(instr: Instruction) -> int:
    """TENSOR_ALU2's passes: one per distinct streamed source it reads; TENSOR_TENSOR_SCAN's: one per streamed data
    source (its initial value, a [p, 1] tile, is held)."""
    if instr.opcode == Opcode.TENSOR_TENSOR_SCAN:
        return max(1, sum(_streamed(ap) for ap in instr.srcs[:2]))
    sources = instr.srcs[:2] if instr.alu1 == AluOp.NONE else instr.srcs
    return max(1, len({ap for ap in sources if _streamed(ap)}))


def engine_pass_ns(engine: Engine, elements: int, passes: int, target: Target, speedup: float = 1.0) -> float:
    """An instruction of the Vector, Scalar or GpSimd engine making `passes` over `elements` per partition:
    max(MIN_II, N * passes) cycles of its engine's clock, the N-proportional part divided by a Vector
    performance-mode ``speedup`` (targets.py)."""
    cycles = max(target.elementwise_min_interval_cycles, elements * passes / speedup)
    return cycles / _CLOCK_GHZ[engine](target)


_SIXTEEN_BIT = (DType.BF16, DType.F16)
_COPY_LIKE = (Opcode.TENSOR_COPY, Opcode.TENSOR_SCALAR)  # NKI's tensor_copy / tensor_scalar


def vector_speedup(instr: Instruction, target: Target, passes: int) -> float:
    """The Vector engine's performance-mode speed-up of ``instr`` (:func:`perf_mode_speedup`). TENSOR_ALU2 counts as
    tensor_scalar with one streamed source and as tensor_tensor with two; a per-partition scalar is held, not an
    operand of the pass."""
    operands = perf_mode_operands(instr.dst, instr.srcs)
    if instr.opcode in _COPY_LIKE or (instr.opcode == Opcode.TENSOR_ALU2 and passes == 1):
        form = "copy"
    elif instr.opcode == Opcode.TENSOR_TENSOR or (instr.opcode == Opcode.TENSOR_ALU2 and passes == 2):
        form = "tensor_tensor"
    else:
        form = None
    return perf_mode_speedup(instr.engine, form, operands, target)


def perf_mode_operands(dst, srcs) -> list:
    """(dtype, space, contiguous) of the operands the performance mode looks at: the destination and the sources
    streamed (a per-partition scalar read with stride 0 is held, not streamed)."""
    return [(ap.dtype, ap.space, _contiguous(ap)) for ap in (dst, *(ap for ap in srcs if _streamed(ap)))]


def perf_mode_speedup(engine: Engine, form: str | None, operands: list, target: Target) -> float:
    """The Vector engine's performance-mode speed-up (targets.vector_perf_mode) of an instruction of ``form`` ("copy":
    tensor_copy / tensor_scalar; "tensor_tensor"; None: any other) whose destination and streamed sources are
    ``operands``, each (dtype, space, contiguous innermost dim): 4x for a copy whose operands are all bf16/fp16 in
    SBUF and contiguous, 2x when one is not contiguous or one side is in PSUM; 2x for a tensor_tensor with both
    inputs in SBUF and every operand bf16/fp16; 1 otherwise. The one rule the emulator's clock and the planners
    (passes/rowwise_schedule.py) both apply."""
    if not target.vector_perf_mode or engine != Engine.VECTOR or form is None:
        return 1.0
    if any(dtype not in _SIXTEEN_BIT for dtype, _, _ in operands):
        return 1.0
    spaces = [space for _, space, _ in operands]
    contiguous = all(c for _, _, c in operands)
    if form == "copy":
        in_psum = spaces.count(Space.PSUM)
        if in_psum > 1 or Space.HBM in spaces:
            return 1.0
        if in_psum == 0 and contiguous:
            return 4.0
        return 2.0 if contiguous or in_psum == 0 else 1.0
    if all(space == Space.SBUF for space in spaces[1:]):
        return 2.0
    return 1.0


def _elementwise_ns(instr: Instruction, target: Target) -> float:
    elements = max(ap.free_elements for ap in instr.operands)
    if instr.opcode == Opcode.BN_AGGR:  # 13 cycles a (count, mean, M2) triple (targets.bn_aggr_cycles_per_triple)
        return engine_pass_ns(instr.engine, instr.srcs[0].free_elements // 3 * target.bn_aggr_cycles_per_triple, 1,
                              target)
    if instr.opcode in (Opcode.TENSOR_ALU2, Opcode.TENSOR_TENSOR_SCAN):
        passes = _alu2_passes(instr)
    else:
        passes = _PASSES.get(instr.opcode, max(1, len(instr.srcs)))
    return engine_pass_ns(instr.engine, elements, passes, target, vector_speedup(instr, target, passes))


# Activation functions the Scalar engine computes without a table (a stated choice, targets.py).
_NO_TABLE = {ActFunc.NONE, ActFunc.IDENTITY, ActFunc.RELU, ActFunc.ABS, ActFunc.NEG, ActFunc.SQUARE, ActFunc.SIGN,
             ActFunc.FLOOR, ActFunc.CEIL, ActFunc.NOT, ActFunc.ROUND}


def activation_table(instr: Instruction) -> ActFunc | None:
    """The activation-function table ``instr`` needs loaded in its Scalar engine (None: it needs none)."""
    if instr.opcode not in (Opcode.ACTIVATE, Opcode.ACTIVATE_BIAS_REDUCE, Opcode.ACTIVATE_SCALED):
        return None
    return table_of(instr.func)


def table_of(func: ActFunc) -> ActFunc | None:
    """The table an activation of ``func`` needs (None: computed without one; a stated choice, targets.py)."""
    return None if func in _NO_TABLE else func


def dependent_gap_ns(engine: Engine, target: Target) -> float:
    """How long after its engine's previous instruction ends an instruction reading that one's output starts (its
    output committed to SRAM first; targets.dependent_spacing_cycles, at the engine's clock)."""
    return target.dependent_spacing_cycles / _CLOCK_GHZ[engine](target)


def table_load_ns(engine: Engine, target: Target) -> float:
    """Loading another activation function's table into an engine (targets.activation_table_load_cycles)."""
    return target.activation_table_load_cycles / _CLOCK_GHZ[engine](target)


def _box(ap) -> tuple:
    """(space, first partition, end partition, first byte, end byte): a box holding every byte ``ap`` addresses."""
    lo = hi = ap.offset
    for stride, size in ap.dims[1:] if ap.space != Space.HBM else ap.dims:
        reach = stride * (size - 1) * ap.dtype.itemsize
        lo, hi = lo + min(reach, 0), hi + max(reach, 0)
    first = ap.partition if ap.space != Space.HBM else 0
    return ap.space, first, first + (ap.dims[0][1] if ap.space != Space.HBM else 1), lo, hi + ap.dtype.itemsize


def _reads_written(reader: Instruction, writer: Instruction) -> bool:
    return reads_written(reader.reads, writer)


def reads_written(reads, writer: Instruction) -> bool:
    """Whether any of the access patterns ``reads`` overlaps what ``writer`` writes (the dependent-spacing test)."""
    for a in map(_box, reads):
        for b in map(_box, writer.writes):
            if a[0] == b[0] and a[1] < b[2] and b[1] < a[2] and a[3] < b[4] and b[3] < a[4]:
                return True
    return False


def stream_costs(stream: list, target: Target) -> tuple:
    """(extra ns, gap ns) of each instruction of one engine's stream from what ran before it on that engine: the
    activation-table load it pays when it needs a table other than the one loaded (extra: the engine loads it
    before computing), and the spacing after the previous instruction's end when it reads what that one wrote
    (gap: its output committed to SRAM first; targets.dependent_spacing_cycles). DMA and Tensor-engine streams
    have neither."""
    extras, gaps = [0.0] * len(stream), [0.0] * len(stream)
    if not stream or stream[0].engine not in (Engine.VECTOR, Engine.SCALAR, Engine.GPSIMD):
        return extras, gaps
    loaded = None
    for i, instr in enumerate(stream):
        extras[i], gaps[i], loaded = step_costs(instr, stream[i - 1] if i else None, loaded, target)
    return extras, gaps


def step_costs(instr: Instruction, previous: Instruction | None, loaded: ActFunc | None, target: Target) -> tuple:
    """(extra ns, gap ns, table loaded after) of ``instr`` following ``previous`` on its Vector, Scalar or GpSimd
    engine with ``loaded`` the table in it (:func:`stream_costs`' rule for one instruction; codegen's balancers
    charge it too)."""
    extra, gap = 0.0, 0.0
    table = activation_table(instr)
    if table is not None and table != loaded:
        extra, loaded = table_load_ns(instr.engine, target), table
    if previous is not None and instr.opcode not in COLLECTIVES and _reads_written(instr, previous):
        gap = dependent_gap_ns(instr.engine, target)
    return extra, gap, loaded


class PlannedStreams:
    """The in-order Vector, Scalar and GpSimd streams as a compile-time planner sees them before the instructions
    exist (passes/rowwise_schedule.py), priced by :func:`stream_costs`' rules: an instruction reading what its
    engine's previous instruction made starts ``dependent_gap_ns`` after that one ends, and one needing another
    activation table than its engine's loaded one pays :func:`table_load_ns` first. What an instruction reads and
    makes are the planner's own keys (its steps)."""

    def __init__(self, target: Target):
        self.target = target
        self.free: dict = {}  # engine -> when its last instruction ends
        self.made: dict = {}  # engine -> the keys its last instruction made
        self.table: dict = {}  # engine -> the activation table loaded

    def run(self, engine: Engine, ns: float, ready: float, reads=(), makes=(), func: ActFunc | None = None) -> tuple:
        """(start, end, engine time charged: its cost, table load and dependent gap, as codegen's balancers charge)
        of an instruction of ``ns`` on ``engine`` whose inputs are ready at ``ready``; ``func``: its activation
        function (an ACTIVATE), None for any other instruction."""
        free = self.free.get(engine, 0.0)
        gap = dependent_gap_ns(engine, self.target) if any(key in self.made.get(engine, ()) for key in reads) else 0.0
        start = max(ready, free + gap)
        table = table_of(func) if func is not None else None
        if table is not None and table != self.table.get(engine):
            ns += table_load_ns(engine, self.target)
            self.table[engine] = table
        self.free[engine], self.made[engine] = start + ns, set(makes)
        return start, start + ns, ns + gap


def remaining_latency_ns(start: float, ready: float, moving: float, latency: float) -> float:
    """What is left at ``start`` of a DMA's ``latency`` (start_latency_ns), prepared from when its waits were met
    (``ready``) and its queue's previous transfer began moving data (``moving``): a queue prepares one transfer
    ahead. Shared by the emulator's clock (stream_timing.simulate) and the planners' DMA queues."""
    return max(0.0, max(ready, moving) + latency - start)


def transfer_bytes(instr: Instruction) -> int:
    """The bytes a DMA moves: its on-chip side's for an indirect one (the rows gathered or scattered, not
    the table its HBM pattern spans), its destination's otherwise."""
    if instr.opcode in (Opcode.DMA_GATHER, Opcode.DMA_SCATTER):
        # (a damaged program may have no on-chip side: its destination is priced, and the load's rules refuse it)
        rows = next((ap for ap in instr.operands[:2] if ap.space != Space.HBM), instr.dst)
        return rows.num_elements * rows.dtype.itemsize
    return instr.dst.num_elements * instr.dst.dtype.itemsize


def hbm_bytes(instr: Instruction, target: Target | None = None) -> int:
    """The HBM traffic of an instruction: what it moves, once per HBM operand (only DMAs and collectives reach
    HBM); a collective's is the model's (it needs the target)."""
    if instr.opcode in COLLECTIVES:
        return collective_hbm_bytes(COLLECTIVES[instr.opcode], collective_buffer_bytes(instr), int(instr.imm0),
                                    target) if target is not None else 0
    return sum(ap.space == Space.HBM for ap in instr.operands[:2]) * transfer_bytes(instr)


def collective_buffer_bytes(instr: Instruction) -> int:
    """The whole buffer of a collective: the larger operand (an all-gather's output, a reduce-scatter's input)."""
    return max(ap.num_elements * ap.dtype.itemsize for ap in instr.operands)


def _collective_ns(instr: Instruction, target: Target) -> float:
    return collective_ns(COLLECTIVES[instr.opcode], collective_buffer_bytes(instr), int(instr.imm0), target)


def _indirect_ns(instr: Instruction, target: Target) -> float:
    """An indirect DMA: its fixed cost, rows moved to or from scattered addresses (half bandwidth, the payload
    curve of the rows); a scatter that adds reads each row before writing it (twice the traffic)."""
    traffic = 2 if instr.alu == AluOp.ADD else 1
    return dma_transfer_ns(traffic * transfer_bytes(instr), False, target, traffic * dma_partitions(instr))


def _dma_transpose_ns(instr: Instruction, target: Target) -> float:
    dst, src = instr.operands
    return dma_transpose_ns(*dst.shape, dst.dtype.itemsize, target, src.space == Space.HBM)


def transposes_by_dma(partitions: int, itemsize: int, target: Target) -> bool:
    """Whether x^T tiles of `partitions` partitions of `itemsize`-byte elements go by DMA transposes (else strided
    loads): on a target that has them, a 2-byte type, every partition of a unit (a destination of fewer pays whole
    units: dma_transpose_ns, so at head dim 64 strided loads on two queues are faster). What the attention kernel
    emits (codegen/attention.py load_transposed) and its pass prices (passes/attention.py)."""
    return target.dma_transpose_hbm_fraction > 0 and partitions == target.partitions and itemsize == 2


def dma_transpose_ns(rows: int, cols: int, itemsize: int, target: Target, from_hbm: bool = True) -> float:
    """A DMA transpose into a [rows, cols] destination: whole [partitions, dma_transpose_inner] units of it at the
    documented fraction of a queue's rate for its source's memory (targets.py: a destination of fewer partitions
    pays full units)."""
    fraction = target.dma_transpose_hbm_fraction if from_hbm else target.dma_transpose_sbuf_fraction
    units = -(-rows // target.partitions) * -(-cols // target.dma_transpose_inner)
    unit_bytes = target.partitions * target.dma_transpose_inner * itemsize
    return target.dma_fixed_ns + units * unit_bytes / (target.dma_gbps_per_queue * fraction)


_COST = {Opcode.DMA_COPY: _dma_ns, Opcode.DMA_TRANSPOSE: _dma_transpose_ns, Opcode.MATMUL: _matmul_ns, Opcode.DMA_GATHER: _indirect_ns,
         Opcode.DMA_SCATTER: _indirect_ns, **{op: _collective_ns for op in COLLECTIVES}}


def start_latency_ns(instr: Instruction, target: Target) -> float:
    """The leading part of ``instr``'s duration before its data moves, which a DMA queue overlaps with the previous
    transfer's data (stream_timing): a DMA's fixed cost (descriptor setup, synchronisation, semaphore-to-start
    latency); 0 for compute instructions. A stated choice: the docs say small transfers are bound by this per-transfer
    overhead and >= 4 KiB per partition saturate an engine at its rate, which holds only if a queue prepares its next
    transfer while one moves data; we let it prepare one transfer ahead."""
    return target.dma_fixed_ns if instr.engine == Engine.DMA else 0.0


def instruction_cost_ns(instr: Instruction, target: Target) -> float:
    """Estimated duration of ``instr`` on ``target`` in nanoseconds."""
    return _COST.get(instr.opcode, _elementwise_ns)(instr, target)


def copy_ns(nbytes: int, target: Target) -> float:
    """Estimated duration of moving ``nbytes`` to or from one NeuronCore's HBM with all its DMA queues."""
    bytes_per_ns = min(target.dma_queues * target.dma_gbps_per_queue, target.hbm_sustained_gbps)
    return target.dma_fixed_ns + nbytes / bytes_per_ns


class HbmChannel:
    """The HBM bandwidth of one core, shared by its DMA queues. Transfers reserve it in the order they
    start (callers ask in that order): each occupies it for its HBM bytes at the core's bandwidth, from
    when its data can first flow (its issue cost paid) or when the channel frees, whichever is later."""

    def __init__(self, target: Target):
        self.gbps, self.issue_ns = target.hbm_sustained_gbps, target.dma_fixed_ns
        self.free_at = 0.0

    def end(self, start: float, duration: float, nbytes: int, lead: float | None = None) -> float:
        """When a transfer of ``nbytes`` HBM bytes that starts at ``start`` and alone would last
        ``duration`` ends; its data flows ``lead`` ns after its start (default: its whole fixed cost)."""
        if not nbytes:
            return start + duration
        lead = self.issue_ns if lead is None else lead
        self.free_at = max(self.free_at, start + lead) + nbytes / self.gbps  # bytes / (GB/s) = ns
        return max(start + duration, self.free_at)
