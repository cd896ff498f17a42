"""The transformer trunk shared by every model: attention, MLP, the block in either LayerNorm order, the layer stack.

Attention takes its mask as an input, so one class serves causal GPT and bidirectional BERT with padding. A block
is either the paper's rearranged pre-LN order (Figure 7b: LN -> sublayer -> residual add, a final LN after the
stack) or the original BERT's post-LN order (Figure 7a: sublayer -> residual add -> LN). The blocks are stacked on
a leading ``layers`` axis (``nnx.vmap``) and run with ``nnx.scan``, so compile time does not grow with depth.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from megajax.parallel import context, pipeline
from megajax.parallel.context import KV_NAMES
from megajax.parallel.layers import (
    ACTIVATIONS,
    ColumnParallelLinear,
    LayerNorm,
    RowParallelLinear,
    dropout,
    scaled_init_std,
)
from megajax.parallel.remat import REMAT_POLICIES, layer_step, selective
from megajax.parallel.sharding import (
    RESIDUAL,
    WHOLE_LAYERS,
    constrain,
    on_shards,
    partly_manual,
    rows_of,
    sequence_positions,
)
from megajax.parallel.xla_options import traced_for_nvidia_gpu

LayerCache = tuple[jax.Array, jax.Array]  # one layer's (keys, values), (B, S_max, N_kv, D) each
KVCache = tuple[jax.Array, jax.Array]  # all layers' (keys, values), (L, B, S_max, N_kv, D) each


@dataclasses.dataclass(frozen=True, kw_only=True)
class TransformerConfig:
    """What every family's config holds: the trunk's shape and numerics, with GPT-2 small's defaults. A family
    subclasses it in its model file and registers the subclass in its spec
    (``ModelSpec.config``); a ``config.model`` field its class lacks is unknown (``config.resolve.model_config``).
    Nothing about the mesh but which rules a model leaves unsplit on a number of model shards (``rule_overrides``)."""

    vocab_size: int = 50257  # true vocabulary; ids >= vocab_size are masked out of the softmax
    make_vocab_size_divisible_by: int = 1024  # 128 x 8 (paper Section 5.1): 50257 -> 51200 embedding rows
    num_layers: int = 12
    hidden_size: int = 768
    num_heads: int = 12
    max_seq_len: int = 1024
    mlp_ratio: int = 4
    ffn_hidden_size: int = 0  # the MLP's width; 0: mlp_ratio * hidden_size
    dropout: float = 0.1
    init_std: float = 0.02
    layernorm_eps: float = 1e-5
    remat: str = "full"  # full (after every layer, paper Section 4.2) | none | save_dots | selective (the attention
    # core only, Korthikanti et al. 2022)
    dtype: str = "float32"  # compute dtype, from train.precision (not a config.model field); parameters stay fp32
    fp8: bool = False  # the blocks' GEMMs in FP8 (train.precision=fp8; not a config.model field)

    def __post_init__(self):
        for field in ("vocab_size", "num_layers", "hidden_size", "num_heads", "max_seq_len", "mlp_ratio",
                      "make_vocab_size_divisible_by"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"model.{field}={value!r} makes no model: it must be a whole number >= 1")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout={self.dropout} must be in [0, 1)")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"model.hidden_size={self.hidden_size} is not divisible by "
                             f"model.num_heads={self.num_heads}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"model.remat={self.remat!r}; choose one of {REMAT_POLICIES}")
        if self.ffn_hidden_size < 0:
            raise ValueError("model.ffn_hidden_size must be >= 0 (0: mlp_ratio * hidden_size)")

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        """The ``config.model`` fields of the family (every dataclass field but the compute precision's)."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.name not in ("dtype", "fp8"))

    @property
    def padded_vocab_size(self) -> int:
        """Embedding rows: the vocabulary rounded up to ``make_vocab_size_divisible_by`` (the config fixes it, not
        the mesh)."""
        return padded_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by)

    @property
    def post_layernorm(self) -> bool:
        """The trunk's LayerNorm order: False, pre-LN with a final LN (paper Fig. 7b); BERT's config makes it a
        field (True: the original BERT, Fig. 7a)."""
        return False

    @property
    def kv_heads(self) -> int:
        """Key/value heads: every query head's own (multi-head attention); Llama's config has grouped-query heads."""
        return self.num_heads

    @property
    def ffn_size(self) -> int:
        """The MLP's hidden width."""
        return self.ffn_hidden_size or self.mlp_ratio * self.hidden_size

    def kv_replicated(self, tp: int) -> bool:
        """Whether ``tp`` model shards replicate the key/value heads rather than split them: never with a head of
        each kind per query head (the shards hold whole heads); Llama's grouped heads can be fewer than shards."""
        return False

    def check_mesh(self, tensor: int, pipe: int, expert: int) -> None:
        """ValueError where the model cannot run on ``tensor`` model shards, ``pipe`` stages and ``expert`` expert
        shards (beyond the trunk's divisibility, and the routed layers ``expert`` > 1 needs, which
        ``config.checks.checked`` checks)."""
        self.kv_replicated(tensor)

    def rule_overrides(self, tp: int) -> dict[str, str | None]:
        """Logical names the rules must leave unsplit on ``tp`` model shards (none here; Llama's replicated
        key/value heads)."""
        return {}

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def value_head_dim(self) -> int:
        """A value's head size (the queries' and keys' but in latent attention)."""
        return self.head_dim

    @property
    def compute_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)


