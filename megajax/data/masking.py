"""Whole-word n-gram masking for BERT's masked-LM objective (SpanBERT-style n-grams, as Megatron-LM's BERT).

A word is a WordPiece token and the '##' pieces that follow it. [CLS], [SEP], [PAD] and [MASK] are never masked;
'##' pieces cut from their word (by truncation at the front of a segment) are not masked either. The budget is
``round(mask_prob * real tokens)`` (at least 1), real tokens being all but those four.

Span lengths n in 1..max_ngram words are drawn with probability proportional to 1/n, as many spans as spend the
budget on average, and each is placed uniformly among the places where n unmasked consecutive words of one
segment lie (if there are none, n - 1, ...). So the masked spans follow 1/n, and a sample's masked count varies
around its budget with the budget as its mean. Megatron-LM instead stops at exactly the budget, shortening or
skipping the spans that overflow it; that tilts the spans towards unigrams (that rule measured here at 128 tokens:
0.57 / 0.27 / 0.16 instead of 6/11, 3/11, 2/11).
Each masked token independently (per token, as Megatron-LM) becomes [MASK] with probability 0.8, a random
non-special id with 0.1, and stays itself with 0.1.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from megajax.data.bert_vocab import BertVocab

MASK_TOKEN, RANDOM_TOKEN = 0.8, 0.9  # cumulative: [MASK] below 0.8, random id below 0.9, else unchanged


@dataclasses.dataclass
class Masked:
    tokens: np.ndarray  # (L,) input ids after masking
    labels: np.ndarray  # (L,) the original id at masked positions, else 0
    weights: np.ndarray  # (L,) 1 at masked positions, else 0
    spans: list[tuple[int, int, int]]  # (first token, end token, number of words) of each masked n-gram


@dataclasses.dataclass
class Words:
    starts: np.ndarray  # (W,) token position where each word starts
    bounds: np.ndarray  # (W + 1,) cumulative token counts: word w has bounds[w + 1] - bounds[w] tokens
    segments: np.ndarray  # (W,) token type of each word
    real_tokens: int  # tokens that count towards the budget


def find_words(tokens: np.ndarray, token_types: np.ndarray, vocab: BertVocab) -> Words:
    """The maskable whole words of ``tokens`` ([CLS] A [SEP] B [SEP] ...)."""
    structural = np.isin(tokens, (vocab.cls_id, vocab.sep_id, vocab.pad_id, vocab.mask_id))
    word_start = ~structural & ~vocab.is_continuation[tokens]
    position = np.arange(len(tokens))
    anchor = np.maximum.accumulate(np.where(word_start | structural, position, -1))  # last start or special
    in_word = ~structural & (anchor >= 0) & word_start[np.maximum(anchor, 0)]  # not a '##' cut from its word
    starts = np.flatnonzero(word_start)
    lengths = np.bincount(anchor[in_word], minlength=len(tokens))[starts]
    return Words(starts, np.concatenate([[0], np.cumsum(lengths)]), token_types[starts], int((~structural).sum()))


def _places(words: Words, covered_before: np.ndarray, n: int) -> np.ndarray:
    """Words where a span of ``n`` words can start: ``n`` unmasked words of one segment."""
    last = len(words.starts) - n
    if last < 0:
        return np.zeros(0, dtype=np.int64)
    w = np.arange(last + 1)
    free = covered_before[w + n] == covered_before[w]
    return w[free & (words.segments[w] == words.segments[w + n - 1])]


def _span_lengths(words: Words, budget: int, max_ngram: int, rng: np.random.Generator) -> np.ndarray:
    """Lengths (in words) of the spans to mask: iid with P(n) proportional to 1/n, as many as spend ``budget``
    tokens on average (randomised rounding of budget / expected span tokens), at least one."""
    if not len(words.starts):
        return np.zeros(0, dtype=np.int64)  # nothing maskable (only '##' pieces cut from their words)
    lengths = np.arange(1, max_ngram + 1)
    p = (1.0 / lengths) / (1.0 / lengths).sum()
    tokens_per_word = words.bounds[-1] / len(words.starts)
    count = max(1, int(budget / ((lengths * p).sum() * tokens_per_word) + rng.random()))
    return rng.choice(lengths, size=count, p=p)


def mask_whole_word_ngrams(tokens: np.ndarray, token_types: np.ndarray, vocab: BertVocab, rng: np.random.Generator,
                           mask_prob: float = 0.15, max_ngram: int = 3) -> Masked:
    """Masks ``mask_prob`` of the real tokens of one sample (in expectation) in whole-word n-grams (module
    docstring)."""
    tokens = np.asarray(tokens)
    words = find_words(tokens, token_types, vocab)
    budget = max(1, round(mask_prob * words.real_tokens))
    covered_before = np.zeros(len(words.starts) + 1, dtype=np.int64)  # masked words before word w
    spans, lengths = [], _span_lengths(words, budget, max_ngram, rng)
    for n, u in zip(lengths, rng.random(len(lengths))):
        while n and not (places := _places(words, covered_before, n)).size:
            n -= 1  # no room for this length (a short sample or segment): a shorter span
        if not n:
            break  # every word is masked
        w = int(places[int(u * len(places))])
        covered_before[w + 1:] += np.minimum(np.arange(1, len(covered_before) - w), n)
        first = int(words.starts[w])
        spans.append((first, first + int(words.bounds[w + n] - words.bounds[w]), int(n)))
    positions = np.concatenate([np.arange(a, b) for a, b, _ in spans]) if spans else np.zeros(0, dtype=np.int64)
    out, labels, weights = tokens.copy(), np.zeros_like(tokens), np.zeros_like(tokens)
    labels[positions], weights[positions] = tokens[positions], 1
    u = rng.random(len(positions))
    out[positions[u < MASK_TOKEN]] = vocab.mask_id
    swap = positions[(u >= MASK_TOKEN) & (u < RANDOM_TOKEN)]
    out[swap] = rng.choice(vocab.random_ids, size=len(swap))
    return Masked(out, labels, weights, spans)
