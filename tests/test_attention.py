"""Scaled dot-product attention compiles at -O2 to one flash-attention kernel (passes/attention.py): the
explicit form (masked_fill + softmax, as the zoo's transformer block writes it) and
F.scaled_dot_product_attention, causal or not, with or without a mask, for sequence lengths that are and
are not multiples of the 128-row tile, in fp32 and bf16, give eager PyTorch's numbers; the S x S scores
never reach HBM and the causal kernel skips the blocks above the diagonal."""
from __future__ import annotations

import itertools
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from neuronc import ir
from neuronc.neff import encode
from neuronc.compiler import CompileOptions, compile_fx, compile_graph
from neuronc.frontend.tensors import dtype_of
from neuronc.ir import Op
from neuronc.passes import attention as attention_pass
from neuronc.isa import ActFunc, DType, Engine, Opcode, Space
from neuronc.neff.program import TensorKind
from neuronc.targets import get_target
from runtime.metrics import matmul_flops
from tests import zoo
from tests.conftest import assert_matches_eager, compile_and_run, compile_module, zoo_graph
from tests.test_repeated_layers import traced


class MaskedFillAttention(nn.Module):
    """The zoo's form: explicit scores, a tril mask applied with masked_fill, softmax, @ v."""

    def __init__(self, causal=True):
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v):
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])
        if self.causal:
            mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
            scores = scores.masked_fill(~mask, float("-inf"))
        return torch.softmax(scores, -1) @ v


class Sdpa(nn.Module):
    def __init__(self, causal=False, scale=None):
        super().__init__()
        self.causal, self.scale = causal, scale

    def forward(self, q, k, v, mask=None):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=self.causal, scale=self.scale)


def _qkv(heads, seq, dim, dtype, batch=1):
    torch.manual_seed(0)
    return tuple((torch.randn(batch, heads, seq, dim) * 1.5).to(dtype) for _ in range(3))


def _assert_one_attention_kernel(compiled):
    assert [n.op for n in compiled.graph.nodes() if n.op not in (Op.PARAMETER, Op.RESHAPE)] == [Op.ATTENTION]
    assert len(compiled.neff.kernels) == 1
    assert not [t for t in compiled.neff.tensors if t.kind == TensorKind.SCRATCH]  # no scores, nothing, in HBM


DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])


@DTYPES
@pytest.mark.parametrize("heads,seq", [(1, 64), (3, 200), (2, 640)])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_masked_fill_attention_is_one_kernel_and_matches_eager(causal, heads, seq, dtype):
    model, inputs = MaskedFillAttention(causal), _qkv(heads, seq, 64, dtype)
    compiled, out = compile_and_run(model, inputs)
    _assert_one_attention_kernel(compiled)
    assert_matches_eager(out, model(*inputs))


@DTYPES
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_scaled_dot_product_attention_is_one_kernel_and_matches_eager(causal, dtype):
    model, inputs = Sdpa(causal), _qkv(2, 200, 32, dtype, batch=2)
    compiled, out = compile_and_run(model, inputs)
    _assert_one_attention_kernel(compiled)  # in bf16 too: eager computes in fp32, the kernel rounds its output
    (attention,) = [n for n in compiled.graph.nodes() if n.op is Op.ATTENTION]
    assert attention.attrs["mask"] == ("causal" if causal else "none") and attention.dtype == dtype_of(dtype)
    assert_matches_eager(out, model(*inputs))


def _opcodes(compiled) -> list:
    return [i.opcode for stream in compiled.neff.streams.values() for i in stream]


