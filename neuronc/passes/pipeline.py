"""The pass pipeline of each optimisation level, readable top to bottom.

Every pass is a function `(graph, ctx) -> graph` (ctx: passes/context.py's PassContext: the target, the options).
-O0/-O1 keep one kernel per op (the baseline). -O2/-O3 compute attention as one flash-attention kernel (softmax(Q
K^T) V, the scores never in HBM) and row-wise normalisations as one kernel each, fuse elementwise groups, read
matmul operands through their views, compute elementwise consumers of a matmul as its epilogue and chain
matmuls; convolutions become implicit-GEMM kernels with their epilogue (-O0/-O1: im2col + matmul); the layout
passes store weights and activations that matmuls read only transposed transposed. The tiling pass last chooses
each matmul's tiles and loop order with the cost model (-O3 searching more candidates; -O0/-O1 stream both
operands tile by tile). Every level gives the same numbers as eager PyTorch.
"""
from __future__ import annotations

import time

from neuronc import ir, ir_verifier
from neuronc.errors import NeuronConfigError
from neuronc.passes.activation_operands import fold_activation_operands
from neuronc.passes.attention import fuse_attention, lower_flex_attention
from neuronc.passes.auto_cast import auto_cast
from neuronc.passes.canonicalize import canonicalize, demote_f64, simplify
from neuronc.passes import gates
from neuronc.passes.context import PassContext
from neuronc.passes.conv import fuse_conv_epilogues, lower_convolutions
from neuronc.passes.duplicate_kernels import merge_duplicate_kernels
from neuronc.passes.fusion import (fuse_elementwise, fuse_matmul_epilogues, fuse_matmul_operands,
                                   fuse_reduction_prologues)
from neuronc.passes.indexing import lower_gather_scatter
from neuronc.passes.concatenation_in_place import write_outputs_into_concatenations
from neuronc.passes.kernel_views import read_kernel_inputs_through_views
from neuronc.passes.layout import store_activations_transposed, store_weights_transposed
from neuronc.passes.legalize import legalize
from neuronc.passes.matmul_chain import chain_matmuls
from neuronc.passes.matmul_column_sums import sum_operands_in_matmuls
from neuronc.passes.row_pairs import pair_output_rows
from neuronc.passes.norm_prologue import fold_norms_into_matmuls, fold_saved_norms_into_matmuls
from neuronc.passes.per_row_producers import fold_per_row_producers
from neuronc.passes.partition_sum_prologues import fold_partition_sum_prologues
from neuronc.passes.recomputed_rows import recompute_rows_in_readers
from neuronc.passes.reduction_epilogues import fold_reduction_epilogues
from neuronc.passes.reduction_rounding import round_reductions_once
from neuronc.passes.rowwise import fuse_rowwise
from neuronc.passes.rowwise_column_sums import sum_rows_in_rowwise_kernels
from neuronc.passes.rowwise_statistics import recompute_statistics_in_rowwise
from neuronc.passes.shared_epilogues import fuse_shared_epilogues
from neuronc.passes.tiling import baseline_tiles, search_matmul_tiles, tile_matmuls
from neuronc.passes.top_k import top_k_of_sorts
from neuronc.passes.view_chains import compose_view_chains, concatenate_through_views
from neuronc.passes.wide_sorts import split_wide_sorts
from neuronc.passes.widening_reads import widen_matmul_results_on_read, widen_on_read

O0 = [
    demote_f64,  # first: no pass below computes in float64; a float64 input or output is refused here
    top_k_of_sorts,  # a sort read only in its first k positions (torch-mlir's top-k) as a TOPK of k
    split_wide_sorts,  # a TOPK of rows wider than a tile: chunks and a merge (top-k of few), or a counting sort
    lower_gather_scatter,  # gathers/scatters as row gathers: their index arithmetic is folded with the rest
    canonicalize,  # rules to a fixed point: constants folded, no-ops dropped, erf and GELU raised, matmuls narrowed
    auto_cast,  # --auto-cast: after canonicalisation (no float64 left), before legalize (sees DOT_GENERAL)
    legalize,  # StableHLO-level ops -> the kernel forms codegen knows (VIEW, MATMUL, REDUCE_LAST...), simplified
    lower_flex_attention,  # FlexAttention's forward: the flash-attention kernel at every level (nothing else lowers it)
    baseline_tiles,  # last: every matmul streams both operands tile by tile
]
O1 = O0  # the same passes today

