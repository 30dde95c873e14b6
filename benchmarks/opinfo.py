"""Op coverage measured by PyTorch's own OpInfo suite, forward and backward (issue 21).

Each op of `torch.testing._internal.common_methods_invocations.op_db` is compiled alone with
`torch.compile(fn, backend=..., fullgraph=True)` on its first samples of each dtype (3 by default) and
compared with eager PyTorch on CPU (fp32 rtol 1e-4 / atol 1e-5; bf16 and fp16 with neuronc's table of
tolerances.py; integers and bools exactly). With --backward, the gradients of each sample's floating-point
inputs (of the sum of each floating output times a fixed random cotangent) are compared too. Peers
(--peers inductor) run the same samples in the same process, side by side.

It prints, per backend and dtype: samples passing, ops fully passing (every sample of the op passes), the
failure classes tallied (an op that cannot be compiled, a wrong result, a backend exception by type and
message), the ops named most often as impossible to compile, and every op with a WRONG RESULT (a compiled
program that runs and returns other numbers than eager: the worst failure a compiler can have).

Singular vectors and eigenvectors are unique only up to sign: a sample of svd, linalg.svd or linalg.eigh that
differs from eager strictly but whose values equal eager's, whose factors reconstruct the input and whose vectors'
magnitudes equal eager's is reported as "equal up to the documented sign freedom", apart: never a pass.

A bf16/fp16 sample whose compiled result differs from eager's but equals, within the dtype's tolerance, the sample
computed in fp32 and rounded once (the reference the test suite uses: eager's narrow kernels often round at every
step) is reported apart too, "off eager's, equal to the fp32 reference rounded once": never a pass either.

Random ops (dropout, rand_like, bernoulli, ...) cannot match eager's numbers: their outputs are checked for
shape and dtype only, and counted apart ("random"). A sample whose eager call raises is not counted.

A full run is long (613 ops, ~1900 fp32 samples, a torch-mlir child per compile; hours on 2 cores). Select:

    .venv/bin/python -m benchmarks.opinfo --ops nn.functional.avg_pool3d logcumsumexp   (names, exact)
    .venv/bin/python -m benchmarks.opinfo --match pool --backward                         (substring)
    .venv/bin/python -m benchmarks.opinfo --every 10 --limit 30                           (a spread subset)
    .venv/bin/python -m benchmarks.opinfo --dtypes fp32 bf16 --peers inductor --json out.json
    .venv/bin/python -m benchmarks.opinfo --every 30 --fallback   (also with the CPU fallback: "neuron+cpu")

"neuron" is strictly on the device (TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION=1); "neuron+cpu" lets a compiled
graph run the ops the device cannot on the CPU (neuronc.pytorch.partition), as torch.compile does by default.

`--graph-breaks` compiles every backend as `torch.compile` does by default (`fullgraph=False`): what Dynamo cannot
trace (functions it skips, data-dependent control flow, sparse tensors...) runs in Python between the graphs it
hands the backend, instead of failing the sample before any backend is called. That is what a user's program
meets; "neuron+cpu" under it answers "does my program run, and right". Samples that pass with no graph reaching
the backend (Dynamo ran all of it in Python) are counted and printed apart, as passes:

    .venv/bin/python -m benchmarks.opinfo --fallback --graph-breaks --peers inductor

The NeuronCore has no float64: "neuron" refuses a graph taking or returning float64 (OpInfo's `double`, the
`--dtypes fp64` samples). `--fp64-to-fp32` adds "neuron-f64", strictly on the device too but compiled with
`options={"auto_cast": "fp64-to-fp32"}` (fp32 computation, float64 cast at the boundary), whose float64 outputs
are compared with eager float64 within the fp32 tolerance: a figure of its own, never merged into "neuron"'s.

    .venv/bin/python -m benchmarks.opinfo --ops double --dtypes fp32 fp64 --fp64-to-fp32
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import signal
import sys
import time
import traceback

os.environ.setdefault("NEURON_CC_FLAGS", "--no_cache")

import torch  # noqa: E402
import torch.utils._pytree as pytree  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int": torch.int32,
          "bool": torch.bool, "fp64": torch.float64}
TOLERANCES = {torch.float32: (1e-4, 1e-5), torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (1e-3, 1e-3)}
RANDOM = {"bernoulli", "normal", "uniform", "rand_like", "randn_like", "randint_like", "multinomial", "randint",
          "nn.functional.dropout", "nn.functional.dropout2d", "nn.functional.dropout3d", "nn.functional.alpha_dropout",
          "nn.functional.feature_alpha_dropout", "nn.functional.rrelu", "cauchy", "exponential", "geometric",
          "log_normal", "randn", "rand", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
          "nn.functional.scaled_dot_product_attention", "torch._refs.rand", "empty_permuted"}
FALLBACK_ENV = "TORCH_NEURONX_DISABLE_FALLBACK_EXECUTION"
WITH_FALLBACK = "neuron+cpu"  # neuronc with the CPU fallback of ops the device cannot run; "neuron" is strict
FP64_CAST = "neuron-f64"  # neuronc strict, with --auto-cast fp64-to-fp32: float64 computed in fp32
UNSUPPORTED_OP = re.compile(r"^\s*- (aten\.[\w.]+|stablehlo\.[\w.]+|chlo\.[\w.]+)", re.M)


def op_label(op) -> str:
    return f"{op.name}.{op.variant_test_name}" if op.variant_test_name else op.name


def select_ops(args) -> list:
    from torch.testing._internal.common_methods_invocations import op_db

    ops = list(op_db)
    if args.ops:
        wanted = set(args.ops)
        ops = [op for op in ops if op.name in wanted or op_label(op) in wanted]
    if args.match:
        ops = [op for op in ops if any(m in op_label(op) for m in args.match)]
    ops = ops[args.start::args.every]
    return ops[:args.limit] if args.limit else ops


class Sample:
    """One OpInfo sample as a function of its tensors: `fn(*tensors)` calls the op with the sample's other
    arguments (numbers, shapes, dims) fixed, as Dynamo specialises them."""

    def __init__(self, op, sample):
        self.op = op
        leaves, self.spec = pytree.tree_flatten((sample.input, sample.args, sample.kwargs))
        self.positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
        self.leaves = leaves
        self.tensors = [leaves[i] for i in self.positions]

    def fn(self, *tensors):
        leaves = list(self.leaves)
        for i, t in zip(self.positions, tensors):
            leaves[i] = t
        input, args, kwargs = pytree.tree_unflatten(leaves, self.spec)
        return self.op(input, *args, **kwargs)

    def inputs(self, requires_grad: bool) -> list:
        out = []
        for t in self.tensors:
            t = t.detach().clone()
            if requires_grad and (t.is_floating_point() or t.is_complex()):
                t.requires_grad_(True)
            out.append(t)
        return out


def _float_outputs(result) -> list:
    return [t for t in pytree.tree_leaves(result) if isinstance(t, torch.Tensor) and t.is_floating_point()
            and t.requires_grad]


def run(fn, sample: Sample, backward: bool):
    """(outputs, gradients of the float inputs or None): fn on fresh copies of the sample's tensors."""
    inputs = sample.inputs(backward)
    result = fn(*inputs)
    if not backward:
        return result, None
    outs = _float_outputs(result)
    wrt = [t for t in inputs if t.requires_grad]
    if not outs or not wrt:
        return result, None
    generator = torch.Generator().manual_seed(0)
    loss = sum((o * torch.randn(o.shape, generator=generator, dtype=torch.float32).to(o.dtype)).sum() for o in outs)
    grads = torch.autograd.grad(loss, wrt, allow_unused=True)
    return result, [None if g is None else g.detach() for g in grads]