def test_each_key_block_makes_its_probabilities_in_one_scalar_instruction_and_their_row_sum_with_p_v():
    model, inputs = Sdpa(), _qkv(1, 640, 64, torch.float32)
    compiled, out = compile_and_run(model, inputs)
    instructions = [i for stream in compiled.neff.streams.values() for i in stream]
    exps = [i for i in instructions if i.opcode == Opcode.ACTIVATE_BIAS_REDUCE and i.srcs[0].free_elements > 1]
    assert len(exps) == 5 * 2  # 5 query tiles x 2 key blocks of 512
    assert Opcode.TENSOR_REDUCE in _opcodes(compiled)  # the row max still takes a Vector pass
    # P V's moving operand is [V | 1]: the accumulator's last column is the row sum
    products = [i for i in instructions if i.opcode == Opcode.MATMUL and i.operands[2].free_elements == 64 + 1]
    assert len(products) == 5 * 5  # 5 query tiles x 5 chunks of 128 keys
    assert_matches_eager(out, model(*inputs))


def test_a_bf16_kernel_makes_the_rounded_logits_in_one_pass_over_the_scores():
    """1/sqrt(64) is a power of two, so round(round(S) / 8) is round(S / 8): one pass over each key block of 1024
    (two PSUM banks) makes the logits (negated), either a Vector TENSOR_SCALAR_REDUCE making their row min, the
    exp's bias, in the same pass, or a Scalar ACTIVATE whose logits GpSimd then takes the row min of in SBUF."""
    model, inputs = MaskedFillAttention(), _qkv(1, 1280, 64, torch.bfloat16)
    compiled, out = compile_and_run(model, inputs)
    instructions = [i for stream in compiled.neff.streams.values() for i in stream]
    fused = [i for i in instructions if i.opcode == Opcode.TENSOR_SCALAR_REDUCE]
    made = [i for i in instructions if i.opcode == Opcode.ACTIVATE and i.srcs[0].space == Space.PSUM
            and i.srcs[0].dtype == DType.F32]
    mins_in_sbuf = [i for i in instructions if i.opcode == Opcode.TENSOR_REDUCE and i.engine == Engine.GPSIMD
                    and i.srcs[0].dtype == DType.BF16]
    assert len(fused) + len(made) == 8 * 1 + 2 * 2  # causal: the last 2 query tiles see > 1024 keys
    assert all(i.srcs[0].space == Space.PSUM for i in fused)
    assert len(mins_in_sbuf) == len(made)
    assert _opcodes(compiled).count(Opcode.TENSOR_REDUCE) == 2 + len(made)  # + the last two tiles' mins combined
    assert_matches_eager(out, model(*inputs))


def test_the_key_blocks_of_a_softmax_group_share_one_bias_so_the_accumulator_is_never_rescaled():
    """Up to SOFTMAX_BLOCKS key blocks make their logits before any meets exp: 1536 keys are one group, whose
    exps all take one bias; the online rescaling (an exp of the bias change, a multiply of the accumulator)
    is left for sequences longer than a group."""
    from neuronc.passes.attention import KEY_BLOCK, SOFTMAX_BLOCKS

    assert KEY_BLOCK < 1536 <= KEY_BLOCK * SOFTMAX_BLOCKS
    model, inputs = MaskedFillAttention(causal=False), _qkv(1, 1536, 64, torch.bfloat16)
    compiled, out = compile_and_run(model, inputs)
    instructions = [i for stream in compiled.neff.streams.values() for i in stream]
    exps = [i for i in instructions if i.opcode == Opcode.ACTIVATE_BIAS_REDUCE]
    assert sorted(i.srcs[0].free_elements for i in exps) == [1536 - KEY_BLOCK] * 12 + [KEY_BLOCK] * 12  # none [rows, 1]
    assert not [i for i in instructions if i.opcode == Opcode.TENSOR_TENSOR and i.alu.name == "MULTIPLY"]
    assert_matches_eager(out, model(*inputs))


def test_a_scale_above_one_is_applied_to_the_logits_in_sbuf_before_exp_and_matches_eager():
    model, inputs = Sdpa(causal=True, scale=2.0), _qkv(1, 200, 32, torch.float32)
    compiled, out = compile_and_run(model, inputs)
    assert sum(n.op is Op.ATTENTION for n in compiled.graph.nodes()) == 1
    instructions = [i for stream in compiled.neff.streams.values() for i in stream]
    # the logits are made negated in SBUF (-2 S), so the exp's bias is a row min of finite-or-+inf values
    assert any(i.opcode in (Opcode.ACTIVATE, Opcode.TENSOR_SCALAR, Opcode.TENSOR_SCALAR_REDUCE)
               and i.imm0 == pytest.approx(-2.0) for i in instructions)
    assert all(i.imm0 == -1.0 for i in instructions if i.opcode == Opcode.ACTIVATE_BIAS_REDUCE)
    assert_matches_eager(out, model(*inputs))


