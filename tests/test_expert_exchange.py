"""The expert-parallel exchange's bounds (``parallel/expert_exchange``): a block sized min(k, E / e) rows a token holds
the worst case a router can send one shard, and a receive room under it (``model.expert_room``) drops what does not
fit by its rule, the same in both exchanges; each against float64 numpy."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from megajax.models.moe import MoEConfig
from megajax.parallel.expert_exchange import experts_forward, water_level

SHARDS, LOCAL, K, TOKENS, H, F = 4, 2, 2, 6, 8, 12
E = SHARDS * LOCAL


def _routing(seed: int) -> np.ndarray:
    """(shards, tokens, k) distinct experts a token: every token of shard 1 sends both its rows to shard 0's experts
    (a whole block, the most one source can send one destination), the even tokens of the others one row to expert
    0 (so shard 0's two experts get unequal loads), the rest at random."""
    rng = np.random.default_rng(seed)
    experts = np.stack([rng.permutation(E)[:K] for _ in range(SHARDS * TOKENS)]).reshape(SHARDS, TOKENS, K)
    experts[:, ::2, 0] = 0
    experts[:, ::2, 1] = np.where(experts[:, ::2, 1] == 0, 5, experts[:, ::2, 1])
    experts[1] = [0, 1]
    return experts


def _room_reference(experts: np.ndarray, kept: np.ndarray, room: int) -> np.ndarray:
    """Which assignments the destinations take: each destination's experts water-filled to the largest level whose
    rows fit ``room``, each expert's rows in the order of the group's batch (source, token, rank)."""
    taken = kept.copy()
    for dest in range(SHARDS):
        ours = range(dest * LOCAL, (dest + 1) * LOCAL)
        totals = np.array([(experts[kept] == x).sum() for x in ours])
        level = max(L for L in range(totals.max() + 1) if np.minimum(totals, L).sum() <= room)
        room_left = dict(zip(ours, np.minimum(totals, level)))
        for i, t, j in np.ndindex(experts.shape):
            x = experts[i, t, j]
            if kept[i, t, j] and x in room_left:
                taken[i, t, j] = room_left[x] > 0
                room_left[x] -= 1
    return taken


def _float64(x, experts, weights, taken, gate, up, down) -> np.ndarray:
    """Each token's weighted sum of its taken experts' SwiGLU, token by token."""
    out = np.zeros_like(x)
    for i, t, j in np.ndindex(experts.shape):
        if taken[i, t, j]:
            a = x[i, t] @ gate[experts[i, t, j]]
            out[i, t] += weights[i, t, j] * ((a / (1 + np.exp(-a))) * (x[i, t] @ up[experts[i, t, j]])) @ down[
                experts[i, t, j]]
    return out


@pytest.mark.parametrize("exchange", ["blocks", "emulated"])
@pytest.mark.parametrize("room", [None, 20])
def test_the_exchange_holds_the_worst_case_and_drops_by_the_room_rule(exchange, room):
    """Shard 1 sends shard 0 a whole block (both rows of each of its tokens, k = 2 = E / e there) and the others
    more to its expert 0: with the block of min(k, E / e) x T rows per source and room for every source's, nothing
    is lost; with a room of 20 rows (shard 0 is sent 26, 17 for expert 0 and 9 for expert 1) the water level is
    11, so expert 1 keeps all 9 and expert 0 its first 11 in source, token, rank order, the rest counted as dropped;
    the kept mask as float64 numpy's rule says, the outputs within 1e-5 of float64 numpy, both exchanges."""
    rng = np.random.default_rng(0)
    experts = _routing(1)
    kept = rng.random(experts.shape) > 0.1  # some dropped before (a capacity's)
    kept[1] = True  # shard 1 sends shard 0 a whole block
    x = rng.normal(size=(SHARDS, TOKENS, H)).astype(np.float32)
    weights = rng.random(experts.shape).astype(np.float32)
    gate, up = (rng.normal(size=(E, H, F)).astype(np.float32) / 3 for _ in range(2))
    down = rng.normal(size=(E, F, H)).astype(np.float32) / 3
    block = TOKENS * min(K, LOCAL)
    assert MoEConfig(num_experts=E, experts_per_token=K, max_seq_len=TOKENS).exchange_sizes(TOKENS, 1, SHARDS) == (
        block, SHARDS * block)
    worst = max((experts[kept] // LOCAL == d).sum() for d in range(SHARDS))
    assert (experts[1] // LOCAL == 0).sum() == block  # one source fills its block to shard 0
    if room is None:
        room = SHARDS * block
        assert worst > SHARDS * TOKENS  # more than balanced routing sends, within the room
    else:
        assert room < worst
    fn = functools.partial(experts_forward, num_experts=E, expert_axis="expert", dtype=jnp.float32, block=min(
        block, room), room=room, exchange=exchange, gemm="xla")
    mesh = Mesh(np.array(jax.devices()[:SHARDS]), ("expert",))
    squeeze = lambda f: lambda *a: tuple(o[None] for o in f(*(v[0] for v in a[:4]), *a[4:]))  # noqa: E731
    run = jax.jit(jax.shard_map(squeeze(fn), mesh=mesh, in_specs=(P("expert"),) * 7,
                                out_specs=(P("expert"), P("expert")), check_vma=False))
    y, taken = run(x, experts.astype(np.int32), weights, kept, gate, up, down)
    want = _room_reference(experts, kept, room)
    np.testing.assert_array_equal(np.asarray(taken), want)
    assert (want != kept).any() == (room < worst)  # the room bites exactly where it is under the worst case
    if room < worst:  # shard 0's expert 1 keeps its 9 rows, under the level; its expert 0 is cut to the level, 11
        assert (kept[experts == 0].sum(), kept[experts == 1].sum()) == (17, 9)
        assert (want[experts == 0].sum(), want[experts == 1].sum()) == (11, 9)
    ref = _float64(*(a.astype(np.float64) for a in (x,)), experts, weights.astype(np.float64), want,
                   *(a.astype(np.float64) for a in (gate, up, down)))
    np.testing.assert_allclose(np.asarray(y), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_water_level_is_the_largest_that_fits():
    """The bisection against trying every level, on 200 random count vectors and rooms (all fitting included)."""
    rng = np.random.default_rng(2)
    for _ in range(200):
        totals = rng.integers(0, 30, size=rng.integers(1, 6))
        room = int(rng.integers(0, 100))
        got = int(water_level(jnp.asarray(totals, jnp.int32), room))
        if totals.sum() <= room:
            assert got == totals.max()
        else:
            assert got == max(L for L in range(totals.max() + 1) if np.minimum(totals, L).sum() <= room)


def test_the_room_is_set_by_expert_room_on_expert_shards_only():
    """``exchange_sizes`` for T = 32 tokens, k = 2 of 8 experts: dropless every source's block of min(k, E / e) x
    T rows; ``expert_room`` r on e > 1 shards: ceil(r x T k) rows, a block no larger; on one shard nothing changes."""
    sizes = lambda room, expert: MoEConfig(num_experts=8, experts_per_token=2, max_seq_len=16,  # noqa: E731
                                           expert_room=room).exchange_sizes(32, 2, expert)
    assert sizes(0, 4) == (64, 256)
    assert sizes(0, 8) == (32, 256)  # one expert a shard: a token sends it one row at most
    assert sizes(1.5, 4) == (64, 96)
    assert sizes(0.5, 4) == (32, 32)
    assert sizes(0.5, 1) == (64, 64)
