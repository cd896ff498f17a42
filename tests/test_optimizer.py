"""Schedules against their closed forms; weight decay on exactly the matrices."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import small_config
from flax import nnx

from megajax.config import base_config, model_config
from megajax.models.gpt import GPT
from megajax.training.optimizer import clip_by_global_norm, learning_rate_schedule, make_optimizer, weight_decay_mask


def _opt(**kw):
    opt = base_config().optimizer
    opt.update(kw)
    return opt


def test_cosine_schedule_closed_form():
    """Paper: 1.5e-4 peak, 3k warmup, cosine over the remaining 297k iterations, floor 1e-5."""
    lr_max, lr_min, w, total = 1.5e-4, 1e-5, 3000, 300_000
    sched = learning_rate_schedule(_opt(lr=lr_max, min_lr=lr_min, warmup_steps=w, decay="cosine"), total)
    d = total - w
    cosine = lambda t: lr_min + (lr_max - lr_min) * 0.5 * (1 + math.cos(math.pi * (t - w) / d))  # noqa: E731
    for t, want in [(0, 0.0), (w // 2, lr_max / 2), (w, lr_max), (w + d // 4, cosine(w + d // 4)),
                    (w + d // 2, (lr_max + lr_min) / 2), (total, lr_min), (total + 10_000, lr_min)]:
        assert float(sched(t)) == pytest.approx(want, rel=1e-5, abs=1e-12), t


def test_linear_schedule_closed_form():
    """BERT: 1e-4 peak after 10k warmup, linear decay over 2M iterations."""
    sched = learning_rate_schedule(_opt(lr=1e-4, min_lr=0.0, warmup_steps=10_000, decay="linear",
                                        decay_steps=2_000_000), 2_010_000)
    assert float(sched(10_000)) == pytest.approx(1e-4)
    assert float(sched(1_010_000)) == pytest.approx(5e-5, rel=1e-5)
    assert float(sched(2_010_000)) == pytest.approx(0.0, abs=1e-12)
    assert float(sched(3_000_000)) == pytest.approx(0.0, abs=1e-12)


def test_weight_decay_mask_is_exactly_the_matrices():
    params = nnx.to_pure_dict(nnx.state(GPT(model_config(small_config()), rngs=nnx.Rngs(0))))
    mask = {"/".join(k.key for k in p): v for p, v in jax.tree_util.tree_leaves_with_path(weight_decay_mask(params))}
    decayed = {k for k, v in mask.items() if v}
    assert decayed == {"blocks/attn/qkv/kernel", "blocks/attn/out/kernel", "blocks/mlp/up/kernel",
                       "blocks/mlp/down/kernel", "wte/embedding", "wpe"}
    assert len(mask) == 16


def test_adamw_decays_only_masked_params():
    """With zero gradients Adam's update is zero, so any change is weight decay: lr * wd * w on matrices only."""
    opt = make_optimizer(_opt(lr=0.1, min_lr=0.1, warmup_steps=0, weight_decay=0.01), 10)
    params = {"k": {"kernel": jnp.ones((2, 2)), "bias": jnp.ones(2)}, "ln": {"scale": jnp.ones(2)}}
    updates, _ = opt.update(jax.tree.map(jnp.zeros_like, params), opt.init(params), params)
    new = optax.apply_updates(params, updates)
    np.testing.assert_allclose(new["k"]["kernel"], 1 - 0.1 * 0.01, rtol=1e-6)
    np.testing.assert_array_equal(new["k"]["bias"], 1.0)
    np.testing.assert_array_equal(new["ln"]["scale"], 1.0)


def test_gradients_are_clipped_to_global_norm_one_before_adam():
    """Adam's first moment after one step is (1 - b1) x the gradient it saw: norm 0.1 when clipped to 1."""
    opt = make_optimizer(_opt(lr=1e-3, warmup_steps=0), 10)
    params = {"a": {"kernel": jnp.zeros((3, 3))}, "b": {"bias": jnp.zeros(4)}}
    grads = {"a": {"kernel": jnp.full((3, 3), 10.0)}, "b": {"bias": jnp.full(4, -5.0)}}
    _, state = opt.update(grads, opt.init(params), params)
    mu = optax.tree_utils.tree_get(state, "mu")
    assert float(optax.tree.norm(mu)) == pytest.approx(0.1, rel=1e-5)
    small = jax.tree.map(lambda g: g * 1e-3, grads)  # norm 0.0316 < 1: untouched
    _, state = opt.update(small, opt.init(params), params)
    assert float(optax.tree.norm(optax.tree_utils.tree_get(state, "mu"))) == pytest.approx(
        0.1 * float(optax.tree.norm(small)), rel=1e-5)


def test_clipping_with_the_norm_given_equals_optax():
    """The step passes the norm it already computed; the result is optax.clip_by_global_norm's, bit for bit."""
    grads = {"a": {"kernel": jnp.full((3, 3), 10.0)}, "b": {"bias": jnp.linspace(-5.0, 3.0, 4)}}
    for scale in (1.0, 1e-3):
        g = jax.tree.map(lambda x: x * scale, grads)
        want, _ = optax.clip_by_global_norm(1.0).update(g, optax.EmptyState())
        for norm in (None, optax.tree.norm(g)):
            got, state = clip_by_global_norm(1.0).update(g, optax.EmptyState(), grad_norm=norm)
            assert state == optax.EmptyState()
            for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
                np.testing.assert_array_equal(x, y)