@DTYPES
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_an_attention_mask_given_as_input_is_read_by_blocks(kind, dtype):
    q, k, v = _qkv(2, 150, 64, dtype)
    torch.manual_seed(1)
    keep = torch.rand(150, 150) > 0.3
    keep[:, 0] = True  # no fully masked row: eager gives NaN there for some forms
    mask = keep if kind == "bool" else torch.where(keep, torch.randn(150, 150), -torch.inf).to(dtype)
    model = Sdpa()
    compiled, out = compile_and_run(model, (q, k, v, mask))
    assert sum(n.op is Op.ATTENTION for n in compiled.graph.nodes()) == 1
    # the mask's own preparation may use HBM; the scores of every head never do
    assert all(math.prod(t.shape) < 2 * 150 * 150 for t in compiled.neff.tensors if t.kind == TensorKind.SCRATCH)
    assert_matches_eager(out, model(q, k, v, mask))


def test_a_head_dim_above_128_accumulates_the_scores_over_two_tiles():
    model, inputs = MaskedFillAttention(), _qkv(2, 130, 160, torch.float32)
    compiled, out = compile_and_run(model, inputs)
    _assert_one_attention_kernel(compiled)
    assert_matches_eager(out, model(*inputs))


def test_a_bf16_head_of_128_dims_is_loaded_transposed_by_dma_on_trn2_and_matches_eager():
    model, inputs = Sdpa(causal=True), _qkv(4, 640, 128, torch.bfloat16)  # 640 keys
    compiled, out = compile_and_run(model, inputs)
    _assert_one_attention_kernel(compiled)
    # K^T and Q^T of every head, each in five chunks of 128 keys (an SBUF hazard cell of columns each, on queues of
    # their own): a head's matmuls take the Tensor engine 2.4 us, a page's transpose its queue 7.6 (cell_heads)
    transposes = _dma_transposes(compiled, Space.HBM)
    assert len(transposes) == 4 * 2 * 5 and {i.operands[0].shape for i in transposes} == {(128, 128)}
    assert_matches_eager(out, model(*inputs))


def test_p_transposes_are_copied_out_of_psum_by_the_engine_that_copies_them_fastest(monkeypatch):
    # bf16 scores rounded as eager rounds them (the masked_fill form): their fp32 copies out of PSUM are faster on Scalar,
    # P^T's 16-bit ones on Vector (performance mode), so P^T's go to Vector whenever it finishes them within
    # COPY_SLACK of the soonest engine (passes/attention.py copy_slack); the same bits either way (4 heads of 512: 16 of
    # 16 copies on Vector, against 11 of 16)
    model, inputs = MaskedFillAttention(), _qkv(4, 512, 128, torch.bfloat16)

    def pt_copies(program, engine):  # 16-bit copies PSUM -> SBUF: P^T's
        return sum(1 for i in program.neff.streams.get((engine, 0), ()) if i.srcs and i.srcs[0].space == Space.PSUM
                   and i.srcs[0].dtype == DType.BF16 and i.operands[0].dtype == DType.BF16)

    compiled, out = compile_and_run(model, inputs)
    [node] = [n for n in compiled.graph.nodes() if n.op is Op.ATTENTION]
    assert node.attrs["plan"].copy_slack == attention_pass.COPY_SLACK > 0
    monkeypatch.setattr(attention_pass, "COPY_SLACK", 0.0)
    soonest, out_soonest = compile_and_run(model, inputs)
    assert pt_copies(compiled, Engine.VECTOR) > pt_copies(soonest, Engine.VECTOR)
    assert pt_copies(compiled, Engine.SCALAR) < pt_copies(soonest, Engine.SCALAR)
    assert torch.equal(out.view(torch.int16), out_soonest.view(torch.int16))
    assert_matches_eager(out, model(*inputs))


