"""The 1F1B pipeline schedule (one forward, one backward), plain or interleaved, in one SPMD program over the mesh's
``pipe`` axis.

Narayanan et al. 2021 (PipeDream-Flush): after a warm-up, each stage alternates one microbatch's forward with an
earlier one's backward, so a stage holds a bounded number of microbatches whatever their count M, where GPipe holds
every microbatch's activations until the backward pipeline starts. Interleaved (v = ``parallel.pipeline_repeats``
> 1 chunks of L/(p v) layers per stage, chunk c of stage s holding the model's layers of virtual stage c p + s, as
the circular schedule's): the bubble's time divided by v. Here the stages run in lockstep ticks of a ``lax.scan``
inside a ``shard_map`` manual over ``pipe`` (each device knows its stage: ``lax.axis_index``):

* on tick ``t`` stage ``s`` runs its forward number ``t - s`` and its backward number ``t - (v + 1) p + 2 + s``;
  forwards take the microbatches in groups of p through chunk 0, then chunk 1, .., backwards the same groups from
  the last chunk (``forward_item``, ``backward_item``). So each forward's input arrives on the tick it is needed:
  from the stage before, or for a chunk c > 0 on stage 0 from the last stage's chunk c - 1 (the ring's wrap-around,
  p forwards earlier); likewise each backward's gradient. Each half runs under ``lax.cond``, so a stage with nothing
  to do skips it. M v + (v + 1) p - 2 ticks of one chunk; the first v p - 1 have forwards only and the last
  v p - 1 backwards only, so the step takes about (M + (p - 1) / v)(F + B): the interleaved schedule's bubble (F
  and B a stage's as the model's remat policy makes them; without chunks M + 2p - 2 ticks and GPipe's bubble).
* the last stage runs its last chunk's forward, the loss's tail (``tail_fn``: final norm, head and loss on the
  microbatch's rows) and both backwards in one tick: ``jax.vjp`` of the chunk and the tail, seeded with the loss's
  weight.
* every other chunk's forward is split from its backward (``_residuals``): the forward tick keeps the residuals
  ``jax.vjp`` saves of the microbatch (what the remat policy keeps; what depends on the weights alone, such as their
  half-precision copies, is computed again in the backward tick, not stored per microbatch) in a ring of
  min(2 v p - 1, M v) slots (``held``; one shape on every stage), and the backward tick applies the pullback to
  them. With ``recompute`` (``parallel.pipeline_stage_recompute``) the residuals are the chunk's inputs (one
  ``jax.checkpoint`` round the chunk): its forward runs again in its backward, and one chunk-microbatch's
  activations exist at a time.
* per tick, collective permutes over ``pipe``: outputs (with the rows' per-row arguments and batch fields) one stage
  on, input gradients one stage back, and two columns of the stages' shares of the batch (``pipeline.run``'s ``io``):
  one brings stage 0 its next input, the other takes stage 0's input gradient to the stage whose share it is.
  Without sequence parallelism each model shard sends 1/t of an activation's sequence and the receiving stage
  all-gathers it over ``model`` (Megatron-LM's scatter/gather, ``scattered``).

The parameters' gradients are accumulated in the loop's carry, each data replica's in its own copy (the stage
function's and the tail's), so nothing is reduced per tick; the caller reduces them once.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax._src.interpreters import partial_eval as pe  # dce_jaxpr: no public equivalent (jax 0.10)
from jax.sharding import PartitionSpec as P

from megajax.parallel.sharding import MODEL_AXIS, PIPE_AXIS

# named scopes round a tick's parts, for ``comm_budget``: an activation's (or its gradient's) transfer round the ring
# of stages and along the io column (``send_scattered``'s, ``run``'s), and 1F1B's three halves, each run on its own
# count of ticks per stage (a collective inside one runs on those ticks only)
RING_SCOPE, IO_SCOPE = "pipeline_ring", "pipeline_io"
FORWARD_SCOPE, TAIL_SCOPE, BACKWARD_SCOPE = "pipeline_forward", "pipeline_tail", "pipeline_backward"
# the scope of what a stack's layers return beside their output (a mixture's routing statistics) wherever it moves:
# with each microbatch round the ring here, summed and gathered after ``pipeline.run``'s loop
BESIDE_SCOPE = "stack_beside"


def ticks(num_micro: int, num_stages: int, num_repeats: int = 1) -> int:
    """The schedule's lockstep ticks, M v + (v + 1) p - 2 (M + 2p - 2 without chunks): the last forward reaches the
    last stage on tick M v + p - 2 and the first chunk's last backward reaches stage 0 v p - 1 + p - 1 ticks after
    the last stage's first backward."""
    return num_micro * num_repeats + (num_repeats + 1) * num_stages - 2


