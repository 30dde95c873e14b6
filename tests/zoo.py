"""The model zoo of the golden tests: plain torch.nn models, random init, small widths.

Each entry builds (model, example inputs) from a fixed seed, so eager PyTorch on CPU gives the
golden outputs in the same run. Models that need an op neuronc cannot compile yet wait in PENDING
(same form), each with the op that blocks it; `neuronc check` on it names the op and its line.
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


class SdpaCausalSelfAttention(CausalSelfAttention):
    """The same attention through F.scaled_dot_product_attention(is_causal=True), as Hugging Face's GPT-2 runs it by
    default (its `sdpa` attention), with the same weights."""

    def forward(self, x):
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=-1)
        q, k, v = (t.view(batch, seq, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))


class TransformerBlock(nn.Module):
    """Pre-norm block: LayerNorm, causal multi-head self-attention (plain matmuls unless `attention` says
    otherwise), GELU MLP."""

    def __init__(self, width=128, heads=4, attention=CausalSelfAttention):
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = attention(width, heads)
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


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 conv + batch-norm, a 1x1 strided projection when the shape changes."""

    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.downsample = None
        if stride != 1 or cin != cout:
            self.downsample = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + identity)


class ResNet(nn.Module):
    """A small ResNet: stem, two stages of basic blocks (the second strided), global average pooling."""

    def __init__(self, width=16, classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width), nn.ReLU())
        self.layer1 = nn.Sequential(BasicBlock(width, width), BasicBlock(width, width))
        self.layer2 = nn.Sequential(BasicBlock(width, 2 * width, stride=2), BasicBlock(2 * width, 2 * width))
        self.fc = nn.Linear(2 * width, classes)

    def forward(self, x):
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class EncoderBlock(nn.Module):
    """Pre-norm (ViT) or post-norm (BERT) encoder block: bidirectional attention with an optional
    key mask through scaled_dot_product_attention, and a GELU MLP."""

    def __init__(self, width, heads, pre_norm):
        super().__init__()
        self.heads, self.pre_norm = heads, pre_norm
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def attention(self, x, mask):
        batch, seq, width = x.shape
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in self.qkv(x).split(width, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))

    def forward(self, x, mask=None):
        if self.pre_norm:
            x = x + self.attention(self.ln1(x), mask)
            return x + self.mlp(self.ln2(x))
        x = self.ln1(x + self.attention(x, mask))
        return self.ln2(x + self.mlp(x))


class ViT(nn.Module):
    """A small vision transformer: strided-conv patch embedding, class token, learned position
    embeddings, pre-norm encoder blocks, classification from the class token."""

    def __init__(self, image=16, patch=4, width=32, heads=2, depth=2, classes=10):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, width, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.randn(1, 1, width) * 0.02)
        self.pos_embed = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, width) * 0.02)
        self.blocks = nn.ModuleList(EncoderBlock(width, heads, pre_norm=True) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, images):
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


class BertEncoder(nn.Module):
    """A small BERT-style encoder: word + position + token-type embeddings, post-norm blocks whose
    attention ignores padding (a boolean mask over keys), and a tanh pooler on the first token."""

    def __init__(self, vocab=100, width=32, heads=2, depth=2, positions=32, token_types=2):
        super().__init__()
        self.words = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(positions, width)
        self.token_types = nn.Embedding(token_types, width)
        self.ln = nn.LayerNorm(width)
        self.blocks = nn.ModuleList(EncoderBlock(width, heads, pre_norm=False) for _ in range(depth))
        self.pooler = nn.Linear(width, width)

    def forward(self, input_ids, token_type_ids, attention_mask):
        positions = torch.arange(input_ids.shape[1])
        x = self.ln(self.words(input_ids) + self.positions(positions) + self.token_types(token_type_ids))
        mask = attention_mask[:, None, None, :]  # [batch, 1, 1, keys]: True where a real token is
        for block in self.blocks:
            x = block(x, mask)
        return torch.tanh(self.pooler(x[:, 0])), x


class RMSNorm(nn.Module):
    def __init__(self, width, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(width))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary(x, positions):
    """RoPE: rotate the two halves of each head's features by position-dependent angles."""
    half = x.shape[-1] // 2
    angles = positions[:, None].float() / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


