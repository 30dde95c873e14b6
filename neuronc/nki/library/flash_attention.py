"""Flash attention, forward and backward, for q, k, v [heads, seq, d] (d <= 128, seq a multiple of 128), causal or
not: out = softmax(scale q k^T [masked]) v, and the gradients of q, k, v.

Forward (FlashAttention-2's loop order): per head, K^T [d, seq] and V (by chunks of 128 keys) stay in SBUF; per tile
of 128 queries, the keys in blocks of 512 (one PSUM bank of fp32 scores): S = Q K^T on the Tensor engine, the causal
mask added to the diagonal block by a matmul with a resident bias tile (blocks above the diagonal are never
visited), the running row max m (kept negated: the exp's bias), P = exp(scale S - m) with its row sum in one Scalar
pass, P transposed on the Tensor engine so keys lie on partitions, P V accumulated in PSUM and folded into the
output accumulator rescaled by exp(m_old - m_new). The output is acc / l; the log-sum-exp, m + log l, is the backward's.
A head's query tiles are software-pipelined, two stages a key block (the scores to the exp; the transposes to P V).

Backward (FlashAttention-2): per head, with D_i = rowsum(dO_i * O_i); per tile of 128 keys j (dK_j, dV_j accumulate in
PSUM) and tile of queries i (i >= j when causal): P = exp(scale S - lse), dV_j += P^T dO_i, dP = dO_i V_j^T,
dS = P * (dP - D_i), dK_j += dS^T Q_i, dQ_i += dS K_j (dS transposed on the Tensor engine; dQ summed in PSUM where a
head's fits one bank, else in SBUF); dQ and dK are scaled at the end. A head's rows move in one DMA each, its
transposes by strided DMAs at d <= 64, else on the Tensor engine; the key tiles are software-pipelined in three
stages. Matmul operands are in q's dtype (bf16 runs the Tensor engine at its full rate), statistics in fp32.

FlexAttention (both kernels): ``score_mod`` (the steps of a score_mod, see score_steps.py) is applied to each block
of scaled logits in fp32, and the backward multiplies dS by its derivative; ``mask`` is a [seq, seq] keep-mask in
HBM (the same for every head; or [batch or 1, heads or 1, seq, seq], a run-time mask reading the head or batch
index), read block by block for the blocks ``blocks`` marks partly kept; ``blocks`` (a
[tiles][tiles] table of HIDDEN / PARTLY / KEPT per 128 x 128 block) skips the hidden ones entirely (no matmul, no
DMA) and reads no mask for the kept ones. A row whose every key is masked gives 0 and a log-sum-exp of -inf, as
flex_attention does.

Run-time terms (``terms``: fp32 HBM tensors the graph computed from tensors a score_mod reads, such as a learned
bias table's entries or per-head slopes) are the score_mod's ("term", i) operands: each [batch or 1, heads or 1, seq,
seq] (read block by block, as the mask) or [.., seq, 1] (a value per query row, read as a column), or, where
``diagonals`` gives it a number c, a table [heads, length] read at [h, q - kv + c] (no grid in HBM). The backward
writes, for each term in ``term_grads``, dY * dy/dterm (dY the gradient of the score_mod's result): [groups, seq,
seq] for a [.., seq, seq] term, its row sums [groups, seq] for a column; the graph applies the rest of the chain rule
(a learned table's scatter-add).
"""
from __future__ import annotations

import math

import neuronc.nki as nki
import neuronc.nki.isa as nisa
import neuronc.nki.language as nl
from neuronc.nki.library.score_steps import Block

P = 128  # queries (and keys) per tile: one per partition
KEY_BLOCK = 512  # keys per block of the forward: one PSUM bank of fp32 scores
MASKED = -3.0e38  # added to masked scores (a finite -inf: exp(scale * it) is 0)
HIDDEN, PARTLY, KEPT = 0, 1, 2  # a block of the mask: every key masked, some, none


