"""A saved model back on the devices: any megajax checkpoint (training workdir, a step, a params-only export) read
straight into the shardings of a mesh of the current devices (resharding on restore), with its resolved spec."""

from __future__ import annotations

import pathlib
from typing import Any, NamedTuple

import jax
import ml_collections
from flax import nnx
from jax.sharding import Mesh

from megajax.checkpoint.manager import read_config, restore_params
from megajax.config.build import abstract_model
from megajax.config.defaults import NO_SCHEDULE
from megajax.config.migrate import migrate_config
from megajax.config.resolve import RunSpec, StoredRun, resolve, stored_config, stored_run
from megajax.config.run import FP8_PRECISION
from megajax.models.transformer import reorder_layers
from megajax.parallel.mesh import MeshShape
from megajax.parallel.partition import shardings


class LoadedModel(NamedTuple):
    """What ``load_model`` returns: ``model, spec, mesh = megajax.load_model(path)``."""

    model: nnx.Module  # ready for model(tokens); its parameters sharded on ``mesh``
    spec: RunSpec  # the resolved run (spec.model: the family's frozen config, spec.model_spec: its spec)
    mesh: Mesh


def run_config(stored: dict) -> ml_collections.ConfigDict:
    """A checkpoint's config as stored (its JSON: ``checkpoint.read_config``, ``Checkpointer.stored``) as today's
    code reads it: the fields added since it was written (``migrate_config``), then its family's (``stored_config``)."""
    return stored_config(migrate_config(stored))


def read_run_config(path: str | pathlib.Path) -> ml_collections.ConfigDict:
    """The config stored with the checkpoint at ``path`` as today's code reads it (``run_config``)."""
    return run_config(read_config(path))


def read_stored_run(path: str | pathlib.Path) -> StoredRun:
    """The run stored with the checkpoint at ``path``, typed (``stored_run`` of ``read_run_config``)."""
    return stored_run(read_run_config(path))


def inference_config(path: str | pathlib.Path, data: int | None = None, model: int | None = None,
                     expert: int | None = None) -> ml_collections.ConfigDict:
    """The config stored with a checkpoint, set up for inference on the current devices: ``mesh.model`` as saved,
    or its largest divisor that the devices here hold (a checkpoint of a 1x2 run evaluates on one device), or
    ``model``; ``mesh.expert`` likewise (a mixture of experts'); every remaining device on ``data`` (or ``data``);
    no pipeline stages; sequence parallelism off (it saves training memory, and a decoding step of one token has no
    sequence to split; the parameters are laid out the same); a run trained in fp8 evaluates in bf16 (FP8 is the
    training GEMMs' speed, not the model: bf16 is the more exact and runs on every GPU); a mixture's bounded exchange
    room off (``model.expert_room``: it drops assignments by what else the batch routes and by the mesh, a
    training-memory bound; inference keeps every one)."""
    MeshShape(-1 if data is None else data, 1 if model is None else model, expert=1 if expert is None else expert)
    config = read_run_config(path)
    config.parallel.sequence = False
    if config.train.precision == FP8_PRECISION:
        config.train.precision = "bf16"
    if config.model.get("expert_room"):
        config.model.expert_room = 0.0
    config.mesh.pipe = 1  # inference runs on data x model (a pipelined run's stages are one resharding away)
    config.mesh.context = 1  # and on whole sequences
    config.parallel.update(NO_SCHEDULE)
    config.mesh.data = -1 if data is None else data
    devices = jax.device_count() // data if data else jax.device_count()
    # a divisor of the saved split keeps every divisibility the saved run had
    divisor = lambda saved, room: max(t for t in range(1, saved + 1) if saved % t == 0 and room % t == 0)  # noqa: E731
    config.mesh.model = divisor(config.mesh.model, devices) if model is None else model
    config.mesh.expert = divisor(config.mesh.expert, devices // config.mesh.model) if expert is None else expert
    return config


def restore_model(path: str | pathlib.Path, config: ml_collections.ConfigDict) -> LoadedModel:
    """The checkpoint at ``path`` on the mesh of ``config`` (``inference_config``), digests verified."""
    spec = resolve(config, jax.device_count(), training=False)
    mesh = spec.mesh.make()
    graphdef, abstract = nnx.split(abstract_model(config))
    target_shardings = nnx.to_pure_dict(shardings(abstract, mesh, spec.rules))
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          nnx.to_pure_dict(abstract), target_shardings)
    params = in_layout(restore_params(path, target), read_stored_run(path), spec.layer_layout)
    return LoadedModel(nnx.merge(graphdef, params), spec, mesh)


def in_layout(tree: Any, saved: StoredRun, layout: tuple[int, int]) -> Any:
    """``tree`` as read from the checkpoint of ``saved``, its stacked layers put in the order of ``layout`` =
    (stages, repeats) (``RunSpec.layer_layout``): a circular pipeline keeps them in another order than the model's,
    and a checkpoint holds them as its run did (``saved.layer_layout``)."""
    return reorder_layers(tree, saved.layer_layout, layout)


def load_model(path: str | pathlib.Path, *, data: int | None = None, model: int | None = None,
               expert: int | None = None) -> LoadedModel:
    """Loads any megajax checkpoint onto the current devices: ``(model, spec, mesh)``.

    ``path`` (absolute or relative) is a training workdir, its ``checkpoints/`` directory, one step of it, or a
    params-only export. The mesh defaults to the checkpoint's ``mesh.model`` (and a mixture of experts'
    ``mesh.expert``) and all remaining devices on ``data``; parameters are read straight into that layout and
    checked against their digests. Sequence parallelism is off: inference does not split the sequence.
    """
    return restore_model(path, inference_config(path, data, model, expert))


def load_model_and_config(path: str | pathlib.Path, *, data: int | None = None,
                          model: int | None = None) -> tuple[nnx.Module, ml_collections.ConfigDict]:
    """``megajax.checkpoint.load_model``, kept for scripts written against it: ``(model, config)``, the config as
    stored, set up for inference (``inference_config``). New code: ``megajax.load_model`` -> (model, spec, mesh)."""
    config = inference_config(path, data, model)
    return restore_model(path, config).model, config
