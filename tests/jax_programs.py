"""JAX programs for the JAX frontend's golden tests: an MLP, a transformer block written with jax.numpy and
jax.nn only, a training step (jax.grad and an SGD update) and an RNN written with lax.scan (forward, and its
gradient: a reverse scan), each with its arguments."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def mlp(params, x):
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    return jax.nn.gelu(h @ params["w2"] + params["b2"])


def layer_norm(x, scale, shift, eps=1e-5):
    mean = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * scale + shift


def transformer_block(p, x, heads=4):
    """Pre-norm causal self-attention and a GELU MLP, each with a residual connection."""
    batch, seq, dim = x.shape

    def split_heads(t):
        return t.reshape(batch, seq, heads, dim // heads).transpose(0, 2, 1, 3)

    h = layer_norm(x, p["ln1_scale"], p["ln1_shift"])
    q, k, v = map(split_heads, jnp.split(h @ p["w_qkv"] + p["b_qkv"], 3, axis=-1))
    scores = q @ k.transpose(0, 1, 3, 2) / jnp.sqrt(jnp.asarray(dim // heads, x.dtype))
    causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    scores = jnp.where(causal, scores, jnp.finfo(x.dtype).min)
    attended = (jax.nn.softmax(scores, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(batch, seq, dim)
    x = x + attended @ p["w_out"] + p["b_out"]
    h = layer_norm(x, p["ln2_scale"], p["ln2_shift"])
    return x + jax.nn.gelu(h @ p["w_up"] + p["b_up"]) @ p["w_down"] + p["b_down"]


def mse(params, x, y):
    return jnp.mean((mlp(params, x) - y) ** 2)


def sgd_step(params, x, y, learning_rate=0.1):
    """One training step: the loss, and the parameters moved against its gradient."""
    loss, grads = jax.value_and_grad(mse)(params, x, y)
    return jax.tree_util.tree_map(lambda p, g: p - learning_rate * g, params, grads), loss


def rnn(params, xs):
    """An Elman RNN over the sequence with lax.scan (a while loop in StableHLO): the last state and every state."""
    def cell(h, x):
        h = jnp.tanh(x @ params["wx"] + h @ params["wh"] + params["b"])
        return h, h

    return jax.lax.scan(cell, jnp.zeros(params["b"].shape, xs.dtype), xs)


def rnn_loss_gradient(params, xs):
    """The gradient of the RNN's states' mean square: a reverse scan over saved states."""
    return jax.grad(lambda p: jnp.mean(rnn(p, xs)[1] ** 2))(params)


class _Draws:
    """Normal draws from numpy's generator (jax.random would compile a program for every shape drawn)."""

    def __init__(self, seed: int):
        self.generator = np.random.default_rng(seed)

    def __call__(self, *shape, scale=1.0, offset=0.0):
        return jnp.asarray(offset + scale * self.generator.standard_normal(shape), jnp.float32)


def mlp_params(draw, features=16, hidden=32, out=8):
    return {"w1": draw(features, hidden, scale=features ** -0.5), "b1": draw(hidden, scale=0.1),
            "w2": draw(hidden, out, scale=hidden ** -0.5), "b2": draw(out, scale=0.1)}


def block_params(draw, dim=32):
    return {"ln1_scale": draw(dim, scale=0.1, offset=1.0), "ln1_shift": draw(dim, scale=0.1),
            "w_qkv": draw(dim, 3 * dim, scale=dim ** -0.5), "b_qkv": draw(3 * dim, scale=0.1),
            "w_out": draw(dim, dim, scale=dim ** -0.5), "b_out": draw(dim, scale=0.1),
            "ln2_scale": draw(dim, scale=0.1, offset=1.0), "ln2_shift": draw(dim, scale=0.1),
            "w_up": draw(dim, 4 * dim, scale=dim ** -0.5), "b_up": draw(4 * dim, scale=0.1),
            "w_down": draw(4 * dim, dim, scale=(4 * dim) ** -0.5), "b_down": draw(dim, scale=0.1)}


def rnn_params(draw, features=16, hidden=32):
    return {"wx": draw(features, hidden, scale=features ** -0.5), "wh": draw(hidden, hidden, scale=hidden ** -0.5),
            "b": draw(hidden, scale=0.1)}


def build(name: str, dtype=jnp.float32) -> tuple:
    """(function, arguments) of a program, its arrays in `dtype`."""
    draw = _Draws(0)
    programs = {
        "mlp": lambda: (mlp, (mlp_params(draw), draw(4, 16))),
        "transformer_block": lambda: (transformer_block, (block_params(draw), draw(2, 8, 32))),
        "sgd_step": lambda: (sgd_step, (mlp_params(draw), draw(4, 16), draw(4, 8))),
        "rnn": lambda: (rnn, (rnn_params(draw), draw(6, 16))),
        "rnn_loss_gradient": lambda: (rnn_loss_gradient, (rnn_params(draw), draw(6, 16))),
    }
    function, args = programs[name]()
    return function, jax.tree_util.tree_map(lambda a: a.astype(dtype), args)


PROGRAMS = ("mlp", "transformer_block", "sgd_step", "rnn", "rnn_loss_gradient")
