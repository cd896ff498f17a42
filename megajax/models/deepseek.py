"""DeepSeek-V3-class decoders (DeepSeek-AI 2024; Moonlight, Kimi K2): multi-head latent attention, DeepSeekMoE.

Every layer's attention is multi-head latent attention (``models.mla``). The first ``first_k_dense_replace`` layers
have a dense SwiGLU (``ffn_hidden_size``); the others a DeepSeekMoE layer: ``n_shared_experts`` shared experts (one
SwiGLU of ``n_shared_experts x moe_ffn_hidden_size`` every token passes, tensor-parallel as a dense MLP) beside
``num_experts`` fine-grained routed experts (``moe.experts_forward``: grouped GEMMs, the expert-parallel exchange).

Routing (``grouped_route``): sigmoid scores of the fp32 router logits; for the choice only, each expert's
``correction_bias`` is added; the experts are in ``n_group`` groups, each group scored by the sum of its two best
biased scores, and a token picks its top ``experts_per_token`` among the experts of its ``topk_group`` best groups.
The weights are the chosen experts' unbiased scores, divided by their sum where ``norm_topk_prob``, times
``routed_scaling_factor``.

Auxiliary-loss-free balancing: the correction biases are parameters no gradient reaches (the optimizer leaves
them), moved after each applied step by ``bias_update_speed`` times sign(mean load - expert load) per layer, the
load counted over the whole global batch (every micro-batch, data and expert shard), so the same on every mesh;
they are saved and restored with the parameters. The small sequence-wise balance loss (``seq_aux_loss_coef``,
DeepSeek-V3's eq. 17-20: per sequence, E / (k T) x the assignments of each expert times the mean of its normalised
scores, summed over the experts; averaged over the sequences and the routed layers, the multi-token prediction
depths' among them) is an option.

The dense layers come first, on a stack every pipeline stage runs whole (``DENSE_STACK``, not split over stages);
the routed layers are the pipelined stack.

Multi-token prediction (``mtp_depth`` D > 0; DeepSeek-V3 sec. 2.2, Megatron-Core's MultiTokenPredictionLayer): depth
k (1..D) at position i reads the hidden state depth k - 1 gave (depth 0: the main model's, after its final norm, as
Megatron-Core reads it; a depth's hidden is its output after its own final norm, as there) and the embedding of
token i + k, each RMS-normalised, joins them by a projection ((embedding; hidden) 2H -> H, the published
checkpoint's ``eh_proj``, in the order Megatron-Core and vLLM's deepseek_mtp join them), runs one routed DeepSeek
layer and its own final norm, and predicts token i + k + 1 with the shared output layer (``MTPBlock``, stacked D deep
on ``MTP_STACK``, run whole on every pipeline stage, as the head). Its loss, each depth's mean cross-entropy over
the positions whose target lies in the window (in packed rows weighted as the main loss weighs that target, where
the depth's input token is in the position's document), averaged over the depths, is weighted by
``mtp_loss_weight``; its routers are balanced by their own correction biases, as the main layers'. Scoring and
generation read the main model only.
Under gradient accumulation over packed rows each micro-batch's MTP mean is over its own weights (the step weighs the
micro-batches by the main loss's), as Megatron-LM's per-micro-batch mean; 1F1B's means are the whole batch's.
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from megajax.models import mla, moe, objectives
from megajax.models.llama import LlamaBlock, RMSNorm, SwiGLU
from megajax.models.mla import LatentAttention
from megajax.models.moe import DENSE_STACK, MixtureOfExperts, MoEBlock, MoEConfig, MoEDecoder, Stats
from megajax.models.objectives import Batch, Metrics, StateUpdate
from megajax.models.spec import HeadMemory, LayerKind, Stack, decoder_spec, register
from megajax.models.transformer import STACK, make_blocks, run_blocks
from megajax.parallel import pipeline
from megajax.parallel.layers import ColumnParallelLinear, dropout, make_param
from megajax.parallel.losses import OWN, Means, vocab_parallel_cross_entropy
from megajax.parallel.remat import layer_step
from megajax.parallel.sharding import RESIDUAL, axis_of, constrain, entry_axes, positions_of

NAME = "deepseek"  # config.model.name


@dataclasses.dataclass(frozen=True, kw_only=True)
class DeepSeekConfig(MoEConfig):
    """DeepSeek-V3's config: the mixture's fields plus latent attention's, the routing's and the balancing's. The
    defaults are its published config.json's but the sequence (4096, its pretraining length: config.json's 163840 is
    what YaRN extends it to) and the balancing's, which are the technical report's (bias speed 0.001, alpha
    0.0001)."""

    vocab_size: int = 129280
    num_layers: int = 61
    hidden_size: int = 7168
    num_heads: int = 128
    num_kv_heads: int = 0  # every head its own key and value (from the shared latent)
    max_seq_len: int = 4096
    ffn_hidden_size: int = 18432  # the dense layers' SwiGLU
    layernorm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: str = "yarn"  # none | yarn
    rope_factor: float = 40.0
    rope_original_max_len: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float = 1.0
    yarn_mscale_all_dim: float = 1.0
    num_experts: int = 256
    experts_per_token: int = 8
    moe_ffn_hidden_size: int = 2048
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.0  # the Switch balancing loss: off (the biases balance)
    q_lora_rank: int = 1536  # 0: one full query projection (DeepSeek-V2-Lite, Moonlight's config: null)
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    n_shared_experts: int = 1
    routed_scaling_factor: float = 2.5
    n_group: int = 8
    topk_group: int = 4
    first_k_dense_replace: int = 3
    bias_update_speed: float = 0.001  # 0: the correction biases stay as they are
    seq_aux_loss_coef: float = 0.0001  # the sequence-wise balance loss's weight (DeepSeek-V3's alpha)
    mtp_depth: int = 0  # multi-token prediction depths D (config.json's num_nextn_predict_layers); 0: none
    mtp_loss_weight: float = 0.3  # the MTP loss's weight (DeepSeek-V3's lambda: 0.3 for 10T tokens, then 0.1)
    rope_scalings: ClassVar[tuple[str, ...]] = ("none", "yarn")

    def __post_init__(self):
        if not 0 <= self.first_k_dense_replace < self.num_layers:
            raise ValueError(f"model.first_k_dense_replace={self.first_k_dense_replace} must be in [0, "
                             f"model.num_layers={self.num_layers}): the layers after the dense ones are routed")
        for name in ("qk_norm", "kv_channels", "mlp_only_layers"):
            if getattr(self, name):
                raise ValueError(f"model.{name}={getattr(self, name)!r} is Qwen3-MoE's; a DeepSeek decoder's "
                                 "attention is latent (its head sizes: model.qk_nope_head_dim, qk_rope_head_dim, "
                                 "v_head_dim) and its dense layers the first model.first_k_dense_replace")
        if self.decoder_sparse_step != 1:
            raise ValueError("model.decoder_sparse_step is Qwen3-MoE's; a DeepSeek decoder's dense layers are the "
                             "first model.first_k_dense_replace")
        if self.num_kv_heads not in (0, self.num_heads):
            raise ValueError(f"model.num_kv_heads={self.num_kv_heads}: latent attention gives every head its own key "
                             "and value; leave it 0")
        super().__post_init__()
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_group", "topk_group"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name}={getattr(self, name)} must be >= 1")
        if self.q_lora_rank < 0 or self.n_shared_experts < 0:
            raise ValueError("model.q_lora_rank and model.n_shared_experts must be >= 0 (0: a full query projection; "
                             "no shared expert)")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"model.qk_rope_head_dim={self.qk_rope_head_dim}: rotary embeddings turn pairs")
        if self.num_experts % self.n_group:
            raise ValueError(f"model.n_group={self.n_group} does not divide model.num_experts={self.num_experts}")
        if self.topk_group > self.n_group:
            raise ValueError(f"model.topk_group={self.topk_group} exceeds model.n_group={self.n_group}: a token "
                             "picks its experts from at most every group")
        per_group = self.num_experts // self.n_group
        if self.n_group > 1 and per_group < 2:
            raise ValueError(f"model.n_group={self.n_group}: a group is scored by its two best experts, so each needs "
                             f"at least two (num_experts={self.num_experts})")
        if self.experts_per_token > self.topk_group * per_group:
            raise ValueError(f"model.experts_per_token={self.experts_per_token} exceeds the "
                             f"{self.topk_group * per_group} experts of model.topk_group={self.topk_group} groups")
        if self.bias_update_speed < 0 or self.seq_aux_loss_coef < 0 or self.routed_scaling_factor <= 0:
            raise ValueError("model.bias_update_speed and model.seq_aux_loss_coef must be >= 0, "
                             "model.routed_scaling_factor > 0")
        if not 0 <= self.mtp_depth < self.max_seq_len:
            raise ValueError(f"model.mtp_depth={self.mtp_depth} must be in [0, model.max_seq_len="
                             f"{self.max_seq_len}): each depth predicts one token further ahead in the window")
        if self.mtp_loss_weight < 0:
            raise ValueError(f"model.mtp_loss_weight={self.mtp_loss_weight} must be >= 0")
        if self.rope_scaling == "yarn" and not (self.rope_factor > 0 and self.yarn_beta_fast > self.yarn_beta_slow > 0):
            raise ValueError("YaRN needs model.rope_factor > 0 and model.yarn_beta_fast > model.yarn_beta_slow > 0")

    @property
    def head_dim(self) -> int:
        """A query's and key's size (the part without position and the rotary one)."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim

    @property
    def routed_layers(self) -> tuple[int, ...]:
        """Every layer after the first ``first_k_dense_replace``."""
        return tuple(range(self.first_k_dense_replace, self.num_layers))

    @property
    def dense_among_routed(self) -> bool:
        """The dense layers come first, on a stack every pipeline stage runs whole."""
        return False

    @property
    def shared_ffn_size(self) -> int:
        """The shared experts' SwiGLU width (one SwiGLU of all of them, as transformers holds them)."""
        return self.n_shared_experts * self.expert_ffn_size