def held(num_micro: int, num_stages: int, num_repeats: int = 1) -> int:
    """Chunk-microbatches whose residuals a stage holds between their forward and their backward: stage s holds
    those of chunk c for 2 (v - c) p - 2 s - 1 ticks, so a ring of 2 v p - 1 (stage 0's chunk 0: one shape on every
    stage), or all M v if fewer; without chunks 2 p - 1, or M."""
    return min(2 * num_repeats * num_stages - 1, num_micro * num_repeats)


def forward_item(k: Any, num_stages: int, num_repeats: int) -> tuple[Any, Any]:
    """(chunk, microbatch) of a stage's k-th forward: microbatches in groups of p, each group through chunk 0, then
    chunk 1, .., chunk v - 1 (Narayanan et al. 2021's interleaved order); without chunks (0, k)."""
    group, r = k // (num_stages * num_repeats), k % (num_stages * num_repeats)
    return r // num_stages, group * num_stages + r % num_stages


def backward_item(j: Any, num_stages: int, num_repeats: int) -> tuple[Any, Any]:
    """(chunk, microbatch) of a stage's j-th backward: as ``forward_item`` with the chunks from the last."""
    group, r = j // (num_stages * num_repeats), j % (num_stages * num_repeats)
    return num_repeats - 1 - r // num_stages, group * num_stages + r % num_stages


@dataclasses.dataclass(frozen=True)
class _Residuals:
    """A stage's backward split from its forward: ``jax.vjp``'s residuals, those that depend on the microbatch
    (``kept``: stored from the forward tick to the backward tick) and those that do not (the stage's weights, their
    half-precision copies: computed again in the backward tick, never stored per microbatch)."""

    forward: Any  # (weights, x, args) -> [y, *kept residuals]
    rest: Any  # (weights) -> the other residuals
    kept: list[bool]  # per residual leaf, in the pullback's order
    tree: Any  # the pullback's tree structure
    shapes: list[jax.ShapeDtypeStruct]  # of the kept residuals

    def pullback(self, kept: list[jax.Array], rest: list[jax.Array]) -> Any:
        kept, rest = iter(kept), iter(rest)
        return jax.tree.unflatten(self.tree, [next(kept) if k else next(rest) for k in self.kept])


def _program(closed: Any, used: list[bool]) -> tuple[Callable[..., list[jax.Array]], list[bool]]:
    """``closed``'s jaxpr cut to the outputs ``used`` (dead code removed), as a function of the inputs it reads, and
    which inputs those are."""
    jaxpr, inputs = pe.dce_jaxpr(pe.convert_constvars_jaxpr(closed.jaxpr), used)
    consts = len(closed.consts)

    def program(*args: jax.Array) -> list[jax.Array]:
        flat = [*closed.consts, *args]
        return jax.core.eval_jaxpr(jaxpr, [], *[a for a, u in zip(flat, inputs, strict=True) if u])

    return program, inputs[consts:]


def _residuals(fn: Callable[[Any, Any, Any], Any], weights: Any, x: Any, args: Any) -> _Residuals:
    """Split the vjp of ``fn(weights, x, args)`` (x and weights differentiated) into a forward that returns the
    microbatch's residuals and a program that recomputes the rest from the weights (``_Residuals``). A residual is
    the microbatch's where its jaxpr, dead code removed, reads ``x`` or ``args``."""
    box = {}

    def traced(w, x, a):
        y, pull = jax.vjp(lambda w, x: fn(w, x, a), w, x)
        leaves, box["tree"] = jax.tree.flatten(pull)
        ys, box["y"] = jax.tree.flatten(y)
        return [*ys, *leaves]

    closed = jax.make_jaxpr(traced)(weights, x, args)
    n_w, n_y = len(jax.tree.leaves(weights)), box["y"].num_leaves
    count = len(closed.jaxpr.outvars) - n_y
    kept = []
    for i in range(count):
        _, reads = _program(closed, [j == n_y + i for j in range(n_y + count)])
        kept.append(any(reads[n_w:]))
    program, _ = _program(closed, [True] * n_y + kept)
    flat = lambda *trees: [a for t in trees for a in jax.tree.leaves(t)]  # noqa: E731

    def forward(w, x, a):  # [y, *kept residuals]
        out = program(*flat(w, x, a))
        return [jax.tree.unflatten(box["y"], out[:n_y]), *out[n_y:]]

    shapes = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
              for v, k in zip(closed.jaxpr.outvars[n_y:], kept, strict=True) if k]
    if all(kept):  # (a side effect that reads the microbatch is in every leaf's program: all are kept)
        return _Residuals(forward, lambda w: [], kept, box["tree"], shapes)
    rest, reads = _program(closed, [False] * n_y + [not k for k in kept])
    assert not any(reads[n_w:]), "a residual left to the backward reads the microbatch"
    return _Residuals(forward, lambda w: rest(*flat(w, _zeros(x), _zeros(args))), kept, box["tree"], shapes)


