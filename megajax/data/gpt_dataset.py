"""GPT training samples from an indexed token file: random access through ``grain``, position = step.

Samples are windows of ``seq_len + 1`` tokens over the concatenated documents, starting every ``seq_len`` tokens, so
consecutive windows share one token (the last target of one is the first input of the next); documents end with
the end-of-document id and windows cross their boundaries, as in Megatron. ``grain.MapDataset``'s shuffle
permutes indices lazily (no per-epoch permutation array, whatever the corpus size) and ``repeat`` reshuffles each
epoch. A batch is a pure function of the step, so a resumed run sees exactly the batches an uninterrupted one
would, and each data shard or host reads only its own rows.
"""

from __future__ import annotations

import dataclasses

import grain
import numpy as np

from megajax.data.documents import PACKED_FIELDS, packed_row, window_documents


@dataclasses.dataclass(frozen=True)
class Packing:
    """How windows are packed (``data.document_masking`` and its two options, ``megajax.data.documents``): the
    document boundaries are the corpus's ``offsets``."""

    offsets: np.ndarray
    reset_positions: bool = True
    eod_mask_loss: bool = False


class WindowSource:
    """Random-access windows of ``seq_len + 1`` tokens from ``tokens[start:stop]``: ``{'tokens'}``, with the packed
    fields where ``packing`` is given."""

    def __init__(self, tokens: np.ndarray, start: int, stop: int, seq_len: int, packing: Packing | None = None):
        self.tokens, self.start, self.seq_len, self.packing = tokens, start, seq_len, packing
        self.num_windows = max((stop - start - 1) // seq_len, 0)

    def __len__(self) -> int:
        return self.num_windows

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        s = self.start + i * self.seq_len
        window = {"tokens": np.asarray(self.tokens[s:s + self.seq_len + 1], dtype=np.int32)}
        if self.packing is not None:
            docs = window_documents(self.packing.offsets, s, self.seq_len + 1)
            window.update(packed_row(docs, self.packing.reset_positions, self.packing.eod_mask_loss))
        return window


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
    """Deterministic global batches ``{'tokens': (global_batch, seq_len + 1)}``, and with ``packing`` the packed
    fields (``segments``, ``positions``, ``loss_weights``: (global_batch, seq_len) each)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, global_batch: int, seed: int,
                 token_range: tuple[int, int] | None = None, packing: Packing | None = None):
        start, stop = token_range or (0, len(tokens))
        self.source = WindowSource(tokens, start, stop, seq_len, packing)
        self.seq_len, self.global_batch, self.seed = seq_len, global_batch, seed
        self.num_samples = len(self.source)
        self.fields = {"tokens": ((seq_len + 1,), np.dtype(np.int32))}
        if packing is not None:
            self.fields.update({k: ((seq_len,), np.dtype(np.float32 if k == "loss_weights" else np.int32))
                                for k in PACKED_FIELDS})
        self._samples = grain.MapDataset.source(self.source).shuffle(seed=seed).repeat() if len(self.source) else None

    def rows(self, step: int, start: int, stop: int) -> dict[str, np.ndarray]:
        """Rows ``start:stop`` of the global batch of ``step``: tokens (stop - start, seq_len + 1) int32."""
        first = step * self.global_batch
        return self.samples(np.arange(first + start, first + stop))

    def samples(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        """Samples ``indices`` of the endless shuffled stream (index k: epoch k // num_samples)."""
        windows = [self._samples[int(k)] for k in indices]
        return {name: np.stack([w[name] for w in windows]).reshape(len(indices), *shape)
                for name, (shape, _) in self.fields.items()}

    def batch(self, step: int) -> dict[str, np.ndarray]:
        return self.rows(step, 0, self.global_batch)

    def identity(self) -> dict:
        """What a resumed loader must match (the keys of loader states saved since the first release)."""
        return {"seed": self.seed, "num_windows": self.num_samples}


def unigram_entropy(tokens: np.ndarray) -> float:
    """Entropy in nats of the token frequency distribution: the loss a model that ignores context can reach."""
    counts = np.bincount(np.asarray(tokens, dtype=np.int64))
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