def test_only_the_first_heads_k_and_q_go_by_hazard_cells_where_a_head_outlasts_a_pages_transpose():
    # seq 2048: a head's matmuls take the Tensor engine 21.8 us, a page's transpose 7.6: the first head's K^T and Q^T by
    # cells (the pipeline's fill waits for them), the others by pages; at seq 1024 (5.8 us) every head's by cells
    dtypes = dict.fromkeys(("q", "k", "v", "out", "p"), DType.BF16)
    trn2 = get_target("trn2")
    assert attention_pass.cell_heads(12, 2048, 2048, 128, 128, dtypes, True, 0, trn2) == 1
    assert attention_pass.cell_heads(12, 1024, 1024, 128, 128, dtypes, True, 0, trn2) == 12
    model, inputs = Sdpa(causal=True), _qkv(2, 2048, 128, torch.bfloat16)
    compiled = compile_module(model, inputs)
    widths = sorted(i.operands[0].shape[1] for i in _dma_transposes(compiled, Space.HBM))
    assert widths == [128] * 2 * 16 + [512] * 2 * 4


def test_the_first_heads_q_and_k_are_transposed_on_the_tensor_engine_when_their_rows_load_sooner(monkeypatch):
    # seq 512, head dim 128, K^T and Q^T by pages: a head's rows reach SBUF over 4 queues in 3.0 us, its DMA transpose
    # takes 7.6 us on one queue, and the pipeline waits for it (passes/attention.py rows_heads). By hazard cells
    # (cell_heads: 2.9 us on 4 queues) no head is made from rows
    dtypes = {"q": DType.BF16, "k": DType.BF16, "p": DType.BF16}
    assert attention_pass.rows_heads(512, 512, 128, dtypes, get_target("trn2"), cells=True) == 0
    monkeypatch.setattr(attention_pass, "cell_heads", lambda *args: 0)
    model, inputs = Sdpa(causal=True), _qkv(3, 512, 128, torch.bfloat16)
    compiled, out = compile_and_run(model, inputs)
    _assert_one_attention_kernel(compiled)
    assert _opcodes(compiled).count(Opcode.DMA_TRANSPOSE) == 2  # Q^T and K^T of the third head only
    assert_matches_eager(out, model(*inputs))
    monkeypatch.setattr(attention_pass, "ROWS_HEADS", 0)
    by_dma = compile_module(model, inputs)
    assert _opcodes(by_dma).count(Opcode.DMA_TRANSPOSE) == 2 * 3

    def transposes(program):  # matmuls writing 16-bit results to PSUM: P^T's, and the rows' when made there
        return sum(1 for i in program.neff.streams[(Engine.TENSOR, 0)]
                   if i.opcode == Opcode.MATMUL and i.operands[0].dtype == DType.BF16)

    assert transposes(compiled) - transposes(by_dma) == 2 * 2 * 4  # Q and K of 2 heads, by 4 chunks of 128 rows


def test_short_heads_are_made_from_rows_only_where_their_kernel_is_faster_so():
    # seq 128, 64 dims: rows_heads prices the fill alone and takes the first heads from rows, but their Tensor-engine
    # transposes and copies out of PSUM cost the kernel more (trn2: 17.2 against 15.3 us); -O2 times both kernels
    # (PassContext.choice_time) and keeps Q^T and K^T by strided loads
    model, inputs = Sdpa(causal=True), _qkv(12, 128, 64, torch.bfloat16)
    dtypes = {"q": DType.BF16, "k": DType.BF16, "p": DType.BF16}
    assert attention_pass.rows_heads(128, 128, 64, dtypes, get_target("trn2")) == attention_pass.ROWS_HEADS
    compiled, out = compile_and_run(model, inputs)
    [node] = [n for n in compiled.graph.nodes() if n.op is Op.ATTENTION]
    assert node.attrs["rows_heads"] == 0
    assert_matches_eager(out, model(*inputs))