O2 = [
    demote_f64,  # as -O0: first, nothing below computes in float64
    top_k_of_sorts,  # as -O0: before lower_gather_scatter lowers the TOPK
    split_wide_sorts,  # as -O0: after top_k_of_sorts (it needs the k a sort is read to), before lower_gather_scatter
    lower_gather_scatter,  # as -O0: index arithmetic folded by canonicalize
    canonicalize,  # as -O0: the canonical forms every pattern below matches
    auto_cast,  # before the convolutions are lowered: it casts CONVOLUTION's operands
    lower_convolutions,  # before legalize: convolutions the implicit-GEMM kernel takes become CONV, the rest im2col
    legalize,  # as -O0: the kernel forms the fusion passes group
    lower_flex_attention,  # as -O0: FLEX_ATTENTION becomes the flash-attention kernel
    store_weights_transposed,  # before fusion: matmuls then read the stored transpose as a dense operand
    fuse_attention,  # before row-wise fusion: the softmax of an attention belongs to its flash kernel
    fuse_rowwise,  # softmax, layer-norm...: one kernel per normalisation, before elementwise fusion takes its ops
    fuse_matmul_operands,  # matmuls read transposed, sliced or broadcast operands through their views
    fuse_elementwise,  # the remaining elementwise groups, one kernel each
    merge_duplicate_kernels,  # after fusion: an elementwise kernel made twice from the same inputs is made once
    fuse_matmul_epilogues,  # elementwise groups reading a matmul become its epilogue (computed from PSUM)
    fuse_conv_epilogues,  # and a convolution's (bias, BatchNorm, activation, residual)
    fuse_reduction_prologues,  # reductions read their operand through its producer group or view
    fold_partition_sum_prologues,  # a sum over tokens computes the elementwise group it sums (dy * x_hat)
    round_reductions_once,  # an fp32 reduction read only by a narrowing convert writes the narrower dtype
    widen_on_read,  # a widening convert read only by kernels that can widen on load is no kernel of its own
    fold_activation_operands,  # after fusion: an activation step reads its operand's scale and width, rounds once
    fold_reduction_epilogues,  # after fusion: a per-row kernel reading only a row reduction is its epilogue
    fold_per_row_producers,  # after the epilogues: a per-row kernel read only through broadcasts is its readers'
    recompute_rows_in_readers,  # after that: x-hat read by a row-wise kernel and a sum over tokens computed by each
    widen_matmul_results_on_read,  # after the readers' bodies are final: a matmul stores bf16 they widen on load
    compose_view_chains,  # after fusion (the views left are copies): a view of a reshaped view reads its source
    concatenate_through_views,  # after compose_view_chains: a concatenate reads view chains only it reads
    read_kernel_inputs_through_views,  # after compose_view_chains: so does a custom kernel, where its accesses map
    write_outputs_into_concatenations,  # after both: a custom kernel writes the concatenation of its outputs itself
    simplify,  # the reshape chains the fusions leave (a fused kernel's reshaped result read by a reshape)
    fuse_shared_epilogues,  # after that: a matmul read by an elementwise kernel and others takes it, stores both
    chain_matmuls,  # after the epilogues are known: a matmul read only by another as A is kept in SBUF
    fold_norms_into_matmuls,  # after the chains: a norm read only by a matmul as A is that matmul's prologue
    fold_saved_norms_into_matmuls,  # PRICED: a norm others read too is a matmul's prologue and its second output
    tile_matmuls,  # tiles and loop order of every matmul (and chain) chosen with the cost model
    sum_operands_in_matmuls,  # after the tiling (A resident): a sum over tokens of a matmul's A is its second output
    sum_rows_in_rowwise_kernels,  # after that: a sum over tokens of a row-wise kernel's rows is its second output
    recompute_statistics_in_rowwise,  # after that: a row reduction read only by row-wise kernels is computed by them
    pair_output_rows,  # last (the plans final): a matmul whose stores are its main traffic stores its tiles in row pairs
]
O3 = O2[:O2.index(chain_matmuls)] + [  # as -O2, plus the decisions that cost compile time:
    store_activations_transposed,  # after fusion, PRICED: emits the program with and without it (every transformer
    # has a layer-norm feeding a matmul: codegen twice); on the documented costs it lost on every shape measured
    chain_matmuls,
    fold_norms_into_matmuls,
    fold_saved_norms_into_matmuls,
    search_matmul_tiles,  # the tiling search trying more candidates
    sum_operands_in_matmuls,
    sum_rows_in_rowwise_kernels,
    recompute_statistics_in_rowwise,
    pair_output_rows,
]

