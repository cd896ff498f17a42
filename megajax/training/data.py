"""A training config's data: the corpus or task rows its model's spec asks for (``ModelSpec.examples``), checked
against the model first (``check_data_source``), and the loaders over them (``megajax.data.sources``)."""

from __future__ import annotations

import ml_collections

from megajax.config import check_data_source
from megajax.data import sources
from megajax.data.loader import Loader
from megajax.models import model_spec


def load_dataset(config: ml_collections.ConfigDict) -> sources.IndexedTokens | sources.TaskData | sources.BlendedData:
    """The data of ``config.data`` for ``config.model.name`` (``megajax.data.sources.load_dataset``)."""
    check_data_source(config)
    return sources.load_dataset(config, model_spec(config.model.name).examples)


def make_loader(config: ml_collections.ConfigDict, split: str = "train", data=None) -> Loader:
    """The loader of ``split`` ('train' or 'valid') of ``config``'s model, positioned at step 0; ``data``: what
    ``load_dataset`` returned, to open the corpus once for both splits."""
    return sources.make_loader(config, model_spec(config.model.name).examples, split,
                               load_dataset(config) if data is None else data)
