"""The numbers a profiler user looks for, from a NEFF and the timeline of one of its runs.

Estimated device time, per-engine busy fraction, HBM bytes moved and achieved bandwidth, model
FLOPs and estimated MFU, and the kernels by time. One dict, so `neuronc inspect --json`,
`neuronc profile`, benchmarks and the Python API report the same thing.

MFU is dtype-aware: each matmul's FLOPs are priced at the target's peak for its operand dtype,
so MFU = (time the matmuls would take at peak) / (estimated device time).
"""
from __future__ import annotations

from neuronc.isa import DType, Engine, Opcode
from neuronc.neff.program import Neff
from neuronc.targets import Target, get_target
from runtime.timeline import Timeline

_FP8 = (DType.F8E4M3, DType.F8E5M2)


def matmul_flops(instr) -> int:
    """2*K*M*N for result[M, N] += stationary[K, M].T @ moving[K, N]."""
    _, stationary, moving = instr.operands
    k, m = stationary.shape[0], stationary.free_elements
    return 2 * k * m * moving.free_elements


def peak_tflops(target: Target, dtype: DType) -> float:
    if dtype in _FP8:
        return target.matmul_tflops_fp8
    if dtype in (DType.BF16, DType.F16):
        return target.matmul_tflops_bf16
    return target.matmul_tflops_fp32


def _stream_name(stream) -> str:
    engine, queue = Engine(stream[0]), stream[1]
    return f"dma{queue}" if engine == Engine.DMA else engine.name.lower()


def summarize(neff: Neff, timeline: Timeline, target: Target | str | None = None) -> dict:
    target = target if isinstance(target, Target) else get_target(target or neff.target)
    time_ns = timeline.estimated_ns
    flops, ideal_ns = 0, 0.0
    for (engine, _), stream in neff.streams.items():
        if engine != Engine.TENSOR:
            continue
        for instr in stream:
            if instr.opcode == Opcode.MATMUL:
                n = matmul_flops(instr)
                flops += n
                ideal_ns += n / (peak_tflops(target, instr.operands[1].dtype) * 1e3)  # TFLOPS = 1e3 FLOP/ns
    kernel_ns: dict = {}
    kernel_count: dict = {}
    kernel_span: dict = {}  # kernel -> (first start, last end) on the timeline
    for event in timeline.events:
        kernel_ns[event.kernel] = kernel_ns.get(event.kernel, 0.0) + event.end_ns - event.start_ns
        kernel_count[event.kernel] = kernel_count.get(event.kernel, 0) + 1
        start, end = kernel_span.get(event.kernel, (event.start_ns, event.end_ns))
        kernel_span[event.kernel] = (min(start, event.start_ns), max(end, event.end_ns))
    kernels = []
    for index, ns in sorted(kernel_ns.items(), key=lambda item: -item[1]):
        info = neff.kernels[index] if 0 <= index < len(neff.kernels) else None
        loc = neff.debug_locs[info.debug] if info is not None and 0 <= info.debug < len(neff.debug_locs) else None
        kernels.append({
            "name": info.name if info else "(no kernel)",
            "ops": list(info.ops) if info else [],
            "source": str(loc) if loc else "",
            "busy_us": ns / 1e3,  # engine time: every engine's and DMA queue's instructions summed
            "span_us": (kernel_span[index][1] - kernel_span[index][0]) / 1e3,  # first start to last end
            "instructions": kernel_count[index],
        })
    seconds = time_ns * 1e-9
    return {
        "name": neff.name,
        "target": target.name,
        "estimated_time_us": time_ns / 1e3,
        "flops": flops,
        "tflops_achieved": flops / seconds / 1e12 if seconds else 0.0,
        "mfu": ideal_ns / time_ns if time_ns else 0.0,
        "hbm_bytes": timeline.hbm_bytes,
        "hbm_gbps_achieved": timeline.hbm_bytes / time_ns if time_ns else 0.0,  # bytes/ns == GB/s
        "hbm_bandwidth_utilisation": timeline.hbm_bytes / time_ns / target.hbm_gbps if time_ns else 0.0,
        "engines": {engine.name.lower(): fraction for engine, fraction in sorted(timeline.busy_fraction().items())},
        "streams_busy_us": {_stream_name(s): ns / 1e3 for s, ns in sorted(timeline.busy_ns().items())},
        "instructions": {engine.name.lower(): n for engine, n in sorted(neff.instruction_count().items())},
        "kernels": kernels,
    }
