"""From a config to a run: the defaults (``defaults.py``), the run (``run.py``: ``RunSpec``, ``StoredRun``), its
checks (``checks.py``), resolving a config into it (``resolve.py``), and the mesh and sharded model it describes
(``build.py``)."""

from megajax.config.build import (
    abstract_model,
    abstract_model_of,
    build_mesh,
    create_model,
    model_factory,
    run_model_factory,
)
from megajax.config.defaults import NO_SCHEDULE, base_config, bert_base_config, model_section, with_model_defaults
from megajax.config.resolve import (
    TRAINING_ONLY_FIELDS,
    check_data_source,
    check_run_data,
    data_settings,
    describe_differences,
    model_config,
    model_differences,
    replanned,
    resolve,
    resolve_precision,
    rules_of,
    stored_config,
    stored_run,
    validate,
)
from megajax.config.run import RunSpec, StoredRun
from megajax.config.settings import (
    LossScaleSettings,
    OptimizerSettings,
    TrainSettings,
    checkpoint_settings,
    loss_scale_settings,
    optimizer_settings,
    train_settings,
)
from megajax.errors import ConfigError
from megajax.models.transformer import padded_vocab_size

__all__ = ["NO_SCHEDULE", "TRAINING_ONLY_FIELDS", "ConfigError", "LossScaleSettings", "OptimizerSettings", "RunSpec",
           "StoredRun", "TrainSettings", "abstract_model", "abstract_model_of", "base_config", "bert_base_config",
           "build_mesh", "check_data_source", "check_run_data", "checkpoint_settings", "create_model", "data_settings",
           "describe_differences", "loss_scale_settings", "model_config", "model_differences",
           "model_factory", "model_section", "optimizer_settings", "padded_vocab_size", "replanned", "resolve",
           "resolve_precision", "rules_of", "run_model_factory", "stored_config", "stored_run", "train_settings",
           "validate", "with_model_defaults"]
