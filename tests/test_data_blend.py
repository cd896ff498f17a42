"""data.blend: weighted mixing of preprocessed datasets (Megatron's --data-path W A W B): the mixture, each
dataset read in order once per epoch, batches a pure function of the step, the single-dataset case equal to the
unblended loader, resume checks, and bad input."""

import jax
import numpy as np
import pytest
from conftest import host_batch

from megajax.config import base_config, bert_base_config, resolve
from megajax.data.blend import PERIOD, BlendedBatches, interleave, parse_blend, slot_counts
from megajax.data.loader import LoaderStateError
from megajax.data.preprocess import write_documents
from megajax.data.tokenizer import train_tokenizer
from megajax.errors import ConfigError
from megajax.training.data import load_dataset, make_loader

RNG = np.random.default_rng(0)
WORDS = [f"w{i}" for i in range(500)]


class _Counter:
    """A stand-in dataset whose sample k is (its id, k): shows which sample of which dataset each row holds."""

    def __init__(self, ident: int):
        self.ident, self.fields = ident, {"tokens": ((2,), np.dtype(np.int32))}

    def samples(self, indices):
        return {"tokens": np.stack([np.full(len(indices), self.ident), indices], axis=1).astype(np.int32)}

    def identity(self):
        return {"id": self.ident}


def test_parse_blend_normalises_and_refuses_bad_input():
    spec = parse_blend("3 data/a  1 data/b")
    assert spec.weights == (0.75, 0.25) and spec.paths == ("data/a", "data/b")
    for text, message in [("0.3 a 0.7", "weight / prefix pairs"), ("x a 1 b", "'x' is not a weight"),
                          ("0 a 1 b", "must be a positive number"), ("-1 a 2 b", "positive"),
                          ("nan a 1 b", "positive"), ("1 a 1 a", "names a dataset twice"),
                          ("1e-6 a 1 b", "below 1/10000")]:
        with pytest.raises(ConfigError, match=message):
            parse_blend(text)
    # a prefix with a space: quoted, as in a shell; unquoted, the message says to quote it
    spec = parse_blend('1 "my data/a" 1 data/b')
    assert spec.paths == ("my data/a", "data/b")
    for text in ["1 my data/a 1 data/b", "1 my data/a 1 data/b c", '1 "my data/a 1 data/b']:
        with pytest.raises(ConfigError, match="a prefix with spaces goes in quotes"):
            parse_blend(text)


def test_every_prefix_of_a_period_is_within_one_sample_of_the_weights():
    weights = (0.5, 0.3, 0.15, 0.05)
    counts = slot_counts(weights)
    assert counts.sum() == PERIOD and np.abs(counts - np.asarray(weights) * PERIOD).max() < 1
    dataset, index = interleave(counts)
    seen = np.cumsum(np.eye(len(weights), dtype=np.int64)[dataset], axis=0)  # (PERIOD, D) counts per prefix
    n = np.arange(1, PERIOD + 1)[:, None]
    assert np.abs(seen - n * counts / PERIOD).max() <= 1.0
    for d in range(len(weights)):  # each dataset's slots in order 0, 1, 2, ...
        np.testing.assert_array_equal(index[dataset == d], np.arange(counts[d]))


def test_mixture_order_and_purity_over_many_steps():
    weights, batch, steps = (0.2, 0.3, 0.5), 24, 1500
    blend = BlendedBatches([_Counter(i) for i in range(3)], weights, batch, ("a", "b", "c"))
    rows = np.concatenate([blend.batch(s)["tokens"] for s in range(steps)])  # (36000, 2)
    share = np.bincount(rows[:, 0], minlength=3) / len(rows)
    assert np.abs(share - weights).max() < 1e-3  # the acceptance asks for 1 %
    for d in range(3):  # every dataset read in order: nothing skipped or repeated (its own epochs wrap it)
        np.testing.assert_array_equal(rows[rows[:, 0] == d, 1], np.arange((rows[:, 0] == d).sum()))
    assert blend.drawn(steps) == np.bincount(rows[:, 0], minlength=3).tolist()
    np.testing.assert_array_equal(blend.rows(777, 5, 19)["tokens"], blend.batch(777)["tokens"][5:19])


