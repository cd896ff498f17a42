"""Mixture-of-experts decoders on the Llama trunk: Mixtral (Jiang et al. 2024) and Qwen3-MoE.

Each block's MLP is a routed mixture: a router (H -> E, no bias, in fp32) scores the experts, each token goes to its
top ``experts_per_token`` of the softmax (renormalised over them where ``norm_topk_prob``: always for Mixtral), each
expert is a SwiGLU MLP, and the token's output is the experts' outputs summed with those weights. Qwen3-MoE adds a
per-head RMSNorm of the queries and keys (``qk_norm``), a head size of its own (``kv_channels``) and, optionally,
dense layers among the routed ones (``decoder_sparse_step``, ``mlp_only_layers``: transformers' rule,
``MoEConfig.routed_layers``): those are Llama layers with its attention (``DenseBlock``), stacked apart
(``DENSE_STACK``), and the decoder runs each run of one kind from its stack's slice in turn (``MoEDecoder``).

Dropless by default: a device's tokens are sorted by expert and each of the three expert GEMMs is one grouped GEMM
(``jax.lax.ragged_dot``) over the groups, no token dropped and no padding. With ``capacity_factor`` > 0 each expert
takes at most ``ceil(capacity_factor * S * k / E)`` of a sequence's assignments, in the order of the tokens and
their ranks (a token's first choice before its second); the rest are dropped (their weight is lost, the residual
carries the token) and counted. Capacity per sequence, not per device, so the same tokens drop on every mesh.

The dispatch runs per device (``sharding.on_shards``): each data shard routes its own rows, each model shard holds
the ``mlp`` columns of every expert's gate and up and the rows of its down (Megatron's split inside each expert), so
a layer's only tensor-parallel collective is the all-reduce of its output, as the dense MLP's. With ``mesh.expert``
> 1 each expert shard holds whole experts and the assignments travel to them and back (``parallel/expert_exchange``:
a block per destination, or, ``model.expert_exchange`` ragged, the default on NVIDIA GPUs, the routed rows alone).
Dropless, an expert shard's receive buffer has room for the worst case, every source's rows for it (e x the routed
rows where a shard holds k or more experts); ``model.expert_room`` r bounds it to r x its own routed rows and drops
(and counts) what does not fit, its experts water-filled and each expert's rows in the order of the expert group's
batch (``expert_exchange.within_room``): memory and passes that do not grow with e, drops that depend on the mesh
(none without expert shards), as a capacity per expert group's batch would; a training setting (inference,
``config.load.inference_config``, keeps every assignment).
The balancing loss
and the router z-loss are summed over the data shards inside, so the loss is the same on every mesh, except under
gradient accumulation, where the step keeps each data replica's gradients apart (``training.replicas``) and each
replica's share of a micro-batch is its own batch (its own f_e and P_e, as Megatron-LM computes them per rank).

The load-balancing loss is the Switch Transformer's as transformers computes it (``load_balancing_loss_func``): the
fractions of assignments and the mean router probabilities per expert, each over every layer's tokens together,
multiplied, summed over the experts and scaled by E; ``router_aux_loss_coef`` weighs it in the loss. The router
z-loss (ST-MoE, Zoph et al. 2022) is the mean of logsumexp(router logits)^2 over tokens and layers.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from megajax.models import llama, objectives
from megajax.models.llama import Attention, Llama, LlamaBlock, LlamaConfig, RMSNorm
from megajax.models.spec import LayerKind, Stack, decoder_spec, register
from megajax.models.transformer import STACK, make_blocks, run_blocks
from megajax.parallel import jax_fixes, pipeline  # noqa: F401 - jax_fixes: ragged_dot under the stages' vmaps
from megajax.parallel.expert_exchange import EXCHANGES, exchange_of, experts_forward
from megajax.parallel.grouped_gemm import GEMMS, gemm_of
from megajax.parallel.layers import dropout, make_param, scaled_init_std
from megajax.parallel.losses import OWN, Means, vocab_parallel_cross_entropy
from megajax.parallel.sharding import RESIDUAL, axis_of, constrain, entry_axes, on_shards, param_at_use, positions_of

NAME = "moe"  # config.model.name

# what each MoE layer returns beside its output, summed over the batch's tokens (all data shards)
Stats = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEConfig(LlamaConfig):
    """A Llama trunk whose MLPs are routed experts; the defaults are Mixtral 8x7B's."""

    num_kv_heads: int = 8
    ffn_hidden_size: int = 14336  # a dense MLP's width (every layer is an MoE layer here; kept for the trunk)
    rope_theta: float = 1e6
    num_experts: int = 8
    experts_per_token: int = 2  # top-k
    moe_ffn_hidden_size: int = 0  # each expert's SwiGLU width; 0: ffn_hidden_size
    norm_topk_prob: bool = True  # renormalise the top-k probabilities to sum to 1 (Mixtral: always)
    router_aux_loss_coef: float = 0.02  # the load-balancing loss's weight (Mixtral's; Qwen3-MoE's 0.001)
    router_z_loss_coef: float = 0.0  # the router z-loss's weight (logged either way)
    capacity_factor: float = 0.0  # 0: dropless; else each expert takes ceil(cf * S * k / E) of a sequence's tokens
    qk_norm: bool = False  # Qwen3: RMSNorm over each query and key head before the rotation
    kv_channels: int = 0  # the head size; 0: hidden_size / num_heads (Qwen3-MoE sets its own)
    decoder_sparse_step: int = 1  # Qwen3-MoE: layer i is routed where (i + 1) % step == 0, the others dense
    mlp_only_layers: tuple[int, ...] = ()  # Qwen3-MoE: layers with a dense SwiGLU (ffn_hidden_size) whatever the step
    expert_exchange: str = "auto"  # blocks, ragged (parallel/expert_exchange.py); auto: ragged on NVIDIA GPUs
    expert_gemm: str = "auto"  # xla, pallas (parallel/grouped_gemm.py); auto: pallas on NVIDIA GPUs
    # 0: an expert shard's receive buffer holds the worst case (every source's rows for it); else
    # ceil(expert_room * its own routed rows), what does not fit dropped and counted (parallel/expert_exchange.py)
    expert_room: float = 0.0

    def __post_init__(self):
        super().__post_init__()
        object.__setattr__(self, "mlp_only_layers", tuple(int(i) for i in self.mlp_only_layers))  # JSON: a list
        if self.decoder_sparse_step < 1:
            raise ValueError(f"model.decoder_sparse_step={self.decoder_sparse_step} must be >= 1 (1: every layer "
                             "routed)")
        if bad := [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]:
            raise ValueError(f"model.mlp_only_layers has {bad}: layers are numbered 0 to {self.num_layers - 1}")
        if not self.routed_layers:
            raise ValueError("model.decoder_sparse_step and model.mlp_only_layers leave no routed layer: a decoder "
                             "of dense layers is model.name=llama")
        if self.num_experts < 1 or not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(f"model.experts_per_token={self.experts_per_token} must be in [1, model.num_experts="
                             f"{self.num_experts}]: each token picks that many distinct experts")
        if self.moe_ffn_hidden_size < 0 or self.kv_channels < 0:
            raise ValueError("model.moe_ffn_hidden_size and model.kv_channels must be >= 0 (0: the default)")
        if self.expert_exchange not in EXCHANGES:
            raise ValueError(f"model.expert_exchange={self.expert_exchange!r} must be one of {', '.join(EXCHANGES)} "
                             "(auto: ragged where the step runs on NVIDIA GPUs, blocks elsewhere)")
        if self.expert_gemm not in GEMMS:
            raise ValueError(f"model.expert_gemm={self.expert_gemm!r} must be one of {', '.join(GEMMS)} (auto: the "
                             "Pallas kernel where the step runs on NVIDIA GPUs, XLA's ragged_dot elsewhere)")
        if self.capacity_factor < 0:
            raise ValueError(f"model.capacity_factor={self.capacity_factor} must be >= 0 (0: dropless)")
        if self.expert_room < 0:
            raise ValueError(f"model.expert_room={self.expert_room} must be >= 0 (0: room for the worst case, "
                             "dropless; 1.25: a quarter more than balanced routing sends an expert shard)")
        if self.router_aux_loss_coef < 0 or self.router_z_loss_coef < 0:
            raise ValueError("model.router_aux_loss_coef and model.router_z_loss_coef must be >= 0")

    @property
    def head_dim(self) -> int:
        return self.kv_channels or self.hidden_size // self.num_heads

    @property
    def routed_layers(self) -> tuple[int, ...]:
        """The layers whose MLP is routed, in order (transformers' Qwen3-MoE rule); the rest are dense."""
        return tuple(i for i in range(self.num_layers)
                     if i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0)

    def segments(self) -> list[tuple[bool, range, int]]:
        """The layers as runs of one kind, in order: (routed, the model's layers, the first one's place in its
        kind's stack)."""
        routed, out, seen = set(self.routed_layers), [], {True: 0, False: 0}
        for i in range(self.num_layers):
            kind = i in routed
            if out and out[-1][0] == kind:
                out[-1] = (kind, range(out[-1][1].start, i + 1), out[-1][2])
            else:
                out.append((kind, range(i, i + 1), seen[kind]))
            seen[kind] += 1
        return out

    @property
    def dense_among_routed(self) -> bool:
        """Whether some layers are dense (Qwen3-MoE's runs of one kind, which pipeline stages do not split yet)."""
        return len(self.routed_layers) < self.num_layers

    @property
    def expert_ffn_size(self) -> int:
        """Each expert's SwiGLU width."""
        return self.moe_ffn_hidden_size or self.ffn_size

    @property
    def capacity(self) -> int:
        """Assignments an expert takes per sequence (0: no limit)."""
        if not self.capacity_factor:
            return 0
        return math.ceil(self.capacity_factor * self.max_seq_len * self.experts_per_token / self.num_experts)

    def exchange_sizes(self, tokens: int, rows: int, expert: int) -> tuple[int, int]:
        """(block, room): the rows a shard of ``tokens`` tokens in ``rows`` sequences sends one of its ``expert``
        destinations at most, and the rows a destination receives at most. A token's k experts are distinct, so a
        destination's E / e experts get at most min(k, E / e) of its assignments; with a capacity, at most what they
        keep of ``rows`` sequences. The room: every source's block (dropless: the worst case, every source's rows
        for this shard); with ``expert_room`` and expert shards, ceil(expert_room x the shard's own tokens x k),
        what does not fit dropped (``expert_exchange.within_room``)."""
        local = self.num_experts // expert
        block = tokens * min(self.experts_per_token, local)
        if self.capacity:
            block = min(block, self.capacity * rows * local)
        room = expert * block
        if self.expert_room and expert > 1:
            room = min(room, math.ceil(self.expert_room * tokens * self.experts_per_token))
        return min(block, room), room

    def exchange_rows(self, rows: int, expert: int) -> int:
        """Rows of a destination's block when a shard of ``rows`` sequences sends its assignments to ``expert``
        shards (``exchange_sizes``' block)."""
        return self.exchange_sizes(rows * self.max_seq_len, rows, expert)[0]

    def receive_rows(self, rows: int, expert: int) -> int:
        """Rows an expert shard receives at most from its group's shards of ``rows`` sequences each
        (``exchange_sizes``' room)."""
        return self.exchange_sizes(rows * self.max_seq_len, rows, expert)[1]

    def check_mesh(self, tensor: int, pipe: int, expert: int) -> None:
        super().check_mesh(tensor, pipe, 1)
        if self.num_experts % expert:
            raise ValueError(f"model.num_experts={self.num_experts} is not divisible by mesh.expert={expert}: each "
                             f"expert shard holds whole experts; pick mesh.expert from the divisors of "
                             f"{self.num_experts}")
        if pipe > 1 and expert > 1:
            raise ValueError(f"mesh.expert={expert} with mesh.pipe={pipe}: inside pipeline stages a stage's rows are "
                             "split over data only, so each expert shard would gather the others' rows and run their "
                             "attention again (not yet laid out for it); set mesh.expert=1 (each model shard then "
                             "holds a slice of every expert) or mesh.pipe=1")
        if pipe > 1 and self.dense_among_routed:
            raise ValueError(f"mesh.pipe={pipe}: a mixture with dense layers among its routed ones "
                             "(model.decoder_sparse_step, model.mlp_only_layers) does not run in pipeline stages yet "
                             "(each run of one kind would be a pipeline of its own); set mesh.pipe=1")


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def summed_unchecked(y: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """``psum(y, axes)`` inside a ``shard_map`` run with ``check_vma=False``, whose transpose, a psum, would
    all-reduce the output's gradient once more: there jax hands each shard the replicated output's gradient divided
    by the shard count (its unchecked transpose), so each partial output's gradient is that times the count, and
    nothing moves (Megatron-LM's reduce-from-tensor-parallel region)."""
    return jax.lax.psum(y, axes)


def _summed_unchecked_fwd(y: jax.Array, axes: tuple[str, ...]) -> tuple[jax.Array, None]:
    return jax.lax.psum(y, axes), None


def _summed_unchecked_bwd(axes: tuple[str, ...], _: None, g: jax.Array) -> tuple[jax.Array]:
    return (g * math.prod(jax.lax.axis_size(a) for a in axes),)


summed_unchecked.defvjp(_summed_unchecked_fwd, _summed_unchecked_bwd)


def route(logits: jax.Array, k: int, renormalise: bool) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(probabilities (T, E), top-k weights (T, k), top-k experts (T, k)) from fp32 router logits (T, E)."""
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if renormalise:
        weights = weights / weights.sum(-1, keepdims=True)
    return probs, weights, experts


def within_capacity(experts: jax.Array, rows: int, num_experts: int, capacity: int) -> jax.Array:
    """(T, k) bool: which assignments their experts take, ``capacity`` per expert per sequence (``rows`` sequences
    of T / rows tokens each), in the order of the tokens and then their ranks; all where ``capacity`` is 0."""
    if not capacity:
        return jnp.ones(experts.shape, bool)
    chosen = jax.nn.one_hot(experts.reshape(rows, -1), num_experts, dtype=jnp.int32)  # (rows, S k, E)
    position = (jnp.cumsum(chosen, axis=1) * chosen).sum(-1) - 1  # each assignment's place in its expert's queue
    return (position < capacity).reshape(experts.shape)


class MixtureOfExperts(nnx.Module):
    """The routed MLP: (B, S, H) -> ((B, S, H), statistics). Experts' weights are stacked on a leading ``experts``
    axis: gate and up (E, H, F) split on ``mlp`` like a dense MLP's columns, down (E, F, H) on its rows."""

    def __init__(self, cfg: MoEConfig, *, rngs: nnx.Rngs):
        h, f, e = cfg.hidden_size, cfg.expert_ffn_size, cfg.num_experts
        self.cfg = cfg
        normal = nnx.initializers.normal(cfg.init_std)
        self.router = make_param(rngs, normal, (h, e), ("embed", None))
        self.gate, self.up = (make_param(rngs, normal, (e, h, f), ("experts", "embed", "mlp")) for _ in range(2))
        self.down = make_param(rngs, nnx.initializers.normal(scaled_init_std(cfg.init_std, cfg.num_layers)),
                               (e, f, h), ("experts", "mlp", "embed"))

    # the statistics ``__call__`` returns, each summed over the tokens (a routing of its own may add some)
    STATS = ("load", "probs", "z", "dropped")

    def local_params(self) -> tuple[tuple[jax.Array, tuple[str | None, ...]], ...]:
        """What the layer reads on each device beyond the router's and the experts' kernels (a routing's own
        parameters, shared experts), each with its logical names (none here)."""
        return ()

    def choose(self, logits: jax.Array, rows: int, *extra: jax.Array
               ) -> tuple[jax.Array, jax.Array, jax.Array, Stats]:
        """(probabilities (T, E), top-k weights (T, k), top-k experts (T, k), further statistics) from the fp32
        router logits (T, E) of ``rows`` sequences, given ``local_params``' values: the softmax's top k."""
        return (*route(logits, self.cfg.experts_per_token, self.cfg.norm_topk_prob), {})

    def beside(self, tokens: jax.Array, *extra: jax.Array) -> jax.Array | None:
        """What the layer adds to the routed experts' output for ``tokens`` (T, h), given ``local_params``' values,
        as this model shard's partial sum (reduced with the experts' in one all-reduce); None: nothing."""
        return None

    def __call__(self, x: jax.Array) -> tuple[jax.Array, Stats]:
        cfg = self.cfg
        names = ("batch", "seq", "embed")
        extra = self.local_params()
        params = (param_at_use(self.router[...], ("embed", None)),
                  *(param_at_use(p[...], ("experts", "embed", "mlp"), cfg.compute_dtype) for p in (self.gate, self.up)),
                  param_at_use(self.down[...], ("experts", "mlp", "embed"), cfg.compute_dtype),
                  *(param_at_use(v, n) for v, n in extra))
        reduce_over = entry_axes(axis_of("mlp"))  # the model shards' partial sums of the output
        expert_axis = axis_of("experts")  # where the experts are split (None: every shard holds them all)
        tokens_over = (*entry_axes(axis_of("batch")), *entry_axes(axis_of("seq")))  # where other tokens are
        # inside pipeline stages the layer runs under the stages' vmaps (spmd_axis_name 'pipe' and 'data'), whose
        # batched shard_map fails jax 0.10's varying-axes check (its message's workaround): unchecked there
        exchange, gemm = exchange_of(cfg.expert_exchange), gemm_of(cfg.expert_gemm)
        # and Pallas's interpret mode fails jax 0.10's check too (a dynamic slice of invarying and varying indices)
        checked = pipeline.stages() == 1 and gemm != "interpret"

        def local(x: jax.Array, router: jax.Array, gate: jax.Array, up: jax.Array,
                  down: jax.Array, *extra: jax.Array) -> tuple[jax.Array, Stats]:
            b, s, h = x.shape
            logits = x.reshape(-1, h).astype(jnp.float32) @ router  # (T, E)
            probs, weights, experts, more = self.choose(logits, b, *extra)
            kept = within_capacity(experts, b, cfg.num_experts, cfg.capacity)
            tokens = x.reshape(-1, h)
            if reduce_over:  # varying over the model shards from here: the backward pass sums the (T, h) gradient
                tokens = jax.lax.pcast(tokens, reduce_over, to="varying")  # once, not each of its k copies
            sizes = cfg.exchange_sizes(b * s, b, cfg.num_experts // gate.shape[0])  # (block, room)
            y, kept = experts_forward(tokens, experts, weights, kept, gate, up, down, cfg.num_experts, expert_axis,
                                      cfg.compute_dtype, *sizes, exchange, gemm, cfg.fp8)
            if (added := self.beside(tokens, *extra)) is not None:
                y = y + added
            if reduce_over:
                y = jax.lax.psum(y, reduce_over) if checked else summed_unchecked(y, reduce_over)
            load = jax.nn.one_hot(experts, cfg.num_experts, dtype=jnp.float32).sum((0, 1))  # (E,) assignments
            stats = {"load": load, "probs": probs.sum(0), "z": jnp.square(jax.nn.logsumexp(logits, -1)).sum(),
                     "dropped": (~kept).sum().astype(jnp.float32), **more}
            if tokens_over:
                stats = jax.lax.psum(stats, tokens_over)
            return y.reshape(b, s, h), stats

        x = constrain(x, names)
        if not reduce_over and not tokens_over and not expert_axis:  # outside a mesh, or a 1x1 one
            y, stats = local(x, *params)
        else:
            y, stats = on_shards(local, (x, *params), (names, ("embed", None), ("experts", "embed", "mlp"),
                                                       ("experts", "embed", "mlp"), ("experts", "mlp", "embed"),
                                                       *(n for _, n in extra)),
                                 (names, {k: () for k in self.STATS}), check_vma=checked)
        return constrain(y, names), stats


class QKNormAttention(Attention):
    """Qwen3's attention: each query and key head RMS-normalised (its own (D,) scale) before the rotation."""

    def __init__(self, cfg: MoEConfig, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        self.q_norm, self.k_norm = (RMSNorm(cfg.head_dim, eps=cfg.layernorm_eps, dtype=cfg.compute_dtype,
                                            rngs=rngs, names=("head_dim",)) for _ in range(2))

    def positioned(self, q: jax.Array, k: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        return super().positioned(self.q_norm(q), self.k_norm(k), positions)


class MoEBlock(LlamaBlock):
    """``x + attn(norm(x))`` then ``x + moe(norm(x))``; beside the cache it returns the layer's routing
    statistics."""

    mlp_class = MixtureOfExperts

    def __init__(self, cfg: MoEConfig, *, rngs: nnx.Rngs):
        self.attention_class = QKNormAttention if cfg.qk_norm else Attention
        super().__init__(cfg, rngs=rngs)

    def __call__(self, x, mask, key, cache=None, index=0):
        k_attn, k_res1, k_res2 = jax.random.split(key, 3) if key is not None else (None, None, None)
        attn, cache = self.attn(self.ln_1(x), mask, k_attn, cache, index)
        x = constrain(x + dropout(attn, self.rate, k_res1), RESIDUAL)
        y, stats = self.mlp(self.ln_2(x))
        x = x + dropout(y, self.rate, k_res2)
        return constrain(x, RESIDUAL), (cache, stats)


class DenseBlock(LlamaBlock):
    """A dense layer among the routed ones (Qwen3-MoE's ``mlp_only_layers`` / ``decoder_sparse_step``): the Llama
    block with the mixture's attention (its query / key norms) and a SwiGLU of ``ffn_hidden_size``."""

    def __init__(self, cfg: MoEConfig, *, rngs: nnx.Rngs):
        self.attention_class = QKNormAttention if cfg.qk_norm else Attention
        super().__init__(cfg, rngs=rngs)


DENSE_STACK = "dense_blocks"  # the dense layers' stack, where a mixture has any (in ``segments`` order)


def _stack_slice(stack: nnx.Module, start: int, stop: int) -> nnx.Module:
    """Layers ``start:stop`` of a stacked module."""
    graphdef, state = nnx.split(stack)
    return nnx.merge(graphdef, jax.tree.map(lambda a: a[start:stop], state))


class MoEDecoder(Llama):
    """A Llama decoder of ``MoEBlock``s (and ``DenseBlock``s where the config makes some layers dense, in a stack
    of their own): ``tokens (B, S) -> logits``; ``routed`` also returns the routing statistics, stacked over the
    routed layers, for the objective."""

    block_class = MoEBlock

    def _make_layers(self, cfg: MoEConfig, rngs: nnx.Rngs) -> None:
        self.blocks = make_blocks(cfg, rngs, MoEBlock, count=len(cfg.routed_layers))
        dense = cfg.num_layers - len(cfg.routed_layers)
        self.dense_blocks = make_blocks(cfg, rngs, DenseBlock, count=dense) if dense else None

    def _run_layers(self, x, mask, dropout_key, cache, index, stack=pipeline.run_stack):
        """All-routed: the one stack. Else each run of one kind (``MoEConfig.segments``) from its stack's slice in
        turn, each layer with its own dropout key and cache slice; the caches joined in layer order, the routing
        statistics stacked over the routed layers."""
        cfg = self.cfg
        if self.dense_blocks is None:
            return run_blocks(self.blocks, cfg, x, mask, dropout_key, cache, index, stack=stack)
        caches, stats = [], []
        for routed, layers, first in cfg.segments():
            layer_stack = _stack_slice(self.blocks if routed else self.dense_blocks, first, first + len(layers))
            part = None if cache is None else tuple(c[layers.start:layers.stop] for c in cache)
            x, out = run_blocks(layer_stack, cfg, x, mask, dropout_key, part, index, layers, stack=stack)
            if routed:
                out, layer_stats = out
                stats.append(layer_stats)
            caches.append(out)
        joined = None if cache is None else tuple(jnp.concatenate(c) for c in zip(*caches))
        return x, (joined, jax.tree.map(lambda *xs: jnp.concatenate(xs), *stats))

    def _forward(self, tokens, dropout_key, cache, index, documents=None, stack=pipeline.run_stack):
        logits, (cache, _) = self._logits(tokens, dropout_key, cache, index, documents, stack)
        return logits, cache

    def routed(self, tokens: jax.Array, dropout_key: jax.Array | None = None, segments: jax.Array | None = None,
               positions: jax.Array | None = None, stack: pipeline.StackRunner = pipeline.run_stack
               ) -> tuple[jax.Array, Stats]:
        """(logits (B, S, padded_vocab), each layer's routing statistics, (L, ...)); packed rows and ``stack`` as
        ``__call__``."""
        logits, (_, stats) = self._logits(tokens, dropout_key, None, 0, self._documents(segments, positions), stack)
        return logits, stats

    def router_terms(self, stats: Stats, shape: tuple[int, int], means: Means = OWN
                     ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(the weighted router losses added to the loss, the metrics), from the routing statistics of a batch of
        ``shape`` (sequences, positions): the balancing loss and the z-loss (``router_losses``)."""
        cfg = self.cfg
        metrics = router_losses(stats, math.prod(shape), cfg, means)
        return cfg.router_aux_loss_coef * metrics["balance_loss"] + cfg.router_z_loss_coef * metrics["z_loss"], \
            metrics


def router_losses(stats: Stats, tokens: int, cfg: MoEConfig, means: Means = OWN) -> dict[str, jax.Array]:
    """The load-balancing loss (transformers' ``load_balancing_loss_func``: E x sum_e f_e P_e over every layer's
    ``tokens`` together), the router z-loss (mean over tokens and layers), the expert load (max over mean
    assignments per expert, averaged over layers) and the fraction of assignments dropped, from the per-layer
    statistics (L, ...) of ``MixtureOfExperts`` over ``tokens``. Each is weighted by ``means.share(tokens)``: 1 on
    the whole batch; on a part of it (the 1F1B schedule's microbatches) the part's share, so the parts' terms sum to
    the batch's where a term is a mean over tokens (the z-loss, the dropped fraction), and to the mean of the parts'
    balancing losses (each microbatch's f_e and P_e its own, as Megatron-LM's)."""
    load = jax.lax.stop_gradient(stats["load"])  # counts: no derivative (under 1F1B none travels back)
    layers = load.shape[0]
    fraction = load.sum(0) / (layers * tokens)  # (E,): assignments per token, summed over the k ranks
    mean_prob = stats["probs"].sum(0) / (layers * tokens)
    share = means.share(tokens)
    return {"balance_loss": share * cfg.num_experts * (fraction * mean_prob).sum(),
            "z_loss": share * stats["z"].sum() / (layers * tokens),
            "expert_load": share * (load.max(-1) / jnp.maximum(load.mean(-1), 1e-9)).mean(),
            "dropped_fraction": share * stats["dropped"].sum() / (layers * tokens * cfg.experts_per_token)}


def _moe_lm(model: MoEDecoder, batch: objectives.Batch, key: jax.Array | None, means: Means = OWN,
            stack: pipeline.StackRunner = pipeline.run_stack):
    """Next-token cross-entropy plus the weighted router losses; each part logged (``lm_loss`` is what the
    perplexity is of)."""
    rows = objectives.next_tokens(batch)
    with positions_of(rows.pop("order", None)):  # context parallelism's order keys dropout by true position
        logits, stats = model.routed(rows["inputs"], dropout_key=key, stack=stack, **objectives.documents(rows))
    losses = vocab_parallel_cross_entropy(logits, rows["targets"])
    weights = rows.get("loss_weights")  # packed rows: a mean weighted as LM's
    lm = means.mean(losses, weights)
    router_loss, metrics = model.router_terms(stats, rows["inputs"].shape, means)
    return lm + router_loss, {"lm_loss": lm, **metrics}


MOE_LM = objectives.Objective(_moe_lm, objectives.LM.fields, objectives.LM.packed_fields)


def flops(cfg: MoEConfig, rows: int, seq: int) -> float:
    """Model FLOPs of a step over the active parameters: 3 (forward + backward) x 2 per multiply-add of the query and
    output projections (h x heads d each), the key/value projections (h x 2 kv_heads d), in a routed layer the
    router (h x E) and the k routed experts' three h x F GEMMs, in a dense one its SwiGLU's three h x ffn GEMMs, the
    attention scores and context (2 s heads d each) and the output layer."""
    h, width = cfg.hidden_size, cfg.num_heads * cfg.head_dim
    attention = 2 * h * (2 * width + 2 * cfg.kv_heads * cfg.head_dim) + 4 * seq * width
    routed = 2 * h * (cfg.num_experts + 3 * cfg.experts_per_token * cfg.expert_ffn_size)
    dense = 2 * h * 3 * cfg.ffn_size
    sparse = len(cfg.routed_layers)
    layers = cfg.num_layers * attention + sparse * routed + (cfg.num_layers - sparse) * dense
    return 3.0 * rows * seq * (layers + 2 * h * cfg.padded_vocab_size)


def layer_residual_bytes(cfg: MoEConfig, rows: int, tp: int, split: int, remat: str, cd: int,
                         attention: str = "xla", expert: int = 1, exchange: str = "blocks") -> int:
    """Bytes one layer keeps for its backward pass on one device (``expert`` expert shards): the Llama layer's
    (``llama.layer_residual_bytes``) without its SwiGLU, plus the routed MLP's, as the traced jaxpr keeps them on
    one device (tests/test_memory_planner.py). Under every policy the layer's routing statistics (8 E + 8 bytes).
    ``none`` and ``selective`` also keep the router's fp32 input in place of the MLP's compute-dtype one; per token
    the router's fp32 logits and probabilities (8 E bytes), its statistics and top-k (25 + 8 k + cd k bytes); per
    assignment (n = tokens x k; a destination's block of the exchange is m = ``exchange_rows`` rows, a shard
    receives R = ``receive_rows``, e m unless ``expert_room`` bounds it) the dispatch buffer (one block of m x h per
    destination shard and one for the dropped), the rows each shard receives and groups (R x h), the grouped outputs
    scattered back (R x h), the outputs gathered and combined (2 n x h), their three masks (n x h bytes), eight int32
    indices (n), the three expert GEMMs' and the SwiGLU's six (R, F / tp) tensors and the group sizes (4 E); in
    16-bit the compute-dtype copies of the shard's experts.
    ``full`` keeps the layer's input, as Llama's; ``save_dots`` Llama's attention GEMMs'
    outputs and the router's logits (the grouped GEMMs are not dots). The expert shards' terms (e > 1) follow the
    code; the compiled step checks them (within 10%), not the jaxpr. The dense layers among the routed ones are
    Llama's (``llama.LAYER``), on their own stack (``stacks``)."""
    trunk = llama.layer_residual_bytes(cfg, rows, tp, split, remat, cd, attention)
    s, f = cfg.max_seq_len, cfg.ffn_size
    if remat == "full":
        return trunk + routed_mlp_bytes(cfg, rows, tp, remat, cd, expert, exchange)
    if remat == "save_dots":  # less Llama's fused gate / up GEMM output
        return trunk - 2 * s * rows * f // tp * cd + routed_mlp_bytes(cfg, rows, tp, remat, cd, expert, exchange)
    swiglu = 6 * s * rows * f * cd // tp + (f * cfg.hidden_size * cd // tp if cd < 4 else 0)
    return trunk - swiglu + routed_mlp_bytes(cfg, rows, tp, remat, cd, expert, exchange)


def routed_mlp_bytes(cfg: MoEConfig, rows: int, tp: int, remat: str, cd: int, expert: int = 1,
                     exchange: str = "blocks") -> int:
    """What the routed MLP alone keeps (``layer_residual_bytes``' routed terms, its statistics included)."""
    stats = 8 * cfg.num_experts + 8
    s, h = cfg.max_seq_len, cfg.hidden_size
    if remat == "full":
        return stats
    if remat == "save_dots":  # the router's logits (the grouped GEMMs are not dots)
        return rows * s * cfg.num_experts * 4 + stats
    tokens, k, e = rows * s, cfg.experts_per_token, expert
    n, width, local = tokens * k, cfg.expert_ffn_size // tp, cfg.num_experts // expert
    block, room = cfg.exchange_rows(rows, expert), cfg.receive_rows(rows, expert)
    return (tokens * h * (4 - cd) + tokens * (25 + 8 * k + cd * k + 8 * cfg.num_experts)
            + ((e + 1) * block if exchange == "blocks" else room) * h * cd + 2 * room * h * cd + 2 * n * h * cd
            + 3 * n * h + 32 * n + 6 * room * width * cd + 4 * cfg.num_experts
            + (3 * local * h * width * cd if cd < 4 else 0)) + stats


def active_parameters(cfg: MoEConfig, total: int) -> int:
    """Of ``total`` parameters, those one token uses: all but the experts it is not routed to in each routed
    layer."""
    return total - len(cfg.routed_layers) * skipped_expert_parameters(cfg)


def skipped_expert_parameters(cfg: MoEConfig) -> int:
    """The parameters of the experts one routed layer does not send a token to (three h x F kernels each)."""
    return (cfg.num_experts - cfg.experts_per_token) * 3 * cfg.hidden_size * cfg.expert_ffn_size


def reference_moe(x: np.ndarray, router: np.ndarray, gate: np.ndarray, up: np.ndarray, down: np.ndarray, k: int,
                  renormalise: bool, capacity: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The layer in float64 numpy, token by token (tests): (output (B, S, H), kept (B, S, k))."""
    x = x.astype(np.float64)
    b, s, h = x.shape
    out, kept = np.zeros_like(x), np.zeros((b, s, k), bool)
    for r in range(b):
        queue = np.zeros(gate.shape[0], int)
        for t in range(s):
            logits = x[r, t] @ router
            probs = np.exp(logits - logits.max())
            probs /= probs.sum()
            top = np.argsort(-probs, kind="stable")[:k]
            weights = probs[top] / (probs[top].sum() if renormalise else 1.0)
            for j, (e, w) in enumerate(zip(top, weights)):
                queue[e] += 1
                if capacity and queue[e] > capacity:
                    continue
                kept[r, t, j] = True
                a = x[r, t] @ gate[e]
                out[r, t] += w * ((a / (1 + np.exp(-a))) * (x[r, t] @ up[e])) @ down[e]
    return out, kept


# MoEBlock: Llama's attention, the routed MLP (its all-reduces are the dense MLP's). Its dispatch (``experts_forward``)
# has static shapes, each shard's send and receive buffers a block of m rows per shard of its group
# (``exchange_rows``); counted unfused, forward: 7 passes of e m x h (the send buffer written, the received rows
# grouped, the grouped outputs' padding and their scatter back), 9 of n x h (the tokens gathered into it and the
# outputs gathered, ordered and weighted back) and 2.5 of e m x 2F/t (the gate and up outputs' padding, the SwiGLU
# product)
ROUTED = LayerKind("routed", residuals=layer_residual_bytes, experts=lambda cfg: (cfg.num_experts,
                   cfg.experts_per_token), exchange_rows=lambda cfg, rows, expert: cfg.exchange_rows(rows, expert),
                   receive_rows=lambda cfg, rows, expert: cfg.receive_rows(rows, expert),
                   dispatch_passes=(7, 9, 2.5))


def stacks(cfg: MoEConfig) -> tuple[Stack, ...]:
    """The routed layers on ``blocks``, the dense ones (Qwen3-MoE's, where any) on ``DENSE_STACK`` (Llama's
    layers with the family's attention)."""
    dense = cfg.num_layers - len(cfg.routed_layers)
    routed = (Stack(STACK, ROUTED, len(cfg.routed_layers)),)
    return routed + ((Stack(DENSE_STACK, llama.LAYER, dense),) if dense else ())


register(decoder_spec(NAME, MoEConfig, MoEDecoder, flops, objective=MOE_LM, perplexity_of="lm_loss",
                      stacks=stacks, active_parameters=active_parameters))
