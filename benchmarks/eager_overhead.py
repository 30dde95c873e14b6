"""Per-op launch overhead of a cached eager op on the `neuron` device, against the same op on CPU eager.

Each op is run once (compiled to a NEFF and cached), then called many times on small tensors so the
time is overhead. On the device an op call only queues the launch on the current stream (PyTorch
dispatch, the signature lookup, new output tensors, the queue entry): that is the launch overhead the
issue's goal (< 20 us per op) is about, printed as ``launch us``. The queued launches then run on the
emulated NeuronCore at ``torch.accelerator.synchronize()`` (``run us``: copying operands into the
program's HBM, its instructions as numpy calls, the outputs written to the tensors); ``total us`` is the
sum, the host time per op of a loop that synchronises. Ratios are against CPU eager. Each figure is the
best over chunks of ops (as ``timeit`` reports the best run): the machine may be shared. On a machine
loaded by other work, ``--clock cpu`` times the process's own CPU time (``time.process_time``) instead of
the wall clock, which the other processes do not inflate.

With ``--new-shapes`` it measures the other cost of eager: the first call of an op at a shape it has not
met. The zoo's models run forward and backward (training mode) once, then again at a batch one larger: every op
of the second pass meets new shapes (``--grow K``: again at batch + 2 .. batch + K). Each such first call costs the op's lowering to the IR
(neuronc/frontend/aten_lowering.py), the passes and codegen, the load on the core (with the runtime's access
check) and the program's first run (binding its kernels); printed per stage and in all, as the median, mean and
90th percentile over the new signatures (an op's first call at a new shape: its compile, or with shape buckets
(``NEURON_EAGER_BUCKETS``) the bucket's program compiled or found, and its first run), in the process's CPU time and
in wall time; the per-stage rows are per program compiled. ``--traced N`` also compiles
N of them through torch-mlir (the route without the lowering) for comparison.

    .venv/bin/python -m benchmarks.eager_overhead [--repeat 2000] [--clock cpu]   (from the repo root)
    .venv/bin/python -m benchmarks.eager_overhead --new-shapes [--models mlp,gpt2] [--traced 8]
"""
from __future__ import annotations

import argparse
import time

import torch

CASES = {
    "add (8x8)": lambda a, b: torch.add(a, b),
    "mul by scalar (8x8)": lambda a, b: a * 0.5,
    "relu (8x8)": lambda a, b: torch.relu(a),
    "mm (8x8 @ 8x8)": lambda a, b: a @ b,
    "add_ in place (8x8)": lambda a, b: a.add_(b),
    "uniform_ (8x8)": lambda a, b: a.uniform_(),  # a random op: the RNG program (neuronc/codegen/rng.py)
}
CHUNK = 500  # launches queued between synchronisations (below the queue depth, so none runs early)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
clock = time.perf_counter