def test_the_last_heads_outputs_go_to_the_queues_that_free_first_where_the_kernel_is_faster_so():
    # 12 heads of 512 queries, head dim 128: the last heads' output tiles stored by slices on the queues that free first
    # on the kernel's estimated clock (codegen freest_queue, STORE_CLOCK), not those with least work booked, which
    # include a queue still moving an earlier head's grouped store; -O2 times both kernels (PassContext.choice_time)
    model, inputs = MaskedFillAttention(), _qkv(12, 512, 128, torch.bfloat16)
    compiled = compile_module(model, inputs)
    [node] = [n for n in compiled.graph.nodes() if n.op is Op.ATTENTION]
    assert node.attrs["plan"].tail_heads > 0 and node.attrs["queues_by_clock"]
    assert not node.attrs["rows_heads"]  # K^T and Q^T by hazard cells load sooner than the rows (cell_heads)
    # and the exp's activation table is loaded at the kernel's start: an exp before any matmul (warm_exp)
    assert node.attrs["warm_exp"]
    scalar = compiled.neff.streams[(Engine.SCALAR, 0)]
    assert scalar[0].opcode == Opcode.ACTIVATE and scalar[0].func == ActFunc.EXP


def _rows_timed_gpt2(monkeypatch, memo: bool) -> tuple:
    """(NEFF bytes, kernels timed) of a 3-layer bf16 GPT-2 at seq 128 whose attentions rows_heads prices from rows,
    compiled at -O2 with node ids counted from 0 (they name the NEFF's tensors); `memo`: the pass's memo as it is,
    else a new one for every attention."""
    timed, choose = [], attention_pass._timed_choices

    def counting(node, time, memory):
        return choose(node, time and (lambda n: timed.append(n) or time(n)), memory if memo else {})

    monkeypatch.setattr(attention_pass, "_timed_choices", counting)
    monkeypatch.setattr(ir, "_ids", itertools.count())
    torch.manual_seed(0)
    model = zoo.GPT2(vocab=64, width=128, layers=3, heads=2, context=128).eval().to(torch.bfloat16)
    compiled = compile_fx(traced(model, torch.randint(0, 64, (1, 128))), CompileOptions(opt_level=2, name="g"))
    return encode(compiled.neff), len(timed)


def test_repeated_layers_time_their_attention_once_and_give_the_neff_timed_layer_by_layer(monkeypatch):
    once, timed = _rows_timed_gpt2(monkeypatch, memo=True)
    assert timed == 4  # one attention's kernel as planned, without rows heads, with P^T by DMA, with the exp's table
    # loaded at its start: for the three layers
    every, timed = _rows_timed_gpt2(monkeypatch, memo=False)
    assert timed == 4 * 3
    assert every == once  # a hit takes the ids the timing took


def _output_stores(compiled) -> int:
    return sum(1 for (engine, _), stream in compiled.neff.streams.items() if engine == Engine.DMA
               for i in stream if i.opcode == Opcode.DMA_COPY and i.operands[0].space == Space.HBM)


def test_only_heads_of_several_query_tiles_store_their_last_heads_tiles_in_slices():
    # seq 128: a head's output is one [128, 64] tile, stored in one transfer (split over four queues it only added
    # fixed costs the next kernel's loads wait behind); seq 512: the last TAIL_HEADS heads store each of their 4
    # tiles in slices over the least-booked queues, the others their 4 tiles at once (passes/attention.py tail_heads)
    model, inputs = Sdpa(causal=True), _qkv(6, 128, 64, torch.bfloat16)
    compiled, out = compile_and_run(model, inputs)
    assert _output_stores(compiled) == 6
    assert_matches_eager(out, model(*inputs))
    longer = compile_module(model, _qkv(6, 512, 64, torch.bfloat16))
    tail, pieces = attention_pass.TAIL_HEADS, 4  # trn2: 16 queues // 4
    assert _output_stores(longer) == (6 - tail) + tail * 4 * pieces


