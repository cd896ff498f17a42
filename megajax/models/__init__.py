"""Model definitions, picked by ``config.model.name``: every model is built from a ``TransformerConfig``."""

from megajax.models.bert import BERT
from megajax.models.gpt import GPT
from megajax.models.heads import BERTClassifier, BERTMultipleChoice, BERTSpan
from megajax.models.transformer import TransformerConfig

MODELS = {"gpt": GPT, "bert": BERT, "bert_classifier": BERTClassifier, "bert_multiple_choice": BERTMultipleChoice,
          "bert_span": BERTSpan}

__all__ = ["BERT", "BERTClassifier", "BERTMultipleChoice", "BERTSpan", "GPT", "MODELS", "TransformerConfig"]
