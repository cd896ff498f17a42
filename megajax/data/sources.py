"""Where training data comes from: ``config.data.source`` -> token array + document offsets -> a loader."""

from __future__ import annotations

import ml_collections
import numpy as np

from megajax.data.gpt_dataset import GPTBatches, GPTLoader, split_by_documents
from megajax.data.indexed import IndexedTokens
from megajax.sharding import ConfigError


def load_dataset(config: ml_collections.ConfigDict) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, document offsets) of the corpus named by ``config.data``."""
    d, vocab = config.data, config.model.vocab_size
    if d.source == "default":
        from megajax.data.default_corpus import default_corpus
        data = default_corpus(vocab)[0]
    elif d.source == "indexed":
        data = IndexedTokens.open(d.path)
    elif d.source == "tfds":
        from megajax.data.default_corpus import cache_root
        from megajax.data.tfds_source import tfds_corpus
        data = tfds_corpus(d.tfds_name, d.tfds_split, d.tfds_feature, d.tokenizer, cache_root(), d.tfds_data_dir,
                           d.min_tokens)
    elif d.source == "random":  # labelled: uniform tokens, the loss cannot fall below log(vocab)
        tokens = np.random.default_rng(d.seed).integers(0, vocab, 1 << 20, dtype=np.int32)
        return tokens, np.arange(0, len(tokens) + 1, 1024)
    else:
        raise ConfigError(f"data.source={d.source!r}; choose default, indexed, tfds or random")
    if data.meta["vocab_size"] > vocab:
        raise ConfigError(f"the data's tokenizer has {data.meta['vocab_size']} ids but model.vocab_size={vocab}; "
                          f"set --config.model.vocab_size={data.meta['vocab_size']}")
    return data.tokens, data.offsets


def make_loader(config: ml_collections.ConfigDict, split: str = "train") -> GPTLoader:
    """The loader of ``split`` ('train' or 'valid'), positioned at step 0."""
    tokens, offsets = load_dataset(config)
    train_range, valid_range = split_by_documents(offsets, config.data.valid_fraction)
    batches = GPTBatches(tokens, config.model.max_seq_len, config.train.global_batch_size, config.data.seed,
                         train_range if split == "train" else valid_range)
    return GPTLoader(batches)
