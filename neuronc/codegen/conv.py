"""The implicit-GEMM convolution kernel (`Op.CONV`, planned by passes/conv.py, which explains the method).

Per image and band of output rows: the band's input rows are loaded once into a zeroed SBUF tile (channels on
the partitions, one phase plane per stride phase), the next band's load issued ahead. Per output-channel tile
and block of rows, every tap of every input-channel tile is one matmul into the block's PSUM accumulator;
the epilogue reads the accumulator's kept columns, and the result is stored. Weights are loaded once, values
the epilogue needs per output channel are loaded and computed once.
"""
from __future__ import annotations

import dataclasses

from neuronc.codegen.emitter import Emitter, hbm
from neuronc.codegen.access import row_slice
from neuronc.codegen.elementwise import ACTIVATIONS, Balancer
from neuronc.instruction_cost import instruction_cost_ns
from neuronc.ir import Node, Op
from neuronc.isa import AccessPattern, ActFunc, AluOp, Engine, Opcode, Space
from neuronc.passes.conv import (PSUM_BUFS, STORE_QUEUES, channel_inputs, element_slots, epilogue_plan, geometry,
                                 pools)
from neuronc.passes.memory_plan import MemoryPlan


def _free(ap: AccessPattern, element: int, partitions: int, *dims) -> AccessPattern:
    """A pattern over `ap`'s slot: `partitions` partitions, free dims (stride, size) from `element`."""
    return dataclasses.replace(ap, offset=ap.offset + element * ap.dtype.itemsize, dims=((1, partitions), *dims))


def _from(ap: AccessPattern, partition: int) -> AccessPattern:
    return dataclasses.replace(ap, partition=ap.partition + partition) if partition else ap


