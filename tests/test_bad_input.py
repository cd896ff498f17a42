"""Bad input and unwritable or full disks, through the commands users type: each ends in one ``error:`` line that
says what to change, a non-zero exit and no traceback, before anything compiles where the input allows, and leaves
nothing behind. The train.py runs of the first test start together (they fail before compiling, so the cost is a
few interpreter starts); the full disks are small tmpfs mounts (root only, else skipped)."""

import contextlib
import json
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import child_env

from megajax.checkpoint import Checkpointer, CheckpointError
from megajax.cli import load_config
from megajax.config import bert_base_config, checkpoint_settings
from megajax.data.preprocess import main as preprocess_main
from megajax.data.tokenizer import train_tokenizer

ROOT = pathlib.Path(__file__).resolve().parent.parent
FLAGS = ["--config.data.source=random", "--config.train.steps=2", "--config.train.eval_batches=0"]

# name: (extra flags, what the error line says). One size and one optimizer setting stand for the rest, whose
# messages test_configs.py pins on the config (train.py reports every ConfigError of resolve alike).
CASES = {
    "config name": (["--config=gpt_tiyn"], "config 'gpt_tiyn' not found"),
    "config not a ConfigDict": (["--config=dict_config.py"], "get_config() returned a dict, not an "
                                                             "ml_collections.ConfigDict"),
    "config field": (["--config.train.stepz=5"],
                     "--config.train.stepz: config.train has no field 'stepz'; did you mean --config.train.steps?"),
    "no layers": (["--config.model.num_layers=0"], "model.num_layers=0 makes no model"),
    "no vocabulary": (["--config.model.vocab_size=0", "--config.data.source=default"],  # its own empty cache
                      "model.vocab_size=0 makes no model"),
    "blend prefix with a space": (["--config.data.source=indexed", "--config.data.blend=1 my data/a 1 data/b"],
                                  "a prefix with spaces goes in quotes"),
    "negative lr": (["--config.optimizer.lr=-1"], "optimizer.lr must be >= 0"),
    "auto with a mesh": (["--config.mesh.auto=True", "--mesh=2x4"], "mesh.auto plans the mesh: drop --mesh"),
    "auto on an encoder": (["--config=bert_tiny", "--config.mesh.auto=True"], "mesh.auto plans causal language models"),
    "auto where nothing fits": (["--config=llama3_8b", "--config.mesh.auto=True"], "mesh.auto: no plan of the 1 device "
                                "fits (the least memory: "),
    "read-only checkpoints": ([], "cannot write checkpoints to "),
    "resumed as another model": ([], "holds another model than this config's (model.name: 'bert' saved, 'gpt' here;"),
    "resumed on another vocabulary": (["--config.data.source=default"], "was trained on data tokenized with another "
                                      "vocabulary than this run's data (tokenizer fingerprints 0000000000000000 "
                                      "there, "),
}


@contextlib.contextmanager
def _read_only(directory: pathlib.Path):
    """``directory`` made unwritable, also for root (an immutable directory; chmod does not bind root)."""
    directory.chmod(0o555)
    immutable = subprocess.run(["chattr", "+i", str(directory)], capture_output=True).returncode == 0
    try:
        yield
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(directory)], check=True)
        directory.chmod(0o755)


def _stand_in_checkpoint(workdir: pathlib.Path, config) -> None:
    """A checkpoint that stores ``config`` (its arrays are a stand-in: the refusal must come before they are read,
    or the run would fail on them instead)."""
    config.checkpoint.async_save = False
    checkpointer = Checkpointer(workdir, checkpoint_settings(config))
    checkpointer.save(1, {"params": {"w": np.zeros(2, np.float32)}}, {"step": 1}, config.to_json(), force=True)
    checkpointer.close()


def _files(root: pathlib.Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")
            if p.is_file() and p.name != "train.lock"}  # the lock is the run's own (taken, then released)


