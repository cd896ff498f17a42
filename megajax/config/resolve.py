"""From a config to the resolved run: ``resolve`` turns the ConfigDict into a frozen ``RunSpec`` (``run.py``: the
model's spec and config, the mesh shape, the rules, the parallelism, the batch, and the typed sections of training:
``train``, ``optimizer``, ``loss_scale``, ``checkpoint``, ``data``, ``init_from``) and checks it (``checks.py``);
nothing below this layer reads the ConfigDict. A tool that weighs another mesh or batch for a run asks ``replanned``,
which changes the run's facts and checks it again. A checkpoint's stored config (``RunSpec.config_json``) is read
as a ``StoredRun`` (its model, data, batch and layer order, typed).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import ml_collections

from megajax.checkpoint.manager import read_config
from megajax.config.checks import checked
from megajax.config.data_checks import check_data
from megajax.config.defaults import with_model_defaults
from megajax.config.migrate import drop_shared_model_fields, migrate_config
from megajax.config.run import FP8_PRECISION, PRECISION_DTYPES, RunSpec, StoredRun, cut_data, splits_sequence
from megajax.config.settings import (
    checkpoint_settings,
    dpo_settings,
    loss_scale_settings,
    optimizer_settings,
    settings_from,
    train_settings,
)
from megajax.data import preference, sft
from megajax.data.settings import PREFERENCE, DataSettings, DataSource
from megajax.errors import ConfigError
from megajax.models import MODELS, TransformerConfig, model_spec
from megajax.parallel.mesh import MeshShape
from megajax.parallel.sharding import PipelineSettings, Rules


def resolve_precision(precision: str) -> str:
    """'auto' is bf16 on GPU/TPU and fp32 on CPU."""
    if precision != "auto":
        return precision
    return "fp32" if jax.default_backend() == "cpu" else "bf16"


def model_config(config: ml_collections.ConfigDict) -> TransformerConfig:
    """The model family's own frozen config (its spec's ``config`` type) from ``config.model``, the compute dtype
    (and whether the blocks' GEMMs are FP8) from ``train.precision``. A field the family's type lacks is unknown:
    ConfigError naming the family's fields."""
    m = config.model
    spec = model_spec(m.name)  # an unknown name fails first, naming the choices
    precision = resolve_precision(config.train.precision)
    if precision not in PRECISION_DTYPES:
        raise ConfigError(f"train.precision={precision!r}; choose one of {['auto', *sorted(PRECISION_DTYPES)]}")
    fields = spec.config.fields()
    if unknown := set(m) - set(fields) - {"name"}:
        raise ConfigError(f"model.name={m.name} has no field {', '.join(f'model.{f}' for f in sorted(unknown))}; "
                          f"its fields ({spec.config.__name__}) are name, {', '.join(fields)}")
    try:
        return spec.config(**{f: m[f] for f in fields if f in m}, dtype=PRECISION_DTYPES[precision],
                           fp8=precision == FP8_PRECISION)
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from e


def stored_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A config read from a checkpoint (its JSON brought up to today's fields by ``config.migrate.migrate_config``;
    ``config.load.run_config``) as its family reads it today: without the fields every model's section held before
    each family had its own config type (``migrate.SHARED_MODEL_FIELDS``) where its family has none, and with the
    family's defaults for what it leaves out (``with_model_defaults``). An unknown family is left for
    ``model_config`` to name."""
    if config.model.get("name") not in MODELS:
        return config
    return with_model_defaults(drop_shared_model_fields(config, model_spec(config.model.name).config.fields()))


# config.model fields that say how a model trains, not what function its parameters compute; every other field
# (a new family's too) must match for a checkpoint to be resumed
TRAINING_ONLY_FIELDS = ("dropout", "init_std", "remat", "expert_exchange", "expert_gemm", "expert_room")


def _values(section: ml_collections.ConfigDict | RunSpec) -> dict:
    """Each field of ``section``'s family (its spec's config type): as the section sets it, else the default (a
    resolved run: its model's)."""
    if isinstance(section, (RunSpec, StoredRun)):
        return {"name": section.model_name, **{f: getattr(section.model, f) for f in section.model.fields()}}
    if section.get("name") not in MODELS:
        return dict(section)
    defaults = model_spec(section.name).config()
    return {"name": section.name, **{f: section.get(f, getattr(defaults, f)) for f in defaults.fields()}}


def model_differences(saved: ml_collections.ConfigDict | StoredRun,
                      requested: ml_collections.ConfigDict | RunSpec | StoredRun,
                      ignore: tuple[str, ...] = ()) -> dict[str, tuple[Any, Any]]:
    """field -> (saved, requested) for each field where two ``config.model`` sections (or a resolved or stored
    run's model) differ, over every field of either family but ``TRAINING_ONLY_FIELDS`` and ``ignore``, the name
    first. A field a section leaves out reads as its family's default; one its family does not have, as None."""
    ours, theirs = _values(saved), _values(requested)
    names = (set(ours) | set(theirs)) - set(TRAINING_ONLY_FIELDS) - set(ignore)
    return {f: (ours.get(f), theirs.get(f)) for f in sorted(names, key=lambda f: (f != "name", f))
            if ours.get(f) != theirs.get(f)}


def describe_differences(differences: dict[str, tuple[Any, Any]]) -> str:
    """``"model.F: A saved, B here; ..."`` for ``model_differences``."""
    return "; ".join(f"model.{f}: {a!r} saved, {b!r} here" for f, (a, b) in differences.items())


def given_rules(config: ml_collections.ConfigDict) -> Rules:
    """``config.sharding.rules`` as a hashable tuple of pairs."""
    return tuple((str(k), None if v is None else str(v)) for k, v in config.sharding.rules)


def rules_of(config: ml_collections.ConfigDict) -> Rules:
    """The logical-axis rules a config's run applies (``run.rules_for``), checked against its mesh's axes."""
    return run_of(config).rules


def sequence_flag(config: ml_collections.ConfigDict) -> bool:
    """Whether the run splits the residual stream's sequence over ``model``: ``parallel.sequence``, or a ``seq_sp``
    rule that does, beyond the ``context`` split every sequence has under context parallelism."""
    return bool(config.parallel.sequence) or splits_sequence(given_rules(config))


def validate(config: ml_collections.ConfigDict, num_devices: int) -> MeshShape:
    """Checks a config against the device count, but for the fields only training reads (``checks.checked``);
    returns its mesh shape, ``data=-1`` resolved."""
    return checked(run_of(config), num_devices, training=False).mesh


def data_source(config: ml_collections.ConfigDict) -> DataSource:
    """``config.data`` as the frozen settings the run holds."""
    return settings_from(DataSource, config.data)


def data_settings(config: ml_collections.ConfigDict) -> DataSettings:
    """``config.data`` cut for the config's model and global batch (``RunSpec.dataset``)."""
    return cut_data(data_source(config), model_config(config), config.train.global_batch_size)


def stored_run(config: ml_collections.ConfigDict) -> StoredRun:
    """A stored config (as ``stored_config`` returns it) typed: ConfigError where its model is not one today's
    code reads."""
    return StoredRun(config.model.name, model_config(config), data_source(config), config.train.global_batch_size,
                     (config.mesh.pipe, config.parallel.pipeline_repeats))


# config.model.name of a config whose model is its init_from checkpoint's (configs/sft.py): the section's other
# fields are max_seq_len (0: the checkpoint's) and the training-only dropout and remat, which the run sets
FROM_INIT = "init_from"


def model_from_init(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """``config``, or where its ``model.name`` is ``FROM_INIT`` a copy whose model section is its ``init_from``
    checkpoint's (a converted model's, a pretraining run's), with the section's ``max_seq_len`` (where > 0),
    ``dropout`` and ``remat``: a fine-tuning config need not restate the model. ``max_seq_len=0`` keeps the
    checkpoint's, but for fine-tuning files (``data.source=sft``, ``preference``) means the longest example (pair)
    rounded up (``default_seq_len`` of ``data.sft``, ``data.preference``), at most the checkpoint's. ConfigError
    without a checkpoint."""
    if config.model.name != FROM_INIT:
        return config
    if not config.init_from:
        raise ConfigError(f"model.name={FROM_INIT} takes the model from a checkpoint: set --config.init_from=PATH (a "
                          "converted model or a training run's workdir)")
    try:
        stored = stored_config(migrate_config(read_config(config.init_from)))
    except (OSError, ValueError) as e:
        raise ConfigError(f"init_from={config.init_from!r} holds no readable checkpoint config ({e}); pass a "
                          "converted model or a training run's workdir") from None
    given = config.model
    config = config.copy_and_resolve_references()
    config.model = stored.model
    config.model.update(dropout=given.dropout, remat=given.remat)
    if given.max_seq_len > 0:
        config.model.max_seq_len = given.max_seq_len
    elif config.data.source == "sft":  # rows as long as the file needs, not the model's whole context (131K)
        config.model.max_seq_len = sft.default_seq_len(config.data.path, config.data.tokenizer,
                                                       config.data.sft_skip_bad_rows, stored.model.max_seq_len)[0]
    elif config.data.source == PREFERENCE:  # as long as the longest pair needs
        config.model.max_seq_len = preference.default_seq_len(config.data.path, config.data.tokenizer,
                                                              config.data.sft_skip_bad_rows, stored.model.max_seq_len)
    return config


def run_of(config: ml_collections.ConfigDict) -> RunSpec:
    """``config`` as a RunSpec, unchecked but for each field's own values (the mesh's degrees, the model's fields):
    ``resolve`` checks it."""
    mesh = MeshShape.of(config.mesh)  # every degree checked before anything divides by one
    parallel = config.parallel
    return RunSpec(model_name=config.model.name, model=model_config(config), mesh=mesh,
                   given_rules=given_rules(config), global_batch=config.train.global_batch_size,
                   sequence=sequence_flag(config), shard_optimizer=bool(parallel.shard_optimizer or parallel.fsdp),
                   fsdp=bool(parallel.fsdp),
                   pipeline=PipelineSettings(parallel.pipeline_schedule, parallel.pipeline_microbatches,
                                             parallel.pipeline_repeats, parallel.pipeline_stage_recompute),
                   data=data_source(config), train=train_settings(config), optimizer=optimizer_settings(config),
                   loss_scale=loss_scale_settings(config), checkpoint=checkpoint_settings(config),
                   init_from=config.init_from, dpo=dpo_settings(config))


def resolve(config: ml_collections.ConfigDict, num_devices: int, training: bool = True) -> RunSpec:
    """Validates a config against ``num_devices`` and resolves it into the run (``checks.checked``).
    ``training=False`` (a model loaded for inference) skips the fields only training reads; the batch is then the
    config's, in one step. A config whose model is its ``init_from`` checkpoint's reads it first
    (``model_from_init``)."""
    return checked(run_of(model_from_init(config)), num_devices, training)


def replanned(run: RunSpec, num_devices: int | None = None, training: bool = True, **changes: Any) -> RunSpec:
    """``run`` with some of its facts changed (``dataclasses.replace``: ``mesh=``, ``pipeline=``, ``model=``,
    ``global_batch=``, ``train=``, ...) and checked again, for a tool weighing another choice; what follows from the
    facts (the rules, the micro-batches) follows. ``num_devices``: the devices the new mesh is checked against
    (default: as many as it takes; a mesh with ``data=-1`` keeps the run's device count). ConfigError as
    ``resolve`` raises it."""
    try:
        changed = dataclasses.replace(run, **changes)
    except TypeError as e:  # a name that is not a RunSpec field
        raise ConfigError(f"replanned: {e}") from None
    devices = run.mesh.devices if changed.mesh.data == -1 else changed.mesh.devices
    return checked(changed, devices if num_devices is None else num_devices, training)


def check_data_source(config: ml_collections.ConfigDict) -> None:
    """Raises ConfigError when the model and ``config.data`` do not fit: pretraining models read corpora (their
    spec's example format), fine-tuning models ``data.source=task`` with one of the tasks their spec lists."""
    check_data(model_spec(config.model.name), config.data)


def check_run_data(run: RunSpec) -> None:
    """``check_data_source`` of a resolved run."""
    check_data(run.model_spec, run.dataset)
