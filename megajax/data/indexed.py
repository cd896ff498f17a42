"""The on-disk token format: ``PREFIX.bin`` (raw token ids), ``PREFIX.idx.npy`` (document offsets) and
``PREFIX.json`` (tokenizer, dtype and counts). The JSON sidecar is written last and marks a complete dataset:
a prefix without it is refused, so an interrupted run never passes for a finished one.

A sentence-split dataset (``preprocess --split_sentences``) adds ``PREFIX.sentences.npy`` ((S, 2) int64: token
start and end of each sentence) and ``PREFIX.doc_sentences.npy`` ((D + 1,) int64: document d holds sentences
``doc_sentences[d]:doc_sentences[d + 1]``). Sentences cover each document's tokens except its final end-of-document
id, so the documents (the GPT view) are the same as without splitting. ``PREFIX.tokenizer.json`` (written when
the writer is given a tokenizer) lets training read the special ids from the dataset itself."""

from __future__ import annotations

import array
import dataclasses
import json
import os
import pathlib
from collections.abc import Sequence

import numpy as np
from tokenizers import Tokenizer

from megajax.data.tokenizer import vocabulary_fingerprint
from megajax.errors import UserError
from megajax.outputs import (
    DATASET_SUFFIXES,
    DOC_SENTENCES,
    INDEX,
    META,
    SENTENCES,
    TOKENIZER,
    TOKENS,
    make_directory,
    remove_created,
)

# the file names live with the rule that protects them (megajax.outputs); META last: it marks completion
SUFFIXES = DATASET_SUFFIXES


class DatasetError(UserError, ValueError):
    """A preprocessed dataset that is incomplete, truncated or inconsistent; the message says to re-run
    preprocessing."""


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


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_stale_temporaries(prefix: pathlib.Path) -> list[pathlib.Path]:
    """Removes ``PREFIX.tmp-PID.*`` files whose writer process is gone (killed with SIGKILL, or its machine
    restarted); returns them. A live writer's files are left alone."""
    stale = []
    for path in prefix.parent.glob(f"{prefix.name}.tmp-*"):
        pid = path.name[len(prefix.name) + len(".tmp-"):].split(".", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            path.unlink(missing_ok=True)
            stale.append(path)
    return stale


class IndexedWriter:
    """Appends documents to temporary files; ``commit(meta)`` moves them into place, sidecar last.

    Documents are added whole (``add``) or as sentences (``add_sentences``), not both in one dataset."""

    def __init__(self, prefix: str | pathlib.Path, dtype: np.dtype, tokenizer_json: str | None = None):
        self.prefix = pathlib.Path(prefix)
        self._created = make_directory(self.prefix.parent)  # removed again if the dataset is not committed
        remove_stale_temporaries(self.prefix)
        self.dtype = np.dtype(dtype)
        self.tokenizer_json = tokenizer_json
        self._tmp = pathlib.Path(f"{self.prefix}.tmp-{os.getpid()}")
        self._file = open(f"{self._tmp}{TOKENS}", "wb")
        self._offsets = [0]
        self._sentences: array.array | None = None  # start, end, start, end, ...; set by the first add_sentences
        self._doc_sentences = array.array("q", [0])

    def add(self, ids: Sequence[int]) -> None:
        """Appends one document (its end-of-document id included)."""
        if self._sentences is not None:
            raise ValueError("this dataset is sentence-split: add documents with add_sentences")
        self._write(ids)

    def add_sentences(self, sentences: Sequence[Sequence[int]], eod_id: int) -> None:
        """Appends one document given as its sentences' ids; ``eod_id`` follows the last sentence."""
        if self._sentences is None:
            if len(self._offsets) > 1:
                raise ValueError("this dataset holds whole documents: add them with add")
            self._sentences = array.array("q")
        position, count = self._offsets[-1], 0
        for sentence in sentences:
            if len(sentence):  # an empty sentence adds nothing to the document
                self._sentences.extend((position, position + len(sentence)))
                position += len(sentence)
                count += 1
        self._write([i for s in sentences for i in s] + [eod_id])
        self._doc_sentences.append(self._doc_sentences[-1] + count)

    def _write(self, ids: Sequence[int]) -> None:
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() > np.iinfo(self.dtype).max):
            raise ValueError(f"token id {int(arr.max())} does not fit {self.dtype.name}; use --dtype=uint32")
        self._file.write(arr.astype(self.dtype).tobytes())
        self._offsets.append(self._offsets[-1] + arr.size)

    def commit(self, meta: dict) -> None:
        self._file.close()
        np.save(f"{self._tmp}{INDEX}", np.asarray(self._offsets, dtype=np.int64))
        extra = {"dtype": self.dtype.name, "documents": len(self._offsets) - 1, "tokens": self._offsets[-1]}
        if self._sentences is not None:
            np.save(f"{self._tmp}{SENTENCES}", np.frombuffer(self._sentences, dtype=np.int64).reshape(-1, 2))
            np.save(f"{self._tmp}{DOC_SENTENCES}", np.frombuffer(self._doc_sentences, dtype=np.int64))
            extra["sentences"] = len(self._sentences) // 2
        if self.tokenizer_json is not None:
            pathlib.Path(f"{self._tmp}{TOKENIZER}").write_text(self.tokenizer_json)
        pathlib.Path(f"{self._tmp}{META}").write_text(json.dumps({**meta, **extra}, indent=1))
        pathlib.Path(f"{self.prefix}{META}").unlink(missing_ok=True)  # the old dataset stops being complete first
        for suffix in SUFFIXES:
            if pathlib.Path(f"{self._tmp}{suffix}").exists():
                os.replace(f"{self._tmp}{suffix}", f"{self.prefix}{suffix}")
            else:  # an older dataset's sentence or tokenizer file must not pass for this one's
                pathlib.Path(f"{self.prefix}{suffix}").unlink(missing_ok=True)

    def abort(self) -> None:
        """Removes the temporary files (also when closing fails, as on a full disk)."""
        try:
            self._file.close()
        except OSError:  # its buffered bytes found no room: the file goes anyway
            pass
        for suffix in SUFFIXES:
            pathlib.Path(f"{self._tmp}{suffix}").unlink(missing_ok=True)
        remove_created(self._created)