def test_bad_input_to_train_py_is_one_error_line_and_leaves_nothing(tmp_path):
    (tmp_path / "dict_config.py").write_text("def get_config():\n    return {'train': {'steps': 2}}\n")
    (tmp_path / "read-only checkpoints" / "checkpoints").mkdir(parents=True)
    _stand_in_checkpoint(tmp_path / "resumed as another model", bert_base_config())
    gpt_tiny = load_config("gpt_tiny")
    gpt_tiny.data.tokenizer_fingerprint = "0" * 16  # not the default corpus's
    _stand_in_checkpoint(tmp_path / "resumed on another vocabulary", gpt_tiny)
    before = {name: _files(tmp_path / name) for name in CASES if (tmp_path / name).exists()}
    env = {**child_env(), "PYTHONPATH": str(ROOT)}
    with _read_only(tmp_path / "read-only checkpoints" / "checkpoints"):
        runs = {name: subprocess.Popen([sys.executable, str(ROOT / "train.py"), f"--workdir={tmp_path / name}",
                                        *FLAGS, *flags], cwd=tmp_path, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.PIPE, text=True,
                                       env={**env, "MEGAJAX_CACHE": str(tmp_path / "cache")}
                                       if name == "no vocabulary" else env)
                for name, (flags, _) in CASES.items()}
        results = {name: (run.wait(timeout=300), run.stderr.read()) for name, run in runs.items()}
    for name, (rc, stderr) in results.items():
        message = CASES[name][1]
        last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
        assert rc != 0 and last.startswith("error: ") and message in last, (name, stderr[-3000:])
        assert "Traceback" not in stderr, (name, stderr[-3000:])
        workdir = tmp_path / name
        assert (_files(workdir) if workdir.exists() else {}) == before.get(name, {}), name  # nothing written
    assert not (tmp_path / "cache").exists()  # the config was refused before the default corpus was built


@contextlib.contextmanager
def _small_disk(directory: pathlib.Path, size: str):
    """A file system of ``size`` at ``directory`` (a tmpfs; needs root, as CI's machine has)."""
    directory.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
                      capture_output=True).returncode:
        pytest.skip("cannot mount a small file system here (not root)")
    try:
        yield directory
    finally:
        subprocess.run(["umount", str(directory)], check=True)


def test_a_disk_too_small_for_a_checkpoint_is_refused_before_training(tmp_path):
    """gpt_tiny's checkpoint is ~11 MB; the workdir's disk holds 4 MB. The run says so before its first step, and what
    to do, instead of failing mid-write in orbax's threads (hundreds of lines of tracebacks)."""
    with _small_disk(tmp_path / "disk", "4m") as disk:
        run = subprocess.run([sys.executable, str(ROOT / "train.py"), f"--workdir={disk / 'run'}", *FLAGS,
                              "--config.train.global_batch_size=8",
                              "--config.checkpoint.every_steps=1"],
                             cwd=tmp_path, env={**child_env(), "PYTHONPATH": str(ROOT)}, capture_output=True,
                             text=True, timeout=300)
        last = run.stderr.strip().splitlines()[-1]
        assert run.returncode != 0 and last.startswith("error: the disk of "), run.stderr[-3000:]
        state = 3 * 937_472 * 4 / 2**20  # gpt_tiny's fp32 parameters and AdamW's two moments
        assert re.search(rf"has \d\.\d MiB free but a checkpoint of this run takes ~{state:.1f} MiB: free space",
                         last), last
        assert "train:" not in run.stderr  # before the first step
        assert "Traceback" not in run.stderr
        assert list(disk.iterdir()) == []  # the workdir this run made is gone


def test_a_save_that_fails_mid_write_removes_its_partial_directory(tmp_path):
    """The disk passes the room check (1 MiB of incompressible parameters, 1 MiB + 4 KiB free) and fills during the
    write (orbax's metadata and the stored config need more): the error says so and the temporary directory orbax
    would leave behind is gone."""
    with _small_disk(tmp_path / "disk", "1028k") as disk:
        config = bert_base_config()
        config.checkpoint.async_save = False
        checkpointer = Checkpointer(disk / "run", checkpoint_settings(config))
        state = {"params": {"w": np.random.default_rng(0).integers(0, 2**32, 2**18, dtype=np.uint32)}}  # random bits
        with pytest.raises(CheckpointError, match=r"saving a checkpoint to .* failed: the disk is full\. The "
                                                  r"checkpoints saved before are intact and the partial one was "
                                                  r"removed; free space and run the same command again"):
            checkpointer.save(1, state, {"step": 1}, config.to_json(), force=True)
        assert list((disk / "run" / "checkpoints").iterdir()) == []


def test_a_full_disk_while_preprocessing_is_an_error_line_and_leaves_nothing(tmp_path, capsys):
    corpus = tmp_path / "corpus.jsonl"
    words = [f"w{i}" for i in range(300)]
    corpus.write_text("".join(json.dumps({"text": " ".join(words[(i + j) % 300] for j in range(200))}) + "\n"
                              for i in range(400)))
    tokenizer = train_tokenizer([corpus.read_text()], "bpe", 400)
    tokenizer.save(tmp_path / "tok.json")
    with _small_disk(tmp_path / "disk", "64k") as disk:
        with pytest.raises(SystemExit) as exit_info:
            preprocess_main([f"--input={corpus}", f"--tokenizer={tmp_path / 'tok.json'}",
                             f"--output_prefix={disk / 'out'}", "--min_tokens=0", "--workers=1"])
        assert str(exit_info.value).startswith("error: ") and "No space left on device" in str(exit_info.value)
        assert f"nothing was written to {disk / 'out'}" in str(exit_info.value)
        assert list(disk.iterdir()) == []


