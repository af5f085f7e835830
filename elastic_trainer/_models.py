"""The default workload: a small decoder-only transformer language model."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .config._settings import check_transformer_settings

# The models below vmap a module's bound ``__call__``, not the module: JAX names each function it vmaps, from its
# code object or else from ``str()`` of it (jax/_src/api_util.py, fun_sourceinfo), and an Equinox module's ``str()``
# pretty-prints the whole module. Tracing the default model's loss and gradient spent 34 of its 216 ms in those
# ``str()`` calls, and spends 7 ms now, in Equinox's own attention (cProfile; jax 0.10.2, equinox 0.13.8). The
# computation is the same.


class _Block(eqx.Module):
    norm1: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    mlp_in: eqx.nn.Linear
    mlp_out: eqx.nn.Linear

    def __init__(self, d_model: int, num_heads: int, mlp_ratio: int, *, key: PRNGKeyArray):
        attn_key, in_key, out_key = jax.random.split(key, 3)
        self.norm1 = eqx.nn.LayerNorm(d_model)
        self.attention = eqx.nn.MultiheadAttention(num_heads, d_model, key=attn_key)
        self.norm2 = eqx.nn.LayerNorm(d_model)
        self.mlp_in = eqx.nn.Linear(d_model, mlp_ratio * d_model, key=in_key)
        self.mlp_out = eqx.nn.Linear(mlp_ratio * d_model, d_model, key=out_key)

    def __call__(self, x: Float[Array, "seq d"], mask: Array) -> Float[Array, "seq d"]:
        h = jax.vmap(self.norm1.__call__)(x)
        x = x + self.attention(h, h, h, mask=mask)
        h = jax.vmap(self.norm2.__call__)(x)
        return x + jax.vmap(self.mlp_out.__call__)(jax.nn.gelu(jax.vmap(self.mlp_in.__call__)(h)))


class Transformer(eqx.Module):
    """A GPT-style decoder: token and position embeddings, pre-norm blocks, a linear head.

    :param vocab_size: number of token ids.
    :param seq_len: longest input, in tokens.
    :param d_model: width of the residual stream.
    :param num_heads: attention heads; must divide ``d_model``.
    :param num_layers: transformer blocks.
    :param mlp_ratio: hidden width of each MLP, as a multiple of ``d_model``.
    :param key: PRNG key for the initial weights.
    """

    token_embedding: eqx.nn.Embedding
    position_embedding: Float[Array, "seq d"]
    blocks: tuple[_Block, ...]
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(
        self,
        vocab_size: int = 256,
        seq_len: int = 64,
        d_model: int = 128,
        num_heads: int = 4,
        num_layers: int = 2,
        mlp_ratio: int = 4,
        *,
        key: PRNGKeyArray,
    ):
        check_transformer_settings(vocab_size=vocab_size, seq_len=seq_len, d_model=d_model, num_heads=num_heads,
                                   num_layers=num_layers, mlp_ratio=mlp_ratio)
        embed_key, pos_key, head_key, *block_keys = jax.random.split(key, 3 + num_layers)
        self.token_embedding = eqx.nn.Embedding(vocab_size, d_model, key=embed_key)
        self.position_embedding = 0.02 * jax.random.normal(pos_key, (seq_len, d_model))
        self.blocks = tuple(_Block(d_model, num_heads, mlp_ratio, key=k) for k in block_keys)
        self.norm = eqx.nn.LayerNorm(d_model)
        self.head = eqx.nn.Linear(d_model, vocab_size, key=head_key)

    def __call__(self, tokens: Int[Array, " seq"]) -> Float[Array, "seq vocab"]:
        """Logits for the token after each position of ``tokens``."""
        seq = tokens.shape[0]
        x = jax.vmap(self.token_embedding.__call__)(tokens) + self.position_embedding[:seq]
        causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
        for block in self.blocks:
            x = block(x, causal)
        return jax.vmap(self.head.__call__)(jax.vmap(self.norm.__call__)(x))


def next_token_loss(model: Transformer, batch: Int[Array, "batch seq_plus_1"], *, key: PRNGKeyArray) -> Array:
    """Mean cross-entropy of predicting each next token of ``batch``.

    ``key`` is unused by this deterministic model; the trainer passes a fresh
    key every step for models with dropout or other randomness.
    """
    del key
    logits = jax.vmap(model.__call__)(batch[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