def _causal_bias(dtype):
    """A [128, 128] tile adding MASKED where key column j lies after query row p (j > p), 0 elsewhere."""
    bias = nl.ndarray((P, P), dtype=dtype, buffer=nl.sbuf)
    ramp = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.sbuf)
    nisa.iota(dst=ramp, pattern=[[1, P]], offset=0, channel_multiplier=-1)  # j - p
    nisa.tensor_scalar(dst=bias, data=ramp, op0=nl.greater, operand0=0.0, op1=nl.multiply, operand1=MASKED)
    return bias


def _load_transposed(dst, src):
    """dst [d, rows] = src [rows, d]^T: a DMA reading the HBM rows by columns."""
    nisa.dma_copy(dst=dst, src=src.permute((1, 0)))


def _block_plan(tiles: int, causal: bool, mask, blocks) -> tuple:
    """[query tile][key tile] -> HIDDEN / PARTLY / KEPT."""
    if blocks is not None:
        return blocks
    if mask is not None:  # a run-time mask: every block read
        return tuple((PARTLY,) * tiles for _ in range(tiles))
    if causal:
        return tuple(tuple(KEPT if j < i else PARTLY if j == i else HIDDEN for j in range(tiles))
                     for i in range(tiles))
    return tuple((KEPT,) * tiles for _ in range(tiles))


def _key_chunks(row: tuple) -> list:
    """The visited key tiles of one query tile as runs of consecutive tiles of at most KEY_BLOCK keys:
    [(first tile, count, whether any is PARTLY)]."""
    chunks = []
    for j, state in enumerate(row):
        if state == HIDDEN:
            continue
        if chunks and chunks[-1][0] + chunks[-1][1] == j and chunks[-1][1] < KEY_BLOCK // P:
            first, count, partly = chunks[-1]
            chunks[-1] = (first, count + 1, partly or state == PARTLY)
        else:
            chunks.append((j, 1, state == PARTLY))
    return chunks


def is_column_term(term) -> bool:
    """A term with one value per query row ([.., seq, 1]), not one per (query, key)."""
    return len(term.shape) == 4 and term.shape[3] == 1


def _term_blocks(terms, rows, k0, keys, b, h, diagonals=()) -> tuple:
    """Each run-time term's values for one block: an fp32 [P, keys] tile, or a [P, 1] column. A term whose
    ``diagonals`` entry is a number c is a table [heads, length] read at [h, q - kv + c] (a relative-position bias):
    one DMA per block, each query row a run of the table read backwards."""
    blocks = []
    for n, term in enumerate(terms):
        c = diagonals[n] if n < len(diagonals) else None
        if c is not None:
            t = nl.ndarray((P, keys), dtype=nl.float32, buffer=nl.sbuf)
            start = h * term.shape[1] + rows.start - k0 + c
            nisa.dma_copy(dst=t, src=term.ap([[1, P], [-1, keys]], offset=start))
            blocks.append(t)
            continue
        bi, hi = (b if term.shape[0] > 1 else 0), (h if term.shape[1] > 1 else 0)
        columns = slice(0, 1) if is_column_term(term) else slice(k0, k0 + keys)
        t = nl.ndarray((P, columns.stop - columns.start), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=term[bi, hi, rows, columns])
        blocks.append(t)
    return tuple(blocks)