def test_a_2048_key_head_of_128_dims_is_not_transposed_on_the_tensor_engine():
    # its rows take as long to load as its first DMA transpose (4 KiB a partition): nothing to gain at the fill
    model, inputs = Sdpa(causal=True), _qkv(1, 2048, 128, torch.bfloat16)
    compiled = compile_module(model, inputs)
    # K^T and Q^T by 16 chunks of 128 keys each, a hazard cell of columns (the first head's: cell_heads) (P^T's, SBUF ->
    # SBUF, are the next tests')
    assert len(_dma_transposes(compiled, Space.HBM)) == 2 * 16
    # the first scores wait for K^T and Q^T, not V: on every queue the transposes come before any load of V (issued after
    # V's loads, Q^T's would queue behind them)
    queues = [stream for (engine, _), stream in compiled.neff.streams.items() if engine == Engine.DMA]
    for stream in queues:
        loads = [i for i in stream if i.operands[1].space == Space.HBM and i.operands[0].space != Space.HBM]
        kinds = [i.opcode == Opcode.DMA_TRANSPOSE for i in loads]
        assert kinds == sorted(kinds, reverse=True)
    assert sum(stream[0].opcode == Opcode.DMA_TRANSPOSE for stream in queues) == 16


def _dma_transposes(compiled, source: Space) -> list:
    """The DMA transposes from `source` (HBM: K^T and Q^T loaded; SBUF: chunks of P^T)."""
    return [i for (engine, _), stream in compiled.neff.streams.items() if engine == Engine.DMA for i in stream
            if i.opcode == Opcode.DMA_TRANSPOSE and i.operands[1].space == source]


def test_chunks_of_p_transposed_by_dma_give_the_tensor_engines_bits(monkeypatch):
    # one head of 2048 keys: the queues have room for about 58 chunks of P^T (passes/attention.py pt_by_dma), too few
    # for the pipeline's waits to pay back at one head; taken here anyway, for the bits: DMA transposes SBUF -> SBUF are
    # exact, as the Tensor engine's are, and each P V stays in its place
    monkeypatch.setattr(attention_pass, "PT_DMA_LEAST", 0)
    model, inputs = Sdpa(causal=True), _qkv(1, 2048, 128, torch.bfloat16)
    compiled, out = compile_and_run(model, inputs)
    _assert_one_attention_kernel(compiled)
    by_dma = _dma_transposes(compiled, Space.SBUF)
    assert by_dma and all(i.operands[0].shape == (128, 128) for i in by_dma)  # a chunk of 128 keys x 128 queries each
    assert len({i.queue for i in by_dma}) > 1
    assert_matches_eager(out, model(*inputs))
    monkeypatch.setattr(attention_pass, "PT_DMA_LEAST", math.inf)
    on_tensor, out_on_tensor = compile_and_run(model, inputs)
    assert not _dma_transposes(on_tensor, Space.SBUF)

    def p_transposes(program):  # matmuls writing 16-bit P^T to PSUM
        return sum(1 for i in program.neff.streams[(Engine.TENSOR, 0)]
                   if i.opcode == Opcode.MATMUL and i.operands[0].dtype == DType.BF16)

    assert p_transposes(on_tensor) - p_transposes(compiled) == len(by_dma)
    assert torch.equal(out.view(torch.int16), out_on_tensor.view(torch.int16))


