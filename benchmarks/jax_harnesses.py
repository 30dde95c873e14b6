"""JAX's own primitive harnesses (jax2tf's suite, `jax._src.internal_test_util.test_harnesses`: every lax primitive
over its shapes, dtypes and parameters) compiled with `neuronc.jax.jit` against `jax.jit` on the CPU. Each harness
is counted as pass (every output within the project's tolerance of its dtype, integers and booleans equal; same
dtypes and shapes), mismatch, refused (a NeuronCompileError naming what neuronc cannot compile yet: complex numbers,
LAPACK custom calls...), error (anything else: a bug) or timeout; harnesses JAX itself cannot run on the CPU are
skipped. Random primitives are compared bit for bit like the others (neuronc draws JAX's numbers). Not a test:
nothing is asserted. Needs `absl-py` (`pip install -e .[bench]`).

    .venv/bin/python -m benchmarks.jax_harnesses [--per-group 4] [--groups gather,scatter_max] [--list]
"""
from __future__ import annotations

import argparse
import collections
import warnings

import numpy as np

from benchmarks.opinfo import SampleTimeout, cpu_time_limit


def _close(want, got) -> bool:
    import jax
    import ml_dtypes

    from neuronc.tolerances import tolerance

    want, got = jax.tree_util.tree_leaves(want), jax.tree_util.tree_leaves(got)
    if len(want) != len(got):
        return False
    for w, g in zip(want, got):
        w, g = np.asarray(w), np.asarray(g)
        if w.shape != g.shape or w.dtype != g.dtype:
            return False
        if w.dtype.kind in "biu" or w.dtype == np.dtype(bool):
            if not np.array_equal(w, g):
                return False
        elif w.dtype.kind == "c":
            if not np.allclose(w, g, rtol=1e-4, atol=1e-4, equal_nan=True):
                return False
        else:
            narrow = w.dtype in (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))
            limits = tolerance(w.dtype) if narrow else dict(rtol=1e-4, atol=1e-4)
            if not np.allclose(w.astype(np.float64), g.astype(np.float64), equal_nan=True, **limits):
                return False
    return True


def sweep(harnesses, seconds: float) -> tuple:
    """(Counter of outcomes, Counter of outcomes per group, [(harness, outcome, detail)] of the failures)."""
    import jax

    import neuronc.jax
    from neuronc.errors import NeuronCompileError

    counts, by_group, failures = collections.Counter(), collections.defaultdict(collections.Counter), []
    for h in harnesses:
        rng = np.random.RandomState(0)
        try:
            args = h.dyn_args_maker(rng)
            want = jax.jit(h.dyn_fun)(*args)
            jax.block_until_ready(want)
        except Exception:  # noqa: BLE001 - JAX cannot run this harness here
            continue
        try:
            with cpu_time_limit(seconds):
                got = neuronc.jax.jit(h.dyn_fun)(*args)
            outcome, detail = ("pass" if _close(want, got) else "mismatch"), ""
        except SampleTimeout:
            outcome, detail = "timeout", ""
        except NeuronCompileError as e:
            outcome, detail = "refused", " ".join(str(e).split())[:200]
        except Exception as e:  # noqa: BLE001 - counted and listed
            outcome, detail = "error", f"{type(e).__name__}: {' '.join(str(e).split())}"[:200]
        counts[outcome] += 1
        by_group[h.group_name][outcome] += 1
        if outcome != "pass":
            failures.append((h.fullname, outcome, detail))
    return counts, by_group, failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-group", type=int, default=4, help="harnesses per primitive group (0: all)")
    parser.add_argument("--groups", default="", help="comma-separated group names (default: every group)")
    parser.add_argument("--seconds", type=float, default=120.0, help="CPU seconds per harness before a timeout")
    parser.add_argument("--list", action="store_true", help="print every failing harness")
    options = parser.parse_args()
    warnings.simplefilter("ignore")
    from jax._src.internal_test_util import test_harnesses

    wanted = set(filter(None, options.groups.split(",")))
    taken, harnesses = collections.Counter(), []
    for h in test_harnesses.all_harnesses:
        if (wanted and h.group_name not in wanted) or (options.per_group and taken[h.group_name] >= options.per_group):
            continue
        taken[h.group_name] += 1
        harnesses.append(h)
    counts, by_group, failures = sweep(harnesses, options.seconds)
    print(f"{len(harnesses)} harnesses of {len(taken)} groups: " + ", ".join(f"{k} {v}" for k, v in counts.most_common()))
    for group, outcomes in sorted(by_group.items()):
        if set(outcomes) != {"pass"}:
            print(f"  {group}: " + ", ".join(f"{k} {v}" for k, v in outcomes.most_common()))
    if options.list:
        for name, outcome, detail in failures:
            print(f"{outcome:8s} {name}  {detail}")


if __name__ == "__main__":
    main()
