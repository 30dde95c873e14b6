"""Repeated layers compiled once (issue 24): the kernels of a model's identical layers are generated once per
signature and instantiated at each layer's addresses (neuronc/codegen/reuse.py). The NEFF is the one the kernels
emitted one by one make, byte for byte, in this very tree; and it computes what eager computes."""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import numpy as np
import pytest
import torch

from neuronc import compiler, ir
from neuronc.codegen import generate, reuse
from neuronc.compiler import CompileOptions, compile_exported, compile_graph
from neuronc.ir import Op
from neuronc.isa import DType, Space
from neuronc.neff import encode
from neuronc.neff.program import DebugLoc
from neuronc.passes import attention as attention_pass
from neuronc.passes.memory_plan import plan_memory
from neuronc.passes.tiling import Prologue
from runtime import run_neff
from tests import zoo
from tests.conftest import assert_matches_eager


@pytest.fixture(scope="module")
def three_layer_gpt2():
    torch.manual_seed(0)
    model = zoo.GPT2(vocab=64, width=64, layers=3, heads=2, context=32).eval()
    inputs = (torch.randint(0, 64, (1, 32)),)
    return model, inputs, torch.export.export(model, inputs)


def _compile(exported, monkeypatch, reuse_kernels: bool):
    monkeypatch.setattr(ir, "_ids", itertools.count())  # node ids name the NEFF's tensors: the same in both
    monkeypatch.setattr(compiler, "generate", functools.partial(generate, reuse=reuse_kernels))
    return compile_exported(exported)


def test_a_three_layer_model_makes_the_same_neff_with_and_without_kernel_reuse(three_layer_gpt2, monkeypatch):
    model, inputs, exported = three_layer_gpt2
    recorded, hits = [], []
    emit = reuse.KernelReuse.emit

    def counting(self, *args):
        emit(self, *args)
        recorded[:] = [len([r for r in self.recordings.values() if r is not None])]
        hits[:] = [self.hits]

    monkeypatch.setattr(reuse.KernelReuse, "emit", counting)
    reused = _compile(exported, monkeypatch, True)
    alone = _compile(exported, monkeypatch, False)
    layer_kernels = (len(reused.neff.kernels) - 3) // 3  # the embeddings, the final norm and the head aside
    # A layer's kernels at the same parity as the first layer's (odd kernels stack their SBUF pools from the top)
    # replay its recordings: the third layer's at least, but for the first layer's residual input (the embeddings)
    # and the last layer's output (the final norm's input), which may make their kernels differ.
    assert hits[0] >= layer_kernels - 2
    assert recorded[0] + hits[0] >= len(reused.neff.kernels) - 4  # nearly every kernel went through a recording
    assert encode(reused.neff) == encode(alone.neff)

    outputs = run_neff(reused.neff, [t.numpy() for t in inputs]).outputs
    with torch.no_grad():
        expected = model(*inputs)
    assert_matches_eager(torch.from_numpy(np.asarray(outputs[0])), expected)


def test_instances_whose_tensor_lies_at_one_address_share_its_hbm_operands(three_layer_gpt2, monkeypatch):
    # a recorded row's HBM operand is rebased once per base of its tensor (_Recording.instantiate): two instances
    # at one address (a layer's activations in the scratch slot of the layer two before) hold one pattern object,
    # which the hazard grid measures once
    _, _, exported = three_layer_gpt2
    seen = []
    emit = reuse.KernelReuse.emit

    def noting(self, em, *args):
        emit(self, em, *args)
        seen[:] = [(self, em)]

    monkeypatch.setattr(reuse.KernelReuse, "emit", noting)
    _compile(exported, monkeypatch, True)
    (kernels, em), = seen
    objects: dict = {}  # (recording, row, operand, value) -> the operand objects instances hold
    uses: dict = {}  # the same key -> how many instructions hold it
    for inst in em.instructions:
        key = kernels.price_keys.get(id(inst))
        for k, ap in enumerate(inst.operands):
            if key is not None and ap.space == Space.HBM:
                objects.setdefault((*key, k, ap), {})[id(ap)] = ap
                uses[(*key, k, ap)] = uses.get((*key, k, ap), 0) + 1
    assert all(len(made) == 1 for made in objects.values())
    assert max(uses.values()) > 1  # some instances do lie at one address


