"""A Hugging Face ``config.json``'s numbers as the converters read them: one rule for every size, count and
coefficient, so that a null, a string or a fraction where a whole number belongs is one line naming the field (and,
through ``ConfigJsonError.at``, the file), not a TypeError in a later comparison.

Null follows transformers (v5 validates its config classes' types): a field typed ``int`` refuses it, whatever its
default, and a field typed ``int | None`` gives null a meaning of its own (``head_dim``: hidden_size / heads;
Llama's ``num_key_value_heads``: the heads'; GPT-2's ``n_inner``: 4 x n_embd), which the caller passes as ``null``.
"""

from __future__ import annotations

import json
import pathlib

REQUIRED = object()  # no default: the field must be there, with a value


class ConfigJsonError(ValueError):
    """A config.json value megajax cannot use, as ``{file} {problem}``; ``at(path)`` names the file read."""

    def __init__(self, problem: str, file: str | pathlib.Path = "config.json"):
        self.problem, self.file = problem, str(file)
        super().__init__(f"{self.file} {problem}")

    def at(self, path: str | pathlib.Path) -> ConfigJsonError:
        return ConfigJsonError(self.problem, path)


def number(hf: dict, key: str, *, default: object = REQUIRED, null: object = REQUIRED, minimum: float | None = 1,
           whole: bool = True) -> int | float:
    """config.json's ``key``: a whole number (``whole=False``: any number) of at least ``minimum`` (None: any).
    Absent, ``default``; null, ``null``; either refused (ConfigJsonError) where not given, as a value that is not a
    number of that kind (true / false included) or is below ``minimum``."""
    want = ("a whole number" if whole else "a number") + ("" if minimum is None else f" >= {minimum}")
    if key not in hf:
        if default is REQUIRED:
            raise ConfigJsonError(f"has no {key} ({want}): give the config.json save_pretrained wrote")
        return default
    value = hf[key]
    if value is None:
        if null is REQUIRED:
            raise ConfigJsonError(f"{key}=null, where {want} is needed (transformers refuses null there too): "
                                  "write the model's value there")
        return null
    kinds = (int,) if whole else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise ConfigJsonError(f"{key}={json.dumps(value)} is not {want}: write the model's value as one")
    if minimum is not None and value < minimum:
        raise ConfigJsonError(f"{key}={json.dumps(value)}: {key} must be {want}")
    return value
