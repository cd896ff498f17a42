"""GPT-2 with Megatron-style tensor parallelism expressed as logical axis names.

Pre-LN blocks (LN -> causal attention -> residual; LN -> MLP -> residual), a final LN and an output layer tied to
the word embedding. The blocks are stacked on a leading ``layers`` axis and run with ``nnx.scan``, so compile time
does not grow with depth.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from megajax.layers import (ColumnParallelLinear, LayerNorm, RowParallelLinear, VocabParallelEmbedding, dropout,
                            gelu, scaled_init_std)
from megajax.losses import mask_padded_vocab
from megajax.sharding import constrain

REMAT_POLICIES = ("none", "full", "save_dots")
LayerCache = tuple[jax.Array, jax.Array]  # one layer's (keys, values), (B, S_max, N, D) each
KVCache = tuple[jax.Array, jax.Array]  # all layers' (keys, values), (L, B, S_max, N, D) each


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Shape and numerics of a GPT model; nothing about the mesh."""

    vocab_size: int  # true vocabulary (e.g. 50257)
    padded_vocab_size: int  # embedding rows (e.g. 51200); ids >= vocab_size are masked out of the softmax
    num_layers: int
    hidden_size: int
    num_heads: int
    max_seq_len: int
    mlp_ratio: int = 4
    dropout: float = 0.1
    init_std: float = 0.02
    layernorm_eps: float = 1e-5
    dtype: str = "float32"  # compute dtype; parameters stay fp32
    remat: str = "none"  # none | full | save_dots

    def __post_init__(self):
        if self.hidden_size % self.num_heads:
            raise ValueError(f"model.hidden_size={self.hidden_size} is not divisible by "
                             f"model.num_heads={self.num_heads}")
        if self.padded_vocab_size < self.vocab_size:
            raise ValueError("padded_vocab_size must be >= vocab_size")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"model.remat={self.remat!r}; choose one of {REMAT_POLICIES}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)


