"""Scale-out on the emulated timeline: estimated device time per training step of GPT-2-small on 1, 2, 4 and 8
NeuronCores of one trn2 chip, data parallel, FSDP2-style and tensor parallel; the share of the communication
hidden behind compute; the scaling efficiency.

    python -m benchmarks.scaling [--ranks 1 2 4 8] [--strategies dp fsdp tp] [--batch 1] [--seq 1024]
                                 [--layers 12] [--whole] [--quick] [--target trn2]

How it measures. One process compiles the training step a rank runs (forward and backward graphs of
torch.compile, through neuronc) for each strategy and group size, against a fake process group of that size
(torch's "fake" backend: nothing is sent, only the graphs are traced), and times the NEFFs without running them:
each NEFF's timeline is the emulator's schedule of every engine, the collective engine included
(neuronc.stream_timing.replay, the simulation the runtime's clock runs: LoadedProgram.time() gives the same
makespan), and a program's times depend on the program and the target only, never on its data. So nothing is
computed: the numerics, the same on every rank, would not change the timeline. Parallelism is expressed the way
it reaches compiled graphs, as DTensor collectives the frontend turns into collective instructions:
* dp: every parameter replicated; its gradient all-reduced in the backward graph (SimpleFSDP's "replicate").
* fsdp: every parameter sharded on its first dimension and all-gathered where it is used; its gradient
  reduce-scattered (SimpleFSDP's "fully_shard", which is what FSDP2's all-gathers and reduce-scatters are).
  AOTAutograd's partitioner saves the gathered weights for the backward graph instead of gathering them again,
  so this is one all-gather per parameter and step, not FSDP2's reshard after forward (two). bf16 parameters in
  the computation, fp32 gradients reduced, fp32 master weights (FSDP2's MixedPrecisionPolicy(bf16, fp32)).
  GPT-2's head reads the token embedding's parameter (the tie kept: one weight, gathered once per forward).
* tp: Megatron-style column/row-parallel MLPs, vocabulary-parallel embedding and head, sequence-parallel norms
  (tests/parallel_training.py's plan; attention computed whole on every rank), bf16.
The collectives' times come from the interconnect model (neuronc/collective_cost.py, with the target's numbers).
Every collective of a graph may start as soon as its input exists (the program's semaphores): an all-gather of
a later weight runs during earlier compute, as FSDP2's prefetch does, and a gradient's reduction during the rest
of the backward pass.

Granularity. By default the step is compiled block by block, as torchtitan compiles a transformer (each block
its own torch.compile region): one transformer block's forward and backward graphs, and the rest of the model
(embeddings, final norm, tied head, loss) as one forward and one backward graph. The step's device time is the
rest's graphs plus ``layers`` launches of the block's graphs, one after the other: every block runs the same
programs, so their timelines are equal (not an extrapolation). Collectives overlap compute only within their own
graph (a block's all-gathers are not prefetched during the previous block, as FSDP2's eager hooks would), so
this is the less favourable case for hiding communication. The block's backward starts from a given gradient of
its output (the next block's), the rest's from its loss. ``--whole`` compiles the step as one forward and one
backward graph instead (collectives free to overlap any compute; the compile time grows with the depth: hours
for 12 layers on 2 shared cores).

The optimizer step (AdamW over the rank's parameters: fp32 param, grad, two moments read, three written, 28
bytes per parameter) is charged at the core's HBM bandwidth: a stated choice, not compiled. The parameters a
rank holds are counted from its shards (tensor parallelism replicates attention's).

Weak scaling (dp, fsdp): each rank keeps its batch (--batch sequences of --seq tokens), so the ideal step time is
flat, and efficiency(N) = step(1) / step(N). Strong scaling (tp): the batch is the same at every N, ideally
step(1) / N, and efficiency(N) = step(1) / (N x step(N)) (step(1): the first rank count measured). Hidden share:
of the collective engine's busy time, the part during which another engine or DMA queue is busy too.

GPT-2-small: the zoo's GPT2 with width 768, 12 layers, 12 heads, context 1024, vocabulary 50304 (50257 padded to
a multiple of 64, as nanoGPT does, so that 8 ranks divide it). --quick: 2 layers, 128 tokens.
Nothing is asserted: it prints measurements.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch
import torch.distributed as dist

from neuronc.collective_cost import chip_layout
from neuronc.isa import Engine

FULL = dict(vocab=50304, width=768, layers=12, heads=12, context=1024)


# ---- compiling one rank's training step ----------------------------------------------------------------------

def _fake_outputs(gm):
    """A function returning zeros shaped as ``gm``'s outputs (an argument it returns: itself): the compiled graphs
    are timed, not run."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    outputs = list(gm.graph.output_node().args[0])
    given = {i: placeholders.index(o) for i, o in enumerate(outputs) if o in placeholders}
    metas = [getattr(o, "meta", {}).get("val") if o is not None else None for o in outputs]

    def run(args):  # a boxed call: one list of the arguments
        return [args[given[i]] if i in given else None if m is None else torch.zeros(m.shape, dtype=m.dtype)
                for i, m in enumerate(metas)]

    run._boxed_call = True
    return run


