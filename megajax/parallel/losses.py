"""Fused vocab-parallel cross-entropy.

Written in plain jnp over logits pinned to ``('batch', 'seq', 'vocab')``: XLA reduces the per-token max, sum of
exponentials and target logit across ``model`` (b x s values each) and never gathers the b x s x v logits. The HLO
audit in the tests checks that this stays true.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from megajax.parallel.sharding import constrain, partly_manual


def mask_padded_vocab(logits: jax.Array, vocab_size: int) -> jax.Array:
    """Sends the logits of padding ids (>= vocab_size) to the dtype's minimum so they get no probability."""
    ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    return jnp.where(ids < vocab_size, logits, jnp.finfo(logits.dtype).min)


def vocab_parallel_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-token ``-log softmax(logits)[label]`` in fp32.

    Args:
      logits: (B, S, V) possibly sharded on V; padded ids already masked (``mask_padded_vocab``).
      labels: (B, S) int ids < V.
    Returns:
      (B, S) fp32 losses.
    """
    return vocab_parallel_nll_and_hit(logits, labels)[0]


def vocab_parallel_nll_and_hit(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(per-token fp32 losses, whether the label's logit is the maximum) from the same three per-token reductions
    over vocabulary shards (max, sum of exponentials, target logit): an accuracy metric costs no collective."""
    logits = constrain(logits.astype(jnp.float32), ("batch", "seq", "vocab"))
    top = jax.lax.stop_gradient(logits.max(axis=-1))  # (B, S)
    lse = top + jnp.log(jnp.sum(jnp.exp(logits - top[..., None]), axis=-1))  # as jax.nn.logsumexp
    if partly_manual():  # XLA's SPMD partitioner aborts on the gather below, the vocabulary split over `model` and
        # the rows over `data`, inside a shard_map manual over `pipe` (the 1F1B tail; jax 0.10): there the label's
        # logit is a masked sum over the vocabulary (each shard adds zeros but its own label's, so it is exact)
        ids = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
        target = jnp.sum(jnp.where(ids == labels[..., None], logits, 0.0), axis=-1)  # (B, S)
    else:
        target = jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]  # (B, S)
    return lse - target, target >= top


class Means:
    """How a loss divides its means: ``mean(values, weights)`` is ``sum(values * weights) / max(sum(weights), 1)`` in
    fp32 (without weights: the mean). Every mean a loss or its metrics take goes through the ``Means`` the loss is
    given, so a loss computed microbatch by microbatch can sum to the whole batch's (``Counted``, ``Given``)."""

    def mean(self, values: jax.Array, weights: jax.Array | None = None) -> jax.Array:
        """The weighted mean of ``values``, divided by ``divide(own count)``."""
        values = values.astype(jnp.float32)
        if weights is None:
            total, own = values.sum(), jnp.float32(values.size)
        else:
            weights = weights.astype(jnp.float32)
            total, own = (values * weights).sum(), jnp.maximum(weights.sum(), 1.0)
        return total / self.divide(own)

    def divide(self, own: jax.Array) -> jax.Array:
        """The denominator of a mean whose own count is ``own``: itself."""
        return own

    def share(self, own: int | jax.Array) -> jax.Array:
        """The weight of a term computed over a part of the batch of ``own`` tokens (a value that is not a sum over
        tokens, as a mixture's balancing loss): ``own / divide(own)``, 1 over the whole batch, the part's share of
        it under ``Given``."""
        own = jnp.asarray(own, jnp.float32)
        return own / self.divide(own)


OWN = Means()  # every mean over its own values: the plain step, evaluation


class Counted(Means):
    """Means over their own counts, each count recorded (``counts``, in the order the loss takes them): the 1F1B step
    traces the loss on the whole batch so."""

    def __init__(self) -> None:
        self.counts: list[jax.Array] = []

    def divide(self, own: jax.Array) -> jax.Array:
        self.counts.append(own)
        return own


class Given(Means):
    """Means divided by given counts, in order (``Counted``'s, of the whole batch): on a part of the batch each mean
    is then that part's share of the whole batch's (the 1F1B pipeline's loss per microbatch)."""

    def __init__(self, counts: list[jax.Array]) -> None:
        self._counts = iter(counts)

    def divide(self, own: jax.Array) -> jax.Array:
        return next(self._counts)


def lm_loss(model, tokens: jax.Array, labels: jax.Array, *, dropout_key: jax.Array | None = None,
            loss_mask: jax.Array | None = None, means: Means = OWN, **inputs) -> jax.Array:
    """Mean next-token cross-entropy of a language model over the tokens, weighted by ``loss_mask`` (B, S) where
    given (a mean ``means`` takes); ``inputs``: the model's other keyword arguments (a packed batch's ``segments``
    and ``positions``, how its layer stack runs)."""
    losses = vocab_parallel_cross_entropy(model(tokens, dropout_key=dropout_key, **inputs), labels)  # (B, S)
    return means.mean(losses, loss_mask)
