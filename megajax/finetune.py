"""``config.init_from``: a fine-tuning run's BERT trunk read from a pretrained megajax checkpoint.

The task models subclass ``BERTEncoder``, so the trunk (embeddings, blocks, final / embedding LN, pooler) has the
same parameter paths in a pretraining checkpoint and in the task model. Only those paths are read, straight into
the task run's shardings (any mesh); the heads keep their fresh initialisation. Everything that can be checked
from the checkpoint's stored config is checked before compiling.
"""

from __future__ import annotations

import pathlib
from typing import Any

import ml_collections
from flax import nnx

from megajax.checkpoint import CheckpointError, read_config, restore_params
from megajax.config import model_config
from megajax.models import MODELS
from megajax.models.bert import BERTEncoder

# config.model fields that fix the trunk's parameter shapes (and its architecture)
TRUNK_FIELDS = ("vocab_size", "make_vocab_size_divisible_by", "num_layers", "hidden_size", "num_heads", "mlp_ratio",
                "max_seq_len", "num_token_types", "post_layernorm", "activation")


def trunk_keys(config: ml_collections.ConfigDict) -> tuple[str, ...]:
    """The top-level parameter names the task model shares with ``BERTEncoder`` (wte, wpe, tte, blocks, ...)."""
    encoder = nnx.eval_shape(lambda: BERTEncoder(model_config(config), rngs=nnx.Rngs(0)))
    return tuple(nnx.to_pure_dict(nnx.state(encoder)))


def check_init_from(config: ml_collections.ConfigDict) -> pathlib.Path:
    """The resolved ``config.init_from`` after checking that it holds a BERT checkpoint of this config's trunk
    sizes; raises FileNotFoundError or CheckpointError naming what differs."""
    path = pathlib.Path(config.init_from).expanduser().resolve()
    if not path.exists():
        raise FileNotFoundError(f"init_from={config.init_from!r}: {path} does not exist; pass a pretraining run's "
                                "workdir or one of its step directories")
    saved = read_config(path).model
    cls = MODELS.get(saved.name)
    if cls is None or not issubclass(cls, BERTEncoder):
        raise CheckpointError(f"init_from={config.init_from!r} holds a model.name={saved.name!r} checkpoint: "
                              f"fine-tuning {config.model.name} needs a BERT one")
    for field in TRUNK_FIELDS:
        if saved.get(field) != config.model.get(field):
            raise CheckpointError(f"init_from={config.init_from!r} was trained with model.{field}={saved.get(field)}"
                                  f" but this config has {config.model.get(field)}; set "
                                  f"--config.model.{field}={saved.get(field)}")
    return path


def load_trunk(config: ml_collections.ConfigDict, params_target: dict[str, Any]) -> dict[str, Any]:
    """The trunk parameters of ``config.init_from``, read into the shardings and dtypes of ``params_target``'s
    matching entries (a pure dict of ShapeDtypeStructs or arrays); the shapes are checked by name."""
    target = {k: params_target[k] for k in trunk_keys(config)}
    return restore_params(check_init_from(config), target)
