"""Target descriptions: every hardware number of trn1, trn2 and trn3 lives here and nowhere else.

Figures are from AWS's public Neuron architecture documentation, collected with their sources in
`shared/TRAINIUM.md`. The cost model and the emulator read them through a :class:`Target`; no other
module may hard-code a hardware number.
"""
from __future__ import annotations

import dataclasses

from neuronc.errors import NeuronConfigError

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    # On-chip memory geometry (per NeuronCore): SBUF 24 / 28 / 32 MiB as 128 partitions, PSUM 2 MiB in 8 banks of
    # 2 KiB per partition (trainium_inferentia2_arch.rst, trainium2_arch.rst, trainium3_arch.rst).
    partitions: int
    sbuf_bytes_per_partition: int
    psum_bytes_per_partition: int
    psum_banks: int
    # Tile rules of the Tensor engine: stationary [K <= k, M <= m], moving [K <= k, N <= n] (nki.isa nc_matmul).
    matmul_max_k: int
    matmul_max_m: int
    matmul_max_n: int
    # Free-axis size limits of Vector/Scalar instructions (elements per partition): 64K from SBUF, 4K from PSUM
    # (nki.language tile size limits).
    max_free_elements_sbuf: int
    max_free_elements_psum: int
    # Clocks (GHz) of each engine (the architecture guides' engine tables; TRAINIUM.md "Per NeuronCore").
    tensor_ghz: float
    vector_ghz: float
    scalar_ghz: float
    gpsimd_ghz: float
    # Peak dense matmul rate per NeuronCore, TFLOPS, by operand dtype family (trainium2_arch.rst: "158 FP8, 79
    # BF16/FP16/TF32 and 20 FP32 dense TFLOPS"; trn1 92 / 23; trn3's 315 mxfp8).
    matmul_tflops_bf16: float
    matmul_tflops_fp32: float
    matmul_tflops_fp8: float
    # Instruction cost rules (cycles of the engine's clock). A matmul's initiation interval is "roughly max(N,
    # MM_INIT_LATENCY), where MM_INIT_LATENCY is 64 TensorE cycles" (trainium_inferentia2_arch.rst, Tensor Engine).
    matmul_min_interval_cycles: int
    matmul_fp32_slowdown: int  # fp32 operands run at 1/this of the bf16 rate (20 vs 79 dense TFLOPS: 1/4)
    # Vector/Scalar/GpSimd instructions. An instruction making `passes` over N elements per partition occupies its
    # engine max(MIN_II, N * passes) cycles: "max(MIN_II, N)" with "MIN_II ... roughly 64 engine cycles" (the
    # engine-selection cost table of nki/api/nki.api.shared.rst), N cycles for one input and 2N for two
    # (nki/guides/architecture/trainium_inferentia2_arch.rst, Vector Engine "Cost Model"). NKI's tensor_tensor_scan
    # (TENSOR_TENSOR_SCAN) has no documented cost: a stated choice prices it as tensor_tensor, 2N for its two
    # streamed inputs (its initial value is one number per partition, held), without the performance mode (trn2's
    # docs list only tensor_copy / tensor_scalar / tensor_tensor for it, and the scan's state is fp32).
    elementwise_min_interval_cycles: int
    # BatchNorm statistics (NKI's bn_stats / bn_aggr on the Vector and GpSimd engines; aws-neuron-sdk
    # nki/api/nki/isa/__init__.py, an earlier version's docstrings): bn_stats reads at most "512
    # (nl.tile_size.bn_stats_fmax)" elements per partition and costs "max(MIN_II, N) Vector Engine cycles" (one pass:
    # the rule above); bn_aggr costs "max(MIN_II, 13*(N/3))" cycles for N input elements (N/3 triples), here 13
    # cycles a triple. Neither is in trn2's performance-mode list (priced at 1x). GpSimd takes the same cycles at
    # its own clock (a stated choice: the docs give the Vector engine's).
    bn_stats_max_free: int
    bn_aggr_cycles_per_triple: int
    # An instruction reading what the instruction before it on the same engine wrote "cannot start data read until
    # the previous instruction has all of its output committed to the local SRAM": the static overhead (~100
    # cycles) plus the tensor access overhead (~60 cycles each way, trainium_inferentia2_arch.rst) show. The docs
    # measure dependent 1-element activations "189 ns (264 ScalarE cycles on NC-v2)" apart (nki_perf_guide.rst,
    # Opt #5a); such an instruction occupies MIN_II, so the gap after its producer's end is 264 - 64 = 200 cycles.
    dependent_spacing_cycles: int
    # A hardware loop (nki.language.dynamic_range / fori_loop: "a hardware loop instruction ... a single copy of the
    # body", compiled "into a compare-and-branch"; nki/deep-dives/nki-dynamic-loops.rst, nki.language.fori_loop)
    # has no documented cost. A stated choice: each iteration pays one instruction slot of the minimum interval
    # (MIN_II, above) for its compare-and-branch, at the Vector engine's clock (runtime/loops.py).
    loop_iteration_cycles: int
    # Vector engine performance mode (NeuronCore-v3+, automatic; trainium2_arch.rst "Vector Engine Performance
    # Mode"): tensor_copy / tensor_scalar 4x with bf16/fp16 operands in SBUF and a contiguous innermost dim, 2x
    # when not contiguous or one side in PSUM; tensor_tensor 2x with both inputs in SBUF and every operand
    # bf16/fp16. The speed-up divides the N-proportional part (the docs state it as throughput; MIN_II stays).
    vector_perf_mode: bool
    # Tensor engine transpose mode (NeuronCore-v3+; trainium2_arch.rst "Built-in Transpose Support", nki.isa
    # nc_matmul is_transpose): a bit-exact transpose whose PSUM output is bf16/fp16 for bf16/fp16 input ("This
    # allows faster PSUM data eviction back to SBUF"). In neuronc's ISA a matmul writing a 16-bit PSUM tile is one
    # (its moving operand the identity); its "2x speedup in FP32 transpose" is not modelled (fp32 transposes are
    # not marked in the ISA: they are priced as matmuls, the slower reading).
    tensor_transpose_mode: bool
    # Loading another activation function's table into the Scalar engine. The docs give no cost and do not say
    # which functions share a table: a stated choice of 1300 cycles (~1 us on trn2, the order of one DMA's fixed
    # cost: the table is fetched from memory), and one table per function, IDENTITY/NONE/NEG/ABS/copy-like
    # functions needing none (instruction_cost.activation_table). Tracked per Scalar engine in stream order.
    activation_table_load_cycles: int
    # Memory system (per NeuronCore): the chip's HBM (32 GiB at 0.82 TB/s, 96 GiB at 2.9 TB/s, 144 GiB at 4.9
    # TB/s; trn1/trn2/trn3 arch pages) divided by its NeuronCores.
    hbm_bytes: int
    hbm_gbps: float  # GB/s peak available to one NeuronCore (the roofline's bound)
    # Fraction of the peak HBM bandwidth sustained by streaming DMA traffic. A stated choice: the docs give no
    # figure; the NKI performance guide (nki/deep-dives/nki_perf_guide.rst) calls a sustained utilisation of
    # 60%+ good and tells kernel writers not to expect 100%. We take 0.9, the typical streaming efficiency of
    # HBM (refresh, bank and read/write turnaround losses), so the model never assumes the peak is sustained;
    # the 60% is a whole-kernel utilisation the model's idle gaps already produce on their own.
    hbm_sustained_fraction: float
    dma_queues: int  # DMA engines per NeuronCore: 16 (nki-dma-bandwidth-guide.rst)
    # Achievable rate of one DMA engine with >= 4 KiB contiguous per partition, bytes/ns (= GB/s):
    # nki/deep-dives/nki-dma-bandwidth-guide.rst, "BW / Engine": trn1 17, trn2 23, trn3 33 (aggregate 272 / 368 /
    # 528 GB/s per NeuronCore). nki-dma-overview's 27.2 (v2, v3) and 38.4 GB/s (v4) are theoretical, not used.
    dma_gbps_per_queue: float
    # Fixed cost of every DMA transfer: "descriptor setup, synchronization, and semaphore-to-start latency
    # (~1300 ns cross-engine)" (nki-dma-bandwidth-guide.rst). neuronc's programs have static shapes, so their
    # descriptors are precomputed in HBM before execution (NKI's dge_mode "none"): no DMA instruction generates
    # descriptors at run time, so neither the hardware DGE's ~600 ns per instruction (two DGE instances per
    # NeuronCore-v3, nki-dge.rst) nor GpSimd's software DGE is charged; indirect DMAs (gather/scatter), the only
    # case needing software descriptors on hardware, pay the same fixed cost (their rows are addressed by
    # precomputed index tiles). A queue moves one transfer's data at a time and prepares the next one meanwhile
    # (a stated choice, instruction_cost.start_latency_ns), so the latency shows after a wait and on small transfers.
    dma_fixed_ns: float
    # The payload curve (nki-dma-bandwidth-guide.rst): < 256 B per partition severely overhead-bound, 256 B - 2 KiB
    # improving, >= 2 KiB approaching peak, >= 4 KiB saturating (dma_efficient_bytes_per_partition). The docs give
    # no formula: we take a transfer of b bytes per partition at b / (b + dma_half_rate_bytes) of the rate,
    # normalised to 1 at 4 KiB (so 256 B runs at 53%, 64 B at 21%, 2 KiB at 94%).
    dma_half_rate_bytes: int
    dma_efficient_bytes_per_partition: int
    # DMA transpose (NeuronCore-v3+; TRAINIUM.md "Corrections and additions", from nki-dma-bandwidth-guide.rst and
    # nki.isa.dma_transpose): the DMA engines transpose a 2-D tile of a 2-byte type, "HBM -> SBUF up to 90% of DMA
    # throughput" and "SBUF -> SBUF up to 50%" with friendly patterns, the engines co-operating on [128, 16] SBUF
    # tiles (multiples of 128 partitions and 16 inner elements). The fractions are of a queue's rate (0: the target
    # has no DMA transpose). A DMA_TRANSPOSE is priced on its one queue (instruction_cost) as whole units of
    # [partitions, dma_transpose_inner] of its destination: one of fewer partitions takes as long as a full one (a
    # stated choice: the docs give no rate for other shapes, and that tile is the unit the engines work on).
    dma_transpose_hbm_fraction: float
    dma_transpose_sbuf_fraction: float
    dma_transpose_inner: int
    # Memory ports (TRAINIUM.md "Corrections and additions", from aws-neuron-sdk
    # nki/guides/architecture/trainium2_arch.rst): NeuronCore-v2 (trn1) "Vector and GpSimd cannot access SBUF in
    # parallel; Vector and Scalar cannot access PSUM in parallel"; NeuronCore-v3 lifts both, Vector and Scalar
    # reading PSUM in parallel "if they use different banks". neuronc.parallel_access turns these into ports.
    vector_gpsimd_exclusive_sbuf: bool
    vector_scalar_exclusive_psum: bool
    # Chip.
    cores_per_chip: int  # NeuronCores per chip: 2 / 8 / 8 (trn1-arch.rst, trainium2.rst, trainium3.rst)
    # One-off start-up cost of a NEFF's first execution: "about 1 ms of GpSimd start-up" (TRAINIUM.md's rules of
    # thumb; the docs give no exact figure: the 1 ms is taken as stated).
    neff_load_ns: float
    # Interconnect (neuronc.collective_cost): NeuronLink between the chips of a node, GB/s per chip. The docs give
    # one figure per chip and do not say whether it counts both directions; it is taken as the sum of both (a
    # chip sends at half of it), the more expensive reading.
    neuronlink_gbps: float
    # Latency of one step (hop) of a collective algorithm: "about 1-2 us (HBM load dependent)" for Ring/KangaRing
    # (aws-neuron-sdk neuron-runtime/explore/intranode-collective-comm.rst); the upper end is taken.
    collective_hop_ns: float
    # NeuronLink links of a chip (its neighbours on the 2D torus): a message between two chips crosses one.
    neuronlink_links: int

    @property
    def sbuf_bytes(self) -> int:
        return self.partitions * self.sbuf_bytes_per_partition

    @property
    def hbm_sustained_gbps(self) -> float:
        """The HBM bandwidth DMA traffic gets (GB/s): the peak times the sustained fraction."""
        return self.hbm_gbps * self.hbm_sustained_fraction

    @property
    def psum_bank_bytes(self) -> int:
        return self.psum_bytes_per_partition // self.psum_banks


