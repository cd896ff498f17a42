"""The training loader: a position (the step) over deterministic batches, delivered as sharded global arrays.

Any batches object works that has ``global_batch``, ``fields``, ``rows(step, start, stop) -> {field: array}`` and
``identity() -> dict``: GPT's windows and BERT's sentence pairs alike. A batch is a pure function of the step, so
the loader's whole state is its step (plus the identity of the data it walks, checked on resume).
"""

from __future__ import annotations

from typing import Protocol

import jax
import numpy as np

from megajax.errors import UserError


class Batches(Protocol):
    global_batch: int
    fields: dict[str, tuple[tuple[int, ...], np.dtype]]  # per-row shape and dtype of each field

    def rows(self, step: int, start: int, stop: int) -> dict[str, np.ndarray]: ...

    def identity(self) -> dict: ...


class LoaderStateError(UserError, ValueError):
    """A saved loader position that does not belong to this dataset, seed or batch size."""


class Loader:
    """The position in ``batches``; its state is ``{'step', 'global_batch', **batches.identity()}``."""

    def __init__(self, batches: Batches, step: int = 0):
        self.batches, self.step = batches, step

    def next_global(self, shardings: dict[str, jax.sharding.Sharding]) -> dict[str, jax.Array]:
        """The next batch as global arrays; each process computes only the rows its devices hold, once per row
        range whatever the number of fields."""
        step, n = self.step, self.batches.global_batch
        self.step += 1
        cache: dict[tuple[int, int], dict[str, np.ndarray]] = {}

        def rows(field: str, idx: tuple) -> np.ndarray:
            key = (idx[0].start or 0, idx[0].stop or n)
            if key not in cache:
                cache[key] = self.batches.rows(step, *key)
            return cache[key][field][(slice(None),) + tuple(idx[1:])]

        return {name: jax.make_array_from_callback(self._shape(name), sharding,
                                                   lambda idx, name=name: rows(name, idx))
                for name, sharding in shardings.items()}

    def _shape(self, name: str) -> tuple[int, ...]:
        return (self.batches.global_batch, *self.batches.fields[name][0])

    def get_state(self) -> dict:
        return {"step": self.step, "global_batch": self.batches.global_batch, **self.batches.identity()}

    def set_state(self, state: dict, allow_batch_size_change: bool = False, allow_blend_change: bool = False) -> None:
        """Moves to a saved position after checking it belongs to this data (states without ``global_batch``, from
        older checkpoints, skip that check)."""
        mine = {k: v for k, v in self.batches.identity().items() if k not in ("global_batch", "blend_weights")}
        weights = self.batches.identity().get("blend_weights")
        if state.get("blend_weights") != weights and not allow_blend_change:
            raise LoaderStateError(
                f"the checkpoint was trained with data.blend weights {state.get('blend_weights')} but this run has "
                f"{weights}: which sample each step reads depends on them. Restore the weights, or pass "
                "--config.data.allow_blend_change=True to go on with the new mixture (the datasets' positions are "
                "then recomputed from it, so some samples repeat or are skipped)")
        if any(state.get(k) != v for k, v in mine.items()):
            raise LoaderStateError(
                f"the checkpoint's data position {state} is from another dataset or seed (this one: {mine}); "
                "train on the data the checkpoint was made with, or start a new workdir")
        saved = state.get("global_batch", self.batches.global_batch)
        if saved != self.batches.global_batch and not allow_batch_size_change:
            raise LoaderStateError(
                f"the checkpoint was trained with train.global_batch_size={saved} but this run uses "
                f"{self.batches.global_batch}: the data position depends on it. Pass "
                f"--config.train.global_batch_size={saved}, or --config.train.allow_batch_size_change=True to "
                "continue anyway (later batches then overlap or skip samples of the earlier ones)")
        self.step = int(state["step"])
