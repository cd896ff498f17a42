"""Llama-family decoders: RMSNorm, rotary positions, a SwiGLU MLP and grouped-query attention on the shared trunk.

Llama 2 / 3 (Touvron et al. 2023; Dubey et al. 2024): pre-norm blocks with RMSNorm, no position table (rotary
embeddings on the queries and keys, Hugging Face's rotate-half layout, optionally Llama 3's frequency scaling),
``down(silu(gate(x)) * up(x))``, ``num_kv_heads`` key/value heads shared by groups of query heads, no biases, the
output layer tied to the word embedding or its own vocab-parallel rows. Registered as ``model.name=llama``.

Tensor parallelism is Megatron's: query heads, and the gate / up columns, split over ``model`` (the same slice of
both on a shard), attention-out and down rows split. The key/value heads are split like the query heads where
``mesh.model`` divides them; where the shards outnumber them each shard uses a copy of the one head its query
heads read (``LlamaConfig.kv_replicated``): the stored weights stay whole on every shard (the ``kv_heads``
rule maps to no axis, so checkpoints keep one layout) and each shard slices its head at use. The gradient of that
slice is summed over exactly the shards sharing the head (XLA's partitioner all-reduces it in groups of
``mesh.model / num_kv_heads`` and all-gathers the heads back into the whole weight).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from megajax.models.spec import LayerKind, decoder_flops, decoder_spec, register, trunk_stack
from megajax.models.transformer import (
    Block,
    CausalDecoder,
    Documents,
    LayerCache,
    Positioned,
    TransformerConfig,
    attention_core,
    attention_core_residual_bytes,
    causal_mask,
    kv_replicated,
    make_blocks,
    run_blocks,
)
from megajax.parallel import context, pipeline
from megajax.parallel.context import KV_NAMES
from megajax.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    column_parallel,
    dropout,
    make_param,
    scaled_init_std,
)
from megajax.parallel.losses import mask_padded_vocab
from megajax.parallel.remat import assembled_at_use, selective
from megajax.parallel.sharding import RESIDUAL, constrain, mesh_size, param_at_use

NAME = "llama"  # config.model.name


ROPE_SCALINGS = ("none", "llama3")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig(TransformerConfig):
    """Llama's config: the trunk's fields with Llama 2 7B's defaults (no dropout), grouped-query
    heads, rotary positions and an untied output layer."""

    vocab_size: int = 32000
    make_vocab_size_divisible_by: int = 128
    num_layers: int = 32
    hidden_size: int = 4096
    num_heads: int = 32
    max_seq_len: int = 4096
    ffn_hidden_size: int = 11008
    dropout: float = 0.0
    num_kv_heads: int = 0  # grouped-query attention's key/value heads; 0: num_heads (multi-head attention)
    rope_theta: float = 10000.0  # rotary embeddings' base
    rope_scaling: str = "none"  # none | llama3 (Llama 3.1's frequency scaling, the four rope_* fields below)
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    tie_embeddings: bool = False  # True: the output layer is the word embedding; False: its own vocab-parallel rows
    rope_scalings: ClassVar[tuple[str, ...]] = ROPE_SCALINGS  # what model.rope_scaling may name (a family may add)

    def __post_init__(self):
        super().__post_init__()
        if self.num_kv_heads < 0:
            raise ValueError("model.num_kv_heads must be >= 0 (0: num_heads)")
        if self.num_heads % self.kv_heads:
            raise ValueError(f"model.num_kv_heads={self.num_kv_heads} does not divide model.num_heads="
                             f"{self.num_heads}: each key/value head serves a whole group of query heads")
        if self.head_dim % 2:
            raise ValueError(f"model.hidden_size / model.num_heads = {self.head_dim}: rotary embeddings turn pairs "
                             "of a head's dimensions, so the head size must be even")
        if self.rope_scaling not in self.rope_scalings:
            raise ValueError(f"model.rope_scaling={self.rope_scaling!r}; choose one of {self.rope_scalings}")
        for field in ("rope_theta", "rope_factor", "rope_original_max_len", "rope_low_freq_factor"):
            if not getattr(self, field) > 0:
                raise ValueError(f"model.{field}={getattr(self, field)!r} must be > 0")
        if not self.rope_high_freq_factor > self.rope_low_freq_factor:
            raise ValueError(f"model.rope_high_freq_factor={self.rope_high_freq_factor} must exceed "
                             f"model.rope_low_freq_factor={self.rope_low_freq_factor} (the band between them is "
                             "interpolated)")

    @property
    def kv_heads(self) -> int:
        """Key/value heads (grouped-query attention; ``num_heads`` for multi-head attention)."""
        return self.num_kv_heads or self.num_heads

    def kv_replicated(self, tp: int) -> bool:
        """Whether ``tp`` model shards replicate the key/value heads rather than split them
        (``transformer.kv_replicated``; ValueError where neither divides the other)."""
        return kv_replicated(self.kv_heads, tp)

    def rule_overrides(self, tp: int) -> dict[str, str | None]:
        """``kv_heads`` unsplit where the shards replicate the key/value heads: each shard then uses its copy of its
        group's head."""
        return {"kv_heads": None} if self.kv_replicated(tp) else {}