class LlamaBlock(nn.Module):
    """RMSNorm, grouped-query causal attention with RoPE through scaled_dot_product_attention, SwiGLU."""

    def __init__(self, width=64, heads=4, kv_heads=2, hidden=172):
        super().__init__()
        self.heads, self.kv_heads, self.head = heads, kv_heads, width // heads
        self.norm1, self.norm2 = RMSNorm(width), RMSNorm(width)
        self.q = nn.Linear(width, width, bias=False)
        self.kv = nn.Linear(width, 2 * kv_heads * self.head, bias=False)
        self.o = nn.Linear(width, width, bias=False)
        self.gate, self.up = nn.Linear(width, hidden, bias=False), nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x):
        batch, seq, width = x.shape
        h = self.norm1(x)
        q = self.q(h).view(batch, seq, self.heads, self.head).transpose(1, 2)
        k, v = self.kv(h).view(batch, seq, 2, self.kv_heads, self.head).permute(2, 0, 3, 1, 4)
        positions = torch.arange(seq)
        q, k = rotary(q, positions), rotary(k, positions)
        repeat = self.heads // self.kv_heads
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(batch, seq, width))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    def __init__(self, vocab=128, width=64, layers=2):
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(LlamaBlock(width) for _ in range(layers))
        self.norm = RMSNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx):
        x = self.tokens(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class MambaBlock(nn.Module):
    """Mamba-style selective scan: input projection, causal depthwise conv1d, SiLU, input-dependent
    step sizes (softplus) and B/C, a linear recurrence over the sequence (unrolled: static length), gating."""

    def __init__(self, width=32, state=8, inner=64, kernel=4):
        super().__init__()
        self.inner, self.state = inner, state
        self.in_proj = nn.Linear(width, 2 * inner)
        self.conv = nn.Conv1d(inner, inner, kernel, groups=inner, padding=kernel - 1)
        self.x_proj = nn.Linear(inner, 1 + 2 * state)
        self.dt_proj = nn.Linear(1, inner)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, state + 1, dtype=torch.float32)).repeat(inner, 1))
        self.D = nn.Parameter(torch.ones(inner))
        self.out_proj = nn.Linear(inner, width)

    def forward(self, x):
        batch, seq, _ = x.shape
        u, gate = self.in_proj(x).chunk(2, dim=-1)
        u = F.silu(self.conv(u.transpose(1, 2))[..., :seq].transpose(1, 2))  # causal: drop the look-ahead
        dt, B, C = self.x_proj(u).split([1, self.state, self.state], dim=-1)
        dt = F.softplus(self.dt_proj(dt))  # [batch, seq, inner]
        decay = torch.exp(dt[..., None] * -torch.exp(self.A_log))  # [batch, seq, inner, state]
        drive = (dt * u)[..., None] * B[:, :, None, :]
        h = torch.zeros(batch, self.inner, self.state, dtype=x.dtype)
        ys = []
        for t in range(seq):
            h = decay[:, t] * h + drive[:, t]
            ys.append((h * C[:, t, None, :]).sum(-1))
        y = torch.stack(ys, dim=1) + u * self.D
        return self.out_proj(y * F.silu(gate))


