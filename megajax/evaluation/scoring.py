"""Scoring token streams with a sharded model: sliding-window log-likelihood and teacher-forced cloze accuracy."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from megajax.evaluation.evaluator import Evaluator
from megajax.parallel.losses import vocab_parallel_cross_entropy
from megajax.parallel.sharding import Rules


def check_stride(stride: int, seq_len: int) -> None:
    """Raises unless 1 <= stride <= seq_len (stride == seq_len: non-overlapping windows)."""
    if not 1 <= stride <= seq_len:
        raise ValueError(f"--stride={stride}: the sliding-window stride must be in 1..{seq_len} (the model's "
                         f"max_seq_len; {seq_len} gives non-overlapping windows, the paper used 32)")


def sliding_windows(num_tokens: int, seq_len: int, stride: int) -> list[tuple[int, int, int]]:
    """Megatron-LM's overlapping-evaluation windows ``(start, first_target, end)`` over ``num_tokens`` tokens.

    Window i starts at token ``i * stride``, feeds tokens[start:end] and predicts tokens[start+1:end+1], with
    ``end = min(start + seq_len, num_tokens - 1)`` (the last windows are shorter). Window 0 scores all its targets
    (1..end); window i > 0 scores only its last ``stride`` target positions, targets
    ``start + seq_len - stride + 1 .. end``. So every target 1..num_tokens-1 is scored exactly once, with context
    from its window's start: at least ``seq_len - stride`` tokens after the first window. Windows that would score
    nothing (past the end) are left out. Fewer than 2 tokens: no windows.
    """
    check_stride(stride, seq_len)
    last = num_tokens - 1
    if last < 1:
        return []
    windows = [(0, 1, min(seq_len, last))]
    start = stride
    while start + seq_len - stride + 1 <= last:
        windows.append((start, start + seq_len - stride + 1, min(start + seq_len, last)))
        start += stride
    return windows


@dataclasses.dataclass
class Scorer:
    """Runs a model on fixed-shape batches (B, seq_len) on its mesh; returns per-token NLL and argmax hits."""

    model: nnx.Module
    mesh: jax.sharding.Mesh
    rules: Rules
    batch_size: int
    seq_len: int

    def __post_init__(self):
        self._evaluator, self._state = Evaluator.of(self.model, _score, self.mesh, self.rules)
        m = self._evaluator.batch_multiple
        self.batch_size = -(-self.batch_size // m) * m

    def __call__(self, inputs: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(nll, hit), each (N, seq_len), for N rows of inputs/labels."""
        rows = {"inputs": np.asarray(inputs, np.int32), "labels": np.asarray(labels, np.int32)}
        return self._evaluator.map_rows(self._state, rows, self.batch_size)


def _score(model: nnx.Module, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    logits = model(batch["inputs"])  # (B, S, V)
    return vocab_parallel_cross_entropy(logits, batch["labels"]), jnp.argmax(logits, axis=-1) == batch["labels"]


def window_rows(tokens: np.ndarray, windows: Sequence[tuple[int, int, int]], seq_len: int):
    """(inputs, labels, mask) arrays (W, seq_len) for the windows; mask marks the targets each window scores."""
    w = len(windows)
    inputs, labels, mask = (np.zeros((w, seq_len), np.int32) for _ in range(3))
    for r, (start, first, end) in enumerate(windows):
        n = end - start
        inputs[r, :n] = tokens[start:end]
        labels[r, :n] = tokens[start + 1:end + 1]
        targets = np.arange(start + 1, start + 1 + seq_len)
        mask[r] = (targets >= first) & (targets <= end)
    return inputs, labels, mask.astype(bool)


def stream_log_likelihood(scorer: Scorer, tokens: np.ndarray, stride: int,
                          progress: Callable | None = None) -> tuple[float, int]:
    """(sum of -log p over every target token, number of targets) with the windows of ``sliding_windows``;
    (0.0, 0) for fewer than 2 tokens."""
    return streams_log_likelihood(scorer, [tokens], stride, progress)[0]


def streams_log_likelihood(scorer: Scorer, streams: Sequence[np.ndarray], stride: int,
                           progress: Callable | None = None) -> list[tuple[float, int]]:
    """``stream_log_likelihood`` of each stream, the windows of all streams scored together, so that many short
    documents (lm-eval's rolling log-likelihood) fill whole batches. ``progress`` receives window counts."""
    rows = [window_rows(np.asarray(t), sliding_windows(len(t), scorer.seq_len, stride), scorer.seq_len)
            for t in streams]
    if not rows:
        return []
    owner = np.concatenate([np.full(len(r[0]), i) for i, r in enumerate(rows)]).astype(np.int64)
    inputs, labels, mask = (np.concatenate(x) for x in zip(*rows))
    totals, counts = np.zeros(len(rows)), np.zeros(len(rows), np.int64)
    chunk = scorer.batch_size * 16
    for i in range(0, len(inputs), chunk):
        nll, _ = scorer(inputs[i:i + chunk], labels[i:i + chunk])
        m = mask[i:i + chunk]
        np.add.at(totals, owner[i:i + chunk], np.where(m, nll.astype(np.float64), 0.0).sum(axis=1))
        np.add.at(counts, owner[i:i + chunk], m.sum(axis=1))
        if progress:
            progress(min(chunk, len(inputs) - i))
    return [(float(t), int(c)) for t, c in zip(totals, counts)]


def cloze_rows(context: Sequence[int], target: Sequence[int], seq_len: int):
    """One teacher-forced row: inputs = (context + target)[:-1], the target's positions marked; the context is
    cut from the left when the example is longer than seq_len + 1 tokens."""
    if not context or not target or len(target) > seq_len:
        raise ValueError(f"a cloze example needs a context and 1..{seq_len} target tokens, got {len(context)} "
                         f"and {len(target)}")
    ids = (list(context) + list(target))[-(seq_len + 1):]
    n = len(ids) - 1
    inputs, labels, mask = np.zeros(seq_len, np.int32), np.zeros(seq_len, np.int32), np.zeros(seq_len, bool)
    inputs[:n], labels[:n] = ids[:-1], ids[1:]
    mask[n - len(target):n] = True
    return inputs, labels, mask
