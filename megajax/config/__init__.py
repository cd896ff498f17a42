"""From a config to a run: the defaults (``defaults.py``), the checks and the resolved ``RunSpec``
(``resolve.py``), and the mesh and sharded model it describes (``build.py``)."""

from megajax.config.build import abstract_model, build_mesh, create_model, model_factory
from megajax.config.defaults import base_config, bert_base_config
from megajax.config.resolve import (
                                    TRAINING_ONLY_FIELDS,
                                    RunSpec,
                                    check_data_source,
                                    layer_layout,
                                    model_config,
                                    model_differences,
                                    padded_vocab_size,
                                    resolve,
                                    resolve_precision,
                                    rules_of,
                                    sequence_parallel,
                                    state_split,
                                    validate,
                                    validate_training,
)
from megajax.errors import ConfigError

__all__ = ["TRAINING_ONLY_FIELDS", "ConfigError", "RunSpec", "abstract_model", "base_config", "bert_base_config",
           "build_mesh", "check_data_source", "create_model", "layer_layout", "model_config", "model_differences",
           "model_factory", "padded_vocab_size", "resolve", "resolve_precision", "rules_of", "sequence_parallel",
           "state_split", "validate", "validate_training"]
