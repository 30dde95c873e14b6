"""Executing a compiled model on the emulated NeuronCore vs PyTorch eager on CPU, side by side.

Issue 3 asks that running a compiled model costs at most 3x eager PyTorch on CPU for the same model
(the golden tests run the emulator on every CI run). For each model of the test zoo this compiles it
once, loads it on a core, checks the outputs against eager, then times eager ``model(*inputs)``
(under ``torch.no_grad()``) and ``program.run(inputs)`` interleaved, so machine noise hits both
alike, and prints best-of and median times, their ratio and the emulator's cost per instruction.

    .venv/bin/python -m benchmarks.emulator_speed [--repeat 30] [--models mlp cnn] [-O 2] [--breakdown]

(from the repo root). ``--breakdown`` also shows where the emulator's time goes: each numpy call of
the loaded program timed alone, summed per opcode.

Programs are compiled afresh (the compile cache is bypassed), so the numbers are for the compiler as
it is in the work tree.
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import time

import numpy as np
import torch

from neuronc.compiler import CompileOptions, compile_exported
from runtime import NeuronCore
from tests import zoo

TARGET_RATIO = 3.0  # issue 3: the emulator may cost at most this many times eager PyTorch


def _seconds(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=30, help="interleaved repetitions per model")
    parser.add_argument("--models", nargs="*", default=sorted(zoo.ZOO), choices=sorted(zoo.ZOO))
    parser.add_argument("-O", "--opt-level", type=int, default=CompileOptions.opt_level)
    parser.add_argument("--breakdown", action="store_true", help="time each numpy call of each program")
    args = parser.parse_args()
    os.environ["NEURON_CC_FLAGS"] = os.environ.get("NEURON_CC_FLAGS", "") + " --no_cache"

    print(f"torch {torch.__version__} ({torch.get_num_threads()} threads), numpy {np.__version__}; compiled at "
          f"-O{args.opt_level}; {args.repeat} interleaved repetitions; times in us, best / median")
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