_COMMON = dict(
    partitions=128,
    psum_bytes_per_partition=16 * KIB,
    psum_banks=8,
    matmul_max_k=128,
    matmul_max_m=128,
    matmul_max_n=512,
    max_free_elements_sbuf=64 * 1024,
    max_free_elements_psum=4 * 1024,
    matmul_min_interval_cycles=64,
    matmul_fp32_slowdown=4,
    elementwise_min_interval_cycles=64,
    bn_stats_max_free=512,
    bn_aggr_cycles_per_triple=13,
    dependent_spacing_cycles=200,
    loop_iteration_cycles=64,
    activation_table_load_cycles=1300,
    dma_efficient_bytes_per_partition=4 * KIB,
    dma_half_rate_bytes=256,
    dma_transpose_inner=16,
    dma_fixed_ns=1300.0,
    hbm_sustained_fraction=0.9,
    neff_load_ns=1_000_000.0,
    collective_hop_ns=2000.0,
)

TARGETS = {
    "trn1": Target(
        name="trn1",
        sbuf_bytes_per_partition=192 * KIB,
        tensor_ghz=2.8,
        vector_ghz=1.12,
        scalar_ghz=1.4,
        gpsimd_ghz=1.4,
        matmul_tflops_bf16=92.0,
        matmul_tflops_fp32=23.0,
        matmul_tflops_fp8=92.0,
        hbm_bytes=32 * GIB // 2,
        hbm_gbps=820.0 / 2,
        dma_queues=16,
        dma_gbps_per_queue=17.0,
        vector_gpsimd_exclusive_sbuf=True,
        vector_scalar_exclusive_psum=True,
        vector_perf_mode=False,
        tensor_transpose_mode=False,
        dma_transpose_hbm_fraction=0.0,  # NeuronCore-v2 has no DMA transpose (nki.isa.dma_transpose: trn2, trn3)
        dma_transpose_sbuf_fraction=0.0,
        cores_per_chip=2,
        # trn1.32xlarge: NeuronLink-v2, 384 GB/s per chip, 2D torus (TRAINIUM.md; about-neuron/arch/neuron-hardware/
        # trn1-arch.rst, the instance table's NeuronLink column)
        neuronlink_gbps=384.0,
        neuronlink_links=4,  # 2D torus (trn1-arch.rst): four neighbours
        **_COMMON,
    ),
    "trn2": Target(
        name="trn2",
        sbuf_bytes_per_partition=224 * KIB,
        tensor_ghz=2.4,
        vector_ghz=0.96,
        scalar_ghz=1.2,
        gpsimd_ghz=1.2,
        matmul_tflops_bf16=79.0,
        matmul_tflops_fp32=20.0,
        matmul_tflops_fp8=158.0,
        hbm_bytes=96 * GIB // 8,
        hbm_gbps=2900.0 / 8,
        dma_queues=16,
        dma_gbps_per_queue=23.0,
        vector_gpsimd_exclusive_sbuf=False,
        vector_scalar_exclusive_psum=False,
        vector_perf_mode=True,
        tensor_transpose_mode=True,
        dma_transpose_hbm_fraction=0.9,
        dma_transpose_sbuf_fraction=0.5,
        cores_per_chip=8,
        # NeuronLink-v3: 1.28 TB/s per chip (TRAINIUM.md; trainium2.rst), of which 1,024 GB/s within an instance
        # (trn2-arch.rst: "Intra-instance NeuronLink-v3 bandwidth (GB/sec/chip)", 4x4 2D torus; the other 256
        # GB/s link instances of an UltraServer). Collectives within a node have the 1,024.
        neuronlink_gbps=1024.0,
        neuronlink_links=4,  # "4 NeuronLink-v3 for device-to-device collective communication" (trainium2_arch.rst)
        **_COMMON,
    ),
    "trn3": Target(
        name="trn3",
        sbuf_bytes_per_partition=256 * KIB,
        tensor_ghz=2.4,
        vector_ghz=1.2,
        scalar_ghz=1.2,
        gpsimd_ghz=1.2,
        matmul_tflops_bf16=79.0,
        matmul_tflops_fp32=20.0,
        matmul_tflops_fp8=315.0,
        hbm_bytes=144 * GIB // 8,
        hbm_gbps=4900.0 / 8,
        dma_queues=16,
        dma_gbps_per_queue=33.0,
        vector_gpsimd_exclusive_sbuf=False,
        vector_scalar_exclusive_psum=False,
        vector_perf_mode=True,
        tensor_transpose_mode=True,
        dma_transpose_hbm_fraction=0.9,
        dma_transpose_sbuf_fraction=0.5,
        cores_per_chip=8,
        # NeuronLink-v4: 2.56 TB/s per chip (TRAINIUM.md; trainium3.rst), also quoted as 2,048 GiB/s per device
        # (trn3-arch.rst's UltraServer table): the lower, 2,048 GiB/s, is taken.
        neuronlink_gbps=2048 * GIB / 1e9,
        neuronlink_links=4,  # "four PCIe Gen6 x8 links" to the server's switch (trn3-arch.rst)
        **_COMMON,
    ),
}

DEFAULT_TARGET = "trn2"


def get_target(name: str | None = None) -> Target:
    name = name or DEFAULT_TARGET
    try:
        return TARGETS[name]
    except KeyError:
        raise NeuronConfigError(
            f"unknown target {name!r}", hint=f"choose one of: {', '.join(sorted(TARGETS))}"
        ) from None
