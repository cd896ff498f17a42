"""GPT training samples from an indexed token file: random access through ``grain``, position = step.

Samples are non-overlapping windows of ``seq_len + 1`` tokens over the concatenated documents (each ends with
the end-of-document id, so windows cross document boundaries, as in Megatron). ``grain.MapDataset``'s shuffle
permutes indices lazily (no per-epoch permutation array, whatever the corpus size) and ``repeat`` reshuffles each
epoch. A batch is a pure function of the step, so a resumed run sees exactly the batches an uninterrupted one
would, and each data shard or host reads only its own rows.
"""

from __future__ import annotations

import grain
import jax
import numpy as np


class WindowSource:
    """Random-access windows of ``seq_len + 1`` tokens from ``tokens[start:stop]``."""

    def __init__(self, tokens: np.ndarray, start: int, stop: int, seq_len: int):
        self.tokens, self.start, self.seq_len = tokens, start, seq_len
        self.num_windows = (stop - start - 1) // seq_len
        if self.num_windows < 1:
            raise ValueError(f"{stop - start} tokens make no window of {seq_len + 1}: use more data or a shorter "
                             "model.max_seq_len")

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, i: int) -> np.ndarray:
        s = self.start + i * self.seq_len
        return np.asarray(self.tokens[s:s + self.seq_len + 1], dtype=np.int32)


def split_by_documents(offsets: np.ndarray, valid_fraction: float) -> tuple[tuple[int, int], tuple[int, int]]:
    """Train and validation token ranges, cut at the document boundary nearest ``(1 - valid_fraction)`` of the
    tokens (29:1 by default, as in the paper)."""
    total = int(offsets[-1])
    if valid_fraction <= 0:
        return (0, total), (total, total)
    target = (1 - valid_fraction) * total
    cut = int(offsets[np.argmin(np.abs(offsets[1:-1] - target)) + 1]) if len(offsets) > 2 else int(target)
    return (0, cut), (cut, total)


class GPTBatches:
    """Deterministic global batches of shape (global_batch, seq_len + 1)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, seed: int,
                 token_range: tuple[int, int] | None = None):
        start, stop = token_range or (0, len(tokens))
        self.source = WindowSource(tokens, start, stop, seq_len)
        self.seq_len, self.global_batch, self.seed = seq_len, global_batch, seed
        self._samples = grain.MapDataset.source(self.source).shuffle(seed=seed).repeat()

    def rows(self, step: int, start: int, stop: int) -> np.ndarray:
        """Rows ``start:stop`` of the global batch of ``step``: (stop - start, seq_len + 1) int32."""
        first = step * self.global_batch
        return np.stack([self._samples[k] for k in range(first + start, first + stop)])

    def batch(self, step: int) -> np.ndarray:
        return self.rows(step, 0, self.global_batch)


class GPTLoader:
    """An iterator over ``GPTBatches`` whose whole state is its step (saved in training checkpoints)."""

    def __init__(self, batches: GPTBatches, step: int = 0):
        self.batches, self.step = batches, step

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        out = self.batches.batch(self.step)
        self.step += 1
        return out

    def next_global(self, sharding: jax.sharding.Sharding) -> jax.Array:
        """The next batch as one global array; each process computes only the rows its devices hold."""
        step, shape = self.step, (self.batches.global_batch, self.batches.seq_len + 1)
        self.step += 1
        return jax.make_array_from_callback(
            shape, sharding, lambda idx: self.batches.rows(step, idx[0].start or 0, idx[0].stop or shape[0]))

    def get_state(self) -> dict:
        return {"step": self.step, "seed": self.batches.seed, "num_windows": len(self.batches.source)}

    def set_state(self, state: dict) -> None:
        if (state["seed"], state["num_windows"]) != (self.batches.seed, len(self.batches.source)):
            raise ValueError(f"loader state {state} is from another dataset or seed (this one: seed "
                             f"{self.batches.seed}, {len(self.batches.source)} windows)")
        self.step = int(state["step"])


def unigram_entropy(tokens: np.ndarray) -> float:
    """Entropy in nats of the token frequency distribution: the loss a model that ignores context can reach."""
    counts = np.bincount(np.asarray(tokens, dtype=np.int64))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
