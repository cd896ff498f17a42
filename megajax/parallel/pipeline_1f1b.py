"""The 1F1B pipeline schedule (one forward, one backward) in one SPMD program over the mesh's ``pipe`` axis.

Narayanan et al. 2021 (PipeDream-Flush): after a warm-up, each stage alternates one microbatch's forward with an
earlier one's backward, so a stage holds a bounded number of microbatches whatever their count M, where GPipe holds
every microbatch's activations until the backward pipeline starts. Here the stages run in lockstep ticks of a
``lax.scan`` inside a ``shard_map`` manual over ``pipe`` (each device knows its stage: ``lax.axis_index``):

* on tick ``t`` stage ``s`` runs the forward of microbatch ``t - s`` and the backward of microbatch
  ``t - 2 (p - 1) + s``; each half runs under ``lax.cond``, so a stage with nothing to do skips it. M + 2p - 2
  ticks; the first p - 1 have forwards only and the last p - 1 backwards only, so the step takes about
  (M + p - 1)(F + B): GPipe's bubble (F and B as the model's remat policy makes them).
* the last stage runs its forward, the loss's tail (``tail_fn``: final norm, head and loss on the microbatch's
  rows) and both backwards in one tick: ``jax.vjp`` of the stage and the tail, seeded with the loss's weight.
* every other stage's forward is split from its backward (``_residuals``): the forward tick keeps the residuals
  ``jax.vjp`` saves of the microbatch (what the remat policy keeps; what depends on the weights alone, such as their
  half-precision copies, is computed again in the backward tick, not stored per microbatch) in a ring of
  min(2p - 1, M) slots (stage s needs 2 (p - 1 - s) + 1; one shape on every stage), and the backward tick applies
  the pullback to them. With ``recompute`` (``parallel.pipeline_stage_recompute``) the residuals are the stage's
  inputs (one ``jax.checkpoint`` round the stage): the stage's forward runs again in its backward, and one
  microbatch's activations exist at a time.
* per tick, collective permutes over ``pipe``: outputs (with the rows' per-row arguments and batch fields) one stage
  on, input gradients one stage back, and two columns of the stages' shares of the batch (``pipeline.run``'s ``io``):
  one brings stage 0 its next input, the other takes stage 0's input gradient to the stage whose share it is.

The parameters' gradients are accumulated in the loop's carry, each data replica's in its own copy (the stage
function's and the tail's), so nothing is reduced per tick; the caller reduces them once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax._src.interpreters import partial_eval as pe  # dce_jaxpr: no public equivalent (jax 0.10)
from jax.sharding import PartitionSpec as P

from megajax.parallel.sharding import PIPE_AXIS


def ticks(num_micro: int, num_stages: int) -> int:
    """The 1F1B schedule's lockstep ticks: the last microbatch's forward reaches the last stage on tick M + p - 2
    and its backward stage 0 p - 1 ticks later."""
    return num_micro + 2 * (num_stages - 1)


def held(num_micro: int, num_stages: int) -> int:
    """Microbatches whose residuals a stage holds between their forward and their backward: stage s holds
    2 (p - 1 - s) + 1, or all M if fewer; the ring has stage 0's count on every stage (one program)."""
    return min(2 * num_stages - 1, num_micro)


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


def _residuals(fn: Callable[[Any, jax.Array, Any], jax.Array], weights: Any, x: jax.Array, args: Any) -> _Residuals:
    """Split the vjp of ``fn(weights, x, args)`` (x and weights differentiated) into a forward that returns the
    microbatch's residuals and a program that recomputes the rest from the weights (``_Residuals``). A residual is
    the microbatch's where its jaxpr, dead code removed, reads ``x`` or ``args``."""
    box = {}

    def traced(w, x, a):
        y, pull = jax.vjp(lambda w, x: fn(w, x, a), w, x)
        leaves, box["tree"] = jax.tree.flatten(pull)
        return [y, *leaves]

    closed = jax.make_jaxpr(traced)(weights, x, args)
    n_w = len(jax.tree.leaves(weights))
    count = len(closed.jaxpr.outvars) - 1
    kept = []
    for i in range(count):
        _, reads = _program(closed, [j == i + 1 for j in range(count + 1)])
        kept.append(any(reads[n_w:]))
    forward, _ = _program(closed, [True, *kept])
    flat = lambda *trees: [a for t in trees for a in jax.tree.leaves(t)]  # noqa: E731
    shapes = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype)
              for v, k in zip(closed.jaxpr.outvars[1:], kept, strict=True) if k]
    if all(kept):  # (a side effect that reads the microbatch is in every leaf's program: all are kept)
        return _Residuals(lambda w, x, a: forward(*flat(w, x, a)), lambda w: [], kept, box["tree"], shapes)
    rest, reads = _program(closed, [False, *(not k for k in kept)])
    assert not any(reads[n_w:]), "a residual left to the backward reads the microbatch"
    return _Residuals(lambda w, x, a: forward(*flat(w, x, a)),
                      lambda w: rest(*flat(w, jnp.zeros_like(x), jax.tree.map(jnp.zeros_like, args))),
                      kept, box["tree"], shapes)


