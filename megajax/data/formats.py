"""How a pretraining model's examples are cut from a tokenized corpus: a model spec names one of these formats
(``megajax.models``), and ``megajax.data.sources`` builds its batches without knowing which model asked.

* ``WINDOWS``: windows of ``seq_len + 1`` tokens over the concatenated documents (next-token prediction); the
  default corpus is the Python standard library's source, byte-level BPE.
* ``SENTENCE_PAIRS``: two segments of consecutive sentences with whole-word masking and a sentence-order label
  (MLM + SOP); needs a corpus preprocessed with ``--split_sentences``. The default corpus is the standard library's
  English prose, sentence-split, WordPiece.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable

from megajax.data.bert_dataset import BERTBatches, documents_in
from megajax.data.bert_vocab import BertVocab
from megajax.data.default_corpus import default_bert_corpus, default_corpus
from megajax.data.gpt_dataset import GPTBatches, Packing
from megajax.data.indexed import IndexedTokens
from megajax.data.loader import Batches
from megajax.data.settings import DataSettings


@dataclasses.dataclass(frozen=True)
class ExampleFormat:
    """A way of cutting training examples from a corpus."""

    name: str
    # vocab_size -> (the offline corpus, its tokenizer file): built on first use and cached
    default_corpus: Callable[[int], tuple[IndexedTokens, pathlib.Path]]
    # (the run's data settings, corpus, token range of the split) -> batches; ValueError when the range cannot
    # make any
    batches: Callable[[DataSettings, IndexedTokens, tuple[int, int]], Batches]
    count: Callable[[Batches], int]  # examples per epoch
    unit: Callable[[int], str]  # max_seq_len -> what one example is, for messages
    needs_sentences: bool  # a corpus without sentence boundaries (data.source=random) cannot make it


def _windows(d: DataSettings, data: IndexedTokens, token_range: tuple[int, int]) -> GPTBatches:
    packing = Packing(data.offsets, d.reset_position_ids, d.eod_mask_loss) if d.document_masking else None
    return GPTBatches(data.tokens, d.max_seq_len, d.global_batch_size, d.seed, token_range, packing)


def _sentence_pairs(d: DataSettings, data: IndexedTokens, token_range: tuple[int, int]) -> BERTBatches:
    return BERTBatches(data, BertVocab.from_dataset(data), d.max_seq_len, d.global_batch_size, d.seed,
                       documents=documents_in(data.offsets, token_range), mask_prob=d.mask_prob,
                       max_ngram=d.max_ngram, short_seq_prob=d.short_seq_prob)


WINDOWS = ExampleFormat("windows", default_corpus, _windows, count=lambda b: b.num_samples,
                        unit=lambda seq: f"samples of {seq + 1} tokens", needs_sentences=False)
SENTENCE_PAIRS = ExampleFormat("sentence pairs", default_bert_corpus, _sentence_pairs, count=len,
                               unit=lambda seq: f"sentence pairs of {seq} tokens", needs_sentences=True)
