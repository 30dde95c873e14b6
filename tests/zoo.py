"""The model zoo of the golden tests: plain torch.nn models, random init, small widths.

Each entry builds (model, example inputs) from a fixed seed, so eager PyTorch on CPU gives the
golden outputs in the same run.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    """Three linear layers with GELU between them and a softmax on top."""

    def __init__(self, width_in=32, hidden=128, classes=10):
        super().__init__()
        self.fc1 = nn.Linear(width_in, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, classes)

    def forward(self, x):
        x = F.gelu(self.fc1(x))
        x = F.gelu(self.fc2(x))
        return torch.softmax(self.fc3(x), dim=-1)


class SmallCNN(nn.Module):
    """conv (stride 1 and 2, padding) + batch-norm (eval) + ReLU + max-pool + adaptive avg-pool + linear."""

    def __init__(self, classes=10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, stride=1, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, stride=2, padding=1)
        self.bn2 = nn.BatchNorm2d(32)
        self.head = nn.Linear(32, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.relu(self.bn2(self.conv2(x)))
        x = F.adaptive_avg_pool2d(x, 1).flatten(1)
        return self.head(x)


class CausalSelfAttention(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        batch, seq, width = x.shape
        head = width // self.heads
        q, k, v = self.qkv(x).split(width, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, head).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(head)
        mask = torch.tril(torch.ones(seq, seq, dtype=torch.bool))
        scores = scores.masked_fill(~mask, float("-inf"))
        y = torch.softmax(scores, dim=-1) @ v
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))


class TransformerBlock(nn.Module):
    """Pre-norm block: LayerNorm, causal multi-head self-attention with plain matmuls, GELU MLP."""

    def __init__(self, width=128, heads=4):
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT2(nn.Module):
    """GPT-2-style decoder: learned token and position embeddings, pre-norm causal blocks, a final
    LayerNorm and an LM head tied to the token embedding. With targets, returns the cross-entropy loss."""

    def __init__(self, vocab=128, width=64, layers=2, heads=4, context=64):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(TransformerBlock(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tokens.weight  # tied
        nn.init.normal_(self.tokens.weight, std=0.02)  # GPT-2's initialisation: logits start near uniform
        nn.init.normal_(self.positions.weight, std=0.01)

    def forward(self, idx, targets=None):
        x = self.tokens(idx) + self.positions(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _cnn():
    model = SmallCNN()
    for bn in (model.bn1, model.bn2):  # non-trivial running statistics, as after training
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
    return model, (torch.randn(2, 3, 16, 16),)


ZOO = {
    "mlp": lambda: (MLP(), (torch.randn(8, 32),)),
    "cnn": _cnn,
    "transformer_block": lambda: (TransformerBlock(), (torch.randn(2, 64, 128),)),
    "gpt2": lambda: (GPT2(), (torch.randint(0, 128, (2, 64)),)),
}


def build(name: str, seed: int = 0):
    """(model in eval mode, example inputs), deterministic for a given seed."""
    torch.manual_seed(seed)
    model, inputs = ZOO[name]()
    return model.eval(), inputs
