"""Runs that go bad stop before they harm a checkpoint, and bad input is refused before anything compiles."""

import json
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest
from conftest import child_env, train_config

from megajax.checkpoint import Checkpointer
from megajax.cli import _flag_value
from megajax.config import ConfigError, checkpoint_settings, resolve
from megajax.data.indexed import IndexedWriter
from megajax.training.health import TrainingDiverged
from megajax.training.loop import train

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _diverging(steps=6, **train):
    config = train_config(steps=steps, **train)
    config.optimizer.update(lr=1e10, warmup_steps=1)  # lr 0 at step 1, 1e10 at step 2: step 3 is NaN
    config.checkpoint.update(every_steps=1, keep=2, async_save=False)
    return config


def test_nonfinite_loss_stops_before_any_bad_save(tmp_path):
    with pytest.raises(TrainingDiverged) as e:
        train(_diverging(), tmp_path)
    message = str(e.value)
    assert "not been finite since step 3" in message and "last good checkpoint is step 2" in message
    assert "optimizer.lr" in message and "max_nonfinite_steps" in message
    ck = Checkpointer(tmp_path, checkpoint_settings(train_config()))
    assert ck.latest_step() == 2  # nothing saved from the bad steps; the good one survives
    ck.close()
    logged = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(np.isfinite(r["loss"]) for r in logged if "loss" in r)


def test_tolerance_skips_isolated_bad_steps(tmp_path):
    """With a tolerance the bad updates are skipped (parameters unchanged) and the run stops only past it."""
    with pytest.raises(TrainingDiverged, match="3 consecutive step"):
        train(_diverging(max_nonfinite_steps=2), tmp_path)


def _tiny_dataset(prefix, n_tokens, vocab=1000, docs=10):
    writer = IndexedWriter(prefix, np.uint16)
    for doc in np.array_split(np.arange(n_tokens) % vocab, docs):
        writer.add(doc)
    writer.commit({"vocab_size": vocab})
    return str(prefix)


@pytest.mark.parametrize("field,value,match", [
    ("train.steps", 0, "train.steps must be >= 1"),
    ("train.log_every", 0, "train.log_every must be >= 1"),
    ("checkpoint.every_steps", 0, "checkpoint.every_steps must be >= 1.*checkpoint.enabled=False"),
    ("train.global_batch_size", 6, "not divisible by the data-parallel size 4"),
    ("data.valid_fraction", 1.0, r"data.valid_fraction must be in \[0, 1\)"),
    ("model.name", "t5", "model.name='t5'; choose one of"),
])
def test_bad_config_values_fail_before_compiling(field, value, match):
    config = train_config(data=4)
    section, key = field.split(".")
    config[section][key] = value
    with pytest.raises(ConfigError, match=match):
        resolve(config, jax.device_count())


def test_data_too_small_is_named(tmp_path):
    config = train_config()
    config.data.update(source="indexed", path=_tiny_dataset(tmp_path / "small", 200))
    with pytest.raises(ConfigError, match="training split is too small.*one step needs train.global_batch_size=8"):
        train(config, tmp_path / "w1")
    config.data.path = _tiny_dataset(tmp_path / "big", 20_000, docs=1)  # one document: the split is cut inside it
    config.data.valid_fraction = 0.001
    with pytest.raises(ConfigError, match="validation split.*data.valid_fraction.*train.eval_batches=0"):
        train(config, tmp_path / "w2")


def test_ids_past_the_vocabulary_are_refused(tmp_path):
    config = train_config()
    config.data.update(source="indexed", path=_tiny_dataset(tmp_path / "wide", 20_000, vocab=1200))
    with pytest.raises(ConfigError, match="tokenizer has 1200 ids but model.vocab_size=1000"):
        train(config, tmp_path / "w")
    meta = tmp_path / "wide.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "vocab_size": 1000}))  # a lying sidecar
    with pytest.raises(ConfigError, match="holds token id 1199 but model.vocab_size=1000"):
        train(config, tmp_path / "w")


def test_resume_past_the_last_step_says_so(tmp_path, capsys):
    config = train_config(steps=2)
    train(config, tmp_path)
    assert train(config, tmp_path) == []
    assert "done: nothing to train, " in capsys.readouterr().err  # and the step that is there



def test_flag_values_parse_with_or_without_equals():
    assert _flag_value(["x", "--cpu_devices", "8"], "cpu_devices") == "8"
    assert _flag_value(["x", "--cpu_devices=4"], "cpu_devices") == "4"
    assert _flag_value(["x", "--cpu_devices_other=4"], "cpu_devices") is None
    with pytest.raises(ConfigError, match="needs a value"):  # an error: line, not a bare exit
        _flag_value(["x", "--cpu_devices"], "cpu_devices")


def test_train_py_exits_nonzero_on_divergence_with_cpu_devices_spaced(tmp_path):
    """As a user types it: `--cpu_devices 2` (a space) simulates 2 devices, and a diverging run exits 1 with a
    message, keeping its good checkpoint."""
    env = child_env()
    cmd = [sys.executable, str(ROOT / "train.py"), "--cpu_devices", "2", "--config=gpt_tiny", f"--workdir={tmp_path}",
           "--config.data.source=random", "--config.model.num_layers=1", "--config.model.max_seq_len=32",
           "--config.train.steps=6", "--config.train.log_every=1",
           "--config.train.global_batch_size=8", "--config.optimizer.lr=1e10", "--config.optimizer.warmup_steps=1",
           "--config.checkpoint.every_steps=1", "--config.checkpoint.async_save=False"]
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "error: training stopped at step" in out.stderr and "last good checkpoint is step 2" in out.stderr
    start = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert start["devices"] == 2