def test_a_reused_attention_kernels_tail_stores_turn_with_its_other_transfers(monkeypatch):
    """The attention kernel stores its last heads' output tiles on the queues its own transfers booked least
    (codegen/attention.py freest_queue, Emitter.dma_on): a reused instance, whose transfers the round robin turns,
    turns those queues with them, so the NEFF is the one the kernels emitted one by one make (the queues chosen for
    the recording's turn and left unturned made another: in the 12-layer GPT-2 forward, 2586.9 us against 2565.6)."""
    torch.manual_seed(0)
    model = zoo.GPT2(vocab=64, width=64, layers=2, heads=2, context=256).eval()
    exported = torch.export.export(model, (torch.randint(0, 64, (1, 256)),))
    # on the queues that free first on the kernel's estimated clock (queues_by_clock, taken here by the kernel's time):
    # every queue gets some of both layers' stores, and the NEFF is still the kernels' one by one
    assert encode(_compile(exported, monkeypatch, True).neff) == encode(_compile(exported, monkeypatch, False).neff)
    monkeypatch.setattr(attention_pass, "CLOCK_STORES_GAIN", math.inf)  # on the queues booked least, below
    instantiated = []
    instantiate = reuse._Recording.instantiate

    def noting(self, em, *args):
        instantiate(self, em, *args)
        instantiated.append(em.kernels[-1].name)

    monkeypatch.setattr(reuse._Recording, "instantiate", noting)
    reused = _compile(exported, monkeypatch, True)
    assert sum(name.startswith("attention") for name in instantiated) == 2  # both layers' from a recording
    stores: dict = {}  # attention kernel -> the queues of its stores, in order
    for insts in reused.neff.streams.values():
        for inst in insts:
            if inst.kernel >= 0 and reused.neff.kernels[inst.kernel].name.startswith("attention") \
                    and inst.operands[0].space is Space.HBM:
                stores.setdefault(inst.kernel, []).append(inst.queue)
    first, second = (sorted(queues) for queues in stores.values())
    assert first != second  # turned with each instance's round robin (left unturned: on the same queues in both)
    alone = _compile(exported, monkeypatch, False)
    assert encode(reused.neff) == encode(alone.neff)


def _add_chain(layers: int) -> ir.Graph:
    """x + w0, then + w1, ...: the same add kernel `layers` times on different weights."""
    x = ir.node(Op.PARAMETER, (), (256, 64), DType.F32, index=0, name="x", kind="input")
    params, node = [x], x
    for k in range(layers):
        w = ir.node(Op.PARAMETER, (), (256, 64), DType.F32, index=k + 1, name=f"w{k}", kind="input")
        params.append(w)
        node = ir.node(Op.ADD, (node, w), (256, 64), DType.F32)
    return ir.Graph(params, [node])


def test_each_instance_addresses_its_own_tensors():
    compiled = compile_graph(_add_chain(4), CompileOptions(opt_level=0))  # -O0: four add kernels, not one fused
    plan = plan_memory(compiled.graph)
    adds = [n for n in compiled.graph.nodes() if n.op is Op.ADD]
    assert len(adds) == len(compiled.neff.kernels) == 4
    instructions = [inst for stream in compiled.neff.streams.values() for inst in stream]
    nbytes = 256 * 64 * 4
    for k, add in enumerate(adds):
        touched = {ap.offset for inst in instructions if inst.kernel == k for ap in inst.operands
                   if ap.space is Space.HBM}
        own = [(plan.offset(n), plan.offset(n) + nbytes) for n in (*add.inputs, add)]
        assert all(any(lo <= a < hi for lo, hi in own) for a in touched)  # nothing but its own tensors
        assert all(any(lo <= a < hi for a in touched) for lo, hi in own)  # every one of them
    inputs = [np.random.default_rng(k).standard_normal((256, 64), dtype=np.float32) for k in range(5)]
    (out,) = run_neff(compiled.neff, inputs).outputs
    np.testing.assert_allclose(np.asarray(out), functools.reduce(np.add, inputs), rtol=1e-6)


