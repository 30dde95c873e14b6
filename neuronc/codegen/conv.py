"""The implicit-GEMM convolution kernel (`Op.CONV`, planned by passes/conv.py, which explains the method).

Per image and band of output rows: the band's input rows are loaded once into a zeroed SBUF tile (channels on
the partitions, one phase plane per stride phase), the next band's load issued ahead. Per output-channel tile
and block of rows, every tap of every input-channel tile is one matmul into the block's PSUM accumulator;
the epilogue reads the accumulator's kept columns, and the result is stored. Weights are loaded once, values
the epilogue needs per output channel are loaded and computed once.
"""
from __future__ import annotations

import dataclasses

from neuronc.codegen.access import HbmTensor, row_slice
from neuronc.codegen.emitter import Emitter
from neuronc.codegen.elementwise import ACTIVATIONS, Balancer
from neuronc.instruction_cost import instruction_cost_ns
from neuronc.ir import Node, Op
from neuronc.isa import AccessPattern, ActFunc, AluOp, Engine, Opcode, Space
from neuronc.placement import dma_slice_count, partition_group
from neuronc.plans import ConvPlan, MemoryPlan


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
        rows, group = on_chip.partitions, partition_group(t)
        if by_bytes:
            most = min(most, dma_slice_count(rows, on_chip.num_elements * on_chip.dtype.itemsize, t))
        most = max(1, min(most, rows // group))
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


def _per_channel_inputs(em, node, plan, kernel: ConvPlan, queues, made, o_tiles, weight_rows, halves) -> tuple:
    """The epilogue's per-channel inputs, loaded once: ({value: [O tile, O tiles] tile, column t for O tile t,
    repeated on partitions [O, 2O) with two halves}, {value: [weight rows, O] tile, the same values along the
    free axis, when the weights are scaled})."""
    parts, cout, epi = em.target.partitions, node.shape[1], kernel.epilogue
    columns, rows = {}, {}
    for i in kernel.channel_inputs:
        values = HbmTensor.of(plan, node.inputs[i], kernel.views[i], node.shape)[0, :, 0, 0]  # one per channel
        tile = made[f"extra{i}"].next().ap(parts, 1)
        for t, (o0, ot) in enumerate(o_tiles):
            for half in range(halves):
                queues.load(_from(_free(tile, t, ot, (1, 1)), half * ot), values[o0:o0 + ot].column.ap)
        columns[("input", i - 1)] = tile
        if epi.scale is not None:
            row = made[f"extra_row{i}"].next().ap(weight_rows, cout)
            queues.load(row, values.broadcast_rows(weight_rows).ap)
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
    _ConvKernel(em, node, plan).emit()


class _ConvKernel:
    """One convolution's instructions: the geometry, plans and tiles its phases share, a method per phase
    (buffers zeroed, weights loaded and arranged, each band loaded ahead, each block multiplied and its
    epilogue computed, each band's result stored)."""

    def __init__(self, em: Emitter, node: Node, plan: MemoryPlan):
        self.em, self.node, self.plan = em, node, plan
        self.kernel = kernel = node.attrs["plan"]
        self.g = g = kernel.geometry
        self.tiling = tiling = kernel.tiling
        self.x, self.w, *self.extras = node.inputs
        # in HBM: the input [N, C, H, W], the weights [O, C, KH x KW] read as [C, O, taps], the result [N, O, OH, OW]
        self.input = HbmTensor.of(plan, self.x)
        self.weights = HbmTensor.of(plan, self.w, shape=(self.w.shape[0], self.w.shape[1],
                                                         self.w.shape[2] * self.w.shape[3])).permute(1, 0, 2)
        self.out = HbmTensor.of(plan, node)
        self.parts = parts = em.target.partitions
        self.oh, self.ow = g.out
        self.pitch, self.cin, self.cout = g.pitch, g.channels, g.out_channels
        self.plane_elements = g.plane_elements(tiling.band)
        self.made = {p.name: em.sbuf_pool(p.dtype, p.elements, bufs=p.bufs) for p in kernel.pools}
        self.psum = em.psum_pool(kernel.psum_bufs)
        self.engines = Balancer(em)
        self.queues = _Queues(em, kernel.store_queues)
        self.c_tiles = [(c0, min(parts, self.cin - c0)) for c0 in range(0, self.cin, parts)]
        self.o_tiles = [(o0, min(parts, self.cout - o0)) for o0 in range(0, self.cout, parts)]
        self.epi = kernel.epilogue
        self.final = max(j for j, kind in enumerate(self.epi.kinds) if kind != "channel")  # the result's step
        self.slots = kernel.slots
        self.per_channel = kernel.channel_inputs
        self.views = kernel.views
        self.pairs = pairs = kernel.taps  # which taps (and rows) each matmul computes
        self.halves = pairs.halves  # 2: partitions [O, 2O) of the accumulator hold the next output row
        self.n_taps, self.n_matmuls, self.margin = len(g.taps), len(pairs.matmuls), pairs.delta
        self.band_elements = g.band_elements(tiling.band + self.halves - 1, pairs.delta)
        # each input buffer zeroed once: the columns of the padding are never written; the rows of the padding,
        # which move from band to band, are zeroed again with each band
        self.width, self.most = len(self.c_tiles) * self.band_elements, em.target.max_free_elements_sbuf
        self.used = min(self.cin, parts) * pairs.copies
        self.buffers = [self.made["input"].next() for _ in range(self.made["input"].bufs)]
        self.turn = iter(range(len(self.buffers) * (g.batch * -(-self.oh // tiling.band) + 1)))

    def emit(self) -> None:
        self._zero(self.buffers[0])  # the others before their first band
        self._zero_temporaries()
        self.raw = self.made["raw_weights"].next().ap(self.parts, 1)
        self.wtile = self.made["weights"].next().ap(self.parts, 1)
        self._zero_unused_weight_blocks()
        self.columns, rows = _per_channel_inputs(self.em, self.node, self.plan, self.kernel, self.queues, self.made,
                                                 self.o_tiles, self.used, self.halves)
        self._load_weights()
        bands = [(n, r0) for n in range(self.g.batch) for r0 in range(0, self.oh, self.tiling.band)]
        ahead = self._load_band(*bands[0])  # its memsets ahead of the per-channel steps on the engines
        if self.epi.scale is not None:
            _per_channel_rows(self.em, self.node, self.epi, self.engines, self.made, self.used, rows)
        self._arrange_weights(rows)
        _per_channel_columns(self.em, self.node, self.epi, self.engines, self.made, self.o_tiles, self.halves,
                             self.columns)  # after the weights: not waited for
        for index, (n, r0) in enumerate(bands):
            band = ahead
            if index + 1 < len(bands):  # the next band loads while this one is multiplied
                ahead = self._load_band(*bands[index + 1])
            height = min(self.tiling.band, self.oh - r0)
            for t, (o0, ot) in enumerate(self.o_tiles):
                result = self.made["result"].next().ap(self.parts, 1)
                for q0 in range(0, height, self.tiling.rows):
                    rows_here = min(self.tiling.rows, height - q0)
                    acc = self._accumulate(band, q0, rows_here, o0, ot)
                    self._epilogue(n, r0, q0, rows_here, t, o0, ot, acc, result)
                self._store(n, r0, height, o0, ot, result)

    # -- buffers ------------------------------------------------------------------------------------------

    def _zero(self, tile) -> None:
        for start in range(0, self.width, self.most):
            self.em.emit(Opcode.MEMSET, Engine.GPSIMD,
                         _free(tile.ap(self.parts, 1), start, self.used, (1, min(self.most, self.width - start))),
                         imm0=0.0)

    def _zero_temporaries(self) -> None:
        """Temporaries zeroed once too: the Scalar engine's activations read their rows whole (the dropped
        columns too)."""
        for name, pool in self.made.items():
            if name.startswith("temp"):
                for _ in range(pool.bufs):
                    self.engines.emit(Opcode.MEMSET, pool.next().ap(self.parts, 2 * self.tiling.rows // self.halves
                                                                     * self.pitch), imm0=0.0)

    def _load_band(self, n: int, r0: int):
        """The tile of the input rows of output rows [r0, r0 + band) of image n: its planes filled, the rows
        of the padding zeroed."""
        g, pairs = self.g, self.pairs
        (sh, sw), ((pt, _), (pl, _)) = g.strides, g.padding
        number = next(self.turn)
        if 0 < number < len(self.buffers):
            self._zero(self.buffers[number])
        tile = self.buffers[number % len(self.buffers)].ap(self.parts, self.width)
        rows = g.plane_rows(self.tiling.band)
        for j, (c0, ct) in enumerate(self.c_tiles):
            for ph in range(sh):
                t0, nt = _spans(r0 * sh + ph - pt, sh, rows, 0, g.height)
                for pw in range(sw):
                    u0, nu = _spans(pw - pl, sw, self.pitch, 0, g.width)
                    row, col = r0 * sh + ph + sh * t0 - pt, pw + sw * u0 - pl
                    for copy in range(pairs.copies):  # the shifted copy on partitions [C, 2C), delta elements earlier
                        plane = (j * self.band_elements + self.margin - copy * pairs.delta
                                 + (ph * sw + pw) * self.plane_elements)
                        for z0, z1 in ((0, t0), (t0 + nt, rows)):  # padding rows (all of them if nt is 0)
                            if z1 > z0:
                                self.engines.emit(Opcode.MEMSET, _from(_free(tile, plane + z0 * self.pitch, ct,
                                                                             (1, (z1 - z0) * self.pitch)), copy * ct),
                                                  imm0=0.0)
                        if nt and nu:
                            self.queues.load(
                                _free(tile, plane + t0 * self.pitch + u0, ct, (self.pitch, nt), (1, nu)),
                                self.input[n, c0:c0 + ct, row:row + nt * sh:sh, col:col + nu * sw:sw].ap,
                                partition=copy * ct)
        return tile

    # -- weights: w[o, c, kh, kw] loaded as it lies, [C tile, O, taps] (again on the partitions of the shifted
    # copy), then per matmul arranged on chip into its stationary [C tile (x 2), O (x 2)], each block a tap's
    # [C, O] (or zeros), each output channel's column times the epilogue's scale --------------------------

    @property
    def _m_size(self) -> int:
        """Columns of one matmul's stationary."""
        return self.cout * self.halves if self.halves == 2 else self.cout

    def _zero_unused_weight_blocks(self) -> None:
        if any(len(blocks) < self.pairs.copies * self.halves for _, blocks in self.pairs.matmuls):
            size = len(self.c_tiles) * self.n_matmuls * self._m_size
            for start in range(0, size, self.most):
                self.engines.emit(Opcode.MEMSET, _free(self.wtile, start, self.used, (1, min(self.most, size - start))),
                                  imm0=0.0)

    def _load_weights(self) -> None:
        cout, n_taps = self.cout, self.n_taps
        for j, (c0, ct) in enumerate(self.c_tiles):
            for copy in range(self.pairs.copies):
                self.queues.load(_free(self.raw, j * cout * n_taps, ct, (n_taps, cout), (1, n_taps)),
                                 self.weights[c0:c0 + ct].ap, partition=copy * ct)

    def _arrange_weights(self, rows: dict) -> None:
        epi, cout, n_taps = self.epi, self.cout, self.n_taps
        for j, (c0, ct) in enumerate(self.c_tiles):
            for m, (_, blocks) in enumerate(self.pairs.matmuls):
                for copy, mh, tap in blocks:
                    dst = _from(_free(self.wtile, (j * self.n_matmuls + m) * self._m_size + mh * cout, ct, (1, cout)),
                                copy * ct)
                    src = _from(_free(self.raw, j * cout * n_taps + tap, ct, (n_taps, cout)), copy * ct)
                    if epi.scale is None:
                        self.engines.emit(Opcode.TENSOR_COPY, dst, src)
                    elif epi.scale[0] == "imm":
                        self.engines.emit(Opcode.TENSOR_SCALAR, dst, src, alu=AluOp.MULTIPLY, imm0=float(epi.scale[1]))
                    else:
                        scale = _from(_free(rows[epi.scale], 0, ct, (1, cout)), copy * ct)
                        self.engines.emit(Opcode.TENSOR_TENSOR, dst, src, scale, alu=AluOp.MULTIPLY)

    def _stationary(self, j: int, m: int, o0: int, ot: int) -> AccessPattern:
        k_rows = self.c_tiles[j][1] * (2 if any(copy for copy, _, _ in self.pairs.matmuls[m][1]) else 1)
        return _free(self.wtile, (j * self.n_matmuls + m) * self._m_size + o0, k_rows, (1, ot * self.halves))

    # -- a block: output rows [r0 + q0, r0 + q0 + rows) of channels [o0, o0 + ot) of image n, into the band's
    # result: `lines` rows of `pitch` in PSUM, the output row r0 + q0 + halves * line + half on partitions
    # [half * ot, ...) ----------------------------------------------------------------------------------------

    def _accumulate(self, band, q0: int, rows: int, o0: int, ot: int) -> AccessPattern:
        """Every tap of every input-channel tile as one matmul into the block's PSUM accumulator."""
        halves, pitch = self.halves, self.pitch
        lines, width = rows // halves, ot * halves
        acc = self.psum.next().ap(width, lines * pitch)
        # With row pairs, line i of the block is output rows q0 + 2i (lower partitions) and q0 + 2i + 1 (upper):
        # its moving operand starts 2 * pitch further than line i - 1's, so one matmul reads every line through
        # two free dims (lines of `pitch` elements, `halves * pitch` apart) and writes them contiguously in PSUM.
        moving_dims = ((halves * pitch, lines), (1, pitch)) if halves == 2 and lines > 1 else ((1, lines * pitch),)
        for j, (c0, ct) in enumerate(self.c_tiles):
            for m, (a, blocks) in enumerate(self.pairs.matmuls):
                element = j * self.band_elements + self.margin + a + q0 * pitch
                k_rows = ct * (2 if any(copy for copy, _, _ in blocks) else 1)
                self.em.emit(Opcode.MATMUL, Engine.TENSOR, _free(acc, 0, width, (1, lines * pitch)),
                             self._stationary(j, m, o0, ot), _free(band, element, k_rows, *moving_dims),
                             accumulate=j + m > 0)
        return acc

    def _epilogue(self, n, r0, q0, rows, t, o0, ot, acc, result) -> None:
        """The epilogue's steps on the accumulator's kept columns, the last one into the result."""
        em, epi, halves, pitch, ow = self.em, self.epi, self.halves, self.pitch, self.ow
        body, kinds, made = epi.body, epi.kinds, self.made
        lines, width = rows // halves, ot * halves
        shape = (width, lines, ow)
        loaded = {("input", 0): _rows_of(acc, lines, pitch, ow)}
        row = r0 + q0
        for i, extra in enumerate(self.extras, start=2):
            if i in self.per_channel:
                continue
            values = HbmTensor.of(self.plan, extra, self.views[i], self.node.shape)  # [N, O, OH, OW]
            tile = made[f"extra{i}"].next().ap(*shape)
            for half in range(halves):
                first = row + half
                self.queues.load(_from(_free(tile, 0, ot, (ow, lines), (1, ow)), half * ot),
                                 values[n, o0:o0 + ot, first:first + lines * halves:halves, 0:ow].ap)
            loaded[("input", i - 1)] = tile
        temps: dict = {}
        results: dict = {}

        def tile_of(j):
            """The (block view, whole rows) of step j's tile: the result's, or a temporary's."""
            if j == self.final:
                whole = _free(result, q0 // halves * pitch, width, (1, lines * pitch))
            else:
                if self.slots[j] not in temps:
                    temps[self.slots[j]] = made[f"temp{self.slots[j]}"].next()
                whole = temps[self.slots[j]].ap(width, lines * pitch, dtype=body[j].dtype)
            return _rows_of(whole, lines, pitch, ow), whole

        if epi.folded is not None:  # acc * scale, plus the shift now unless an activation takes it as its bias
            if epi.shift is None or epi.biased is not None:
                results[epi.folded] = loaded[("input", 0)]
            else:
                view, whole = tile_of(epi.folded) if epi.folded == self.final else (None, None)
                if whole is None:
                    whole = made["shifted"].next().ap(width, lines * pitch)
                    view = _rows_of(whole, lines, pitch, ow)
                _activate(em, ActFunc.IDENTITY, whole, acc, epi.shift, self.columns, t, width, made)
                results[epi.folded] = view
        for j, (step, kind) in enumerate(zip(body, kinds)):
            if kind != "element":
                continue
            out, whole = tile_of(j)
            if j == epi.biased:  # func(x + shift), x the value so far read whole (with its dropped columns)
                (x_arg,) = [a for a in step.args if a[0] == "step"]
                source = results[x_arg[1]]
                source_whole = acc if source is loaded[("input", 0)] else _whole_of(source, lines, pitch)
                func = ActFunc.RELU if step.op is Op.MAXIMUM else ACTIVATIONS[step.op]
                _activate(em, func, whole, source_whole, epi.shift, self.columns, t, width, made)
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
                    args.append(_free(self.columns[(a, ref)], t, width, (0, lines), (0, ow)))
            self.engines.compute(step, out, args, made.get("constants"), self.node.loc)
            results[j] = out

    def _store(self, n, r0, height, o0, ot, result) -> None:
        """Stored by band, not by block: the stores of one image share HBM pages, so fewer and larger ones wait on
        each other less."""
        halves, lines = self.halves, height // self.halves
        self.queues.store([(self.out[n, o0:o0 + ot, r0 + half:r0 + half + lines * halves:halves, :].ap,
                            _from(_free(result, 0, ot, (self.pitch, lines), (1, self.ow)), half * ot))
                           for half in range(halves)])
