"""BERT training samples (masked LM + sentence-order prediction) from a sentence-split indexed dataset.

As Megatron-LM's BERT dataset: a sample map is built once from the seed by filling a target length (``seq_len - 3``,
or with probability ``short_seq_prob`` a random length in [2, seq_len - 3]) with consecutive sentences of one
document, closing a chunk only where at least two sentences are in it and at least two are left (documents with
fewer than two sentences make no sample). A sample never crosses a document. Each sample then splits its chunk
into A and B at a random sentence boundary, swaps them with probability 0.5 (SOP label 1 = swapped), trims the
longer side one token at a time from its front or back (each with probability 0.5) until it fits the target, and
becomes ``[CLS] A [SEP] B [SEP]`` padded to ``seq_len``, with whole-word n-gram masking (``masking.py``).

The map is shuffled lazily per epoch by ``grain`` (as the GPT loader), and each sample draws its randomness from
a generator seeded by (seed, epoch, map index): a batch is a pure function of (seed, step).
"""

from __future__ import annotations

import grain
import numpy as np

from megajax.data.bert_vocab import BertVocab
from megajax.data.indexed import IndexedTokens
from megajax.data.masking import mask_whole_word_ngrams

SPECIALS_PER_SAMPLE = 3  # [CLS], [SEP], [SEP]
MAP_STREAM, SAMPLE_STREAM = 0, 1  # first word of the RNG keys: the map's and the samples' streams never meet
INT = np.dtype(np.int32)


def documents_in(offsets: np.ndarray, token_range: tuple[int, int]) -> tuple[int, int]:
    """The documents ``[first, end)`` that start inside ``token_range`` (e.g. a train/valid split's token range)."""
    return int(np.searchsorted(offsets[:-1], token_range[0])), int(np.searchsorted(offsets[:-1], token_range[1]))


def build_sample_map(sentences: np.ndarray, doc_sentences: np.ndarray, documents: tuple[int, int], max_tokens: int,
                     short_seq_prob: float, seed: int) -> np.ndarray:
    """(M, 4) int64 rows ``(document, first sentence, end sentence, target length)``: the chunks of the documents
    in ``documents`` (module docstring). Sentence indices are global rows of ``sentences``."""
    rng = np.random.default_rng([MAP_STREAM, seed, 0, 0])
    first_doc, end_doc = documents
    lo, hi = int(doc_sentences[first_doc]), int(doc_sentences[end_doc])
    sizes = (sentences[lo:hi, 1] - sentences[lo:hi, 0]).tolist()
    short = (rng.random(hi - lo + 1) < short_seq_prob).tolist()
    short_lengths = rng.integers(2, max_tokens + 1, hi - lo + 1).tolist()
    draws = iter(zip(short, short_lengths))  # one target per chunk; at most one chunk per sentence

    def target() -> int:
        is_short, length = next(draws)
        return length if is_short else max_tokens

    rows = []
    bounds = doc_sentences[first_doc:end_doc + 1].tolist()
    for doc, (begin, end) in enumerate(zip(bounds[:-1], bounds[1:]), start=first_doc):
        if end - begin < 2:
            continue  # one sentence cannot make an A/B pair
        start, length, goal = begin, 0, target()
        for s in range(begin, end):
            length += sizes[s - lo]
            left = end - s - 1
            if (length >= goal and left > 1 and s - start >= 1) or left == 0:
                rows.append((doc, start, s + 1, goal))
                start, length, goal = s + 1, 0, target()
    return np.asarray(rows, dtype=np.int64).reshape(-1, 4)


def longer_first_lengths(len_a: int, len_b: int, budget: int) -> tuple[int, int]:
    """How many tokens of A and B survive BERT's pair truncation: the longer (B on ties) loses one token at a time
    until ``len_a + len_b <= budget``."""
    keep_a, keep_b = len_a, len_b
    while keep_a + keep_b > budget:
        if keep_a > keep_b:
            keep_a -= 1
        else:
            keep_b -= 1
    return keep_a, keep_b


