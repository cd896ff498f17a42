"""The models. Each file registers its ``ModelSpec`` (``spec.py``) under its ``config.model.name``; importing this
package registers them all. ``transformer.py`` is the trunk every model shares; ``objectives.py`` the losses."""

from megajax.models import bert, deepseek, gpt, heads, llama, moe  # noqa: F401 - each registers its spec
from megajax.models.spec import MODELS, ModelSpec, eval_task_models, model_spec, task_models
from megajax.models.transformer import TransformerConfig

__all__ = ["MODELS", "ModelSpec", "TransformerConfig", "eval_task_models", "model_spec", "task_models"]
