"""The sharded model computes what the unsharded one does: logits, loss and every gradient, on every mesh."""

import jax
import numpy as np
import pytest
from conftest import MESHES, place
from flax import nnx

from megajax.config import rules_of
from megajax.parallel.losses import lm_loss
from megajax.parallel.sharding import ParallelContext, activate

# fp32 on CPU; the sharded sums reorder additions, so bit equality is not expected.
RTOL = 1e-5


def _run(model, config, batch, data, model_axis):
    mesh, graphdef, state = place(model, config, data, model_axis)
    tokens, labels = batch

    def loss_and_logits(state):
        m = nnx.merge(graphdef, state)
        return lm_loss(m, tokens, labels), m(tokens)

    with activate(mesh, ParallelContext(rules_of(config))):
        (loss, logits), grads = jax.jit(jax.value_and_grad(loss_and_logits, has_aux=True))(state)
    return float(loss), np.asarray(logits), jax.tree.map(np.asarray, nnx.to_pure_dict(grads))


@pytest.fixture(scope="module")
def unsharded(reference_model, batch):
    config, model = reference_model
    return _run(model, config, batch, 1, 1)


@pytest.mark.parametrize("data,model_axis", MESHES[1:])
def test_mesh_matches_single_device(reference_model, batch, unsharded, data, model_axis):
    config, model = reference_model
    loss, logits, grads = _run(model, config, batch, data, model_axis)
    ref_loss, ref_logits, ref_grads = unsharded
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL)
    valid = logits[..., :config.model.vocab_size]
    np.testing.assert_allclose(valid, ref_logits[..., :config.model.vocab_size], rtol=RTOL,
                               atol=RTOL * np.abs(ref_logits[..., :1000]).max())
    flat, ref_flat = jax.tree_util.tree_leaves_with_path(grads), jax.tree_util.tree_leaves(ref_grads)
    assert len(flat) == len(ref_flat) == 16
    for (path, g), r in zip(flat, ref_flat):
        scale = np.abs(r).max()
        assert scale > 0 or "wpe" in jax.tree_util.keystr(path), jax.tree_util.keystr(path)
        np.testing.assert_allclose(g, r, rtol=RTOL, atol=RTOL * scale, err_msg=jax.tree_util.keystr(path))


def test_initialisation_is_mesh_independent(reference_model):
    """Partitionable threefry: the same seed gives the same weights whether or not they are sharded."""
    from conftest import small_config

    from megajax.config import build_mesh, create_model

    config, model = reference_model
    c = small_config(data=2, model=4)
    sharded = create_model(c, build_mesh(c), seed=0)
    for a, b in zip(jax.tree.leaves(nnx.state(model)), jax.tree.leaves(nnx.state(sharded))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_padded_vocab_gets_no_probability(reference_model, batch):
    config, model = reference_model
    logits = np.asarray(model(batch[0]))
    assert logits.shape[-1] == 1024
    probs = np.asarray(jax.nn.softmax(logits, axis=-1))
    assert probs[..., config.model.vocab_size:].max() == 0.0
    np.testing.assert_allclose(probs.sum(-1), 1.0, rtol=1e-5)
