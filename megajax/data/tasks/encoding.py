"""BERT inputs for fine-tuning: the tokenizer behind a task, ``[CLS] A [SEP] B [SEP]`` rows and the encoded task.

Rows are stored compactly (token ids in the smallest integer type that holds the vocabulary, plus where segment B
starts and where padding starts) and expanded to the model's int32 ``tokens`` / ``token_types`` /
``padding_mask`` only for the rows of a batch: RACE's 4 x 512 positions per question stay a few hundred MB.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Sequence

import numpy as np
from tokenizers import Encoding, Tokenizer

from megajax.data.bert_dataset import longer_first_lengths
from megajax.data.tokenizer import TextTokenizer

INT = np.dtype(np.int32)
SPECIALS_PER_PAIR = 3  # [CLS], [SEP], [SEP]
ENCODE_CHUNK = 8192  # texts per encode_batch call: bounds the Encoding objects alive at once


@dataclasses.dataclass(frozen=True)
class Specials:
    """The special ids a BERT input row needs, and the vocabulary size (for the storage dtype)."""

    cls_id: int
    sep_id: int
    pad_id: int
    vocab_size: int


def wordpiece_backend(tokenizer: TextTokenizer | Tokenizer) -> tuple[Tokenizer, Specials]:
    """The ``tokenizers.Tokenizer`` behind ``tokenizer`` (a copy with truncation and padding off when the file set
    them, so texts are never cut silently) and its [CLS] / [SEP] / [PAD] ids."""
    backend = tokenizer.tokenizer if isinstance(tokenizer, TextTokenizer) else tokenizer
    if not isinstance(backend, Tokenizer):
        raise TypeError(f"expected a megajax TextTokenizer or a tokenizers.Tokenizer, got {type(tokenizer).__name__}")
    if backend.truncation is not None or backend.padding is not None:
        backend = Tokenizer.from_str(backend.to_str())
        backend.no_truncation()
        backend.no_padding()
    ids = {name: backend.token_to_id(name) for name in ("[CLS]", "[SEP]", "[PAD]")}
    missing = [name for name, i in ids.items() if i is None]
    if missing:
        raise ValueError(f"the tokenizer has no {', '.join(missing)} token: fine-tuning BERT needs its WordPiece "
                         "vocabulary (e.g. bert-base-uncased's vocab.txt)")
    size = backend.get_vocab_size(with_added_tokens=True)
    return backend, Specials(ids["[CLS]"], ids["[SEP]"], ids["[PAD]"], size)


def encode(backend: Tokenizer, texts: Sequence[str]) -> list[Encoding]:
    """Encodings (ids and character offsets into each text) without special tokens, in chunks."""
    out: list[Encoding] = []
    for i in range(0, len(texts), ENCODE_CHUNK):
        out.extend(backend.encode_batch(list(texts[i:i + ENCODE_CHUNK]), add_special_tokens=False))
    return out


def token_ids(backend: Tokenizer, texts: Sequence[str]) -> list[list[int]]:
    """Token ids of each text, without special tokens."""
    return [e.ids for e in encode(backend, texts)]


def truncate_longer_first(a: Sequence[int], b: Sequence[int], budget: int) -> tuple[Sequence[int], Sequence[int]]:
    """Drops tokens from the end of the longer of ``a`` and ``b`` (``b`` on ties), one at a time, until
    ``len(a) + len(b) <= budget`` (BERT's rule for sentence pairs)."""
    keep_a, keep_b = longer_first_lengths(len(a), len(b), budget)
    return a[:keep_a], b[:keep_b]


def id_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits in it (BERT's 30522 do), else int32."""
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.int32)


@dataclasses.dataclass(frozen=True)
class PackedPairs:
    """Rows ``[CLS] A [SEP] B [SEP]`` padded to ``seq_len``, possibly several per example (RACE's 4 options).

    ``tokens`` (N, *group, S): ids, the pad id past ``length``; ``b_start`` (N, *group): the position of B's first
    token (one past the first [SEP]); ``length`` (N, *group): real tokens, both [SEP]s included.
    """

    tokens: np.ndarray
    b_start: np.ndarray
    length: np.ndarray

    def __post_init__(self):
        if self.tokens.shape[:-1] != self.b_start.shape or self.b_start.shape != self.length.shape:
            raise ValueError(f"PackedPairs: tokens {self.tokens.shape}, b_start {self.b_start.shape} and length "
                             f"{self.length.shape} disagree")

    @classmethod
    def build(cls, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], seq_len: int, specials: Specials,
              group: tuple[int, ...] = ()) -> PackedPairs:
        """Packs already-truncated (A, B) id pairs, listed example by example (then option by option)."""
        size = int(np.prod(group, dtype=np.int64))
        if len(pairs) % size:
            raise ValueError(f"{len(pairs)} pairs do not fill whole examples of {group} rows")
        tokens = np.full((len(pairs), seq_len), specials.pad_id, id_dtype(specials.vocab_size))
        b_start, length = np.zeros(len(pairs), INT), np.zeros(len(pairs), INT)
        for row, (a, b) in enumerate(pairs):
            n = len(a) + len(b) + SPECIALS_PER_PAIR
            if n > seq_len:
                raise ValueError(f"pair {row} needs {n} positions but seq_len is {seq_len}: truncate it first")
            tokens[row, :n] = [specials.cls_id, *a, specials.sep_id, *b, specials.sep_id]
            b_start[row], length[row] = len(a) + 2, n
        shape = (len(pairs) // size, *group)
        return cls(tokens.reshape(*shape, seq_len), b_start.reshape(shape), length.reshape(shape))

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[-1]

    @property
    def row_shape(self) -> tuple[int, ...]:
        """Per-example shape of each model input: (*group, S)."""
        return self.tokens.shape[1:]

    def __len__(self) -> int:
        return len(self.tokens)

    def expand(self, index: np.ndarray) -> dict[str, np.ndarray]:
        """The model inputs of examples ``index`` as int32: tokens, token_types (1 on B and its [SEP], 0 on
        [CLS] A [SEP] and padding), padding_mask (1 = real token)."""
        positions = np.arange(self.seq_len)
        b_start, length = self.b_start[index][..., None], self.length[index][..., None]
        return {"tokens": self.tokens[index].astype(INT),
                "token_types": ((positions >= b_start) & (positions < length)).astype(INT),
                "padding_mask": (positions < length).astype(INT)}


@dataclasses.dataclass(frozen=True)
class EncodedTask:
    """A task's examples (or SQuAD's windows) ready for the model: packed inputs and int32 targets, one per row.

    ``targets``: ``labels`` (classification, RACE) or ``start_positions`` / ``end_positions`` (SQuAD), each (N,).
    """

    name: str
    inputs: PackedPairs
    targets: dict[str, np.ndarray]

    def __post_init__(self):
        if not len(self.inputs):
            raise ValueError(f"task {self.name} has no examples")
        for key, value in self.targets.items():
            if value.shape != (len(self.inputs),):
                raise ValueError(f"task {self.name}: target {key} has shape {value.shape}, expected "
                                 f"({len(self.inputs)},)")

    def __len__(self) -> int:
        return len(self.inputs)

    @property
    def fields(self) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """Per-row shape and dtype of every batch field (the loader protocol's ``fields``)."""
        shape = self.inputs.row_shape
        return {"tokens": (shape, INT), "token_types": (shape, INT), "padding_mask": (shape, INT),
                **{key: ((), INT) for key in self.targets}}

    def rows(self, index: np.ndarray) -> dict[str, np.ndarray]:
        """Every field of examples ``index``."""
        return {**self.inputs.expand(index), **{k: v[index].astype(INT) for k, v in self.targets.items()}}

    @functools.cached_property
    def fingerprint(self) -> str:
        """A digest of every stored array: a resumed run must walk the same rows (same files, tokenizer, rules)."""
        digest = hashlib.blake2b(digest_size=16)
        arrays = {"tokens": self.inputs.tokens, "b_start": self.inputs.b_start, "length": self.inputs.length,
                  **{f"target {k}": self.targets[k] for k in sorted(self.targets)}}
        for name, array in arrays.items():
            digest.update(str((name, array.shape, array.dtype.str)).encode())
            digest.update(np.ascontiguousarray(array).tobytes())
        return digest.hexdigest()