TEXTS = [". ".join(" ".join(RNG.choice(WORDS, 12)) for _ in range(4)) + "." for _ in range(200)]
TOKENIZERS = {kind: train_tokenizer(TEXTS, kind, 700) for kind in ("bpe", "wordpiece")}


def _corpus(tmp_path, name, n_docs, split_sentences=False, tokenizer=None):
    texts = [". ".join(" ".join(RNG.choice(WORDS, 12)) for _ in range(4)) + "." for _ in range(n_docs)]
    tok = tokenizer or TOKENIZERS["wordpiece" if split_sentences else "bpe"]
    write_documents(texts, tok, tmp_path / name, min_tokens=0, split_sentences=split_sentences)
    return str(tmp_path / name)


def _spec(bert=False, **data):
    c = bert_base_config() if bert else base_config()
    c.model.update(vocab_size=768, make_vocab_size_divisible_by=128, max_seq_len=32)
    c.train.global_batch_size = 8
    c.data.update({"source": "indexed", **data})
    return resolve(c, jax.device_count())


def test_one_dataset_at_full_weight_is_the_unblended_loader(tmp_path):
    path = _corpus(tmp_path, "a", 60)
    plain, blended = make_loader(_spec(path=path)), make_loader(_spec(blend=f"1 {path}"))
    for step in (0, 1, 7, 40):
        np.testing.assert_array_equal(plain.batches.batch(step)["tokens"], blended.batches.batch(step)["tokens"])


def test_blend_of_gpt_and_bert_datasets_and_resume_checks(tmp_path):
    a, b = _corpus(tmp_path, "a", 40), _corpus(tmp_path, "b", 80)
    loader = make_loader(_spec(blend=f"0.25 {a} 0.75 {b}"))
    data = load_dataset(_spec(blend=f"0.25 {a} 0.75 {b}"))
    for step in range(3):
        tokens = host_batch(loader)["tokens"]
        assert tokens.shape == (8, 33) and tokens.dtype == np.int32
    valid = make_loader(_spec(blend=f"0.25 {a} 0.75 {b}"), "valid", data)
    assert valid.batches.batch(0)["tokens"].shape == (8, 33)
    state = loader.get_state()
    resumed = make_loader(_spec(blend=f"0.25 {a} 0.75 {b}"))
    resumed.set_state(state)
    # the same batch after resume
    np.testing.assert_array_equal(host_batch(resumed)["tokens"], host_batch(loader)["tokens"])
    changed = make_loader(_spec(blend=f"0.5 {a} 0.5 {b}"))
    with pytest.raises(LoaderStateError, match="allow_blend_change=True"):
        changed.set_state(state)
    changed.set_state(state, allow_blend_change=True)
    assert changed.step == 3
    other = make_loader(_spec(blend=f"0.25 {b} 0.75 {a}"))
    with pytest.raises(LoaderStateError, match="another dataset"):
        other.set_state(state)

    x, y = _corpus(tmp_path, "x", 40, split_sentences=True), _corpus(tmp_path, "y", 40, split_sentences=True)
    bert = make_loader(_spec(bert=True, blend=f"1 {x} 3 {y}"))
    batch = host_batch(bert)
    assert batch["tokens"].shape == (8, 32) and set(batch) >= {"mlm_labels", "sop_labels", "token_types"}


@pytest.mark.parametrize("data, message", [
    (dict(blend="1 nowhere"), "data.blend: dataset nowhere"),
    (dict(blend="1 a", path="data/x"), "leave data.path empty"),
    (dict(blend="1 a", source="default"), "set --config.data.source=indexed"),
])
def test_blend_config_errors(tmp_path, data, message):
    with pytest.raises(ConfigError, match=message):
        load_dataset(_spec(**data))


def test_blend_of_two_tokenizers_is_refused(tmp_path):
    a = _corpus(tmp_path, "a", 20)
    b = _corpus(tmp_path, "b", 20, tokenizer=train_tokenizer(TEXTS[:50], "bpe", 600))
    with pytest.raises(ConfigError, match=f"{b} was preprocessed with another tokenizer than {a}"):
        load_dataset(_spec(blend=f"1 {a} 1 {b}"))