def rope_frequencies(cfg: LlamaConfig) -> jax.Array:
    """The (head_dim / 2,) fp32 inverse frequencies theta^(-2i/d), with Llama 3's scaling where configured: wavelengths
    longer than original_max_len / low_freq_factor slowed by ``rope_factor``, shorter than original_max_len /
    high_freq_factor kept, the band between interpolated smoothly."""
    d = cfg.head_dim
    inv = 1.0 / cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    if cfg.rope_scaling == "none":
        return inv
    old, low, high = cfg.rope_original_max_len, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    wavelength = 2 * math.pi / inv
    smooth = (old / wavelength - low) / (high - low)  # 0 at the low-frequency edge, 1 at the high one
    blended = (1 - smooth) * inv / cfg.rope_factor + smooth * inv
    scaled = jnp.where(wavelength > old / low, inv / cfg.rope_factor, inv)
    return jnp.where((wavelength >= old / high) & (wavelength <= old / low), blended, scaled)


def rotate(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotary embedding of ``x`` (B, S, heads, D) at ``positions`` (S,) or (B, S), rotate-half layout: the pairs are
    (x[i], x[i + D/2]), as Hugging Face's Llama (its checkpoints' q/k rows are ordered for it)."""
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # (S, D/2), or (B, S, D/2) for packed rows
    angles = angles if angles.ndim == 3 else angles[None]
    cos, sin = (jnp.concatenate([f(angles)] * 2, axis=-1)[:, :, None, :] for f in (jnp.cos, jnp.sin))
    x32 = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


def fused_columns(x: jax.Array, params: tuple[jax.Array, ...], prepare: Callable[..., tuple[jax.Array, ...]],
                  split: str, dtype: jnp.dtype, fp8: bool = False) -> list[jax.Array]:
    """``[x @ k for k in prepare(*params)]`` as one column-parallel GEMM: each kernel (H, ...) is split on its second
    dimension by the logical name ``split``, and the shards' blocks are put side by side on each device (nothing
    moves), so the input's gradient is summed over the model shards once, not once per projection (query and
    key/value, gate and up). The assembled kernel is recomputed from ``params`` in the backward pass, not kept per
    layer. Each result comes back (B, S, prod(kernel.shape[1:])), split like its kernel. ``fp8``: the GEMM in FP8
    (one scale for the fused kernel)."""
    t = mesh_size(split)
    names = ("embed", split, None)

    def product(x, *params):
        blocks = [k.reshape(k.shape[0], t, -1) for k in prepare(*params)]  # (H, t, width / t): shard i in row i
        fused = constrain(jnp.concatenate(blocks, axis=-1), names)
        y = column_parallel(x, fused, None, names, dtype, fp8)  # (B, S, t, sum of widths / t)
        return jnp.split(y, np.cumsum([blk.shape[-1] for blk in blocks])[:-1], axis=-1)

    outs = assembled_at_use(product)(x, *params)
    return [o.reshape(*o.shape[:2], -1) for o in outs]


class RMSNorm(nnx.Module):
    """``x / rms(x) * scale`` with a replicated scale; the statistic in fp32 whatever the compute dtype."""

    def __init__(self, features: int, *, eps: float, dtype: jnp.dtype, rngs: nnx.Rngs,
                 names: tuple[str] = ("embed",)):
        self.eps, self.dtype, self.names = eps, dtype, names
        self.scale = make_param(rngs, nnx.initializers.ones, (features,), names)

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        normed = (x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + self.eps)).astype(self.dtype)
        return normed * param_at_use(self.scale[...], self.names).astype(self.dtype)


def kv_copies(cfg: LlamaConfig) -> int:
    """The key/value heads one step computes, under the active rules: ``num_kv_heads`` where the model shards split
    them (or outside a mesh), else one copy per shard (each holds the head its query heads share)."""
    tp = mesh_size("heads")
    return tp if cfg.kv_replicated(tp) else cfg.kv_heads


class KeyValue(ColumnParallelLinear):
    """The key and value projections, (H, kv_heads, 2, head_dim) stored, used as ``kv_copies`` heads split like the
    query heads: where the heads are replicated each shard's copy is a slice of the whole weight, no communication
    (its gradient, the transpose, sums the copies: the grouped all-reduce)."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        super().__init__(cfg.hidden_size, (cfg.kv_heads, 2, cfg.head_dim), ("embed", "kv_heads", "qkv", "head_dim"),
                         std=cfg.init_std, dtype=cfg.compute_dtype, rngs=rngs, bias=False, fp8=cfg.fp8)
        self.stored_names, self.names = self.names, ("embed", "heads", "qkv", "head_dim")

    def kernel_at_use(self, value: jax.Array | None = None) -> jax.Array:
        """The kernel (of the stored ``value``, default this layer's) as ``kv_copies`` heads split like the query
        heads."""
        kernel = param_at_use(self.kernel[...] if value is None else value, self.stored_names, self.dtype)
        copies = kv_copies(self.cfg)
        if copies != self.cfg.kv_heads:
            # the pin's transpose lays the gradient out whole again here, in the layer's backward pass: the shards
            # sharing a head sum their copies' gradients, then the heads are gathered
            kernel = jnp.repeat(constrain(kernel, self.stored_names), copies // self.cfg.kv_heads, axis=1)
        return constrain(kernel, self.names)


class Attention(nnx.Module):
    """Grouped-query self-attention with rotary positions; query heads are the model-parallel dimension."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        dt, h = cfg.compute_dtype, cfg.hidden_size
        self.cfg, self.rate = cfg, cfg.dropout
        self.q = ColumnParallelLinear(h, (cfg.num_heads, cfg.head_dim), ("embed", "heads", "head_dim"),
                                      std=cfg.init_std, dtype=dt, rngs=rngs, bias=False, fp8=cfg.fp8)
        self.kv = KeyValue(cfg, rngs=rngs)
        self.out = RowParallelLinear((cfg.num_heads, cfg.head_dim), h, ("heads", "head_dim", "embed"),
                                     std=scaled_init_std(cfg.init_std, cfg.num_layers), dtype=dt, rngs=rngs,
                                     bias=False, fp8=cfg.fp8)

    def __call__(self, x: jax.Array, mask: jax.Array, key: jax.Array | None, cache: LayerCache | None,
                 index: jax.Array | int) -> tuple[jax.Array, LayerCache | None]:
        """(B, S, H) -> (B, S, H) at positions ``index ..`` (or, for packed rows, ``mask``'s: a ``Positioned``);
        ``cache``: this layer's keys and values (B, S_max, kv_copies, D), extended at ``index`` and read whole (the
        mask hides what is not there yet)."""
        names = ("batch", "seq", "heads", "head_dim")
        if isinstance(mask, Positioned):
            mask, positions = mask
        else:
            positions = index + jnp.arange(x.shape[1])
        b, s, _ = x.shape
        q, kv = fused_columns(x, (self.q.kernel[...], self.kv.kernel[...]),
                              lambda q, kv: (param_at_use(q, self.q.names, self.q.dtype), self.kv.kernel_at_use(kv)),
                              "heads", self.cfg.compute_dtype, self.cfg.fp8)
        kv = kv.reshape(b, s, -1, 2, self.cfg.head_dim)  # (B, S, kv_copies, 2, D)
        q, k = self.positioned(q.reshape(b, s, *self.q.kernel.shape[-2:]), kv[:, :, :, 0], positions)
        q, k, v = constrain(q, names), constrain(k, names), constrain(kv[:, :, :, 1], names)
        if cache is not None:
            k, v = (constrain(jax.lax.dynamic_update_slice_in_dim(c, new.astype(c.dtype), index, axis=1), KV_NAMES)
                    for c, new in zip(cache, (k, v)))
            cache = (k, v)
        # every key and value of the sequence (under context parallelism gathered over `context`)
        return self.out(context.attention(selective(attention_core, self.cfg.remat), q, k, v, mask, key,
                                          self.rate)), cache

    def positioned(self, q: jax.Array, k: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The queries and keys (B, S, heads, D) at ``positions`` (S,): rotated (a family that normalises each
        head first, as Qwen3, does so here)."""
        inv_freq = rope_frequencies(self.cfg)
        return rotate(q, positions, inv_freq), rotate(k, positions, inv_freq)


class SwiGLU(nnx.Module):
    """``down(silu(gate(x)) * up(x))``: gate and up column-parallel on the same ``mlp`` split (a shard holds both
    halves of its hidden units), down row-parallel; no biases."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        dt, h, f = cfg.compute_dtype, cfg.hidden_size, cfg.ffn_size
        self.dtype, self.fp8 = dt, cfg.fp8
        self.gate, self.up = (ColumnParallelLinear(h, (f,), ("embed", "mlp"), std=cfg.init_std, dtype=dt,
                                                   rngs=rngs, bias=False, fp8=cfg.fp8) for _ in range(2))
        self.down = RowParallelLinear((f,), h, ("mlp", "embed"), std=scaled_init_std(cfg.init_std, cfg.num_layers),
                                      dtype=dt, rngs=rngs, bias=False, fp8=cfg.fp8)

    def __call__(self, x: jax.Array) -> jax.Array:  # (B, S, H) -> (B, S, H)
        gate, up = fused_columns(x, (self.gate.kernel[...], self.up.kernel[...]),
                                 lambda *ks: tuple(param_at_use(k, self.up.names, self.dtype) for k in ks), "mlp",
                                 self.dtype, self.fp8)
        y = constrain(jax.nn.silu(gate) * up, ("batch", "seq", "mlp"))  # (B, S, F)
        return self.down(y)


class LlamaBlock(Block):
    """``x + attn(norm(x))`` then ``x + mlp(norm(x))``: the trunk's pre-norm block with RMSNorm, rotary
    grouped-query attention and SwiGLU."""

    norm_class, attention_class, mlp_class = RMSNorm, Attention, SwiGLU


class Llama(CausalDecoder):
    """Llama decoder: ``tokens (B, S) -> logits (B, S, padded_vocab)`` with padded ids masked."""

    block_class: type[nnx.Module] = LlamaBlock

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        dt = cfg.compute_dtype
        self.wte = VocabParallelEmbedding(cfg.padded_vocab_size, cfg.hidden_size, std=cfg.init_std, dtype=dt,
                                          rngs=rngs)
        self._make_layers(cfg, rngs)
        self.ln_f = RMSNorm(cfg.hidden_size, eps=cfg.layernorm_eps, dtype=dt, rngs=rngs)
        self.lm_head = None if cfg.tie_embeddings else VocabParallelEmbedding(
            cfg.padded_vocab_size, cfg.hidden_size, std=cfg.init_std, dtype=dt, rngs=rngs)

    def cache_heads(self) -> int:
        """The key/value heads only (one per shard where the shards replicate them), not the query heads."""
        return kv_copies(self.cfg)

    def _forward(self, tokens, dropout_key, cache, index, documents=None, stack=pipeline.run_stack):
        return self._logits(tokens, dropout_key, cache, index, documents, stack)

    def _make_layers(self, cfg: LlamaConfig, rngs: nnx.Rngs) -> None:
        """The layer stack: ``cfg.num_layers`` of ``block_class`` (``make_blocks``)."""
        self.blocks = make_blocks(cfg, rngs, self.block_class)

    def _run_layers(self, x: jax.Array, mask: jax.Array, dropout_key: jax.Array | None, cache, index,
                    stack: pipeline.StackRunner = pipeline.run_stack):
        """The layer stack over ``x``: its output and what the blocks return beside it (``run_blocks``)."""
        return run_blocks(self.blocks, self.cfg, x, mask, dropout_key, cache, index, stack=stack)

    def _logits(self, tokens: jax.Array, dropout_key: jax.Array | None, cache, index: jax.Array | int,
                documents: Documents | None = None, stack: pipeline.StackRunner = pipeline.run_stack):
        """(logits, what the blocks return beside their output, stacked over the layers: the key/value cache for
        Llama's blocks, which ``_forward`` returns)."""
        x, _, rows, layers_out = self._trunk(tokens, dropout_key, cache, index, documents, stack)
        return self._head(self.ln_f(x), self._head_rows(tokens.shape[0], rows)), layers_out

    def _trunk(self, tokens: jax.Array, dropout_key: jax.Array | None, cache, index: jax.Array | int,
               documents: Documents | None = None, stack: pipeline.StackRunner = pipeline.run_stack):
        """(the last layer's output (B, S, H), the attention mask, the embedding's ``replica_rows``, what the blocks
        return beside their output): the model before its final norm and head."""
        cfg = self.cfg
        b, s = tokens.shape
        tokens = self._tokens(tokens)
        k_emb, k_layers = jax.random.split(dropout_key) if dropout_key is not None else (None, None)
        rows = self.wte.replica_rows(b)
        x = constrain(dropout(self.wte(tokens, rows), cfg.dropout, k_emb), RESIDUAL)
        kv_len = s if cache is None else cache[0].shape[2]
        mask = causal_mask(index + jnp.arange(s), kv_len)  # (1, 1, S, S_kv)
        if documents is not None:  # packed rows: within each document, at its positions
            mask = Positioned(documents.mask(), documents.positions)
        x, layers_out = self._run_layers(x, mask, k_layers, cache, index, stack)
        return x, mask, rows, layers_out

    def _head_rows(self, batch: int, rows: jax.Array) -> jax.Array:
        """The output layer's ``replica_rows`` for ``batch`` rows (the embedding's ``rows`` where tied): read once per
        step, however many times the head is applied."""
        return rows if self.lm_head is None else self.lm_head.replica_rows(batch)

    def _head(self, h: jax.Array, head_rows: jax.Array) -> jax.Array:
        """(B, S, H) final-normed hidden states -> (B, S, padded_vocab) logits, the padded ids masked."""
        head = self.wte if self.lm_head is None else self.lm_head
        return mask_padded_vocab(head.attend(h, head_rows), self.cfg.vocab_size)


def flops(cfg: LlamaConfig, rows: int, seq: int) -> float:
    """Model FLOPs of a step: the query and output projections h x h, key/value h x 2 kv_heads d, SwiGLU's three
    h x ffn GEMMs, the attention scores and context, the output layer over the padded vocabulary."""
    return decoder_flops(rows, seq, cfg.num_layers, cfg.hidden_size, 2 * cfg.kv_heads * cfg.head_dim,
                         3 * cfg.ffn_size, cfg.padded_vocab_size)


def layer_residual_bytes(cfg: LlamaConfig, rows: int, tp: int, split: int, remat: str, cd: int,
                         attention: str = "xla") -> int:
    """Bytes one Llama layer keeps for its backward pass on one device (``rows`` sequences, ``tp`` model shards,
    the residual stream split ``split`` ways, ``cd`` bytes per compute-dtype value, ``attention`` the attention
    core's implementation); the same as the traced jaxpr (tests/test_llama.py). ``none`` keeps: per RMSNorm its
    fp32 input and normalised values, the compute-dtype normalised and scaled values and its fp32 statistic;
    dropout's 1-byte masks of both residual branches; q and the attention context, k and v (one head per shard
    where they are replicated); the SwiGLU's 6 (b, s, ffn) tensors; the attention core's residuals
    (``transformer.attention_core_residual_bytes``); the norms' scales broadcast in the compute dtype; in 16-bit
    the compute-dtype copies of attention-out and down (the fused query / key-value and gate / up kernels are
    reassembled in the backward pass, not kept). ``selective`` drops the attention core's, ``full`` keeps the
    layer's input, ``save_dots`` the input, one projection and the two fused GEMMs' outputs."""
    s, b, h, d, f = cfg.max_seq_len, rows, cfg.hidden_size, cfg.head_dim, cfg.ffn_size
    sbh, dropout = s * b * h, cfg.dropout > 0
    kv_local = 1 if cfg.kv_replicated(tp) else cfg.kv_heads // tp  # key/value heads on one shard
    if remat == "full":
        return sbh * cd // split
    if remat == "save_dots":
        return 2 * sbh * cd + (s * b * (h + 2 * f) // tp + 2 * s * b * kv_local * d) * cd
    kept = (4 * sbh * (cd + 4) + 4 * s * b * 4 + (2 * sbh if dropout else 0)) // split  # norms, masks
    kept += 2 * h * cd  # the scales broadcast to (1, 1, h)
    kept += (2 * sbh + 6 * s * b * f) * cd // tp + 2 * s * b * kv_local * d * cd  # q, context; SwiGLU; k, v
    if split > 1:  # sequence parallelism: the two fused column-parallel GEMMs keep their all-gathered inputs
        kept += 2 * sbh * cd
    if remat != "selective":
        kept += attention_core_residual_bytes(cfg, b, tp, attention)
    if cd < 4:
        kept += (h * h + f * h) * cd // tp  # compute-dtype copies of attention-out and down
    return kept


LAYER = LayerKind("llama", residuals=layer_residual_bytes)  # LlamaBlock: two all-reduces each way, one redone

# init_from: a converted (or another run's) Llama continues training
register(decoder_spec(NAME, LlamaConfig, Llama, flops, stacks=lambda cfg: trunk_stack(cfg, LAYER)))
