"""What BERT's data pipeline needs to know about a WordPiece vocabulary: the special ids and which ids continue a
word. Read from the tokenizer saved with a dataset, so training needs no tokenizer flag of its own."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
from tokenizers import Tokenizer

from megajax.data.indexed import IndexedTokens

CONTINUATION = "##"


@dataclasses.dataclass(frozen=True)
class BertVocab:
    """Special ids, the vocabulary size and per-id flags of a WordPiece vocabulary."""

    cls_id: int
    sep_id: int
    mask_id: int
    pad_id: int
    vocab_size: int
    is_continuation: np.ndarray  # (vocab_size,) bool: the id is a '##' piece that continues the previous word
    is_special: np.ndarray  # (vocab_size,) bool: [CLS]/[SEP]/[PAD]/... and other bracketed names ([unused7])

    def __post_init__(self):
        for name in ("is_continuation", "is_special"):
            if getattr(self, name).shape != (self.vocab_size,):
                raise ValueError(f"BertVocab.{name} has shape {getattr(self, name).shape}, expected "
                                 f"({self.vocab_size},)")

    @functools.cached_property
    def random_ids(self) -> np.ndarray:
        """The ids a masked token may be replaced by: the real vocabulary, no special token."""
        return np.flatnonzero(~self.is_special)

    @classmethod
    def from_tokenizer(cls, tokenizer: Tokenizer, source: str = "the tokenizer") -> "BertVocab":
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        ids = {}
        for name in ("[CLS]", "[SEP]", "[MASK]", "[PAD]"):
            if name not in vocab:
                raise ValueError(f"{source} has no {name} token: BERT needs a WordPiece vocabulary with [PAD], "
                                 "[UNK], [CLS], [SEP] and [MASK] (bert-base-uncased's vocab.txt has them)")
            ids[name] = vocab[name]
        size = tokenizer.get_vocab_size(with_added_tokens=True)
        is_continuation, is_special = np.zeros(size, bool), np.zeros(size, bool)
        for token, i in vocab.items():
            is_continuation[i] = token.startswith(CONTINUATION) and len(token) > len(CONTINUATION)
            is_special[i] = len(token) > 2 and token[0] == "[" and token[-1] == "]"
        for added in tokenizer.get_added_tokens_decoder().values():
            if added.special:
                is_special[vocab[added.content]] = True
        return cls(ids["[CLS]"], ids["[SEP]"], ids["[MASK]"], ids["[PAD]"], size, is_continuation, is_special)

    @classmethod
    def from_dataset(cls, data: IndexedTokens) -> "BertVocab":
        """The vocabulary of the tokenizer that ``preprocess`` saved beside ``data``."""
        path = data.tokenizer_path()
        if path is None:
            raise FileNotFoundError(f"{data.prefix} has no saved tokenizer (PREFIX.tokenizer.json): re-run "
                                    "python -m megajax.data.preprocess --split_sentences with a WordPiece tokenizer")
        return cls.from_tokenizer(Tokenizer.from_file(str(path)), str(path))
