"""Array digests: equal to a plain numpy computation of the formula on every layout, and sensitive to any change."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from megajax.checkpoint.digest import _SEEDS, digests


def _fmix32_np(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def _reference(x: np.ndarray) -> str:
    """The documented formula on the host: flat row-major words, position-mixed, summed mod 2^32 per seed."""
    x = np.ascontiguousarray(x)
    if x.dtype == np.bool_:
        words = x.astype(np.uint32).ravel()
    else:
        words = x.view(f"uint{x.dtype.itemsize * 8}").astype(np.uint32).ravel()
    position = np.arange(words.size, dtype=np.uint64).astype(np.uint32)
    lanes = [int(np.sum(_fmix32_np(words ^ _fmix32_np(position ^ np.uint32(s))), dtype=np.uint64) % 2**32)
             for s in _SEEDS]
    return "".join(f"{v:08x}" for v in lanes)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=(jax.sharding.AxisType.Auto,) * 2)


def test_matches_numpy_on_every_layout(mesh):
    rng = np.random.default_rng(0)
    kernel = rng.standard_normal((2, 16, 4, 3, 8)).astype(np.float32)  # a stacked QKV kernel
    want = _reference(kernel)
    layouts = [P(), P(None, None, "model"), P("data", None, "model"), P(None, ("data", "model"))]
    for spec in layouts:
        placed = jax.device_put(kernel, NamedSharding(mesh, spec))
        assert digests({"k": placed})["k"] == want, spec
    others = {"bf16": rng.standard_normal((8, 12)).astype(ml_dtypes.bfloat16),
              "int32": rng.integers(-2**31, 2**31 - 1, (5, 7), dtype=np.int32),
              "uint32": rng.integers(0, 2**32 - 1, (2,), dtype=np.uint32),
              "bool": rng.random((3, 4)) > 0.5, "scalar": np.float32(3.5), "empty": np.zeros((0, 4), np.float32)}
    got = digests({k: jnp.asarray(v) for k, v in others.items()})
    assert got == {k: _reference(np.asarray(v)) for k, v in others.items()}


def test_any_changed_bit_or_moved_value_changes_the_digest(mesh):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 32)).astype(np.float32)
    sharded = NamedSharding(mesh, P("data", "model"))
    base = digests({"x": jax.device_put(x, sharded)})["x"]
    changed = {}
    for flat in rng.choice(x.size * 32, 12, replace=False):  # (element, bit) pairs anywhere in the array
        y = x.copy()
        y.view(np.uint32).reshape(-1)[flat // 32] ^= np.uint32(1 << (flat % 32))
        changed[f"bit {flat % 32} of element {flat // 32}"] = jax.device_put(y, sharded)
    swapped = x.copy()
    swapped[[3, 40]] = swapped[[40, 3]]
    changed["swap rows"] = jax.device_put(swapped, sharded)
    changed["transposed"] = jax.device_put(np.ascontiguousarray(x.reshape(32, 64).T).reshape(64, 32), sharded)
    got = digests(changed)
    assert all(v != base for v in got.values()), [k for k, v in got.items() if v == base]
    assert len(set(got.values())) == len(got)