def test_kernels_that_differ_in_an_op_or_a_shape_do_not_share_a_signature():
    x = ir.node(Op.PARAMETER, (), (256, 64), DType.F32, index=0, name="x", kind="input")
    w = ir.node(Op.PARAMETER, (), (256, 64), DType.F32, index=1, name="w", kind="input")
    v = ir.node(Op.PARAMETER, (), (256, 32), DType.F32, index=2, name="v", kind="input")
    first, second = ir.node(Op.ADD, (x, w), (256, 64), DType.F32), ir.node(Op.ADD, (w, x), (256, 64), DType.F32)
    product = ir.node(Op.MULTIPLY, (x, w), (256, 64), DType.F32)
    narrow = ir.node(Op.ADD, (v, v), (256, 32), DType.F32)
    plan = plan_memory(ir.Graph([x, w, v], [first, second, product, narrow]))
    keys = [reuse.signature(n, plan)[0] for n in (first, second, product, narrow)]
    assert keys[0] == keys[1]  # the same kernel on other tensors
    assert len({keys[0], keys[2], keys[3]}) == 3


def test_the_attention_pass_composes_each_layers_view_chains_once_with_the_same_neff(three_layer_gpt2, monkeypatch):
    """passes/attention.py fits each distinct chain of reshapes and views (q, k, v split out of one projection, the
    output merged back) once, keyed by the chain's shapes and view attributes: the layers share the fits, and the
    program is the one fitting every chain anew makes (a key too coarse to tell two chains apart would differ)."""
    from neuronc.passes import attention

    _, _, exported = three_layer_gpt2
    fitted = (attention._fitted_chain, attention._fitted_inverse)
    for memo in fitted:
        memo.cache_clear()
    shared = _compile(exported, monkeypatch, True)
    hits = [memo.cache_info().hits for memo in fitted]
    for memo in fitted:
        monkeypatch.setattr(attention, memo.__name__, memo.__wrapped__)  # every chain fitted anew
    anew = _compile(exported, monkeypatch, True)
    assert sum(n.op is Op.ATTENTION for n in shared.graph.nodes()) == 3
    assert hits[0] >= 2 * 2  # two layers' operand chains (at least q and k: v may merge symbolically) reuse the first's
    assert encode(shared.neff) == encode(anew.neff)


def _transposed_columns(source, offset: int) -> ir.Node:
    """Columns offset..offset+3 of a [4, 8] source, then transposed: a view of a view (composed numerically)."""
    columns = ir.node(Op.VIEW, (source,), (4, 4), DType.F32, offset=offset, strides=(8, 1))
    return ir.node(Op.VIEW, (columns,), (4, 4), DType.F32, offset=0, strides=(1, 4))


def test_view_chains_that_differ_only_in_an_offset_are_fitted_apart():
    from neuronc.passes import attention

    first = ir.node(Op.PARAMETER, (), (4, 8), DType.F32, index=0, name="a", kind="input")
    second = ir.node(Op.PARAMETER, (), (4, 8), DType.F32, index=1, name="b", kind="input")
    assert attention._composed_view(_transposed_columns(first, 0)) == (first, 0, (1, 8))
    assert attention._composed_view(_transposed_columns(second, 0)) == (second, 0, (1, 8))  # its own source
    assert attention._composed_view(_transposed_columns(first, 4)) == (first, 4, (1, 8))


def test_copies_of_a_recorded_instruction_are_priced_once_and_alike(three_layer_gpt2, monkeypatch):
    import neuronc.codegen as codegen
    from neuronc import stream_timing
    from neuronc.targets import get_target

    priced, price = [], stream_timing.instruction_cost_ns
    monkeypatch.setattr(stream_timing, "instruction_cost_ns", lambda i, t: priced.append(i) or price(i, t))
    estimates, estimate = [], stream_timing.estimate_streams

    def counting(streams, target, same_price=None):
        priced.clear()
        result = estimate(streams, target, same_price)
        estimates.append((streams, dict(same_price or {}), len(priced), result))
        return result

    monkeypatch.setattr(codegen, "estimate_streams", counting)
    _compile(three_layer_gpt2[2], monkeypatch, True).neff.estimated_ns  # (computed when read: test_estimate_on_read)
    assert estimates
    # the program's estimate, read last: kernels the passes time at -O2 (choice_time, unless a kernel price cached by
    # an earlier compile in this process answers) are generated alone, without reuse, and estimated before it
    streams, keys, count, (makespan, kernel_ns) = estimates[-1]
    instructions = sum(len(s) for s in streams.values())
    assert len(set(keys.values())) < len(keys)  # rows of one recording copied into several kernels
    assert count == instructions - len(keys) + len(set(keys.values()))  # one price per row, not per copy
    # every instruction priced on its own gives the same estimate, kernel by kernel
    assert estimate(streams, get_target("trn2")) == (makespan, kernel_ns)


