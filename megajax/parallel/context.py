"""Context parallelism's layout of a sequence (``mesh.context`` > 1): every sequence is split over the ``context``
axis for the whole layer stack (the ``seq`` rule), and attention gathers its keys and values whole (an all-gather
over ``context`` each layer, its transpose a reduce-scatter of their gradients: Llama 3's choice, Megatron-Core's
``all_gather`` communication type). Causal attention gives a query the keys before it, so a device holding the
last chunk would do C times the work of the first; each device holds instead chunks ``i`` and ``2C - 1 - i`` of
the sequence cut in 2C (Megatron-Core's and Llama 3's load balance), the same count of visible (query, key) pairs
on every device. The objective permutes each row's inputs, targets and packed fields into that order before the
model (``balanced``) and gives the model each token's true position; a mean over tokens does not see the order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from megajax.parallel.sharding import axis_of, batch_rows, constrain, mesh_size, on_shards, sequence_positions

# attention's keys and values (B, S_kv, N, D): the sequence whole on every device, whatever splits the queries'
KV_NAMES = ("batch", None, "heads", "head_dim")


def balanced_order(seq: int, shards: int) -> np.ndarray:
    """The positions of a sequence of ``seq`` tokens in the order the ``shards`` context shards hold them: shard
    ``i``'s contiguous block is chunks ``i`` and ``2 * shards - 1 - i`` of ``2 * shards`` equal chunks."""
    if seq % (2 * shards):
        raise ValueError(f"a sequence of {seq} tokens does not cut into 2 x {shards} equal chunks")
    chunks = np.arange(seq).reshape(2 * shards, -1)
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * shards - 1 - i]]) for i in range(shards)])


def balanced(rows: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """``rows`` (each (B, S, ...) token-aligned: inputs, targets, packed fields) in the order of ``balanced_order``
    over the active mesh's context shards, with ``positions`` (B, S) (each token's, carried along where given, else
    its index in the row) and ``order`` (S,) (each held token's index in its row: what keys dropout, through
    ``sharding.positions_of``); unchanged without context shards."""
    shards = mesh_size("seq")
    if shards == 1:
        return rows
    b, s = next(iter(rows.values())).shape[:2]
    order = balanced_order(s, shards)
    out = {k: v[:, order] for k, v in rows.items()}
    if "positions" not in out:
        out["positions"] = jnp.broadcast_to(jnp.asarray(order, jnp.int32), (b, s))
    out["order"] = jnp.asarray(order, jnp.int32)
    return out



class AttentionDropout(NamedTuple):
    """Attention dropout's key with where the probabilities an attention core traces sit in the step's: their rows
    (B,), heads (N,) and queries' positions (S_q,), and the positions of the keys in the order they are held (S_kv,):
    what ``attention`` passes a core running on one device's blocks, so its mask is the plain step's
    (``layers.dropout`` keyed by row, head and query position over the keys in position order)."""

    key: jax.Array
    rows: jax.Array
    heads: jax.Array
    queries: jax.Array
    keys: jax.Array


def attention(core: Callable[..., jax.Array], q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
              key: jax.Array | None, rate: float) -> jax.Array:
    """``core(q, k, v, mask, key, rate)`` (an attention core: (B, S, N, D) -> (B, S, N, D)) with every key and value
    of the sequence: under context parallelism on each device's blocks (a ``shard_map``), its queries' chunks
    against the keys and values all-gathered over ``context`` (whose gradient's transpose is a reduce-scatter:
    each device's queries give part of every key's gradient); otherwise with the keys and values pinned whole.
    ``mask`` (B or 1, 1, S_q or 1, S_kv): the queries' rows split as theirs."""
    axis = axis_of("seq")
    if axis is None:
        return core(q, constrain(k, KV_NAMES), constrain(v, KV_NAMES), mask, key, rate)

    positions = sequence_positions(q.shape[1])  # the whole sequence's, in the order the activations hold it
    head_axis = axis_of("heads")

    def local(q, k, v, mask, rows, queries):
        k, v = (jax.lax.all_gather(a, axis, axis=1, tiled=True) for a in (k, v))
        drop = key
        if key is not None and rate > 0:  # the device's rows, heads and queries, keyed as the plain step's
            n = q.shape[2]
            heads = jnp.arange(n) + (jax.lax.axis_index(head_axis) * n if head_axis else 0)
            drop = AttentionDropout(key, rows, heads, queries, positions)
        return core(q, k, v, mask, drop, rate)

    names = ("batch", "seq", "heads", "head_dim")
    mask_names = ("batch" if mask.shape[0] > 1 else None, None, "seq" if mask.shape[2] > 1 else None, None)
    args = (q, k, v, mask, batch_rows(q.shape[0]), positions)
    # the keys' all-gather is varying -> varying (its transpose the reduce-scatter of their gradient), so the output's
    # layout cannot be proven by the varying-axes check once a pipeline stage's vmaps wrap the call; it is as declared
    # (the steps on context shards, with and without stages, equal the one-device step's)
    return on_shards(local, args, (names, names, names, mask_names, ("batch",), ("seq",)), names, check_vma=False)