def _spans(start: int, step: int, count: int, low: int, high: int) -> tuple:
    """(first, number) of the i in [0, count) with low <= start + step * i < high."""
    first = max(0, -(-(low - start) // step))
    last = min(count - 1, (high - 1 - start) // step)
    return first, max(0, last - first + 1)


class _Queues:
    """The kernel's DMAs, split by partitions (as access.dma_by_rows) into slices of whole partition groups (a
    DMA queue's share, by which the sync pass tracks hazards, so the slices never wait on each other). Result
    stores go to queues of their own, slice k always to store queue k: a store's rows of every channel share
    HBM pages with the image's other stores, which on other queues would wait on each other one after the
    other (slice k of the next block waits for slice k of this one in its queue's order, no semaphore needed),
    and loads queued behind stores would wait for the epilogue."""

    def __init__(self, em: Emitter, store_queues: int):
        self.em, self.stores = em, store_queues
        self.busy = [0.0] * (em.target.dma_queues - store_queues)  # ns of loads given to each load queue

    def _slices(self, dst: AccessPattern, src: AccessPattern, most: int, by_bytes: bool = True) -> list:
        t = self.em.target
        on_chip = dst if dst.space != Space.HBM else src
        rows, group = on_chip.partitions, max(1, t.partitions // t.dma_queues)
        nbytes = on_chip.num_elements * on_chip.dtype.itemsize
        smallest = t.dma_efficient_bytes_per_partition * t.partitions // t.dma_queues
        most = max(1, min(most, nbytes // smallest if by_bytes else most, rows // group))
        pieces = max(p for p in range(1, most + 1) if rows % p == 0 and (rows // p) % group == 0) \
            if rows % group == 0 else 1
        return [(row_slice(dst, rows * k // pieces, rows * (k + 1) // pieces),
                 row_slice(src, rows * k // pieces, rows * (k + 1) // pieces)) for k in range(pieces)]

    def _emit(self, queue: int, dst, src) -> None:
        self.em.emit(Opcode.DMA_COPY, Engine.DMA, dst, src, queue=queue)

    def load(self, dst: AccessPattern, src: AccessPattern, partition: int = 0) -> None:
        """Each slice on the load queue with the least work so far (as the cost model prices it)."""
        dst, src = (_from(ap, partition) if ap.space != Space.HBM else ap for ap in (dst, src))
        for piece in self._slices(dst, src, len(self.busy)):
            queue = min(range(len(self.busy)), key=self.busy.__getitem__)
            self._emit(self.stores + queue, *piece)
            self.busy[queue] += instruction_cost_ns(self.em.instructions[-1], self.em.target)

    def store(self, parts: list) -> None:
        """Store (dst, src) parts of the same channels (the rows of each half): slice k of every part on store queue
        k, where it shares pages with slice k of the other parts and of the other stores. Slices of neighbouring
        channels share an HBM page too: the even ones go first, so that each odd one waits for its two
        neighbours, running side by side, rather than for a chain of them."""
        pieces = [self._slices(dst, src, self.stores, by_bytes=False) for dst, src in parts]
        for k in [*range(0, len(pieces[0]), 2), *range(1, len(pieces[0]), 2)]:
            for part in pieces:
                self._emit(k, *part[k])


def _rows_of(whole: AccessPattern, rows: int, pitch: int, ow: int) -> AccessPattern:
    """The kept columns [partitions, rows, ow] of a tile of rows of `pitch` elements."""
    return dataclasses.replace(whole, dims=(whole.dims[0], (pitch, rows), (1, ow)))


def _whole_of(view: AccessPattern, rows: int, pitch: int) -> AccessPattern:
    return dataclasses.replace(view, dims=(view.dims[0], (1, rows * pitch)))


def _activate(em: Emitter, func, out, source, shift, columns, t, ot, made) -> None:
    """out = func(source + shift) on the Scalar engine, the shift one value per partition (or an immediate)."""
    if shift[0] == "imm":
        em.emit(Opcode.ACTIVATE, Engine.SCALAR, out, source, func=func, imm0=1.0, imm1=float(shift[1]))
        return
    em.emit(Opcode.ACTIVATE_BIAS_REDUCE, Engine.SCALAR, out, made["row_sum"].next().ap(ot, 1), source,
            _free(columns[shift], t, ot, (1, 1)), func=func, imm0=1.0)


def _per_channel_inputs(em, node, plan, epi, queues, made, o_tiles, weight_rows, halves) -> tuple:
    """The epilogue's per-channel inputs, loaded once: ({value: [O tile, O tiles] tile, column t for O tile t,
    repeated on partitions [O, 2O) with two halves}, {value: [weight rows, O] tile, the same values along the
    free axis, when the weights are scaled})."""
    x, w, *extras = node.inputs
    parts, cout = em.target.partitions, node.shape[1]
    views = node.attrs.get("views") or (None,) * len(node.inputs)
    columns, rows = {}, {}
    for i in sorted(channel_inputs(node)):
        extra, (offset, strides) = extras[i - 2], views[i]
        tile = made[f"extra{i}"].next().ap(parts, 1)
        for t, (o0, ot) in enumerate(o_tiles):
            for half in range(halves):
                queues.load(_from(_free(tile, t, ot, (1, 1)), half * ot),
                            hbm(extra.dtype, plan.offset(extra) + (offset + o0 * strides[1]) * extra.dtype.itemsize,
                                ((strides[1], ot), (1, 1))))
        columns[("input", i - 1)] = tile
        if epi.scale is not None:
            row = made[f"extra_row{i}"].next().ap(weight_rows, cout)
            queues.load(row, hbm(extra.dtype, plan.offset(extra) + offset * extra.dtype.itemsize,
                                 ((0, weight_rows), (strides[1], cout))))
            rows[("input", i - 1)] = row
    return columns, rows


def _channel_steps(epi) -> list:
    return [(j, step) for j, (step, kind) in enumerate(zip(epi.body, epi.kinds)) if kind == "channel"]


def _per_channel_rows(em, node, epi, engines, made, weight_rows, rows) -> None:
    """The epilogue's per-channel steps along the free axis, into `rows`: what the weights' scale is made of."""
    for j, step in _channel_steps(epi):
        row = made[f"channel_row{j}"].next().ap(weight_rows, node.shape[1], dtype=step.dtype)
        args = [float(ref) if a == "imm" else rows[(a, ref)] for a, ref in step.args]
        engines.compute(step, row, args, made.get("constants"), node.loc)
        rows[("step", j)] = row


def _per_channel_columns(em, node, epi, engines, made, o_tiles, halves, columns) -> None:
    """The epilogue's per-channel steps, once per channel (on its partition), into `columns`."""
    for j, step in _channel_steps(epi):
        tile = made[f"channel{j}"].next().ap(em.target.partitions, 1, dtype=step.dtype)
        for t, (o0, ot) in enumerate(o_tiles):
            args = [float(ref) if a == "imm" else _free(columns[(a, ref)], t, ot * halves, (1, 1))
                    for a, ref in step.args]
            engines.compute(step, _free(tile, t, ot * halves, (1, 1)), args, made.get("constants"), node.loc)
        columns[("step", j)] = tile


def convolution(em: Emitter, node: Node, plan: MemoryPlan) -> None:
    g = geometry(node, em.target.partitions)
    tiling = node.attrs["tiling"]
    x, w, *extras = node.inputs
    parts = em.target.partitions
    (sh, sw), ((pt, _), (pl, _)) = g.strides, g.padding
    oh, ow = g.out
    pitch, taps, cin, cout = g.pitch, g.taps, g.channels, g.out_channels
    plane_elements = g.plane_elements(tiling.band)
    made = {name: em.sbuf_pool(dtype, n, bufs=bufs) for name, (dtype, n, bufs) in pools(node, tiling, parts).items()}
    psum = em.psum_pool(PSUM_BUFS)
    engines = Balancer(em)
    queues = _Queues(em, STORE_QUEUES)
    c_tiles = [(c0, min(parts, cin - c0)) for c0 in range(0, cin, parts)]
    o_tiles = [(o0, min(parts, cout - o0)) for o0 in range(0, cout, parts)]
    epi = epilogue_plan(node)
    body, kinds = epi.body, epi.kinds
    final = max(j for j, kind in enumerate(kinds) if kind != "channel")  # the step whose value is the result
    slots, _ = element_slots(body, kinds)
    per_channel = channel_inputs(node)
    views = node.attrs.get("views") or (None,) * len(node.inputs)
    constants = made.get("constants")

    pairs = tiling.plan(g)  # which taps (and rows) each matmul computes
    halves = pairs.halves  # 2: partitions [O, 2O) of the accumulator hold the next output row
    n_taps, n_matmuls, margin = len(taps), len(pairs.matmuls), pairs.delta
    band_elements = g.band_elements(tiling.band + halves - 1, margin)
    # each input buffer zeroed once: the columns of the padding are never written; the rows of the padding,
    # which move from band to band, are zeroed again with each band
    width, most, used = len(c_tiles) * band_elements, em.target.max_free_elements_sbuf, min(cin, parts) * pairs.copies
    buffers = [made["input"].next() for _ in range(made["input"].bufs)]
    turn = iter(range(len(buffers) * (g.batch * -(-oh // tiling.band) + 1)))

    def zero(tile):
        for start in range(0, width, most):
            em.emit(Opcode.MEMSET, Engine.GPSIMD, _free(tile.ap(parts, 1), start, used, (1, min(most, width - start))),
                    imm0=0.0)

    zero(buffers[0])  # the others before their first band
    # temporaries zeroed once too: the Scalar engine's activations read their rows whole (the dropped columns too)
    for name, pool in made.items():
        if name.startswith("temp"):
            for _ in range(pool.bufs):
                engines.emit(Opcode.MEMSET, pool.next().ap(parts, 2 * tiling.rows // halves * pitch), imm0=0.0)

    def load_band(n, r0):
        """The tile of the input rows of output rows [r0, r0 + band) of image n: its planes filled, the rows
        of the padding zeroed."""
        number = next(turn)
        if 0 < number < len(buffers):
            zero(buffers[number])
        tile = buffers[number % len(buffers)].ap(parts, width)
        rows = g.plane_rows(tiling.band)
        for j, (c0, ct) in enumerate(c_tiles):
            for ph in range(sh):
                t0, nt = _spans(r0 * sh + ph - pt, sh, rows, 0, g.height)
                for pw in range(sw):
                    u0, nu = _spans(pw - pl, sw, pitch, 0, g.width)
                    row, col = r0 * sh + ph + sh * t0 - pt, pw + sw * u0 - pl
                    for copy in range(pairs.copies):  # the shifted copy on partitions [C, 2C), delta elements earlier
                        plane = j * band_elements + margin - copy * pairs.delta + (ph * sw + pw) * plane_elements
                        for z0, z1 in ((0, t0), (t0 + nt, rows)):  # padding rows (all of them if nt is 0)
                            if z1 > z0:
                                engines.emit(Opcode.MEMSET, _from(_free(tile, plane + z0 * pitch, ct,
                                                                        (1, (z1 - z0) * pitch)), copy * ct), imm0=0.0)
                        if nt and nu:
                            queues.load(_free(tile, plane + t0 * pitch + u0, ct, (pitch, nt), (1, nu)),
                                       hbm(x.dtype, plan.offset(x) + (((n * cin + c0) * g.height + row) * g.width + col)
                                           * x.dtype.itemsize,
                                           ((g.height * g.width, ct), (sh * g.width, nt), (sw, nu))),
                                       partition=copy * ct)
        return tile

    # the weights, once: w[o, c, kh, kw] loaded as it lies, [C tile, O, taps] (again on the partitions of the
    # shifted copy), then per matmul rearranged on chip into its stationary [C tile (x 2), O (x 2)], each block
    # a tap's [C, O] (or zeros), each output channel's column times the epilogue's scale
    raw, wtile = made["raw_weights"].next().ap(parts, 1), made["weights"].next().ap(parts, 1)
    m_size = cout * halves if halves == 2 else cout  # columns of one matmul's stationary
    if any(len(blocks) < pairs.copies * halves for _, blocks in pairs.matmuls):
        size = len(c_tiles) * n_matmuls * m_size
        for start in range(0, size, most):
            engines.emit(Opcode.MEMSET, _free(wtile, start, used, (1, min(most, size - start))), imm0=0.0)
    columns, rows_ = _per_channel_inputs(em, node, plan, epi, queues, made, o_tiles, min(cin, parts) * pairs.copies,
                                         halves)
    for j, (c0, ct) in enumerate(c_tiles):
        for copy in range(pairs.copies):
            queues.load(_free(raw, j * cout * n_taps, ct, (n_taps, cout), (1, n_taps)),
                       hbm(w.dtype, plan.offset(w) + c0 * n_taps * w.dtype.itemsize,
                           ((n_taps, ct), (cin * n_taps, cout), (1, n_taps))), partition=copy * ct)
    bands = [(n, r0) for n in range(g.batch) for r0 in range(0, oh, tiling.band)]
    ahead = load_band(*bands[0])  # its memsets ahead of the per-channel steps on the engines
    if epi.scale is not None:
        _per_channel_rows(em, node, epi, engines, made, min(cin, parts) * pairs.copies, rows_)
    for j, (c0, ct) in enumerate(c_tiles):
        for m, (_, blocks) in enumerate(pairs.matmuls):
            for copy, mh, tap in blocks:
                dst = _from(_free(wtile, (j * n_matmuls + m) * m_size + mh * cout, ct, (1, cout)), copy * ct)
                src = _from(_free(raw, j * cout * n_taps + tap, ct, (n_taps, cout)), copy * ct)
                if epi.scale is None:
                    engines.emit(Opcode.TENSOR_COPY, dst, src)
                elif epi.scale[0] == "imm":
                    engines.emit(Opcode.TENSOR_SCALAR, dst, src, alu=AluOp.MULTIPLY, imm0=float(epi.scale[1]))
                else:
                    scale = _from(_free(rows_[epi.scale], 0, ct, (1, cout)), copy * ct)
                    engines.emit(Opcode.TENSOR_TENSOR, dst, src, scale, alu=AluOp.MULTIPLY)

    _per_channel_columns(em, node, epi, engines, made, o_tiles, halves, columns)  # after the weights: not waited for

    def stationary(j, m, o0, ot):
        k_rows = c_tiles[j][1] * (2 if any(copy for copy, _, _ in pairs.matmuls[m][1]) else 1)
        return _free(wtile, (j * n_matmuls + m) * m_size + o0, k_rows, (1, ot * halves))

    def block(n, r0, band, q0, rows, t, o0, ot, result):
        """Output rows [r0 + q0, r0 + q0 + rows) of channels [o0, o0 + ot) of image n, into the band's result: `lines`
        rows of `pitch` in PSUM, the output row r0 + q0 + halves * line + half on partitions [half * ot, ...)."""
        lines, width = rows // halves, ot * halves
        acc = psum.next().ap(width, lines * pitch)
        spans = [(i * pitch, pitch) for i in range(lines)] if halves == 2 else [(0, rows * pitch)]
        for s_, (start, size) in enumerate(spans):
            for j, (c0, ct) in enumerate(c_tiles):
                for m, (a, blocks) in enumerate(pairs.matmuls):
                    element = j * band_elements + margin + a + (q0 + halves * s_) * pitch
                    k_rows = ct * (2 if any(copy for copy, _, _ in blocks) else 1)
                    em.emit(Opcode.MATMUL, Engine.TENSOR, _free(acc, start, width, (1, size)), stationary(j, m, o0, ot),
                            _free(band, element, k_rows, (1, size)), accumulate=j + m > 0)
        shape = (width, lines, ow)
        loaded = {("input", 0): _rows_of(acc, lines, pitch, ow)}
        row = r0 + q0
        for i, extra in enumerate(extras, start=2):
            if i in per_channel:
                continue
            offset, (sn, sc, sy, sx) = views[i] or (0, (cout * oh * ow, oh * ow, ow, 1))
            tile = made[f"extra{i}"].next().ap(*shape)
            for half in range(halves):
                queues.load(_from(_free(tile, 0, ot, (ow, lines), (1, ow)), half * ot),
                            hbm(extra.dtype, plan.offset(extra) + (offset + n * sn + o0 * sc + (row + half) * sy)
                                * extra.dtype.itemsize, ((sc, ot), (halves * sy, lines), (sx, ow))))
            loaded[("input", i - 1)] = tile
        temps: dict = {}
        results: dict = {}

        def tile_of(j):
            """The (block view, whole rows) of step j's tile: the result's, or a temporary's."""
            if j == final:
                whole = _free(result, q0 // halves * pitch, width, (1, lines * pitch))
            else:
                if slots[j] not in temps:
                    temps[slots[j]] = made[f"temp{slots[j]}"].next()
                whole = temps[slots[j]].ap(width, lines * pitch, dtype=body[j].dtype)
            return _rows_of(whole, lines, pitch, ow), whole

        whole_acc = acc
        if epi.folded is not None:  # acc * scale, plus the shift now unless an activation takes it as its bias
            if epi.shift is None or epi.biased is not None:
                results[epi.folded] = loaded[("input", 0)]
            else:
                view, whole = tile_of(epi.folded) if epi.folded == final else (None, None)
                if whole is None:
                    whole = made["shifted"].next().ap(width, lines * pitch)
                    view = _rows_of(whole, lines, pitch, ow)
                _activate(em, ActFunc.IDENTITY, whole, whole_acc, epi.shift, columns, t, width, made)
                results[epi.folded] = view
        for j, (step, kind) in enumerate(zip(body, kinds)):
            if kind != "element":
                continue
            out, whole = tile_of(j)
            if j == epi.biased:  # func(x + shift), x the value so far read whole (with its dropped columns)
                (x_arg,) = [a for a in step.args if a[0] == "step"]
                source = results[x_arg[1]]
                source_whole = whole_acc if source is loaded[("input", 0)] else _whole_of(source, lines, pitch)
                func = ActFunc.RELU if step.op is Op.MAXIMUM else ACTIVATIONS[step.op]
                _activate(em, func, whole, source_whole, epi.shift, columns, t, width, made)
                results[j] = out
                continue
            args = []
            for a, ref in step.args:
                if a == "imm":
                    args.append(float(ref))
                elif a == "step" and kinds[ref] != "channel":
                    args.append(results[ref])
                elif (a, ref) in loaded:
                    args.append(loaded[(a, ref)])
                else:  # a per-channel value, read along the block with stride 0
                    args.append(_free(columns[(a, ref)], t, width, (0, lines), (0, ow)))
            engines.compute(step, out, args, constants, node.loc)
            results[j] = out

    for index, (n, r0) in enumerate(bands):
        band = ahead
        if index + 1 < len(bands):  # the next band loads while this one is multiplied
            ahead = load_band(*bands[index + 1])
        height = min(tiling.band, oh - r0)
        for t, (o0, ot) in enumerate(o_tiles):
            result = made["result"].next().ap(parts, 1)
            for q0 in range(0, height, tiling.rows):
                block(n, r0, band, q0, min(tiling.rows, height - q0), t, o0, ot, result)
            # stored by band, not by block: the stores of one image share HBM pages, so fewer and larger ones
            # wait on each other less
            queues.store([(hbm(node.dtype, plan.offset(node) + (((n * cout + o0) * oh + r0 + half) * ow)
                               * node.dtype.itemsize, ((oh * ow, ot), (halves * ow, height // halves), (1, ow))),
                           _from(_free(result, 0, ot, (pitch, height // halves), (1, ow)), half * ot))
                          for half in range(halves)])
