"""What the scaling model reads of a megajax config, once: the resolved view of its model and memory choices
(``resolved``), its parameters per GPU and per pipeline stage and its layer's GEMM shapes, from the abstract model
through the sharding rules (``layout``: nothing here describes a block by formula), and the choices' flags."""

from __future__ import annotations

import dataclasses
import functools
import math

import ml_collections

from megajax.config import base_config, model_config, sequence_parallel, state_split, validate
from megajax.errors import ConfigError
from megajax.models import ModelSpec, TransformerConfig, model_spec
from megajax.models.transformer import STACK
from megajax.parallel.sharding import entry_axes, logical_to_spec
from megajax.tools.memory_planner import parameters


@dataclasses.dataclass(frozen=True)
class Resolved:
    """What the formulas read of a config, resolved once (``resolved``) so that a prediction reads no ConfigDict
    in its inner loops: the model's frozen config and spec, the memory choices, and the key its abstract model's
    layout is cached under. Derived from a config, never written by hand; the functions below take either."""

    cfg: TransformerConfig  # config.model_config: the model's shape, remat, dropout, compute dtype
    spec: ModelSpec
    sequence: bool  # sequence parallelism (config.sequence_parallel)
    shard_optimizer: bool  # AdamW's moments split over data: ZeRO-1, or FSDP (config.state_split)
    fsdp: bool  # the parameters too: FSDP (ZeRO-3)
    key: tuple  # (config.model's fields but remat, the sharding rules): what ``layout`` is cached on

    def with_remat(self, remat: str) -> Resolved:
        """The same model timed under another remat policy (the pipeline's recomputation)."""
        return dataclasses.replace(self, cfg=dataclasses.replace(self.cfg, remat=remat))


Model = ml_collections.ConfigDict | Resolved  # a megajax config (load_config's), or its ``resolved`` view


def resolved(model: Model) -> Resolved:
    """``model``'s ``Resolved`` view (itself if it is one), cached on the config sections it reads."""
    if isinstance(model, Resolved):
        return model
    return _resolved(tuple(sorted(model.model.items())), model.train.precision, tuple(sorted(model.parallel.items())),
                     tuple(tuple(rule) for rule in model.sharding.rules), model.mesh.model, model.mesh.pipe)


@functools.lru_cache(maxsize=1024)
def _resolved(fields: tuple, precision: str, parallel: tuple, rules: tuple, tensor: int, pipe: int) -> Resolved:
    config = ml_collections.ConfigDict({"model": dict(fields), "train": {"precision": precision},
                                        "parallel": dict(parallel), "sharding": {"rules": rules},
                                        "mesh": {"model": tensor, "pipe": pipe}})
    shard_optimizer, fsdp = state_split(config)
    layout_fields = tuple((k, v) for k, v in fields if k != "remat")  # parameters do not depend on it
    return Resolved(cfg=model_config(config), spec=model_spec(config.model.name), sequence=sequence_parallel(config),
                    shard_optimizer=shard_optimizer, fsdp=fsdp, key=(layout_fields, rules))


@dataclasses.dataclass(frozen=True)
class Layout:
    """What the abstract model of a config says about one of ``tensor`` model-parallel GPUs (``layout``)."""

    total: int  # parameters of the whole model
    ends: int  # parameters outside the layer stack on one GPU: embeddings, final norm, output layer
    layer: int  # one layer's parameters on one GPU
    gemms: tuple[tuple[int, int], ...]  # one layer's weight GEMMs on one GPU, (k, n) per kernel, over every token
    tied: bool  # one (vocabulary, hidden) weight: the word embedding is the output layer

    def local(self, layers: int) -> int:
        """Parameters on one GPU of a model (or pipeline stage) of ``layers`` layers and the ends."""
        return self.ends + layers * self.layer


def layout(model: Model, tensor: int) -> Layout:
    """``model``'s parameters on one of ``tensor`` GPUs, read from its abstract model (``nnx.eval_shape``, the
    memory planner's ``parameters``) through the sharding rules; cached per model (``config.model``'s fields but
    the remat policy, which the mesh search varies), rules and ``tensor``, so the search builds each once."""
    return _layout(resolved(model).key, tensor)


