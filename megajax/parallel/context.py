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

import jax
import jax.numpy as jnp
import numpy as np

from megajax.parallel.sharding import axis_of, constrain, mesh_size, on_shards

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
    its index in the row); unchanged without context shards."""
    shards = mesh_size("seq")
    if shards == 1:
        return rows
    b, s = next(iter(rows.values())).shape[:2]
    order = balanced_order(s, shards)
    out = {k: v[:, order] for k, v in rows.items()}
    if "positions" not in out:
        out["positions"] = jnp.broadcast_to(jnp.asarray(order, jnp.int32), (b, s))
    return out



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

    def local(q, k, v, mask):
        k, v = (jax.lax.all_gather(a, axis, axis=1, tiled=True) for a in (k, v))
        return core(q, k, v, mask, key, rate)

    names = ("batch", "seq", "heads", "head_dim")
    mask_names = ("batch" if mask.shape[0] > 1 else None, None, "seq" if mask.shape[2] > 1 else None, None)
    return on_shards(local, (q, k, v, mask), (names, names, names, mask_names), names)
