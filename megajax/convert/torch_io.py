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
    if allow_pickle:
        return torch.load(path, map_location="cpu", weights_only=False)
    try:
        with torch.serialization.safe_globals([argparse.Namespace]):
            return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - torch raises UnpicklingError subclasses and RuntimeErrors here
        raise ValueError(f"{path} cannot be loaded with weights_only=True ({str(e)[:200]}); if you trust the file, "
                         "pass --allow_pickle") from e


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