def check_activation(activation: str) -> None:
    """ValueError unless ``activation`` names one of ``ACTIVATIONS`` (a config with the trunk's ``MLP`` has one)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"model.activation={activation!r}; choose one of {sorted(ACTIVATIONS)}")


def padded_vocab_size(vocab_size: int, divisible_by: int) -> int:
    """Rounds the vocabulary up to a multiple of ``divisible_by``."""
    if divisible_by < 1:
        raise ValueError(f"model.make_vocab_size_divisible_by must be >= 1, got {divisible_by}")
    return -(-vocab_size // divisible_by) * divisible_by


def kv_replicated(kv_heads: int, tp: int) -> bool:
    """Whether ``tp`` model shards replicate ``kv_heads`` key/value heads (more shards than heads, Megatron's rule
    for grouped-query attention: each head copied on the shards that share it) rather than split them; ValueError
    where neither divides the other. The one rule the model, the memory planner and the scaling model follow."""
    if kv_heads % tp == 0:
        return False
    if tp % kv_heads == 0:
        return True
    raise ValueError(f"mesh.model={tp} neither divides model.num_kv_heads={kv_heads} (each shard holds whole "
                     f"key/value heads) nor is a multiple of it (each head replicated on the shards that share it): "
                     f"pick mesh.model from the divisors or multiples of {kv_heads}")


def causal_mask(q_positions: jax.Array, kv_len: int) -> jax.Array:
    """(1, 1, S_q, S_kv) bool: query at position p sees keys 0..p."""
    return (jnp.arange(kv_len)[None, :] <= q_positions[:, None])[None, None]


class Documents(NamedTuple):
    """Each input token's position (B, S) and, for a packed batch (``megajax.data.documents``), its document in its
    row (B, S; None: one document per row). Positions restart at each document where the data says so; under
    context parallelism the row is in ``parallel.context``'s balanced order and the positions are the true ones."""

    segments: jax.Array | None
    positions: jax.Array

    def mask(self) -> jax.Array:
        """(B, 1, S, S) bool: a query sees the keys of its own document at its position or before (the queries'
        sequence split as the activations', the keys' whole: under context parallelism each device's queries
        against every key)."""
        whole = ("batch", None)
        pos = self.positions
        visible = constrain(pos, whole)[:, None, :] <= constrain(pos, ("batch", "seq"))[:, :, None]
        if self.segments is not None:
            seg = self.segments
            visible &= constrain(seg, ("batch", "seq"))[:, :, None] == constrain(seg, whole)[:, None, :]
        return constrain(visible, ("batch", "seq", None))[:, None]


class Positioned(NamedTuple):
    """An attention mask with the queries' positions per row, for attention that positions its queries and keys
    itself (rotary): what a decoder's blocks take as their mask over packed rows. Its leaves lead with the batch,
    so a pipeline hands each microbatch its rows (``pipeline.run_stack``)."""

    mask: jax.Array  # (B, 1, S, S)
    positions: jax.Array  # (B, S)


