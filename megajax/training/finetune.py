"""``init_from``: a run's trunk read from a megajax checkpoint: a fine-tuning run's pretrained BERT, or a
converted Llama (``hf-to-megajax``) whose training continues.

A task model's spec names its pretrained trunk (``ModelSpec.pretrained_trunk``: ``BERTEncoder`` for the BERT task
models), which the task model and the pretraining model both subclass, so the trunk (embeddings, blocks, final /
embedding LN, pooler) has the same parameter paths in a pretraining checkpoint and in the task model. Only those
paths are read, straight into the task run's shardings (any mesh); the heads keep their fresh initialisation.
Everything that can be checked from the checkpoint's stored config is checked before compiling.
"""

from __future__ import annotations

import pathlib
from typing import Any

import jax
from flax import nnx

from megajax.checkpoint import CheckpointError, restore_params
from megajax.config import RunSpec, describe_differences, model_differences, stored_run
from megajax.config.load import in_layout, read_run_config, read_stored_run
from megajax.errors import ConfigError
from megajax.models import MODELS

# config.model fields a run may set apart from its init_from checkpoint's: the family (a task model reads its
# pretraining model's trunk), the task heads' outputs, the sequence length (BERT's GLUE runs read the first 128 of
# 512 position rows); every other field but the training-only ones fixes the trunk and must match
FREE_FIELDS = ("name", "num_classes", "max_seq_len", "make_vocab_size_divisible_by")  # the last: as padded rows


def _trunk(spec: RunSpec) -> type[nnx.Module]:
    trunk = spec.model_spec.pretrained_trunk
    if trunk is None:
        raise ConfigError(f"init_from: model.name={spec.model_name} has no pretrained trunk to load; leave "
                          "init_from empty")
    return trunk


def trunk_keys(spec: RunSpec) -> tuple[str, ...]:
    """The top-level parameter names the task model shares with its pretrained trunk (wte, wpe, tte, blocks, ...)."""
    trunk = _trunk(spec)
    encoder = nnx.eval_shape(lambda: trunk(spec.model, rngs=nnx.Rngs(0)))
    return tuple(nnx.to_pure_dict(nnx.state(encoder)))


def check_init_from(spec: RunSpec, given: str | None = None, field: str = "init_from") -> pathlib.Path:
    """The resolved ``spec.init_from`` (or ``given``, the config's ``field``: a preference run's reference model)
    after checking that it holds a checkpoint of this model's pretrained trunk (a BERT for the BERT task models) of
    this config's sizes and vocabulary; raises FileNotFoundError or CheckpointError naming what differs."""
    given = spec.init_from if given is None else given
    path = pathlib.Path(given).expanduser().resolve()
    if not path.exists():
        raise FileNotFoundError(f"{field}={given!r}: {path} does not exist; pass a pretraining run's "
                                "workdir or one of its step directories")
    trunk, config = _trunk(spec), read_run_config(path)
    name = config.model.name  # the family first: a section that is not its name's family's would not read as one
    if name not in MODELS or not issubclass(MODELS[name].module, trunk):
        raise CheckpointError(f"{field}={given!r} holds a model.name={name!r} checkpoint: "
                              f"fine-tuning {spec.model_name} needs one whose model is a {trunk.__name__}")
    saved = stored_run(config)
    if differences := model_differences(saved, spec, ignore=FREE_FIELDS):
        flags = " ".join(f"--config.model.{f}={ours}" for f, (ours, _) in differences.items())
        raise CheckpointError(f"{field}={given!r} holds a trunk unlike this config's "
                              f"({describe_differences(differences)}); set {flags}")
    model = saved.model
    if model.padded_vocab_size != spec.model.padded_vocab_size:
        raise CheckpointError(f"{field}={given!r} has {model.padded_vocab_size} embedding rows (vocab_size "
                              f"{model.vocab_size} padded to a multiple of {model.make_vocab_size_divisible_by}), "
                              f"this config {spec.model.padded_vocab_size}; set "
                              f"--config.model.make_vocab_size_divisible_by={model.make_vocab_size_divisible_by}")
    theirs, ours = saved.dataset.tokenizer_fingerprint, spec.dataset.tokenizer_fingerprint
    if theirs and ours and theirs != ours:  # same size, other words: every id would mean another token
        raise CheckpointError(f"{field}={given!r} was pretrained with another vocabulary than "
                              f"data.tokenizer={spec.dataset.tokenizer!r} (tokenizer fingerprints {theirs} there, "
                              f"{ours} here): fine-tune with the tokenizer of its pretraining data")
    positional = set(spec.model_spec.sequence_rows) & set(trunk_keys(spec))  # rotary: none
    if spec.model.max_seq_len > model.max_seq_len and positional:
        raise CheckpointError(f"{field}={given!r} has position embeddings for model.max_seq_len="
                              f"{model.max_seq_len}, fewer than this config's {spec.model.max_seq_len}; set "
                              f"--config.model.max_seq_len to at most {model.max_seq_len}")
    return path


def load_trunk(spec: RunSpec, params_target: dict[str, Any], given: str | None = None,
               field: str = "init_from") -> dict[str, Any]:
    """The trunk parameters of ``spec.init_from`` (or of ``given``, the config's ``field``: ``check_init_from``),
    read into the shardings and dtypes of ``params_target``'s
    matching entries (a pure dict of ShapeDtypeStructs or arrays); the shapes are checked by name. A shorter
    ``model.max_seq_len`` than pretraining's keeps the first rows of the position embeddings (fine-tuning at 128
    tokens from a 512-token BERT, as BERT's GLUE runs): the spec's ``sequence_rows``, whose rows follow the
    sequence."""
    path = check_init_from(spec, given, field)
    target, saved = {k: params_target[k] for k in trunk_keys(spec)}, read_stored_run(path)
    positions = saved.model.max_seq_len
    cut = {k: target[k] for k in spec.model_spec.sequence_rows
           if k in target and target[k].shape[0] != positions}  # none with rotary positions
    for k, want in cut.items():  # read as saved, then keep the first rows
        target[k] = jax.ShapeDtypeStruct((positions, *want.shape[1:]), want.dtype, sharding=want.sharding)
    trunk = in_layout(restore_params(path, target), saved, spec.layer_layout)
    for k, want in cut.items():
        trunk[k] = jax.device_put(trunk[k][:want.shape[0]], want.sharding)
    return trunk
