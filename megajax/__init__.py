"""megajax: Megatron-LM's tensor + data parallelism in JAX/Flax NNX.

The public entry points (``megajax.api``) are importable from here: ``load_model``, ``load_config``, ``train``,
``evaluate``, ``resolve``, ``create_model``, ``base_config``, ``bert_base_config``, ``model_spec``. They load on first
use, so ``import megajax`` (and the command-line tools' argument parsing) does not start jax.
"""

import importlib

from megajax.platform import cpu_without_a_gpu

__version__ = "0.1.0"
cpu_without_a_gpu()  # before anything imports jax (a no-op but where the CUDA plugin is installed without a GPU)

_API = ("LoadedModel", "ModelSpec", "RunSpec", "base_config", "bert_base_config", "create_model", "evaluate",
        "load_config", "load_model", "model_spec", "resolve", "train")
__all__ = list(_API)


def __getattr__(name: str):
    if name in _API:
        return getattr(importlib.import_module("megajax.api"), name)
    raise AttributeError(f"module 'megajax' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])
