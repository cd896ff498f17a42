"""GPT training samples from one long token array, as a pure function of (step, row range).

Samples are non-overlapping windows of ``seq_len + 1`` tokens (documents are concatenated with an end-of-document
token, so windows cross document boundaries, as in Megatron). Each epoch visits the windows in a fresh seeded
permutation. Because a batch is a function of the step alone, resuming at step N yields exactly the batches an
uninterrupted run would have seen, and each data shard (or host) reads only its own rows.
"""

from __future__ import annotations

import functools

import numpy as np


class GPTBatches:
    """Deterministic batches of shape (global_batch, seq_len + 1) from ``tokens``."""

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, seed: int, *, split: str = "train",
                 valid_fraction: float = 1 / 30):
        n = (len(tokens) - 1) // seq_len
        n_valid = max(1, int(round(n * valid_fraction))) if valid_fraction > 0 else 0
        if n - n_valid < 1:
            raise ValueError(f"{len(tokens)} tokens make too few windows of {seq_len + 1} for a train split; "
                             "use more data or a shorter model.max_seq_len")
        first, count = (0, n - n_valid) if split == "train" else (n - n_valid, n_valid)
        if count < 1:
            raise ValueError(f"split {split!r} is empty")
        self.tokens, self.seq_len, self.global_batch, self.seed = tokens, seq_len, global_batch, seed
        self.first, self.num_windows = first, count

    @functools.lru_cache(maxsize=2)
    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)

    def rows(self, step: int, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` of the global batch of ``step``: (stop - start, seq_len + 1) int32."""
        out = np.empty((stop - start, self.seq_len + 1), np.int32)
        for r, k in enumerate(range(step * self.global_batch + start, step * self.global_batch + stop)):
            epoch, i = divmod(k, self.num_windows)
            w = self.first + int(self._order(epoch)[i])
            out[r] = self.tokens[w * self.seq_len: w * self.seq_len + self.seq_len + 1]
        return out

    def batch(self, step: int) -> np.ndarray:
        return self.rows(step, 0, self.global_batch)


def unigram_entropy(tokens: np.ndarray) -> float:
    """Entropy in nats of the token frequency distribution: the loss a model that ignores context can reach."""
    counts = np.bincount(np.asarray(tokens, dtype=np.int64))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