def test_long_keys_go_by_512_key_blocks_four_to_a_softmax_group_with_the_bits_of_1024_key_blocks(monkeypatch):
    # a query tile meeting 2048 keys: 1024-key blocks take two PSUM banks of scores each, so only two are in flight and
    # the Tensor engine waits for a block's copies out of PSUM; 512-key blocks keep four in flight (passes/attention.py
    # split_blocks). The softmax group keeps its 2048 keys (one statistic a tile here, as with two 1024-key blocks) and
    # P^T's waits their time, so the bits are those of the 1024-key blocks. A bank of the scores goes to P^T
    model, inputs = MaskedFillAttention(), _qkv(1, 2048, 128, torch.bfloat16)
    compiled, out = compile_and_run(model, inputs)
    [node] = [n for n in compiled.graph.nodes() if n.op is Op.ATTENTION]
    plan = node.attrs["plan"]
    assert (plan.key_block, plan.softmax_blocks) == (512, 4)
    assert (plan.score_psum, plan.pt_psum) == (3, 3)  # a block's scores and its 16-bit P^T take a bank each
    assert (plan.pt_wait, plan.pv_wait, plan.pt_dma_chunks) == (2 * attention_pass.PT_WAIT, 2 * attention_pass.PV_WAIT,
                                                                 2)
    exps = [i for i in compiled.neff.streams[(Engine.SCALAR, 0)] if i.opcode == Opcode.ACTIVATE_BIAS_REDUCE
            and i.operands[0].dtype == DType.BF16 and i.srcs[0].free_elements > 1]
    assert exps and max(i.srcs[0].free_elements for i in exps) == 512
    assert_matches_eager(out, model(*inputs))
    monkeypatch.setattr(attention_pass, "SPLIT", 1)
    whole, out_whole = compile_and_run(model, inputs)
    [node] = [n for n in whole.graph.nodes() if n.op is Op.ATTENTION]
    assert (node.attrs["plan"].key_block, node.attrs["plan"].softmax_blocks) == (1024, 2)
    assert (node.attrs["plan"].score_psum, node.attrs["plan"].pt_psum) == (4, 2)  # two blocks of two banks each
    assert torch.equal(out.view(torch.int16), out_whole.view(torch.int16))


@pytest.mark.parametrize("seq, causal, split", [(2048, True, 2), (1024, True, 1), (1536, False, 1), (2048, False, 2)])
def test_key_blocks_are_split_only_where_a_query_tile_meets_at_least_2048_keys(seq, causal, split):
    # the Llama layer's attention (16 heads, seq 1024) lost with 512-key blocks in context (1938.1 -> 1939.9 us)
    assert attention_pass.split_blocks(seq, seq, causal, 0, True) == split
    assert attention_pass.split_blocks(seq, seq, causal, 0, False) == 1  # the exp reads PSUM: one-bank blocks already


@pytest.mark.parametrize("heads, seq, taken", [(12, 2048, True), (4, 2048, True), (2, 2048, False),
                                               (12, 1024, False), (12, 512, False)])
def test_p_is_transposed_by_dma_where_the_queues_have_room_for_enough_chunks(heads, seq, taken):
    # head dim 128, trn2: a head's matmuls take the Tensor engine 21.8 us at seq 2048 and its loads and stores the
    # queues 6.8 (room for 58 chunks a head); 5.8 and 3.6 us at 1024 (8 chunks); 1.6 and 2.0 at 512, where the queues
    # are the bound (passes/attention.py head_ns)
    dtypes = dict.fromkeys(("q", "k", "v", "out", "p"), DType.BF16)
    assert attention_pass.pt_by_dma(heads, seq, seq, 128, 128, dtypes, True, 0, get_target("trn2")) == taken
    assert not attention_pass.pt_by_dma(heads, seq, seq, 128, 128, dtypes, True, 0, get_target("trn1"))
    if seq == 512:
        model, inputs = Sdpa(causal=True), _qkv(2, 512, 128, torch.bfloat16)
        assert not _dma_transposes(compile_module(model, inputs), Space.SBUF)


def test_p_is_transposed_by_dma_where_the_kernels_time_says_so_though_the_chunks_count_too_few():
    # 12 heads of 1024 keys, head dim 128: pt_by_dma counts room for too few chunks (above), but the kernel is faster
    # with the pipeline's waits for them (trn2: 85.9 against 90.2 us; part 48 saw the gain come from the waits, the
    # queues taking no chunk here); -O2 times both (_timed_choices)
    model, inputs = MaskedFillAttention(), _qkv(12, 1024, 128, torch.bfloat16)
    compiled = compile_module(model, inputs)
    [node] = [n for n in compiled.graph.nodes() if n.op is Op.ATTENTION]
    assert node.attrs["pt_by_dma"] and node.attrs["plan"].depth == attention_pass.pipeline_depth(
        1024, 1024, True, 0, True, None, True)


