"""train.py end to end: real text on the CPU, metrics on disk, and two processes agreeing with one."""

import json
import pathlib
import socket
import subprocess
import sys

import numpy as np
import pytest
from conftest import child_env

from megajax.checkpoint import read_config
from megajax.cli import load_config
from megajax.data.default_corpus import default_corpus
from megajax.data.tokenizer import load_tokenizer
from megajax.training.loop import train

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.many_steps
def test_tiny_trains_on_the_default_corpus(tmp_path):
    config = load_config("gpt_tiny")
    config.train.update(steps=60, log_every=20)
    records = train(config, tmp_path)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    start, logged = lines[0], [r for r in lines[1:] if "loss" in r]
    assert start["event"] == "start" and start["num_params"] == 937_472 and start["mesh"] == "8x1"
    assert lines[1:] == records and [r["step"] for r in logged] == [20, 40, 60]
    valid = lines[-1]
    assert valid["step"] == 60 and valid["valid_loss"] < start["unigram_entropy"]
    assert valid["valid_ppl"] == pytest.approx(np.exp(valid["valid_loss"]))
    for key in ("loss", "lr", "grad_norm", "tokens_per_sec", "step_time_s", "tflops_per_device", "mfu"):
        assert key in logged[-1]
    assert logged[-1]["loss"] < logged[0]["loss"] - 0.5
    assert logged[-1]["loss"] < start["unigram_entropy"]  # it learned context, not just token frequencies
    assert any(p.name.startswith("events.out.tfevents") for p in tmp_path.iterdir())
    # the checkpoints record the vocabulary of the data's tokenizer, which resuming and evaluation compare
    tokenizer = load_tokenizer(default_corpus(config.model.vocab_size)[1])
    assert read_config(tmp_path)["data"]["tokenizer_fingerprint"] == tokenizer.fingerprint
    assert config.data.tokenizer_fingerprint == ""  # recorded on the run's copy, not the caller's config


@pytest.mark.many_steps
def test_llama_tiny_learns_on_the_default_corpus(tmp_path):
    """llama_tiny's threshold (issue 24): held-out loss at least 0.5 nats under the corpus's unigram entropy, here
    after 100 of its 300 steps on 4x2 (its 2 key/value heads split over the model axis); the full run ends ~1.8 nats
    under it (configs/llama_tiny.py)."""
    config = load_config("llama_tiny")
    config.train.update(steps=100, log_every=50)
    config.mesh.update(data=4, model=2)
    train(config, tmp_path)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    start, valid = lines[0], lines[-1]
    assert start["num_params"] == 887_424 and start["mesh"] == "4x2"
    assert valid["step"] == 100 and valid["valid_loss"] < start["unigram_entropy"] - 0.5, (valid, start)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ARGS = ["--config=gpt_tiny", "--config.data.source=random", "--config.train.steps=3", "--config.train.log_every=1",
        "--config.mesh.model=2", "--config.train.global_batch_size=8"]


@pytest.mark.slow
def test_two_processes_match_one(tmp_path):
    env = child_env()
    env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{_free_port()}", JAX_NUM_PROCESSES="2", JAX_PLATFORMS="cpu",
               PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, str(ROOT / "train.py"), "--cpu_devices=4", f"--workdir={tmp_path}"]
                              + ARGS, env={**env, "JAX_PROCESS_ID": str(i)}, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for i in range(2)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs[0][-3000:] + outputs[1][-3000:]
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["processes"] == 2 and lines[0]["devices"] == 8 and lines[0]["mesh"] == "4x2"
    multi = [r["loss"] for r in lines[1:] if "loss" in r]

    config = load_config("gpt_tiny")
    config.data.source, config.mesh.model = "random", 2
    config.train.update(steps=3, log_every=1, global_batch_size=8)
    single = [r["loss"] for r in train(config, tmp_path.parent / f"{tmp_path.name}-single") if "loss" in r]
    assert len(multi) == 3
    np.testing.assert_allclose(multi, single, rtol=1e-5)
