"""Does the emulator obey AWS's documented costs? Each documented figure (a rate, a measurement, a rule) next to
what the emulator reports for a microprogram built to show it, side by side, plus the costs the docs leave open
(stated choices in neuronc/targets.py) so they are visible too.

Every time below is the emulator's own timeline (runtime.NeuronCore.load(...).time(): the schedule the runtime
runs), not a formula re-typed here. Sources: TRAINIUM.md "Corrections and additions" and the citations in
neuronc/targets.py.

    python -m benchmarks.calibration [--target trn2]
"""
from __future__ import annotations

import argparse

from neuronc.errors import NeuronRuntimeError
from neuronc.isa import AccessPattern, ActFunc, AluOp, DType, Engine, Instruction, Opcode, Space, row_major_dims
from neuronc.neff.program import Neff, TensorEntry, TensorKind
from neuronc.targets import get_target
from runtime import NeuronCore


def _chip(shape: tuple, dtype=DType.F32, space=Space.SBUF, offset=0) -> AccessPattern:
    return AccessPattern(space, dtype, offset, ((1, shape[0]),) + row_major_dims(shape[1:]))


class _Micro:
    """A microprogram: HBM tensors and per-stream instruction lists, timed by the emulator."""

    def __init__(self, target: str):
        self.target, self.tensors, self.streams = target, [], {}

    def tensor(self, shape: tuple, dtype=DType.F32) -> TensorEntry:
        t = TensorEntry(f"t{len(self.tensors)}", TensorKind.INPUT, dtype, shape,
                        sum(t.nbytes for t in self.tensors), len(self.tensors), None)
        self.tensors.append(t)
        return t

    def emit(self, opcode, engine, *operands, queue=0, **fields) -> None:
        self.streams.setdefault((engine, queue), []).append(Instruction(opcode, engine, operands, queue=queue,
                                                                        **fields))

    def events(self) -> list:
        neff = Neff("calibration", self.target, self.tensors, self.streams, sum(t.nbytes for t in self.tensors))
        return NeuronCore(self.target, check_uninitialised=False).load(neff).time().events


def _load(target: str, bytes_per_partition: int, count: int = 1, queues: int = 1) -> list:
    """`count` loads per queue of `bytes_per_partition` on each of 128 partitions, fp32, each into its own tile."""
    m = _Micro(target)
    elements = bytes_per_partition // 4
    for q in range(queues):
        src = m.tensor((count * 128, elements))
        for n in range(count):
            rows = AccessPattern(Space.HBM, DType.F32, src.offset + n * 128 * bytes_per_partition,
                                 ((elements, 128), (1, elements)))
            m.emit(Opcode.DMA_COPY, Engine.DMA, _chip((128, elements), offset=(n % 4) * bytes_per_partition), rows,
                   queue=q)
    return m.events()


def _dma_transpose(target: str, space: Space, rows: int) -> str:
    """The rate of a lone bf16 DMA transpose into [128, rows] of SBUF, past its fixed cost, as a share of a queue's."""
    t, m = get_target(target), _Micro(target)
    x = m.tensor((rows, 128), DType.BF16)
    src = (AccessPattern(Space.HBM, DType.BF16, x.offset, ((128, rows), (1, 128))) if space == Space.HBM
           else _chip((rows, 128), DType.BF16, offset=rows * 2))
    m.emit(Opcode.DMA_TRANSPOSE, Engine.DMA, _chip((128, rows), DType.BF16), src)
    try:
        ns = _only(m.events()) - t.dma_fixed_ns
    except NeuronRuntimeError:
        return "refused at load"
    return f"{128 * rows * 2 / ns / t.dma_gbps_per_queue:.0%}"


def _spacing(events: list) -> float:
    """The mean ns between the starts of consecutive events of one stream."""
    starts = sorted(e.start_ns for e in events)
    return (starts[-1] - starts[0]) / (len(starts) - 1)