def mismatch(got, want, random: bool, fp64_in_fp32: bool = False) -> str | None:
    """None if `got` matches `want` (eager), else what differs. `fp64_in_fp32`: a float64 output was computed in
    fp32 (--auto-cast fp64-to-fp32), held to fp32's tolerance (else float64 is compared exactly)."""
    got_leaves, want_leaves = pytree.tree_leaves(got), pytree.tree_leaves(want)
    if len(got_leaves) != len(want_leaves):
        return f"{len(got_leaves)} outputs, eager has {len(want_leaves)}"
    for g, w in zip(got_leaves, want_leaves):
        if isinstance(w, torch.Tensor):
            if not isinstance(g, torch.Tensor):
                return f"a {type(g).__name__} where eager returns a tensor"
            if g.shape != w.shape or g.dtype != w.dtype:
                return f"{g.dtype}{list(g.shape)} where eager has {w.dtype}{list(w.shape)}"
            if random:
                continue
            g, w = g.detach(), w.detach()
            if w.is_complex() or g.is_complex():  # compared as their real parts, with their parts' tolerance
                g, w = torch.view_as_real(g.resolve_conj()), torch.view_as_real(w.resolve_conj())
            rtol, atol = TOLERANCES.get(torch.float32 if fp64_in_fp32 and w.dtype == torch.float64 else w.dtype,
                                        (0, 0))
            close = torch.isclose(g, w, rtol=rtol, atol=atol, equal_nan=True) if rtol or atol else (
                (g == w) | (g.isnan() & w.isnan()) if w.is_floating_point() else g == w)
            if not bool(close.all()):
                wrong = (~close).sum().item()
                diff = (g.double() - w.double()).abs()
                worst = diff[~close].nan_to_num(nan=float("inf"), posinf=float("inf")).max().item() if wrong else 0.0
                return f"{wrong}/{w.numel()} elements off (up to {worst:.3g})"
        elif not random and g != w and not (isinstance(w, float) and w != w and g != g):
            return f"{g!r} where eager has {w!r}"
    return None