class CausalSelfAttention(nnx.Module):
    """Multi-head causal self-attention; heads are the model-parallel dimension."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        dt, h = cfg.compute_dtype, cfg.hidden_size
        self.rate = cfg.dropout
        # (H, heads, 3, head_dim): a shard of `heads` holds whole heads with their own q, k and v.
        self.qkv = ColumnParallelLinear(h, (cfg.num_heads, 3, cfg.head_dim), ("embed", "heads", "qkv", "head_dim"),
                                        std=cfg.init_std, dtype=dt, rngs=rngs)
        self.out = RowParallelLinear((cfg.num_heads, cfg.head_dim), h, ("heads", "head_dim", "embed"),
                                     std=scaled_init_std(cfg.init_std, cfg.num_layers), dtype=dt, rngs=rngs)

    def __call__(self, x: jax.Array, key: jax.Array | None, cache: LayerCache | None = None,
                 index: jax.Array | int = 0) -> tuple[jax.Array, LayerCache | None]:
        """(B, S, H) -> (B, S, H). With ``cache`` (this layer's keys/values, (B, S_max, N, D) each) the new keys and
        values are written at positions ``index ..`` and the queries attend to every cached position before them."""
        qkv = self.qkv(x)  # (B, S, N, 3, D)
        q, k, v = (constrain(qkv[:, :, :, i], ("batch", "seq", "heads", "head_dim")) for i in range(3))
        s = q.shape[1]
        q_pos = index + jnp.arange(s)
        if cache is not None:
            k, v = (constrain(jax.lax.dynamic_update_slice_in_dim(c, new.astype(c.dtype), index, axis=1),
                              ("batch", "seq", "heads", "head_dim")) for c, new in zip(cache, (k, v)))
            cache = (k, v)
        k_pos = jnp.arange(k.shape[1])
        scores = jnp.einsum("bqnd,bknd->bnqk", q, k).astype(jnp.float32) / jnp.sqrt(q.shape[-1]).astype(jnp.float32)
        causal = k_pos[None, :] <= q_pos[:, None]  # (S, S_kv)
        scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)  # (B, N, S, S_kv)
        probs = dropout(probs, self.rate, key)
        ctx = jnp.einsum("bnqk,bknd->bqnd", probs, v.astype(x.dtype))  # (B, S, N, D)
        return self.out(ctx), cache


class MLP(nnx.Module):
    """H -> 4H (column-parallel) -> GeLU -> H (row-parallel)."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        dt, h, f = cfg.compute_dtype, cfg.hidden_size, cfg.mlp_ratio * cfg.hidden_size
        self.up = ColumnParallelLinear(h, (f,), ("embed", "mlp"), std=cfg.init_std, dtype=dt, rngs=rngs)
        self.down = RowParallelLinear((f,), h, ("mlp", "embed"),
                                      std=scaled_init_std(cfg.init_std, cfg.num_layers), dtype=dt, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:  # (B, S, H) -> (B, S, H)
        y = constrain(gelu(self.up(x)), ("batch", "seq", "mlp"))  # (B, S, 4H)
        return self.down(y)


class Block(nnx.Module):
    """Pre-LN transformer layer."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        dt = cfg.compute_dtype
        self.rate = cfg.dropout
        self.ln_1 = LayerNorm(cfg.hidden_size, eps=cfg.layernorm_eps, dtype=dt, rngs=rngs)
        self.attn = CausalSelfAttention(cfg, rngs=rngs)
        self.ln_2 = LayerNorm(cfg.hidden_size, eps=cfg.layernorm_eps, dtype=dt, rngs=rngs)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x: jax.Array, key: jax.Array | None, cache: LayerCache | None = None,
                 index: jax.Array | int = 0) -> tuple[jax.Array, LayerCache | None]:  # (B, S, H) -> (B, S, H)
        k_attn, k_res1, k_res2 = jax.random.split(key, 3) if key is not None else (None, None, None)
        attn, cache = self.attn(self.ln_1(x), k_attn, cache, index)
        x = constrain(x + dropout(attn, self.rate, k_res1), ("batch", "seq", "embed"))
        x = x + dropout(self.mlp(self.ln_2(x)), self.rate, k_res2)
        return constrain(x, ("batch", "seq", "embed")), cache


def _remat_policy(name: str):
    return {"full": None, "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}[name]


class GPT(nnx.Module):
    """GPT-2 language model: ``tokens (B, S) -> logits (B, S, padded_vocab)`` with padded ids masked."""

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        dt = cfg.compute_dtype
        self.wte = VocabParallelEmbedding(cfg.padded_vocab_size, cfg.hidden_size, std=cfg.init_std, dtype=dt,
                                          rngs=rngs)
        self.wpe = nnx.Param(nnx.initializers.normal(cfg.init_std)(rngs.params(), (cfg.max_seq_len, cfg.hidden_size)),
                             out_sharding=("position", "embed"), eager_sharding=False)

        @nnx.split_rngs(splits=cfg.num_layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_blocks(rngs: nnx.Rngs) -> Block:
            return Block(cfg, rngs=rngs)

        self.blocks = make_blocks(rngs)
        self.ln_f = LayerNorm(cfg.hidden_size, eps=cfg.layernorm_eps, dtype=dt, rngs=rngs)

    def __call__(self, tokens: jax.Array, *, dropout_key: jax.Array | None = None) -> jax.Array:
        """Training / scoring forward: (B, S) int ids -> (B, S, padded_vocab) logits."""
        return self._forward(tokens, dropout_key, None, 0)[0]

    def init_cache(self, batch: int, max_len: int | None = None) -> KVCache:
        """Zeroed keys and values for ``decode``: two (L, B, max_len, heads, head_dim) arrays."""
        cfg = self.cfg
        shape = (cfg.num_layers, batch, max_len or cfg.max_seq_len, cfg.num_heads, cfg.head_dim)
        zeros = jnp.zeros(shape, cfg.compute_dtype)
        return (constrain(zeros, ("layers", "batch", "seq", "heads", "head_dim")),) * 2

    def decode(self, tokens: jax.Array, cache: KVCache, index: jax.Array | int) -> tuple[jax.Array, KVCache]:
        """Incremental forward of ``tokens`` (B, S) at positions ``index ..``, reading and extending ``cache``."""
        return self._forward(tokens, None, cache, index)

    def _forward(self, tokens, dropout_key, cache, index):
        cfg = self.cfg
        b, s = tokens.shape
        if s > cfg.max_seq_len:
            raise ValueError(f"sequence length {s} exceeds model.max_seq_len={cfg.max_seq_len}")
        tokens = constrain(tokens, ("batch", "seq"))
        k_emb, k_layers = jax.random.split(dropout_key) if dropout_key is not None else (None, None)
        positions = jax.lax.dynamic_slice_in_dim(self.wpe[...], index, s, axis=0)
        x = self.wte(tokens) + positions.astype(cfg.compute_dtype)  # (B, S, H)
        x = constrain(dropout(x, cfg.dropout, k_emb), ("batch", "seq", "embed"))

        layer_keys = jax.random.split(k_layers, cfg.num_layers) if k_layers is not None else None
        x, cache = self._run_blocks(x, layer_keys, cache, index)

        logits = self.wte.attend(self.ln_f(x))  # (B, S, V_padded)
        return mask_padded_vocab(logits, cfg.vocab_size), cache

    def _run_blocks(self, x, layer_keys, cache, index):
        def step(block: Block, h: jax.Array, key: jax.Array | None, layer_cache: LayerCache | None):
            return block(h, key, layer_cache, index)

        if self.cfg.remat != "none":
            step = nnx.remat(step, policy=_remat_policy(self.cfg.remat))

        scan = nnx.scan(step, in_axes=(0, nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0))
        return scan(self.blocks, x, layer_keys, cache)
