"""The TFDS source on a tiny dataset built here (array_record, no TensorFlow, no network)."""

import jax
import numpy as np
import pytest
from conftest import host_batch, train_config

from megajax.config import resolve
from megajax.data.tokenizer import train_tokenizer
from megajax.training.data import make_loader

tfds = pytest.importorskip("tensorflow_datasets")  # the `test` extra installs it; CI runs this test

TEXTS = [f"record {i}: " + " ".join(f"word{(i * 7 + j) % 50}" for j in range(60)) for i in range(12)]


class TinyText(tfds.core.GeneratorBasedBuilder):
    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        return tfds.core.DatasetInfo(builder=self, features=tfds.features.FeaturesDict(
            {"content": tfds.features.Text()}))

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples()}

    def _generate_examples(self):
        for i, text in enumerate(TEXTS):
            yield i, {"content": text}


def test_tfds_text_feature_trains(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGAJAX_CACHE", str(tmp_path / "cache"))
    TinyText(data_dir=str(tmp_path / "tfds"), file_format="array_record").download_and_prepare()
    tokenizer = train_tokenizer(TEXTS, "bpe", 400)
    tokenizer.save(tmp_path / "tok.json")
    config = train_config()
    config.model.vocab_size = 400
    config.data.update(source="tfds", tfds_name="tiny_text", tfds_feature="content",
                       tfds_data_dir=str(tmp_path / "tfds"), tokenizer=str(tmp_path / "tok.json"), valid_fraction=0.0)
    loader = make_loader(resolve(config, jax.device_count()))
    source = loader.batches.source
    stream = tokenizer.decode(np.asarray(source.tokens))
    for text in TEXTS:
        assert text in stream  # every record made it through, in order, with the same tokenization
    assert stream.count("<|endoftext|>") == len(TEXTS)
    assert host_batch(loader)["tokens"].shape == (8, 33)
    config.data.tfds_feature = "body"
    with pytest.raises(KeyError, match="no feature 'body'"):
        make_loader(resolve(config, jax.device_count()))
