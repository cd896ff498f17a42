"""From a config to a mesh and a sharded model: validate first, then allocate each shard where it lives."""

from __future__ import annotations

import jax
import ml_collections
from flax import nnx
from jax.sharding import Mesh

from megajax.config import gpt_config, rules_of, validate
from megajax.models.gpt import GPT
from megajax.partition import init_sharded, partition_specs
from megajax.sharding import make_mesh


def build_mesh(config: ml_collections.ConfigDict, devices: list[jax.Device] | None = None) -> Mesh:
    """The (data, model) mesh of ``config.mesh``, after ``validate``."""
    devices = list(jax.devices() if devices is None else devices)
    dp, tp = validate(config, len(devices))
    return make_mesh(dp, tp, devices)


def abstract_model(config: ml_collections.ConfigDict) -> GPT:
    """The model with ShapeDtypeStructs for parameters: shapes and names, no memory."""
    cfg = gpt_config(config)
    model = nnx.eval_shape(lambda: GPT(cfg, rngs=nnx.Rngs(0)))
    partition_specs(nnx.state(model), rules_of(config))  # unknown names fail here, before allocation
    return model


def create_model(config: ml_collections.ConfigDict, mesh: Mesh, seed: int = 0) -> GPT:
    """Initialises the model sharded on ``mesh`` (checks run first, on the abstract model)."""
    abstract_model(config)
    cfg = gpt_config(config)
    return init_sharded(lambda: GPT(cfg, rngs=nnx.Rngs(seed)), mesh, rules_of(config))
