"""The attention core under its two masks against float64 numpy, against jax.nn.dot_product_attention (the call the
cuDNN path makes, here on its XLA implementation), and which implementation is picked where."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from megajax.models import transformer
from megajax.models.transformer import attention_core, attention_implementation, causal_mask, padding_mask

B, S, N, D = 2, 12, 4, 16


def _qkv(seed: int = 0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((B, S, N, D)).astype(np.float32) for _ in range(3)]


def _reference(q, k, v, mask) -> np.ndarray:
    """float64: softmax over the keys the mask allows, of q.k / sqrt(D), times v."""
    q, k, v = (x.astype(np.float64) for x in (q, k, v))
    scores = np.einsum("bqnd,bknd->bnqk", q, k) / np.sqrt(D)
    scores = np.where(np.broadcast_to(mask, scores.shape), scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return np.einsum("bnqk,bknd->bqnd", probs, v)


MASKS = {
    "causal": lambda: np.asarray(causal_mask(jnp.arange(S), S)),
    "padding": lambda: np.asarray(padding_mask(jnp.asarray((np.arange(S)[None] < np.array([[S], [7]])).astype(int)))),
}


@pytest.mark.parametrize("kind", sorted(MASKS))
def test_core_equals_float64_and_dot_product_attention(kind):
    q, k, v = _qkv()
    mask = MASKS[kind]()
    got = np.asarray(attention_core(*map(jnp.asarray, (q, k, v)), jnp.asarray(mask), None, 0.1))
    np.testing.assert_allclose(got, _reference(q, k, v, mask), rtol=1e-5, atol=1e-6)
    full = np.broadcast_to(mask, (mask.shape[0], 1, S, S))
    theirs = jax.nn.dot_product_attention(*map(jnp.asarray, (q, k, v)), mask=jnp.asarray(full), implementation="xla")
    np.testing.assert_allclose(got, np.asarray(theirs), rtol=1e-5, atol=1e-6)


def test_implementation_is_xla_here_and_cudnn_where_it_applies(monkeypatch):
    assert jax.devices()[0].platform == "cpu"
    assert attention_implementation(jnp.bfloat16, 64, dropout=False, lengths=(S, S)) == "xla"  # no GPU

    h100 = types.SimpleNamespace(platform="gpu", client=types.SimpleNamespace(platform_version="cuda 12080"))
    monkeypatch.setattr(transformer.jax, "devices", lambda: [h100])
    assert attention_implementation(jnp.bfloat16, 64, dropout=False, lengths=(S, S)) == "cudnn"
    assert attention_implementation(jnp.float16, 128, dropout=False, lengths=(S, S)) == "cudnn"
    assert attention_implementation(jnp.bfloat16, 64, dropout=True, lengths=(S, S)) == "xla"  # cuDNN: no dropout
    assert attention_implementation(jnp.float32, 64, dropout=False, lengths=(S, S)) == "xla"
    assert attention_implementation(jnp.bfloat16, 160, dropout=False, lengths=(S, S)) == "xla"
    assert attention_implementation(jnp.bfloat16, 60, dropout=False, lengths=(S, S)) == "xla"
    assert attention_implementation(jnp.bfloat16, 64, dropout=False, lengths=(S - 1, S)) == "xla"  # odd length
    rocm = types.SimpleNamespace(platform="gpu", client=types.SimpleNamespace(platform_version="rocm 6.2"))
    monkeypatch.setattr(transformer.jax, "devices", lambda: [rocm])
    assert attention_implementation(jnp.bfloat16, 64, dropout=False, lengths=(S, S)) == "xla"