SIGN_FREE = {"svd", "linalg.svd", "linalg.eigh"}  # outputs with vectors unique only up to sign
UP_TO_SIGN = "equal up to the documented sign freedom"  # a class of its own, never counted as a pass


def equal_up_to_sign(label: str, sample: Sample, got, want) -> bool:
    """For an op of SIGN_FREE that failed the strict comparison: its values equal eager's (S, eigenvalues), its
    factors reconstruct the input (U diag(S) Vh; Q diag(L) Q^T as eager's), and the magnitudes of its vectors'
    columns equal eager's |U| |V| (|Q|), all at the strict tolerances."""
    got, want = [t.detach() for t in got], [t.detach() for t in want]
    rtol, atol = TOLERANCES.get(want[0].dtype, (0, 0))
    same = lambda g, w: g.shape == w.shape and bool(torch.isclose(g, w, rtol=rtol, atol=atol).all())  # noqa: E731
    if label == "linalg.eigh":
        (values, vectors), (want_values, want_vectors) = got, want
        rebuilt = lambda v, q: (q * v.unsqueeze(-2)) @ q.mT  # noqa: E731
        return (same(values, want_values) and same(rebuilt(values, vectors), rebuilt(want_values, want_vectors))
                and same(vectors.abs(), want_vectors.abs()))
    (u, s, v), (want_u, want_s, want_v) = got, want
    if label == "linalg.svd":  # Vh; torch.svd returns V
        v, want_v = v.mT, want_v.mT
    k = s.shape[-1]
    a = sample.tensors[0].detach()
    return (same(s, want_s) and same((u[..., :k] * s.unsqueeze(-2)) @ v[..., :k].mT, a)
            and same(u.abs(), want_u.abs()) and same(v.abs(), want_v.abs()))


NARROW = (torch.bfloat16, torch.float16)
ROUNDED_ONCE = "off eager's, equal to the fp32 reference rounded once"  # a class of its own, never a pass


def equals_fp32_reference(sample: Sample, got, want) -> bool:
    """For a bf16/fp16 sample that differs from eager: whether the compiled outputs equal, within their dtype's
    tolerance, the sample computed in fp32 (narrow inputs widened) and rounded once to eager's dtypes: the
    reference the test suite holds narrow results to (tolerances.py, Inductor's `reference_in_float`). Eager's own
    narrow kernels round in between (in bf16 steps), so a result exact to the reference may be off eager's."""
    try:
        wide = sample.fn(*[t.float() if t.dtype in NARROW else t for t in sample.inputs(False)])
    except Exception:  # noqa: BLE001 - no fp32 form of this sample: no reference
        return False
    wide_leaves, want_leaves = pytree.tree_leaves(wide), pytree.tree_leaves(want)
    if len(wide_leaves) != len(want_leaves):
        return False
    reference = [r.to(w.dtype) if isinstance(r, torch.Tensor) and isinstance(w, torch.Tensor) and r.shape == w.shape
                 else r for r, w in zip(wide_leaves, want_leaves)]
    return mismatch(got, reference, random=False) is None