def _only(events: list) -> float:
    (e,) = events
    return e.end_ns - e.start_ns


def rows(name: str) -> list:
    """(what, documented, emulator) rows."""
    t = get_target(name)
    out = []

    big = _load(name, 8192, count=8)  # one queue, 8 transfers of 8 KiB per partition back to back
    rate = 8 * 128 * 8192 / (big[-1].end_ns - big[0].start_ns - t.dma_fixed_ns)
    out.append(("DMA rate of one engine, >= 4 KiB per partition (B/ns)", f"{t.dma_gbps_per_queue:g} (BW/Engine)",
                f"{rate:.1f}"))
    (one,) = _load(name, 4096)
    out.append(("DMA fixed cost of a transfer: setup, sync, semaphore-to-start (ns)", "~1300",
                f"{one.end_ns - one.start_ns - 128 * 4096 / t.dma_gbps_per_queue:.0f} (a lone 4 KiB/partition "
                f"transfer less its bytes at the rate)"))
    (tiny,) = _load(name, 4)
    out.append(("a lone transfer of 4 B per partition (ns)", "~1300 + overhead-bound bytes",
                f"{tiny.end_ns - tiny.start_ns:.0f} (payload curve at 4 B: 1.6% of the rate)"))
    for b, doc in ((64, "< 256 B: severely overhead-bound"), (256, "256 B - 2 KiB: improving"),
                   (2048, ">= 2 KiB: approaching peak"), (4096, ">= 4 KiB: saturating")):
        events = _load(name, b, count=8)
        achieved = 8 * 128 * b / (events[-1].end_ns - events[0].start_ns - t.dma_fixed_ns)
        out.append((f"DMA payload {b} B per partition: fraction of the engine rate", doc,
                    f"{achieved / t.dma_gbps_per_queue:.2f}"))
    all_queues = _load(name, 8192, count=4, queues=t.dma_queues)
    aggregate = t.dma_queues * 4 * 128 * 8192 / (max(e.end_ns for e in all_queues) - t.dma_fixed_ns)
    out.append(("all queues streaming from HBM (GB/s)",
                f"engines {t.dma_queues * t.dma_gbps_per_queue:g}; HBM {t.hbm_gbps:g} peak, sustained "
                f"{t.hbm_sustained_fraction:g} x peak (stated choice)", f"{aggregate:.0f}"))

    for n in (16, 64, 128, 512):
        m = _Micro(name)
        for _ in range(8):
            m.emit(Opcode.MATMUL, Engine.TENSOR, _chip((128, n), space=Space.PSUM), _chip((128, 128), DType.BF16),
                   _chip((128, n), DType.BF16, offset=4096))
        cycles = _spacing(m.events()) * t.tensor_ghz
        out.append((f"matmul interval, moving N={n} (Tensor cycles)", f"max(N, 64) = {max(n, 64)}", f"{cycles:.0f}"))

    for n in (1, 32, 512, 2048):
        m = _Micro(name)
        m.emit(Opcode.ACTIVATE, Engine.SCALAR, _chip((128, n)), _chip((128, n), offset=16384), func=ActFunc.IDENTITY,
               imm0=1.0)
        out.append((f"Scalar instruction, N={n} elements, one input (cycles)", f"max(MIN_II ~64, N) = {max(64, n)}",
                    f"{_only(m.events()) * t.scalar_ghz:.0f}"))
    m = _Micro(name)
    m.emit(Opcode.TENSOR_TENSOR, Engine.VECTOR, _chip((128, 512)), _chip((128, 512), offset=4096),
           _chip((128, 512), offset=8192), alu=AluOp.ADD)
    out.append(("Vector tensor_tensor fp32, N=512, two inputs (cycles)", "2N = 1024",
                f"{_only(m.events()) * t.vector_ghz:.0f}"))
    for n in (384, 16):
        m = _Micro(name)
        m.emit(Opcode.BN_STATS, Engine.VECTOR, _chip((128, 6)), _chip((128, n), DType.BF16, offset=4096))
        out.append((f"Vector bn_stats, N={n} elements (cycles)", f"max(MIN_II ~64, N) = {max(64, n)}",
                    f"{_only(m.events()) * t.vector_ghz:.0f}"))
    for triples in (4, 20):
        m = _Micro(name)
        m.emit(Opcode.BN_AGGR, Engine.VECTOR, _chip((128, 2)), _chip((128, 3 * triples), offset=4096))
        out.append((f"Vector bn_aggr, N={3 * triples} elements (cycles)",
                    f"max(MIN_II ~64, 13 N/3) = {max(64, 13 * triples)}", f"{_only(m.events()) * t.vector_ghz:.0f}"))
    m = _Micro(name)
    for n in range(6):
        m.emit(Opcode.ACTIVATE, Engine.SCALAR, _chip((128, 1), offset=4 * (n + 1)), _chip((128, 1), offset=4 * n),
               func=ActFunc.IDENTITY, imm0=1.0)
    out.append(("dependent 1-element activations, start to start (Scalar cycles)", "~264 (189 ns on NC-v2)",
                f"{_spacing(m.events()) * t.scalar_ghz:.0f}"))

    def copy(dtype, space=Space.SBUF):
        m = _Micro(name)
        m.emit(Opcode.TENSOR_COPY, Engine.VECTOR, _chip((128, 2048), dtype), _chip((128, 2048), dtype, space, offset=0))
        return _only(m.events())

    out.append(("Vector copy bf16 SBUF->SBUF speed-up over fp32", "4x" if t.vector_perf_mode else "1x (from trn2)",
                f"{copy(DType.F32) / copy(DType.BF16):.1f}x"))
    out.append(("Vector copy bf16 PSUM->SBUF speed-up over fp32", "2x" if t.vector_perf_mode else "1x (from trn2)",
                f"{copy(DType.F32) / copy(DType.BF16, Space.PSUM):.1f}x"))

    m = _Micro(name)
    for func in (ActFunc.EXP, ActFunc.EXP, ActFunc.TANH):
        m.emit(Opcode.ACTIVATE, Engine.SCALAR, _chip((128, 512)), _chip((128, 512), offset=4096), func=func, imm0=1.0)
    first, same, switch = (e.end_ns - e.start_ns for e in m.events())
    out.append(("activation table load on a function switch (Scalar cycles)",
                f"not documented; stated choice {t.activation_table_load_cycles}",
                f"{(switch - same) * t.scalar_ghz:.0f} (first use {(first - same) * t.scalar_ghz:.0f})"))
    out.append(("Tensor-engine transpose mode: 16-bit PSUM output (evicted at the 2x above)",
                "trn2+" if t.tensor_transpose_mode else "none (from trn2)",
                "modelled" if t.tensor_transpose_mode else "refused at load"))
    out.append(("Tensor-engine transpose mode: fp32 transposes 2x", "trn2+", "not modelled (priced as matmuls)"))
    for space, share, rows in ((Space.HBM, "90%", 2048), (Space.SBUF, "50%", 128)):
        out.append((f"DMA transpose {space.name}->SBUF, [128, 16]-unit tiles, of a queue's rate",
                    f"up to {share} (trn2+)", _dma_transpose(name, space, rows)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="trn2")
    args = parser.parse_args()
    table = rows(args.target)
    widths = [max(len(r[i]) for r in table) for i in range(3)]
    print(f"target {args.target}: documented figure vs the emulator's timeline")
    print(f"{'cost':<{widths[0]}}  {'documented':<{widths[1]}}  emulator")
    for what, doc, emulated in table:
        print(f"{what:<{widths[0]}}  {doc:<{widths[1]}}  {emulated}")


if __name__ == "__main__":
    main()
