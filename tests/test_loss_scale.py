"""Dynamic loss scale state machine (Megatron-LM semantics), step by step."""

import jax.numpy as jnp
import ml_collections

from megajax.training.loss_scale import LossScale


def _scale(initial=2.0**16, growth=3, hysteresis=2):
    cfg = ml_collections.ConfigDict(dict(initial=initial, growth_interval=growth, hysteresis=hysteresis,
                                         min_scale=1.0))
    return LossScale.create(cfg, dynamic=True)


def test_hysteresis_then_halving():
    s = _scale()
    s = s.adjust(jnp.bool_(False))
    assert float(s.scale) == 2.0**16  # first overflow tolerated
    s = s.adjust(jnp.bool_(False))
    assert float(s.scale) == 2.0**15  # second one backs off
    s = s.adjust(jnp.bool_(False))
    assert float(s.scale) == 2.0**14  # and every further one until a growth resets hysteresis


def test_growth_after_interval_resets_hysteresis():
    s = _scale()
    s = s.adjust(jnp.bool_(False))
    for _ in range(2):
        s = s.adjust(jnp.bool_(True))
    assert float(s.scale) == 2.0**16
    s = s.adjust(jnp.bool_(True))
    assert float(s.scale) == 2.0**17 and int(s.hysteresis_left) == 2 and int(s.good_steps) == 0


def test_min_scale_and_static():
    s = _scale(initial=1.0, hysteresis=1)
    assert float(s.adjust(jnp.bool_(False)).scale) == 1.0
    static = LossScale.create(None, dynamic=False)
    assert static.adjust(jnp.bool_(False)) is static and static.scale_loss(3.0) == 3.0
