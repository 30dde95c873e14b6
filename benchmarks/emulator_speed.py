"""Executing a compiled model on the emulated NeuronCore vs PyTorch eager on CPU, side by side.

Issue 3 asks that running a compiled model costs at most 3x eager PyTorch on CPU for the same model
(the golden tests run the emulator on every CI run). For each model of the test zoo this compiles it
once, loads it on a core, checks the outputs against eager, then times eager ``model(*inputs)``
(under ``torch.no_grad()``) and ``program.run(inputs)`` interleaved, so machine noise hits both
alike, and prints best-of and median times, their ratio and the emulator's cost per instruction.

    .venv/bin/python -m benchmarks.emulator_speed [--repeat 30] [--models mlp cnn] [-O 2] [--breakdown]
    .venv/bin/python -m benchmarks.emulator_speed --compiled [--models mlp512 gpt2_block hf_gpt2 moe]
    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.emulator_speed --compiled --clock cpu  # on a loaded machine

(from the repo root). ``--breakdown`` also shows where the emulator's time goes: each numpy call of
the loaded program timed alone, summed per opcode.

``--compiled`` measures the path a user takes instead: ``torch.compile(model, backend="neuron")`` called
on CPU tensors (Dynamo's guards, AOTAutograd's wrapper with the parameters lifted to inputs, the
backend's conversions, the run) against eager ``model(*inputs)``, both under ``torch.no_grad()``,
interleaved; beside them, ``program.run`` of the graph's own loaded program on the same inputs (what
the call costs beyond the emulation). Besides the zoo it offers the three models issue 16 names:
``mlp512`` (3 linear layers 512 wide, batch 64), ``gpt2_block`` (the zoo's block 768 wide, 12 heads,
seq 128, fp32) and ``hf_gpt2`` (Hugging Face's GPT2LMHeadModel, 2 layers, seq 128; needs transformers).

Programs are compiled afresh (the compile cache is bypassed), so the numbers are for the compiler as
it is in the work tree.
"""
from __future__ import annotations

import argparse
import collections
import functools
import os
import statistics
import time

import numpy as np
import torch

from neuronc.compiler import CompileOptions, compile_exported
from runtime import NeuronCore
from tests import zoo

TARGET_RATIO = 3.0  # issue 3: the emulator may cost at most this many times eager PyTorch


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = CLOCKS["wall"]


def _seconds(fn) -> float:
    start = _clock()
    fn()
    return _clock() - start


def measure(name: str, repeat: int, opt_level: int) -> dict:
    model, inputs = zoo.build(name)
    neff = compile_exported(torch.export.export(model, inputs), CompileOptions(opt_level=opt_level, name=name)).neff
    start = time.perf_counter()
    program = NeuronCore(neff.target).load(neff)
    load_s = time.perf_counter() - start
    arrays = [x.numpy() for x in inputs]

    def eager():
        with torch.no_grad():
            return model(*inputs)

    expected, outputs = eager(), program.run(arrays).outputs
    for out, want in zip(outputs, expected if isinstance(expected, tuple) else (expected,), strict=True):
        np.testing.assert_allclose(out, want.numpy(), rtol=1e-4, atol=1e-5)
    for _ in range(3):  # warm up caches, lazy imports and torch's kernels
        eager(), program.run(arrays)
    eager_s, emulator_s = [], []
    for _ in range(repeat):
        eager_s.append(_seconds(eager))
        emulator_s.append(_seconds(lambda: program.run(arrays)))
    timing_s = min(_seconds(program.time) for _ in range(3)) if hasattr(program, "time") else float("nan")
    return dict(name=name, instructions=sum(len(s) for s in neff.streams.values()), load_s=load_s,
                eager_best=min(eager_s), eager_median=statistics.median(eager_s),
                emulator_best=min(emulator_s), emulator_median=statistics.median(emulator_s), timing_s=timing_s,
                program=program, arrays=arrays)


