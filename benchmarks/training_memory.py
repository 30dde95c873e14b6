"""Peak host memory of compiling one training step (issue 21: "compiling the GPT-2-small and Llama-style training
graphs peaks below 4 GB").

Builds the model from its config (no download), compiles forward + backward of one step with
``torch.compile(backend="neuron")`` (NEURON_CC_FLAGS=--no_cache), and prints the peak resident set of the compiling
process (getrusage, and a thread sampling /proc/self/statm every 50 ms that also records where the compile or run
was at the highest sample) and of the torch-mlir child (getrusage of the waited-for children), then the bytes of
each compiled graph's tensors by kind (an input "resident" when read in place from the parameter's own memory) and
the size of the runtime's access-check tables (``LoadedProgram._access_tables``) of each memory of each program.

    .venv/bin/python -m benchmarks.training_memory [--model gpt2|llama] [--seq 128] [--timing-only]
    (from the repo root; needs Hugging Face transformers: pip install -e .[bench])

gpt2: HF GPT2LMHeadModel from GPT2Config() (GPT-2 small). llama: HF LlamaForCausalLM, 2 layers, hidden 1024,
16 heads / 4 KV heads, intermediate 2816, vocab 32000. Run one configuration per process: the peaks are the process's.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import resource
import sys
import threading
import time
import traceback

os.environ["NEURON_CC_FLAGS"] = os.environ.get("NEURON_CC_FLAGS", "") + " --no_cache"

import torch  # noqa: E402 - after the flags above

from benchmarks.hooks import timing_only  # noqa: E402

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE / 2**20


class Sampler(threading.Thread):
    """Samples this process's resident set every ``period`` s; keeps the highest, and where the compile was then."""

    def __init__(self, period: float = 0.05):
        super().__init__(daemon=True)
        self.period, self.peak, self.where, self.stop = period, 0.0, "", threading.Event()

    def stack(self) -> str:
        """The innermost frames of a thread in neuronc or the runtime (the backward's compile and run are called
        from the autograd engine), else of any other thread."""
        stacks = [traceback.extract_stack(f) for ident, f in sys._current_frames().items() if ident != self.ident]
        ours = [s for s in stacks if any("/neuronc/" in f.filename or "/runtime/" in f.filename for f in s)]
        stack = (ours or stacks or [[]])[0]
        return " <- ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in reversed(stack[-6:]))

    def run(self) -> None:
        while not self.stop.is_set():
            rss = rss_mib()
            if rss > self.peak:
                self.peak, self.where = rss, self.stack()
            time.sleep(self.period)


def build(name: str):
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    if name == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config()), 50257
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=1024, intermediate_size=2816,
                                      num_attention_heads=16, num_key_value_heads=4, vocab_size=32000)
    return transformers.LlamaForCausalLM(config), 32000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("gpt2", "llama"), default="gpt2")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--timing-only", action="store_true", help="the emulator only times the programs")
    options = parser.parse_args()

    from neuronc.neff.program import TensorKind
    from runtime.core import LoadedProgram

    tables = []  # bytes of each (writers, probes) pair the access check made
    original = LoadedProgram._access_tables

    def counted(self, *args, **kwargs):
        made = original(self, *args, **kwargs)
        tables.append((self.neff.name, sum(c.table.nbytes for c in made)))
        return made

    LoadedProgram._access_tables = counted
    model, vocab = build(options.model)
    ids = torch.randint(0, vocab, (1, options.seq))
    compiled = torch.compile(model, backend="neuron")
    before = rss_mib()
    sampler = Sampler()
    sampler.start()
    start = time.perf_counter()
    with timing_only() if options.timing_only else contextlib.nullcontext():
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
    seconds = time.perf_counter() - start
    sampler.stop.set()
    sampler.join()
    self_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    child_peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    print(f"{options.model} seq {options.seq} {'timing only' if options.timing_only else 'with numerics'}: "
          f"{seconds:.0f} s; RSS before the compile {before:.0f} MiB; peak: compiling process {self_peak:.0f} MiB "
          f"(getrusage), {sampler.peak:.0f} MiB (sampled), torch-mlir child {child_peak:.0f} MiB")
    print(f"  highest sample in: {sampler.where or '(no stack)'}")
    from neuronc.pytorch import backend

    for function in backend.compiled_graphs:
        neff, resident = function.compiled.neff, set(function.resident)
        kinds: dict = {}
        for t in neff.tensors:
            kind = "resident input" if t.kind == TensorKind.INPUT and t.index in resident else t.kind.name.lower()
            kinds[kind] = kinds.get(kind, 0) + t.nbytes
        print(f"  graph {neff.name} ({sum(map(len, neff.streams.values()))} instructions), tensor MiB: "
              + ", ".join(f"{kind} {nbytes / 2**20:.0f}" for kind, nbytes in kinds.items()))
    print(f"  access-check tables (writers + probes) of each memory of each program loaded, MiB: "
          f"{[round(nbytes / 2**20) for _, nbytes in tables]}")


if __name__ == "__main__":
    main()