def classify(err: BaseException) -> tuple:
    """(failure class, ops named) of an exception of a compiled call."""
    text = str(err)
    named = UNSUPPORTED_OP.findall(text)
    if "cannot be compiled" in text and named:
        return ("op cannot be compiled" if len(set(named)) == 1 else "several ops cannot be compiled"), named
    inner = getattr(err, "inner_exception", None) or err.__cause__ or err
    if "raised:" in text:  # BackendCompilerFailed: "backend='neuron' raised:\nType: message"
        text = text.split("raised:", 1)[1].strip()
    first = next((line for line in text.splitlines() if line.strip()), type(err).__name__)
    first = re.sub(r"0x[0-9a-f]+|\d+", "N", first)[:110]
    return f"{type(inner).__name__}: {first}", []


def check_sample(backend: str, sample: Sample, backward: bool, random: bool, fullgraph: bool = True) -> tuple:
    """('pass' | class, ops named, detail) of one sample compiled by `backend`, against eager (``fullgraph``:
    torch.compile's argument; False lets Dynamo break the graph)."""
    try:
        want, want_grads = run(sample.fn, sample, backward)
    except SampleTimeout:
        raise  # counted as failing, not as eager's refusal
    except Exception:  # noqa: BLE001 - eager itself refuses the sample: not counted
        return "eager error", [], ""
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters["stats"].clear()  # graphs_compiled counts this sample's graphs
    os.environ[FALLBACK_ENV] = "" if backend == WITH_FALLBACK else "1"
    neuron = backend in (WITH_FALLBACK, FP64_CAST)
    options = {"options": {"auto_cast": "fp64-to-fp32"}} if backend == FP64_CAST else {}
    compiled = torch.compile(sample.fn, backend="neuron" if neuron else backend, fullgraph=fullgraph, **options)
    try:
        got, got_grads = run(compiled, sample, backward)
    except Exception as err:  # noqa: BLE001 - every backend failure is a data point
        cls, named = classify(err)
        return cls, named, ""
    fp64_in_fp32 = backend == FP64_CAST
    wrong = mismatch(got, want, random, fp64_in_fp32)
    if wrong is None and backward and want_grads is not None:
        if got_grads is None:
            return "no gradient", [], ""
        wrong = mismatch([g for g in got_grads if g is not None], [g for g in want_grads if g is not None], random,
                         fp64_in_fp32)
        if wrong is not None:
            return ("random" if random else "WRONG GRADIENT"), [], wrong
    if (wrong is not None and not random and not backward and any(
            isinstance(w, torch.Tensor) and w.dtype in NARROW for w in pytree.tree_leaves(want))
            and equals_fp32_reference(sample, got, want)):
        return ROUNDED_ONCE, [], wrong
    if wrong is not None and op_label(sample.op) in SIGN_FREE and equal_up_to_sign(op_label(sample.op), sample,
                                                                                   got, want):
        return UP_TO_SIGN, [], wrong
    if wrong is not None:
        return ("random" if random else "WRONG RESULT"), [], wrong
    return ("random" if random else "pass"), [], ""


class SampleTimeout(Exception):
    """A sample used more CPU time than --sample-timeout allows: counted as a failure (a compile, load or run that a
    user would give up on), so that one such sample does not stop the whole run."""


@contextlib.contextmanager
def cpu_time_limit(seconds: float):
    """Raise SampleTimeout in this thread once the process has used ``seconds`` of CPU (user + system; not wall
    time, which other jobs on a shared machine stretch). 0: no limit."""
    if not seconds:
        yield
        return

    def expire(signum, frame):
        raise SampleTimeout(f"more than {seconds:g} CPU seconds")

    previous = signal.signal(signal.SIGPROF, expire)
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)


