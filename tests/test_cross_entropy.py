"""The fused vocab-parallel cross-entropy equals optax's on gathered logits, and padding gets no mass."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from megajax.parallel.losses import mask_padded_vocab, vocab_parallel_cross_entropy
from megajax.parallel.mesh import MeshShape
from megajax.parallel.sharding import MEGATRON_RULES, ParallelContext, activate

V_TRUE, V_PAD = 1000, 1024


@pytest.mark.parametrize("data,model_axis", [(1, 1), (1, 4), (2, 4), (1, 8)])
def test_matches_optax(data, model_axis):
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(0, 3, (4, 16, V_PAD)).astype(np.float32))
    labels = jnp.asarray(rng.integers(0, V_TRUE, (4, 16)))
    mesh = MeshShape(data, model_axis).make()
    sharded = jax.device_put(logits, NamedSharding(mesh, P("data", None, "model")))

    def ours(x):
        return vocab_parallel_cross_entropy(mask_padded_vocab(x, V_TRUE), labels)

    with activate(mesh, ParallelContext(MEGATRON_RULES)):
        loss, grad = jax.jit(jax.value_and_grad(lambda x: ours(x).mean()))(sharded)
        per_token = jax.jit(ours)(sharded)
    reference = optax.softmax_cross_entropy_with_integer_labels(logits[..., :V_TRUE], labels)
    ref_grad = jax.grad(lambda x: optax.softmax_cross_entropy_with_integer_labels(x, labels).mean())(
        logits[..., :V_TRUE])
    np.testing.assert_allclose(per_token, reference, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(loss, reference.mean(), rtol=1e-6)
    np.testing.assert_allclose(grad[..., :V_TRUE], ref_grad, rtol=1e-5, atol=1e-9)
    assert not np.asarray(grad[..., V_TRUE:]).any()  # padded ids receive no gradient (no probability)
