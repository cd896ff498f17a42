"""Dropout keyed by row (``layers.dropout``, ``sharding.rows_of``): a mask element depends on the key (seed, step,
layer), the row's index in the step's global batch and its place in the row only. So training with dropout gives
the same losses on every mesh, accumulation split and pipeline (several steps, 1e-6 relative), and each device
draws only its own rows' masks (the compiled HLO's random bits)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import choice_config, step_losses
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from megajax.config import base_config, rules_of
from megajax.parallel.layers import dropout
from megajax.parallel.mesh import MeshShape
from megajax.parallel.sharding import ParallelContext, activate, constrain, rows_of

STEPS = 3
RATE = 0.1


def test_a_rows_mask_is_its_own_whatever_the_batch_around_it():
    """Rows 5 and 2 of a batch, traced alone as those rows, draw the masks they draw in the whole batch; another
    key draws others."""
    x = jnp.ones((8, 4, 6))
    key = jax.random.key(3)
    whole = dropout(x, RATE, key)
    with rows_of(jnp.array([5, 2])):
        part = dropout(x[:2], RATE, key)
    np.testing.assert_array_equal(part, whole[jnp.array([5, 2])])
    assert not np.array_equal(whole, dropout(x, RATE, jax.random.key(4)))
    assert 0 < float((whole == 0).mean()) < 0.3  # it drops, at about the rate


def test_each_device_draws_only_its_own_rows():
    """On 8 data shards the compiled program's largest random-bits array is one device's 2 of the 16 rows."""
    mesh, rules = MeshShape(8, 1).make(), rules_of(base_config())
    x = jax.device_put(jnp.ones((16, 32, 64)), NamedSharding(mesh, P("data")))
    names = ("batch", "seq", "embed")
    with activate(mesh, ParallelContext(rules)):
        text = jax.jit(lambda x, k: constrain(dropout(constrain(x, names), RATE, k), names)).lower(
            x, jax.random.key(0)).compile().as_text()
    sizes = [int(np.prod([int(d) for d in s.split(",")])) for s in re.findall(r"u32\[([\d,]+)\]", text)]
    assert max(sizes) == 2 * 32 * 64


def _losses(pipe: int, data: int, model: int, accumulate: int = 0, micro: int = 0, repeats: int = 1):
    """The losses of ``STEPS`` steps of a 4-layer GPT with dropout 0.1 on a (pipe, data, model) mesh with
    ``accumulate`` sequences per data shard per accumulation step (0: none) and ``micro`` pipeline microbatches,
    from the same initial parameters (the 1x1 run's) on the same batches."""
    config = choice_config(None, data, model)
    config.model.update(num_layers=4, dropout=RATE)
    config.mesh.pipe = pipe
    config.parallel.update(pipeline_microbatches=micro, pipeline_repeats=repeats,
                           pipeline_schedule="circular" if repeats > 1 else "gpipe")
    config.train.micro_batch_size = accumulate
    return step_losses(config, _INITIAL, "initial", STEPS)


_INITIAL = {}


@pytest.fixture(scope="module")
def reference():
    _INITIAL.clear()
    return _losses(1, 1, 1)


@pytest.mark.parametrize("pipe, data, model, accumulate, micro, repeats", [
    (1, 1, 1, 2, 0, 1),  # 4 accumulation steps of 2 on one device
    (1, 2, 4, 2, 0, 1),  # 2x4, each data shard's 4 rows in 2 steps
    (1, 8, 1, 0, 0, 1),  # 8 data shards
    (2, 2, 2, 2, 2, 1),  # GPipe stages with accumulation
    (2, 2, 1, 0, 4, 2),  # the circular schedule
])
def test_losses_are_the_same_on_every_mesh_split_and_pipeline(reference, pipe, data, model, accumulate, micro,
                                                              repeats):
    """Dropout 0.1, three steps (the masks change with the step, the parameters with the masks): the losses of the
    1x1 run without accumulation, 1e-6 relative."""
    got = _losses(pipe, data, model, accumulate, micro, repeats)
    assert len(set(reference)) == STEPS  # the steps differ
    np.testing.assert_allclose(got, reference, rtol=1e-6)