def scattered(x_spec: P, seq: int, mesh_shape: dict[str, int]) -> P | None:
    """Whether a microbatch's activations (rows, seq, hidden), laid out as ``x_spec``, cross a stage boundary split
    over the ``tensor`` model shards (``run``'s ``scatter``): ``x_spec`` where nothing splits the sequence over them
    yet (Megatron-LM's scatter/gather, Narayanan et al. 2021 Section 4.1: each model shard sends 1/t of the activation
    and the next stage all-gathers it over the model shards' fast links, instead of every model shard sending all of
    it); None where it is split already (sequence parallelism) or a device's part of it (over ``mesh_shape``'s
    axes) does not divide."""
    tensor, entries = mesh_shape.get(MODEL_AXIS, 1), (*x_spec, None, None)
    local = seq // math.prod(mesh_shape[a] for a in _axes(P(entries[1])))
    return None if tensor == 1 or MODEL_AXIS in _axes(x_spec) or local % tensor else x_spec


def _split_send_gather(a: jax.Array, pairs: Any, axis: int) -> jax.Array:
    """Inside a ``shard_map`` manual over ``pipe`` and ``model``: this model shard's 1/t of ``a`` along ``axis`` (the
    sequence) sent to the stages ``pairs`` name, and the pieces all-gathered over ``model`` on arrival."""
    piece = a.shape[axis] // jax.lax.axis_size(MODEL_AXIS)
    mine = jax.lax.dynamic_slice_in_dim(a, jax.lax.axis_index(MODEL_AXIS) * piece, piece, axis=axis)
    return jax.lax.all_gather(jax.lax.ppermute(mine, PIPE_AXIS, list(pairs)), MODEL_AXIS, axis=axis, tiled=True)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def send_scattered(a: jax.Array, pairs: tuple[tuple[int, int], ...], scatter: P, scope: str) -> jax.Array:
    """``a`` (stages, rows, seq, hidden), split over ``pipe`` and laid out as ``P(pipe, *scatter)``, moved between
    stages by ``pairs`` (source, destination) as Megatron-LM moves an activation (``scattered``): each model shard
    sends 1/t of the sequence, gathered over ``model`` on arrival; a stage no pair sends to receives zeros. Its
    gradient goes back the same way (the pairs reversed): autodiff would reduce-scatter a cotangent every model shard
    holds whole, t times over. ``scope``: a named scope round both directions' collectives (which schedule transfer
    they are, for ``comm_budget``)."""
    spec = P(PIPE_AXIS, *scatter)

    def send(b):
        with jax.named_scope(scope):
            return _split_send_gather(b, pairs, 2)

    return jax.shard_map(send, in_specs=spec, out_specs=spec, axis_names={PIPE_AXIS, MODEL_AXIS, *_axes(scatter)},
                         check_vma=False)(a)


def _send_forward(a, pairs, scatter, scope):
    return send_scattered(a, pairs, scatter, scope), None


def _send_backward(pairs, scatter, scope, _, g):
    return (send_scattered(g, tuple((d, s) for s, d in pairs), scatter, scope),)


send_scattered.defvjp(_send_forward, _send_backward)


def _with_derivative(fn: Callable[[Any, jax.Array], Any], weights: Any, x: jax.Array) -> Any:
    """Per leaf of ``fn(weights, x)``'s output: whether it has a derivative in ``weights`` or ``x`` (its linearized
    program, dead code removed, reads a tangent): a count's (a mixture's assignments per expert) has none, so no
    gradient of it needs to travel."""
    out, linear = jax.linearize(fn, weights, x)
    closed = jax.make_jaxpr(linear)(weights, x)
    count = len(closed.jaxpr.outvars)
    flags = [any(pe.dce_jaxpr(closed.jaxpr, [j == i for j in range(count)])[1]) for i in range(count)]
    return jax.tree.unflatten(jax.tree.structure(out), flags)