def grouped_route(logits: jax.Array, bias: jax.Array, cfg: DeepSeekConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(sigmoid scores (T, E), top-k weights (T, k), top-k experts (T, k)) of fp32 router logits (T, E): the choice
    by the scores plus ``bias`` within the ``topk_group`` best of ``n_group`` groups (each scored by its two best
    biased scores), the weights the chosen experts' unbiased scores (renormalised where ``norm_topk_prob``) times
    ``routed_scaling_factor``."""
    scores = jax.nn.sigmoid(logits)
    choice = scores + bias
    t, e = choice.shape
    if cfg.n_group > 1:
        group_scores = jax.lax.top_k(choice.reshape(t, cfg.n_group, -1), 2)[0].sum(-1)  # (T, groups)
        best = jax.lax.top_k(group_scores, cfg.topk_group)[1]
        allowed = jax.nn.one_hot(best, cfg.n_group, dtype=jnp.bool_).any(1)  # (T, groups)
        choice = jnp.where(jnp.repeat(allowed, e // cfg.n_group, axis=1), choice, -jnp.inf)
    experts = jax.lax.top_k(choice, cfg.experts_per_token)[1]
    weights = jnp.take_along_axis(scores, experts, axis=1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return scores, weights * cfg.routed_scaling_factor, experts


class DeepSeekMoE(MixtureOfExperts):
    """Shared experts beside routed ones: ``(B, S, H) -> ((B, S, H), statistics)``. The routed part is the
    mixture's (``MixtureOfExperts``) with ``grouped_route``; each layer's ``correction_bias`` (E,) is a parameter
    the gradient never reaches (``update_biases`` moves it). The shared experts' weights are a SwiGLU's
    (``shared``: gate, up, down), run inside the mixture's per-device function (``beside``)."""

    STATS = (*MixtureOfExperts.STATS, "sequence_balance")

    def __init__(self, cfg: DeepSeekConfig, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        self.correction_bias = make_param(rngs, nnx.initializers.zeros, (cfg.num_experts,), (None,))
        self.shared = SwiGLU(dataclasses.replace(cfg, ffn_hidden_size=cfg.shared_ffn_size), rngs=rngs) \
            if cfg.n_shared_experts else None

    def local_params(self) -> tuple[tuple[jax.Array, tuple[str | None, ...]], ...]:
        """The correction biases, and the shared experts' kernels (their ``mlp`` columns split as a dense MLP's)."""
        shared = () if self.shared is None else tuple(
            (k.kernel[...], k.names) for k in (self.shared.gate, self.shared.up, self.shared.down))
        return ((self.correction_bias[...], (None,)), *shared)

    def choose(self, logits: jax.Array, rows: int, bias: jax.Array, *shared: jax.Array
               ) -> tuple[jax.Array, jax.Array, jax.Array, Stats]:
        """``grouped_route``; the statistics' probabilities are the normalised scores (s / sum of s), and
        ``sequence_balance`` sums each sequence's sum_e f_e P_e (its positions gathered over the shards that split
        it first, then divided by their count, as the caller sums the statistics over them)."""
        cfg = self.cfg
        scores, weights, experts = grouped_route(logits, jax.lax.stop_gradient(bias), cfg)
        normed = scores / scores.sum(-1, keepdims=True)
        e, length = cfg.num_experts, logits.shape[0] // rows
        counts = jax.nn.one_hot(experts, e, dtype=jnp.float32).sum(1).reshape(rows, length, e).sum(1)  # (b, E)
        mass = normed.reshape(rows, length, e).sum(1)
        seq_axes = entry_axes(axis_of("seq"))
        shards = math.prod(jax.lax.axis_size(a) for a in seq_axes) if seq_axes else 1
        if seq_axes:
            counts, mass = jax.lax.psum((jax.lax.stop_gradient(counts), mass), seq_axes)
        whole = length * shards
        balance = (counts * e / (cfg.experts_per_token * whole) * mass / whole).sum() / shards
        if seq_axes:  # the same on each of them: varying again, so the caller's sum over them gives it once
            balance = jax.lax.pcast(balance, seq_axes, to="varying")
        return normed, weights, experts, {"sequence_balance": balance}

    def beside(self, tokens: jax.Array, bias: jax.Array, *shared: jax.Array) -> jax.Array | None:
        """The shared experts' SwiGLU on this shard's ``mlp`` slice: its partial sum joins the routed experts' before
        their one all-reduce (a layer's forward pass reduces over ``model`` once for both, not twice)."""
        if not shared:
            return None
        dt = self.cfg.compute_dtype
        gate, up, down = (k.astype(dt) for k in shared)
        x = tokens.astype(dt)
        return (jax.nn.silu(x @ gate) * (x @ up)) @ down


class DeepSeekBlock(MoEBlock):
    """Latent attention, then the DeepSeekMoE layer; beside the cache it returns the layer's routing statistics."""

    attention_class, mlp_class = LatentAttention, DeepSeekMoE

    def __init__(self, cfg: DeepSeekConfig, *, rngs: nnx.Rngs):
        LlamaBlock.__init__(self, cfg, rngs=rngs)


class DeepSeekDenseBlock(LlamaBlock):
    """One of the first ``first_k_dense_replace`` layers: latent attention, then a SwiGLU of ``ffn_hidden_size``."""

    attention_class = LatentAttention


class MTPBlock(DeepSeekBlock):
    """One multi-token prediction depth: ``(h (B, S, H), embedded (B, S, H)) -> (normed output, statistics)``, h the
    previous depth's output (after its final norm), ``embedded`` the embeddings of the tokens ``depth`` places ahead:
    ``norm(layer(proj([enorm(embedded); hnorm(h)])))``, the layer a routed DeepSeek layer (this class's own
    attention and DeepSeekMoE). ``proj`` is column-parallel (its output gathered as the layer's input)."""

    def __init__(self, cfg: DeepSeekConfig, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        h, dt = cfg.hidden_size, cfg.compute_dtype
        self.enorm, self.hnorm, self.norm = (RMSNorm(h, eps=cfg.layernorm_eps, dtype=dt, rngs=rngs)
                                             for _ in range(3))
        self.proj = ColumnParallelLinear(2 * h, (h,), ("embed", "mlp"), std=cfg.init_std, dtype=dt, rngs=rngs,
                                         bias=False, fp8=cfg.fp8)

    def __call__(self, h, embedded, mask, key):
        joined = self.proj(jnp.concatenate([self.enorm(embedded), self.hnorm(h)], -1))
        x, (_, stats) = super().__call__(constrain(joined, RESIDUAL), mask, key)
        return self.norm(x), stats


MTP_STACK = "mtp"  # the multi-token prediction depths' stack (``MTPBlock``s), where mtp_depth > 0


class DeepSeekDecoder(MoEDecoder):
    """The dense layers (``DENSE_STACK``, run whole on every pipeline stage) then the routed ones (``blocks``,
    pipelined): ``tokens (B, S) -> logits``; ``routed`` also returns the routed layers' statistics, ``predicted``
    the multi-token prediction depths' logits too (``MTP_STACK``)."""

    block_class = DeepSeekBlock

    def _make_layers(self, cfg: DeepSeekConfig, rngs: nnx.Rngs) -> None:
        k = cfg.first_k_dense_replace
        self.dense_blocks = make_blocks(cfg, rngs, DeepSeekDenseBlock, count=k, pipelined=False) if k else None
        self.blocks = make_blocks(cfg, rngs, DeepSeekBlock, count=cfg.num_layers - k)
        self.mtp = make_blocks(cfg, rngs, MTPBlock, count=cfg.mtp_depth, pipelined=False) if cfg.mtp_depth else None

    def predicted(self, tokens: jax.Array, ahead: jax.Array | None, dropout_key: jax.Array | None = None,
                  segments: jax.Array | None = None, positions: jax.Array | None = None,
                  stack: pipeline.StackRunner = pipeline.run_stack
                  ) -> tuple[jax.Array, jax.Array | None, Stats]:
        """(logits (B, S, padded_vocab), each multi-token prediction depth's logits (D, B, S, padded_vocab) or None,
        the routing statistics of the routed layers then the depths' (L + D, ...)); ``ahead`` (B, S, D): the token
        ``k`` places ahead of each input at depth ``k`` (None without MTP). Packed rows and ``stack`` as
        ``__call__``."""
        cfg = self.cfg
        b = tokens.shape[0]
        x, mask, rows, (_, stats) = self._trunk(tokens, dropout_key, None, 0, self._documents(segments, positions),
                                                stack)
        head_rows = self._head_rows(b, rows)
        h = self.ln_f(x)
        logits = self._head(h, head_rows)
        if self.mtp is None:
            return logits, None, stats
        depth = cfg.mtp_depth
        keys = None if dropout_key is None else jax.random.split(jax.random.fold_in(dropout_key, cfg.num_layers),
                                                                 (depth, 2))
        embedded = jnp.stack([constrain(dropout(self.wte(self._tokens(ahead[..., k]), rows), cfg.dropout,
                                                None if keys is None else keys[k, 0]), RESIDUAL)
                              for k in range(depth)])

        def step(block: MTPBlock, h: jax.Array, e: jax.Array, key: jax.Array | None):
            out, layer_stats = block(h, e, mask, key)
            return out, (out, layer_stats)

        scan = nnx.scan(layer_step(step, cfg.remat), in_axes=(0, nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0))
        _, (outs, mtp_stats) = scan(self.mtp, h, embedded, None if keys is None else keys[:, 1])
        ahead_logits = jnp.stack([self._head(outs[k], head_rows) for k in range(depth)])
        return logits, ahead_logits, jax.tree.map(lambda a, b: jnp.concatenate([a, b]), stats, mtp_stats)

    def _run_layers(self, x, mask, dropout_key, cache, index, stack=pipeline.run_stack):
        cfg, k = self.cfg, self.cfg.first_k_dense_replace
        part = lambda r: None if cache is None else tuple(c[r.start:r.stop] for c in cache)  # noqa: E731
        first = None
        if k:
            x, first = run_blocks(self.dense_blocks, cfg, x, mask, dropout_key, part(range(k)), index, range(k),
                                  stack=pipeline.run_whole)
        routed = range(k, cfg.num_layers)
        x, (rest, stats) = run_blocks(self.blocks, cfg, x, mask, dropout_key, part(routed), index, routed,
                                      stack=stack)
        joined = rest if cache is None or not k else tuple(jnp.concatenate(c) for c in zip(first, rest))
        return x, (joined, stats)

    def init_cache(self, batch: int, max_len: int | None = None) -> tuple[jax.Array, jax.Array]:
        """Zeroed latents and shared rotary keys for ``decode``: (L, B, max_len, 1, kv_lora_rank) and (L, B,
        max_len, 1, qk_rope_head_dim), (kv_lora_rank + qk_rope_head_dim) x dtype bytes per token and layer."""
        cfg = self.cfg
        return tuple(jnp.zeros((cfg.num_layers, batch, max_len or cfg.max_seq_len, 1, width), cfg.compute_dtype)
                     for width in (cfg.kv_lora_rank, cfg.qk_rope_head_dim))

    def router_terms(self, stats: Stats, shape: tuple[int, int], means: Means = OWN) -> tuple[jax.Array, Metrics]:
        """The mixture's terms, the sequence-wise balance loss (mean over sequences and routed layers, the multi-token
        prediction depths' included, weighted by ``seq_aux_loss_coef``) and, for ``update_biases``, each routed
        layer's and depth's assignments per expert (not logged)."""
        cfg = self.cfg
        loss, metrics = super().router_terms(stats, shape, means)
        layers = stats["load"].shape[0]
        sequence = means.share(math.prod(shape)) * stats["sequence_balance"].sum() / (layers * shape[0])
        metrics.update(sequence_balance_loss=sequence, expert_counts=jax.lax.stop_gradient(stats["load"]))
        return loss + cfg.seq_aux_loss_coef * sequence, metrics


def update_biases(model: DeepSeekDecoder, sums: Metrics) -> None:
    """After a step: each routed layer's and multi-token prediction depth's ``correction_bias`` += bias_update_speed
    x sign(mean load - load), from the step's assignments per expert (``expert_counts``, (routed layers + depths,
    E))."""
    cfg = model.cfg
    routed = len(cfg.routed_layers)
    load = sums["expert_counts"][:routed]  # in the model's layer order; a circular pipeline holds its stack in its own
    load = pipeline.relayout(load, (1, 1), (pipeline.stages(), pipeline.repeats()))
    for stack, counts in ((model.blocks, load), (model.mtp, sums["expert_counts"][routed:])):
        if stack is not None:
            bias = stack.mlp.correction_bias
            bias[...] = bias[...] + cfg.bias_update_speed * jnp.sign(counts.mean(-1, keepdims=True) - counts)


def ahead_rows(batch: Batch, depth: int) -> Batch:
    """Multi-token prediction's token-aligned fields (B, S, depth) of a decoder's batch (``tokens`` (B, S + 1)): at
    depth k (1..depth) each input's token k places ahead (``ahead``: the depth's input), the one k + 1 ahead
    (``ahead_targets``) and its weight (``ahead_weights``): 1 where it lies in the window (0 past it, where the
    ids are padding), times, in packed rows, the main loss's weight of that target where the depth's input (token
    i + k) is in input i's document."""
    tokens = batch["tokens"]
    b, s = tokens.shape[0], tokens.shape[1] - 1
    padded = jnp.pad(tokens, ((0, 0), (0, depth + 1)))
    ahead = jnp.stack([padded[:, k:k + s] for k in range(1, depth + 1)], -1)
    targets = jnp.stack([padded[:, k + 1:k + 1 + s] for k in range(1, depth + 1)], -1)
    inside = (jnp.arange(s)[:, None] + jnp.arange(2, depth + 2)[None] <= s).astype(jnp.float32)  # (S, depth)
    weights = jnp.broadcast_to(inside, (b, s, depth))
    if "loss_weights" in batch:  # target i + k + 1 is the loss weight of input i + k; same document as input i
        segments = jnp.pad(batch["segments"], ((0, 0), (0, depth)), constant_values=-1)
        loss_weights = jnp.pad(batch["loss_weights"], ((0, 0), (0, depth)))
        same = jnp.stack([(segments[:, k:k + s] == batch["segments"]) * loss_weights[:, k:k + s]
                          for k in range(1, depth + 1)], -1)
        weights = weights * same
    return {"ahead": ahead, "ahead_targets": targets, "ahead_weights": weights}


def _deepseek_lm(model: DeepSeekDecoder, batch: Batch, key: jax.Array | None, means: Means = OWN,
                 stack: pipeline.StackRunner = pipeline.run_stack) -> tuple[jax.Array, Metrics]:
    """Next-token cross-entropy, the weighted router losses and, with ``mtp_depth``, ``mtp_loss_weight`` x the
    multi-token prediction loss (``mtp_loss``: each depth's mean cross-entropy over its weighted targets, averaged
    over the depths); each part logged (``lm_loss`` is what the perplexity is of)."""
    depth = model.cfg.mtp_depth
    rows = objectives.next_tokens(batch, ahead_rows(batch, depth) if depth else None)
    with positions_of(rows.pop("order", None)):  # context parallelism's order keys dropout by true position
        logits, ahead_logits, stats = model.predicted(rows["inputs"], rows.get("ahead"), dropout_key=key,
                                                      stack=stack, **objectives.documents(rows))
    lm = means.mean(vocab_parallel_cross_entropy(logits, rows["targets"]), rows.get("loss_weights"))
    router_loss, metrics = model.router_terms(stats, rows["inputs"].shape, means)
    if not depth:
        return lm + router_loss, {"lm_loss": lm, **metrics}
    mtp = sum(means.mean(vocab_parallel_cross_entropy(ahead_logits[k], rows["ahead_targets"][..., k]),
                         rows["ahead_weights"][..., k]) for k in range(depth)) / depth
    return lm + router_loss + model.cfg.mtp_loss_weight * mtp, {"lm_loss": lm, "mtp_loss": mtp, **metrics}


DEEPSEEK_LM = dataclasses.replace(moe.MOE_LM, loss=_deepseek_lm,
                                  update=StateUpdate(("expert_counts",), update_biases, moved=("correction_bias",)))


def flops(cfg: DeepSeekConfig, rows: int, seq: int) -> float:
    """Model FLOPs of a step over the active parameters: 3 (forward + backward) x 2 per multiply-add of latent
    attention's projections (the query's down and up, or one; the key/value latent's down and up; the output), its
    scores (nope + rope per head) and context (v per head), the dense layers' SwiGLU, the routed layers' router, k
    routed experts and shared experts, and the output layer; each multi-token prediction depth's routed layer, join
    projection and output layer."""
    h, n = cfg.hidden_size, cfg.num_heads
    qk, v, r = cfg.head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    query = h * cfg.q_lora_rank + cfg.q_lora_rank * n * qk if cfg.q_lora_rank else h * n * qk
    attention = 2 * (query + h * (r + cfg.qk_rope_head_dim) + r * n * (cfg.qk_nope_head_dim + v) + n * v * h) \
        + 2 * seq * n * (qk + v)
    routed = 2 * h * (cfg.num_experts + 3 * cfg.experts_per_token * cfg.expert_ffn_size + 3 * cfg.shared_ffn_size)
    dense = 2 * h * 3 * cfg.ffn_size
    sparse = len(cfg.routed_layers)
    layers = cfg.num_layers * attention + sparse * routed + (cfg.num_layers - sparse) * dense
    head = 2 * h * cfg.padded_vocab_size
    mtp = cfg.mtp_depth * (attention + routed + 2 * 2 * h * h + head)  # each depth: a routed layer, proj, the head
    return 3.0 * rows * seq * (layers + head + mtp)


def reference_route(logits: np.ndarray, bias: np.ndarray, cfg: DeepSeekConfig) -> tuple[np.ndarray, np.ndarray]:
    """``grouped_route`` in float64 numpy, token by token (tests): (weights (T, k), experts (T, k)), each token's
    experts in descending order of their biased scores."""
    logits = logits.astype(np.float64)
    t, e = logits.shape
    per = e // cfg.n_group
    weights, experts = np.zeros((t, cfg.experts_per_token)), np.zeros((t, cfg.experts_per_token), int)
    for i in range(t):
        scores = 1 / (1 + np.exp(-logits[i]))
        choice = scores + bias
        if cfg.n_group > 1:
            groups = [np.sort(choice[g * per:(g + 1) * per])[-2:].sum() for g in range(cfg.n_group)]
            keep = np.argsort(groups, kind="stable")[::-1][:cfg.topk_group]
            choice = np.where(np.isin(np.arange(e) // per, keep), choice, -np.inf)
        top = np.argsort(-choice, kind="stable")[:cfg.experts_per_token]
        w = scores[top] / (scores[top].sum() + 1e-20 if cfg.norm_topk_prob else 1.0)
        weights[i], experts[i] = w * cfg.routed_scaling_factor, top
    return weights, experts


def stacks(cfg: DeepSeekConfig) -> tuple[Stack, ...]:
    """The dense layers (the first ``first_k_dense_replace``, run whole on every stage), the routed ones and the
    multi-token prediction depths (run whole on every stage)."""
    k = cfg.first_k_dense_replace
    routed = (Stack(STACK, ROUTED, cfg.num_layers - k),)
    mtp = (Stack(MTP_STACK, MTP, cfg.mtp_depth, pipelined=False),) if cfg.mtp_depth else ()
    return ((Stack(DENSE_STACK, DENSE, k, pipelined=False),) if k else ()) + routed + mtp


def dense_layer_residual_bytes(cfg: DeepSeekConfig, rows: int, tp: int, split: int, remat: str, cd: int,
                               attention: str = "xla") -> int:
    """Bytes one dense layer keeps for its backward pass on one device: the block's two RMSNorms (as Llama's: fp32
    input and normalised values, compute-dtype normalised and scaled, two fp32 statistics per position, the scales
    broadcast), dropout's masks, the SwiGLU's six (b, s, ffn) tensors (in 16-bit the compute-dtype copy of down)
    and latent attention's (``mla.attention_residual_bytes``); ``full`` the layer's input, ``save_dots`` the input,
    one projection, the fused gate / up GEMM's output and attention's projections. Under sequence parallelism the
    residual stream's terms are split and the column-parallel GEMMs keep their all-gathered inputs (the SwiGLU's
    b s h, the latents' b s (q_lora_rank + kv_lora_rank))."""
    s, b, h, f = cfg.max_seq_len, rows, cfg.hidden_size, cfg.ffn_size
    sbh = s * b * h
    if remat == "full":
        return sbh * cd // split
    attention_bytes = mla.attention_residual_bytes(cfg, rows, tp, remat, cd, attention)
    if remat == "save_dots":
        return 2 * sbh * cd + 2 * s * b * f * cd // tp + attention_bytes
    kept = (4 * sbh * (cd + 4) + 4 * s * b * 4 + (2 * sbh if cfg.dropout > 0 else 0)) // split + 2 * h * cd
    kept += 6 * s * b * f * cd // tp + (f * h * cd // tp if cd < 4 else 0)
    if split > 1:
        kept += (sbh + s * b * sum(mla.latents(cfg))) * cd
    return kept + attention_bytes


def routed_layer_residual_bytes(cfg: DeepSeekConfig, rows: int, tp: int, split: int, remat: str, cd: int,
                                attention: str = "xla", expert: int = 1, exchange: str = "blocks") -> int:
    """Bytes one routed layer keeps: the dense layer's (``dense_layer_residual_bytes``) with the shared experts'
    SwiGLU (n_shared x moe_ffn wide; in 16-bit the copies of its three kernels) in place of its own, the mixture's
    routed MLP (``moe.routed_mlp_bytes``, its statistics with the sequence-wise one), and what DeepSeek's routing
    keeps beyond the softmax's: per token the layer's input once more in the compute dtype (the router's and the
    shared experts' reads) and one more fp32 value per expert (the normalised scores), per sequence its fp32
    probability mass per expert (the sequence-wise loss's); the traced jaxpr's on one device
    (tests/test_deepseek.py). The expert shards' terms are the mixture's (``moe.layer_residual_bytes``)."""
    s, b, h = cfg.max_seq_len, rows, cfg.hidden_size
    dense = dense_layer_residual_bytes(cfg, rows, tp, split, remat, cd, attention)
    routed = moe.routed_mlp_bytes(cfg, rows, tp, remat, cd, expert, exchange) + 4  # + the sequence-wise statistic
    f, fs = cfg.ffn_size, cfg.shared_ffn_size
    if remat == "full":
        return dense + routed
    if remat == "save_dots":
        return dense - 2 * s * b * (f - fs) * cd // tp + routed
    dense_mlp = 6 * s * b * f * cd // tp + (f * h * cd // tp if cd < 4 else 0)  # its down's copy, gate / up fused
    shared = 6 * s * b * fs * cd // tp + (3 * fs * h * cd // tp if cd < 4 else 0)  # all three kernels' copies
    routing = s * b * (h * cd + 4 * cfg.num_experts) + b * cfg.num_experts * 4
    return dense - dense_mlp + shared + routed + routing


def mtp_layer_residual_bytes(cfg: DeepSeekConfig, rows: int, tp: int, split: int, remat: str, cd: int,
                             attention: str = "xla", expert: int = 1, exchange: str = "blocks") -> int:
    """Bytes one multi-token prediction depth keeps: a routed layer's (``routed_layer_residual_bytes``) and the
    join's and final norm's. ``full``: the depth's hidden input and its output besides the layer's; ``save_dots``
    those and the projection's output; otherwise per RMSNorm (enorm, hnorm, the final one) its fp32 input and
    normalised values, two fp32 statistics per position and, in 16-bit, its scale broadcast, and in the compute dtype
    the three normalised values, the concatenation (b, s, 2h, which the projection reads whole), the projection's
    output, the layer's output and the depth's. Equal to the traced jaxpr's in 16-bit (the training precision); in
    fp32, where the casts are no-ops, the traced count is 3 (b, s, h) values lower (tests/test_deepseek.py)."""
    s, b, h = cfg.max_seq_len, rows, cfg.hidden_size
    sbh = s * b * h
    layer = routed_layer_residual_bytes(cfg, rows, tp, split, remat, cd, attention, expert, exchange)
    if remat == "full":
        return layer + sbh * cd // split
    if remat == "save_dots":
        return layer + 2 * sbh * cd // split + sbh * cd // tp
    norms = 3 * (2 * sbh * 4 + 2 * s * b * 4) // split + (3 * h * cd if cd < 4 else 0)
    return layer + norms + (5 * sbh * cd + sbh * cd // tp) // split + 2 * sbh * cd


def backward_widths(cfg: DeepSeekConfig) -> tuple[int, ...]:
    """The elements per token of each of a layer's backward all-reduces over ``model``: the MLP's input gradient
    (h); latent attention's key/value latent's and shared rotary key's gradients (kv_lora_rank, qk_rope_head_dim:
    every model shard's heads give part of each) and the query latent's (q_lora_rank), or without one the input's
    (h: the query projection is column-parallel); one all-reduce each, as the compiled step has them."""
    query = cfg.q_lora_rank or cfg.hidden_size
    return cfg.hidden_size, query, cfg.kv_lora_rank, cfg.qk_rope_head_dim


# A dense layer: the output all-reduces of latent attention and the SwiGLU forward; backward the MLP input's and
# the latents' gradients
DENSE = LayerKind("deepseek dense", residuals=dense_layer_residual_bytes, backward_widths=backward_widths)
# A routed layer: the mixture's kind (its experts, exchange and dispatch passes) with its own residuals; the shared
# experts' output is reduced with the routed experts' (``DeepSeekMoE.beside``), so two all-reduces forward, as a
# dense layer's
ROUTED = dataclasses.replace(moe.ROUTED, name="deepseek routed", residuals=routed_layer_residual_bytes,
                             backward_widths=backward_widths)

# A multi-token prediction depth: a routed layer with the join before it (its two norms, the concatenation, the
# projection) and its final norm after; its output layer's logits are the head's (``head_memory``), once more per depth
MTP = dataclasses.replace(ROUTED, name="deepseek mtp", residuals=mtp_layer_residual_bytes,
                          uncounted="each depth's join projection and its output layer's collectives; set "
                                    "model.mtp_depth=0 to read a budget")

def active_parameters(cfg: DeepSeekConfig, total: int) -> int:
    """Of ``total`` parameters, those one token uses: all but the routed experts it skips in each routed layer and
    each multi-token prediction depth."""
    return total - (len(cfg.routed_layers) + cfg.mtp_depth) * moe.skipped_expert_parameters(cfg)


register(decoder_spec(NAME, DeepSeekConfig, DeepSeekDecoder, flops, objective=DEEPSEEK_LM, perplexity_of="lm_loss",
                      stacks=stacks, active_parameters=active_parameters,
                      head_memory=HeadMemory(vocab_logit_copies=3, hidden_tensors=8,
                                             outputs=lambda cfg: 1 + cfg.mtp_depth)))
