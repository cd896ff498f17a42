"""An encoded task as batches: shuffled for training (the loader protocol), in order for evaluation.

``TrainBatches`` shuffles the rows lazily per epoch with ``grain`` (as the pre-training loaders): global row k of
step s, k = s * global_batch + row, is row k mod N of epoch k // N's permutation, so a batch is a pure function of
(seed, step) and a resumed run sees exactly the batches an uninterrupted one would. ``OrderedBatches`` walks rows
0..N-1 once in fixed-size batches; the last is padded by repeating the last row, marked ``valid = 0``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import grain
import numpy as np

from megajax.data.tasks.encoding import INT, EncodedTask


class TrainBatches:
    """Training batches of ``task`` (the loader protocol: ``global_batch``, ``fields``, ``rows``, ``identity``)."""

    def __init__(self, task: EncodedTask, global_batch: int, seed: int):
        if global_batch < 1 or seed < 0:
            raise ValueError(f"global_batch={global_batch} must be >= 1 and seed={seed} >= 0")
        self.task, self.global_batch, self.seed = task, global_batch, seed
        self.fields = task.fields
        self._order = grain.MapDataset.range(len(task)).shuffle(seed=seed).repeat()

    def __len__(self) -> int:
        """Rows per epoch."""
        return len(self.task)

    def rows(self, step: int, start: int, stop: int) -> dict[str, np.ndarray]:
        """Rows ``start:stop`` of the global batch of ``step``."""
        first = step * self.global_batch
        index = np.asarray([self._order[k] for k in range(first + start, first + stop)], np.int64)
        return self.task.rows(index)

    def batch(self, step: int) -> dict[str, np.ndarray]:
        return self.rows(step, 0, self.global_batch)

    def identity(self) -> dict:
        """Facts a resumed loader must match: the same rows (by digest), seed and batch size."""
        return {"task": self.task.name, "examples": len(self.task), "seq_len": self.task.inputs.seq_len,
                "seed": self.seed, "global_batch": self.global_batch, "fingerprint": self.task.fingerprint}


class OrderedBatches:
    """Every row of ``task`` exactly once, in order, ``batch_size`` at a time; fields add ``valid`` (1 = a real
    row, 0 = padding) and ``index`` (the row's index in ``task``). Also follows the loader protocol, so
    ``Loader(batches).next_global`` can shard it."""

    def __init__(self, task: EncodedTask, batch_size: int):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        self.task, self.global_batch = task, batch_size
        self.num_steps = -(-len(task) // batch_size)
        self.fields = {**task.fields, "valid": ((), INT), "index": ((), INT)}

    def __len__(self) -> int:
        return self.num_steps

    def rows(self, step: int, start: int, stop: int) -> dict[str, np.ndarray]:
        """Rows ``start:stop`` of batch ``step`` (0 <= step < num_steps)."""
        if not 0 <= step < self.num_steps:
            raise IndexError(f"batch {step} of {self.num_steps}")
        k = step * self.global_batch + np.arange(start, stop)
        index = np.minimum(k, len(self.task) - 1)
        return {**self.task.rows(index), "valid": (k < len(self.task)).astype(INT), "index": index.astype(INT)}

    def batch(self, step: int) -> dict[str, np.ndarray]:
        return self.rows(step, 0, self.global_batch)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return (self.batch(step) for step in range(self.num_steps))

    def identity(self) -> dict:
        return {"task": self.task.name, "examples": len(self.task), "batch_size": self.global_batch,
                "fingerprint": self.task.fingerprint}

    def unpad(self, outputs: Sequence[Mapping[str, np.ndarray]]) -> dict[str, np.ndarray]:
        """Per-batch outputs (one mapping per step, in step order, each array with ``batch_size`` leading rows)
        concatenated and cut to the task's rows, in task order."""
        if len(outputs) != self.num_steps:
            raise ValueError(f"{len(outputs)} batch outputs for {self.num_steps} batches")
        out = {}
        for name in outputs[0]:
            parts = [np.asarray(o[name]) for o in outputs]
            if any(len(p) != self.global_batch for p in parts):
                raise ValueError(f"output {name!r}: every batch must have {self.global_batch} rows")
            out[name] = np.concatenate(parts)[:len(self.task)]
        return out
