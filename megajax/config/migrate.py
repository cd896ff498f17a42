"""Configs stored by older checkpoints, brought up to today's fields when they are read (``config.load``), so the
code that reads a config never needs a fallback. Each entry is a field added after checkpoints were first written,
with the value that reproduces what those checkpoints did. The checkpoint layer stores and returns the config as
JSON; reading it as a config is this layer's."""

from __future__ import annotations

from collections.abc import Collection

import ml_collections

from megajax.models.gpt import NAME as GPT

# (section or None for the top level, field) -> the value an older checkpoint implied
ADDED_FIELDS = {
    ("model", "name"): GPT,  # before BERT, every checkpoint was a GPT
    (None, "init_from"): "",
    ("parallel", "sequence"): False,
    ("parallel", "shard_optimizer"): False,
    ("parallel", "fsdp"): False,
    ("parallel", "pipeline_microbatches"): 0,
    ("parallel", "pipeline_repeats"): 1,
    ("parallel", "pipeline_schedule"): "gpipe",  # "circular" where pipeline_repeats > 1 (migrate_config)
    ("parallel", "pipeline_stage_recompute"): False,  # the same step's values either way
    ("mesh", "pipe"): 1,
    ("mesh", "expert"): 1,
    ("mesh", "context"): 1,
    ("mesh", "auto"): False,
    ("checkpoint", "restore_step"): 0,
    ("train", "precision"): "auto",
    ("data", "blend"): "",
    ("data", "allow_blend_change"): False,
    ("data", "max_dropped_fraction"): 1.0,  # training used whatever rows its readers kept
    ("data", "tokenizer_fingerprint"): "",  # not recorded: nothing to compare
    ("data", "document_masking"): False,  # windows attended across documents
    ("data", "reset_position_ids"): True,
    ("data", "eod_mask_loss"): False,
    ("data", "sft_packing"): True,
    ("data", "sft_truncate"): False,
    ("data", "sft_skip_bad_rows"): False,
    ("data", "pairs_per_row"): 1,
    ("dpo", "beta"): 0.1,  # read only with data.source=preference, which came with them
    ("dpo", "loss"): "sigmoid",
    ("dpo", "label_smoothing"): 0.0,
    ("dpo", "reference"): "",
}
# config.model fields every family's section held before each family had its own config type, with the value they
# held in a family that does not have them (GPT's num_token_types, Llama's unused activation)
SHARED_MODEL_FIELDS = {"post_layernorm": False, "num_token_types": 0, "num_classes": 2, "activation": "gelu_tanh"}
SEQUENCE_PARALLEL_RULE = ("seq_sp", None)  # the residual stream's sequence name, replicated unless parallel.sequence


def migrate_config(stored: dict) -> ml_collections.ConfigDict:
    """The config stored with a checkpoint (its JSON as a dict: ``checkpoint.read_config``) with every field of
    ``ADDED_FIELDS`` it lacks set to its old meaning, and the sequence-parallel rule added to sharding rules stored
    before it existed."""
    config = ml_collections.ConfigDict(stored)  # new sections: ``stored`` is left as it was
    if "parallel" in config and "pipeline_schedule" not in config.parallel:  # repeats alone chose the schedule
        config.parallel.pipeline_schedule = "circular" if config.parallel.get("pipeline_repeats", 1) > 1 else "gpipe"
    for (section, field), value in ADDED_FIELDS.items():
        if section is not None and section not in config:
            config[section] = ml_collections.ConfigDict()
        parent = config if section is None else config[section]
        if field not in parent:
            parent[field] = value
    rules = [tuple(r) for r in config.sharding.rules]
    if SEQUENCE_PARALLEL_RULE[0] not in dict(rules):
        config.sharding.rules = tuple(rules) + (SEQUENCE_PARALLEL_RULE,)
    return config


def drop_shared_model_fields(config: ml_collections.ConfigDict,
                             family_fields: Collection[str]) -> ml_collections.ConfigDict:
    """``config`` (as ``migrate_config`` returns it) without the ``SHARED_MODEL_FIELDS`` that its model's family
    (``family_fields``: its config type's fields) does not have and that hold the value meaning "not this family's".
    Any other value is kept, so that reading it as this family's config fails on the unknown field."""
    config = ml_collections.ConfigDict(config.to_dict())
    for field, value in SHARED_MODEL_FIELDS.items():
        if field in config.model and field not in family_fields and config.model[field] == value:
            del config.model[field]
    return config
