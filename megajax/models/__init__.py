"""Model definitions."""

from megajax.models.gpt import GPT, GPTConfig

__all__ = ["GPT", "GPTConfig"]