def cpu_us(fn, a, b, repeat: int) -> float:
    fn(a, b)
    best = float("inf")
    for _ in range(max(1, repeat // CHUNK)):
        start = clock()
        for _ in range(CHUNK):
            fn(a, b)
        best = min(best, (clock() - start) / CHUNK * 1e6)
    return best


def neuron_us(fn, a, b, repeat: int) -> tuple:
    """(launch, run) microseconds per op."""
    fn(a, b)
    torch.accelerator.synchronize()
    launch = run = float("inf")
    for _ in range(max(1, repeat // CHUNK)):
        start = clock()
        for _ in range(CHUNK):
            fn(a, b)
        queued = clock()
        torch.accelerator.synchronize()
        launch = min(launch, (queued - start) / CHUNK * 1e6)
        run = min(run, (clock() - queued) / CHUNK * 1e6)
    return launch, run


class Stopwatch:
    """Time spent in some functions of a module (CPU and wall seconds per call), by wrapping them."""

    def __init__(self):
        self.calls: dict = {}

    def wrap(self, owner, name: str, label: str):
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            cpu, wall = time.process_time(), time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.calls.setdefault(label, []).append((time.process_time() - cpu, time.perf_counter() - wall))

        setattr(owner, name, timed)
        return original


def _grown(x: torch.Tensor, rows: int = 1) -> torch.Tensor:
    """x with ``rows`` more rows (batch) than it has: the same ops at new shapes."""
    return torch.cat([x] + [x[:1]] * rows) if x.dim() else x


def _pass(name: str, grow: int) -> None:
    from tests import zoo

    model, inputs = zoo.build(name)
    model = model.train().to("neuron")
    if isinstance(model, zoo.GPT2):
        model.head.weight = model.tokens.weight
    inputs = [(_grown(x, grow) if grow else x).to("neuron") for x in inputs]
    with torch.device("neuron"):
        out = model(*inputs)
        (out[0] if isinstance(out, tuple) else out).float().pow(2).mean().backward()
    torch.accelerator.synchronize()


def _first_run_timed(entry, record: list):
    """``entry.run`` timing its first call into ``record[2:]`` (CPU, wall seconds), then the plain run again."""
    run = entry.run

    def first(*args):
        if entry.run is run:  # a later launch queued before the first ran
            return run(*args)
        entry.run = run
        cpu, wall = time.process_time(), time.perf_counter()
        try:
            return run(*args)
        finally:
            record[2], record[3] = time.process_time() - cpu, time.perf_counter() - wall

    return first


def new_shapes(models: list, traced: int, grow: int = 1) -> None:
    import statistics

    from neuronc.pytorch import eager
    from runtime.core import NeuronCore

    for name in models:  # every op compiled once (and the imports paid)
        _pass(name, grow=0)
    watch = Stopwatch()
    firsts = {}  # id of a new EagerProgram (one per new signature) -> [compile cpu, wall, first run cpu, wall]
    compile_op = eager._compile
    depth = [0]

    def timed_compile(*args, **kwargs):  # the outermost call: a bucket's program compiled inside it is its cost
        depth[0] += 1
        cpu, wall = time.process_time(), time.perf_counter()
        try:
            entry = compile_op(*args, **kwargs)
        finally:
            depth[0] -= 1
        if isinstance(entry, eager.EagerProgram) and not depth[0]:
            firsts[id(entry)] = [time.process_time() - cpu, time.perf_counter() - wall, 0.0, 0.0]
            entry.run = _first_run_timed(entry, firsts[id(entry)])
        return entry

    eager._compile = timed_compile
    watch.wrap(eager, "_lower", "lower to IR")
    watch.wrap(eager, "_compile_lowered", "passes + codegen")
    watch.wrap(NeuronCore, "load", "load (access check)")
    stats = dict(eager.compile_stats)
    try:
        for rows in range(1, grow + 1):
            for name in models:
                _pass(name, grow=rows)
    finally:
        eager._compile = compile_op
    made = {how: n - stats.get(how, 0) for how, n in eager.compile_stats.items()}
    programs = made.get("lowered", 0) + made.get("traced", 0)
    print(f"first call of an op at a new shape: the zoo ({', '.join(models)}), forward and backward at batch + 1"
          f"{f' .. + {grow}' if grow > 1 else ''}: {len(firsts)} new signatures, {made.get('bucketed', 0)} of them "
          f"run by a bucket's program, {made.get('looped', 0)} by a looped program ({made.get('loop tiles', 0)} tile "
          f"programs compiled for {made.get('looped programs', 0)} looped programs); {programs} programs compiled "
          f"({made.get('disk cache', 0)} loaded from disk), "
          f"{made.get('bucketed', 0) and 'buckets on' or 'buckets off or unused'}")
    print(f"  {'stage':26} {'median ms (cpu)':>16} {'mean':>8} {'p90':>8} {'median ms (wall)':>17}")
    stages = list(watch.calls.items()) + [("first run", [(f[2], f[3]) for f in firsts.values()]),
                                          ("all (compile + first run)", [(f[0] + f[2], f[1] + f[3])
                                                                         for f in firsts.values()])]
    for label, calls in stages:
        if not calls:
            continue
        cpu = sorted(c * 1e3 for c, _ in calls)
        wall = sorted(w * 1e3 for _, w in calls)
        print(f"  {label:26} {statistics.median(cpu):16.2f} {statistics.mean(cpu):8.2f} "
              f"{cpu[int(0.9 * (len(cpu) - 1))]:8.2f} {statistics.median(wall):17.2f}")
    if traced:
        _traced_sample(traced)


def _traced_sample(count: int) -> None:
    """Compile ``count`` ops at yet newer shapes through torch-mlir (the lowering switched off)."""
    import statistics

    from neuronc.pytorch import eager

    lower = eager._lower
    eager._lower = lambda *args: None
    watch = Stopwatch()
    watch.wrap(eager, "_compile", "traced")
    try:
        x, y = torch.randn(7, 13).to("neuron"), torch.randn(13, 5).to("neuron")
        ops = [lambda: x + 1.0, lambda: x @ y, lambda: x.softmax(-1), lambda: x.relu(), lambda: x.sum(0),
               lambda: torch.nn.functional.layer_norm(x, (13,)), lambda: x.exp(), lambda: x.mean(1),
               lambda: torch.nn.functional.gelu(x), lambda: x.t().contiguous(), lambda: x * x, lambda: x.tanh()]
        for op in ops[:count]:
            op()
        torch.accelerator.synchronize()
    finally:
        eager._lower = lower
    cpu = [c * 1e3 for c, _ in watch.calls.get("traced", [])]
    wall = [w * 1e3 for _, w in watch.calls.get("traced", [])]
    if cpu:
        print(f"  {'through torch-mlir (' + str(len(cpu)) + ' ops)':26} {statistics.median(cpu):16.2f} "
              f"{statistics.mean(cpu):8.2f} {max(cpu):8.2f} {statistics.median(wall):17.2f}   "
              "(CPU time of this process: the forked torch-mlir child's is not counted)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2000)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall time, or the process's CPU time (for a machine shared with other work)")
    parser.add_argument("--new-shapes", action="store_true", help="the first call of ops at new shapes")
    parser.add_argument("--models", default="mlp,cnn,transformer_block,gpt2,resnet,vit,bert,llama,mamba,moe,unet")
    parser.add_argument("--traced", type=int, default=0, help="also compile this many ops through torch-mlir")
    parser.add_argument("--grow", type=int, default=1,
                        help="with --new-shapes: passes at batch + 1 .. batch + GROW (each a new shape)")
    options = parser.parse_args()
    if options.new_shapes:
        import warnings

        warnings.simplefilter("ignore")
        new_shapes(options.models.split(","), options.traced, options.grow)
        return
    global clock
    repeat, clock = options.repeat, CLOCKS[options.clock]
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    da, db = a.to("neuron"), b.to("neuron")
    print(f"{'op':22} {'cpu us':>7} {'launch us':>10} {'run us':>7} {'total us':>9} {'launch/cpu':>11} "
          f"{'total/cpu':>10}")
    for name, fn in CASES.items():
        cpu = cpu_us(fn, a, b, repeat)
        launch, run = neuron_us(fn, da, db, repeat)
        print(f"{name:22} {cpu:7.1f} {launch:10.1f} {run:7.1f} {launch + run:9.1f} {launch / cpu:11.1f} "
              f"{(launch + run) / cpu:10.1f}")


if __name__ == "__main__":
    main()
