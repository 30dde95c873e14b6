"""The tiling cost model against the emulator: every candidate tiling of a few matmuls, priced by
`cost_model.matmul_ns` and timed on the emulated NeuronCore (the span of the matmul's kernel on the timeline,
compiled with that tiling forced), side by side. Nothing is asserted: it prints the two and their ratio,
and marks the candidate the tiling pass picks and the one the emulator finds fastest.

    python -m benchmarks.tiling_model [--cases matmul,gpt2_mlp] [--quick] [--wide]
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.roofline import _cases
from neuronc.compiler import CompileOptions, compile_graph
from neuronc.frontend.exported import import_exported_program
from neuronc.passes import tiling
from neuronc.targets import get_target
from runtime import run_neff


def _imported(model, inputs, dtype, name):
    model = model.eval().to(dtype)
    inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)
    imported, weights = import_exported_program(torch.export.export(model, inputs), name)
    for param in imported.graph.params:
        if param.attrs["kind"] == "weight":
            param.attrs["data"] = weights[param.attrs["name"]]
    return imported.graph


def _compile_with(graph, name, pick):
    """The NEFF of `graph` at -O2 with the tiling pass's choice replaced by pick(index of the matmul, node, target)."""
    chosen, seen = tiling.choose, []

    def choose(node, target, wide=False):
        seen.append(node)
        return pick(len(seen) - 1, node, target) or chosen(node, target, wide)

    tiling.choose = choose
    try:
        return compile_graph(graph, CompileOptions(opt_level=2, name=name)).neff, seen
    finally:
        tiling.choose = chosen


def _kernel_span_ns(neff, index: int) -> float:
    """Span of the index-th matmul kernel on the emulator's timeline."""
    kernel = [i for i, k in enumerate(neff.kernels) if k.name.startswith("matmul")][index]
    events = [e for e in run_neff(neff, numerics=False).timeline.events if e.kernel == kernel]
    return max(e.end_ns for e in events) - min(e.start_ns for e in events)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="matmul,gpt2_mlp", help="comma-separated roofline cases")
    parser.add_argument("--quick", action="store_true", help="the roofline's smaller shapes")
    parser.add_argument("--wide", action="store_true", help="-O3's wider candidate set")
    args = parser.parse_args()
    target = get_target("trn2")
    cases = _cases(args.quick)
    for name in args.cases.split(","):
        graph = _imported(*cases[name], name)
        _, nodes = _compile_with(graph, name, lambda i, node, t: None)
        for index, node in enumerate(nodes):
            picked = tiling.choose(node, target, args.wide)
            print(f"{name} matmul {index}: {node.shape} x K={node.attrs['k']}, picked {picked}")
            print(f"  {'tiling':<44} {'model us':>9} {'emulator us':>12} {'model/emu':>10}")
            rows = []
            for candidate in tiling.candidates(node, target, args.wide):
                neff, _ = _compile_with(graph, name, lambda i, n, t, c=candidate: c if i == index else None)
                rows.append((candidate, tiling.price(node, candidate, target), _kernel_span_ns(neff, index)))
            fastest = min(rows, key=lambda row: row[2])[0]
            for candidate, model_ns, emulator_ns in rows:
                mark = (" <- picked" if candidate == picked else "") + (" <- fastest" if candidate == fastest else "")
                print(f"  {str(candidate):<44} {model_ns / 1e3:>9.1f} {emulator_ns / 1e3:>12.1f} "
                      f"{model_ns / emulator_ns:>10.2f}{mark}", flush=True)


if __name__ == "__main__":
    main()