def _axes(spec: P) -> set[str]:
    return {a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)}


def _zeros(tree: Any) -> Any:
    return jax.tree.map(jnp.zeros_like, tree)


def _where(flag: jax.Array, a: Any, b: Any) -> Any:
    return jax.tree.map(lambda x, y: jnp.where(flag, x, y), a, b)


def run(stage_fn: Callable[[Any, Any, Any, tuple[jax.Array, Any], Any], tuple[jax.Array, Any]],
        tail_fn: Callable[[Any, Any, tuple[jax.Array, Any], Any, Any], tuple[jax.Array, Any]],
        weights: Any, keys: Any, shared: Any, tail_params: Any, consts: Any, xs: jax.Array, args: Any, fields: Any,
        recompute: bool = False, scatter: P | None = None, carried: Any = None) -> tuple[Any, Any, Any, jax.Array]:
    """The 1F1B schedule over the M microbatches ``xs``; returns (the tail's summed outputs, the gradients of
    ``weights``, of ``tail_params``, of ``xs``).

    ``stage_fn(weights, keys, shared, (x, c), args) -> (y, c)``: one chunk of a stage's layers on one microbatch
    (``weights``, ``keys``: the chunk's), ``c`` what travels with the microbatch's activation from its first chunk to
    the tail, each chunk adding to it (a mixture's routing statistics), starting as zeros of ``carried``'s shapes
    (one microbatch's; None: nothing), its gradient travelling back with the activation's. ``weights``, ``keys``: leaves
    leading with (stages, chunks, ...), stages split over ``pipe``; ``keys`` not differentiated; ``shared``: whole
    on every stage, not differentiated. ``tail_fn(tail_params, consts, (y, c), args, fields) -> (seed, aux)``: the
    loss's tail on the last chunk's output ``y`` of a microbatch;
    ``seed`` is what is differentiated (the loss contribution times its scale), ``aux`` is summed over the
    microbatches and returned. ``tail_params``, ``consts``: whole on every stage. ``xs``, ``args``, ``fields``:
    (p, K, mb, ...) split over ``pipe``, stage j's share holding microbatches j K .. j K + K - 1 (as
    ``pipeline.run``). The gradients of ``tail_params`` are returned per stage (leading p, split over ``pipe``: the
    caller sums them, in one reduction with any other sum it needs); those of ``weights`` and ``xs`` are laid out as
    their primals. ``recompute``: hold each microbatch's stage input instead of its residuals and run
    the stage's forward again in its backward. ``scatter``: one microbatch's layout (rows, seq, hidden) where each
    model shard sends its 1/t of the sequence of an activation or gradient across a stage boundary, all-gathered
    over ``model`` on arrival (``scattered``); None: all of it.
    """
    p, k_cols = xs.shape[:2]
    v = jax.tree.leaves(weights)[0].shape[1]
    num_micro = p * k_cols
    ring = held(num_micro, p, v)
    lag = (v + 1) * p - 2  # stage 0's j-th backward runs on tick j + lag
    if v == 1:  # the ends need no wrap-around
        forward, backward = [(s, s + 1) for s in range(p - 1)], [(s + 1, s) for s in range(p - 1)]
    else:  # a chunk's output from the last stage to stage 0 for the next chunk, its gradient back
        forward, backward = [(s, (s + 1) % p) for s in range(p)], [((s + 1) % p, s) for s in range(p)]
    toward_first = [(s + 1, s) for s in range(p - 1)]
    ring_down = [(s, (s - 1) % p) for s in range(p)]

    def cross(a: jax.Array, pairs: list[tuple[int, int]]) -> jax.Array:  # an activation or its gradient (rows,
        # seq, hidden) to the stages ``pairs`` name: each model shard sends its 1 / scatter of the sequence, gathered
        # again on arrival (manual over ``model``, so that XLA neither sends it whole nor carries the split on)
        if scatter is None:
            return jax.lax.ppermute(a, PIPE_AXIS, pairs)
        return jax.shard_map(lambda b: _split_send_gather(b, pairs, 1), in_specs=scatter, out_specs=scatter,
                             axis_names={MODEL_AXIS, *_axes(scatter)}, check_vma=False)(a)

    def carry_on(x: tuple[jax.Array, Any], pairs: list[tuple[int, int]], live: Any = None) -> tuple[jax.Array, Any]:
        # an activation with what travels with it, or their gradients (those of ``live`` leaves; the rest zero)
        with jax.named_scope(BESIDE_SCOPE):
            carried = jax.tree.map(lambda a, on: jax.lax.ppermute(a, PIPE_AXIS, pairs) if on else jnp.zeros_like(a),
                                   x[1], jax.tree.map(lambda _: True, x[1]) if live is None else live)
        return cross(x[0], pairs), carried

    def body(weights, keys, shared, tail_params, consts, xs, args, fields):
        own = lambda tree: jax.tree.map(lambda a: a[0], tree)  # noqa: E731  (this stage's block)
        weights, keys, xs, args, fields = own(weights), own(keys), own(xs), own(args), own(fields)
        def chunk(tree: Any, c: Any) -> Any:  # chunk c's leaves (c a count or traced)
            if v == 1 or isinstance(c, int):
                return jax.tree.map(lambda a: a[c if v > 1 else 0], tree)
            return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, c, 0, keepdims=False), tree)

        s = jax.lax.axis_index(PIPE_AXIS)
        first, last = s == 0, s == p - 1
        one = lambda tree: jax.tree.map(lambda a: jnp.zeros_like(a[0]), tree)  # noqa: E731  (one microbatch's)
        c0 = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), carried)
        x0, args0, fields0 = (one(xs), c0), one(args), one(fields)
        aux0 = jax.eval_shape(lambda: tail_fn(tail_params, consts, x0, args0, fields0)[1])
        aux0 = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), aux0)

        def stage(w, x, a):  # a: (the microbatch's args, the chunk's keys)
            return stage_fn(w, a[1], shared, x, a[0])

        # recompute: the stage's residuals are its inputs (one checkpoint round the whole chunk)
        halves = _residuals(jax.checkpoint(stage) if recompute else stage, chunk(weights, 0), x0,
                            (args0, chunk(keys, 0)))
        live = None
        if jax.tree.leaves(c0):
            live = _with_derivative(lambda w, h: stage(w, (h, c0), (args0, chunk(keys, 0)))[1], chunk(weights, 0),
                                    x0[0])

        @jax.named_scope(FORWARD_SCOPE)
        def forward_half(x, a, held, slot, c):  # the chunk's output; the residuals its backward needs of this
            # microbatch written into their slot of the ring
            y, *kept = halves.forward(chunk(weights, c), x, (a, chunk(keys, c)))
            return y, [h.at[slot].set(r) for h, r in zip(held, kept, strict=True)]

        @jax.named_scope(TAIL_SCOPE)
        def last_half(x, a, f):  # the last stage's last chunk: forward, tail, both backwards
            c_keys = chunk(keys, v - 1)

            def whole(w, tp, x):
                return tail_fn(tp, consts, stage_fn(w, c_keys, shared, x, a), a, f)

            seed, pull, aux = jax.vjp(whole, chunk(weights, v - 1), tail_params, x, has_aux=True)
            dw, dtp, dx = pull(jnp.ones_like(seed))
            return dw, dtp, dx, aux

        @jax.named_scope(BACKWARD_SCOPE)
        def middle_half(kept, g, c):  # any other chunk: its backward from the residuals its forward kept
            dw, dx = halves.pullback(kept, halves.rest(chunk(weights, c)))(g)
            return dw, _zeros(tail_params), dx, aux0

        def add(sums, c, grads):  # into chunk c's gradient sums, elementwise (a dynamic update of chunk c's held
            # another copy: compiled temp +0.2 MB, half the stage's fp32 gradients, 8-layer GPT on (2,2,2), v = 2)
            if v == 1:
                return jax.tree.map(lambda a, g: a + g[None], sums, grads)
            at_c = jnp.arange(v) == c
            return jax.tree.map(lambda a, g: a + jnp.where(at_c.reshape(-1, *[1] * g.ndim), g[None], 0), sums, grads)

        def tick(carry, t):
            inbox, grad_in, held, io, io_grad, dw_sum, dtp_sum, aux_sum = carry
            f, b = t - s, t - lag + s  # this stage's forward and backward counts
            (c_f, _), (c_b, _) = forward_item(f, p, v), backward_item(b, p, v)
            f_on = (f >= 0) & (f < num_micro * v)
            b_on = (b >= 0) & (b < num_micro * v)
            # stage 0 takes a new microbatch on its chunk 0's forwards, and gives back a microbatch's input gradient
            # on its chunk 0's backwards: their counts order the io columns (one turn per tick without chunks)
            (c_in, m_in), (c_out, m_out) = forward_item(t, p, v), backward_item(t - lag, p, v)
            takes = (t < num_micro * v) & (c_in == 0)
            gives = (t >= lag) & (t - lag < num_micro * v) & (c_out == 0)
            col = m_in % k_cols
            entry = jax.tree.map(lambda a: a[col], io)
            x, a, fl = _where(first & (c_f == 0), ((entry[0], c0), *entry[1:]), inbox)
            # the residuals wait in the ring for the microbatch's backward (the last chunk's on the last stage are
            # used at once)
            fused = last & (c_f == v - 1)
            y, held = jax.lax.cond(f_on & ~fused, forward_half,
                                   lambda x, a, held, slot, c: (_zeros(x), held), x, a, held, f % ring, c_f)
            f_b = b + (2 * c_b - v + 1) * p  # the forward count of the backward's chunk-microbatch
            kept_b = [h[f_b % ring] for h in held]

            def backward_half(sums, x, a, fl, kept_b, g, c):  # the sums added to inside the branch: no second copy
                dw, dtp, dx, aux = jax.lax.cond(last & (c == v - 1), lambda: last_half(x, a, fl),
                                                lambda: middle_half(kept_b, g, c))
                dw_sum, dtp_sum, aux_sum = sums
                return (add(dw_sum, c, dw), *jax.tree.map(jnp.add, (dtp_sum, aux_sum), (dtp, aux))), dx

            def idle(sums, *_):
                return sums, _zeros(x)

            (dw_sum, dtp_sum, aux_sum), dx = jax.lax.cond(b_on, backward_half, idle, (dw_sum, dtp_sum, aux_sum), x, a,
                                                          fl, kept_b, grad_in, c_b)
            permute = lambda tree, pairs: jax.tree.map(  # noqa: E731
                lambda a: jax.lax.ppermute(a, PIPE_AXIS, pairs), tree)
            with jax.named_scope(RING_SCOPE):  # the output one stage on, the input gradient one back
                inbox = (carry_on(y, forward), *permute((a, fl), forward))
                grad_in = carry_on(dx, backward, live)

            # the input column one stage towards stage 0, kept where stage 0 took from it; stage 0's input gradient
            # put in its column, which then turns one stage down the ring, kept where stage 0 gave one: microbatch
            # j K + c's ends on stage j (p - j turns; ``run``). The permutes run on every tick (a collective inside
            # a branch taken on some ticks stalled XLA:CPU's device threads under pytest); what they carry is kept
            # on M ticks each
            x_in, *rest = entry  # (the microbatch's input, its args and fields)
            g_col = (m_out + 2 * (p - 1)) % k_cols
            g_entry = jnp.where(first, dx[0], io_grad[g_col])
            with jax.named_scope(IO_SCOPE):
                moved = (cross(x_in, toward_first), *permute(rest, toward_first))
                g_moved = cross(g_entry, ring_down)
            io = _where(takes, jax.tree.map(lambda a, c: a.at[col].set(c), io, moved), io)
            io_grad = jnp.where(gives, io_grad.at[g_col].set(g_moved), io_grad)
            return (inbox, grad_in, held, io, io_grad, dw_sum, dtp_sum, aux_sum), None

        held = [jnp.zeros((ring, *a.shape), a.dtype) for a in halves.shapes]
        carry = ((x0, args0, fields0), x0, held, (xs, args, fields), jnp.zeros_like(xs), _zeros(weights),
                 _zeros(tail_params), aux0)
        carry, _ = jax.lax.scan(tick, carry, jnp.arange(ticks(num_micro, p, v)))
        *_, io_grad, dw, dtp, aux = carry
        dxs = jnp.roll(io_grad, -(2 * (p - 1)) % k_cols, axis=0)  # each in its own column
        lead = lambda tree: jax.tree.map(lambda a: a[None], tree)  # noqa: E731
        return lead(aux), lead(dw), lead(dtp), dxs[None]

    split = P(PIPE_AXIS)
    aux, dw, dtp, dxs = jax.shard_map(
        body, in_specs=(split, split, P(), P(), P(), split, split, split), out_specs=(split, split, split, split),
        axis_names={PIPE_AXIS}, check_vma=False)(weights, keys, shared, tail_params, consts, xs, args, fields)
    return jax.tree.map(lambda a: a.sum(0), aux), dw, dtp, dxs
