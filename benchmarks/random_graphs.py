"""Models with dropout in train mode under torch.compile(backend="neuron"): how many NEFFs a training step compiles,
how many graphs run in part on the CPU, the first step's time (compile included) and a later step's time.

Random ops are drawn on the device inside the compiled graphs (neuronc/frontend/random_draws.py); before that, each
dropout cut its graph in two with the draw on the CPU between (a partition, neuronc/pytorch/partition.py). Models:
`mlp` (Linear, Dropout(0.1), ReLU, Linear), `gpt2` (Hugging Face's GPT2LMHeadModel built from a 2-layer config,
dropout 0.1 everywhere, needs transformers: `pip install -e .[bench]`). Tensors on the CPU, or `--device neuron`.
The device time is the NEFFs' estimated time (the cost model's), the random ops on the CPU of a partitioned graph
not included.

    .venv/bin/python -m benchmarks.random_graphs [--models mlp gpt2] [--device cpu|neuron]   (from the repo root)
"""
from __future__ import annotations

import argparse
import os
import time
import warnings

os.environ["NEURON_CC_FLAGS"] = os.environ.get("NEURON_CC_FLAGS", "") + " --no_cache"

import torch  # noqa: E402
from torch import nn  # noqa: E402


def mlp():
    model = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.1), nn.ReLU(), nn.Linear(64, 64))
    return model, (torch.randn(32, 64),), lambda out: out.square().mean()


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=128, n_positions=64)
    model = GPT2LMHeadModel(config)
    ids = torch.randint(0, 128, (2, 32))
    return model, (ids,), lambda out: out[0].float().square().mean()


MODELS = {"mlp": mlp, "gpt2": gpt2}


def measure(name: str, device: str) -> str:
    from neuronc.pytorch import backend, partition

    torch._dynamo.reset()
    torch.manual_seed(0)
    model, inputs, loss_of = MODELS[name]()
    model = model.to(device).train()
    inputs = tuple(i.to(device) for i in inputs)
    kwargs = {"use_cache": False, "return_dict": False} if name == "gpt2" else {}
    compiled = torch.compile(model, backend="neuron")
    compiles, partitioned = backend.compile_count(), partition.partitioned_graphs

    def step():
        loss = loss_of(compiled(*inputs, **kwargs))
        loss.backward()
        if device != "cpu":
            torch.neuron.synchronize()

    start = time.perf_counter()
    step()
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(3):
        step()
    later = (time.perf_counter() - start) / 3
    device_us = sum(f.compiled.neff.estimated_ns for f in backend.compiled_graphs[compiles:]) / 1e3
    return (f"{name:5s} on {device}: {backend.compile_count() - compiles} NEFFs, "
            f"{partition.partitioned_graphs - partitioned} graph(s) partitioned with ops on the CPU, "
            f"first step {first:.1f} s, later steps {later * 1e3:.0f} ms (host wall clock, the emulator's run "
            f"included), estimated device time of the NEFFs {device_us:.0f} us per step")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--device", default="cpu", choices=["cpu", "neuron"])
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    for name in args.models:
        print(measure(name, args.device), flush=True)


if __name__ == "__main__":
    main()
