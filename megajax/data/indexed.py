"""The on-disk token format: ``PREFIX.bin`` (raw token ids), ``PREFIX.idx.npy`` (document offsets) and
``PREFIX.json`` (tokenizer, dtype and counts). The JSON sidecar is written last and marks a complete dataset:
a prefix without it is refused, so an interrupted run never passes for a finished one."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Sequence

import numpy as np

TOKENS, INDEX, META = ".bin", ".idx.npy", ".json"


def choose_dtype(vocab_size: int, requested: str = "auto") -> np.dtype:
    """uint16 when every id fits (vocab <= 65536), else uint32; an explicit request is checked."""
    if requested == "auto":
        return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)
    dtype = np.dtype(requested)
    if dtype not in (np.uint16, np.uint32):
        raise ValueError(f"token dtype {requested!r}; choose uint16, uint32 or auto")
    if vocab_size > np.iinfo(dtype).max + 1:
        raise ValueError(f"a vocabulary of {vocab_size} ids does not fit {dtype.name}; use uint32 or auto")
    return dtype


class IndexedWriter:
    """Appends documents to temporary files; ``commit(meta)`` moves them into place, sidecar last."""

    def __init__(self, prefix: str | pathlib.Path, dtype: np.dtype):
        self.prefix = pathlib.Path(prefix)
        self.prefix.parent.mkdir(parents=True, exist_ok=True)
        self.dtype = np.dtype(dtype)
        self._tmp = pathlib.Path(f"{self.prefix}.tmp-{os.getpid()}")
        self._file = open(f"{self._tmp}{TOKENS}", "wb")
        self._offsets = [0]

    def add(self, ids: Sequence[int]) -> None:
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(self.dtype).max):
            raise ValueError(f"token id {int(arr.max())} does not fit {self.dtype.name}; use --dtype=uint32")
        self._file.write(arr.astype(self.dtype).tobytes())
        self._offsets.append(self._offsets[-1] + arr.size)

    def commit(self, meta: dict) -> None:
        self._file.close()
        np.save(f"{self._tmp}{INDEX}", np.asarray(self._offsets, dtype=np.int64))
        pathlib.Path(f"{self._tmp}{META}").write_text(json.dumps({**meta, "dtype": self.dtype.name,
                                                                  "documents": len(self._offsets) - 1,
                                                                  "tokens": self._offsets[-1]}, indent=1))
        pathlib.Path(f"{self.prefix}{META}").unlink(missing_ok=True)  # the old dataset stops being complete first
        os.replace(f"{self._tmp}{TOKENS}", f"{self.prefix}{TOKENS}")
        os.replace(f"{self._tmp}{INDEX}", f"{self.prefix}{INDEX}")
        os.replace(f"{self._tmp}{META}", f"{self.prefix}{META}")

    def abort(self) -> None:
        self._file.close()
        for suffix in (TOKENS, INDEX, META):
            pathlib.Path(f"{self._tmp}{suffix}").unlink(missing_ok=True)


@dataclasses.dataclass
class IndexedTokens:
    """A memory-mapped token file with its document offsets and metadata."""

    tokens: np.ndarray  # (T,) uint16/uint32, memory-mapped
    offsets: np.ndarray  # (D + 1,) int64: document d is tokens[offsets[d]:offsets[d + 1]]
    meta: dict

    @classmethod
    def open(cls, prefix: str | pathlib.Path) -> "IndexedTokens":
        prefix = pathlib.Path(prefix)
        meta_path = pathlib.Path(f"{prefix}{META}")
        if not meta_path.is_file():
            if pathlib.Path(f"{prefix}{TOKENS}").exists():
                raise ValueError(f"{prefix}{TOKENS} has no {META} sidecar: preprocessing did not finish; re-run it")
            raise FileNotFoundError(f"no preprocessed dataset at {prefix} (expected {meta_path}); create one with "
                                    "python -m megajax.data.preprocess --output_prefix=...")
        meta = json.loads(meta_path.read_text())
        tokens = np.memmap(f"{prefix}{TOKENS}", dtype=np.dtype(meta["dtype"]), mode="r")
        offsets = np.load(f"{prefix}{INDEX}")
        if len(tokens) != meta["tokens"] or offsets[-1] != len(tokens):
            raise ValueError(f"{prefix}: token file holds {len(tokens)} ids but the index says {offsets[-1]} and "
                             f"the sidecar {meta['tokens']}: the files are corrupt or from different runs")
        return cls(tokens, offsets, meta)

    def document(self, d: int) -> np.ndarray:
        return self.tokens[self.offsets[d]:self.offsets[d + 1]]
