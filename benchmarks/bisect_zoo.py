"""`neuronc.bisect` over zoo models and the JAX test programs: how many values each NEFF keeps in HBM and is
compared, whether any diverges from XLA on CPU, and how long a bisection takes (reference run, compile, the
watched run; the pass search only runs when something diverges). A sweep, not a test: a model of the zoo that
diverges here is a finding to look into (the tests hold outputs to eager PyTorch; this holds every kernel's).

    .venv/bin/python -m benchmarks.bisect_zoo [--models transformer_block gpt2 jax:mlp] [-O 2]
"""
from __future__ import annotations

import argparse
import time

import neuronc
from tests import jax_programs, zoo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="*", default=["mlp", "transformer_block", "gpt2", "llama",
                                                         "jax:transformer_block", "jax:sgd_step"])
    parser.add_argument("-O", dest="opt_level", type=int, default=2)
    args = parser.parse_args()
    print(f"{'model':<24} {'values':>7} {'compared':>9} {'diverges':>9} {'seconds':>8}")
    for name in args.models:
        start = time.perf_counter()
        if name.startswith("jax:"):
            function, inputs = jax_programs.build(name[len("jax:"):])
            reports = neuronc.bisect(function, *inputs, opt_level=args.opt_level)
        else:
            model, inputs = zoo.build(name)
            reports = neuronc.bisect(model, *inputs, opt_level=args.opt_level)
        seconds = time.perf_counter() - start
        for report in reports:
            print(f"{name:<24} {report.values:>7} {report.compared:>9} {str(report.diverges):>9} {seconds:>8.1f}")
            if report.diverges:
                print(report)


if __name__ == "__main__":
    main()
