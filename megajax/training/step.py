"""The training state and the pure, jitted training step, for any objective.

One step: split the global batch into micro-batches (gradient accumulation by a ``fori_loop``; each data replica's
gradients kept apart through it and reduced once, ``training.replicas``), forward + backward each (dropout keyed by
the step and each row's index in the global batch: ``sharding.rows_of``, so the masks do not depend on the split),
unscale (fp16), clip + AdamW, and skip the update when the loss or the gradient norm is not finite. Shardings come
from the caller's jit: parameters over ``model``, the batch over ``data``; XLA inserts Megatron's all-reduces and
the data-parallel gradient reduction.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct

from megajax.models.objectives import Batch, Field, Metrics, Objective
from megajax.parallel.pipeline import GPIPE, ONE_F_ONE_B
from megajax.parallel.sharding import constrain, rows_of, rules_remapped
from megajax.parallel.xla_options import traced_for_nvidia_gpu
from megajax.training import pipelined, replicas
from megajax.training.loss_scale import LossScale
from megajax.training.optimizer import applied_updates

Params = dict[str, Any]


@struct.dataclass
class TrainState:
    step: jax.Array  # i32 scalar: completed steps
    params: Params  # fp32 master parameters, a nested dict matching the model
    opt_state: optax.OptState
    loss_scale: LossScale
    rng: jax.Array  # uint32 key data of the base dropout key; the step is folded in (and each row, by dropout)


def split_micro(batch: Batch, fields: dict[str, Field], num_micro: int) -> Batch:
    """Each (B, ...) field -> (num_micro, B / num_micro, ...), every micro-batch spread over all data shards."""
    def split(x: jax.Array, field: Field) -> jax.Array:
        x = x.reshape(x.shape[0] // num_micro, num_micro, *x.shape[1:])  # row j*num_micro + i -> micro-batch i
        return constrain(jnp.swapaxes(x, 0, 1), (None, *field.names))

    return {k: split(v, fields[k]) for k, v in batch.items()}


def _counted(n: jax.Array) -> jax.Array:
    return jnp.maximum(n.astype(jnp.float32), 1.0)  # as the objective's mean


def make_train_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation, schedule: optax.Schedule,
                    objective: Objective, fields: dict[str, Field], *, num_micro: int, dropout: bool,
                    pipeline_schedule: str = GPIPE) -> Callable[[TrainState, Batch], tuple[TrainState, Metrics]]:
    """Builds ``step(state, batch) -> (state, metrics)``; jit it with shardings and donation. Under
    ``pipeline_schedule`` 1f1b (``parallel.pipeline``) each micro-batch's gradients come from that schedule
    (``training.pipelined``), the loss computed per pipeline microbatch inside it; otherwise from ``jax.grad``.

    A step whose loss or gradient norm is inf/nan applies no update (``metrics['skipped']``); ``nonfinite`` marks
    the skipped steps that are not routine fp16 overflows.
    """

    held = objective.update.sums if objective.update else ()  # sums the state update reads: added, not weighed

    def weigher(scale: LossScale, share: jax.Array):
        def weigh(loss, metrics):
            loss, metrics = loss * share, {k: m if k in held else m * share for k, m in metrics.items()}
            return scale.scale_loss(loss), (loss, metrics)
        return weigh

    def micro_grads(params: Params, micro: Batch, key: jax.Array | None, scale: LossScale, share: jax.Array):
        weigh = weigher(scale, share)
        if pipeline_schedule == ONE_F_ONE_B:  # the loss per microbatch, inside the schedule
            return pipelined.grads(objective, graphdef, params, micro, key, weigh)
        return jax.grad(lambda p: weigh(*objective.loss(nnx.merge(graphdef, p), micro, key)), has_aux=True)(params)

    def share(rows: Batch, total: jax.Array | None, pieces: int) -> jax.Array:
        """The weight in the step's mean of ``rows``, one of ``pieces`` equal parts of a micro-batch: equal, or
        their share of what the objective's mean counts (``Objective.counted``: packed rows' targets, preference
        pairs; ``total``, the global batch's; x num_micro), so the step's loss is the global batch's mean whatever
        the split (1 exactly without accumulation)."""
        own = objective.counted(rows)
        if own is None:
            return jnp.float32(1 / pieces)
        return _counted(own) / _counted(total) * num_micro

    def replica_grads(own: Params, micro: Batch, ids: jax.Array, key: jax.Array | None, scale: LossScale,
                      total: jax.Array | None, d: int):
        """Each data replica's gradients (d, ...) with respect to its copy ``own`` of the parameters
        (``training.replicas``), each replica's loss weighed by its share; the loss and metrics summed over them."""
        inner = replicas.inner_batch_axes()

        def one(own_params, rows, row_ids):
            weigh = weigher(scale, share(rows, total, d))
            with rules_remapped(batch=inner), rows_of(row_ids):
                return jax.grad(lambda p: weigh(*objective.loss(nnx.merge(graphdef, p), rows, key)),
                                has_aux=True)(own_params)

        grads, aux = jax.vmap(one, spmd_axis_name=replicas.DATA_AXIS)(
            own, jax.tree.map(lambda x: replicas.by_replica(x, d), micro), replicas.by_replica(ids, d))
        return grads, jax.tree.map(lambda a: a.sum(0), aux)

    def step(state: TrainState, batch: Batch) -> tuple[TrainState, Metrics]:
        step_key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
        micro_batches = split_micro(batch, fields, num_micro)
        d = replicas.replica_count(num_micro)  # > 1: each data replica's gradients kept apart through the loop
        specs = replicas.layouts(graphdef, state.params) if d > 1 else None
        total = objective.counted(batch)

        def accumulate(i, carry):
            grads_sum, metrics_sum = carry
            micro = jax.tree.map(lambda x: jax.lax.dynamic_index_in_dim(x, i, keepdims=False), micro_batches)
            rows = jax.tree.leaves(micro)[0].shape[0]
            ids = jnp.arange(rows) * num_micro + i  # split_micro's rows of the global batch
            key = step_key if dropout else None
            if d > 1:
                grads, (loss, metrics) = replica_grads(replicas.copies(state.params, specs, d), micro, ids, key,
                                                       state.loss_scale, total, d)
            else:
                with rows_of(ids):
                    grads, (loss, metrics) = micro_grads(state.params, micro, key, state.loss_scale,
                                                         share(micro, total, 1))
            metrics = {"loss": loss, **metrics}
            return jax.tree.map(jnp.add, grads_sum, grads), jax.tree.map(jnp.add, metrics_sum, metrics)

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        zeros = zeros if d == 1 else replicas.copies(zeros, specs, d)  # each replica's accumulator
        metric_zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), jax.eval_shape(
            lambda: {"loss": jnp.float32(0), **objective.loss(nnx.merge(graphdef, state.params),
                                                              jax.tree.map(lambda x: x[0], micro_batches),
                                                              None)[1]}))
        # The accumulation loop's bound hidden from XLA (a barrier): XLA:GPU then neither double-buffers it nor peels
        # a micro-batch off it to pipeline collectives, each of which gave a second micro-batch's saved activations
        # their own buffer beside the first's (compiled for 8 H100s: llama3_8b's plan 63.5 -> 59.5 GiB, gpt_2p5b's
        # fp8 plan 34.4 -> 26.9); the layer loops inside keep both. The price: the host reads the loop's
        # condition once per micro-batch. hlo_audit reads the trip count from the bound the loop carries.
        bound = num_micro if num_micro == 1 else jax.lax.optimization_barrier(jnp.int32(num_micro))
        grads, metrics = jax.lax.fori_loop(0, bound, accumulate, (zeros, metric_zeros))
        if d > 1:  # the replicas' gradients summed: the step's one reduction over `data`
            grads = jax.tree.map(lambda g: g.sum(0), grads)
        grads = state.loss_scale.unscale(jax.tree.map(lambda g: g / num_micro, grads))
        sums = {k: metrics.pop(k) for k in held}
        metrics = jax.tree.map(lambda m: m / num_micro, metrics)
        grad_norm = optax.tree.norm(grads)  # non-finite iff some gradient element is
        finite = jnp.isfinite(grad_norm) & jnp.isfinite(metrics["loss"])

        def apply(params, opt_state):
            updates, opt_state = optimizer.update(grads, opt_state, params, grad_norm=grad_norm)
            params = optax.apply_updates(params, updates)
            if objective.update:  # what the model moves outside the gradient, from the step's sums
                model = nnx.merge(graphdef, params)
                objective.update.apply(model, sums)
                params = nnx.to_pure_dict(nnx.state(model))
            return params, opt_state

        # Skip a bad update the way the platform's XLA updates the donated parameters and moments in place. On an
        # NVIDIA GPU, where(finite, new, old): under cond it wrote the new ones to temporaries and copied them back
        # (12 bytes of temp per parameter; gpt_8p3b's 4-layer step on 1x8 H100s: 1.18 -> 0.41 GiB). Elsewhere cond:
        # on the CPU, where made XLA copy every moment each step (8 bytes per parameter).
        if traced_for_nvidia_gpu():
            new = apply(state.params, state.opt_state)
            old = (state.params, state.opt_state)
            params, opt_state = jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
        else:
            params, opt_state = jax.lax.cond(finite, apply, lambda p, o: (p, o), state.params, state.opt_state)
        new_state = state.replace(step=state.step + 1, params=params, opt_state=opt_state,
                                  loss_scale=state.loss_scale.adjust(finite))
        scale = state.loss_scale
        # fp16 overflows are routine (the scale backs off); only at the smallest scale do they mean divergence.
        diverged = ~finite & (scale.scale <= scale.min_scale) if scale.dynamic else ~finite
        metrics.update(lr=schedule(applied_updates(state.opt_state)), grad_norm=grad_norm, loss_scale=scale.scale,
                       skipped=(~finite).astype(jnp.int32), nonfinite=diverged.astype(jnp.int32))
        return new_state, metrics

    return step