def test_chained_matmul_kernels_are_recorded_once_and_locate_each_instance_at_its_own_first_matmul(monkeypatch):
    """A matmul chain's first matmul emits its instructions at its own source location (Emitter.locate): the
    signature numbers that location and each instance takes its own, so the chained kernels of identical blocks share
    a recording (before: no signature, each generated anew) and the NEFF, debug table included, is the same bytes."""
    torch.manual_seed(0)
    blocks = [m for _ in range(5) for m in (torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64),
                                            torch.nn.Tanh())]
    model = torch.nn.Sequential(*blocks).eval().to(torch.bfloat16)
    exported = torch.export.export(model, (torch.randn(300, 64).to(torch.bfloat16),))
    chained, record = [], reuse.KernelReuse._record

    def noting(self, em, kernel, node, plan, numbered, locs):
        found = record(self, em, kernel, node, plan, numbered, locs)
        if node.attrs.get("chain") is not None:
            chained.append(found)
        return found

    monkeypatch.setattr(reuse.KernelReuse, "_record", noting)
    hits = []
    emit = reuse.KernelReuse.emit

    def counting(self, *args):
        emit(self, *args)
        hits[:] = [self.hits]

    monkeypatch.setattr(reuse.KernelReuse, "emit", counting)
    reused = _compile(exported, monkeypatch, True)
    assert chained and all(found is not None and found.located for found in chained)
    assert hits[0] >= 2  # five chained blocks, at most three signatures (the first block's input, two parities)
    assert encode(reused.neff) == encode(_compile(exported, monkeypatch, False).neff)


def _compile_add_chain(monkeypatch, reuse_kernels: bool):
    monkeypatch.setattr(ir, "_ids", itertools.count())  # node ids name the NEFF's tensors: the same in both
    monkeypatch.setattr(compiler, "generate", functools.partial(generate, reuse=reuse_kernels))
    return compile_graph(_add_chain(6), CompileOptions(opt_level=0))  # -O0: six add kernels, not one fused


def test_a_signature_met_at_both_kernel_parities_runs_its_kernel_once(monkeypatch):
    """An odd kernel's SBUF pools stack from the top: the other parity's recording is the first one with each SBUF
    operand moved to its pool's other base, not a second run of the kernel; the NEFF is the same bytes."""
    recorded, used = [], set()
    record, emit = reuse.KernelReuse._record, reuse.KernelReuse.emit

    def noting_records(self, em, kernel, node, plan, numbered, locs):
        recorded.append((reuse.signature(node, plan)[0], (len(em.kernels) - 1) % 2))
        return record(self, em, kernel, node, plan, numbered, locs)

    def noting_uses(self, em, kernel, node, plan):
        used.add((reuse.signature(node, plan)[0], (len(em.kernels) - 1) % 2))
        emit(self, em, kernel, node, plan)

    monkeypatch.setattr(reuse.KernelReuse, "_record", noting_records)
    monkeypatch.setattr(reuse.KernelReuse, "emit", noting_uses)
    reused = _compile_add_chain(monkeypatch, True)
    both = {key for key, parity in used if (key, 1 - parity) in used}
    assert both  # the middle adds' signature is met at both parities
    assert sorted(key for key, _ in recorded) == sorted(set(key for key, _ in recorded))  # each run once
    assert encode(reused.neff) == encode(_compile_add_chain(monkeypatch, False).neff)


def test_equal_plans_are_printed_once_with_the_signatures_unchanged(three_layer_gpt2, monkeypatch):
    """Each layer's kernels carry their own plan objects, equal from layer to layer: the signature prints a plan's
    text once per distinct value (keyed by its pickle) and every key is the one printed afresh."""
    _check_plan_texts(three_layer_gpt2[2], monkeypatch)


def _prologue_adds(prologue_locs: list, **attrs) -> tuple:
    """ADD nodes at m.py:10, 20, ... each with a norm prologue located at the given location; their memory plan."""
    x = ir.node(Op.PARAMETER, (), (256, 64), DType.F32, index=0, name="x", kind="input")
    w = ir.node(Op.PARAMETER, (), (256, 64), DType.F32, index=1, name="w", kind="input")
    adds = [ir.node(Op.ADD, (x, w), (256, 64), DType.F32, DebugLoc("m.py", 10 * (k + 1)),
                    prologue=Prologue(split=1, operand=0, dtype=DType.F32, attrs={"rows": 256, **attrs}, loc=loc))
            for k, loc in enumerate(prologue_locs)]
    return adds, plan_memory(ir.Graph([x, w], adds))