class MixtureOfExperts(nn.Module):
    """Top-k routing: router softmax, top-k experts per token, the routed (token, expert) slots
    gathered and grouped by expert (a stable argsort), each slot's expert weights gathered, and the
    weighted results scattered back onto their tokens (index_add)."""

    def __init__(self, width=32, experts=4, hidden=64, k=2):
        super().__init__()
        self.k = k
        self.router = nn.Linear(width, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, width, hidden) / math.sqrt(width))
        self.w2 = nn.Parameter(torch.randn(experts, hidden, width) / math.sqrt(hidden))

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        weights, chosen = torch.topk(torch.softmax(self.router(tokens), dim=-1), self.k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        expert_of_slot = chosen.reshape(-1)
        order = torch.argsort(expert_of_slot, stable=True)
        token_of_slot = order // self.k
        routed = tokens[token_of_slot]  # [tokens * k, width]
        expert = expert_of_slot[order]
        hidden = F.gelu(torch.bmm(routed[:, None, :], self.w1[expert]))
        y = torch.bmm(hidden, self.w2[expert])[:, 0, :] * weights.reshape(-1)[order][:, None]
        return torch.zeros_like(tokens).index_add(0, token_of_slot, y).reshape(x.shape)


class UNetBlock(nn.Module):
    """A diffusion UNet level: sinusoidal timestep embedding, strided-conv downsampling, GroupNorm +
    SiLU + conv, nearest upsampling plus a transposed conv, skip concatenation, GroupNorm + conv."""

    def __init__(self, channels=8, time_dim=16):
        super().__init__()
        self.time_dim = time_dim
        self.time = nn.Sequential(nn.Linear(time_dim, channels), nn.SiLU())
        self.down = nn.Conv2d(channels, channels, 3, stride=2, padding=1)
        self.norm1, self.conv1 = nn.GroupNorm(4, channels), nn.Conv2d(channels, channels, 3, padding=1)
        self.up = nn.ConvTranspose2d(channels, channels, 2, stride=2)
        self.norm2, self.conv2 = nn.GroupNorm(4, 2 * channels), nn.Conv2d(2 * channels, channels, 3, padding=1)

    def embed(self, t):
        half = self.time_dim // 2
        angles = t[:, None].float() * torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
        return torch.cat([angles.sin(), angles.cos()], dim=-1).to(t.dtype)

    def forward(self, x, t):
        h = self.down(x)
        h = self.conv1(F.silu(self.norm1(h))) + self.time(self.embed(t))[:, :, None, None]
        h = F.interpolate(h, scale_factor=2, mode="nearest") + self.up(h)
        return self.conv2(F.silu(self.norm2(torch.cat([h, x], dim=1))))


class Recommender(nn.Module):
    """Embedding-bag recommendation model: a bag (sum) of each user's item ids, a masked mean of the
    same history (a boolean mask of real entries), the candidate item's embedding, dense features, MLP."""

    def __init__(self, items=100, width=16, dense=8):
        super().__init__()
        self.bag = nn.EmbeddingBag(items, width, mode="sum")
        self.items = nn.Embedding(items, width)
        self.mlp = nn.Sequential(nn.Linear(3 * width + dense, 32), nn.ReLU(), nn.Linear(32, 1))

    def forward(self, history, mask, candidate, dense):
        offsets = torch.arange(0, history.numel(), history.shape[1])
        bag = self.bag(history.reshape(-1), offsets)
        kept = mask[..., None].to(dense.dtype)
        mean = (self.items(history) * kept).sum(1) / kept.sum(1).clamp(min=1)
        return torch.sigmoid(self.mlp(torch.cat([bag, mean, self.items(candidate), dense], dim=-1))).squeeze(-1)


def _with_running_statistics(model):
    """Non-trivial batch-norm statistics, as after training."""
    for bn in (m for m in model.modules() if isinstance(m, nn.BatchNorm2d)):
        bn.running_mean.uniform_(-0.5, 0.5)
        bn.running_var.uniform_(0.5, 2.0)
    return model


def _bert():
    batch, seq = 2, 16
    input_ids = torch.randint(0, 100, (batch, seq))
    token_type_ids = (torch.arange(seq) >= seq // 2).long().expand(batch, seq).contiguous()  # sentence A, B
    attention_mask = torch.ones(batch, seq, dtype=torch.bool)
    attention_mask[1, 11:] = False  # the second sequence is padded
    return BertEncoder(), (input_ids, token_type_ids, attention_mask)


ZOO = {
    "mlp": lambda: (MLP(), (torch.randn(8, 32),)),
    "cnn": lambda: (_with_running_statistics(SmallCNN()), (torch.randn(2, 3, 16, 16),)),
    "transformer_block": lambda: (TransformerBlock(), (torch.randn(2, 64, 128),)),
    "gpt2": lambda: (GPT2(), (torch.randint(0, 128, (2, 64)),)),
    "resnet": lambda: (_with_running_statistics(ResNet()), (torch.randn(2, 3, 16, 16),)),
    "vit": lambda: (ViT(), (torch.randn(2, 3, 16, 16),)),
    "bert": _bert,  # integer token ids and token types, a boolean padding mask
    "llama": lambda: (Llama(), (torch.randint(0, 128, (2, 32)),)),
    "mamba": lambda: (MambaBlock(), (torch.randn(2, 16, 32),)),
    "moe": lambda: (MixtureOfExperts(), (torch.randn(2, 8, 32),)),
    "unet": lambda: (UNetBlock(), (torch.randn(2, 8, 8, 8), torch.rand(2) * 100)),
    "recommender": lambda: (Recommender(), (torch.randint(0, 100, (4, 6)), torch.rand(4, 6) > 0.3,
                                            torch.randint(0, 100, (4,)), torch.randn(4, 8))),
}


def build(name: str, seed: int = 0):
    """(model in eval mode, example inputs), deterministic for a given seed."""
    torch.manual_seed(seed)
    model, inputs = ZOO[name]()
    return model.eval(), inputs


# Models of issue 5 that need ops not lowered yet; they join ZOO when `neuronc check` passes on them.
PENDING: dict = {}
