"""Pipeline parallelism over the mesh's ``pipe`` axis, in SPMD: every stage runs the same program.

The stacked layers (their leading ``layers`` dimension, split over ``pipe`` by the rule ``('layers', 'pipe')``)
form ``p`` stages. The ends (embeddings, final norm, head, loss) run on every stage, each on its share of the batch:
the rules split ``batch`` over data and pipe, so a stage computes 1/p of the head (MaxText's rule for the embedding's
and the logits' batch). The M microbatches (a multiple of p) are formed where the rows are: stage j's share holds
microbatches j M/p .. (j + 1) M/p - 1. Each tick of a ``lax.scan``, every stage runs its layers on the microbatch
it holds; then every stage's output moves one stage on with one collective permute over ``pipe`` (``ppermute`` in
``shard_map``; the wrap-around pair carries a microbatch from the last stage back to stage 0), and one column of the
stages' shares moves one stage towards stage 0, which brings stage 0 its next input and each finished microbatch to
the stage whose share it is (``run``): no whole-batch transfer. With model shards (and no sequence parallelism)
each sends 1/t of an activation's sequence and the receiving stage all-gathers it over ``model``, Megatron-LM's
scatter/gather (``pipeline_1f1b.send_scattered``). Autodiff of the loop is the backward pipeline: the permutes'
transposes run the other way. The stage function is vmapped over the stages with
``spmd_axis_name='pipe'``, so its own layout constraints (tensor parallelism over ``model``, the batch over ``data``)
hold inside every stage.

Two schedules, by ``repeats`` = v (``parallel.pipeline_repeats``):

* GPipe (v = 1; Huang et al. 2019): stage ``s`` holds ``L/p`` contiguous layers and runs microbatch ``t - s`` on
  tick ``t`` of ``M + p - 1``: the bubble is ``p - 1`` idle ticks of ``L/p`` layers.
* Circular (v > 1; Megatron's interleaved schedule in its effect on the bubble, Narayanan et al. 2021; MaxText's
  circular pipeline): stage ``s`` holds v chunks of ``L/(p v)`` layers, chunks ``s, s + p, .., s + (v-1) p`` of the
  model's ``p v``, and each microbatch goes round the ring v times. Stage ``s`` runs item ``k = t - s`` on tick ``t``:
  microbatch ``k mod M`` through its chunk ``k div M``; stage 0 keeps each item that comes back round until its
  next round. ``M v + p - 1`` ticks of ``L/(p v)`` layers: the same ``p - 1`` idle ticks, each v times shorter.

Every stage computes on every tick (one program); on its idle ticks it computes on zeros, and what it computes is
thrown away.

The circular schedule needs each stage's chunks on its devices, so a pipelined run keeps its stacked layers in
``layer_order``'s order (a permutation, applied when the state is created and when a checkpoint of another layout
is read; checkpoints record their layout in their config).

``run_stack`` runs a model's layer stack through the schedule (``run``) with what the stages need around it: FSDP's
gather once per step, one copy of each stage's layers per data replica, the dropout keys in the stack's order, the
microbatches in the stages' shares and each stage's narrowed ``ParallelContext``; the model passes only its own
scan of the layers.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero
from jax.sharding import PartitionSpec as P

from megajax.parallel import pipeline_1f1b
from megajax.parallel.remat import pipeline_chunk
from megajax.parallel.sharding import (
    PIPE_AXIS,
    RESIDUAL,
    axis_of,
    batch_rows,
    constrain,
    entry_axes,
    parallel_context,
    param_at_use,
    params_split,
    params_whole,
    replicas,
    rows_of,
    rules_remapped,
    spec_of,
)

# the scope of what a stack's layers return beside their output (a mixture's routing statistics), summed and
# gathered after the tick loop, or under 1F1B moved with each microbatch (the communication budget counts it apart)
BESIDE_SCOPE = pipeline_1f1b.BESIDE_SCOPE
GPIPE, CIRCULAR, ONE_F_ONE_B = "gpipe", "circular", "1f1b"
SCHEDULES = (GPIPE, CIRCULAR, ONE_F_ONE_B)  # parallel.pipeline_schedule

# A model's scan of its stacked layers, ``scan_layers(blocks, h, mask, layer_keys, remat_layers) -> (h, beside)``:
# ``blocks`` (a stack of layers), ``h`` (B, S, H), ``layer_keys`` one dropout key per layer or None, ``remat_layers``
# False where the caller recomputes the layers already (a circular pipeline's chunk); ``beside`` what each layer
# returns beside its output, stacked over the layers (None: nothing).
ScanLayers = Callable[[nnx.Module, jax.Array, Any, jax.Array | None, bool], tuple[jax.Array, Any]]
# how a model runs its pipelined layer stack, ``runner(blocks, scan_layers, x, mask, layer_keys) -> (output,
# beside)``: given to the model by its caller (``run_stack``, or the 1F1B step's recording and replaying runners);
# ``beside``: what the layers return beside their output, stacked over the layers in model order (None where they
# return nothing), summed over the rows (a mixture's routing statistics: under stages, over the microbatches)
StackRunner = Callable[[nnx.Module, ScanLayers, jax.Array, Any, jax.Array | None], tuple[jax.Array, Any]]


def stages() -> int:
    """Pipeline stages of the mesh being traced under (its ``pipe`` axis; 1 without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty or PIPE_AXIS not in mesh.axis_names else mesh.shape[PIPE_AXIS]


def microbatches(rows: int, replicas: int) -> int:
    """How many microbatches a batch of ``rows`` (split over ``replicas`` data shards) is cut into
    (``microbatches_for``, with the active ``ParallelContext``'s ``pipeline_microbatches``)."""
    return microbatches_for(rows // replicas, parallel_context().pipeline.microbatches, stages())


def microbatches_for(rows_per_replica: int, configured: int, num_stages: int) -> int:
    """The largest multiple of ``num_stages`` up to ``configured`` (``parallel.pipeline_microbatches``; 0 or fewer
    than the stages: one per stage) that cuts each data shard's ``rows_per_replica`` evenly: each stage's share of
    the batch holds M/p whole microbatches. ValueError where the rows are not a multiple of the stages."""
    if rows_per_replica % num_stages:
        raise ValueError(f"each data shard's {rows_per_replica} rows are split over the {num_stages} pipeline stages "
                         f"(the embedding and head run on each stage's share): make them a multiple of {num_stages}")
    wanted = max(configured, num_stages)
    return next(m for m in range(wanted - wanted % num_stages, 0, -num_stages) if rows_per_replica % m == 0)


def repeats() -> int:
    """Chunks of layers per stage under the active schedule (1: GPipe)."""
    return parallel_context().pipeline.repeats


def ticks(num_micro: int, num_stages: int, num_repeats: int = 1) -> int:
    """The schedule's length: every microbatch through every chunk of every stage."""
    return num_repeats * num_micro + num_stages - 1


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


RING_SCOPE, IO_SCOPE = pipeline_1f1b.RING_SCOPE, pipeline_1f1b.IO_SCOPE  # a scattered transfer's named scopes


def _shift(x: Any, pairs: list[tuple[int, int]]) -> Any:
    """Each leaf of ``x`` (stages, ...) moved between stages by ``pairs`` (source, destination) over ``pipe``; a
    stage no pair sends to receives zeros."""
    shift = jax.shard_map(lambda a: jax.tree.map(lambda b: jax.lax.ppermute(b, PIPE_AXIS, pairs), a),
                          in_specs=P(PIPE_AXIS), out_specs=P(PIPE_AXIS), axis_names={PIPE_AXIS})
    return shift(x)


@jax.custom_vjp
def _select(flag: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """``jnp.where(flag, a, b)`` whose gradient keeps ``flag`` as it is: autodiff of ``jnp.where`` keeps it
    broadcast to ``a``'s shape, and inside the tick loop, for a flag that changes with the tick, a byte per element
    of an activation for every tick (a quarter of the ticks' fp32 inputs again)."""
    return jnp.where(flag, a, b)


def _select_fwd(flag: jax.Array, a: jax.Array, b: jax.Array) -> tuple[jax.Array, jax.Array]:
    return jnp.where(flag, a, b), flag


def _select_bwd(flag: jax.Array, g: jax.Array) -> tuple[None, jax.Array, jax.Array]:
    zeros = jnp.zeros_like(g)
    return None, jnp.where(flag, g, zeros), jnp.where(flag, zeros, g)


_select.defvjp(_select_fwd, _select_bwd)


def _choose(flag: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """``_select`` for an activation; ``jnp.where`` for integer arguments (nothing to differentiate)."""
    return _select(flag, a, b) if jnp.issubdtype(a.dtype, jnp.inexact) else jnp.where(flag, a, b)


def run(stage_fn: Callable[[Any, jax.Array, Any], tuple[jax.Array, Any]], stage_params: Any, xs: jax.Array,
        args: Any, x_spec: P, args_spec: Any, scatter: P | None = None) -> tuple[jax.Array, Any]:
    """Runs the microbatches ``xs`` through the stages' chunks in order and returns their outputs, laid out as ``xs``,
    and what the chunks return beside them summed over the microbatches, (stages, repeats, ...) per leaf.

    ``xs`` (p, K, mb, ...) split over ``pipe``: stage j holds microbatches j K .. j K + K - 1 (M = p K of them), the
    rows the ends (embedding, head, loss) compute on that stage. ``stage_fn(params, x, args) -> (y, beside)``: one
    chunk of a stage on one microbatch ``x`` (mb, ...) with its ``args`` (``beside``: a pytree its busy ticks add
    up, per stage and chunk, or None); ``stage_params``: a pytree whose leaves lead with (stages,
    repeats, ...), the stage axis split over ``pipe``; ``args``: a pytree of per-microbatch arguments laid out as
    ``xs`` (p, K, mb, ...) (a padding mask, the rows' indices), or None; ``x_spec``, ``args_spec``: the layout of one
    microbatch's ``x`` and args leaves (mb, ...).

    The microbatches reach stage 0 and the outputs their stage by one more permute per tick (``io``): each tick t,
    stage 0 takes column c = t mod K's entry, then that column moves one stage towards stage 0 and the last stage
    puts its output in. Column c is visited on ticks c, c + K, ..: on its i-th visit stage 0 holds stage i's entry,
    microbatch i K + c = t; the output of microbatch k leaves the last stage on tick k + p - 1 (its last round) and
    moves on at each of the column's later visits, p - 1 - k div K of them: it ends on stage k div K, its input's,
    in column (k + p - 1 + (v - 1) M) mod K (rolled back at the end, on each device). So no whole-batch transfer:
    each tick each stage sends one microbatch to the next and one to the one before. ``scatter``: a microbatch's layout
    where each model shard sends 1/t of an activation's sequence across a stage boundary, gathered over ``model`` on
    arrival (``pipeline_1f1b.scattered``: Megatron-LM's scatter/gather); None: all of it.
    """
    p, k_cols = xs.shape[:2]
    num_micro = p * k_cols
    v = jax.tree.leaves(stage_params)[0].shape[1]
    stage = jax.lax.with_sharding_constraint(jnp.arange(p), P(PIPE_AXIS))
    on_stages = (P(PIPE_AXIS, *x_spec), jax.tree.map(lambda s: P(PIPE_AXIS, *s), args_spec,
                                                     is_leaf=lambda s: isinstance(s, P)))
    in_io = jax.tree.map(lambda s: P(s[0], None, *s[1:]), on_stages, is_leaf=lambda s: isinstance(s, P))
    pin = jax.lax.with_sharding_constraint
    at = lambda flag, a: flag.reshape(p, *(1,) * (a.ndim - 1))  # noqa: E731  (a per-stage flag against a leaf)
    first, last = stage == 0, stage == p - 1
    forward = [(s, (s + 1) % p) for s in range(p)]  # each stage's output to the next; the last's to stage 0
    back = [(s + 1, s) for s in range(p - 1)]  # the io column towards stage 0

    def send(a: jax.Array, pairs: list[tuple[int, int]], scope: str) -> jax.Array:  # an activation (stages, mb,
        # seq, hidden)
        if scatter is None:
            return _shift(a, pairs)
        return pipeline_1f1b.send_scattered(a, tuple(pairs), scatter, scope)

    def chunk(params, x, r, busy, args):  # one stage's chunk r (its own: r differs between stages)
        # an idle stage-tick (before its first item, past its last) computes on zeros, not on what its row holds (a
        # finished microbatch, another's output): its result is thrown away, and a value outside the layers' domain
        # there would make the gradient through it NaN. Masked inside the chunk, so a recomputed chunk keeps its
        # input as before, not a masked copy too
        x = _select(busy, x, jnp.zeros_like(x))
        y, beside = stage_fn(jax.tree.map(lambda a: a[r] if v > 1 else a[0], params), x, args)
        # an idle tick's adds nothing; at the chunk's place among the stage's v (a one-hot: r is traced)
        place = jax.nn.one_hot(r, v, dtype=jnp.float32) * busy
        return y, jax.tree.map(lambda b: place.reshape(v, *(1,) * b.ndim).astype(b.dtype) * b, beside)

    if v > 1:  # each tick's chunk is a slice of the parameters that depends on the tick
        chunk = pipeline_chunk(chunk)

    def tick(carry, t):
        current, io, held = carry  # (x, args) per stage; the io columns; the circular schedule's returning items
        column = jax.tree.map(lambda a: a[:, t % k_cols], io)
        fresh = column
        if v > 1:  # rounds after the first take what came back round the ring (slot t mod M)
            fresh = jax.tree.map(lambda a, b: _choose(t < num_micro, a, b[:, t % num_micro]), column, held)
        x, x_args = pin(jax.tree.map(lambda a, b: jnp.where(at(first, a), a, b), fresh, current), on_stages)
        item = t - stage
        busy = (item >= 0) & (item < v * num_micro)
        r = jnp.clip(item // num_micro, 0, v - 1)
        y, beside = jax.vmap(chunk, spmd_axis_name=PIPE_AXIS)(stage_params, x, r, busy, x_args)
        moved = pin((send(y, forward, RING_SCOPE), _shift(x_args, forward)), on_stages)
        # the column one stage on towards stage 0, the last stage's output put in (only its last round's stays)
        column = (send(column[0], back, IO_SCOPE), _shift(column[1], back))
        column = (jnp.where(at(last, y), y, column[0]), column[1])
        io = pin(jax.tree.map(lambda a, c: a.at[:, t % k_cols].set(c), io, column), in_io)
        if v > 1:  # the item the last stage finished, now at stage 0, waits in its slot for its next round
            done = t - (p - 1)
            slot = done % num_micro
            held = pin(jax.tree.map(lambda h, m: h.at[:, slot].set(_choose(at(first & (done >= 0), m), m,
                                                                           h[:, slot])), held, moved), in_io)
        return (moved, io, held), beside

    io = pin((xs, args), in_io)
    start = pin(jax.tree.map(lambda a: jnp.zeros((p, *a.shape[2:]), a.dtype), io), on_stages)
    held = None
    if v > 1:  # stage 0's row: the items between rounds (each device holds a row: M microbatches)
        held = pin(jax.tree.map(lambda a: jnp.zeros((p, num_micro, *a.shape[2:]), a.dtype), io), in_io)
    (_, (out, _), _), beside = jax.lax.scan(tick, (start, io, held), jnp.arange(ticks(num_micro, p, v)))
    sums = jax.tree.map(lambda a: a.sum(0), beside)  # each tick's, per stage and chunk (idle ticks' zero)
    return jnp.roll(out, -(((v - 1) * num_micro + p - 1) % k_cols), axis=1), sums


@dataclasses.dataclass(frozen=True)
class StackCall:
    """A model's call of its pipelined layer stack (the arguments of a ``StackRunner``), as a schedule that owns the
    loss takes it over (``training.pipelined``): the stacked blocks (their graph and state), the model's scan of
    them, and the call's arguments."""

    graphdef: nnx.GraphDef
    state: nnx.State
    scan_layers: ScanLayers
    x: jax.Array
    mask: Any
    layer_keys: jax.Array | None
    beside: Any = None  # the shapes of what the layers return beside their output ((L, ...) leaves), or None


@dataclasses.dataclass(frozen=True)
class _Stages:
    """A stack call laid out for a schedule: ``copies(state)`` (each stage's layers, one copy per data replica,
    (p, v, d, L/(p v), ...)), the dropout keys in the stack's order (p, v, L/(p v)) or None, ``stage(params, h,
    args)`` (one chunk on one microbatch: ``run``'s ``stage_fn``; what its layers return beside its output, per data
    replica: summed over them once, after the loop), the microbatches ``xs`` and their per-row
    ``args`` in the stages' shares (p, K, mb, ...) with one microbatch's layouts, and ``to_io`` / ``from_io``
    between (B, ...) rows and that layout."""

    copies: Callable[[nnx.State], Any]
    keys: jax.Array | None
    stage: Callable[..., jax.Array]
    xs: jax.Array
    args: Any
    x_spec: P
    args_spec: Any
    to_io: Callable[[jax.Array], jax.Array]
    from_io: Callable[[jax.Array], jax.Array]
    replicas: int
    shared: Any  # the mask every row shares, or None
    layers: int  # the stack's
    replica_axes: Any  # the mesh axes the data replicas are split over (None: one replica)


def run_stack(blocks: nnx.Module, scan_layers: ScanLayers, x: jax.Array, mask: Any,
              layer_keys: jax.Array | None) -> jax.Array:
    """``scan_layers``' result on ``x`` (B, S, H), the stacked ``blocks`` run as ``stages()`` stages of ``repeats()``
    chunks of layers (the stack held in ``layer_order``) over microbatches of ``x``'s rows. ``x``'s rows are split
    over data and pipe (the rules' ``batch``: the embedding and the head run on each stage's share); the M
    microbatches are formed where the rows are, each spanning every data shard: stage j's share holds microbatches
    j K .. j K + K - 1 (``run``), and nothing moves to form them. ``mask``: one for every row, or a pytree whose
    leaves have one row per row of ``x`` (BERT's padding mask; a packed batch's mask and positions), which travel
    with their microbatch; ``layer_keys``: the plain step's dropout keys, one per layer in model order, or None.
    Each stage's scan runs on one data replica's rows (``jax.vmap`` with ``spmd_axis_name`` 'data', so the rules map
    ``batch`` nowhere inside), with its parameters whole (``params_whole``) and its rows' indices in the step's
    batch (``rows_of``: dropout draws the plain step's masks, for those rows only). The default ``StackRunner`` a
    model is given; the 1F1B step gives it others (``training.pipelined``), which record the call or return a given
    output, and runs the recorded call with ``run_stack_1f1b``."""
    graphdef, state = nnx.split(blocks)
    plan = _stages(StackCall(graphdef, state, scan_layers, x, mask, layer_keys))
    scatter = pipeline_1f1b.scattered(plan.x_spec, x.shape[1], dict(jax.sharding.get_abstract_mesh().shape))
    ys, sums = run(plan.stage, (plan.copies(state), plan.keys), plan.xs, plan.args, plan.x_spec, plan.args_spec,
                   scatter)
    place = np.argsort(layer_order(plan.layers, stages(), repeats()))  # each model layer's place in the stack
    p, over = stages(), plan.replica_axes

    def in_model_order(a: jax.Array) -> jax.Array:  # (p, v, d, L/(p v), ...) -> (L, ...)
        def whole(b):  # this stage's and replica's chunks placed among the stages', summed: one all-reduce over
            # pipe x data after the loop (its backward, of a value every device holds, moves nothing)
            placed = jnp.zeros((p, *b.shape[1:]), b.dtype).at[jax.lax.axis_index(PIPE_AXIS)].set(b[0])
            return jax.lax.psum(placed, (PIPE_AXIS, *entry_axes(over)))

        with jax.named_scope(BESIDE_SCOPE):
            a = jax.shard_map(whole, in_specs=P(PIPE_AXIS, None, over), out_specs=P(),
                              axis_names={PIPE_AXIS, *entry_axes(over)})(a)
        return a.reshape(plan.layers, *a.shape[4:])[place]

    return constrain(plan.from_io(ys), RESIDUAL), jax.tree.map(in_model_order, sums)


def run_whole(blocks: nnx.Module, scan_layers: ScanLayers, x: jax.Array, mask: Any,
              layer_keys: jax.Array | None) -> tuple[jax.Array, Any]:
    """The ``StackRunner`` of a stack that is not split over pipeline stages (a ``models.spec.Stack`` with
    ``pipelined=False``): ``scan_layers`` on ``x`` as it is, each stage running the whole stack on its share of
    the rows, as it runs the embedding."""
    return scan_layers(blocks, x, mask, layer_keys, True)


def _stages(call: StackCall) -> _Stages:
    """``call`` laid out for the schedules (``run_stack``)."""
    p, v, x, mask, rows = stages(), repeats(), call.x, call.mask, call.x.shape[0]
    split = replicas(rows)
    if split % p:
        raise ValueError(f"a pipelined batch of {rows} rows is not split over the {p} stages: each (data, pipe) shard "
                         "must hold whole rows")
    d = split // p
    m = microbatches(rows, d)
    k_cols, r = m // p, rows // (d * m)  # microbatches per stage; one microbatch's rows on one data shard
    data_axes = tuple(a for a in entry_axes(axis_of("batch")) if a != PIPE_AXIS)
    data_axes = data_axes[0] if len(data_axes) == 1 else data_axes or None
    graphdef = call.graphdef
    num_layers = jax.tree.leaves(call.state)[0].shape[0]
    per_chunk = num_layers // (p * v)

    def copies(state: nnx.State) -> Any:
        if params_split():  # FSDP: the stage's layers gathered over `data` once per step, outside the tick loop (a
            # gather per tick would repeat it T times); their gradients are split again here
            state = jax.tree.map(lambda var: var.replace(param_at_use(var.get_value(),
                                                                      var.get_metadata()["out_sharding"])),
                                 state, is_leaf=lambda x: isinstance(x, nnx.Variable))
        # each stage's chunks of layers, one copy per data replica (each device holds its own: nothing moves), so
        # the tick loop sums each replica's gradient locally and the copies' gradients are reduced over `data`
        # once, after the loop, not on every tick (as the tied embedding's copies are:
        # VocabParallelEmbedding.replica_rows)
        return jax.tree.map(lambda a: jnp.broadcast_to(a.reshape(p, v, 1, per_chunk, *a.shape[1:]),
                                                       (p, v, d, per_chunk, *a.shape[1:])), state)

    keys = None  # the plain step's dropout keys, one per layer, in the stack's order
    if call.layer_keys is not None:
        keys = call.layer_keys[layer_order(num_layers, p, v)].reshape(p, v, per_chunk)

    def to_io(a: jax.Array) -> jax.Array:  # (B, ...) -> (p, K, mb, ...): shard (data i, pipe j)'s rows
        # c r .. (c + 1) r - 1 are data shard i's part of stage j's column c
        a = a.reshape(d, p, k_cols, r, *a.shape[1:])
        return jnp.moveaxis(a, 0, 2).reshape(p, k_cols, d * r, *a.shape[4:])

    def from_io(a: jax.Array) -> jax.Array:  # to_io's inverse
        a = a.reshape(p, k_cols, d, r, *a.shape[3:])
        return jnp.moveaxis(a, 2, 0).reshape(rows, *a.shape[4:])

    # BERT's padding mask, a packed batch's mask and positions; not a mask every row shares
    per_row = mask is not None and rows > 1 and all(a.shape[0] == rows for a in jax.tree.leaves(mask))
    # the circular schedule recomputes each chunk from its input (run): not its layers a second time. 1F1B's stages
    # keep what the model's remat policy keeps (pipeline_1f1b)
    recompute_layers = v == 1 or parallel_context().pipeline.schedule == ONE_F_ONE_B

    def stage(params, h, args, shared=mask):  # shared: the mask every row shares (passed into a shard_map)
        (own_copies, chunk_keys), (ids, row_mask) = params, args

        def replica(own, ids, h, row_mask):  # one data replica's rows of the microbatch, with its copy of the layers
            with rules_remapped(batch=None), rows_of(ids), params_whole():
                return call.scan_layers(nnx.merge(graphdef, own), h, row_mask if per_row else shared, chunk_keys,
                                        recompute_layers)

        h, beside = jax.vmap(replica, spmd_axis_name="data")(own_copies, _by_replica(ids, d), _by_replica(h, d),
                                                             jax.tree.map(lambda a: _by_replica(a, d), row_mask)
                                                             if per_row else None)
        return h.reshape(-1, *h.shape[2:]), beside  # what the layers return beside h: per replica (d, ...)

    args = (to_io(batch_rows(rows)), jax.tree.map(to_io, mask) if per_row else None)
    # one microbatch's layout: its rows over the data shards (the layers' rules within), the rest free
    args_spec = jax.tree.map(lambda a: P(data_axes, *(P.UNCONSTRAINED,) * (a.ndim - 3)), args)
    with rules_remapped(batch=data_axes):
        x_spec = spec_of(RESIDUAL)
    return _Stages(copies, keys, stage, to_io(constrain(x, RESIDUAL)), args, x_spec, args_spec, to_io, from_io, d,
                   None if per_row else mask, num_layers, data_axes)


def _summed_over(axes: Any, leaves: list[jax.Array], at: int, to: int) -> list[jax.Array]:
    """Each leaf summed over its dimension ``at`` (the data replicas, split over ``axes``; None: one), the sums
    given to every replica again as dimension ``to``: one all-reduce of the leaves side by side, so that XLA sums
    each whole (its own reduction summed some over the layers first, others not)."""
    over = entry_axes(axes)

    def summed(*blocks):
        parts = [b.sum(at) for b in blocks]
        flat = jnp.concatenate([a.reshape(-1) for a in parts])
        flat = jax.lax.psum(flat, over) if over else flat
        cuts = np.cumsum([a.size for a in parts])[:-1]
        return tuple(jnp.broadcast_to(jnp.expand_dims(t.reshape(a.shape), to), jnp.moveaxis(b, at, to).shape)
                     for t, a, b in zip(jnp.split(flat, cuts), parts, blocks))

    if not leaves:
        return leaves
    spec = lambda i: P(*(None,) * i, axes)  # noqa: E731
    with jax.named_scope(BESIDE_SCOPE):
        return list(jax.shard_map(summed, in_specs=tuple(spec(at) for _ in leaves),
                                  out_specs=tuple(spec(to) for _ in leaves), axis_names=set(over),
                                  check_vma=False)(*leaves))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _replicas_total(axes: Any, carried: Any) -> Any:
    """``carried``'s leaves (p v, d, L/(p v), ...), the d data replicas split over ``axes``, summed over the
    replicas and given to each, (d, p v, L/(p v), ...): one all-reduce each way, backward of the leaves that have a
    gradient only (a count's is zero)."""
    leaves, treedef = jax.tree.flatten(carried)
    return jax.tree.unflatten(treedef, _summed_over(axes, leaves, 1, 0))


def _replicas_total_fwd(axes: Any, carried: Any) -> tuple[Any, None]:
    # (with symbolic zeros the primals come wrapped)
    leaves, treedef = jax.tree.flatten(carried, is_leaf=lambda a: isinstance(a, CustomVJPPrimal))
    return jax.tree.unflatten(treedef, _summed_over(axes, [a.value for a in leaves], 1, 0)), None


def _replicas_total_bwd(axes: Any, _: None, ct: Any) -> tuple[Any]:
    leaves, treedef = jax.tree.flatten(ct, is_leaf=lambda a: isinstance(a, SymbolicZero))
    live = [i for i, a in enumerate(leaves) if not isinstance(a, SymbolicZero)]
    sums = iter(_summed_over(axes, [leaves[i] for i in live], 0, 1))
    out = [next(sums) if i in live else jnp.zeros((a.aval.shape[1], a.aval.shape[0], *a.aval.shape[2:]),
                                                   a.aval.dtype) for i, a in enumerate(leaves)]
    return (jax.tree.unflatten(treedef, out),)


_replicas_total.defvjp(_replicas_total_fwd, _replicas_total_bwd, symbolic_zeros=True)


def _by_replica(a: jax.Array, d: int) -> jax.Array:
    """(rows, ...) -> (d, rows / d, ...): one microbatch's rows by data replica."""
    return a.reshape(d, a.shape[0] // d, *a.shape[1:])


# the loss's tail on one data replica's rows of a microbatch, ``tail(tail_params, consts, (h, beside), fields) ->
# (seed, aux)``: ``h`` the stack's output on those rows, ``beside`` what the layers returned beside it (model order,
# (L, ...) leaves, or None): the microbatch's, summed over its rows and divided by the data replicas (each replica's
# rows' share of it); ``fields`` the batch's fields for those rows; ``seed`` is differentiated, ``aux`` summed over
# the microbatches
Tail = Callable[[Any, Any, tuple[jax.Array, Any], Any], tuple[jax.Array, Any]]


def run_stack_1f1b(call: StackCall, tail: Tail, tail_params: Any, consts: Any, fields: Any
                   ) -> tuple[Any, nnx.State, Any, jax.Array]:
    """The 1F1B schedule (``pipeline_1f1b.run``) over a recorded stack ``call``, each microbatch's
    loss computed by ``tail`` on the last stage as it finishes; returns (the tail's ``aux`` summed over the
    microbatches, the gradients of the stack's state, of ``tail_params``, of ``call.x``). ``fields``: the batch's
    fields (B, ...), each microbatch's rows travelling with it to the last stage. ``tail_params`` are copied per data
    replica, as the layers (``_stages``); their gradients, one per stage and copy, are summed as one dimension over
    `pipe` x `data`: one all-reduce (a sum over the stages, then one over the copies, compiled to one each). What the
    layers return beside their output (``call.beside``) travels with each microbatch to the tail, each chunk adding
    its layers' at their place among the stack's (per data replica: (p v, d, L/(p v), ...)), and its gradient comes
    back with the activation's."""
    plan = _stages(call)
    weights, pull_weights = jax.vjp(plan.copies, call.state)
    d, p, v = plan.replicas, stages(), repeats()
    spread = lambda a: jnp.broadcast_to(a[None], (d, *a.shape))  # noqa: E731
    copies = jax.tree.map(spread, tail_params)
    per_chunk = plan.layers // (p * v)
    carried = jax.tree.map(lambda b: jax.ShapeDtypeStruct((p * v, d, per_chunk, *b.shape[1:]), b.dtype), call.beside)
    places = jnp.arange(p * v, dtype=jnp.int32).reshape(p, v)  # each chunk's among the stack's, in its order
    in_model = np.argsort(layer_order(plan.layers, p, v))

    def stage_fn(w, keys, shared, x, args):  # w: (d, L/(p v), ...), keys (L/(p v),): one chunk of the stage's
        (keys, place), (h, carried) = keys, x
        y, beside = plan.stage((w, keys), h, args, shared)
        at = jax.nn.one_hot(place, p * v)
        return y, jax.tree.map(lambda c, b: c + at.reshape(-1, *(1,) * b.ndim).astype(b.dtype) * b[None],
                               carried, beside)

    def tail_fn(tp, consts, out, args, fields):
        (h, carried), ids = out, args[0]
        # the microbatch's on every replica, in model order, divided by the replicas (each replica's rows' share)
        beside = jax.tree.map(lambda c: c.reshape(d, plan.layers, *c.shape[3:])[:, in_model] / d,
                              _replicas_total(plan.replica_axes, carried))

        def replica(own, h, ids, fields, beside):
            with rules_remapped(batch=None), rows_of(ids), params_whole():
                return tail(own, consts, (h, beside), fields)

        seeds, aux = jax.vmap(replica, spmd_axis_name="data")(
            tp, _by_replica(h, d), _by_replica(ids, d), jax.tree.map(lambda a: _by_replica(a, d), fields), beside)
        return seeds.sum(), jax.tree.map(lambda a: a.sum(0), aux)

    mesh = jax.sharding.get_abstract_mesh()
    scatter = pipeline_1f1b.scattered(plan.x_spec, call.x.shape[1], dict(mesh.shape))
    # the tail's fields whole on each row: a packed batch's are split over `context`, and the tail's objective
    # reorders them (context.balanced) on the last stage inside a branch, where XLA's partitioner aborts on that
    # gather with model shards (jax 0.10) and a move between context shards is a collective no other stage joins
    fields = jax.tree.map(lambda a: constrain(a, ("batch", *(None,) * (a.ndim - 1))), fields)
    aux, dw, d_copies, dxs = pipeline_1f1b.run(stage_fn, tail_fn, weights, (plan.keys, places), plan.shared, copies,
                                               consts, plan.xs, plan.args, jax.tree.map(plan.to_io, fields),
                                               parallel_context().pipeline.stage_recompute, scatter, carried)
    # (stages, copies, ...) -> one dimension over pipe x data, summed
    (d_state,), d_tail = pull_weights(dw), jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]).sum(0), d_copies)
    return aux, d_state, d_tail, constrain(plan.from_io(dxs), RESIDUAL)
