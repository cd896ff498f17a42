"""The 1F1B pipeline schedule (one forward, one backward) in one SPMD program over the mesh's ``pipe`` axis.

Narayanan et al. 2021 (PipeDream-Flush): after a warm-up, each stage alternates one microbatch's forward with an
earlier one's backward, so a stage holds a bounded number of microbatches whatever their count M, where GPipe holds
every microbatch's activations until the backward pipeline starts. Here the stages run in lockstep ticks of a
``lax.scan`` inside a ``shard_map`` manual over ``pipe`` (each device knows its stage: ``lax.axis_index``):

* on tick ``t`` stage ``s`` runs the forward of microbatch ``t - s`` and the backward of microbatch
  ``t - 2 (p - 1) + s``; each half runs under ``lax.cond``, so a stage with nothing to do skips it. M + 2p - 2
  ticks; the first p - 1 have forwards only and the last p - 1 backwards only, so the step takes about
  (M + p - 1)(2F + B): GPipe's bubble, with the forward recomputed in the backward as under ``remat=full``.
* the last stage runs its forward, the loss's tail (``tail_fn``: final norm, head and loss on the microbatch's
  rows) and both backwards in one tick: ``jax.vjp`` of the stage and the tail, seeded with the loss's weight.
* every other stage's backward is ``jax.vjp`` of its forward at the input it held: the stage keeps its microbatches'
  inputs (2 (p - 1 - s) + 1 of them at stage s, in a ring of 2p - 1 slots, one shape on every stage), not their
  activations; one microbatch's activations exist at a time, inside its backward.
* per tick, collective permutes over ``pipe``: outputs (with the rows' per-row arguments and batch fields) one stage
  on, input gradients one stage back, and two columns of the stages' shares of the batch (``pipeline.run``'s ``io``):
  one brings stage 0 its next input, the other takes stage 0's input gradient to the stage whose share it is.

The parameters' gradients are accumulated in the loop's carry, each data replica's in its own copy (the stage
function's and the tail's), so nothing is reduced per tick; the caller reduces them once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from megajax.parallel.sharding import PIPE_AXIS


def ticks(num_micro: int, num_stages: int) -> int:
    """The 1F1B schedule's lockstep ticks: the last microbatch's forward reaches the last stage on tick M + p - 2
    and its backward stage 0 p - 1 ticks later."""
    return num_micro + 2 * (num_stages - 1)


def held_inputs(num_stages: int) -> int:
    """Stage inputs a stage holds between a microbatch's forward and its backward: stage s holds 2 (p - 1 - s) + 1;
    the ring has stage 0's count on every stage (one program)."""
    return 2 * num_stages - 1


def _zeros(tree: Any) -> Any:
    return jax.tree.map(jnp.zeros_like, tree)


def _where(flag: jax.Array, a: Any, b: Any) -> Any:
    return jax.tree.map(lambda x, y: jnp.where(flag, x, y), a, b)


def run(stage_fn: Callable[[Any, Any, Any, jax.Array, Any], jax.Array],
        tail_fn: Callable[[Any, Any, jax.Array, Any, Any], tuple[jax.Array, Any]],
        weights: Any, keys: Any, shared: Any, tail_params: Any, consts: Any, xs: jax.Array, args: Any, fields: Any
        ) -> tuple[Any, Any, Any, jax.Array]:
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
    are laid out as their primals.
    """
    p, k_cols = xs.shape[:2]
    num_micro = p * k_cols
    ring = held_inputs(p)
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

        def forward_half(x, a):
            return stage_fn(weights, keys, shared, x, a)

        def last_half(x, a, f):  # the last stage: forward, tail, both backwards
            def whole(w, tp, x):
                return tail_fn(tp, consts, stage_fn(w, keys, shared, x, a), a, f)

            seed, pull, aux = jax.vjp(whole, weights, tail_params, x, has_aux=True)
            dw, dtp, dx = pull(jnp.ones_like(seed))
            return dw, dtp, dx, aux

        def middle_half(x, a, g):  # another stage: the forward again from its held input, then its backward
            _, pull = jax.vjp(lambda w, x: stage_fn(w, keys, shared, x, a), weights, x)
            dw, dx = pull(g)
            return dw, _zeros(tail_params), dx, aux0

        def tick(carry, t):
            inbox, grad_in, held, io, io_grad, dw_sum, dtp_sum, aux_sum = carry
            f, b = t - s, t - 2 * (p - 1) + s
            f_on = (f >= 0) & (f < num_micro)
            b_on = (b >= 0) & (b < num_micro)
            col = t % k_cols
            entry = jax.tree.map(lambda a: a[col], io)
            x, a, fl = _where(first, entry, inbox)
            # a stage's input waits in the ring for its backward (the last stage's is used at once)
            held = jax.tree.map(lambda h, v: jnp.where(f_on, h.at[f % ring].set(v), h), held, (x, a))
            y = jax.lax.cond(f_on & ~last, forward_half, lambda x, a: jnp.zeros_like(x), x, a)
            xb, ab = jax.tree.map(lambda h: h[b % ring], held)

            def backward_half(sums, x, a, fl, xb, ab, g):  # the sums added to inside the branch: no second copy
                dw, dtp, dx, aux = jax.lax.cond(last, lambda: last_half(x, a, fl), lambda: middle_half(xb, ab, g))
                return jax.tree.map(jnp.add, sums, (dw, dtp, aux)), dx

            def idle(sums, *_):
                return sums, jnp.zeros_like(x)

            (dw_sum, dtp_sum, aux_sum), dx = jax.lax.cond(b_on, backward_half, idle, (dw_sum, dtp_sum, aux_sum), x, a,
                                                          fl, xb, ab, grad_in)
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

        held = jax.tree.map(lambda a: jnp.zeros((ring, *a.shape), a.dtype), (x0, args0))
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