def compile_step(model, inputs, target: str, grad=None) -> list:
    """The Compiled graphs (forward, backward, ...) of one training step of ``model`` on ``inputs``: its output
    (a loss) backpropagated, or with ``grad``, backpropagated from that gradient (a block inside a model)."""
    from torch._dynamo.backends.common import aot_autograd

    from neuronc.compiler import CompileOptions, compile_fx
    from neuronc.frontend.torch_import import decomposition_table

    compiled, options = [], CompileOptions(target=target)

    def compiler(gm, _inputs):
        run = _fake_outputs(gm)
        compiled.append(compile_fx(gm, options))
        return run

    torch._dynamo.reset()
    step = torch.compile(model, backend=aot_autograd(fw_compiler=compiler, bw_compiler=compiler,
                                                     decompositions=decomposition_table()))
    from torch.nn.utils import parametrize

    with parametrize.cached():  # a parameter used twice (a tied weight) is gathered once
        out = step(*inputs)
    out.backward(grad)
    return compiled


# ---- the strategies (DTensor parametrizations, as SimpleFSDP does) -------------------------------------------

class _Gathered(torch.nn.Module):
    """A parameter kept as a DTensor (sharded or replicated), used whole: redistributed to Replicate in the
    computation's dtype; its gradient leaves as Partial and is reduced (reduce-scatter to the shard, or
    all-reduce) in the reduction dtype."""

    def __init__(self, param_dtype, reduce_dtype):
        super().__init__()
        self.param_dtype, self.reduce_dtype = param_dtype, reduce_dtype

    def forward(self, x):
        from torch.distributed.tensor import Partial, Replicate

        return x.redistribute(placements=(Replicate(),), forward_dtype=self.param_dtype,
                              backward_dtype=self.reduce_dtype).to_local(grad_placements=(Partial(),))


class _TiedHead(torch.nn.Module):
    """GPT-2's head as the tie means it: the token embedding's weight read through its module, so that the
    parametrized weight is one parameter, cast and gathered once per forward (parametrize.cached) and its
    gradient reduced once (redistributing a parameter per module untied it: two parameters, two gathers)."""

    def __init__(self, tokens):
        super().__init__()
        self._tokens = [tokens]  # not a submodule: the embedding's parameter stays the embedding's

    def forward(self, x):
        return torch.nn.functional.linear(x, self._tokens[0].weight)


def _data_parallel(model, mesh, shard: bool):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.nn.utils import parametrize

    if getattr(model, "head", None) is not None and model.head.weight is model.tokens.weight:
        model.head = _TiedHead(model.tokens)
    placement = Shard(0) if shard else Replicate()
    for module in list(model.modules()):
        for name, p in list(module.named_parameters(recurse=False)):
            module.register_parameter(name, torch.nn.Parameter(distribute_tensor(p.data, mesh, [placement])))
            parametrize.register_parametrization(module, name, _Gathered(torch.bfloat16, torch.float32),
                                                 unsafe=True)
    return model


def _tensor_parallel(model, mesh):
    from tests.parallel_training import _tensor_parallel as plan

    model = plan(model.to(torch.bfloat16), mesh)
    return model


STRATEGIES = {
    "dp": lambda model, mesh: _data_parallel(model, mesh, shard=False),
    "fsdp": lambda model, mesh: _data_parallel(model, mesh, shard=True),
    "tp": _tensor_parallel,
}
WEAK = {"dp", "fsdp"}




