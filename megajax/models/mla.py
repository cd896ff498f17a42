"""Multi-head latent attention (DeepSeek-V2, Liu et al. 2024; DeepSeek-V3), with YaRN's rotary scaling.

Queries come through a low-rank latent (``q_lora_rank``: down-projection, its RMSNorm, up-projection to the heads;
or one full projection where the rank is 0). Keys and values come from one compressed latent of ``kv_lora_rank``
(after its RMSNorm) projected up per head into a ``qk_nope_head_dim`` key part and a ``v_head_dim`` value; beside
it the same down-projection gives one ``qk_rope_head_dim`` key that carries the rotary position and is shared by
every head (the "decoupled" rotary key). A head's query is its ``qk_nope_head_dim`` part and its own rotary part.

Tensor parallelism: the down-projections and their norms are small and replicated (each model shard computes the
latents whole, as Megatron-Core's MLA does), the up-projections are column-parallel over ``heads`` and the output
projection row-parallel, so a layer's forward pass has one all-reduce, as Llama's attention.

Generation caches the normalised latent and the rotated shared key only, (kv_lora_rank + qk_rope_head_dim) values
per token and layer, and projects the latent up to every head's keys and values as it reads them.

The rotary part is in the rotate-half layout (``llama.rotate``); DeepSeek's published weights interleave the pairs
(``rope_interleave``), which the converter permutes (``convert/hf_deepseek.py``). With YaRN (``rope_scaling``
``yarn``) the frequencies are interpolated as transformers' ``_compute_yarn_parameters`` does, the rotated parts
scaled by its attention factor, and the softmax scale multiplied by ``mscale(factor, mscale_all_dim)^2``.
"""

from __future__ import annotations

import math
from typing import Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from megajax.models.llama import RMSNorm, rotate
from megajax.models.transformer import LayerCache, Positioned, attention_core, attention_core_residual_bytes
from megajax.parallel import context
from megajax.parallel.layers import ColumnParallelLinear, Dense, RowParallelLinear, scaled_init_std
from megajax.parallel.remat import selective
from megajax.parallel.sharding import constrain

LATENT_EPS = 1e-6  # the latents' RMSNorm epsilon (transformers' DeepseekV3RMSNorm default; not rms_norm_eps)
CACHE_NAMES = ("batch", "seq", None, None)  # a latent cache entry (B, S, 1, width): one "head", never split


class LatentConfig(Protocol):
    """The fields multi-head latent attention reads (``models.deepseek.DeepSeekConfig``)."""

    hidden_size: int
    num_heads: int
    num_layers: int
    init_std: float
    dropout: float
    remat: str
    fp8: bool
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_theta: float
    rope_scaling: str
    rope_factor: float
    rope_original_max_len: int
    yarn_beta_fast: float
    yarn_beta_slow: float
    yarn_mscale: float
    yarn_mscale_all_dim: float

    @property
    def compute_dtype(self) -> jnp.dtype: ...


