"""Pipeline parallelism over the mesh's ``pipe`` axis, in SPMD: every stage runs the same program.

The stacked layers (their leading ``layers`` dimension, split over ``pipe`` by the rule ``('layers', 'pipe')``)
form ``p`` stages. A batch is cut into ``M`` microbatches. Each tick of a ``lax.scan``, every stage runs its layers
on the microbatch it holds; then every stage's output moves one stage on with one collective permute over ``pipe``
(``ppermute`` in ``shard_map``; the wrap-around pair carries a microbatch from the last stage back to stage 0).
Autodiff of the loop is the backward pipeline: the permutes' transposes run the ring the other way. The stage
function is vmapped over the stages with ``spmd_axis_name='pipe'``, so its own layout constraints (tensor
parallelism over ``model``, the batch over ``data``) hold inside every stage.

Two schedules, by ``repeats`` = v (``parallel.pipeline_repeats``):

* GPipe (v = 1; Huang et al. 2019): stage ``s`` holds ``L/p`` contiguous layers and runs microbatch ``t - s`` on
  tick ``t`` of ``M + p - 1``: the bubble is ``p - 1`` idle ticks of ``L/p`` layers.
* Circular (v > 1; Megatron's interleaved schedule in its effect on the bubble, Narayanan et al. 2021; MaxText's
  circular pipeline): stage ``s`` holds v chunks of ``L/(p v)`` layers, chunks ``s, s + p, .., s + (v-1) p`` of the
  model's ``p v``, and each microbatch goes round the ring v times. Stage ``s`` runs item ``k = t - s`` on tick ``t``:
  microbatch ``k mod P`` through its chunk ``k div P``, where ``P = max(M, p)`` (slots ``M .. P-1`` idle: a
  microbatch cannot start its next round before it has finished this one). ``(v-1) P + M + p - 1`` ticks of
  ``L/(p v)`` layers: with ``M >= p`` the same ``p - 1`` idle ticks, each v times shorter.

Every stage computes on every tick (one program); on its idle ticks it computes on zeros, and what it computes is
thrown away.

The circular schedule needs each stage's chunks on its devices, so a pipelined run keeps its stacked layers in
``layer_order``'s order (a permutation, applied when the state is created and when a checkpoint of another layout
is read; checkpoints record their layout in their config).

``run_stack`` runs a model's layer stack through the schedule (``run``) with what the stages need around it: FSDP's
gather once per step, one copy of each stage's layers per data replica, the dropout keys in the stack's order, the
microbatches and each stage's narrowed ``ParallelContext``; the model passes only its own scan of the layers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from megajax.parallel.remat import pipeline_chunk
from megajax.parallel.sharding import (
    PIPE_AXIS,
    RESIDUAL,
    batch_rows,
    constrain,
    parallel_context,
    param_at_use,
    params_split,
    params_whole,
    replicas,
    rows_of,
    rules_remapped,
    spec_of,
)

# A model's scan of its stacked layers, ``scan_layers(blocks, h, mask, layer_keys, remat_layers) -> h``: ``blocks``
# (a stack of layers), ``h`` (B, S, H), ``layer_keys`` one dropout key per layer or None, ``remat_layers`` False where
# the caller recomputes the layers already (a circular pipeline's chunk).
ScanLayers = Callable[[nnx.Module, jax.Array, Any, jax.Array | None, bool], jax.Array]


def stages() -> int:
    """Pipeline stages of the mesh being traced under (its ``pipe`` axis; 1 without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty or PIPE_AXIS not in mesh.axis_names else mesh.shape[PIPE_AXIS]


def microbatches(rows: int, replicas: int) -> int:
    """How many microbatches a batch of ``rows`` (split over ``replicas`` data shards, ``sharding.replicas``) is cut
    into: the active ``ParallelContext``'s ``pipeline_microbatches`` (0: one per stage), or the largest smaller
    count that divides each shard's rows evenly."""
    return microbatches_for(rows // replicas, parallel_context().pipeline_microbatches, stages())


def microbatches_for(rows_per_replica: int, configured: int, num_stages: int) -> int:
    """The largest count up to ``configured`` (``parallel.pipeline_microbatches``; 0: one per stage) that cuts each
    data shard's ``rows_per_replica`` evenly."""
    wanted = configured or num_stages
    return next(m for m in range(min(wanted, rows_per_replica), 0, -1) if rows_per_replica % m == 0)


def repeats() -> int:
    """Chunks of layers per stage under the active schedule (1: GPipe)."""
    return parallel_context().pipeline_repeats


def slots(num_micro: int, num_stages: int) -> int:
    """Items per round of the ring: M, or p where fewer microbatches than stages leave idle slots."""
    return max(num_micro, num_stages)


def ticks(num_micro: int, num_stages: int, num_repeats: int = 1) -> int:
    """The schedule's length: every microbatch through every chunk of every stage."""
    return (num_repeats - 1) * slots(num_micro, num_stages) + num_micro + num_stages - 1


def bubble_fraction(num_micro: int, num_stages: int, num_repeats: int = 1) -> float:
    """The idle share of the stage-ticks, 1 - M v / ticks: (p - 1) / (M v + p - 1) with M >= p."""
    return 1 - num_micro * num_repeats / ticks(num_micro, num_stages, num_repeats)


def layer_order(num_layers: int, num_stages: int, num_repeats: int) -> np.ndarray:
    """The model layer held at each position of the stacked layers of a ``(num_stages, num_repeats)`` pipeline:
    position ``s L/p + r L/(p v) + j`` holds layer ``(r p + s) L/(p v) + j`` (stage s's chunk r). The identity
    unless both are > 1."""
    per_chunk = num_layers // (num_stages * num_repeats)
    stage, repeat, j = np.meshgrid(np.arange(num_stages), np.arange(num_repeats), np.arange(per_chunk), indexing="ij")
    return ((repeat * num_stages + stage) * per_chunk + j).reshape(-1)


def same_order(saved: tuple[int, int], wanted: tuple[int, int], num_layers: int) -> bool:
    """Whether stacked layers in the ``saved`` (stages, repeats) layout are already in the ``wanted`` one's order."""
    return np.array_equal(layer_order(num_layers, *saved), layer_order(num_layers, *wanted))


def relayout(a: jax.Array, saved: tuple[int, int], wanted: tuple[int, int]) -> jax.Array:
    """``a``'s leading dimension (stacked layers) taken from the ``saved`` (stages, repeats) order to the ``wanted``
    one: ``a[argsort(layer_order(saved))][layer_order(wanted)]``, written as reshapes and transposes of whole
    chunks, which XLA turns into an all-to-all over ``pipe`` where the stack is split over it (an index gather would
    gather the stack onto every device)."""
    num_layers = a.shape[0]
    if same_order(saved, wanted, num_layers):
        return a
    (p, v), rest = saved, a.shape[1:]
    natural = jnp.swapaxes(a.reshape(p, v, num_layers // (p * v), *rest), 0, 1).reshape(a.shape)
    (p, v) = wanted
    return jnp.swapaxes(natural.reshape(v, p, num_layers // (p * v), *rest), 0, 1).reshape(a.shape)


def _ring_shift(x: jax.Array, num_stages: int) -> jax.Array:
    """``x`` (stages, ...) moved one stage on: stage s's row to stage s + 1, the last stage's to stage 0."""
    ring = [(s, (s + 1) % num_stages) for s in range(num_stages)]
    shift = jax.shard_map(lambda a: jax.lax.ppermute(a, PIPE_AXIS, ring), in_specs=P(PIPE_AXIS),
                          out_specs=P(PIPE_AXIS), axis_names={PIPE_AXIS})
    return shift(x)


def run(stage_fn: Callable[[Any, jax.Array, Any], jax.Array], stage_params: Any, xs: jax.Array,
        per_micro: Any, x_spec: P) -> jax.Array:
    """Runs ``xs`` (M, mb, ...) through the stages' chunks in order and returns the outputs (M, mb, ...), held by
    stage 0.

    ``stage_fn(params, x, args)``: one chunk of a stage on one microbatch ``x`` (mb, ...); ``stage_params``: a
    pytree whose leaves lead with (stages, repeats, ...), the stage axis split over ``pipe``; ``per_micro``: a pytree
    whose leaves lead with the microbatch axis (M, ...) (e.g. a padding mask), given to the stage with its
    microbatch's row, or None; ``x_spec``: the layout of one microbatch (mb, ...).
    """
    p, num_micro = stages(), xs.shape[0]
    v = jax.tree.leaves(stage_params)[0].shape[1]
    period = slots(num_micro, p) if v > 1 else num_micro
    stage = jax.lax.with_sharding_constraint(jnp.arange(p), P(PIPE_AXIS))
    on_stages = P(PIPE_AXIS, *x_spec)
    # Stage 0's row holds the inputs and, slot by slot, each microbatch as it comes back round (its next round's
    # input; after the last, the output); the other stages' rows feed only their idle ticks (each device keeps only
    # its own row: the inputs' bytes, or p microbatches' where fewer than p circulate). Slots past M are idle items.
    pad = jnp.zeros((period - num_micro, *xs.shape[1:]), xs.dtype)
    held = jnp.zeros((p, period, *xs.shape[1:]), xs.dtype).at[0].set(jnp.concatenate([xs, pad]))
    held = jax.lax.with_sharding_constraint(held, P(PIPE_AXIS, None, *x_spec))
    first = (stage == 0).reshape(p, *(1,) * (xs.ndim - 1))

    def chunk(params, x, r, busy, args):  # one stage's chunk r (its own: r differs between stages)
        # an idle stage-tick (before its first item, past its last, an idle slot) computes on zeros, not on what
        # its row holds (a finished microbatch, another's output): its result is thrown away, and a value outside
        # the layers' domain there would make the gradient through it NaN. Masked inside the chunk, so a
        # recomputed chunk keeps its input as before, not a masked copy too
        x = jnp.where(busy, x, jnp.zeros_like(x))
        return stage_fn(jax.tree.map(lambda a: a[r] if v > 1 else a[0], params), x, args)

    if v > 1:  # each tick's chunk is a slice of the parameters that depends on the tick
        chunk = pipeline_chunk(chunk)

    def tick(carry, t):
        current, held = carry
        fresh = held[:, t % period]  # stage 0's item t (read before it can be overwritten, at t + p - 1 or later)
        x = jax.lax.with_sharding_constraint(jnp.where(first, fresh, current), on_stages)
        item = t - stage
        busy = (item >= 0) & (item < v * period) & (item % period < num_micro)
        item = jnp.maximum(item, 0)
        r, rows = jnp.minimum(item // period, v - 1), jnp.minimum(item % period, num_micro - 1)
        args = jax.tree.map(lambda a: a[rows], per_micro)
        y = jax.vmap(chunk, spmd_axis_name=PIPE_AXIS)(stage_params, x, r, busy, args)
        moved = jax.lax.with_sharding_constraint(_ring_shift(y, p), on_stages)
        done = t - (p - 1)  # the item the last stage finished, now arrived at stage 0
        slot = done % period
        kept = jnp.where(first & (done >= 0), moved, held[:, slot])
        return (moved, held.at[:, slot].set(kept)), None

    start = jax.lax.with_sharding_constraint(jnp.zeros((p, *xs.shape[1:]), xs.dtype), on_stages)
    (_, held), _ = jax.lax.scan(tick, (start, held), jnp.arange(ticks(num_micro, p, v)))
    return held[0, :num_micro]


def run_stack(blocks: nnx.Module, scan_layers: ScanLayers, x: jax.Array, mask: Any,
              layer_keys: jax.Array | None) -> jax.Array:
    """``scan_layers``' result on ``x`` (B, S, H), the stacked ``blocks`` run as ``stages()`` stages of ``repeats()``
    chunks of layers (the stack held in ``layer_order``) over microbatches of ``x``'s rows (row ``k * M + i`` in
    microbatch ``i``, so each spans every data shard and nothing moves to form them). ``mask``: one for every row,
    or a pytree whose leaves have one row per row of ``x`` (BERT's padding mask; a packed batch's mask and
    positions); ``layer_keys``: the plain step's dropout keys, one per layer in model order, or None. Each stage's
    scan runs on one data replica's rows (``jax.vmap`` with ``spmd_axis_name`` 'data', so the rules map ``batch``
    nowhere inside), with its parameters whole (``params_whole``) and its rows' indices in the step's batch
    (``rows_of``: dropout draws the plain step's masks, for those rows only)."""
    p, v, (rows, *rest) = stages(), repeats(), x.shape
    d = replicas(rows)
    m = microbatches(rows, d)
    graphdef, state = nnx.split(blocks)
    if params_split():  # FSDP: the stage's layers gathered over `data` once per step, outside the tick loop (a
        # gather per tick would repeat it T times); their gradients are split again here
        state = jax.tree.map(lambda var: var.replace(param_at_use(var.get_value(), var.get_metadata()["out_sharding"])),
                             state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    num_layers = jax.tree.leaves(state)[0].shape[0]
    per_chunk = num_layers // (p * v)
    # each stage's chunks of layers, one copy per data replica (each device holds its own: nothing moves), so the
    # tick loop sums each replica's gradient locally and the copies' gradients are reduced over `data` once, after
    # the loop, not on every tick (as the tied embedding's copies are: VocabParallelEmbedding.replica_rows)
    layers = jax.tree.map(lambda a: jnp.broadcast_to(a.reshape(p, v, 1, per_chunk, *a.shape[1:]),
                                                     (p, v, d, per_chunk, *a.shape[1:])), state)
    keys = None  # the plain step's dropout keys, one per layer, in the stack's order
    if layer_keys is not None:
        keys = layer_keys[layer_order(num_layers, p, v)].reshape(p, v, per_chunk)

    def micro(a: jax.Array) -> jax.Array:  # (B, ...) -> (M, B/M, ...)
        return jnp.swapaxes(a.reshape(rows // m, m, *a.shape[1:]), 0, 1)

    # BERT's padding mask, a packed batch's mask and positions; not a mask every row shares
    per_row = mask is not None and rows > 1 and all(a.shape[0] == rows for a in jax.tree.leaves(mask))
    xs = constrain(micro(x), (None, *RESIDUAL))

    def stage(params, h, args):
        (copies, chunk_keys), (ids, row_mask) = params, args

        def replica(own, ids, h, row_mask):  # one data replica's rows of the microbatch, with its copy of the layers
            with rules_remapped(batch=None), rows_of(ids), params_whole():
                # the circular schedule recomputes each chunk from its input (run): no second recomputation
                return scan_layers(nnx.merge(graphdef, own), h, row_mask if per_row else mask, chunk_keys, v == 1)

        by_replica = lambda a: a.reshape(d, a.shape[0] // d, *a.shape[1:])  # noqa: E731
        h = jax.vmap(replica, spmd_axis_name="data")(copies, by_replica(ids), by_replica(h),
                                                     jax.tree.map(by_replica, row_mask) if per_row else None)
        return h.reshape(-1, *h.shape[2:])

    per_micro = (micro(batch_rows(rows)), jax.tree.map(micro, mask) if per_row else None)
    ys = run(stage, (layers, keys), xs, per_micro, spec_of(RESIDUAL))
    return constrain(jnp.swapaxes(ys, 0, 1).reshape(rows, *rest), RESIDUAL)
