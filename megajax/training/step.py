"""The training state and the pure, jitted training step.

One step: split the global batch into micro-batches (gradient accumulation by ``lax.scan``), forward + backward
each with its own dropout key, unscale and check the gradients (fp16), clip + AdamW, and skip the update when a
gradient overflowed. Shardings come from the caller's jit: parameters over ``model``, the batch over ``data``; XLA
inserts Megatron's all-reduces and the data-parallel gradient reduction.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from megajax.losses import lm_loss
from megajax.sharding import constrain
from megajax.training.loss_scale import LossScale, all_finite
from megajax.training.optimizer import applied_updates

Params = dict[str, Any]


@struct.dataclass
class TrainState:
    step: jax.Array  # i32 scalar: completed steps
    params: Params  # fp32 master parameters, a nested dict matching the model
    opt_state: optax.OptState
    loss_scale: LossScale
    rng: jax.Array  # uint32 key data of the base dropout key; step and micro-batch are folded in


def _split_micro(batch: jax.Array, num_micro: int) -> jax.Array:
    """(B, T) -> (num_micro, B / num_micro, T) with every micro-batch spread over all data shards."""
    b, t = batch.shape
    x = batch.reshape(b // num_micro, num_micro, t)  # row j*num_micro + i goes to micro-batch i
    return constrain(jnp.swapaxes(x, 0, 1), (None, "batch", None))


def make_eval_step(graphdef: nnx.GraphDef) -> Callable[[Params, jax.Array], jax.Array]:
    """Builds ``eval_step(params, batch (B, S + 1)) -> mean next-token loss`` (no dropout, no gradients)."""

    def eval_step(params: Params, batch: jax.Array) -> jax.Array:
        return lm_loss(nnx.merge(graphdef, params), batch[:, :-1], batch[:, 1:])

    return eval_step


def make_train_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation, schedule: optax.Schedule,
                    *, num_micro: int, dropout: bool
                    ) -> Callable[[TrainState, jax.Array], tuple[TrainState, dict[str, jax.Array]]]:
    """Builds ``step(state, batch (B, S + 1) int32) -> (state, metrics)``; jit it with shardings and donation."""

    def micro_grads(params: Params, micro: jax.Array, key: jax.Array | None, scale: LossScale):
        def loss_fn(p):
            loss = lm_loss(nnx.merge(graphdef, p), micro[:, :-1], micro[:, 1:], dropout_key=key)
            return scale.scale_loss(loss), loss

        grads, loss = jax.grad(loss_fn, has_aux=True)(params)
        return grads, loss

    def step(state: TrainState, batch: jax.Array) -> tuple[TrainState, dict[str, jax.Array]]:
        step_key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        micro_batches = _split_micro(batch, num_micro)

        def accumulate(carry, xs):
            grads_sum, loss_sum = carry
            micro, i = xs
            key = jax.random.fold_in(step_key, i) if dropout else None
            grads, loss = micro_grads(state.params, micro, key, state.loss_scale)
            return (jax.tree.map(jnp.add, grads_sum, grads), loss_sum + loss), None

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        (grads, loss), _ = jax.lax.scan(accumulate, (zeros, jnp.float32(0.0)),
                                        (micro_batches, jnp.arange(num_micro)))
        grads = state.loss_scale.unscale(jax.tree.map(lambda g: g / num_micro, grads))
        loss = loss / num_micro
        finite = all_finite(grads)
        grad_norm = optax.tree.norm(grads)

        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        if state.loss_scale.dynamic:  # skip the update on overflow
            keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
            params, opt_state = keep(params, state.params), keep(opt_state, state.opt_state)
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                                  loss_scale=state.loss_scale.adjust(finite))
        metrics = {"loss": loss, "lr": schedule(applied_updates(state.opt_state)), "grad_norm": grad_norm, "loss_scale": state.loss_scale.scale,
                   "skipped": (~finite).astype(jnp.int32)}
        return new_state, metrics

    return step
