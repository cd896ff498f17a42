"""A mixture-of-experts layer's assignments taken to their experts and back: the expert-parallel exchange and the
experts' grouped GEMMs (``parallel/grouped_gemm``), run on each device's blocks inside the layer's ``shard_map``.

Two exchanges give the same results (``model.expert_exchange``):

- ``blocks``: one all-to-all of a block per destination shard, each with room for every assignment the shard can
  send it (``block`` below): static shapes, so dropless up to e times the routed rows cross the links, and the
  rows' expert ids go with them; the experts run on the first ``room`` rows of what arrived, grouped. XLA:CPU runs
  only this one.
- ``ragged``: ``jax.lax.ragged_all_to_all`` sends each destination its own rows only, one slice per (destination,
  expert), placed on the receiver grouped by expert and source, so the grouped GEMMs read them as they land, and
  brings the outputs back the same way to the places they left; the counts and offsets go first (three small
  all-to-alls of integers), no ids. Only the routed rows move; the receive buffer has the room ``room`` below.
  XLA:CPU has no ragged all-to-all ("UNIMPLEMENTED"), so on the CPU the same program runs with the primitive's
  semantics built from a blocks all-to-all (``emulated_ragged_all_to_all``): what tests check the ragged path's
  offsets with.

``auto`` (the default) is ``ragged`` where the step is traced for NVIDIA GPUs, ``blocks`` elsewhere.

Static shapes bound what a shard sends a destination (``block`` rows: a token's k experts are distinct, so it sends
a shard of E / e experts at most min(k, E / e) rows) and what a destination receives (``room`` rows: dropless, e
blocks, every source's rows for this shard). Where the room is less (``model.expert_room``), each destination takes
what fits (``within_room``), water-filling its experts (each keeps its rows up to one level, the largest the room
holds), each expert's in the order of its group's batch (source shard, token, rank); the rest are dropped and
counted, the same in both exchanges.
"""

import jax
import jax.numpy as jnp

from megajax.parallel.grouped_gemm import grouped_gemm
from megajax.parallel.xla_options import platform_choice

EXCHANGES = ("auto", "blocks", "ragged")


def exchange_of(setting: str) -> str:
    """The exchange a step traced now runs for ``model.expert_exchange`` = ``setting``: ``blocks``, ``ragged`` (the
    collective itself) or ``emulated`` (the ragged program with the collective emulated: not an NVIDIA GPU)."""
    return platform_choice(setting, "model.expert_exchange", "ragged", "blocks", "emulated")