def breakdown(program, arrays) -> str:
    """Each numpy call a run makes, timed alone (warm, best of 5) and summed per opcode: the floor
    that numpy sets for this program, and where it goes."""
    program.run(arrays)
    plan = program._plan  # the bound calls of the runtime: private, but a benchmark may look inside
    spent, calls, instructions = collections.Counter(), collections.Counter(), collections.defaultdict(set)
    with np.errstate(all="ignore"):
        for call, owner in zip(plan.calls, plan.owners):
            opcode = owner.instr.opcode.name
            spent[opcode] += min(_seconds(call) for _ in range(5))
            calls[opcode] += 1
            instructions[opcode].add(owner.key)
    parts = [f"{op} {len(instructions[op])} instrs/{calls[op]} calls {t * 1e6:.0f}" for op, t in spent.most_common()]
    return f"  numpy calls alone {sum(spent.values()) * 1e6:.0f} us: " + ", ".join(parts)


def _mlp512():
    torch.manual_seed(0)
    width = 512
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                                torch.nn.ReLU(), torch.nn.Linear(width, width))
    return model.eval(), (torch.randn(64, width),)


def _gpt2_block():
    torch.manual_seed(0)
    return zoo.TransformerBlock(width=768, heads=12).eval(), (torch.randn(1, 128, 768),)


def _hf_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, use_cache=False)
    model = GPT2LMHeadModel(config).eval()
    return model, (torch.randint(0, config.vocab_size, (1, 128)),)


EXTRA = {"mlp512": _mlp512, "gpt2_block": _gpt2_block, "hf_gpt2": _hf_gpt2}  # issue 16's user-path models


def _tensors(out) -> list:
    """The tensors of a model's output (a tensor, a tuple/list/dict of them, nested; a ModelOutput)."""
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return _tensors(list(out.values()))
    return [t for o in out for t in _tensors(o)] if isinstance(out, (tuple, list)) else []


def measure_compiled(name: str, repeat: int, opt_level: int) -> dict:
    """``torch.compile(model, backend="neuron")`` on CPU tensors against eager, interleaved, and the
    compiled graph's program.run on the same inputs."""
    from neuronc.pytorch import backend

    model, inputs = EXTRA[name]() if name in EXTRA else zoo.build(name)
    torch._dynamo.reset()
    first = len(backend.compiled_graphs)
    compiled = torch.compile(model, backend="neuron", options={"opt_level": opt_level})

    def eager():
        with torch.no_grad():
            return model(*inputs)

    def user():
        with torch.no_grad():
            return compiled(*inputs)

    start = time.perf_counter()
    got = user()
    compile_s = time.perf_counter() - start
    for out, want in zip(_tensors(got), _tensors(eager()), strict=True):
        torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
    graphs = backend.compiled_graphs[first:]
    runs = [(g.program, [a.copy() for a in _program_inputs(g)]) for g in graphs]
    for _ in range(3):  # warm up
        eager(), user()
    eager_s, compiled_s, run_s = [], [], []
    for _ in range(repeat):
        eager_s.append(_seconds(eager))
        compiled_s.append(_seconds(user))
        run_s.append(sum(_seconds(functools.partial(p.run, a)) for p, a in runs))
    return dict(name=name, graphs=len(graphs), compile_s=compile_s,
                instructions=sum(len(s) for g in graphs for s in g.compiled.neff.streams.values()),
                eager_best=min(eager_s), eager_median=statistics.median(eager_s),
                compiled_best=min(compiled_s), compiled_median=statistics.median(compiled_s),
                run_best=min(run_s), run_median=statistics.median(run_s))


def _program_inputs(function) -> list:
    """The arrays the last call of a compiled graph gave its program (read back from its HBM)."""
    return list(function.program._plan.inputs)


