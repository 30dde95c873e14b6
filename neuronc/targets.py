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
    # On-chip memory geometry (per NeuronCore).
    partitions: int
    sbuf_bytes_per_partition: int
    psum_bytes_per_partition: int
    psum_banks: int
    # Tile rules of the Tensor engine: stationary [K <= k, M <= m], moving [K <= k, N <= n].
    matmul_max_k: int
    matmul_max_m: int
    matmul_max_n: int
    # Free-axis size limits of Vector/Scalar instructions (elements per partition).
    max_free_elements_sbuf: int
    max_free_elements_psum: int
    # Clocks (GHz) of each engine.
    tensor_ghz: float
    vector_ghz: float
    scalar_ghz: float
    gpsimd_ghz: float
    # Peak dense matmul rate per NeuronCore, TFLOPS, by operand dtype family.
    matmul_tflops_bf16: float
    matmul_tflops_fp32: float
    matmul_tflops_fp8: float
    # Instruction cost rules of thumb (cycles of the engine's clock).
    matmul_min_interval_cycles: int  # initiation interval is max(N, this)
    matmul_fp32_slowdown: int  # fp32 operands run at 1/this of the bf16 rate
    elementwise_fixed_cycles: int  # fixed overhead of a Vector/Scalar/GpSimd instruction
    onchip_access_cycles: int  # extra cycles to reach SBUF/PSUM
    # Memory system (per NeuronCore).
    hbm_bytes: int
    hbm_gbps: float  # GB/s available to one NeuronCore
    dma_queues: int
    dma_gbps_per_queue: float
    dma_fixed_ns: float  # cost of issuing one DMA
    dma_efficient_bytes_per_partition: int
    # Chip.
    cores_per_chip: int
    neff_load_ns: float  # one-off start-up cost of a NEFF's first execution
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
    elementwise_fixed_cycles=100,
    onchip_access_cycles=60,
    dma_efficient_bytes_per_partition=4 * KIB,
    dma_fixed_ns=600.0,
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
        dma_gbps_per_queue=27.0 * GIB / 1e9,
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
        dma_gbps_per_queue=27.0 * GIB / 1e9,
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
        dma_gbps_per_queue=27.0 * GIB / 1e9,
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