def padding_mask(valid: jax.Array) -> jax.Array:
    """(B, 1, 1, S) bool from a (B, S) 1/0 mask of real tokens: every query sees every real key."""
    return valid.astype(bool)[:, None, None, :]


class SelfAttention(nnx.Module):
    """Multi-head self-attention under a given mask; heads are the model-parallel dimension."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        dt, h = cfg.compute_dtype, cfg.hidden_size
        self.rate, self.remat = cfg.dropout, cfg.remat
        # (H, heads, 3, head_dim): a shard of `heads` holds whole heads with their own q, k and v.
        self.qkv = ColumnParallelLinear(h, (cfg.num_heads, 3, cfg.head_dim), ("embed", "heads", "qkv", "head_dim"),
                                        std=cfg.init_std, dtype=dt, rngs=rngs, fp8=cfg.fp8)
        self.out = RowParallelLinear((cfg.num_heads, cfg.head_dim), h, ("heads", "head_dim", "embed"),
                                     std=scaled_init_std(cfg.init_std, cfg.num_layers), dtype=dt, rngs=rngs,
                                     fp8=cfg.fp8)

    def __call__(self, x: jax.Array, mask: jax.Array, key: jax.Array | None, cache: LayerCache | None = None,
                 index: jax.Array | int = 0) -> tuple[jax.Array, LayerCache | None]:
        """(B, S, H) -> (B, S, H); ``mask`` broadcasts to (B, heads, S, S_kv), True where a query may look.

        With ``cache`` (this layer's keys/values, (B, S_max, N, D) each) the new keys and values are written at
        positions ``index ..`` and the queries attend over the whole cache (the mask hides what is not yet there).
        """
        qkv = self.qkv(x)  # (B, S, N, 3, D)
        names = ("batch", "seq", "heads", "head_dim")
        q, k, v = (constrain(qkv[:, :, :, i], names) for i in range(3))
        if cache is not None:
            k, v = (constrain(jax.lax.dynamic_update_slice_in_dim(c, new.astype(c.dtype), index, axis=1), KV_NAMES)
                    for c, new in zip(cache, (k, v)))
            cache = (k, v)
        # every key and value of the sequence (under context parallelism gathered over `context`)
        return self.out(context.attention(selective(attention_core, self.remat), q, k, v, mask, key,
                                          self.rate)), cache


def attention_implementation(dtype: jnp.dtype, head_dim: int, dropout: bool, lengths: tuple[int, int],
                             value_dim: int | None = None) -> str:
    """'cudnn' (jax.nn.dot_product_attention's cuDNN flash attention) on an NVIDIA GPU for fp16 / bf16 heads of at
    most 128 dimensions, a multiple of 8, even query and key lengths (its masked backward needs them), when no
    attention dropout is drawn (it has none); else 'xla': megajax's own softmax(q k^T / sqrt(d)) v, the ops jax's
    XLA implementation emits too, with Megatron's dropout. The mask reaches cuDNN as a dense bias (the mask is an
    input, so its causal shortcut is not used); unmeasured, as no GPU has been available. The device is the mesh's
    being traced for (a compile-only H100's too, ``megajax.tools.gpu_target``), else this host's first.
    ``value_dim``: the values' head size where it is not the queries' and keys' (latent attention's)."""
    if _cudnn_refusal(dtype, head_dim, dropout, lengths, value_dim):
        return "xla"
    return "cudnn" if traced_for_nvidia_gpu() else "xla"


def _cudnn_refusal(dtype: jnp.dtype, head_dim: int, dropout: bool, lengths: tuple[int, int],
                   value_dim: int | None = None) -> str | None:
    """Why cuDNN's flash attention cannot run these heads (None: it can)."""
    if value_dim not in (None, head_dim):
        return (f"values of {value_dim} beside queries and keys of {head_dim}: jax.nn.dot_product_attention takes one "
                "head size")
    if dropout:
        return "attention dropout: cuDNN's flash attention (jax.nn.dot_product_attention) draws none"
    if jnp.dtype(dtype) not in (jnp.bfloat16, jnp.float16):
        return f"{jnp.dtype(dtype).name} compute: cuDNN's flash attention runs bf16 / fp16"
    if head_dim > 128 or head_dim % 8:
        return f"head_dim={head_dim}: cuDNN's flash attention takes multiples of 8 up to 128"
    if any(n % 2 for n in lengths):
        return f"odd sequence length {lengths}: cuDNN's masked backward pass needs even ones"
    return None


def attention_reason(cfg: TransformerConfig) -> str:
    """Why a model's training step uses megajax's XLA attention rather than cuDNN's ('' where it can use cuDNN)."""
    return _cudnn_refusal(cfg.compute_dtype, cfg.head_dim, cfg.dropout > 0,
                          (cfg.max_seq_len, cfg.max_seq_len), cfg.value_head_dim) or ""


def attention_core_residual_bytes(cfg: TransformerConfig, rows: int, tp: int, implementation: str) -> int:
    """Bytes one layer's attention core keeps for its backward pass on one device (``rows`` sequences, ``tp`` model
    shards holding a/tp query heads each), without recomputation. ``xla``: the softmax probabilities in fp32 and in
    the compute dtype (a*s*s*b each), their 1-byte dropout mask, and the softmax's two fp32 statistics (a*s*b each).
    ``cudnn``: flash attention recomputes the probabilities from q, k and v and keeps only its fp32 log-sum-exp
    (a*s*b). q, k, v and the context are the block's, counted by its inventory."""
    a, s = cfg.num_heads, cfg.max_seq_len
    if implementation == "cudnn":
        return a * s * rows * 4 // tp
    cd = jnp.dtype(cfg.compute_dtype).itemsize
    dropout = 1 if cfg.dropout > 0 else 0
    return a * s * s * rows * (4 + cd + dropout) // tp + 2 * a * s * rows * 4 // tp


def attention_core(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array, key: jax.Array | None,
                   rate: float) -> jax.Array:
    """softmax(q k^T / sqrt(d)) v under ``mask``, with dropout on the probabilities: (B, S, N, D) -> (B, S, N, D).
    Keys and values may have fewer heads, N_kv dividing N (grouped-query attention): query head n reads key/value
    head n // (N / N_kv). Its (B, N, S, S_kv) intermediates are what ``remat=selective`` recomputes instead of
    keeping (cuDNN's flash attention, where ``attention_implementation`` picks it, never makes them)."""
    dropout_on = key is not None and rate > 0.0  # (a key, or context.AttentionDropout's)
    if attention_implementation(q.dtype, q.shape[-1], dropout_on, (q.shape[1], k.shape[1]), v.shape[-1]) == "cudnn":
        # a per-row mask (packed rows) over every head: under a pipeline's vmap jax 0.10's cuDNN batching rule
        # reshapes the bias as if it held every head, and fails on a broadcast one
        heads = q.shape[2] if mask.shape[0] > 1 else mask.shape[1]
        mask = jnp.broadcast_to(mask, (mask.shape[0], heads, q.shape[1], k.shape[1]))

        def cudnn(q, k, v, mask):
            return jax.nn.dot_product_attention(q, k, v.astype(q.dtype), mask=mask, implementation="cudnn")

        if partly_manual():  # inside the 1F1B stages' shard_map cuDNN attention's partitioning rule fails (jax
            # 0.10), so it runs on each device's blocks
            names = ("batch", "seq", "heads", "head_dim")
            mask_names = ("batch", "heads", None, None) if mask.shape[0] > 1 else (None, None, None, None)
            return on_shards(cudnn, (q, k, v, mask), (names, KV_NAMES, KV_NAMES, mask_names), names, check_vma=False)
        return cudnn(q, k, v, mask)
    scale = jnp.sqrt(q.shape[-1]).astype(jnp.float32)
    b, s, n, d = q.shape
    groups = n // k.shape[2]
    if groups == 1:
        scores = jnp.einsum("bqnd,bknd->bnqk", q, k)
    else:  # (B, S, N_kv, N/N_kv, D): each key/value head meets its group of query heads, nothing is repeated
        scores = jnp.einsum("bqcgd,bkcd->bcgqk", q.reshape(b, s, -1, groups, d), k).reshape(b, n, s, -1)
    scores = scores.astype(jnp.float32) / scale  # (B, N, S, S_kv)
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)
    # keyed by row, head and query position, the keys in position order (context.AttentionDropout: a device's part)
    if isinstance(key, context.AttentionDropout):
        with rows_of(key.rows):
            probs = dropout(probs, rate, key.key, (key.heads, key.queries), key.keys)
    else:
        probs = dropout(probs, rate, key, (jnp.arange(n), sequence_positions(s)))
    if groups == 1:
        return jnp.einsum("bnqk,bknd->bqnd", probs, v.astype(q.dtype))  # (B, S, N, D)
    out = jnp.einsum("bcgqk,bkcd->bqcgd", probs.reshape(b, -1, groups, s, probs.shape[-1]), v.astype(q.dtype))
    return out.reshape(b, s, n, d)