def graphs_compiled() -> int:
    """Graphs Dynamo handed a backend for the last sample (check_sample clears the count before it compiles)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def measure(ops, backends, dtypes, samples_per_op: int, backward: bool, verbose: bool,
            fullgraph: bool = True, timeout: float = 0) -> list:
    records = []
    for op in ops:
        label = op_label(op)
        for dtype_name in dtypes:
            dtype = DTYPES[dtype_name]
            if dtype not in op.supported_dtypes("cpu"):
                continue
            try:
                samples = [Sample(op, s) for _, s in zip(range(samples_per_op), op.sample_inputs(
                    "cpu", dtype, requires_grad=False))]
            except Exception:  # noqa: BLE001 - OpInfo's own generator fails: nothing to measure
                continue
            grad = backward and dtype.is_floating_point and op.supports_autograd
            for index, sample in enumerate(samples):
                for backend in backends:
                    start = time.perf_counter()
                    try:
                        with cpu_time_limit(timeout):
                            outcome, named, detail = check_sample(backend, sample, grad, op.name in RANDOM, fullgraph)
                    except SampleTimeout as err:
                        outcome, named, detail = "SampleTimeout", [], str(err)
                    except Exception as err:  # noqa: BLE001 - the harness goes on
                        outcome, named, detail = f"harness: {type(err).__name__}", [], str(err)[:200]
                        if verbose:
                            traceback.print_exc()
                    if outcome == "eager error":
                        break
                    records.append({"op": label, "dtype": dtype_name, "sample": index, "backend": backend,
                                    "direction": "backward" if grad else "forward", "outcome": outcome,
                                    "ops": named, "detail": detail, "graphs": graphs_compiled(),
                                    "seconds": round(time.perf_counter() - start, 2)})
                    if verbose or outcome not in ("pass", "random"):
                        print(f"  {backend:9s} {dtype_name:4s} {label}[{index}]: {outcome}"
                              f"{' ' + ', '.join(sorted(set(named))) if named else ''}{' ' + detail if detail else ''}",
                              flush=True)
    return records


def report(records: list, backends: list) -> None:
    print()
    print(f"{'backend':10s} {'dtype':5s} {'dir':8s} {'samples passing':>22s} {'ops fully passing':>18s} {'random':>7s}")
    for backend in backends:
        for key in sorted({(r["dtype"], r["direction"]) for r in records}):
            rows = [r for r in records if r["backend"] == backend and (r["dtype"], r["direction"]) == key]
            counted = [r for r in rows if r["outcome"] != "random"]
            passed = sum(r["outcome"] == "pass" for r in counted)
            by_op = collections.defaultdict(list)
            for r in counted:
                by_op[r["op"]].append(r["outcome"] == "pass")
            full = sum(all(v) for v in by_op.values())
            share = f"{100 * passed / len(counted):.1f}% ({passed}/{len(counted)})" if counted else "-"
            print(f"{backend:10s} {key[0]:5s} {key[1]:8s} {share:>22s} {f'{full}/{len(by_op)}':>18s} "
                  f"{len(rows) - len(counted):>7d}")
            up_to_sign = sum(r["outcome"] == UP_TO_SIGN for r in counted)
            if up_to_sign:
                print(f"{'':10s} {'':5s} {'':8s} {up_to_sign:>22d} of them (not passes): {UP_TO_SIGN}")
            uncompiled = sum(r["outcome"] == "pass" and r.get("graphs") == 0 for r in counted)
            if uncompiled:
                print(f"{'':10s} {'':5s} {'':8s} {uncompiled:>22d} of the passes: no graph reached the backend "
                      "(Dynamo ran the sample in Python)")
            rounded_once = sum(r["outcome"] == ROUNDED_ONCE for r in counted)
            if rounded_once:
                print(f"{'':10s} {'':5s} {'':8s} {rounded_once:>22d} of them (not passes): {ROUNDED_ONCE}")
    for backend in backends:
        rows = [r for r in records if r["backend"] == backend and r["outcome"] not in ("pass", "random")]
        if not rows:
            continue
        print(f"\n{backend}: failure classes (samples)")
        for cls, count in collections.Counter(r["outcome"] for r in rows).most_common(15):
            print(f"  {count:5d}  {cls}")
        named = collections.Counter(o for r in rows for o in set(r["ops"]))
        if named:
            print(f"{backend}: ops that cannot be compiled, most named first")
            print("  " + ", ".join(f"{o} ({n})" for o, n in named.most_common(30)))
        failing = collections.defaultdict(list)
        for r in rows:
            failing[r["op"]].append(r)
        print(f"{backend}: failing ops, most samples first (samples: cause of the first)")
        for op, rs in sorted(failing.items(), key=lambda item: (-len(item[1]), item[0])):
            cause = rs[0]["outcome"] + (" " + ", ".join(sorted(set(rs[0]["ops"]))) if rs[0]["ops"] else "")
            print(f"  {len(rs):3d}  {op}: {cause}{' ' + rs[0]['detail'] if rs[0]['detail'] else ''}")
        wrong = sorted({(r["op"], r["dtype"], r["direction"], r["detail"]) for r in rows
                        if r["outcome"].startswith("WRONG")})
        if wrong:
            print(f"{backend}: WRONG RESULTS (silent: the program ran)")
            for op, dtype, direction, detail in wrong:
                print(f"  {op} {dtype} {direction}: {detail}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", nargs="*", help="OpInfo names (name or name.variant), exact")
    parser.add_argument("--match", nargs="*", help="keep ops whose name contains one of these")
    parser.add_argument("--start", type=int, default=0, help="first op (index into the selection)")
    parser.add_argument("--every", type=int, default=1, help="every k-th op (a spread subset)")
    parser.add_argument("--limit", type=int, default=0, help="at most this many ops")
    parser.add_argument("--samples", type=int, default=3, help="samples per op and dtype")
    parser.add_argument("--dtypes", nargs="*", default=["fp32"], choices=sorted(DTYPES))
    parser.add_argument("--backward", action="store_true", help="compare gradients too (training graphs)")
    parser.add_argument("--peers", nargs="*", default=[], help="other backends side by side, e.g. inductor")
    parser.add_argument("--fallback", action="store_true",
                        help=f"also measure '{WITH_FALLBACK}': ops the device cannot run fall back to the CPU "
                             "('neuron' alone is strictly on the device)")
    parser.add_argument("--fp64-to-fp32", action="store_true",
                        help=f"also measure '{FP64_CAST}': strictly on the device with --auto-cast fp64-to-fp32 "
                             "(float64 outputs held to fp32's tolerance against eager float64)")
    parser.add_argument("--graph-breaks", action="store_true",
                        help="compile with fullgraph=False, torch.compile's default: Dynamo runs what it cannot "
                             "trace in Python between graphs (every backend)")
    parser.add_argument("--sample-timeout", type=float, default=600, metavar="CPU_SECONDS",
                        help="a sample (eager, compile, load, run; backends one at a time) using more CPU time counts "
                             "as failing, as 'SampleTimeout' (default 600; 0: none)")
    parser.add_argument("--json", help="write every sample's record here")
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args(argv)
    import logging

    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)
    import warnings

    warnings.filterwarnings("ignore")
    ops = select_ops(args)
    backends = ["neuron", *([WITH_FALLBACK] if args.fallback else []), *([FP64_CAST] if args.fp64_to_fp32 else []),
                *args.peers]
    print(f"{len(ops)} ops, up to {args.samples} samples per dtype ({', '.join(args.dtypes)}), "
          f"{'forward and backward' if args.backward else 'forward'}; backends: {', '.join(backends)}; "
          f"{'graph breaks allowed (fullgraph=False)' if args.graph_breaks else 'fullgraph=True'}", flush=True)
    start = time.perf_counter()
    records = measure(ops, backends, args.dtypes, args.samples, args.backward, args.verbose,
                      fullgraph=not args.graph_breaks, timeout=args.sample_timeout)
    report(records, backends)
    print(f"\n{time.perf_counter() - start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
