"""An encoded task as training batches (the loader protocol); evaluation maps every row in order with
``megajax.evaluation.evaluator.Evaluator.map_rows``.

``TrainBatches`` shuffles the rows lazily per epoch with ``grain`` (as the pre-training loaders): global row k of
step s, k = s * global_batch + row, is row k mod N of epoch k // N's permutation, so a batch is a pure function of
(seed, step) and a resumed run sees exactly the batches an uninterrupted one would.
"""

from __future__ import annotations

import grain
import numpy as np

from megajax.data.tasks.encoding import EncodedTask


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

