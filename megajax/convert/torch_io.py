"""Reading and writing PyTorch checkpoint files without executing pickled code (optional extra ``convert``)."""

from __future__ import annotations

import argparse
import pathlib
from typing import Any

import numpy as np


def _torch():
    try:
        import torch
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError("converting PyTorch checkpoints needs the optional extra: pip install 'megajax[convert]'") \
            from e
    return torch


def load(path: str | pathlib.Path, allow_pickle: bool = False) -> Any:
    """``torch.load`` with ``weights_only=True`` (plus argparse.Namespace, which Megatron stores its args in).

    Real Megatron checkpoints may also pickle RNG states; those need ``allow_pickle=True``, which runs pickled code
    and must only be used on files you trust.
    """
    torch = _torch()
    try:
        if allow_pickle:
            return torch.load(path, map_location="cpu", weights_only=False)
        with torch.serialization.safe_globals([argparse.Namespace]):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises UnpicklingError subclasses and RuntimeErrors here
        if not allow_pickle and "Weights only load failed" in str(e):  # readable, but it pickles code
            raise ValueError(f"{path} holds pickled objects that weights_only=True refuses ({_first_line(e)}); if "
                             "you trust the file, pass --allow_pickle") from e
        raise ValueError(f"{path} cannot be read as a PyTorch checkpoint ({_first_line(e)}): the file is truncated "
                         "or damaged; copy or save it again") from e


def _first_line(error: Exception, limit: int = 160) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text if len(text) <= limit else text[:limit] + "..."


def save(obj: Any, path: str | pathlib.Path) -> None:
    _torch().save(obj, path)


def to_numpy(t) -> np.ndarray:
    """A torch tensor (any float dtype, bf16 included) as a float32 numpy array; non-floats as they are."""
    torch = _torch()
    if t.is_floating_point():
        return t.detach().to(torch.float32).cpu().numpy()
    return t.detach().cpu().numpy()


def to_torch(a: np.ndarray, dtype: str = "float32"):
    torch = _torch()
    return torch.from_numpy(np.array(a, dtype=np.float32, copy=True)).to(getattr(torch, dtype))
