"""From a config to a mesh and a sharded model: validate first, then allocate each shard where it lives.

Every path that makes a model (training, evaluation, conversion, tools, tests) goes through ``model_factory`` (a
config) or ``run_model_factory`` (a resolved ``RunSpec``): the module comes from the spec registered as
``config.model.name``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import ml_collections
from flax import nnx
from jax.sharding import Mesh

from megajax.config.resolve import model_config, rules_of, validate
from megajax.config.run import RunSpec
from megajax.errors import ConfigError
from megajax.models import TransformerConfig, model_spec
from megajax.parallel.partition import init_sharded, partition_specs


def build_mesh(config: ml_collections.ConfigDict, devices: list[jax.Device] | None = None) -> Mesh:
    """The mesh of ``config.mesh``, after ``validate``."""
    devices = list(jax.devices() if devices is None else devices)
    return validate(config, len(devices)).make(devices)


def model_factory(config: ml_collections.ConfigDict) -> Callable[[int], nnx.Module]:
    """``seed -> model`` for ``config.model.name`` (its ``megajax.models`` spec's module)."""
    return _factory(model_spec(config.model.name).module, model_config(config))


def run_model_factory(spec: RunSpec) -> Callable[[int], nnx.Module]:
    """``seed -> model`` of a resolved run."""
    return _factory(spec.model_spec.module, spec.model)


def _factory(cls: type[nnx.Module], cfg: TransformerConfig) -> Callable[[int], nnx.Module]:
    return lambda seed: cls(cfg, rngs=nnx.Rngs(seed))


def abstract_model(config: ml_collections.ConfigDict) -> nnx.Module:
    """The model with ShapeDtypeStructs for parameters: shapes and names, no memory."""
    return _abstract(model_factory(config), rules_of(config))


def abstract_model_of(spec: RunSpec) -> nnx.Module:
    """``abstract_model`` of a resolved run."""
    return _abstract(run_model_factory(spec), spec.rules)


def _abstract(make: Callable[[int], nnx.Module], rules) -> nnx.Module:
    try:
        model = nnx.eval_shape(lambda: make(0))
    except ValueError as e:  # the module's own checks of its config (options it does not have)
        raise ConfigError(str(e)) from e
    partition_specs(nnx.state(model), rules)  # unknown names fail here, before allocation
    return model


def create_model(config: ml_collections.ConfigDict, mesh: Mesh, seed: int = 0) -> nnx.Module:
    """Initialises the model sharded on ``mesh`` (checks run first, on the abstract model)."""
    abstract_model(config)
    make = model_factory(config)
    return init_sharded(lambda: make(seed), mesh, rules_of(config))
