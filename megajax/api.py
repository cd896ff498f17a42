"""The entry points a user scripts against, importable from the package top (``megajax.load_model`` ...)."""

from __future__ import annotations

from megajax.cli import load_config
from megajax.config import RunSpec, base_config, bert_base_config, create_model, resolve
from megajax.config.load import LoadedModel, load_model
from megajax.evaluation.runner import run as evaluate
from megajax.models import ModelSpec, model_spec
from megajax.training.loop import train

__all__ = ["LoadedModel", "ModelSpec", "RunSpec", "base_config", "bert_base_config", "create_model", "evaluate",
           "load_config", "load_model", "model_spec", "resolve", "train"]

