"""The matmul kernel: stationary and moving tiles on the Tensor engine accumulating in PSUM, loads issued ahead,
and the fused epilogue (bias, activation, residual, cast) computed from PSUM on the other engines."""
from __future__ import annotations

from typing import Callable, NamedTuple

from neuronc.codegen.access import column_slice, dma_by_rows, tile_at
from neuronc.codegen.elementwise import StepBalancer, assign_slots
from neuronc.codegen.emitter import Emitter, hbm
from neuronc.isa import AccessPattern, ActFunc, Engine, Opcode
from neuronc.ir import Node
from neuronc.plans import ChainPlan, MatmulPlan, MemoryPlan


def matmul(em: Emitter, node: Node, plan: MemoryPlan) -> None:
    """A matmul kernel, or a chain of two (passes/matmul_chain.py): the first one's result, computed
    transposed, stays in SBUF as the second one's stationary operand."""
    kernel = node.attrs["plan"]
    if isinstance(kernel, MatmulPlan):
        return _matmul(em, kernel, plan, node.inputs, node.loc, home=node)
    assert isinstance(kernel, ChainPlan)
    first, second = kernel.first, kernel.second
    first_inputs, second_inputs = node.inputs[:kernel.split], (None, *node.inputs[kernel.split:])
    tiling = second.tiling
    rows, columns, dtype = first.m, first.n, first.dtype
    k_tiles = -(-rows // tiling.tile_k)
    kept = em.sbuf_pool(dtype, k_tiles * columns, bufs=1).next().ap(tiling.tile_k, k_tiles * columns)
    early = kernel.early_rows
    psum = em.psum_pool(bufs=em.target.psum_banks - early)
    if not early:
        em.locate(kernel.first_loc)
        _matmul(em, first, plan, first_inputs, kernel.first_loc, sink=kept, psum=psum)
        em.locate(None)
        _matmul(em, second, plan, second_inputs, node.loc, a_resident=kept, psum=psum, home=node)
        return
    rest = _matmul(em, second, plan, second_inputs, node.loc, a_resident=kept, psum=psum, home=node,
                   early_psum=em.psum_pool(bufs=early))
    # The second's first column of output tiles accumulates K tile by K tile as the first makes them, `LAG` of
    # the first's tiles behind (so their epilogues are done when the Tensor engine reaches these matmuls).
    made, pending = [0] * k_tiles, []
    first_tiles = -(-columns // first.tiling.tile_n)

    def made_tile(m0):
        made[m0 // tiling.tile_k] += 1
        if made[m0 // tiling.tile_k] == first_tiles:
            pending.append(m0 // tiling.tile_k)
            rest.load_k(m0 // tiling.tile_k)
            if sum(count == first_tiles for count in made) == k_tiles // 2:
                rest.prefetch()  # halfway through the first matmul
        while len(pending) > LAG:
            rest.accumulate_k(pending.pop(0))

    em.locate(kernel.first_loc)  # the second's early matmuls, emitted among the first's, keep the first's location
    _matmul(em, first, plan, first_inputs, kernel.first_loc, sink=kept, psum=psum, after_tile=made_tile)
    em.locate(None)
    rest.finish(pending)


LAG = 2  # a chain's first-matmul tiles between the making of a K tile and the second's matmuls reading it
LEAD_PART = 4  # the part of its K tiles the next strip's tiles accumulate while the first matmul's last epilogues run


class _Strip(NamedTuple):
    """A loaded operand strip: [K tile, k tiles x width] in SBUF, and the part of the bias that travels with it
    (B's strips: the bias row's columns, [1, width]; A's: the bias column's rows, [M tile, row tiles])."""

    tile: AccessPattern
    width: int
    bias: AccessPattern | None = None


class _Rest(NamedTuple):
    """A chain's second matmul, emitted in parts while the first one makes its stationary operand A^T."""

    load_k: Callable  # (j): load K tile j of the first output column's B strip
    accumulate_k: Callable  # (j): that column's matmuls of K tile j, once A^T's K tile j is made
    prefetch: Callable  # (): load the first strips of the columns after the first
    finish: Callable  # (pending K tiles): the rest of the kernel


class _Placed(NamedTuple):
    """An output tile placed in a tile the caller owns (a chain's kept result), in place of a pool's slot."""

    at: AccessPattern

    def ap(self, *shape, dtype=None) -> AccessPattern:
        return self.at


def _matmul(em: Emitter, kernel: MatmulPlan, plan: MemoryPlan, inputs: tuple, loc, a_resident: AccessPattern | None = None,
            sink: AccessPattern | None = None, psum=None, home: Node | None = None, after_tile=None,
            early_psum=None):
    """C[b] = A[b] @ B[b]: stationary = A tile transposed [K, M], moving = B tile [K, N], fp32 in PSUM,
    tiled and ordered as the tiling pass decided (attrs["tiling"], passes/tiling.py).

    Operands are loaded as strips [K tile, k tiles x width] by one DMA each (split over the queues by
    partitions): with a resident operand, its strip of `block` output tiles stays in SBUF while the other
    operand's strips stream through it. With an epilogue (fused elementwise consumers: bias, activation,
    residual, cast), each result tile is computed from the PSUM accumulator and the epilogue's other
    inputs on its way out.

    With `a_resident` ([K tile, k tiles x M] in SBUF: A^T, all of it), A is not loaded; with `sink` ([M tile,
    M tiles x N] in SBUF), result tiles go there (row tile i at columns i x N) instead of to HBM; `psum`, a
    PSUM pool to share; `home`, the graph node whose HBM buffer the result is stored in (default: `node`);
    `after_tile(m0)` is called once a row tile's epilogue is emitted.

    With `early_psum` (and `a_resident`), nothing is emitted yet: the first column of output tiles takes its
    accumulators from `early_psum`, and the kernel is returned as a `_Rest`, whose functions the caller
    interleaves with the making of A^T (see `matmul`)."""
    a, b, *extra = inputs
    batch, m, n, k = kernel.batch, kernel.m, kernel.n, kernel.k
    tiling = kernel.tiling
    a_offset, (asb, asm, ask) = kernel.a.offset, kernel.a.strides
    b_offset, (bsb, bsk, bsn) = kernel.b.offset, kernel.b.strides
    extra_views = [(view.offset, view.strides) for view in kernel.extras]
    body = kernel.epilogue
    slots, temp_count = assign_slots(body)
    tm, tn, tk = tiling.tile_m, tiling.tile_n, tiling.tile_k
    k_tiles = -(-k // tk)
    strips = {p.name: em.sbuf_pool(p.dtype, p.elements, bufs=p.bufs) for p in kernel.operand_pools
              if not (p.name == "a" and a_resident is not None)}
    out_pools = {p.name: p for p in kernel.epilogue_pools}
    pool = lambda name: em.sbuf_pool(out_pools[name].dtype, out_pools[name].elements, bufs=out_pools[name].bufs)  # noqa: E731
    result, constants = pool("result"), pool("constants")
    extra_pools = [pool(f"extra{i}") if f"extra{i}" in out_pools else None for i in range(len(extra))]
    bias_row = kernel.bias_row  # an extra input added into PSUM as a row, by a rank-1 matmul
    if bias_row is not None:
        ones = pool("ones").next().ap(1, tm)
        em.emit(Opcode.MEMSET, Engine.GPSIMD, ones, imm0=1.0)
    bias_column = kernel.bias_column  # an extra input of one value per row, added by the first step
    if bias_column is not None:
        column_sums, widened = pool("row_sum"), pool("bias")
    temps = [pool(f"temp{i}") for i in range(temp_count)]
    psum = psum or em.psum_pool()
    engines = StepBalancer(em)
    ci = kernel.dtype.itemsize

    a_by_k_tile = kernel.a_by_k_tile

    def load_strip(name, x, element, k_stride, w_stride, width):
        """All K tiles of `width` columns of x ([K, width] at `element`, strided) as [tk, k tiles x width]: one
        DMA split over the queues by partitions, or one per K tile for A^T written head by head by an attention
        (passes/tiling.py `loads_a_by_k_tile`)."""
        tile = strips[name].next().ap(tk, k_tiles * width)
        whole, tail = divmod(k, tk)
        if whole and name == "a" and a_by_k_tile:
            for j in range(whole):
                dma_by_rows(em, tile_at(tile, j * width, tk, width),
                            hbm(x.dtype, plan.offset(x) + (element + j * tk * k_stride) * x.dtype.itemsize,
                                ((k_stride, tk), (w_stride, width))))
        elif whole:
            dma_by_rows(em, tile_at(tile, 0, min(tk, k), whole, width),
                         hbm(x.dtype, plan.offset(x) + element * x.dtype.itemsize,
                             ((k_stride, min(tk, k)), (tk * k_stride, whole), (w_stride, width))))
        if tail:
            em.dma(tile_at(tile, whole * width, tail, width),
                   hbm(x.dtype, plan.offset(x) + (element + whole * tk * k_stride) * x.dtype.itemsize,
                       ((k_stride, tail), (w_stride, width))))
        return tile, width

    def a_strip(g, m0, rows):
        if a_resident is not None:
            return _Strip(a_resident, m)
        rows = min(rows, m - m0)
        return _Strip(*load_strip("a", a, a_offset + g * asb + m0 * asm, ask, asm, rows),
                      bias_column_of(g, m0, rows) if bias_column is not None else None)

    def b_strip(g, n0, cols):
        cols = min(cols, n - n0)
        return _Strip(*load_strip("b", b, b_offset + g * bsb + n0 * bsn, bsk, bsn, cols),
                      bias_row_of(g, n0, cols) if bias_row is not None else None)

    def bias_row_of(g, n0, cols):
        """[1, cols] of the bias row from column n0, loaded now (with the B strip it is added to)."""
        x, (offset, (sb, _, sn)) = extra[bias_row - 1], extra_views[bias_row - 1]
        row = strips["bias_row"].next().ap(1, cols)
        em.dma(row, hbm(x.dtype, plan.offset(x) + (offset + g * sb + n0 * sn) * x.dtype.itemsize, ((0, 1), (sn, cols))))
        return row

    def bias_column_of(g, m0, rows):
        """[M tile, row tiles] of the bias column from row m0 (row tile i in column i), loaded now."""
        x, (offset, (sb, sm, _)) = extra[bias_column - 1], extra_views[bias_column - 1]
        tiles, tail = divmod(rows, tm)
        column = strips["bias_column"].next().ap(min(tm, rows), tiles + bool(tail))
        at = plan.offset(x) + (offset + g * sb + m0 * sm) * x.dtype.itemsize
        if tiles:
            em.dma(tile_at(column, 0, min(tm, rows), tiles), hbm(x.dtype, at, ((sm, min(tm, rows)), (tm * sm, tiles))))
        if tail:
            em.dma(tile_at(column, tiles, tail, 1), hbm(x.dtype, at + tiles * tm * sm * x.dtype.itemsize, ((sm, tail), (1, 1))))
        return column

    def in_strip(strip, col, size):
        """The operand of K tile j: `size` columns from `col` of the strip's j-th K tile."""
        return lambda j: tile_at(strip.tile, j * strip.width + col, min(tk, k - j * tk), size)

    def streamed(name, x, element, k_stride, w_stride, size):
        """The operand of K tile j loaded on demand ([rows, size] tiles, the baseline's stream)."""
        def load(j):
            rows = min(tk, k - j * tk)
            tile = strips[name].next().ap(rows, size)
            em.dma(tile, hbm(x.dtype, plan.offset(x) + (element + j * tk * k_stride) * x.dtype.itemsize,
                             ((k_stride, rows), (w_stride, size))))
            return tile
        return load

    def output_tile(g, m0, n0, stationary, moving, acc=None, row=None, column=None):
        """One [mt, nt] output tile: K tiles accumulated in PSUM (unless `acc` holds them), the epilogue, the
        store. `row` / `column`: its part of the bias row / column, loaded with the strips (else loaded here)."""
        mt, nt = min(tm, m - m0), min(tn, n - n0)
        if acc is None:
            acc = psum.next().ap(mt, nt)
            for j in range(k_tiles):
                em.emit(Opcode.MATMUL, Engine.TENSOR, acc, stationary(j), moving(j), accumulate=j > 0)
        loaded = {0: acc}
        for i, (x, xpool, (offset, (sb, sm, sn))) in enumerate(zip(extra, extra_pools, extra_views), start=1):
            if i == bias_row:  # acc[m, n] += 1 * bias[n]
                row = row if row is not None else bias_row_of(g, n0, nt)
                em.emit(Opcode.MATMUL, Engine.TENSOR, acc, column_slice(ones, 0, mt), row,
                        accumulate=True)
                continue
            if i == bias_column:  # [mt, 1] values widened to fp32 for the first step's per-partition bias
                column = column if column is not None else bias_column_of(g, m0, mt)
                loaded[i] = widened.next().ap(mt, 1)
                em.emit(Opcode.TENSOR_COPY, Engine.GPSIMD, loaded[i], column)
                engines.account(em.instructions[-1:])
                loaded["row_sum"] = column_sums.next().ap(mt, 1)
                continue
            loaded[i] = xpool.next().ap(mt, nt)  # by rows over several queues, as the store
            dma_by_rows(em, loaded[i], hbm(x.dtype, plan.offset(x) + (offset + g * sb + m0 * sm + n0 * sn) * x.dtype.itemsize,
                                  ((sm, mt), (sn, nt))))
        if sink is not None:
            waiting.append((loaded, [p.next() for p in temps], _Placed(tile_at(sink, m0 // tm * n + n0, mt, nt)),
                            (mt, nt), None, m0))
        else:
            waiting.append((loaded, [p.next() for p in temps], result.next(), (mt, nt),
                            hbm(kernel.dtype, plan.offset(home) + ((g * m + m0) * n + n0) * ci, ((n, mt), (1, nt))),
                            m0))
        if len(waiting) > EPILOGUE_GROUP:  # this tile's matmuls go ahead of the epilogues of the ones before
            flush(keep=1)

    waiting = []  # output tiles whose matmuls are emitted and whose epilogues are not

    def flush(keep=0, last=False):
        """The epilogues of the waiting tiles but the last `keep`, step by step across the tiles (independent
        chains side by side on the engines, not one chain at a time), then their stores. The `last` tile of
        the kernel is stored by rows over half the queues (the other half may still hold the store before it):
        nothing comes after it to share them with."""
        jobs = waiting[:len(waiting) - keep]
        del waiting[:len(jobs)]
        outs = _emit_bodies(body, slots, [job[:4] for job in jobs], constants, loc, engines, bias_column)
        for job, out in zip(jobs, outs):  # by rows over several queues: a short store, and its rows' own pages
            if job[4] is not None:
                dma_by_rows(em, job[4], out, em.target.dma_queues // 2 if last and job is jobs[-1] else None)
        for job in jobs:
            if after_tile is not None:
                after_tile(job[5])

    if tiling.resident == "none":
        for g in range(batch):
            for m0 in range(0, m, tm):
                for n0 in range(0, n, tn):
                    output_tile(g, m0, n0,
                                streamed("a", a, a_offset + g * asb + m0 * asm, ask, asm, min(tm, m - m0)),
                                streamed("b", b, b_offset + g * bsb + n0 * bsn, bsk, bsn, min(tn, n - n0)))
        flush(last=True)
        return
    def plan_steps(first_column=0):
        """The strip loads in order of use, each with the output tiles it completes (columns from
        `first_column` on)."""
        steps = []  # (loader of one strip, [(g, m0, n0, a strip step, a col, b strip step, b col)])
        for g in range(batch):
            if tiling.resident == "a":
                for mb in range(0, m, tiling.block * tm):
                    steps.append((lambda g=g, mb=mb: a_strip(g, mb, tiling.block * tm), []))
                    a_step = len(steps) - 1
                    for n0 in range(first_column, n, tn):
                        steps.append((lambda g=g, n0=n0: b_strip(g, n0, tn), []))
                        steps[-1][1].extend((g, m0, n0, a_step, m0 - mb, len(steps) - 1, 0)
                                            for m0 in range(mb, min(m, mb + tiling.block * tm), tm))
            else:
                for nb in range(first_column, n, tiling.block * tn):
                    steps.append((lambda g=g, nb=nb: b_strip(g, nb, tiling.block * tn), []))
                    b_step = len(steps) - 1
                    for m0 in range(0, m, tm):
                        steps.append((lambda g=g, m0=m0: a_strip(g, m0, tm), []))
                        steps[-1][1].extend((g, m0, n0, len(steps) - 1, 0, b_step, n0 - nb)
                                            for n0 in range(nb, min(n, nb + tiling.block * tn), tn))
        if tiling.streamed_first and a_resident is None and len(steps) > 1:
            return _streamed_first(steps)
        return steps

    def run(steps, loaded):
        """Every strip load issued `stream_bufs - 1` steps ahead (before the previous steps' tiles and their
        stores), so it overlaps their compute; `loaded`: the strips loaded already, by step."""
        for i, (_, tiles) in enumerate(steps):
            for j in range(len(loaded), min(len(steps), i + tiling.stream_bufs)):
                loaded[j] = steps[j][0]()
            for tile in tiles:
                stationary, moving, row, column = operands(tile, loaded)
                output_tile(*tile[:3], stationary, moving, row=row, column=column)
        flush(last=True)

    def operands(tile, loaded):
        """(stationary, moving, bias row, bias column) of an output tile of `plan_steps`, from the loaded strips."""
        g, m0, n0, a_step, a_col, b_step, b_col = tile
        mt, nt, a_strip_, b_strip_ = min(tm, m - m0), min(tn, n - n0), loaded[a_step], loaded[b_step]
        return (in_strip(a_strip_, a_col, mt), in_strip(b_strip_, b_col, nt),
                b_strip_.bias and tile_at(b_strip_.bias, b_col, 1, nt),
                a_strip_.bias and tile_at(a_strip_.bias, a_col // tm, mt, 1))

    if early_psum is None:
        run(plan_steps(), {})
        return None
    width = min(tn, n)
    strip = _Strip(strips["b"].next().ap(tk, k_tiles * width), width,  # the first column's B strip, a K tile at a time,
                   bias_row_of(0, 0, width) if bias_row is not None else None)  # and its bias row, now
    accs = [(m0, early_psum.next().ap(min(tm, m - m0), width)) for m0 in range(0, m, tm)]

    def early_load(j):
        rows = min(tk, k - j * tk)
        dma_by_rows(em, tile_at(strip.tile, j * width, rows, width),
                    hbm(b.dtype, plan.offset(b) + (b_offset + j * tk * bsk) * b.dtype.itemsize, ((bsk, rows), (bsn, width))))

    def early_k(j):
        for m0, acc in accs:
            em.emit(Opcode.MATMUL, Engine.TENSOR, acc, in_strip(_Strip(a_resident, m), m0, min(tm, m - m0))(j),
                    in_strip(strip, 0, min(tn, n))(j), accumulate=j > 0)

    steps, loaded = plan_steps(first_column=tn), {}

    def prefetch():  # the strips of the first steps after the first column
        for j in range(min(len(steps), tiling.stream_bufs - 1)):
            loaded[j] = steps[j][0]()

    def later(pending):
        """The rest, once the first matmul's matmuls are emitted, `pending` its K tiles whose early matmuls are not
        (the last made: their epilogues end last). The next strip's output tiles first accumulate a part of the
        other K tiles, so the Tensor engine has work while those epilogues finish; then the early column is
        finished, then those tiles one by one (each one's epilogue beside the next one's matmuls), then the rest."""
        head = next((i for i, (_, tiles) in enumerate(steps) if tiles), None)
        ahead = []  # (output tile, its accumulator, its operands)
        if head is not None and pending:
            for j in range(len(loaded), head + 1):
                loaded[j] = steps[j][0]()
            ahead = [(tile, psum.next().ap(min(tm, m - tile[1]), min(tn, n - tile[2])), operands(tile, loaded))
                     for tile in steps[head][1]]
            steps[head] = (steps[head][0], [])
        order = [j for j in range(k_tiles) if j not in pending] + list(pending)
        lead = -(-(k_tiles - len(pending)) // LEAD_PART)

        def accumulate(acc, stationary, moving, part):
            for index in part:
                j = order[index]
                em.emit(Opcode.MATMUL, Engine.TENSOR, acc, stationary(j), moving(j), accumulate=index > 0)

        for index in range(lead):
            for _, acc, (stationary, moving, _, _) in ahead:
                accumulate(acc, stationary, moving, [index])
        for j in pending:
            early_k(j)
        for m0, acc in accs:
            output_tile(0, m0, 0, None, None, acc=acc, row=strip.bias)
        for tile, acc, (stationary, moving, row, column) in ahead:
            accumulate(acc, stationary, moving, range(lead, k_tiles))
            output_tile(*tile[:3], None, None, acc=acc, row=row, column=column)
        run(steps, loaded)

    return _Rest(load_k=early_load, accumulate_k=early_k, prefetch=prefetch, finish=later)


def _streamed_first(steps: list) -> list:
    """The steps with the first streamed strip loaded before the first resident one: its output tiles move to
    the resident strip's step (the later of their two loads), the step numbers they name swapped."""
    swap = {0: 1, 1: 0}
    steps = [(steps[1][0], []), (steps[0][0], steps[1][1]), *steps[2:]]
    return [(load, [(g, m0, n0, swap.get(a_step, a_step), a_col, swap.get(b_step, b_step), b_col)
                    for g, m0, n0, a_step, a_col, b_step, b_col in tiles]) for load, tiles in steps]


EPILOGUE_GROUP = 2  # output tiles whose epilogues a matmul kernel emits side by side


def _emit_bodies(body, slots, jobs, constants, loc, engines, bias_column=None) -> list:
    """`emit_body` for several tiles at once, each step for every tile before the next step: jobs are
    (loaded, temp tiles, out tile, shape). Returns each job's result AP. Each step goes to the engine that
    would finish it first, after the steps it reads (`StepBalancer`). With `bias_column`, the first step (the
    accumulator rounded to its dtype) adds that input's per-partition values on its way, in one Scalar pass."""
    results = [[] for _ in jobs]
    made = [[] for _ in jobs]  # when each job's steps are done, as the balancer books them
    for index, (step, slot) in enumerate(zip(body, slots)):
        for (loaded, temp_tiles, out_tile, shape), done, times in zip(jobs, results, made):
            out = out_tile.ap(*shape) if slot is None else temp_tiles[slot].ap(*shape, dtype=step.dtype)
            args = [loaded[ref] if kind == "input" else done[ref] if kind == "step" else float(ref)
                    for kind, ref in step.args]
            ready = max([times[ref] for kind, ref in step.args if kind == "step"], default=0.0)
            if index == 0 and bias_column is not None:  # acc + bias in fp32, rounded once: the ADD's sum
                engines.em.emit(Opcode.ACTIVATE_BIAS_REDUCE, Engine.SCALAR, out, loaded["row_sum"], args[0],
                                loaded[bias_column], func=ActFunc.IDENTITY, imm0=1.0)
                times.append(engines.account(engines.em.instructions[-1:], ready))
            else:
                times.append(engines.compute(step, out, args, constants, loc, ready))
            done.append(out)
    return [done[-1] for done in results]