def test_every_other_command_reports_bad_input_as_one_error_line(tmp_path):
    """The same rule through eval.py and each ``python -m megajax.*`` command: a misspelled config or flag, a missing
    checkpoint, an unwritable output (checked before anything is read), an unknown language; the processes start
    together. With MEGAJAX_DEBUG=1 the same mistake shows its traceback."""
    (tmp_path / "sealed").mkdir()
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "gpt2"}')
    (tmp_path / "doc.jsonl").write_text('{"text": "a b c"}\n')
    mixtral = tmp_path / "mixtral"  # a converted Mixtral's config.json with a null top-k
    mixtral.mkdir()
    (mixtral / "config.json").write_text(json.dumps({
        "model_type": "mixtral", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "num_local_experts": 4,
        "num_experts_per_tok": None, "max_position_embeddings": 64}))
    inputs = {p: p.read_bytes() for p in (hf / "config.json", mixtral / "config.json", tmp_path / "doc.jsonl")}
    cases = {  # name: (command, what the error line says)
        "info config name": (["-m", "megajax.info", "--config=gpt_tiyn"], "config 'gpt_tiyn' not found"),
        "comm_report config name": (["-m", "megajax.comm_report", "--config=gpt_tiyn"], "config 'gpt_tiyn' not found"),
        "scaling config name": (["-m", "megajax.scaling", "--config=gpt_tiyn", "--gpus=8"],
                                "config 'gpt_tiyn' not found"),
        "eval.py flag": ([str(ROOT / "eval.py"), "--checkpoint=x", "--task=ppl", "--stide=4"],
                         "unrecognized arguments: --stide=4"),
        "eval.py checkpoint": ([str(ROOT / "eval.py"), f"--checkpoint={tmp_path / 'none'}", "--task=ppl"],
                               "no megajax checkpoint at "),
        "convert unwritable output": (["-m", "megajax.convert", "hf-to-megajax", f"--hf={hf}",
                                       f"--output={tmp_path / 'sealed' / 'out'}"], "cannot be written"),
        "preprocess language": (["-m", "megajax.data.preprocess", f"--input={tmp_path / 'doc.jsonl'}",
                                 "--tokenizer=t.json", f"--output_prefix={tmp_path / 'o'}", "--language=xx"],
                                "--language: invalid choice: 'xx'"),
        "convert a null in config.json": (["-m", "megajax.convert", "hf-to-megajax", f"--hf={mixtral}",
                                           f"--output={tmp_path / 'moe'}"],
                                          f"{mixtral / 'config.json'} num_experts_per_tok=null, where a whole number "
                                          ">= 1 is needed (transformers refuses null there too): write the model's "
                                          "value there"),
    }
    env = {**child_env(), "PYTHONPATH": str(ROOT)}
    with _read_only(tmp_path / "sealed"):
        runs = {name: subprocess.Popen([sys.executable, *command], cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                                       stderr=subprocess.PIPE, text=True) for name, (command, _) in cases.items()}
        debug = subprocess.Popen([sys.executable, "-m", "megajax.info", "--config=gpt_tiyn"], cwd=tmp_path,
                                 env={**env, "MEGAJAX_DEBUG": "1"}, stderr=subprocess.PIPE, text=True)
        results = {name: (run.wait(timeout=300), run.stderr.read()) for name, run in runs.items()}
        debug_out = debug.communicate(timeout=300)[1]
    for name, (rc, stderr) in results.items():
        last = stderr.strip().splitlines()[-1] if stderr.strip() else ""
        assert rc != 0 and "error: " in last and cases[name][1] in last, (name, stderr[-3000:])
        assert "Traceback" not in stderr, (name, stderr[-3000:])
    assert list((tmp_path / "sealed").iterdir()) == [] and not list(tmp_path.glob("o.*"))
    assert not (tmp_path / "moe").exists() and {p: p.read_bytes() for p in inputs} == inputs
    assert debug.returncode != 0 and "Traceback" in debug_out and "FileNotFoundError: config 'gpt_tiyn'" in debug_out
