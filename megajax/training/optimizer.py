"""AdamW with decoupled weight decay on matrices only, global-norm clipping, warmup + decay schedules.

Paper Section 4.2: Adam with weight decay 0.01, global gradient-norm clipping at 1.0; GPT learning rate 1.5e-4
with 3k warmup iterations then single-cycle cosine decay to 1e-5; BERT warmup then linear decay.
"""

from __future__ import annotations

from typing import Any

import jax
import optax

from megajax.config import OptimizerSettings

Params = dict[str, Any]

NO_DECAY_LEAVES = ("bias", "scale")  # biases (any leaf named *bias, e.g. BERT's mlm_bias) and LayerNorm scales


def learning_rate_schedule(opt: OptimizerSettings, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to ``opt.lr`` over ``opt.warmup_steps``, then cosine or linear decay to ``opt.min_lr``
    over ``opt.decay_steps`` (default: the rest of training), flat at ``min_lr`` afterwards."""
    warmup = int(opt.warmup_steps)
    decay = int(opt.decay_steps) if opt.decay_steps else max(total_steps - warmup, 1)
    if opt.decay == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, opt.lr, warmup, warmup + decay, opt.min_lr)
    if opt.decay == "linear":
        return optax.join_schedules(
            [optax.linear_schedule(0.0, opt.lr, warmup), optax.linear_schedule(opt.lr, opt.min_lr, decay)], [warmup])
    raise ValueError(f"optimizer.decay={opt.decay!r}; choose 'cosine' or 'linear'")


def weight_decay_mask(params: Params) -> Params:
    """True for weight matrices and embeddings; False for biases and LayerNorm parameters."""
    return jax.tree_util.tree_map_with_path(lambda path, _: not path[-1].key.endswith(NO_DECAY_LEAVES), params)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """``optax.clip_by_global_norm`` that takes the norm as ``update(..., grad_norm=...)`` when the caller has it:
    the training step computes it once for the log and the skip test, and a second computation here would
    reduce every sharded gradient's sum of squares over ``model`` again (XLA does not merge the two). Its state is
    the same empty state as optax's, so checkpoints keep their layout."""

    def update(updates, state, params=None, *, grad_norm: jax.Array | None = None, **extra_args):
        del params, extra_args
        norm = optax.tree.norm(updates) if grad_norm is None else grad_norm
        keep = norm < max_norm  # exactly optax's expression (a NaN norm clips, to NaN)
        return jax.tree.map(lambda g: jax.lax.select(keep, g, (g / norm.astype(g.dtype)) * max_norm), updates), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update)


def make_optimizer(opt: OptimizerSettings, total_steps: int) -> optax.GradientTransformationExtraArgs:
    """Clip by global norm, then AdamW. Gradients must already be unscaled (fp16) when they reach it; pass their
    norm as ``update(grads, state, params, grad_norm=norm)`` if it is already computed."""
    return optax.chain(
        clip_by_global_norm(opt.clip_norm),
        optax.adamw(learning_rate_schedule(opt, total_steps), b1=opt.b1, b2=opt.b2, eps=opt.eps,
                    weight_decay=opt.weight_decay, mask=weight_decay_mask),
    )


def applied_updates(opt_state: optax.OptState) -> jax.Array:
    """How many updates the optimizer has applied (skipped fp16 steps excluded): the schedule's step."""
    counts = [x for path, x in optax.tree_utils.tree_get_all_with_path(opt_state, "count")
              if path[-1].tuple_name == "ScaleByScheduleState"]
    return counts[0]
