"""A checkpoint written before each family had its own config type (issue 34) still resumes and loads: every
family's stored ``config.model`` then held BERT's ``post_layernorm`` and ``num_token_types``, the classifier's
``num_classes`` and GPT's ``activation`` (Llama's unused), and GPT's and BERT's had no ``ffn_hidden_size``. They are
read as today's sections (``config/migrate.py``, ``config.resolve.stored_config``)."""

from __future__ import annotations

import json
import pathlib

import pytest
from conftest import choice_config
from test_bert_training import bert_run_config

from megajax.api import load_model
from megajax.config import model_config, stored_config
from megajax.config.load import read_run_config
from megajax.training.loop import train

# what the shared defaults added to each family's section before issue 34, and the fields they lacked
OLD_SHARED = {"post_layernorm": False, "num_token_types": 0, "num_classes": 2, "activation": "gelu_tanh"}
ADDED_SINCE = {"gpt": ("ffn_hidden_size",), "bert": ("ffn_hidden_size",), "llama": ()}


def _as_stored_before(step_dir: pathlib.Path, name: str) -> dict:
    """Rewrites the stored config of ``step_dir`` as the defaults of before issue 34 wrote it; returns it."""
    path = step_dir / "config" / "metadata"
    stored = json.loads(path.read_text())
    model = stored["model"]
    for field, value in OLD_SHARED.items():
        model.setdefault(field, value)  # BERT keeps its own post_layernorm and num_token_types
    for field in ADDED_SINCE[name]:
        del model[field]
    path.write_text(json.dumps(stored))
    return model


@pytest.mark.parametrize("name", ["gpt", "bert", "llama"])
def test_a_checkpoint_from_before_family_configs_resumes_and_loads(tmp_path, name):
    config = bert_run_config(steps=1) if name == "bert" else choice_config(None, 1, 1, steps=1, name=name)
    config.checkpoint.update(enabled=True, async_save=False)
    workdir = tmp_path / "run"
    train(config, workdir)
    step_dir = workdir / "checkpoints" / "1"
    old = _as_stored_before(step_dir, name)
    assert "num_token_types" in old and "activation" in old  # the test edits what it means to

    read = read_run_config(step_dir)  # the stored JSON, migrated, then stored_config
    assert model_config(read) == model_config(config)  # the same model, field for field
    config.train.steps = 2
    records = train(config, workdir)  # resumes: the stored and requested models compare equal
    assert [r["step"] for r in records][-1] == 2 and records[0]["step"] > 1
    loaded = load_model(workdir)
    assert loaded.spec.model.num_layers == config.model.num_layers


def test_a_field_the_family_never_had_is_still_refused(tmp_path):
    """Only the old shared values are dropped: a stored GPT section with num_token_types=2 (never a GPT's) is read
    as what it is, an unknown field."""
    config = choice_config(None, 1, 1, steps=1)
    config.model.num_token_types = 2
    with pytest.raises(Exception, match="model.name=gpt has no field model.num_token_types"):
        model_config(stored_config(config))