def _zeros(tree: Any) -> Any:
    return jax.tree.map(jnp.zeros_like, tree)


def _where(flag: jax.Array, a: Any, b: Any) -> Any:
    return jax.tree.map(lambda x, y: jnp.where(flag, x, y), a, b)


def run(stage_fn: Callable[[Any, Any, Any, jax.Array, Any], jax.Array],
        tail_fn: Callable[[Any, Any, jax.Array, Any, Any], tuple[jax.Array, Any]],
        weights: Any, keys: Any, shared: Any, tail_params: Any, consts: Any, xs: jax.Array, args: Any, fields: Any,
        recompute: bool = False) -> tuple[Any, Any, Any, jax.Array]:
    """The 1F1B schedule over the M microbatches ``xs``; returns (the tail's summed outputs, the gradients of
    ``weights``, of ``tail_params``, of ``xs``).

    ``stage_fn(weights, keys, shared, x, args) -> y``: a stage's layers on one microbatch (``weights``, ``keys``: the
    stage's, leaves leading with (stages, ...) split over ``pipe``; ``keys`` not differentiated; ``shared``: whole on
    every stage, not differentiated). ``tail_fn(tail_params,
    consts, y, args, fields) -> (seed, aux)``: the loss's tail on the last stage's output ``y`` of a microbatch;
    ``seed`` is what is differentiated (the loss contribution times its scale), ``aux`` is summed over the
    microbatches and returned. ``tail_params``, ``consts``: whole on every stage. ``xs``, ``args``, ``fields``:
    (p, K, mb, ...) split over ``pipe``, stage j's share holding microbatches j K .. j K + K - 1 (as
    ``pipeline.run``). The gradients of ``tail_params`` are summed over the stages; those of ``weights`` and ``xs``
    are laid out as their primals. ``recompute``: hold each microbatch's stage input instead of its residuals and run
    the stage's forward again in its backward.
    """
    p, k_cols = xs.shape[:2]
    num_micro = p * k_cols
    ring = held(num_micro, p)
    forward = [(s, s + 1) for s in range(p - 1)]
    backward = [(s + 1, s) for s in range(p - 1)]
    ring_down = [(s, (s - 1) % p) for s in range(p)]

    def body(weights, keys, shared, tail_params, consts, xs, args, fields):
        own = lambda tree: jax.tree.map(lambda a: a[0], tree)  # noqa: E731  (this stage's block)
        weights, keys, xs, args, fields = own(weights), own(keys), own(xs), own(args), own(fields)
        s = jax.lax.axis_index(PIPE_AXIS)
        first, last = s == 0, s == p - 1
        one = lambda tree: jax.tree.map(lambda a: jnp.zeros_like(a[0]), tree)  # noqa: E731  (one microbatch's)
        x0, args0, fields0 = one(xs), one(args), one(fields)
        aux0 = jax.eval_shape(lambda: tail_fn(tail_params, consts, x0, args0, fields0)[1])
        aux0 = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), aux0)

        def stage(w, x, a):
            return stage_fn(w, keys, shared, x, a)

        # recompute: the stage's residuals are its inputs (one checkpoint round the whole stage)
        halves = _residuals(jax.checkpoint(stage) if recompute else stage, weights, x0, args0)

        def forward_half(x, a, held, slot):  # the stage's output; the residuals its backward needs of this
            # microbatch written into their slot of the ring
            y, *kept = halves.forward(weights, x, a)
            return y, [h.at[slot].set(v) for h, v in zip(held, kept, strict=True)]

        def last_half(x, a, f):  # the last stage: forward, tail, both backwards
            def whole(w, tp, x):
                return tail_fn(tp, consts, stage_fn(w, keys, shared, x, a), a, f)

            seed, pull, aux = jax.vjp(whole, weights, tail_params, x, has_aux=True)
            dw, dtp, dx = pull(jnp.ones_like(seed))
            return dw, dtp, dx, aux

        def middle_half(kept, g):  # another stage: its backward from the residuals its forward kept
            dw, dx = halves.pullback(kept, halves.rest(weights))(g)
            return dw, _zeros(tail_params), dx, aux0

        def tick(carry, t):
            inbox, grad_in, held, io, io_grad, dw_sum, dtp_sum, aux_sum = carry
            f, b = t - s, t - 2 * (p - 1) + s
            f_on = (f >= 0) & (f < num_micro)
            b_on = (b >= 0) & (b < num_micro)
            col = t % k_cols
            entry = jax.tree.map(lambda a: a[col], io)
            x, a, fl = _where(first, entry, inbox)
            # the residuals wait in the ring for the microbatch's backward (the last stage's are used at once)
            y, held = jax.lax.cond(f_on & ~last, forward_half, lambda x, a, held, slot: (jnp.zeros_like(x), held),
                                   x, a, held, f % ring)
            kept_b = [h[b % ring] for h in held]

            def backward_half(sums, x, a, fl, kept_b, g):  # the sums added to inside the branch: no second copy
                dw, dtp, dx, aux = jax.lax.cond(last, lambda: last_half(x, a, fl), lambda: middle_half(kept_b, g))
                return jax.tree.map(jnp.add, sums, (dw, dtp, aux)), dx

            def idle(sums, *_):
                return sums, jnp.zeros_like(x)

            (dw_sum, dtp_sum, aux_sum), dx = jax.lax.cond(b_on, backward_half, idle, (dw_sum, dtp_sum, aux_sum), x, a,
                                                          fl, kept_b, grad_in)
            permute = lambda tree, pairs: jax.tree.map(  # noqa: E731
                lambda v: jax.lax.ppermute(v, PIPE_AXIS, pairs), tree)
            inbox = permute((y, a, fl), forward)
            grad_in = permute(dx, backward)
            # the input column one stage towards stage 0; stage 0's input gradient put in its column, which then
            # turns one stage down the ring: microbatch j K + c's ends on stage j (p - j turns; ``run``)
            io = jax.tree.map(lambda a, c: a.at[col].set(c), io, permute(entry, backward))
            g_entry = jnp.where(first & b_on, dx, io_grad[col])
            io_grad = io_grad.at[col].set(permute(g_entry, ring_down))
            return (inbox, grad_in, held, io, io_grad, dw_sum, dtp_sum, aux_sum), None

        held = [jnp.zeros((ring, *a.shape), a.dtype) for a in halves.shapes]
        carry = ((x0, args0, fields0), x0, held, (xs, args, fields), jnp.zeros_like(xs), _zeros(weights),
                 _zeros(tail_params), aux0)
        carry, _ = jax.lax.scan(tick, carry, jnp.arange(ticks(num_micro, p)))
        *_, io_grad, dw, dtp, aux = carry
        dxs = jnp.roll(io_grad, -(2 * (p - 1)) % k_cols, axis=0)  # each in its own column
        lead = lambda tree: jax.tree.map(lambda a: a[None], tree)  # noqa: E731
        return lead(aux), lead(dw), lead(dtp), dxs[None]

    split = P(PIPE_AXIS)
    aux, dw, dtp, dxs = jax.shard_map(
        body, in_specs=(split, split, P(), P(), P(), split, split, split), out_specs=(split, split, split, split),
        axis_names={PIPE_AXIS}, check_vma=False)(weights, keys, shared, tail_params, consts, xs, args, fields)
    total = lambda tree: jax.tree.map(lambda a: a.sum(0), tree)  # noqa: E731  (the stages' sums)
    return total(aux), dw, total(dtp), dxs