def _flex_logits(scores, scale, score_mod, mask, rows, k0, keys, b, h, derivative=False, terms=(), terms_wrt=(),
                 diagonals=()):
    """(score_mod(scale * scores) with masked keys at MASKED, fp32 [P, keys] in SBUF; its derivative or None; its
    derivatives with respect to the terms ``terms_wrt``; the Block that made them, None without a score_mod)."""
    z = nl.ndarray((P, keys), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=z, data=scores, op0=nl.multiply, operand0=scale)
    grad, term_grads, block = 1.0, (), None
    if score_mod:
        block = Block(P, keys, rows.start, k0, b, h, _term_blocks(terms, rows, k0, keys, b, h, diagonals))
        if terms_wrt:
            z, grad, term_grads = block.apply(score_mod, z, derivative=derivative, terms_wrt=terms_wrt)
        else:
            z, grad = block.apply(score_mod, z, derivative=derivative)
            term_grads = ()
        grad = 0.0 if grad is None else grad
    if mask is not None:
        if len(mask.shape) == 4:  # per batch or head: [batch or 1, heads or 1, seq, seq]
            mask = mask[b if mask.shape[0] > 1 else 0, h if mask.shape[1] > 1 else 0]
        keep = nl.ndarray((P, keys), dtype=mask.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=keep, src=mask[rows, k0:k0 + keys])
        z = nl.where(keep, z, MASKED, dtype=nl.float32)
    return z, grad, term_grads, block


def _transposed_dtype(dtype):
    """The PSUM dtype of a transposed bf16/fp16 tile: its own on trn2+ (the Tensor engine's transpose mode: half
    the bytes for the engine evacuating it), else fp32."""
    if dtype in (nl.bfloat16, nl.float16) and nisa.get_nc_version() >= nisa.nc_version.gen3:
        return dtype
    return nl.float32