def emulated_ragged_all_to_all(operand: jax.Array, output: jax.Array, input_offsets: jax.Array,
                               send_sizes: jax.Array, output_offsets: jax.Array, recv_sizes: jax.Array, *,
                               axis_name: str) -> jax.Array:
    """``jax.lax.ragged_all_to_all``'s result, from an all-to-all of blocks with room for a whole ``operand`` per
    slice: slice i of the K goes to shard i // (K / shards), landing at ``output_offsets[i]`` there; received slices
    overwrite ``output``'s rows, the rest keep its values. Linear in ``operand`` and ``output``, so its derivative
    is the primitive's too."""
    shards = jax.lax.axis_size(axis_name)
    slices, room = input_offsets.shape[0], operand.shape[0]
    along = jnp.arange(room)
    rows = jnp.minimum(input_offsets[:, None] + along, room - 1)  # (K, room)
    valid = (along < send_sizes[:, None]).reshape(slices, room, *(1,) * (operand.ndim - 1))
    sent = jnp.where(valid, operand[rows], 0)  # (K, room, ...)
    a2a = lambda v: jax.lax.all_to_all(v, axis_name, 0, 0, tiled=True)  # noqa: E731
    got = a2a(sent.reshape(shards, slices // shards * room, *operand.shape[1:])).reshape(sent.shape)
    at = a2a(output_offsets)[:, None] + along  # where each received slice's rows go here
    at = jnp.where(along < recv_sizes[:, None], at, output.shape[0])  # past the end: dropped
    return output.at[at.reshape(-1)].set(got.reshape(-1, *operand.shape[1:]), mode="drop")


def expert_mlp(rows: jax.Array, sizes: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array,
               dtype: jnp.dtype, gemm: str = "xla", fp8: bool = False) -> jax.Array:
    """The local experts' SwiGLU over ``rows`` grouped by expert (``sizes`` rows each, in order; rows past their sum
    give zeros), three grouped GEMMs (``gemm``: ``grouped_gemm.gemm_of``; ``fp8``: the kernels' in FP8)."""
    hidden = jax.nn.silu(grouped_gemm(rows, gate.astype(dtype), sizes, gemm, fp8)) * grouped_gemm(
        rows, up.astype(dtype), sizes, gemm, fp8)
    return grouped_gemm(hidden, down.astype(dtype), sizes, gemm, fp8)


def experts_forward(x: jax.Array, experts: jax.Array, weights: jax.Array, kept: jax.Array, gate: jax.Array,
                    up: jax.Array, down: jax.Array, num_experts: int, expert_axis: str | None, dtype: jnp.dtype,
                    block: int, room: int, exchange: str = "blocks", gemm: str = "xla", fp8: bool = False
                    ) -> tuple[jax.Array, jax.Array]:
    """(sum_j weights[t, j] * expert_{experts[t, j]}(x[t]) over the assignments taken, which of the ``kept`` ones
    were taken (T, k)): (T, H) -> (T, H), a partial sum where the experts' ``mlp`` width is split (the caller reduces
    it).

    This shard holds ``gate.shape[0]`` of the ``num_experts`` experts (the ``expert_axis`` shard's consecutive
    block). Its assignments are sorted by expert (so by destination shard), exchanged (``exchange``: ``blocks``,
    ``ragged`` or ``emulated``, see the module), run through their experts (``gemm``: ``grouped_gemm.gemm_of``; ``fp8``:
    its kernels in FP8) and returned. A shard sends a destination at most ``block`` rows and a destination receives at
    most ``room`` (``MoEConfig.exchange_sizes``); where that is less than every source's block, what does not fit is
    dropped (``within_room``)."""
    t, k = experts.shape
    local = gate.shape[0]
    shards = num_experts // local
    expert = jnp.where(kept, experts, num_experts).reshape(-1)  # a dropped assignment sorts after every expert
    if shards > 1 and room < shards * block:
        expert = within_room(expert, num_experts, local, room, expert_axis)
        kept = (expert < num_experts).reshape(t, k)
    order = jnp.argsort(expert, stable=True)  # grouped by expert, so by destination shard
    rows = x.astype(dtype)[order // k]  # (n, h) in that order
    if shards > 1 and exchange != "blocks":
        out = _ragged(rows, expert, gate, up, down, num_experts, expert_axis, dtype, room, exchange, gemm, fp8)
    else:
        out = _blocks(rows, expert[order], gate, up, down, num_experts, expert_axis, dtype, block, room, gemm, fp8)
    out = jnp.zeros_like(out).at[order].set(out).reshape(t, k, -1)  # back to (token, rank); dropped: zeros
    return (out * jnp.where(kept, weights, 0.0).astype(dtype)[..., None]).sum(1), kept


def water_level(totals: jax.Array, room: int) -> jax.Array:
    """The largest level L >= 0 with sum(min(totals, L)) <= ``room`` (any L >= max(totals) where all fit: that
    max), found by bisection over the integers (totals are counts of rows)."""
    if totals.shape[0] == 0:
        return jnp.zeros((), totals.dtype)
    most = totals.max()
    # where not everything fits, the level is at most the room (f(L) >= L for L <= max): bisect [0, room]
    lo, hi = jnp.zeros((), totals.dtype), jnp.minimum(most, room).astype(totals.dtype)
    for _ in range(max(int(room), 1).bit_length() + 1):
        mid = (lo + hi + 1) // 2
        fits = jnp.minimum(totals, mid).sum() <= room
        lo, hi = jnp.where(fits, mid, lo), jnp.where(fits, hi, mid - 1)
    return jnp.where(totals.sum() <= room, most, lo)


def within_room(expert: jax.Array, num_experts: int, local: int, room: int, expert_axis: str) -> jax.Array:
    """``expert`` (n,), each assignment's expert (``num_experts``: dropped), with those the destinations' rooms do
    not take dropped: each destination's experts keep their rows up to ``water_level`` of the ``room``, each
    expert's in the order of its group's batch (the sources in shard order, each source's in token and rank order).
    Two all-to-alls of E integers a shard: the counts there, what each destination takes back."""
    shards, n = num_experts // local, expert.shape[0]
    a2a = lambda v: jax.lax.all_to_all(v, expert_axis, 0, 0, tiled=True)  # noqa: E731
    counts = jnp.bincount(expert, length=num_experts + 1)  # the last: the dropped ones
    got = a2a(counts[:num_experts].reshape(shards, local))  # (source, local expert): what this shard is sent
    totals = got.sum(0)
    taken = jnp.minimum(totals, water_level(totals, room))  # each local expert's rows kept
    before = jnp.cumsum(got, 0) - got  # the earlier sources' rows of each expert
    allowed = a2a(jnp.clip(taken[None, :] - before, 0, got)).reshape(-1)  # (E,): what each expert takes of ours
    order = jnp.argsort(expert, stable=True)
    grouped = expert[order]
    rank = jnp.arange(n) - (jnp.cumsum(counts) - counts)[grouped]  # each one's place among its expert's, in order
    fits = rank < jnp.concatenate([allowed, jnp.zeros((1,), allowed.dtype)])[grouped]
    return jnp.zeros_like(expert).at[order].set(jnp.where(fits, grouped, num_experts))


def _blocks(rows: jax.Array, expert: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, num_experts: int,
            expert_axis: str | None, dtype: jnp.dtype, block: int, room: int, gemm: str, fp8: bool) -> jax.Array:
    """The blocks exchange of ``rows`` sorted by ``expert`` (``num_experts``: dropped), their outputs in that order;
    the experts run on the first ``room`` rows of what arrived, grouped (the rest are empty)."""
    n, h = rows.shape
    local = gate.shape[0]
    shards = num_experts // local
    dest = expert // local  # `shards` for a dropped one
    counts = jnp.bincount(dest, length=shards + 1)
    place = jnp.arange(n) - (jnp.cumsum(counts) - counts)[dest]  # its row in its destination's block
    place = jnp.where(dest < shards, place, 0)  # the dropped share one row of the discarded block
    send = jnp.zeros((shards + 1, block, h), dtype).at[dest, place].set(rows)[:shards]
    ids = jnp.full((shards + 1, block), local, jnp.int32).at[dest, place].set(expert % local)[:shards]
    if shards > 1:
        send, ids = (jax.lax.all_to_all(a, expert_axis, 0, 0, tiled=True) for a in (send, ids))
    ids = ids.reshape(-1)  # what arrived, by source shard: each row's expert on this shard (`local`: an empty row)
    grouped = jnp.argsort(ids, stable=True)[:room]  # the empty rows sort last
    sizes = jnp.bincount(ids, length=local + 1)[:local].astype(jnp.int32)  # rows past their sum are not computed
    out = expert_mlp(send.reshape(-1, h)[grouped], sizes, gate, up, down, dtype, gemm, fp8)  # zeros past the groups
    out = jnp.zeros_like(out, shape=(shards * block, h)).at[grouped].set(out).reshape(shards, block, h)
    if shards > 1:
        out = jax.lax.all_to_all(out, expert_axis, 0, 0, tiled=True)
    return jnp.concatenate([out, jnp.zeros((1, block, h), dtype)])[dest, place]  # a dropped assignment's: zeros


def _ragged(rows: jax.Array, expert: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, num_experts: int,
            expert_axis: str, dtype: jnp.dtype, room: int, exchange: str, gemm: str, fp8: bool) -> jax.Array:
    """The ragged exchange of ``rows`` (sorted by expert; ``expert`` unsorted, ``num_experts``: dropped), their
    outputs in that order; ``room`` rows received at most."""
    h, local = rows.shape[1], gate.shape[0]
    shards = num_experts // local
    move = jax.lax.ragged_all_to_all if exchange == "ragged" else emulated_ragged_all_to_all
    a2a = lambda v: jax.lax.all_to_all(v, expert_axis, 0, 0, tiled=True)  # noqa: E731
    sent = jnp.bincount(expert, length=num_experts).reshape(shards, local)  # to shard j's expert l (dropped: none)
    sent_at = (jnp.cumsum(sent.reshape(-1)) - sent.reshape(-1)).reshape(shards, local)  # its rows here, in order
    got = a2a(sent)  # (source i, local expert l): what this shard receives
    per_expert = got.sum(0)
    # received rows grouped by expert, each expert's by source: expert l's run starts after the earlier experts'
    got_at = (jnp.cumsum(per_expert) - per_expert)[None, :] + jnp.cumsum(got, 0) - got
    flat = lambda v: v.reshape(-1).astype(jnp.int32)  # noqa: E731
    # the buffers take the rows' varying axes: a fresh zeros would be cast to them, and under recomputation that
    # cast's transpose all-reduced the whole receive buffer's gradient over `expert` (compiled for H100s)
    buffer = jnp.zeros_like(rows, shape=(room, h))
    received = move(rows, buffer, flat(sent_at), flat(sent), flat(a2a(got_at)), flat(got), axis_name=expert_axis)
    out = expert_mlp(received, per_expert.astype(jnp.int32), gate, up, down, dtype, gemm, fp8)  # zeros past the groups
    return move(out, jnp.zeros_like(rows), flat(got_at), flat(got), flat(a2a(sent_at)), flat(sent),
                axis_name=expert_axis)