def _matmul_flops(compiled):
    return sum(matmul_flops(i) for stream in compiled.neff.streams.values() for i in stream if i.opcode == Opcode.MATMUL)


def test_the_causal_kernel_skips_the_blocks_above_the_diagonal():
    inputs = _qkv(1, 2048, 64, torch.bfloat16)
    programs = {causal: compile_module(MaskedFillAttention(causal), inputs) for causal in (True, False)}
    assert _matmul_flops(programs[True]) < 0.7 * _matmul_flops(programs[False])
    assert programs[True].neff.estimated_ns < 0.7 * programs[False].neff.estimated_ns


def test_the_transformer_blocks_attention_is_one_kernel():
    compiled = compile_graph(zoo_graph("transformer_block"), CompileOptions(opt_level=2))
    attention = [n for n in compiled.graph.nodes() if n.op is Op.ATTENTION]
    assert len(attention) == 1 and attention[0].attrs["mask"] == "causal"
    assert not any(n.op is Op.MATMUL and n.shape[-1] == n.shape[-2] == 64 for n in compiled.graph.nodes())


def test_a_causal_mask_broadcast_over_many_heads_is_still_made_on_chip():
    """The mask's view over (heads, Sq, Sk) is larger than the masks evaluated at compile time; its source
    (one Sq x Sk pattern) is not, so it is still recognised as causal."""
    inputs = tuple(torch.zeros(1, 8, 1500, 8, dtype=torch.bfloat16) for _ in range(3))
    compiled = compile_module(MaskedFillAttention(), inputs)
    attention = [n for n in compiled.graph.nodes() if n.op is Op.ATTENTION]
    assert len(attention) == 1 and attention[0].attrs["mask"] == "causal"


def test_the_blocks_attention_reads_q_k_v_in_place_and_writes_its_output_in_place():
    """Inside a transformer block, q, k and v are head views of the qkv projection's bf16 output and the
    output is transposed back to [batch, seq, heads * dim] for the projection: the kernel reads the views
    and writes that layout itself, so the graph is the two projections and the attention, no copy."""
    from tests import zoo

    torch.manual_seed(0)
    model = zoo.CausalSelfAttention(128, 4).eval().to(torch.bfloat16)
    inputs = (torch.randn(2, 200, 128, dtype=torch.bfloat16),)
    compiled, out = compile_and_run(model, inputs)
    kernels = [n for n in compiled.graph.nodes() if n.op not in (Op.PARAMETER, Op.RESHAPE)]
    assert [n.op for n in kernels] == [Op.MATMUL, Op.ATTENTION, Op.MATMUL]
    qkv, attention, proj = kernels
    assert all(ir.unreshaped(x) is qkv for x in attention.inputs)
    assert qkv.dtype == attention.dtype == DType.BF16  # q, k, v read as eager rounds them, at the bf16 rate
    assert ir.unreshaped(proj.inputs[0]) is attention and attention.shape[-1] == 128  # [tokens, heads * dim]
    assert len(compiled.neff.kernels) == 3
    assert_matches_eager(out, model(*inputs))


def test_keys_beyond_one_softmax_group_rescale_the_accumulator_once_per_group_and_match_eager():
    """2200 keys are a softmax group (2048 keys) and a group of one block: the second group's bias moves the running
    max, and each query tile's accumulator is rescaled once, before that group's P V."""
    model, inputs = MaskedFillAttention(causal=False), _qkv(1, 2200, 64, torch.bfloat16)
    compiled, out = compile_and_run(model, inputs)
    instructions = [i for stream in compiled.neff.streams.values() for i in stream]
    rescales = [i for i in instructions if i.opcode == Opcode.TENSOR_ALU2 and i.alu.name == "MULTIPLY"]
    assert len(rescales) == -(-2200 // 128)
    assert_matches_eager(out, model(*inputs))