def _transposed_rows(rows, tiles: int, d: int, dtype):
    """[d, tiles * 128] = the transpose of rows [128, tiles, d] (row i * 128 + p at [p, i]), on the Tensor engine
    (its transpose mode for 16-bit types on trn2+) by PSUM banks of columns, each bank copied out once."""
    dst = nl.ndarray((d, tiles * P), dtype=dtype, buffer=nl.sbuf)
    transposed = _transposed_dtype(dtype)
    per_bank = max(1, nl.tile_size.psum_bank_fmax_bytes // (P * (2 if transposed in (nl.bfloat16, nl.float16) else 4)))
    for first in range(0, tiles, per_bank):
        count = min(per_bank, tiles - first)
        staged = nl.ndarray((d, count * P), dtype=transposed, buffer=nl.psum)
        for c in range(count):
            nisa.nc_transpose(dst=staged[:, c * P:(c + 1) * P], data=rows[:, first + c, :])
        nisa.tensor_copy(dst=dst[:, first * P:(first + count) * P], src=staged)
    return dst


def _by_tiles(rows, tiles: int, d: int):
    """An HBM [tiles * 128, d] as [128, tiles, d]: row i * 128 + p at [p, i] (one DMA for a head's tiles)."""
    return rows.reshape((tiles, P, d)).permute((1, 0, 2))


def _pipelined(stages) -> None:
    """Run generators of a kernel's stages, one more started at each step and every started one advanced by a stage,
    the later ones first (software pipelining: program order only, each generator's own order kept)."""
    started = []
    for gen in stages:
        started.insert(0, gen)
        started = [g for g in started if next(g, StopIteration) is not StopIteration]
    while started:
        started = [g for g in started if next(g, StopIteration) is not StopIteration]


@nki.jit
def flash_attention_forward(q, k, v, scale=None, causal=True, score_mod=(), mask=None, blocks=None, heads=None,
                            terms=(), diagonals=()):
    groups, seq, d = q.shape
    assert seq % P == 0 and d <= P, "seq must be a multiple of 128 and d at most 128"
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(d)
    flex = bool(score_mod) or mask is not None or blocks is not None
    assert not (flex and causal), "causal=True is the built-in mask: pass a flex mask with causal=False"
    heads = heads or groups
    dtype = q.dtype
    out = nl.ndarray((groups, seq, d), dtype=dtype, buffer=nl.shared_hbm)
    lse = nl.ndarray((groups, seq), dtype=nl.float32, buffer=nl.shared_hbm)
    tiles = seq // P
    plan = _block_plan(tiles, causal, mask, blocks)
    identity = nl.shared_identity_matrix(P, dtype=dtype)
    bias = _causal_bias(dtype) if causal else None
    # each query tile's row sums and negated maxima, column g * tiles + i: their log-sum-exp is computed once at
    # the end (a log between the exps would reload the Scalar engine's activation table twice per tile)
    totals = nl.ndarray((P, groups * tiles), dtype=nl.float32, buffer=nl.sbuf)
    transposed = _transposed_dtype(dtype)
    neg_maxima = nl.ndarray((P, groups * tiles), dtype=nl.float32, buffer=nl.sbuf)  # -(each row's max)
    for g in nl.affine_range(groups):
        k_t = nl.ndarray((d, seq), dtype=dtype, buffer=nl.sbuf)
        _load_transposed(k_t, k[g])
        v_tiles = nl.ndarray((P, tiles, d), dtype=dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=v_tiles, src=_by_tiles(v[g], tiles, d))
        q_heads = nl.ndarray((d, seq), dtype=dtype, buffer=nl.sbuf)  # Q^T of the head: fewer, larger DMAs
        _load_transposed(q_heads, q[g])
        results = nl.ndarray((P, tiles, d), dtype=dtype, buffer=nl.sbuf)
        # the query tiles software-pipelined: tile i's chunks in two stages each (the scores to the exp; the transposes
        # to P V), emitted after the next tile's stage before it, so the engines' in-order queues hold other work
        # while a stage waits
        def query_tile(i, g=g, k_t=k_t, v_tiles=v_tiles, q_heads=q_heads, results=results):
            rows = slice(i * P, (i + 1) * P)
            q_t = q_heads[:, rows]
            acc = nl.ndarray((P, d), dtype=nl.float32, buffer=nl.sbuf)
            column = g * tiles + i
            total = totals[:, column:column + 1]
            m = None
            for first, count, partly in _key_chunks(plan[i]):
                k0, kb = first * P, count * P
                scores = nl.ndarray((P, kb), dtype=nl.float32, buffer=nl.psum)
                nisa.nc_matmul(dst=scores, stationary=q_t, moving=k_t[:, k0:k0 + kb])
                logits, logit_scale = scores, scale
                if flex:
                    logits, *_ = _flex_logits(scores, scale, score_mod, mask if partly else None, rows, k0, kb,
                                             g // heads, g % heads, terms=terms, diagonals=diagonals)
                    logit_scale = 1.0
                elif causal and partly:  # the diagonal: keys after each query masked
                    c = i * P - k0
                    nisa.nc_matmul(dst=scores[:, c:c + P], stationary=identity, moving=bias, accumulate=True)
                block_max = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
                nisa.tensor_reduce(dst=block_max, op=nl.max, data=logits, axis=1)
                # the running max kept negated (the exp's bias): one instruction after the reduction, not two
                neg_m = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
                if m is None:
                    nisa.tensor_scalar(dst=neg_m, data=block_max, op0=nl.multiply, operand0=-logit_scale)
                else:
                    nisa.tensor_scalar(dst=neg_m, data=block_max, op0=nl.multiply, operand0=-logit_scale,
                                       op1=nl.minimum, operand1=m)
                probs = nl.ndarray((P, kb), dtype=dtype, buffer=nl.sbuf)
                row_sum = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
                nisa.activation(dst=probs, op=nl.exp, data=logits, bias=neg_m, scale=logit_scale,
                                reduce_op=nl.add, reduce_res=row_sum)
                yield
                probs_t_psum = nl.ndarray((P, kb), dtype=transposed, buffer=nl.psum)
                for c in nl.affine_range(kb // P):
                    nisa.nc_transpose(dst=probs_t_psum[:, c * P:(c + 1) * P], data=probs[:, c * P:(c + 1) * P])
                probs_t = nl.ndarray((P, kb), dtype=dtype, buffer=nl.sbuf)
                nisa.tensor_copy(dst=probs_t, src=probs_t_psum)
                pv = nl.ndarray((P, d), dtype=nl.float32, buffer=nl.psum)
                for c in nl.affine_range(kb // P):
                    nisa.nc_matmul(dst=pv, stationary=probs_t[:, c * P:(c + 1) * P], moving=v_tiles[:, first + c, :])
                if m is None:
                    nisa.tensor_copy(dst=acc, src=pv)
                    nisa.tensor_copy(dst=total, src=row_sum)
                else:  # rescale by exp(m_old - m_new), then add
                    alpha = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
                    nisa.activation(dst=alpha, op=nl.exp, data=m, bias=neg_m, scale=-1.0)
                    nisa.scalar_tensor_tensor(dst=acc, data=acc, op0=nl.multiply, operand0=alpha, op1=nl.add,
                                              operand1=pv)
                    nisa.scalar_tensor_tensor(dst=total, data=total, op0=nl.multiply, operand0=alpha, op1=nl.add,
                                              operand1=row_sum)
                m = neg_m
                yield
            result = results[:, i, :]
            if m is None:  # every key of these queries hidden: 0, and a log-sum-exp of log(1) - inf
                nisa.memset(dst=result, value=0.0)
                nisa.memset(dst=total, value=1.0)
                nisa.memset(dst=neg_maxima[:, column:column + 1], value=math.inf)
            else:
                nisa.tensor_copy(dst=neg_maxima[:, column:column + 1], src=m)
                if mask is None:
                    nisa.tensor_scalar(dst=result, data=acc, op0=nl.divide, operand0=total)
                else:  # rows whose every key the mask hides (their max is MASKED): 0
                    seen = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
                    nisa.tensor_scalar(dst=seen, data=m, op0=nl.less, operand0=-MASKED / 2)
                    nisa.tensor_scalar(dst=result, data=acc, op0=nl.divide, operand0=total, op1=nl.multiply,
                                       operand1=seen)
        _pipelined([query_tile(i) for i in range(tiles)])
        nisa.dma_copy(dst=_by_tiles(out[g], tiles, d), src=results)
    log_totals = nl.ndarray((P, groups * tiles), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=log_totals, op=nl.log, data=totals)
    row_lse = nl.ndarray((P, groups * tiles), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=row_lse, data1=log_totals, data2=neg_maxima, op=nl.subtract)
    if mask is not None:  # a row that saw no key: -inf, as flex_attention's
        seen = nl.ndarray((P, groups * tiles), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=seen, data=neg_maxima, op0=nl.less, operand0=-MASKED / 2)
        row_lse = nl.where(seen, row_lse, -math.inf, dtype=nl.float32)
    nisa.dma_copy(dst=lse.reshape((groups * tiles, P)).permute((1, 0)), src=row_lse)
    return out, lse


@nki.jit
def flash_attention_backward(q, k, v, out, grad_out, lse, scale=None, causal=True, score_mod=(), mask=None,
                             blocks=None, heads=None, terms=(), term_grads=(), diagonals=()):
    groups, seq, d = q.shape
    assert seq % P == 0 and d <= P, "seq must be a multiple of 128 and d at most 128"
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(d)
    flex = bool(score_mod) or mask is not None or blocks is not None
    assert not (flex and causal), "causal=True is the built-in mask: pass a flex mask with causal=False"
    heads = heads or groups
    dtype = q.dtype
    grad_q = nl.ndarray((groups, seq, d), dtype=dtype, buffer=nl.shared_hbm)
    grad_k = nl.ndarray((groups, seq, d), dtype=dtype, buffer=nl.shared_hbm)
    grad_v = nl.ndarray((groups, seq, d), dtype=dtype, buffer=nl.shared_hbm)
    term_grads = tuple(term_grads)
    grad_terms = [nl.ndarray((groups, seq) if is_column_term(terms[t]) else (groups, seq, seq), dtype=nl.float32,
                             buffer=nl.shared_hbm) for t in term_grads]
    tiles = seq // P
    plan = _block_plan(tiles, causal, mask, blocks)
    identity = nl.shared_identity_matrix(P, dtype=dtype)
    bias = _causal_bias(dtype) if causal else None
    # every head's log-sum-exp at once, [P, groups * tiles] (column g * tiles + i), as the forward wrote it
    neg_lse_all = nl.ndarray((P, groups * tiles), dtype=nl.float32, buffer=nl.sbuf)
    lse_all = nl.ndarray((P, groups * tiles), dtype=nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=lse_all, src=lse.reshape((groups * tiles, P)).permute((1, 0)))
    if flex:  # a fully masked row's -inf: exp(MASKED - lse) must stay 0
        nisa.tensor_scalar(dst=neg_lse_all, data=lse_all, op0=nl.multiply, operand0=-1.0, op1=nl.minimum,
                           operand1=-MASKED / 4)
    else:
        nisa.tensor_scalar(dst=neg_lse_all, data=lse_all, op0=nl.multiply, operand0=-1.0)
    for g in nl.affine_range(groups):
        # a head's rows, [P, tiles, d], one DMA each, and q, k, v, dO transposed, [d, seq]: by strided DMAs at
        # d <= 64, else on the Tensor engine (a strided load's queue time grows with d * seq, the copy out of PSUM
        # of a transpose with seq alone)
        by_dma = d <= P // 2
        q_rows, k_rows, do_rows, o_rows = (nl.ndarray((P, tiles, d), dtype=dtype, buffer=nl.sbuf) for _ in range(4))
        loads = [(q_rows, q), (k_rows, k), (do_rows, grad_out), (o_rows, out)]
        if not by_dma:
            v_rows = nl.ndarray((P, tiles, d), dtype=dtype, buffer=nl.sbuf)
            loads.append((v_rows, v))
        for dst, src in loads:
            nisa.dma_copy(dst=dst, src=_by_tiles(src[g], tiles, d))
        if by_dma:
            q_t, k_t, v_t, do_t = (nl.ndarray((d, seq), dtype=dtype, buffer=nl.sbuf) for _ in range(4))
            for dst, src in ((q_t, q), (k_t, k), (v_t, v), (do_t, grad_out)):
                _load_transposed(dst, src[g])
        else:
            q_t, k_t, v_t, do_t = (_transposed_rows(rows, tiles, d, dtype)
                                   for rows in (q_rows, k_rows, v_rows, do_rows))
        neg_lse = neg_lse_all[:, g * tiles:(g + 1) * tiles]
        products = nl.ndarray((P, tiles, d), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=products, data1=o_rows, data2=do_rows, op=nl.multiply)
        delta = nl.ndarray((P, tiles), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=delta, op=nl.add, data=products, axis=2)
        # dQ accumulates in PSUM where the head's fits one bank, else in SBUF
        in_psum = tiles * d * 4 <= nl.tile_size.psum_bank_fmax_bytes
        grad_q_acc = nl.ndarray((P, tiles, d), dtype=nl.float32, buffer=nl.psum if in_psum else nl.sbuf)
        nisa.memset(dst=grad_q_acc, value=0.0)
        grad_k_all = nl.ndarray((P, tiles, d), dtype=dtype, buffer=nl.sbuf)
        grad_v_all = nl.ndarray((P, tiles, d), dtype=dtype, buffer=nl.sbuf)
        term_sums = {}  # a column term's gradient: its rows' sums over the visited keys, [P, tiles]
        for t in term_grads:
            if is_column_term(terms[t]):
                term_sums[t] = nl.ndarray((P, tiles), dtype=nl.float32, buffer=nl.sbuf)
                nisa.memset(dst=term_sums[t], value=0.0)
        zeros = None
        if len(term_sums) < len(term_grads):  # a [seq, seq] term's gradient is 0 in the blocks no query sees
            zeros = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.sbuf)
            nisa.memset(dst=zeros, value=0.0)
        # the key tiles software-pipelined: key tile j's blocks in three stages (P and dV; dS and dK; dS^T and dQ),
        # each stage of all its blocks at once, emitted after the next key tile's stage before it (stage s of tile j
        # at step j + s, the later tiles first), so the engines' in-order queues hold other work while a stage waits
        def key_tile(j, g=g, q_t=q_t, k_t=k_t, v_t=v_t, do_t=do_t, q_rows=q_rows, k_rows=k_rows, do_rows=do_rows,
                     neg_lse=neg_lse, delta=delta, grad_q_acc=grad_q_acc, in_psum=in_psum, grad_k_all=grad_k_all,
                     grad_v_all=grad_v_all, term_sums=term_sums, zeros=zeros):
            keys = slice(j * P, (j + 1) * P)
            visited = [i for i in range(tiles) if plan[i][j] != HIDDEN]
            for i in range(tiles):
                for t, grad_term in zip(term_grads, grad_terms):
                    if i not in visited and t not in term_sums:
                        nisa.dma_copy(dst=grad_term[g, i * P:(i + 1) * P, keys], src=zeros)
            grad_v_rows, grad_k_rows = grad_v_all[:, j, :], grad_k_all[:, j, :]
            if not visited:  # no query sees these keys
                nisa.memset(dst=grad_v_rows, value=0.0)
                nisa.memset(dst=grad_k_rows, value=0.0)
                return
            grad_v_psum = nl.ndarray((P, d), dtype=nl.float32, buffer=nl.psum)
            grad_k_psum = nl.ndarray((P, d), dtype=nl.float32, buffer=nl.psum)
            probs_of, grad_s_of = {}, {}
            for n, i in enumerate(visited):
                queries = slice(i * P, (i + 1) * P)
                scores = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.psum)
                nisa.nc_matmul(dst=scores, stationary=q_t[:, queries], moving=k_t[:, keys])
                probs = nl.ndarray((P, P), dtype=dtype, buffer=nl.sbuf)
                grad_mod, d_terms, block = 1.0, (), None
                if flex:
                    logits, grad_mod, d_terms, block = _flex_logits(
                        scores, scale, score_mod, mask if plan[i][j] == PARTLY else None, queries, j * P, P,
                        g // heads, g % heads, derivative=True, terms=terms, terms_wrt=term_grads,
                        diagonals=diagonals)
                    nisa.activation(dst=probs, op=nl.exp, data=logits, bias=neg_lse[:, i:i + 1])
                else:
                    if causal and i == j:
                        nisa.nc_matmul(dst=scores, stationary=identity, moving=bias, accumulate=True)
                    nisa.activation(dst=probs, op=nl.exp, data=scores, bias=neg_lse[:, i:i + 1], scale=scale)
                nisa.nc_matmul(dst=grad_v_psum, stationary=probs, moving=do_rows[:, i, :], accumulate=n > 0)
                probs_of[i] = probs, grad_mod, d_terms, block
            yield
            for n, i in enumerate(visited):
                queries = slice(i * P, (i + 1) * P)
                probs, grad_mod, d_terms, block = probs_of[i]
                grad_p = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.psum)
                nisa.nc_matmul(dst=grad_p, stationary=do_t[:, queries], moving=v_t[:, keys])
                grad_s = nl.ndarray((P, P), dtype=dtype, buffer=nl.sbuf)
                if isinstance(grad_mod, float) and grad_mod == 1.0 and not term_grads:
                    nisa.scalar_tensor_tensor(dst=grad_s, data=grad_p, op0=nl.subtract, operand0=delta[:, i:i + 1],
                                              op1=nl.multiply, operand1=probs)
                else:  # through the score_mod: dS = P (dP - D) * dmod/dscore
                    grad_y = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.sbuf)
                    nisa.scalar_tensor_tensor(dst=grad_y, data=grad_p, op0=nl.subtract, operand0=delta[:, i:i + 1],
                                              op1=nl.multiply, operand1=probs)
                    if isinstance(grad_mod, float):
                        nisa.tensor_scalar(dst=grad_s, data=grad_y, op0=nl.multiply, operand0=grad_mod)
                    else:
                        nisa.tensor_tensor(dst=grad_s, data1=grad_y, data2=grad_mod, op=nl.multiply)
                    for t, grad_term, d_term in zip(term_grads, grad_terms, d_terms):  # dY * dy/dterm
                        g_term = 0.0 if d_term is None else block.binary("mul", grad_y, d_term)
                        if t in term_sums:
                            row_sum = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
                            if isinstance(g_term, float):
                                nisa.memset(dst=row_sum, value=0.0)
                            else:
                                nisa.tensor_reduce(dst=row_sum, op=nl.add, data=block.full(g_term), axis=1)
                            nisa.tensor_tensor(dst=term_sums[t][:, i:i + 1], data1=term_sums[t][:, i:i + 1],
                                               data2=row_sum, op=nl.add)
                        else:
                            nisa.dma_copy(dst=grad_term[g, queries, keys],
                                          src=zeros if isinstance(g_term, float) else block.full(g_term))
                nisa.nc_matmul(dst=grad_k_psum, stationary=grad_s, moving=q_rows[:, i, :], accumulate=n > 0)
                grad_s_of[i] = grad_s
            yield
            for i in visited:
                grad_s = grad_s_of[i]
                grad_s_t_psum = nl.ndarray((P, P), dtype=nl.float32, buffer=nl.psum)
                nisa.nc_transpose(dst=grad_s_t_psum, data=grad_s)
                grad_s_t = nl.ndarray((P, P), dtype=dtype, buffer=nl.sbuf)
                nisa.tensor_copy(dst=grad_s_t, src=grad_s_t_psum)
                if in_psum:
                    nisa.nc_matmul(dst=grad_q_acc[:, i, :], stationary=grad_s_t, moving=k_rows[:, j, :],
                                   accumulate=True)
                else:
                    grad_q_psum = nl.ndarray((P, d), dtype=nl.float32, buffer=nl.psum)
                    nisa.nc_matmul(dst=grad_q_psum, stationary=grad_s_t, moving=k_rows[:, j, :])
                    nisa.tensor_tensor(dst=grad_q_acc[:, i, :], data1=grad_q_acc[:, i, :], data2=grad_q_psum,
                                       op=nl.add)
            nisa.tensor_copy(dst=grad_v_rows, src=grad_v_psum)
            nisa.tensor_scalar(dst=grad_k_rows, data=grad_k_psum, op0=nl.multiply, operand0=scale)
        pipeline = [key_tile(j) for j in range(tiles)]
        for step in range(tiles + 2):
            for j in range(min(step, tiles - 1), max(step - 3, -1), -1):
                next(pipeline[j], None)
        nisa.dma_copy(dst=_by_tiles(grad_v[g], tiles, d), src=grad_v_all)
        nisa.dma_copy(dst=_by_tiles(grad_k[g], tiles, d), src=grad_k_all)
        grad_q_rows = nl.ndarray((P, tiles, d), dtype=dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=grad_q_rows, data=grad_q_acc, op0=nl.multiply, operand0=scale)
        nisa.dma_copy(dst=_by_tiles(grad_q[g], tiles, d), src=grad_q_rows)
        for t, grad_term in zip(term_grads, grad_terms):
            if t in term_sums:
                nisa.dma_copy(dst=grad_term[g].reshape((tiles, P)).permute((1, 0)), src=term_sums[t])
    return (grad_q, grad_k, grad_v) + tuple(grad_terms)
