"""Pipeline parallelism (GPipe) over the mesh's ``pipe`` axis, in SPMD: every stage runs the same program.

The stacked layers (their leading ``layers`` dimension, split over ``pipe`` by the rule ``('layers', 'pipe')``)
form ``p`` stages of ``L/p`` contiguous layers. A batch is cut into ``M`` microbatches. On tick ``t`` of
``T = M + p - 1`` (a ``lax.scan``) stage ``s`` runs its layers on microbatch ``t - s`` (idle where that is outside
``0 .. M-1``: the bubble, ``(p-1)/(M+p-1)`` of the stage-ticks); then every stage's output moves one stage on with one
collective permute over ``pipe`` (``ppermute`` in ``shard_map``; the wrap-around pair carries a finished microbatch
back to stage 0, which keeps the finished ones). Autodiff of the loop is the backward pipeline: the permutes'
transposes run the ring the other way. The stage function is vmapped over the stages with
``spmd_axis_name='pipe'``, so its own layout constraints (tensor parallelism over ``model``, the batch over
``data``) hold inside every stage.

This is the schedule of MaxText's and praxis's pipeline layers (Huang et al. 2019, GPipe), written here for
megajax's layer stack; docs/pipeline-plan.md has the design, what is measured and what is left (the circular
schedule, sequence parallelism and FSDP under a pipeline).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from megajax.parallel.sharding import PIPE_AXIS, pipeline_microbatches


def stages() -> int:
    """Pipeline stages of the mesh being traced under (its ``pipe`` axis; 1 without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty or PIPE_AXIS not in mesh.axis_names else mesh.shape[PIPE_AXIS]


def microbatches(rows: int, replicas: int) -> int:
    """How many microbatches a batch of ``rows`` (split over ``replicas`` data shards, ``sharding.replicas``) is cut
    into: ``activate``'s ``pipeline_microbatches`` (0: one per stage), or the largest smaller count that divides
    each shard's rows evenly."""
    return microbatches_for(rows // replicas, pipeline_microbatches() or stages())


def microbatches_for(rows_per_replica: int, wanted: int) -> int:
    """The largest count up to ``wanted`` that cuts each data shard's ``rows_per_replica`` evenly."""
    return next(m for m in range(min(wanted, rows_per_replica), 0, -1) if rows_per_replica % m == 0)


def ticks(num_micro: int, num_stages: int) -> int:
    """The schedule's length: every microbatch through every stage."""
    return num_micro + num_stages - 1


def bubble_fraction(num_micro: int, num_stages: int) -> float:
    """The idle share of the stage-ticks: (p - 1) / (M + p - 1)."""
    return (num_stages - 1) / ticks(num_micro, num_stages)


def _ring_shift(x: jax.Array, num_stages: int) -> jax.Array:
    """``x`` (stages, ...) moved one stage on: stage s's row to stage s + 1, the last stage's to stage 0."""
    ring = [(s, (s + 1) % num_stages) for s in range(num_stages)]
    shift = jax.shard_map(lambda a: jax.lax.ppermute(a, PIPE_AXIS, ring), in_specs=P(PIPE_AXIS),
                          out_specs=P(PIPE_AXIS), axis_names={PIPE_AXIS})
    return shift(x)


def gpipe(stage_fn: Callable[[Any, jax.Array, Any], jax.Array], stage_params: Any, xs: jax.Array,
          per_micro: Any, x_spec: P) -> jax.Array:
    """Runs ``xs`` (M, mb, ...) through ``p`` stages in order and returns the outputs (M, mb, ...), held by stage 0.

    ``stage_fn(params, x, args)``: one stage on one microbatch ``x`` (mb, ...); ``stage_params``: a pytree whose
    leaves lead with the stage axis (p, ...), split over ``pipe``; ``per_micro``: a pytree whose leaves lead with
    the microbatch axis (M, ...) (e.g. a padding mask), given to the stage with its microbatch's row, or None;
    ``x_spec``: the layout of one microbatch (mb, ...).
    """
    p, num_micro = stages(), xs.shape[0]
    stage = jax.lax.with_sharding_constraint(jnp.arange(p), P(PIPE_AXIS))
    on_stages = P(PIPE_AXIS, *x_spec)
    # Stage 0's row holds the inputs, and the finished microbatches as they come back round; the other stages' rows
    # feed only their bubble ticks (each device keeps only its own row: the same bytes as the inputs).
    held = jnp.zeros((p, *xs.shape), xs.dtype).at[0].set(xs)
    held = jax.lax.with_sharding_constraint(held, P(PIPE_AXIS, None, *x_spec))
    first = (stage == 0).reshape(p, *(1,) * (xs.ndim - 1))

    def tick(carry, t):
        current, held = carry
        fresh = held[:, t % num_micro]  # stage 0: microbatch t (read before it can be overwritten, at t + p - 1)
        x = jax.lax.with_sharding_constraint(jnp.where(first, fresh, current), on_stages)
        rows = jnp.clip(t - stage, 0, num_micro - 1)
        args = jax.tree.map(lambda a: a[rows], per_micro)
        y = jax.vmap(stage_fn, spmd_axis_name=PIPE_AXIS)(stage_params, x, args)
        moved = jax.lax.with_sharding_constraint(_ring_shift(y, p), on_stages)
        done = t - (p - 1)  # the microbatch the last stage finished, now arrived at stage 0
        slot = done % num_micro
        kept = jnp.where(first & (done >= 0), moved, held[:, slot])
        return (moved, held.at[:, slot].set(kept)), None

    start = jax.lax.with_sharding_constraint(jnp.zeros((p, *xs.shape[1:]), xs.dtype), on_stages)
    (_, held), _ = jax.lax.scan(tick, (start, held), jnp.arange(ticks(num_micro, p)))
    return held[0]
