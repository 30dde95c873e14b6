"""The 12-layer GPT-2-small forward of the compile-time benchmarks (issues 4 and 6), from the test zoo.

Width 768, 12 heads, vocabulary 50257, context 1024; one sequence of 512 tokens (batch 1), in eval mode.
"""
from __future__ import annotations

import torch

from tests.zoo import GPT2

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def build(dtype: str = "bf16", layers: int = 12, seq: int = 512, seed: int = 0):
    """(model in eval mode, (token ids,)), deterministic for a given seed."""
    torch.manual_seed(seed)
    model = GPT2(vocab=50257, width=768, layers=layers, heads=12, context=1024).eval().to(DTYPES[dtype])
    return model, (torch.randint(0, 50257, (1, seq)),)
