"""PyTorch's OpInfo samples run eagerly on the `neuron` device against the same samples on the CPU (the compiled
path is benchmarks/opinfo.py). Each sample's tensors are moved to the device, the op is called as a user would,
and its results come back: counted as pass (values within 1e-4, or the project's tolerance of a 16-bit float dtype;
same dtypes and shapes), mismatch, error (with
the error's first line) or timeout. Random ops and uninitialised results mismatch by nature and are counted but
not listed; so do samples whose input is a view of a larger tensor read through `as_strided` (moving a view
copies only its elements). tensor_split's samples error as on CUDA: their index tensor must stay on the CPU.
Not a test: nothing is asserted.

    .venv/bin/python -m benchmarks.eager_opinfo [--ops add,fft.ifft] [--samples 2] [--dtype fp32]
"""
from __future__ import annotations

import argparse
import collections
import warnings

import torch

from benchmarks.opinfo import SampleTimeout, cpu_time_limit
from neuronc.tolerances import TOLERANCES

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "int64": torch.int64}
NONDETERMINISTIC = ("empty", "new_empty", "rand", "randn", "randint", "normal", "uniform", "bernoulli",
                    "multinomial", "dropout", "rrelu", "fractional_max_pool", "cauchy", "exponential",
                    "geometric", "log_normal", "as_strided")


def _moved(value, device):
    return torch.utils._pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, value)


def _same(expected, got) -> bool:
    want, have = torch.utils._pytree.tree_leaves(expected), torch.utils._pytree.tree_leaves(got)
    if len(want) != len(have):
        return False
    for a, b in zip(want, have):
        if not isinstance(a, torch.Tensor):
            continue
        if not isinstance(b, torch.Tensor) or a.shape != b.shape or a.dtype != b.dtype:
            return False
        b = b.cpu()
        if a.dtype.itemsize == 1 and a.is_floating_point():  # fp8: the CPU has no arithmetic on it
            a, b = a.float(), b.float()
        tolerance = TOLERANCES[a.dtype] if a.dtype in (torch.bfloat16, torch.float16) else dict(rtol=1e-4, atol=1e-4)
        close = torch.allclose(a, b, equal_nan=True, **tolerance) if a.is_floating_point() or a.is_complex() \
            else torch.equal(a, b)
        if not close:
            return False
    return True


def sweep(ops, dtype, samples: int, seconds: float) -> tuple:
    """(Counter of outcomes, [(op, outcome, detail)] of the listed failures)."""
    device = torch.device("neuron", 0)
    counts, failures = collections.Counter(), []
    for op in ops:
        name = op.name + ("." + op.variant_test_name if op.variant_test_name else "")
        try:
            cases = list(op.sample_inputs("cpu", dtype, requires_grad=False))[:samples]
        except Exception:  # noqa: BLE001 - an OpInfo without samples of this dtype
            continue
        for sample in cases:
            try:
                torch.manual_seed(0)
                expected = op(sample.input, *sample.args, **sample.kwargs)
            except Exception:  # noqa: BLE001 - eager refuses the sample on the CPU too
                continue
            try:
                with cpu_time_limit(seconds):
                    torch.manual_seed(0)
                    got = op(_moved(sample.input, device), *_moved(sample.args, device),
                             **_moved(sample.kwargs, device))
                outcome, detail = ("pass" if _same(expected, got) else "mismatch"), ""
            except SampleTimeout:
                outcome, detail = "timeout", ""
            except Exception as e:  # noqa: BLE001 - counted and listed
                outcome, detail = "error", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:160]
            counts[outcome] += 1
            if outcome != "pass" and not any(word in name for word in NONDETERMINISTIC):
                failures.append((name, outcome, detail))
    return counts, failures


def main() -> None:
    from torch.testing._internal.common_methods_invocations import op_db

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ops", default="", help="comma-separated OpInfo names (default: all of op_db)")
    parser.add_argument("--samples", type=int, default=2, help="samples per op")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--seconds", type=float, default=20.0, help="CPU seconds a sample may take")
    args = parser.parse_args()
    wanted = set(filter(None, args.ops.split(",")))
    ops = [op for op in op_db if not wanted or op.name in wanted]
    warnings.simplefilter("ignore")
    torch.neuron._lazy_init()
    counts, failures = sweep(ops, DTYPES[args.dtype], args.samples, args.seconds)
    print(f"{len(ops)} OpInfos, {sum(counts.values())} samples: " + ", ".join(f"{k} {v}" for k, v in counts.most_common()))
    for name, outcome, detail in failures:
        print(f"  {name}: {outcome} {detail}")


if __name__ == "__main__":
    main()
