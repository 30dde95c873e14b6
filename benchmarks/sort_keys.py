"""What exact sort keys cost on the emulated NeuronCore (issue 21): the cost model's estimate, side by side per key
dtype.

The TOPK kernel compares fp32. A bf16, fp16 or int16 key is sorted in one TOPK. An fp32 key (mapped to an int32
ordered as PyTorch orders floats: NaN largest, -0 equal to 0) and an int32 key past 2^24 need two 16-bit digit
passes. A TOPK of k < n/3 such keys takes 4 TOPKs of k. Printed: the estimated device time (`run_neff(...)
.timeline.estimated_ns`) of `torch.sort` and `torch.topk` as torch.compile lowers them (torch-mlir: a top-k is a
sort of the whole row, then a slice, which passes/top_k.py narrows to a TOPK of k; printed also without that pass),
and of one TOPK node of k as the eager device lowers top-k; then rows of 8000 values, wider than a tile
(passes/wide_sorts.py).

    .venv/bin/python -m benchmarks.sort_keys
"""
from __future__ import annotations

import os

os.environ.setdefault("NEURON_CC_FLAGS", "--no_cache")

import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

from neuronc import ir  # noqa: E402
from neuronc.compiler import CompileOptions, compile_exported, compile_graph  # noqa: E402
from neuronc.ir import Op  # noqa: E402
from neuronc.isa import DType  # noqa: E402
from neuronc.passes import indexing, pipeline  # noqa: E402
from neuronc.passes.top_k import top_k_of_sorts  # noqa: E402
from neuronc.placement import tile_free_elements  # noqa: E402
from neuronc.targets import get_target  # noqa: E402
from runtime import run_neff  # noqa: E402

ROWS, SORTED, SEARCHED, K = 128, 512, 1024, 8
WIDE = 8000  # an OpInfo sort sample's length: wider than a tile
KEYS = {"fp32": torch.float32, "bf16": torch.bfloat16, "int16": torch.int16}


def _array(x: torch.Tensor) -> np.ndarray:
    return x.float().numpy().astype(ml_dtypes.bfloat16) if x.dtype == torch.bfloat16 else x.numpy()


def _compiled_ms(fn, x: torch.Tensor) -> float:
    class Program(torch.nn.Module):
        def forward(self, t):
            return fn(t)

    compiled = compile_exported(torch.export.export(Program(), (x,)), CompileOptions.from_dict({}))
    return run_neff(compiled.neff, [_array(x)]).timeline.estimated_ns / 1e6


def _topk_node_ms(x: np.ndarray, dtype: DType) -> float:
    p = ir.node(Op.PARAMETER, [], x.shape, dtype, index=0, name="x", kind="input")
    top = ir.node(Op.TOPK, [p], (x.shape[0], K), DType.I32, dimension=1, k=K, descending=True)
    return run_neff(compile_graph(ir.Graph([p], [top]), CompileOptions()).neff, [x]).timeline.estimated_ns / 1e6


def main() -> None:
    rng = torch.Generator().manual_seed(0)
    print(f"{'key':6} {'sort [128, 512]':>16} {'topk 8 [128, 1024]':>20} {'TOPK node k=8':>14}  (estimated ms)")
    for name, dtype in KEYS.items():
        sorted_x = (torch.randn(ROWS, SORTED, generator=rng) * 1000).to(dtype)
        searched = (torch.randn(ROWS, SEARCHED, generator=rng) * 1000).to(dtype)
        sort_ms = _compiled_ms(lambda t: torch.sort(t, dim=1, stable=True), sorted_x)
        topk_ms = _compiled_ms(lambda t: torch.topk(t, K, dim=1), searched)
        node_ms = _topk_node_ms(_array(searched), DType.from_numpy(_array(searched).dtype))
        print(f"{name:6} {sort_ms:16.2f} {topk_ms:20.2f} {node_ms:14.3f}")
    whole = indexing._few
    indexing._few = lambda *args: False  # the same fp32 TOPK node by a whole-row digit pass, for comparison
    try:
        x = (torch.randn(ROWS, SEARCHED, generator=rng) * 1000).numpy()
        print(f"fp32 TOPK node k=8 by a whole-row digit pass: {_topk_node_ms(x, DType.F32):.3f} ms")
    finally:
        indexing._few = whole
    levels = dict(pipeline.PIPELINES)
    for level, passes in levels.items():  # torch.compile's top-k as the whole-row sort and slice it arrives as
        pipeline.PIPELINES[level] = [p for p in passes if p is not top_k_of_sorts]
    try:
        for name, dtype in KEYS.items():
            searched = (torch.randn(ROWS, SEARCHED, generator=rng) * 1000).to(dtype)
            whole_ms = _compiled_ms(lambda t: torch.topk(t, K, dim=1), searched)
            print(f"{name} topk 8 [128, 1024] without passes/top_k.py (a whole-row sort, then a slice): {whole_ms:.2f} ms")
    finally:
        pipeline.PIPELINES.update(levels)
    wide_rows(rng)


def wide_rows(rng: torch.Generator) -> None:
    """Rows wider than the TOPK kernel's tile (passes/wide_sorts.py): a sort by counting, a top-k by chunks and a
    merge; beside them a sort of one row that fits a tile (TOPK's digit passes), for scale."""
    width = tile_free_elements(get_target())
    print(f"rows wider than a tile ({width} values):")
    for name, dtype in KEYS.items():
        x = (torch.randn(1, WIDE, generator=rng) * 1000).to(dtype)
        sort_ms = _compiled_ms(lambda t: torch.sort(t, dim=1, stable=True), x)
        top = (torch.randn(ROWS, WIDE, generator=rng) * 1000).to(dtype)
        topk_ms = _compiled_ms(lambda t: torch.topk(t, K, dim=1), top)
        print(f"{name:6} sort [1, {WIDE}] {sort_ms:.2f} ms   topk {K} [{ROWS}, {WIDE}] {topk_ms:.2f} ms")
    x = torch.randn(1, width - 84, generator=rng)
    one_tile_ms = _compiled_ms(lambda t: torch.sort(t, dim=1, stable=True), x)
    print(f"fp32   sort [1, {width - 84}] within one tile (TOPK): {one_tile_ms:.2f} ms")


if __name__ == "__main__":
    main()
