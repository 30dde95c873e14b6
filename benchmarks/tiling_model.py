"""The tiling pass's prices against the emulator: every candidate tiling of a few matmuls, priced as the tiling
pass prices it (its kernel emitted alone and timed on the emulator's clock, `neuronc.kernel_timing`; the formula
`cost_model.matmul_ns` beside it, which only orders the candidates for that) and timed on the emulated NeuronCore
within the whole program (the span of the matmul's kernel on the timeline, compiled with that tiling forced),
side by side. Nothing is asserted: it prints them and the price's ratio to the span, and marks the candidate the
tiling pass picks and the one the emulator finds fastest in the program. A chain of two matmuls
(passes/matmul_chain.py, one kernel) is listed by its pairs of tilings, its formula `tiling.chain_price`.
A kernel's span in a program of several kernels includes its neighbours' DMAs sharing the queues (and its loads
issued early, during the kernel before), which a kernel timed alone does not see.

    python -m benchmarks.tiling_model [--cases matmul,gpt2_mlp] [--quick] [--wide]
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.roofline import _cases
from neuronc.compiler import CompileOptions, compile_graph
from neuronc.frontend.exported import import_exported_program
from neuronc.kernel_timing import kernel_time
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


def _compile_with(graph, name, pick, pick_chain=lambda node, target: None):
    """The NEFF of `graph` at -O2 with the tiling pass's choice replaced by pick(index of the matmul, node, target)
    and a chain's by pick_chain(node, target), and the matmul nodes tiled alone and the chained ones."""
    chosen, chained, seen, chains = tiling.choose, tiling.chain_tilings, [], []

    def choose(node, target, wide=False, timed=None):
        seen.append(node)
        return pick(len(seen) - 1, node, target) or chosen(node, target, wide, timed)

    def chain_tilings(node, target, wide=False, timed=None):
        chains.append(node)
        return pick_chain(node, target) or chained(node, target, wide, timed)

    tiling.choose, tiling.chain_tilings = choose, chain_tilings
    try:
        return compile_graph(graph, CompileOptions(opt_level=2, name=name)).neff, seen, chains
    finally:
        tiling.choose, tiling.chain_tilings = chosen, chained


def _kernel_span_ns(neff, index: int) -> float:
    """Span of the index-th matmul kernel on the emulator's timeline."""
    kernel = [i for i, k in enumerate(neff.kernels) if k.name.startswith("matmul")][index]
    events = [e for e in run_neff(neff, numerics=False).timeline.events if e.kernel == kernel]
    return max(e.end_ns for e in events) - min(e.start_ns for e in events)


def _print_rows(rows, picked) -> None:
    """(label, candidate, formula ns, priced ns, emulator ns) rows, the picked and the fastest marked."""
    fastest = min(rows, key=lambda row: row[4])[1]
    for label, candidate, formula_ns, model_ns, emulator_ns in rows:
        mark = (" <- picked" if candidate == picked else "") + (" <- fastest" if candidate == fastest else "")
        print(f"  {label:<60} {formula_ns / 1e3:>10.1f} {model_ns / 1e3:>9.1f} {emulator_ns / 1e3:>12.1f} "
              f"{model_ns / emulator_ns:>10.3f}{mark}", flush=True)


HEADER = f"{'formula us':>10} {'priced us':>9} {'emulator us':>12} {'priced/emu':>10}"


def _chain_key(node) -> tuple:
    """A chain's shapes: the chain pass and the tiling pass ask for its tilings with different nodes."""
    return node.attrs["chain"].shape, node.shape, node.attrs["k"]


def _chain_index(neff, chain: int) -> int:
    """Which matmul kernel of the NEFF is its chain-th chain (`neuronc inspect --kernels` says "chain tiles")."""
    kernels = [k for k in neff.kernels if k.name.startswith("matmul")]
    return [i for i, k in enumerate(kernels) if any(op.startswith("[chain") for op in k.ops)][chain]


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
        _, nodes, chains = _compile_with(graph, name, lambda i, node, t: None)
        for index, node in enumerate(nodes):
            timed = lambda n: kernel_time(n, target)  # noqa: E731 (as the compiler's PassContext.kernel_time)
            picked = tiling.choose(node, target, args.wide, timed)
            print(f"{name} matmul {index}: {node.shape} x K={node.attrs['k']}, picked {picked}")
            print(f"  {'tiling':<60} {HEADER}")
            rows = []
            for candidate in tiling.candidates(node, target, args.wide):
                neff, _, _ = _compile_with(graph, name, lambda i, n, t, c=candidate, index=index: c if i == index else None)
                rows.append((str(candidate), candidate, tiling.price(node, candidate, target),
                             timed(tiling.planned(node, candidate))[0], _kernel_span_ns(neff, index)))
            _print_rows(rows, picked)
        for chain, node in enumerate({_chain_key(n): n for n in chains}.values()):
            timed = lambda n: kernel_time(n, target)  # noqa: E731
            picked = tiling.chain_tilings(node, target, args.wide, timed)
            print(f"{name} chain {node.attrs['chain'].shape} then {node.shape}, picked {picked[0]}, "
                  f"then bufs={picked[1].stream_bufs}")
            print(f"  {'first tiling, then the second bufs':<60} {HEADER}")
            rows = []
            for option in tiling.chain_options(node, target, args.wide):
                neff, _, _ = _compile_with(graph, name, lambda i, n, t: None,
                                           lambda n, t, o=option, node=node: o if _chain_key(n) == _chain_key(node) else None)
                rows.append((f"{option[0]}, then bufs={option[1].stream_bufs}", option,
                             tiling.chain_price(node, *option, target),
                             timed(tiling.chain_planned(node, *option, target))[0],
                             _kernel_span_ns(neff, _chain_index(neff, chain))))
            _print_rows(rows, picked)


if __name__ == "__main__":
    main()
