"""From a config to a run: the defaults (``defaults.py``), the checks and the resolved ``RunSpec``
(``resolve.py``), and the mesh and sharded model it describes (``build.py``)."""

from megajax.config.build import abstract_model, build_mesh, create_model, model_factory
from megajax.config.defaults import base_config, bert_base_config, model_section, with_model_defaults
from megajax.config.resolve import (
                                    TRAINING_ONLY_FIELDS,
                                    RunSpec,
                                    check_data_source,
                                    describe_differences,
                                    layer_layout,
                                    model_config,
                                    model_differences,
                                    resolve,
                                    resolve_precision,
                                    rules_of,
                                    sequence_parallel,
                                    state_split,
                                    stored_config,
                                    validate,
                                    validate_training,
)
from megajax.errors import ConfigError
from megajax.models.transformer import padded_vocab_size

__all__ = ["TRAINING_ONLY_FIELDS", "ConfigError", "RunSpec", "abstract_model", "base_config", "bert_base_config",
           "build_mesh", "check_data_source", "create_model", "describe_differences", "layer_layout", "model_config",
           "model_differences", "model_factory", "model_section", "padded_vocab_size", "resolve", "resolve_precision",
           "rules_of", "sequence_parallel", "state_split", "stored_config", "validate", "validate_training",
           "with_model_defaults"]
