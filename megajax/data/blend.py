"""Weighted blending of several preprocessed datasets, as Megatron's ``--data-path 0.3 A 0.7 B``.

``data.blend = "0.3 data/a 0.7 data/b"``: weights (normalised to sum 1) and prefixes written by
``python -m megajax.data.preprocess``. Each run of ``PERIOD`` consecutive samples holds ``round(w_d * PERIOD)`` of
dataset d (largest remainders, so the counts add up), interleaved as evenly as their weights allow: dataset d's
j-th slot sits at virtual time (j + 1/2) / count_d, and the slots are taken in time order (ties to the earlier
dataset). Sample k of the run (k = step x global batch + row) is slot k mod PERIOD of period k // PERIOD, which
gives its dataset d and that dataset's own sample index: every PERIOD samples the mixture is exact, in between it
is within a sample or two of it, and a batch stays a pure function of the step (resume is exact, each process
reads only its rows). A dataset drawn past its end starts a new, reshuffled epoch of itself, as an unblended
dataset does.
"""

from __future__ import annotations

import dataclasses
import math
import shlex

import numpy as np

from megajax.errors import ConfigError

PERIOD = 10_000  # slots per period: weights are kept to 1/PERIOD (0.01 %)


@dataclasses.dataclass(frozen=True)
class BlendSpec:
    """The parsed ``data.blend``: normalised weights and their dataset prefixes, in the order given."""

    weights: tuple[float, ...]
    paths: tuple[str, ...]


def parse_blend(text: str) -> BlendSpec:
    """``"W1 PREFIX1 W2 PREFIX2 ..."`` -> BlendSpec (a prefix with spaces in quotes, as in a shell); raises
    ConfigError saying what is wrong."""
    quoting = "; a prefix with spaces goes in quotes, e.g. '0.3 \"my data/wiki\" 0.7 data/books'" \
        if any(c.isspace() for c in text.strip()) else ""
    try:
        items = shlex.split(text)
    except ValueError as e:  # an unclosed quote
        raise ConfigError(f"data.blend={text!r}: {e}{quoting}") from None
    if len(items) < 2 or len(items) % 2:
        raise ConfigError(f"data.blend={text!r}: give weight / prefix pairs, e.g. '0.3 data/wiki 0.7 data/books'"
                          f"{quoting}")
    weights, paths = [], []
    for w, path in zip(items[::2], items[1::2]):
        try:
            weight = float(w)
        except ValueError:
            raise ConfigError(f"data.blend={text!r}: {w!r} is not a weight (pairs are: weight prefix){quoting}") \
                from None
        if not (math.isfinite(weight) and weight > 0):
            raise ConfigError(f"data.blend={text!r}: weight {w} of {path} must be a positive number")
        weights.append(weight)
        paths.append(path)
    if len(set(paths)) != len(paths):
        raise ConfigError(f"data.blend={text!r} names a dataset twice; give each once with its total weight")
    total = sum(weights)
    spec = BlendSpec(tuple(w / total for w in weights), tuple(paths))
    small = [p for w, p in zip(spec.weights, spec.paths) if w * PERIOD < 0.5]
    if small:
        raise ConfigError(f"data.blend={text!r}: {small[0]} has a weight below 1/{PERIOD} of the total: it would "
                          "never be drawn; raise it or leave the dataset out")
    return spec


def slot_counts(weights: tuple[float, ...], period: int = PERIOD) -> np.ndarray:
    """Slots per period for each weight: floor(w * period), the remaining ones to the largest remainders."""
    exact = np.asarray(weights, np.float64) * period
    counts = np.floor(exact).astype(np.int64)
    order = np.argsort(-(exact - counts), kind="stable")
    counts[order[:period - counts.sum()]] += 1
    return counts


def interleave(counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(dataset of each slot, that dataset's index within the period) for slots ordered by virtual time."""
    datasets = np.repeat(np.arange(len(counts)), counts)
    index = np.concatenate([np.arange(c) for c in counts])
    time = (2 * index + 1) / (2 * counts[datasets])  # exact ties for equal rationals: division rounds correctly
    order = np.lexsort((datasets, time))
    return datasets[order], index[order]


class BlendedBatches:
    """The loader protocol over several datasets' batches (each with ``samples(indices)``), mixed by weight."""

    def __init__(self, parts: list, weights: tuple[float, ...], global_batch: int, names: tuple[str, ...]):
        if len(parts) != len(weights) or not parts:
            raise ValueError(f"{len(parts)} datasets for {len(weights)} weights")
        fields = parts[0].fields
        for name, part in zip(names, parts):
            if part.fields != fields:
                raise ValueError(f"dataset {name} gives rows {part.fields}, the first gives {fields}")
        self.parts, self.weights, self.names, self.global_batch = parts, tuple(weights), tuple(names), global_batch
        self.fields = fields
        self.counts = slot_counts(self.weights)
        self._dataset, self._index = interleave(self.counts)

    def locate(self, k: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(dataset, that dataset's sample index) of global samples ``k``."""
        period, slot = np.divmod(np.asarray(k, np.int64), PERIOD)
        dataset = self._dataset[slot]
        return dataset, period * self.counts[dataset] + self._index[slot]

    def rows(self, step: int, start: int, stop: int) -> dict[str, np.ndarray]:
        """Rows ``start:stop`` of the global batch of ``step``, each from its dataset."""
        first = step * self.global_batch
        dataset, index = self.locate(np.arange(first + start, first + stop))
        out = {name: np.zeros((stop - start, *shape), dtype) for name, (shape, dtype) in self.fields.items()}
        for d in np.unique(dataset):
            rows = np.flatnonzero(dataset == d)
            for name, values in self.parts[d].samples(index[rows]).items():
                out[name][rows] = values
        return out

    def batch(self, step: int) -> dict[str, np.ndarray]:
        return self.rows(step, 0, self.global_batch)

    def drawn(self, steps: int) -> list[int]:
        """Samples drawn from each dataset by the first ``steps`` steps."""
        period, slot = divmod(steps * self.global_batch, PERIOD)
        return (period * self.counts + np.bincount(self._dataset[:slot], minlength=len(self.parts))).tolist()

    def identity(self) -> dict:
        """What a resumed loader must match: the datasets (and their own identities) and the weights."""
        parts = [{k: v for k, v in p.identity().items() if k != "global_batch"} for p in self.parts]  # checked apart
        return {"blend": [{"path": n, **p} for n, p in zip(self.names, parts)],
                "blend_weights": list(self.weights), "blend_period": PERIOD}
