"""A partition broadcast (one HBM row DMA'd to many partitions: codegen's bias and norm-parameter tiles) writes, when
the program runs, only the partitions some instruction reads before a copy overwrites them; the outputs and the
timeline are those of the whole copy."""
from __future__ import annotations

import numpy as np

from neuronc.isa import AccessPattern, AluOp, DType, Engine, Opcode, Space
from neuronc.neff.program import TensorKind
from runtime import NeuronCore
from tests.test_runtime import Program, chip, done, hbm, uniform

SENTINEL = 0x5A  # a byte no float the programs below compute is made of


def _broadcast(t, partitions: int, width: int, offset: int = 0, partition: int = 0):
    """(the on-chip tile, the HBM source): HBM row ``t`` copied to ``partitions`` partitions from ``partition``."""
    return (chip((partitions, width), offset=offset, partition=partition),
            AccessPattern(Space.HBM, DType.F32, t.offset, ((0, partitions), (1, width))))


def _run(program, inputs):
    """(outputs, the SBUF bytes of partitions 0-127 at offsets 0-63 after the run): SBUF filled with SENTINEL
    first, so the bytes no instruction wrote still hold it."""
    core = NeuronCore("trn2")
    loaded = core.load(program)
    core.sbuf[:, :64] = SENTINEL
    result = loaded.run(inputs)
    return result, core.sbuf[:, :64].copy()


def _bias_added(reader_rows: int, then_overwritten: bool = False):
    """y[reader_rows, 8] = x + b, b broadcast to 64 partitions at SBUF offset 0; x at offset 32 (the same
    partitions). With ``then_overwritten`` a later copy loads z[64, 8] into b's bytes, and a second add reads
    them: y2 = z + z."""
    p = Program()
    b_t = p.tensor("b", TensorKind.INPUT, (1, 8))
    x_t = p.tensor("x", TensorKind.INPUT, (reader_rows, 8))
    y_t = p.tensor("y", TensorKind.OUTPUT, (reader_rows, 8))
    bias, source = _broadcast(b_t, 64, 8)
    x = chip((reader_rows, 8), offset=32)
    p.emit(Opcode.DMA_COPY, Engine.DMA, bias, source)
    p.emit(Opcode.DMA_COPY, Engine.DMA, x, hbm(x_t), queue=1)
    p.emit(Opcode.TENSOR_TENSOR, Engine.VECTOR, chip((reader_rows, 8), offset=48), x,
           chip((reader_rows, 8)), alu=AluOp.ADD, waits=done(Engine.DMA) + done(Engine.DMA, queue=1))
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(y_t), chip((reader_rows, 8), offset=48), queue=2,
           waits=done(Engine.VECTOR))
    if then_overwritten:
        z_t = p.tensor("z", TensorKind.INPUT, (64, 8))
        y2_t = p.tensor("y2", TensorKind.OUTPUT, (64, 8))
        p.emit(Opcode.DMA_COPY, Engine.DMA, chip((64, 8)), hbm(z_t), queue=3, waits=done(Engine.VECTOR))
        p.emit(Opcode.TENSOR_TENSOR, Engine.VECTOR, chip((64, 8), offset=48), chip((64, 8)), chip((64, 8)),
               alu=AluOp.ADD, waits=done(Engine.DMA, queue=3) + done(Engine.DMA, queue=2))
        p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(y2_t), chip((64, 8), offset=48), queue=2,
               waits=done(Engine.VECTOR, 2))
    return p.neff()


def test_a_broadcast_writes_only_the_partitions_read_before_they_are_overwritten():
    b, x = uniform(-1, 1, (1, 8)), uniform(-1, 1, (4, 8))
    result, sbuf = _run(_bias_added(4), [b, x])

    np.testing.assert_array_equal(result.outputs[0], x + b)
    assert (sbuf[4:64, :32] == SENTINEL).all()  # partitions 4-63 of the bias tile: read by nothing, not written
    np.testing.assert_array_equal(sbuf[:4, :32].view(np.float32), np.broadcast_to(b, (4, 8)))