def main_compiled(args) -> None:
    print(f"torch {torch.__version__} ({torch.get_num_threads()} threads), numpy {np.__version__}; "
          f"torch.compile(backend='neuron') at -O{args.opt_level} on CPU tensors; {args.repeat} interleaved "
          f"repetitions; {args.clock} times in us, best / median")
    print(f"{'model':<18} {'graphs':>6} {'instrs':>6} {'eager us':>15} {'compiled us':>17} {'ratio':>11} "
          f"{'program.run us':>17} {'ratio':>11} {'compile s':>9}  3x target")
    met = True
    for name in args.models:
        r = measure_compiled(name, args.repeat, args.opt_level)
        best, median = r["compiled_best"] / r["eager_best"], r["compiled_median"] / r["eager_median"]
        run_best, run_median = r["run_best"] / r["eager_best"], r["run_median"] / r["eager_median"]
        ok = best <= TARGET_RATIO
        met &= ok
        print(f"{name:<18} {r['graphs']:>6} {r['instructions']:>6} {r['eager_best'] * 1e6:>7.0f} /"
              f"{r['eager_median'] * 1e6:>6.0f} {r['compiled_best'] * 1e6:>8.0f} /{r['compiled_median'] * 1e6:>7.0f} "
              f"{best:>5.2f} /{median:>4.2f} {r['run_best'] * 1e6:>8.0f} /{r['run_median'] * 1e6:>7.0f} "
              f"{run_best:>5.2f} /{run_median:>4.2f} {r['compile_s']:>9.1f}  {'met' if ok else 'NOT met'}")
    verdict = "met by every model" if met else "NOT met by every model"
    print(f"3x eager target through torch.compile (best-of ratio <= {TARGET_RATIO:g}) {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=30, help="interleaved repetitions per model")
    parser.add_argument("--models", nargs="*", choices=sorted(zoo.ZOO) + sorted(EXTRA),
                        help="default: the zoo (and, with --compiled, the extra models too)")
    parser.add_argument("-O", "--opt-level", type=int, default=CompileOptions.opt_level)
    parser.add_argument("--breakdown", action="store_true", help="time each numpy call of each program")
    parser.add_argument("--compiled", action="store_true", help="through torch.compile(backend='neuron')")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="cpu: the process's CPU time (on a loaded machine; run with OMP_NUM_THREADS=1 so "
                        "that torch and numpy each use one thread and CPU time is the work done)")
    args = parser.parse_args()
    global _clock
    _clock = CLOCKS[args.clock]
    os.environ["NEURON_CC_FLAGS"] = os.environ.get("NEURON_CC_FLAGS", "") + " --no_cache"
    if args.compiled:
        args.models = args.models or sorted(zoo.ZOO) + list(EXTRA)
        return main_compiled(args)
    args.models = args.models or sorted(zoo.ZOO)
    if set(args.models) & set(EXTRA):
        parser.error(f"{', '.join(sorted(EXTRA))} are measured with --compiled only")

    print(f"torch {torch.__version__} ({torch.get_num_threads()} threads), numpy {np.__version__}; compiled at "
          f"-O{args.opt_level}; {args.repeat} interleaved repetitions; {args.clock} times in us, best / median")
    print(f"{'model':<18} {'instrs':>6} {'eager us':>15} {'emulator us':>17} {'ratio':>11} "
          f"{'us/instr':>8} {'time() us':>9} {'load ms':>7}  3x target")
    met = True
    for name in args.models:
        r = measure(name, args.repeat, args.opt_level)
        best, median = r["emulator_best"] / r["eager_best"], r["emulator_median"] / r["eager_median"]
        ok = best <= TARGET_RATIO
        met &= ok
        print(f"{name:<18} {r['instructions']:>6} {r['eager_best'] * 1e6:>7.0f} /{r['eager_median'] * 1e6:>6.0f} "
              f"{r['emulator_best'] * 1e6:>8.0f} /{r['emulator_median'] * 1e6:>7.0f} {best:>5.2f} /{median:>4.2f} "
              f"{r['emulator_best'] / r['instructions'] * 1e6:>8.2f} {r['timing_s'] * 1e6:>9.0f} "
              f"{r['load_s'] * 1e3:>7.1f}  {'met' if ok else 'NOT met'}")
        if args.breakdown:
            print(breakdown(r["program"], r["arrays"]))
    verdict = "met by every model" if met else "NOT met by every model"
    print(f"3x eager target (best-of ratio <= {TARGET_RATIO:g}) {verdict}")


if __name__ == "__main__":
    main()