def yarn_mscale(scale: float, mscale: float) -> float:
    """YaRN's magnitude correction ``0.1 mscale ln(scale) + 1`` (1 where the context is not stretched)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(cfg: LatentConfig) -> jax.Array:
    """The rotary part's (qk_rope_head_dim / 2,) fp32 inverse frequencies; with YaRN, interpolated by ``rope_factor``
    below the band between ``yarn_beta_slow`` and ``yarn_beta_fast`` rotations over the original length, kept
    above it, ramped linearly between (the band's edges rounded outwards, as transformers' ``truncate``)."""
    d, base = cfg.qk_rope_head_dim, cfg.rope_theta
    extrapolated = 1.0 / base ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)
    if cfg.rope_scaling != "yarn":
        return extrapolated

    def correction_dim(rotations: float) -> float:
        return d * math.log(cfg.rope_original_max_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(cfg.yarn_beta_fast)), 0)
    high = min(math.ceil(correction_dim(cfg.yarn_beta_slow)), d - 1)
    high = high + 0.001 if low == high else high
    ramp = jnp.clip((jnp.arange(d // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: the fast (short-wavelength) dimensions, extrapolated
    return extrapolated / cfg.rope_factor * (1 - keep) + extrapolated * keep


def rope_attention_factor(cfg: LatentConfig) -> float:
    """YaRN's scale of the rotated parts (cos and sin): mscale(factor, mscale) / mscale(factor, mscale_all_dim), or
    mscale(factor, 1) without both (transformers' ``attention_factor``); 1 without YaRN."""
    if cfg.rope_scaling != "yarn":
        return 1.0
    if cfg.yarn_mscale and cfg.yarn_mscale_all_dim:
        return yarn_mscale(cfg.rope_factor, cfg.yarn_mscale) / yarn_mscale(cfg.rope_factor, cfg.yarn_mscale_all_dim)
    return yarn_mscale(cfg.rope_factor, 1.0)


def softmax_scale(cfg: LatentConfig) -> float:
    """The scores' scale: 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim), times mscale(factor, mscale_all_dim)^2
    under YaRN (DeepSeek-V3's config: 1.0 mscale_all_dim, factor 40: 1.3689^2)."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    if cfg.rope_scaling == "yarn" and cfg.yarn_mscale_all_dim:
        scale *= yarn_mscale(cfg.rope_factor, cfg.yarn_mscale_all_dim) ** 2
    return scale


class LatentAttention(nnx.Module):
    """Multi-head latent attention: (B, S, H) -> (B, S, H); heads split over ``model``."""

    def __init__(self, cfg: LatentConfig, *, rngs: nnx.Rngs):
        dt, h, n = cfg.compute_dtype, cfg.hidden_size, cfg.num_heads
        self.cfg, self.rate = cfg, cfg.dropout
        qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
        std = dict(std=cfg.init_std, dtype=dt, rngs=rngs, bias=False)
        if cfg.q_lora_rank:
            self.q_down = Dense(h, (cfg.q_lora_rank,), ("embed", None), **std)
            self.q_norm = RMSNorm(cfg.q_lora_rank, eps=LATENT_EPS, dtype=dt, rngs=rngs, names=(None,))
            self.q = ColumnParallelLinear(cfg.q_lora_rank, (n, qk), (None, "heads", "head_dim"), fp8=cfg.fp8, **std)
        else:
            self.q_down = self.q_norm = None
            self.q = ColumnParallelLinear(h, (n, qk), ("embed", "heads", "head_dim"), fp8=cfg.fp8, **std)
        self.kv_down = Dense(h, (cfg.kv_lora_rank + cfg.qk_rope_head_dim,), ("embed", None), **std)
        self.kv_norm = RMSNorm(cfg.kv_lora_rank, eps=LATENT_EPS, dtype=dt, rngs=rngs, names=(None,))
        self.kv_up = ColumnParallelLinear(cfg.kv_lora_rank, (n, cfg.qk_nope_head_dim + cfg.v_head_dim),
                                          (None, "heads", "head_dim"), fp8=cfg.fp8, **std)
        self.out = RowParallelLinear((n, cfg.v_head_dim), h, ("heads", "head_dim", "embed"),
                                     std=scaled_init_std(cfg.init_std, cfg.num_layers), dtype=dt, rngs=rngs,
                                     bias=False, fp8=cfg.fp8)

    def __call__(self, x: jax.Array, mask: jax.Array, key: jax.Array | None, cache: LayerCache | None,
                 index: jax.Array | int) -> tuple[jax.Array, LayerCache | None]:
        """(B, S, H) -> (B, S, H) at positions ``index ..`` (or, for packed rows, ``mask``'s: a ``Positioned``);
        ``cache``: this layer's normalised latents (B, S_max, 1, kv_lora_rank) and rotated shared keys (B, S_max, 1,
        qk_rope_head_dim), extended at ``index`` and read whole (the mask hides what is not there yet)."""
        cfg = self.cfg
        names = ("batch", "seq", "heads", "head_dim")
        if isinstance(mask, Positioned):
            mask, positions = mask
        else:
            positions = index + jnp.arange(x.shape[1])
        nope, r = cfg.qk_nope_head_dim, cfg.kv_lora_rank
        q = self.q(x if self.q_down is None else self.q_norm(self.q_down(x)))  # (B, S, heads, nope + rope)
        latent = self.kv_down(x)  # (B, S, r + rope): replicated over the model shards
        inv_freq, factor = rope_frequencies(cfg), rope_attention_factor(cfg)
        c_kv = self.kv_norm(latent[..., :r])[:, :, None]  # (B, S, 1, r)
        k_rope = rotate(latent[:, :, None, r:], positions, inv_freq)  # (B, S, 1, rope)
        q_rope = rotate(q[..., nope:], positions, inv_freq)
        if factor != 1.0:
            k_rope, q_rope = k_rope * factor, q_rope * factor
        if cache is not None:
            c_kv, k_rope = (constrain(jax.lax.dynamic_update_slice_in_dim(c, new.astype(c.dtype), index, axis=1),
                                      CACHE_NAMES) for c, new in zip(cache, (c_kv, k_rope)))
            cache = (c_kv, k_rope)
        kv = self.kv_up(c_kv[:, :, 0])  # (B, S_kv, heads, nope + v)
        k_rope = constrain(k_rope, CACHE_NAMES)
        k = jnp.concatenate([kv[..., :nope], jnp.broadcast_to(k_rope, (*kv.shape[:3], k_rope.shape[-1]))], -1)
        # attention_core divides the scores by sqrt(nope + rope); the queries carry the rest of the scale
        extra = softmax_scale(cfg) * math.sqrt(q.shape[-1])
        q = jnp.concatenate([q[..., :nope], q_rope.astype(q.dtype)], -1)
        q = q if extra == 1.0 else (q * extra).astype(q.dtype)
        q, k, v = constrain(q, names), constrain(k, names), constrain(kv[..., nope:], names)
        # every key and value of the sequence (under context parallelism gathered over `context`)
        out = context.attention(selective(attention_core, cfg.remat), q, k, v, mask, key, self.rate)
        return self.out(out), cache


def latents(cfg: LatentConfig) -> tuple[int, ...]:
    """The widths of the latents each model shard computes whole and normalises: the query's (where it has one) and
    the keys' and values'."""
    return ((cfg.q_lora_rank,) if cfg.q_lora_rank else ()) + (cfg.kv_lora_rank,)


def attention_residual_bytes(cfg: LatentConfig, rows: int, tp: int, remat: str, cd: int,
                             attention: str = "xla") -> int:
    """Bytes latent attention keeps for its backward pass on one device (``rows`` sequences, ``tp`` model shards,
    ``cd`` bytes per compute-dtype value), beyond the block's norms: the traced jaxpr's on one device
    (tests/test_deepseek.py). ``none`` keeps the queries and keys (heads x (nope + rope)) and the values and context
    (heads x v) split over the shards; per latent (replicated) its RMSNorm's fp32 input and normalised values, the
    compute-dtype normalised and scaled values, two fp32 statistics per position and its scale broadcast; the
    attention core's residuals; in 16-bit the compute-dtype copies of every projection (the down-projections whole,
    the others split). ``selective`` drops the core's; ``save_dots`` keeps the projections' outputs (the
    down-projections' whole); ``full`` nothing beyond the layer's input."""
    s, b, n = cfg.max_seq_len, rows, cfg.num_heads
    qk, v, r, rope = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    h, qr = cfg.hidden_size, cfg.q_lora_rank
    if remat == "full":
        return 0
    if remat == "save_dots":
        return s * b * (n * (cfg.qk_nope_head_dim + v) // tp + n * qk // tp + qr + r + rope) * cd
    kept = 2 * s * b * n * (qk + v) * cd // tp  # q, k; v, context
    kept += sum(s * b * w * (8 + 2 * cd) + 2 * s * b * 4 + w * cd for w in latents(cfg))
    if remat != "selective":
        kept += attention_core_residual_bytes(cfg, b, tp, attention)
    if cd < 4:
        query = h * qr * tp + qr * n * qk if qr else h * n * qk
        kept += (query + h * (r + rope) * tp + r * n * (cfg.qk_nope_head_dim + v) + n * v * h) * cd // tp
    return kept