def _block_tensor_parallel(block, mesh, width: int, heads: int):
    """One block with the whole model's tensor-parallel plan (its ``blocks.0.`` entries): its input and output
    are the rank's slice of the sequence, as between the blocks of the whole model."""
    from torch.distributed.tensor.parallel import parallelize_module

    from tests.parallel_training import tensor_parallel_plan
    from tests.zoo import GPT2

    prefix = "blocks.0."
    plan = {k[len(prefix):]: v for k, v in tensor_parallel_plan(GPT2(vocab=8, width=width, layers=1, heads=heads,
                                                                      context=8)).items() if k.startswith(prefix)}
    return parallelize_module(block.to(torch.bfloat16), mesh, plan)


@contextlib.contextmanager
def _fake_group(ranks: int):
    """A device mesh over a fake process group of ``ranks`` (this process is rank 0; nothing is sent)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ranks)
    try:
        yield init_device_mesh("cpu", (ranks,))
    finally:
        dist.destroy_process_group()


def local_parameters(module) -> int:
    """The parameters a rank holds (its shards), which its optimizer steps over."""
    from torch.distributed.tensor import DTensor

    return sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in module.parameters())


def step_graphs(strategy: str, ranks: int, config: dict, batch: int, seq: int, target: str) -> tuple:
    """(the compiled graphs of one rank's whole training step: the model as one forward and one backward graph,
    the parameters the rank holds)."""
    from tests.zoo import GPT2

    with _fake_group(ranks) as mesh:
        torch.manual_seed(0)
        model = STRATEGIES[strategy](GPT2(**config), mesh)
        if strategy == "tp":
            model.head.weight = model.tokens.weight
        generator = torch.Generator().manual_seed(1)
        idx = torch.randint(0, config["vocab"], (batch, seq), generator=generator)
        if strategy != "tp":
            return compile_step(model, (idx, idx.roll(-1, 1)), target), local_parameters(model)
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():  # around the compiled call, as a user writes it: Dynamo does not trace it inside
            return compile_step(model, (idx, idx.roll(-1, 1)), target), local_parameters(model)


def block_graphs(strategy: str, ranks: int, config: dict, batch: int, seq: int, target: str) -> tuple:
    """One rank's training step compiled block by block, as torchtitan compiles a transformer: ((graphs of the
    rest of the model: embeddings, final norm, head and loss, forward and backward; the parameters the rank holds
    of them), (graphs of one transformer block, forward and backward; its parameters the rank holds)). Every
    block of the model runs the block's programs."""
    from tests.zoo import TransformerBlock

    ends = step_graphs(strategy, ranks, {**config, "layers": 0}, batch, seq, target)
    with _fake_group(ranks) as mesh:
        torch.manual_seed(0)
        block = TransformerBlock(config["width"], config["heads"])
        if strategy == "tp":
            block, rows = _block_tensor_parallel(block, mesh, config["width"], config["heads"]), seq // ranks
        else:
            block, rows = STRATEGIES[strategy](block, mesh), seq
        generator = torch.Generator().manual_seed(1)
        x = torch.randn(batch, rows, config["width"], generator=generator, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.randn(batch, rows, config["width"], generator=generator, dtype=torch.bfloat16)
        return ends, (compile_step(block, (x,), target, grad), local_parameters(block))


# ---- measuring the timeline -------------------------------------------------------------------------------

def _union(spans: list) -> list:
    merged = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _overlap(a: list, b: list) -> float:
    """Length of the intersection of two unions of intervals."""
    total, j = 0.0, 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            total += min(end, b[k][1]) - max(start, b[k][0])
            k += 1
    return total


def measure(compiled: list, target: str) -> dict:
    """Device time of the graphs run one after the other, and their collective engine's busy and hidden time.
    Each NEFF's timeline is the emulator's schedule without running it (neuronc.stream_timing.replay: the
    simulation the runtime's clock runs, so its makespan is LoadedProgram.time()'s; no data is needed, since
    times depend on the program and the target only)."""
    from neuronc.stream_timing import replay
    from neuronc.targets import get_target

    total = comm = hidden = 0.0
    for c in compiled:
        collective, compute, makespan = [], [], 0.0
        for instr, start, end in replay(c.neff.streams, get_target(target)):
            (collective if instr.engine == Engine.COLLECTIVE else compute).append((start, end))
            makespan = max(makespan, end)
        collective, compute = _union(collective), _union(compute)
        total += makespan
        comm += sum(end - start for start, end in collective)
        hidden += _overlap(collective, compute)
    return {"graph_ns": total, "comm_ns": comm, "hidden_ns": hidden, "graphs": len(compiled)}


def _times(m: dict, times: int) -> dict:
    return {k: v * times for k, v in m.items()}


def _plus(a: dict, b: dict) -> dict:
    return {k: a[k] + b[k] for k in a}


def optimizer_ns(params_per_rank: int, target: str) -> float:
    from neuronc.targets import get_target

    return params_per_rank * 28 / get_target(target).hbm_gbps  # bytes / (GB/s) = ns


def rank_step(strategy: str, ranks: int, config: dict, batch: int, seq: int, target: str, whole: bool) -> dict:
    """Device time of one rank's training step (graphs and optimizer), its collectives' busy and hidden time, and
    with ``whole`` False the rest-of-model and per-block graph times."""
    if whole:
        compiled, params = step_graphs(strategy, ranks, config, batch, seq, target)
        m = measure(compiled, target)
    else:
        (ends, ends_params), (block, block_params) = block_graphs(strategy, ranks, config, batch, seq, target)
        m_ends, m_block = measure(ends, target), measure(block, target)
        m = _plus(m_ends, _times(m_block, config["layers"]))
        m.update(ends_ns=m_ends["graph_ns"], block_ns=m_block["graph_ns"])
        params = ends_params + config["layers"] * block_params
    m.update(params=params, step_ns=m["graph_ns"] + optimizer_ns(params, target))
    return m


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="*", default=[1, 2, 4, 8])
    parser.add_argument("--strategies", nargs="*", default=["dp", "fsdp", "tp"], choices=sorted(STRATEGIES))
    parser.add_argument("--batch", type=int, help="sequences per rank (dp, fsdp) or in all (tp); default 1 (the "
                        "fewer tokens per rank, the less compute to hide communication behind), 4 with --quick")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=FULL["layers"])
    parser.add_argument("--target", default="trn2")
    parser.add_argument("--whole", action="store_true",
                        help="compile the step as one forward and one backward graph instead of block by block")
    parser.add_argument("--quick", action="store_true", help="2 layers, 128 tokens: checks the script, not GPT-2")
    args = parser.parse_args(argv)
    os.environ.setdefault("NEURON_CC_FLAGS", "--no_cache")
    config, seq = ({**FULL, "layers": 2}, 128) if args.quick else ({**FULL, "layers": args.layers}, args.seq)
    args.batch = args.batch or (4 if args.quick else 1)
    from neuronc.targets import get_target
    from tests.zoo import GPT2

    params = sum(p.numel() for p in GPT2(**config).parameters())
    print(f"GPT-2 {config['layers']} layers, width {config['width']}, {config['heads']} heads, vocabulary "
          f"{config['vocab']}: {params / 1e6:.1f}M parameters; {args.batch} x {seq} tokens per rank (dp, fsdp) / in "
          f"all (tp); target {args.target}, {get_target(args.target).cores_per_chip} cores per chip; compiled "
          f"{'whole' if args.whole else 'block by block'}")
    print(f"{'strategy':<8} {'ranks':>5} {'chips':>5} {'step ms':>9} {'comm ms':>8} {'hidden':>7} {'efficiency':>10} "
          f"{'rest ms':>8} {'block ms':>8} {'optim ms':>8} {'graphs':>6} {'compile s':>9}")
    for strategy in args.strategies:
        baseline = None
        for ranks in args.ranks:
            start = time.perf_counter()
            m = rank_step(strategy, ranks, config, args.batch, seq, args.target, args.whole)
            step = m["step_ns"]
            baseline = baseline or (step, ranks)
            efficiency = baseline[0] / step if strategy in WEAK else baseline[0] * baseline[1] / (ranks * step)
            hidden = m["hidden_ns"] / m["comm_ns"] if m["comm_ns"] else float("nan")
            parts = "" if args.whole else f"{m['ends_ns'] / 1e6:>8.3f} {m['block_ns'] / 1e6:>8.3f}"
            print(f"{strategy:<8} {ranks:>5} {chip_layout(ranks, get_target(args.target))[1]:>5} {step / 1e6:>9.3f} "
                  f"{m['comm_ns'] / 1e6:>8.3f} {hidden:>7.1%} {efficiency:>10.3f} {parts or '-':>17} "
                  f"{(step - m['graph_ns']) / 1e6:>8.3f} {m['graphs']:>6} {time.perf_counter() - start:>9.1f}",
                  flush=True)


if __name__ == "__main__":
    main()