def _printed_prologues(monkeypatch) -> list:
    printed: list = []
    value = reuse._Signature.value

    def counting(self, v, indent=None):
        if isinstance(v, Prologue):
            printed.append(v)
        return value(self, v, indent)

    monkeypatch.setattr(reuse._Signature, "value", counting)
    return printed


def test_a_plan_that_names_a_location_is_printed_once_as_a_template_its_locations_filled_in(monkeypatch):
    """A norm prologue's plan holds the norm's source location, each layer's own, which each signature numbers: its
    text is kept as a template keyed by its pickle without the locations, and each signature fills in its own. The
    signatures (keys and locations) are those printed afresh, whether the prologue's location is the kernel's own
    (loc0) or another (loc1)."""
    locs = [DebugLoc("m.py", 11), DebugLoc("m.py", 21), DebugLoc("m.py", 30), DebugLoc("m.py", 41),
            DebugLoc("m.py", 51)]
    adds, plan = _prologue_adds(locs)
    fresh = [reuse.signature(n, plan) for n in adds]
    printed = _printed_prologues(monkeypatch)
    texts: dict = {}
    assert [reuse.signature(n, plan, texts) for n in adds] == fresh
    assert fresh[2][0] != fresh[0][0] == fresh[1][0] == fresh[3][0]  # m.py:30's prologue is at the kernel's loc0
    assert [loc.line for loc in fresh[3][2]] == [40, 41]
    assert len(printed) == 2  # the first afresh (its type then keyed apart), the second as the template
    assert texts[Prologue] is reuse._APART


def test_a_plan_that_names_a_node_is_printed_afresh(monkeypatch):
    """A record whose text numbers a node is not kept (a node's pickle holds its whole graph): its type is printed
    afresh from then on, and each key is the one printed afresh."""
    y = ir.node(Op.PARAMETER, (), (4,), DType.F32, index=2, name="y", kind="input")
    adds, plan = _prologue_adds([DebugLoc("m.py", 11), DebugLoc("m.py", 21), DebugLoc("m.py", 31)], node=y)
    fresh = [reuse.signature(n, plan) for n in adds]
    printed = _printed_prologues(monkeypatch)
    texts: dict = {}
    assert [reuse.signature(n, plan, texts) for n in adds] == fresh
    assert len(printed) == 3
    assert texts == {Prologue: False}


def test_a_bf16_gpt2s_norm_prologues_are_printed_as_templates_with_the_signatures_unchanged(monkeypatch):
    """The bf16 GPT-2 folds each layer norm into its matmul (passes/norm_prologue.py): the prologues, each at its own
    layer's location, are printed once per template and every signature is the one printed afresh."""
    torch.manual_seed(0)
    model = zoo.GPT2(vocab=256, width=128, layers=2, heads=4, context=128).eval().to(torch.bfloat16)
    inputs = (torch.randint(0, 256, (1, 128)),)
    texts = _check_plan_texts(torch.export.export(model, inputs), monkeypatch)
    assert texts[Prologue] is reuse._APART
    assert sum(isinstance(kept, tuple) for kept in texts.values()) >= 2  # templates kept, filled in by later layers


def _check_plan_texts(exported, monkeypatch) -> dict:
    """The signatures of `exported`'s kernels with one memo of plan texts, checked against fresh ones; the memo."""
    kernels = []
    signature = reuse.signature

    def noting(node, plan, texts=None):
        kernels.append((node, plan))
        return signature(node, plan, texts)

    monkeypatch.setattr(reuse, "signature", noting)
    _compile(exported, monkeypatch, True)
    monkeypatch.undo()
    printed = []
    value = reuse._Signature.value

    def counting(self, v, indent=None):
        if dataclasses.is_dataclass(v):
            printed.append(v)
        return value(self, v, indent)

    monkeypatch.setattr(reuse._Signature, "value", counting)
    texts: dict = {}
    remembered = [reuse.signature(node, plan, texts) for node, plan in kernels]
    with_memo, printed[:] = len(printed), []
    fresh = [reuse.signature(node, plan) for node, plan in kernels]
    assert remembered == fresh
    assert 0 < with_memo < len(printed)  # the later layers' plans were not printed again
    return texts