def _truncate(a: np.ndarray, b: np.ndarray, target: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Trims A and B to ``longer_first_lengths``; each cut token comes from the front or the back with probability
    0.5."""
    keep_a, keep_b = longer_first_lengths(len(a), len(b), target)
    front_a = rng.binomial(len(a) - keep_a, 0.5)  # each of the cuts independently at the front
    front_b = rng.binomial(len(b) - keep_b, 0.5)
    return a[front_a:front_a + keep_a], b[front_b:front_b + keep_b]


class BERTBatches:
    """Deterministic global batches of BERT samples: fields of shape (global_batch, *per-row shape), int32.

    ``tokens``, ``token_types`` (0 for [CLS] A [SEP] and padding, 1 for B [SEP]), ``padding_mask`` (1 = real
    token), ``mlm_labels`` (original id where masked, else 0), ``mlm_weights`` (1 where masked), all (seq_len,);
    ``sop_labels`` () (1 = A and B swapped). Global sample k of step s is ``s * global_batch + row``.
    """

    def __init__(self, data: IndexedTokens, vocab: BertVocab, seq_len: int, global_batch: int, seed: int, *,
                 documents: tuple[int, int] | None = None, mask_prob: float = 0.15, max_ngram: int = 3,
                 short_seq_prob: float = 0.1):
        if data.sentences is None:
            raise ValueError(f"{data.prefix} has no sentence boundaries: BERT needs a corpus preprocessed with "
                             "python -m megajax.data.preprocess --split_sentences")
        if data.meta.get("vocab_size", vocab.vocab_size) != vocab.vocab_size:  # unrecorded: nothing to compare
            raise ValueError(f"the dataset's tokenizer has {data.meta['vocab_size']} ids but the BERT vocabulary "
                             f"{vocab.vocab_size}: use the tokenizer saved with the dataset")
        if seq_len < SPECIALS_PER_SAMPLE + 2:
            raise ValueError(f"seq_len={seq_len}: a BERT sample needs at least 5 positions ([CLS] A [SEP] B [SEP])")
        if not (0 < mask_prob < 1 and max_ngram >= 1 and 0 <= short_seq_prob <= 1 and seed >= 0):
            raise ValueError(f"mask_prob={mask_prob} (in (0, 1)), max_ngram={max_ngram} (>= 1), short_seq_prob="
                             f"{short_seq_prob} (in [0, 1]) or seed={seed} (>= 0) is out of range")
        n_docs = len(data.offsets) - 1
        documents = documents or (0, n_docs)
        if not 0 <= documents[0] <= documents[1] <= n_docs:
            raise ValueError(f"document range {documents} is not inside the dataset's {n_docs} documents")
        self.data, self.vocab, self.seq_len, self.global_batch, self.seed = data, vocab, seq_len, global_batch, seed
        self.documents, self.mask_prob, self.max_ngram = documents, mask_prob, max_ngram
        self.short_seq_prob = short_seq_prob
        self.sample_map = build_sample_map(data.sentences, data.doc_sentences, documents,
                                           seq_len - SPECIALS_PER_SAMPLE, short_seq_prob, seed)
        if not len(self.sample_map):
            raise ValueError(f"documents {documents} of {data.prefix} hold no document with two sentences: BERT "
                             "samples need sentence pairs; use more data or another split")
        self._order = grain.MapDataset.range(len(self.sample_map)).shuffle(seed=seed).repeat()
        self.fields = {name: ((seq_len,), INT) for name in
                       ("tokens", "token_types", "padding_mask", "mlm_labels", "mlm_weights")}
        self.fields["sop_labels"] = ((), INT)

    def __len__(self) -> int:
        """Samples per epoch."""
        return len(self.sample_map)

    def sample(self, epoch: int, index: int) -> dict[str, np.ndarray]:
        """Sample ``index`` of the map as drawn in ``epoch``."""
        rng = np.random.default_rng([SAMPLE_STREAM, self.seed, epoch, index])
        _, first, end, target = self.sample_map[index]
        spans = self.data.sentences[first:end]
        split = int(spans[rng.integers(1, end - first), 0])  # the map's chunks have two sentences or more
        a = np.asarray(self.data.tokens[spans[0, 0]:split], dtype=np.int32)
        b = np.asarray(self.data.tokens[split:spans[-1, 1]], dtype=np.int32)
        swapped = rng.random() < 0.5
        if swapped:
            a, b = b, a
        a, b = _truncate(a, b, int(target), rng)
        v = self.vocab
        tokens = np.concatenate([[v.cls_id], a, [v.sep_id], b, [v.sep_id]]).astype(np.int32)
        types = np.zeros(len(tokens), np.int32)
        types[len(a) + 2:] = 1
        masked = mask_whole_word_ngrams(tokens, types, v, rng, self.mask_prob, self.max_ngram)
        pad = self.seq_len - len(tokens)
        return {"tokens": np.pad(masked.tokens, (0, pad), constant_values=v.pad_id),
                "token_types": np.pad(types, (0, pad)),
                "padding_mask": np.pad(np.ones(len(tokens), np.int32), (0, pad)),
                "mlm_labels": np.pad(masked.labels, (0, pad)),
                "mlm_weights": np.pad(masked.weights, (0, pad)),
                "sop_labels": np.int32(swapped)}

    def rows(self, step: int, start: int, stop: int) -> dict[str, np.ndarray]:
        """Rows ``start:stop`` of the global batch of ``step``."""
        first = step * self.global_batch
        return self.samples(np.arange(first + start, first + stop))

    def samples(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Samples ``indices`` of the endless stream (index k: epoch k // samples per epoch, reshuffled)."""
        n = len(self.sample_map)
        samples = [self.sample(int(k) // n, self._order[int(k)]) for k in indices]
        return {name: np.stack([s[name] for s in samples]).astype(dtype).reshape(len(indices), *shape)
                for name, (shape, dtype) in self.fields.items()}

    def batch(self, step: int) -> dict[str, np.ndarray]:
        return self.rows(step, 0, self.global_batch)

    def identity(self) -> dict:
        """Facts a resumed loader must match: the same seed, map and sample rules give the same batches."""
        return {"seed": self.seed, "samples": len(self.sample_map), "seq_len": self.seq_len,
                "global_batch": self.global_batch, "documents": list(self.documents),
                "tokens": int(self.data.meta["tokens"]), "mask_prob": self.mask_prob, "max_ngram": self.max_ngram,
                "short_seq_prob": self.short_seq_prob}
