"""A run's data: the corpus or task rows its model's spec asks for (``ModelSpec.examples``), checked against the
model first (``check_run_data``), and the loaders over them (``megajax.data.sources``)."""

from __future__ import annotations

from megajax.config import RunSpec, check_run_data
from megajax.data import sources
from megajax.data.loader import Loader


def load_dataset(spec: RunSpec) -> sources.Data:
    """The data of ``spec.dataset`` for ``spec``'s model (``megajax.data.sources.load_dataset``)."""
    check_run_data(spec)
    return sources.load_dataset(spec.dataset, spec.model_spec.examples)


def make_loader(spec: RunSpec, split: str = "train", data=None) -> Loader:
    """The loader of ``split`` ('train' or 'valid') of ``spec``'s model, positioned at step 0; ``data``: what
    ``load_dataset`` returned, to open the corpus once for both splits."""
    return sources.make_loader(spec.dataset, spec.model_spec.examples, split,
                               load_dataset(spec) if data is None else data)
