"""Which graphs a pass can change: a graph without the nodes a pass starts from comes out of it as it went in,
so the pipeline (passes/pipeline.py) does not run the pass on it.

Why: an eager op's program is the graph of one op (pytorch/eager.py, frontend/aten_lowering.py), and of -O2's
twenty passes most find nothing to do in it (no sort, no gather, no convolution, no attention...), yet each walks
the graph, builds its consumers or rewrites it node by node: about 0.4 ms of CPU per new shape, ~8% of a new
op's first call (docs/performance.md, issue 20 part 9). A whole model's graph holds most of these ops and runs
every pass as before.

Each gate is read off its pass: every change the pass makes starts from a node of the listed ops (or dtype), so a
graph without one is returned unchanged — the same nodes, the same NEFF. A pass missing here always runs.
`tests/test_pass_gates.py` compiles graphs with the gates on and off and compares the NEFFs' bytes, and checks
that each gated pass leaves graphs without its ops unchanged.
"""
from __future__ import annotations

import functools

from neuronc import ir
from neuronc.ir import Op
from neuronc.isa import DType

ENABLED = True  # the tests switch them off to compare


def _ops(*ops: Op):
    wanted = frozenset(ops)
    return lambda summary: not wanted.isdisjoint(summary.ops)


@functools.cache
def _gates() -> dict:
    """Pass name -> predicate on a graph's Summary: whether the pass may change it."""
    from neuronc.passes import indexing

    return {
        # only float64 nodes are demoted; the refusal of float64 inputs/outputs needs one too
        "demote_f64": lambda summary: DType.F64 in summary.dtypes,
        # both act on TOPK nodes only (their readers are reached from them)
        "top_k_of_sorts": _ops(Op.TOPK),
        "split_wide_sorts": _ops(Op.TOPK),
        # its rewrite calls the rules of these ops only
        "lower_gather_scatter": _ops(*indexing._RULES),
        "lower_convolutions": _ops(Op.CONVOLUTION),
        "lower_flex_attention": _ops(Op.FLEX_ATTENTION),
        # a weight is stored transposed when every reader is a VIEW transposing it
        "store_weights_transposed": _ops(Op.VIEW),
        # matches start from a MATMUL (the scores' or the output's)
        "fuse_attention": _ops(Op.MATMUL),
        "fuse_matmul_operands": _ops(Op.MATMUL),
        # matmul plans only
        "pair_output_rows": _ops(Op.MATMUL),
        # fuse_epilogues(kind=MATMUL) folds groups reading a MATMUL; the converts folded are MATMULs' epilogues
        "fuse_matmul_epilogues": _ops(Op.MATMUL),
        # the same for CONV, then its channel producers and its tiling: CONV nodes only
        "fuse_conv_epilogues": _ops(Op.CONV),
        # groups are seeded at a REDUCE_LAST; prologues are folded into REDUCE_LAST nodes
        "fuse_rowwise": _ops(Op.REDUCE_LAST),
        "fuse_reduction_prologues": _ops(Op.REDUCE_LAST),
        # both rewrite REDUCE_LAST nodes only (a sum over tokens; a reduction read by a convert)
        "fold_partition_sum_prologues": _ops(Op.REDUCE_LAST),
        "round_reductions_once": _ops(Op.REDUCE_LAST),
        # it merges FUSED nodes only
        "merge_duplicate_kernels": _ops(Op.FUSED),
        # it rewrites elementwise bodies and matmul epilogues only
        "fold_activation_operands": _ops(Op.FUSED, Op.MATMUL),
        # it folds a reader of a REDUCE_LAST into it
        "fold_reduction_epilogues": _ops(Op.REDUCE_LAST),
        "fold_per_row_producers": _ops(Op.FUSED),
        "recompute_rows_in_readers": _ops(Op.FUSED),
        # it narrows MATMUL nodes' results (and rewrites their readers)
        "widen_matmul_results_on_read": _ops(Op.MATMUL),
        # it rewrites VIEW nodes only
        "compose_view_chains": _ops(Op.VIEW),
        # it rewrites CONCATENATE nodes reading VIEW chains
        "concatenate_through_views": _ops(Op.CONCATENATE),
        # it rewrites CUSTOM_KERNEL nodes reading VIEW chains
        "read_kernel_inputs_through_views": _ops(Op.CUSTOM_KERNEL),
        # it rewrites a CONCATENATE of a CUSTOM_KERNEL's outputs
        "write_outputs_into_concatenations": lambda summary: {Op.CONCATENATE, Op.CUSTOM_KERNEL} <= summary.ops,
        # a chain is a MATMUL read by a MATMUL
        "chain_matmuls": _ops(Op.MATMUL),
        # a sum over tokens (REDUCE_LAST) of a MATMUL's A becomes its second output
        "sum_operands_in_matmuls": lambda summary: Op.REDUCE_LAST in summary.ops and Op.MATMUL in summary.ops,
        # a sum over tokens (REDUCE_LAST) of a ROWWISE kernel's rows becomes its second output
        "sum_rows_in_rowwise_kernels": lambda summary: {Op.REDUCE_LAST, Op.ROWWISE} <= summary.ops,
        # a REDUCE_LAST read only by ROWWISE kernels becomes their steps
        "recompute_statistics_in_rowwise": lambda summary: {Op.REDUCE_LAST, Op.ROWWISE} <= summary.ops,
        # a prologue is a ROWWISE read by a MATMUL
        "fold_norms_into_matmuls": lambda summary: Op.ROWWISE in summary.ops and Op.MATMUL in summary.ops,
        "fold_saved_norms_into_matmuls": lambda summary: Op.ROWWISE in summary.ops and Op.MATMUL in summary.ops,
    }


class Summary:
    """The ops and dtypes of a graph's nodes (made once per graph the pipeline meets)."""

    def __init__(self, graph: ir.Graph):
        nodes = graph.nodes()
        self.ops = frozenset(n.op for n in nodes)
        self.dtypes = frozenset(n.dtype for n in nodes)


def may_change(name: str, summary: Summary) -> bool:
    """Whether the pass called `name` can change a graph of this summary (False only when its gate says so)."""
    if not ENABLED:
        return True
    gate = _gates().get(name)
    return gate is None or gate(summary)


def gated(name: str) -> bool:
    """Whether the pass called `name` has a gate."""
    return name in _gates()