def _read_meta(path: pathlib.Path) -> dict:
    """A dataset's sidecar, checked to hold what reading the dataset needs (DatasetError naming the file if not)."""
    try:
        meta = json.loads(path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DatasetError(f"{path} is not a dataset's JSON sidecar ({e}): the dataset is damaged; re-run "
                           "preprocessing") from None
    if not isinstance(meta, dict):
        raise DatasetError(f"{path} is not a dataset's sidecar (it holds no JSON object); re-run preprocessing")
    missing = [k for k in ("dtype", "tokens") if k not in meta] + (
        [] if meta.get("dtype") in ("uint16", "uint32", None) else [f"dtype (uint16 or uint32, not {meta['dtype']!r})"])
    if "sentences" in meta and not isinstance(meta["sentences"], int):
        missing.append("sentences (a count)")
    if missing or not isinstance(meta.get("tokens"), int):
        raise DatasetError(f"{path} lacks what a dataset's sidecar holds ({', '.join(missing) or 'tokens (a count)'}):"
                           " it was not written by preprocessing, or was edited; re-run preprocessing")
    return meta


@dataclasses.dataclass
class IndexedTokens:
    """A memory-mapped token file with its document offsets, metadata and (if sentence-split) sentence bounds."""

    tokens: np.ndarray  # (T,) uint16/uint32, memory-mapped
    offsets: np.ndarray  # (D + 1,) int64: document d is tokens[offsets[d]:offsets[d + 1]]
    meta: dict
    prefix: pathlib.Path | None = None
    sentences: np.ndarray | None = None  # (S, 2) int64 [start, end) token positions, memory-mapped
    doc_sentences: np.ndarray | None = None  # (D + 1,) int64: document d has sentences doc_sentences[d]:[d + 1]

    @classmethod
    def open(cls, prefix: str | pathlib.Path) -> "IndexedTokens":
        prefix = pathlib.Path(prefix)
        meta_path = pathlib.Path(f"{prefix}{META}")
        if not meta_path.is_file():
            if pathlib.Path(f"{prefix}{TOKENS}").exists():
                raise DatasetError(f"{prefix}{TOKENS} has no {META} sidecar: preprocessing did not finish; re-run it")
            raise FileNotFoundError(f"no preprocessed dataset at {prefix} (expected {meta_path}); create one with "
                                    "python -m megajax.data.preprocess --output_prefix=...")
        meta = _read_meta(meta_path)
        dtype = np.dtype(meta["dtype"])
        for suffix in (TOKENS, INDEX):
            if not pathlib.Path(f"{prefix}{suffix}").is_file():
                raise DatasetError(f"{prefix}{suffix} is missing beside {meta_path}: the dataset is incomplete; "
                                   "re-run preprocessing")
        size = os.path.getsize(f"{prefix}{TOKENS}")
        if size % dtype.itemsize:
            raise DatasetError(f"{prefix}{TOKENS} has {size} bytes, not a whole number of {dtype.name} ids (the "
                             f"dtype in {meta_path}): the file is truncated or from another run; re-run preprocessing")
        tokens = np.memmap(f"{prefix}{TOKENS}", dtype=dtype, mode="r")
        offsets = np.load(f"{prefix}{INDEX}")
        if len(tokens) != meta["tokens"] or offsets[-1] != len(tokens):
            raise DatasetError(f"{prefix}: token file holds {len(tokens)} ids but the index says {offsets[-1]} and "
                             f"the sidecar {meta['tokens']}: the files are corrupt or from different runs")
        data = cls(tokens, offsets, meta, prefix)
        if "sentences" in meta:
            data.sentences = np.load(f"{prefix}{SENTENCES}", mmap_mode="r")
            data.doc_sentences = np.load(f"{prefix}{DOC_SENTENCES}")
            if (len(data.sentences) != meta["sentences"] or len(data.doc_sentences) != len(offsets)
                    or data.doc_sentences[-1] != len(data.sentences)):
                raise DatasetError(f"{prefix}: {SENTENCES} / {DOC_SENTENCES} do not match the sidecar's "
                                 f"{meta['sentences']} sentences in {len(offsets) - 1} documents; re-run preprocessing")
        return data

    def document(self, d: int) -> np.ndarray:
        return self.tokens[self.offsets[d]:self.offsets[d + 1]]

    def tokenizer_fingerprint(self) -> str:
        """The vocabulary fingerprint of the dataset's tokenizer (``tokenizer.vocabulary_fingerprint``): from the
        sidecar, else from the saved tokenizer file (datasets written before fingerprints), else "" (unknown)."""
        if "tokenizer_fingerprint" in self.meta:
            return self.meta["tokenizer_fingerprint"]
        path = self.tokenizer_path()
        return vocabulary_fingerprint(Tokenizer.from_file(str(path))) if path is not None else ""

    def tokenizer_path(self) -> pathlib.Path | None:
        """The tokenizer saved with the dataset, if any."""
        if self.prefix is None:
            return None
        path = pathlib.Path(f"{self.prefix}{TOKENIZER}")
        return path if path.is_file() else None