def test_a_broadcast_read_on_every_partition_is_written_whole():
    b, x = uniform(-1, 1, (1, 8)), uniform(-1, 1, (64, 8))
    result, sbuf = _run(_bias_added(64), [b, x])

    np.testing.assert_array_equal(result.outputs[0], x + b)
    np.testing.assert_array_equal(sbuf[:64, :32].view(np.float32), np.broadcast_to(b, (64, 8)))


def test_a_broadcast_partition_overwritten_and_then_read_is_not_written_by_the_broadcast():
    """Partitions 4-63 are overwritten by a copy before the second add reads them: that read sees the copy's
    bytes, never the broadcast's, so the broadcast still writes partitions 0-3 only; both results are eager's."""
    b, x, z = uniform(-1, 1, (1, 8)), uniform(-1, 1, (4, 8)), uniform(-1, 1, (64, 8))
    loaded = NeuronCore("trn2").load(_bias_added(4, then_overwritten=True))
    broadcast = (loaded.streams.index((Engine.DMA, 0)), 0)
    assert {key: (rows.start, rows.stop) for key, rows in loaded._read_partitions().items()} == {broadcast: (0, 4)}
    result = loaded.run([b, x, z])
    np.testing.assert_array_equal(result.outputs[0], x + b)
    np.testing.assert_array_equal(result.outputs[1], z + z)


def test_a_broadcast_no_instruction_reads_makes_no_call_and_changes_no_result():
    """The upper half of a broadcast in two halves (codegen's 128-partition bias tile) when the reader uses only
    partition 0: that half runs no call; the timeline is the same as the program's without the trim."""
    p = Program()
    b_t = p.tensor("b", TensorKind.INPUT, (1, 8))
    y_t = p.tensor("y", TensorKind.OUTPUT, (1, 8))
    low, low_source = _broadcast(b_t, 64, 8)
    high, high_source = _broadcast(b_t, 64, 8, partition=64)
    p.emit(Opcode.DMA_COPY, Engine.DMA, low, low_source)
    p.emit(Opcode.DMA_COPY, Engine.DMA, high, high_source, queue=1)
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(y_t), chip((1, 8)), queue=2,
           waits=done(Engine.DMA) + done(Engine.DMA, queue=1))
    b = uniform(-1, 1, (1, 8))
    core = NeuronCore("trn2")
    loaded = core.load(p.neff())
    core.sbuf[:, :64] = SENTINEL
    result = loaded.run([b])

    np.testing.assert_array_equal(result.outputs[0], b)
    assert (core.sbuf[1:128, :32] == SENTINEL).all()
    assert len(loaded._plan.calls) == 2  # the low broadcast (partition 0 only) and the store
    whole = [e.end_ns for e in NeuronCore("trn2", check_uninitialised=True).load(p.neff()).time().events]
    assert [e.end_ns for e in result.timeline.events] == whole


def test_a_copy_over_part_of_a_broadcasts_bytes_does_not_end_what_the_broadcast_must_write():
    """x[8, 4] copied over the first half of each partition's bytes of an 8-partition broadcast of b[1, 8], then
    all 8 x 8 read: the second halves are the broadcast's, so every partition is written."""
    p = Program()
    b_t = p.tensor("b", TensorKind.INPUT, (1, 8))
    x_t = p.tensor("x", TensorKind.INPUT, (8, 4))
    y_t = p.tensor("y", TensorKind.OUTPUT, (8, 8))
    tile, source = _broadcast(b_t, 8, 8)
    p.emit(Opcode.DMA_COPY, Engine.DMA, tile, source)
    p.emit(Opcode.DMA_COPY, Engine.DMA, chip((8, 4)), hbm(x_t), queue=1, waits=done(Engine.DMA))
    p.emit(Opcode.DMA_COPY, Engine.DMA, hbm(y_t), tile, queue=2, waits=done(Engine.DMA, queue=1))
    b, x = uniform(-1, 1, (1, 8)), uniform(-1, 1, (8, 4))
    loaded = NeuronCore("trn2").load(p.neff())

    assert loaded._read_partitions() == {}
    np.testing.assert_array_equal(loaded.run([b, x]).outputs[0], np.concatenate([x, np.repeat(b[:, 4:], 8, 0)], 1))