@functools.lru_cache(maxsize=256)
def _layout(key: tuple, tensor: int) -> Layout:
    fields, rules = dict(key[0]), key[1]
    config = base_config(fields["name"])
    config.model.update(fields)
    config.sharding.rules = rules
    layers = config.model.num_layers
    params = parameters(config, {"data": 1, "model": tensor})
    stacked = [p for p in params if p.module == STACK]
    layer = sum(p.per_device for p in stacked) // layers
    gemms = tuple(_gemm(p.names[1:], p.shape[1:], rules, tensor) for p in stacked if _is_kernel(p.names[1:]))
    vocab = [p for p in params if "vocab" in p.names and "embed" in p.names]
    return Layout(total=sum(math.prod(p.shape) for p in params), ends=sum(p.per_device for p in params) -
                  layers * layer, layer=layer, gemms=gemms, tied=len(vocab) == 1)


def _is_kernel(names: tuple) -> bool:
    """A layer's weight that multiplies every token's hidden state, or yields it: the hidden size (``embed``) on
    one side, other axes on the other (norm scales and biases have one side only)."""
    return len(names) > 1 and (names[0] == "embed") != (names[-1] == "embed")


def _gemm(names: tuple, shape: tuple, rules: tuple, tensor: int) -> tuple[int, int]:
    """(k, n) of a layer kernel's GEMM on one of ``tensor`` GPUs: the hidden size is the input of a column-parallel
    kernel (``embed`` first) and the output of a row-parallel one (``embed`` last). Each GPU computes with its share
    of an axis the rules split (the rules before the model's overrides: where it keeps an axis whole because the
    axis has fewer entries than GPUs, replicated key/value heads, each GPU uses its copy of one)."""
    spec = logical_to_spec(names, rules)
    local = [max(1, n // (tensor if "model" in entry_axes(entry) else 1)) for n, entry in zip(shape, spec)]
    return (local[0], math.prod(local[1:])) if names[0] == "embed" else (math.prod(local[:-1]), local[-1])


def parameters_per_gpu(model: Model, tensor: int = 1, stages: int = 1) -> tuple[int, int]:
    """(total parameters, parameters on one of ``tensor`` model-parallel GPUs of one of ``stages`` pipeline stages):
    the stage's L/p layers and the ends (megajax replicates the embeddings, final norm and output layer over pipe;
    Megatron-LM's first stage holds the embeddings, its last the final norm and the tied output layer's copy: about
    the same); the memory planner's ``params_per_device``, from the abstract model."""
    r = resolved(model)
    lay = _layout(r.key, tensor)
    return lay.total, lay.local(r.cfg.num_layers // stages)


def splits_evenly(config: ml_collections.ConfigDict, tensor: int) -> bool:
    """Whether ``tensor`` model-parallel GPUs can hold the model: the checks ``config.validate`` makes of
    ``mesh.model`` (whole heads, equal slices of hidden, MLP and vocabulary, whole key/value heads or a copy of
    one)."""
    trial = config.copy_and_resolve_references()
    trial.mesh.update(data=1, model=tensor, pipe=1)
    trial.parallel.update(sequence=False, pipeline_repeats=1)
    try:
        validate(trial, tensor)
    except ConfigError:
        return False
    return True


def choices(model: Model) -> tuple[str, bool, bool, bool]:
    """The memory choices a prediction is for: (``model.remat``, sequence parallelism, the moments split over data
    (``parallel.shard_optimizer``, ZeRO-1, or FSDP), the parameters too (``parallel.fsdp``, ZeRO-3))."""
    r = resolved(model)
    return r.cfg.remat, r.sequence, r.shard_optimizer, r.fsdp


def with_choices(config: ml_collections.ConfigDict, remat: str | None = None, sequence: bool | None = None,
                 shard_optimizer: bool | None = None, fsdp: bool | None = None) -> ml_collections.ConfigDict:
    """A copy of ``config`` with the choices given (None: the config's)."""
    config = config.copy_and_resolve_references()
    if remat is not None:
        config.model.remat = remat
    for field, value in (("sequence", sequence), ("shard_optimizer", shard_optimizer), ("fsdp", fsdp)):
        if value is not None:
            config.parallel[field] = value
    return config


def choice_flags(model: Model) -> str:
    """The config flags that give ``model``'s choices."""
    remat, sequence, shard_optimizer, fsdp = choices(model)
    return (f"--config.model.remat={remat} --config.parallel.sequence={sequence} "
            f"--config.parallel.shard_optimizer={shard_optimizer} --config.parallel.fsdp={fsdp}")
