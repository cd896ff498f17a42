"""Model definitions, picked by ``config.model.name``: every model is built from a ``TransformerConfig``."""

from megajax.models.bert import BERT
from megajax.models.gpt import GPT
from megajax.models.transformer import TransformerConfig

MODELS = {"gpt": GPT, "bert": BERT}

__all__ = ["BERT", "GPT", "MODELS", "TransformerConfig"]