class MLP(nnx.Module):
    """H -> 4H (column-parallel) -> GeLU -> H (row-parallel); its config has an ``activation`` field (GPT's,
    BERT's)."""

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        dt, h, f = cfg.compute_dtype, cfg.hidden_size, cfg.ffn_size
        self.act = ACTIVATIONS[cfg.activation]
        self.up = ColumnParallelLinear(h, (f,), ("embed", "mlp"), std=cfg.init_std, dtype=dt, rngs=rngs, fp8=cfg.fp8)
        self.down = RowParallelLinear((f,), h, ("mlp", "embed"), std=scaled_init_std(cfg.init_std, cfg.num_layers),
                                      dtype=dt, rngs=rngs, fp8=cfg.fp8)

    def __call__(self, x: jax.Array) -> jax.Array:  # (B, S, H) -> (B, S, H)
        y = constrain(self.act(self.up(x)), ("batch", "seq", "mlp"))  # (B, S, 4H)
        return self.down(y)


class Block(nnx.Module):
    """One transformer layer: attention then MLP, each with dropout and a residual add, in either LN order. A
    family with other sublayers subclasses it and names their classes (``norm_class``, ``attention_class``,
    ``mlp_class``, built as ``LayerNorm``, ``SelfAttention`` and ``MLP`` are)."""

    norm_class: type[nnx.Module] = LayerNorm
    attention_class: type[nnx.Module] = SelfAttention
    mlp_class: type[nnx.Module] = MLP

    def __init__(self, cfg: TransformerConfig, *, rngs: nnx.Rngs):
        dt = cfg.compute_dtype
        self.rate, self.post_ln = cfg.dropout, cfg.post_layernorm
        self.ln_1 = self.norm_class(cfg.hidden_size, eps=cfg.layernorm_eps, dtype=dt, rngs=rngs)
        self.attn = self.attention_class(cfg, rngs=rngs)
        self.ln_2 = self.norm_class(cfg.hidden_size, eps=cfg.layernorm_eps, dtype=dt, rngs=rngs)
        self.mlp = self.mlp_class(cfg, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array, key: jax.Array | None, cache: LayerCache | None = None,
                 index: jax.Array | int = 0) -> tuple[jax.Array, LayerCache | None]:  # (B, S, H) -> (B, S, H)
        k_attn, k_res1, k_res2 = jax.random.split(key, 3) if key is not None else (None, None, None)
        if self.post_ln:  # Fig. 7a: LN(x + sublayer(x))
            attn, cache = self.attn(x, mask, k_attn, cache, index)
            x = self.ln_1(constrain(x + dropout(attn, self.rate, k_res1), RESIDUAL))
            x = self.ln_2(x + dropout(self.mlp(x), self.rate, k_res2))
        else:  # Fig. 7b: x + sublayer(LN(x))
            attn, cache = self.attn(self.ln_1(x), mask, k_attn, cache, index)
            x = constrain(x + dropout(attn, self.rate, k_res1), RESIDUAL)
            x = x + dropout(self.mlp(self.ln_2(x)), self.rate, k_res2)
        return constrain(x, RESIDUAL), cache


