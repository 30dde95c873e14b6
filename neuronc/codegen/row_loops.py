"""One program for every row count of a row-independent op (an elementwise op at a fixed row width): the op's
programs compiled for tiles of a few row counts become the bodies of hardware loops (neuronc/isa.py, "Registers
and loops").

``blocks`` are the tile row counts, largest first, each dividing the one before (128, 64, ..., 1). Register 0
counts the full tiles of ``blocks[0]`` rows, register j the tiles of ``blocks[j]`` rows in the remainder (0 to
blocks[j-1] / blocks[j] - 1, so with halving blocks each remainder loop runs 0 or 1 times): n rows are
sum(count_j * blocks[j]), no row padded. Loop j's body is the program of ``blocks[j]`` rows with the offsets of
its row-sliced inputs and outputs moved by the rows of the larger tiles before it (a term per register) and by
its own tiles (a term in the loop index). The other operands (0-d values, a tile's weights, constants and scratch)
keep theirs. Exact when every result row is computed from the same rows of the inputs alone, which the caller
decides (eager: pointwise ops on operands of the result's shape).
"""
from __future__ import annotations

import dataclasses

from neuronc.isa import LOOP_INDEX, Space
from neuronc.neff.program import KernelInfo, Loop, Neff, Register, TensorEntry, TensorKind
from neuronc.neff.rules import TensorIndex, hbm_span

ALIGNMENT = 64  # bytes between the tensors of the program (a stated choice, as codegen's HBM plans align)


def _rows_of(t: TensorEntry, block: int) -> bool:
    return len(t.shape) >= 1 and t.shape[0] == block


def row_program(tiles: dict, blocks: tuple, max_tiles: int, name: str) -> Neff:
    """The program serving 0 to ``max_tiles * blocks[0] + blocks[0] - 1`` rows from ``tiles`` (block -> the static
    Neff of that many rows; its inputs and outputs of ``block`` rows are row-sliced, the others the same in every
    tile program). Raises ValueError when the tile programs do not have that form."""
    first = tiles[blocks[0]]
    registers = [Register("tiles", 0, max_tiles)] + [Register(f"rows{b}", 0, a // b - 1)
                                                     for a, b in zip(blocks, blocks[1:])]
    row_terms = tuple((r, b) for r, b in enumerate(blocks))
    capacity = max_tiles * blocks[0] + blocks[0] - 1
    tensors, offset = [], 0

    def place(entry: TensorEntry) -> TensorEntry:
        nonlocal offset
        offset += -offset % ALIGNMENT
        placed = dataclasses.replace(entry, offset=offset)
        offset += placed.nbytes
        tensors.append(placed)
        return placed

    sliced, shared = {}, {}  # (kind, index) -> the program's entry
    for t in first.tensors:
        if t.kind not in (TensorKind.INPUT, TensorKind.OUTPUT):
            continue
        if _rows_of(t, blocks[0]):
            sliced[(t.kind, t.index)] = place(dataclasses.replace(t, shape=(capacity, *t.shape[1:]), rows=row_terms))
        elif t.kind == TensorKind.OUTPUT:
            raise ValueError(f"output {t.name!r} of {list(t.shape)} is not sliced by rows")
        else:
            shared[(t.kind, t.index)] = place(t)
    loops, kernels, debug_locs = [], [], []
    for level, block in enumerate(blocks):
        tile = tiles[block]
        if tile.loops or tile.registers:
            raise ValueError("a tile program has loops of its own")
        mapping = {}  # the tile's entry name -> (the program's entry, row-sliced)
        for t in tile.tensors:
            key = (t.kind, t.index)
            same = key in sliced and t.shape[1:] == sliced[key].shape[1:] and t.dtype == sliced[key].dtype
            if same and _rows_of(t, block):
                mapping[t.name] = (sliced[key], True)
            elif key in shared and t.shape == shared[key].shape and t.dtype == shared[key].dtype:
                mapping[t.name] = (shared[key], False)
            elif t.kind in (TensorKind.INPUT, TensorKind.OUTPUT):
                raise ValueError(f"the {block}-row program's {t.kind.name.lower()} {t.name!r} "
                                 f"does not match the others'")
            else:  # its own weights, constants and scratch
                mapping[t.name] = (place(dataclasses.replace(t, name=f"{t.name}@{block}")), False)
        if any(t.kind in (TensorKind.INPUT, TensorKind.OUTPUT) and t.name not in mapping for t in tile.tensors):
            raise ValueError("unmatched tensors")
        row_bytes = {name: entry.nbytes // entry.shape[0] for name, (entry, rows) in mapping.items() if rows}
        before = tuple((r, blocks[r]) for r in range(level))  # the rows of the larger tiles before this loop's
        move = _Mover(TensorIndex(tile.tensors), mapping, row_bytes, before, block)
        k0, d0 = len(kernels), len(debug_locs)
        kernels += [KernelInfo(f"{k.name}@{block}", k.ops, k.debug + d0 if k.debug >= 0 else -1)
                    for k in tile.kernels]  # (not the tile's estimate: reading a pending one would compute it)
        debug_locs += list(tile.debug_locs)
        streams = {key: [dataclasses.replace(i, operands=tuple(map(move, i.operands)),
                                             kernel=i.kernel + k0 if i.kernel >= 0 else -1,
                                             debug=i.debug + d0 if i.debug >= 0 else -1) for i in stream]
                   for key, stream in tile.streams.items()}
        loops.append(Loop(level, streams))
    offset += -offset % ALIGNMENT
    return Neff(name, first.target, tensors, {}, offset, debug_locs=debug_locs, kernels=kernels,
                compiler_version=first.compiler_version, registers=registers, loops=loops)


class _Mover:
    """A tile program's operand in the looped program: an HBM one in its tensor's new place, moved by the rows
    before its loop's tiles (``before``: (register, rows) of the larger tiles) and by the loop index when its
    tensor is row-sliced. One object per operand: the tile's instructions share their patterns."""

    def __init__(self, index: TensorIndex, mapping: dict, row_bytes: dict, before: tuple, block: int):
        self.index, self.mapping, self.row_bytes, self.before, self.block = index, mapping, row_bytes, before, block
        self.moved: dict = {}

    def __call__(self, ap):
        if ap.space != Space.HBM:
            return ap
        done = self.moved.get(ap)
        if done is None:
            t = self.index.covering(*hbm_span(ap))
            entry, rows = self.mapping[t.name]
            terms = ()
            if rows:
                row = self.row_bytes[t.name]
                terms = tuple((r, b * row) for r, b in self.before) + ((LOOP_INDEX, self.block * row),)
            done = self.moved[ap] = dataclasses.replace(ap, offset=entry.offset + ap.offset - t.offset, terms=terms)
        return done
