"""Dynamic loss scaling for fp16 (Micikevicius et al. 2017), with Megatron-LM's hysteresis.

On a step whose gradients hold an inf/nan the update is skipped, and after ``hysteresis`` such steps since the last
growth the scale is halved (not below ``min_scale``). After ``growth_interval`` consecutive clean steps it doubles.
For fp32/bf16 the scale is a constant 1 and nothing is ever skipped.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from megajax.config import LossScaleSettings


@struct.dataclass
class LossScale:
    scale: jax.Array  # f32 scalar
    good_steps: jax.Array  # i32: clean steps since the last overflow or growth
    hysteresis_left: jax.Array  # i32: overflows still tolerated before backing off
    dynamic: bool = struct.field(pytree_node=False, default=False)
    growth_interval: int = struct.field(pytree_node=False, default=1000)
    hysteresis: int = struct.field(pytree_node=False, default=2)
    min_scale: float = struct.field(pytree_node=False, default=1.0)

    @classmethod
    def create(cls, cfg: LossScaleSettings | None, dynamic: bool) -> "LossScale":
        if not dynamic:
            return cls(jnp.float32(1.0), jnp.int32(0), jnp.int32(0))
        return cls(jnp.float32(cfg.initial), jnp.int32(0), jnp.int32(cfg.hysteresis), True,
                   int(cfg.growth_interval), int(cfg.hysteresis), float(cfg.min_scale))

    def scale_loss(self, loss: jax.Array) -> jax.Array:
        return loss * self.scale if self.dynamic else loss

    def unscale(self, grads):
        return jax.tree.map(lambda g: g / self.scale, grads) if self.dynamic else grads

    def adjust(self, finite: jax.Array) -> "LossScale":
        """The scale state after a step whose gradients were (or were not) all finite."""
        if not self.dynamic:
            return self
        hysteresis_left = jnp.where(finite, self.hysteresis_left, self.hysteresis_left - 1)
        back_off = ~finite & (hysteresis_left <= 0)
        good = jnp.where(finite, self.good_steps + 1, 0)
        grow = good >= self.growth_interval
        scale = jnp.where(back_off, jnp.maximum(self.scale * 0.5, self.min_scale), self.scale)
        scale = jnp.where(grow, scale * 2.0, scale)
        return self.replace(scale=scale, good_steps=jnp.where(grow, 0, good),
                            hysteresis_left=jnp.where(grow, self.hysteresis, hysteresis_left))