PIPELINES = {0: O0, 1: O1, 2: O2, 3: O3}


def passes_for(opt_level: int) -> list:
    """The passes of an optimisation level, in order."""
    if opt_level not in PIPELINES:
        raise NeuronConfigError(f"unknown optimisation level {opt_level}", hint="use -O0, -O1, -O2 or -O3")
    return PIPELINES[opt_level]


# Passes whose rewrite is a trade the compiler prices (with `ctx.price`) instead of always taking: the rest of the
# pipeline runs on the graph with the rewrite and on the graph without it, and the one the cost model times faster
# is kept (ctx.decisions records both prices). Storing a row-wise result transposed moves a strided transfer from a
# matmul's operand loads into the producer's stores; which side pays less depends on the shapes and queues.
# Folding a norm others read too into a matmul (its result the kernel's second output) saves the norm's kernel and
# the matmul's load of its transpose, but puts the norm's work and its transposes in the matmul's kernel and takes
# the norm from the column sums a row-wise kernel makes for its readers (GPT-2 block training: the forward gains,
# the backward loses).
PRICED = (store_activations_transposed, fold_saved_norms_into_matmuls)


def run_pipeline(graph: ir.Graph, ctx: PassContext, timings: dict | None = None) -> ir.Graph:
    """Run the passes of `ctx.opt_level` in order; with `timings`, record each pass's seconds in it as
    "pass/<name>" ("pass/<name>#2" for its second run, ...). With `ctx.verify`, the graph is verified before the
    first pass and after each one (ir_verifier: a pass that breaks the IR is named), the time under "verify IR".
    A PRICED pass that changes the graph is kept only if `ctx.price` times the finished graph faster with it."""
    verify(graph, ctx, "the import", timings)
    return _run(graph, passes_for(ctx.opt_level), ctx, timings)


def _run(graph: ir.Graph, passes: list, ctx: PassContext, timings: dict | None) -> ir.Graph:
    summary = None  # (the graph, its gates.Summary) the gates last looked at: a skipped pass keeps the graph
    for n, step in enumerate(passes):
        start = time.perf_counter()
        if gates.gated(step.__name__):  # a pass that cannot change this graph is not run (passes/gates.py)
            if summary is None or summary[0] is not graph:
                summary = (graph, gates.Summary(graph))
            if not gates.may_change(step.__name__, summary[1]):
                _record(step, start, graph, ctx, timings)
                continue
        before, graph = graph, step(graph, ctx)
        if step in PRICED and ctx.price is not None and graph is not before:
            _record(step, start, graph, ctx, timings)
            taken, skipped = (_run(g, passes[n + 1:], ctx, timings) for g in (graph, before))
            prices = ctx.price(taken), ctx.price(skipped)
            ctx.decisions[step.__name__] = prices
            return taken if prices[0] < prices[1] else skipped
        _record(step, start, graph, ctx, timings)
    return graph


def _record(step, start: float, graph: ir.Graph, ctx: PassContext, timings: dict | None) -> None:
    if timings is not None:
        key, run = f"pass/{step.__name__}", 1
        while key in timings:
            run += 1
            key = f"pass/{step.__name__}#{run}"
        timings[key] = time.perf_counter() - start
    verify(graph, ctx, step.__name__, timings)


def verify(graph: ir.Graph, ctx: PassContext, after: str, timings: dict | None) -> None:
    if ctx.verify:
        start = time.perf_counter()
        ir_verifier.verify(graph, after)
        if timings is not None:
            timings["verify IR"] = timings.get("verify IR", 0.0) + time.perf_counter() - start