def make_blocks(cfg: TransformerConfig, rngs: nnx.Rngs, block: type[nnx.Module] = Block,
                count: int | None = None, pipelined: bool = True) -> nnx.Module:
    """``count`` (default ``cfg.num_layers``) blocks (``block(cfg, rngs=...)``, called as ``Block`` is) stacked on a
    leading ``layers`` axis, each with its own initialisation; ``pipelined`` False: a stack every pipeline stage runs
    whole (``pipeline.run_whole``), on a ``WHOLE_LAYERS`` axis, which no rule splits."""
    axis = "layers" if pipelined else WHOLE_LAYERS

    @nnx.split_rngs(splits=count or cfg.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: axis})
    def make(rngs: nnx.Rngs) -> nnx.Module:
        return block(cfg, rngs=rngs)

    return make(rngs)


STACK = "blocks"  # the attribute of a model's (first) pipelined layer stack (make_blocks; models.spec.trunk_stack)


def reorder_layers(tree: Any, saved: tuple[int, int], wanted: tuple[int, int]) -> Any:
    """``tree`` (parameters, or a training state whose optimizer moments mirror them) with the stacked layers (every
    leaf under a ``STACK`` key) taken from the ``saved`` (stages, repeats) order to the ``wanted`` one
    (``pipeline.relayout``); the other leaves as they are. Committed arrays keep their shardings and are given up
    (one jitted program for all of them, so each is replaced as it goes, not copied whole)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    stacked = [i for i, (path, _) in enumerate(flat)
               if any(getattr(k, "key", getattr(k, "name", None)) == STACK for k in path)]
    leaves = [a for _, a in flat]
    if not stacked or pipeline.same_order(saved, wanted, leaves[stacked[0]].shape[0]):
        return tree
    picked = [leaves[i] for i in stacked]
    move = lambda xs: [pipeline.relayout(x, saved, wanted) for x in xs]  # noqa: E731
    if all(isinstance(a, jax.Array) and not isinstance(a, jax.core.Tracer) for a in picked):
        picked = jax.jit(move, out_shardings=[a.sharding for a in picked], donate_argnums=0)(picked)
    else:
        picked = move(picked)
    for i, a in zip(stacked, picked, strict=True):
        leaves[i] = a
    return jax.tree_util.tree_unflatten(treedef, leaves)


def run_blocks(blocks: nnx.Module, cfg: TransformerConfig, x: jax.Array, mask: jax.Array, dropout_key: jax.Array | None,
               cache: KVCache | None = None, index: jax.Array | int = 0,
               layers: range | None = None, stack: pipeline.StackRunner = pipeline.run_stack
               ) -> tuple[jax.Array, KVCache | None]:
    """Runs the stacked blocks over ``x`` (B, S, H) with ``nnx.scan`` (each step under ``remat.layer_step``); on a
    mesh with pipeline stages, the same scan as a pipeline's stages, run by ``stack`` (``pipeline.run_stack``, or
    the 1F1B step's runners; not for incremental decoding). Layer ``i`` draws its dropout from the ``i``-th of
    ``cfg.num_layers`` splits of ``dropout_key``; ``layers``: which of the model's layers the blocks are (default
    all of them, in order). Returns the output and what each block returns beside its own (its key/value cache; a
    mixture-of-experts block adds its routing statistics), stacked over the layers (under pipeline stages summed
    over the microbatches, with no cache: ``pipeline.StackRunner``)."""
    layer_keys = None if dropout_key is None else jax.random.split(dropout_key, cfg.num_layers)
    if layers is not None and layer_keys is not None:
        layer_keys = layer_keys[layers.start:layers.stop]
    if pipeline.stages() > 1 and cache is None:
        def scan_layers(blocks: nnx.Module, h: jax.Array, mask: jax.Array, keys: jax.Array | None,
                        remat_layers: bool) -> tuple[jax.Array, Any]:
            return _scan_blocks(blocks, cfg, h, mask, keys, remat_layers=remat_layers)

        return stack(blocks, scan_layers, x, mask, layer_keys)
    if pipeline.stages() > 1 and pipeline.repeats() > 1:
        raise ValueError("incremental decoding reads the layers in model order; a circular pipeline's stack is not "
                         "(decode on a mesh without pipeline stages: megajax.config.load_model does)")
    return _scan_blocks(blocks, cfg, x, mask, layer_keys, cache, index)


def _scan_blocks(blocks: nnx.Module, cfg: TransformerConfig, x: jax.Array, mask: jax.Array,
                 layer_keys: jax.Array | None, cache: KVCache | None = None, index: jax.Array | int = 0,
                 remat_layers: bool = True) -> tuple[jax.Array, KVCache | None]:
    """The blocks in order over ``x``, layer ``i`` with ``layer_keys[i]`` (or no dropout); each step under
    ``remat.layer_step`` (``remat_layers`` False: under the caller's recomputation)."""

    def step(block: nnx.Module, h: jax.Array, key: jax.Array | None, layer_cache: LayerCache | None):
        return block(h, mask, key, layer_cache, index)

    scan = nnx.scan(layer_step(step, cfg.remat, remat_layers), in_axes=(0, nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0))
    return scan(blocks, x, layer_keys, cache)


class CausalDecoder(nnx.Module):
    """What every decoder language model shares for training, scoring and generation: the forward pass and the
    key/value cache of incremental decoding. A subclass sets ``self.cfg`` and defines ``_forward(tokens,
    dropout_key, cache, index, documents, stack) -> (logits, cache)`` (``documents``: a packed batch's layout, or
    None; ``stack``: how its pipelined layer stack runs, ``run_blocks``); ``cache_heads`` is how many key/value heads
    a step computes."""

    cfg: TransformerConfig

    def __call__(self, tokens: jax.Array, *, dropout_key: jax.Array | None = None, segments: jax.Array | None = None,
                 positions: jax.Array | None = None, stack: pipeline.StackRunner = pipeline.run_stack) -> jax.Array:
        """Training / scoring forward: (B, S) int ids -> (B, S, padded_vocab) logits. ``positions`` (B, S): each
        token's (a packed row's, restarting at each document; a row in context parallelism's order); with them a
        token attends to the keys at its position or before, and with packed rows' ``segments`` (B, S) only within
        its document (``Documents``). ``stack``: how the pipelined layer stack runs (``run_blocks``)."""
        return self._forward(tokens, dropout_key, None, 0, self._documents(segments, positions), stack)[0]

    @staticmethod
    def _documents(segments: jax.Array | None, positions: jax.Array | None) -> Documents | None:
        if segments is not None and positions is None:
            raise ValueError("packed rows need their positions with their segments (megajax.data.documents)")
        if positions is None:
            return None
        names = ("batch", "seq")
        return Documents(None if segments is None else constrain(segments, names), constrain(positions, names))

    def cache_heads(self) -> int:
        """Key/value heads per layer in the cache (all of them for multi-head attention)."""
        return self.cfg.num_heads

    def init_cache(self, batch: int, max_len: int | None = None) -> KVCache:
        """Zeroed keys and values for ``decode``: two (L, B, max_len, cache_heads, head_dim) arrays."""
        cfg = self.cfg
        shape = (cfg.num_layers, batch, max_len or cfg.max_seq_len, self.cache_heads(), cfg.head_dim)
        zeros = jnp.zeros(shape, cfg.compute_dtype)
        return (constrain(zeros, ("layers", "batch", "seq", "heads", "head_dim")),) * 2

    def decode(self, tokens: jax.Array, cache: KVCache, index: jax.Array | int) -> tuple[jax.Array, KVCache]:
        """Incremental forward of ``tokens`` (B, S) at positions ``index ..``, reading and extending ``cache``."""
        return self._forward(tokens, None, cache, index)

    def _tokens(self, tokens: jax.Array) -> jax.Array:
        """The ids laid out by batch, after checking their length against the model's."""
        if tokens.shape[1] > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {tokens.shape[1]} exceeds model.max_seq_len={self.cfg.max_seq_len}")
        return constrain(tokens, ("batch", "seq"))

    def _forward(self, tokens: jax.Array, dropout_key: jax.Array | None, cache: KVCache | None,
                 index: jax.Array | int, documents: Documents | None = None,
                 stack: pipeline.StackRunner = pipeline.run_stack) -> tuple[jax.Array, KVCache | None]:
        raise NotImplementedError
