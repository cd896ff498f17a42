"""Checkpoints: SIGTERM saves, exact resume after it and after SIGKILL, interrupted saves, resharding, damaged
files."""

import json
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import child_env, train_config

from megajax.checkpoint import Checkpointer, CheckpointError, load_model, read_config, save_params
from megajax.checkpoint.manager import _arrays, _to_tree
from megajax.config import ConfigError, checkpoint_settings
from megajax.training.loop import setup, train

ROOT = pathlib.Path(__file__).resolve().parent.parent
FLAGS = ["--config=gpt_tiny", "--config.data.source=random", "--config.train.log_every=1",
         "--config.model.dropout=0.1", "--config.train.global_batch_size=8"]


# The schedule is part of the compiled step: with one decay length for every run of this module, the reference
# run compiles the step and the stopped and resumed runs load it from the session's compilation cache.
SCHEDULE = ["--config.optimizer.decay_steps=24"]


def _launch(workdir, *extra):
    # One CPU device and the session's compilation cache (child_env: tests/conftest.py), shared by all the processes
    # of this module: they compile the step once between them (a cache beside each test's workdir compiled it in
    # the reference run and again in each test).
    env = child_env()
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu")
    return subprocess.Popen([sys.executable, str(ROOT / "train.py"), f"--workdir={workdir}", *FLAGS, *extra],
                            env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _metrics(workdir):
    return [json.loads(x) for x in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]


def _wait_for(predicate, proc, timeout=240):
    t0 = time.time()
    while not predicate():
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.time() - t0 < timeout
        time.sleep(0.02)


def _final_params(workdir):
    model, _ = load_model(workdir, data=1, model=1)
    return jax.tree.map(np.asarray, jax.tree.leaves(model))


ARGS = ["--config.train.steps=24", "--config.checkpoint.every_steps=4", *SCHEDULE]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run both stopped runs must equal: its losses by step and its final parameters."""
    workdir = tmp_path_factory.mktemp("reference") / "run"
    run = _launch(workdir, *ARGS)
    assert run.wait(timeout=300) == 0, run.stderr.read()[-3000:]
    return {r["step"]: r["loss"] for r in _metrics(workdir) if "loss" in r}, _final_params(workdir)


def _assert_resumed_exactly(workdir, reference) -> list[int]:
    """Each resumed stretch of ``workdir``'s run (from a resume to the next, the last to step 24) equals the
    reference bit for bit, and so do the final parameters; returns the steps it resumed from."""
    lines = _metrics(workdir)
    starts = [i for i, r in enumerate(lines) if r.get("event") == "resume"]
    losses, params = reference
    for i, end in zip(starts, [*starts[1:], len(lines)]):
        after = {r["step"]: r["loss"] for r in lines[i:end] if "loss" in r}
        first = lines[i]["step"] + 1
        assert sorted(after) == list(range(first, 25 if end == len(lines) else first + len(after)))
        assert all(after[s] == losses[s] for s in after), [(s, after[s], losses[s]) for s in after]  # bitwise
    for a, b in zip(jax.tree.leaves(_final_params(workdir)), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b)
    return [lines[i]["step"] for i in starts]


@pytest.mark.slow
def test_sigterm_saves_exits_143_and_a_sigkill_later_loses_nothing(tmp_path, reference):
    """A scheduler's stop, then a crash, then the same command: SIGTERM lets the current step finish and be saved,
    the exit status is 143 (128 + SIGTERM) with one line saying where the checkpoint is; the same command resumes
    there, is killed (SIGKILL) mid-run after a later checkpoint, and the same command again resumes from that
    checkpoint and finishes as if nothing happened: each resumed stretch's losses and the final parameters are the
    uninterrupted run's bit for bit."""
    workdir = tmp_path / "run"
    proc = _launch(workdir, *ARGS)
    _wait_for(lambda: (workdir / "metrics.jsonl").exists() and len(_metrics(workdir)) >= 4, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=120) == 128 + signal.SIGTERM
    last = _metrics(workdir)[-1]["step"]
    assert last < 24  # stopped before the end
    stderr = proc.stderr.read()
    assert stderr.strip().splitlines()[-1].startswith(f"stopped by SIGTERM: step {last}/24; "), stderr[-2000:]
    assert f"checkpoint {workdir / 'checkpoints' / str(last)}; run the same command to resume" in stderr
    assert "Traceback" not in stderr
    assert Checkpointer(workdir, checkpoint_settings(train_config())).latest_step() == last

    saved = (last // 4 + 1) * 4  # the resumed run's next checkpoint (every 4 steps)
    assert saved < 24, last
    killed = _launch(workdir, *ARGS)
    _wait_for(lambda: (workdir / f"checkpoints/{saved}").is_dir(), killed)
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    assert killed.returncode == -signal.SIGKILL
    died = [r for r in _metrics(workdir) if "loss" in r][-1]["step"]
    assert died < 24  # it really died mid-run

    resumed = _launch(workdir, *ARGS)
    assert resumed.wait(timeout=300) == 0
    assert "done: step 24/24; " in resumed.stderr.read()
    first, second = _assert_resumed_exactly(workdir, reference)
    assert first == last and saved <= second <= died


@pytest.fixture(scope="module")
def saved_1x8(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("ck")
    config = train_config(1, 8, steps=2)
    train(config, workdir)
    return workdir


@pytest.fixture(scope="module")
def run_1x8():
    """The compiled run for saved_1x8's config: its abstract_state is the restore target."""
    return setup(train_config(1, 8, steps=2))


def test_interrupted_save_leaves_previous_checkpoint(saved_1x8, run_1x8, tmp_path):
    workdir = tmp_path / "w"
    shutil.copytree(saved_1x8, workdir)
    partial = workdir / "checkpoints" / "7.orbax-checkpoint-tmp-1700000000"
    shutil.copytree(workdir / "checkpoints" / "2", partial)
    for f in partial.rglob("*"):
        if f.is_file() and f.stat().st_size > 100:
            f.write_bytes(f.read_bytes()[:50])  # a save killed half-way
    ck = Checkpointer(workdir, checkpoint_settings(train_config()))
    assert ck.latest_step() == 2
    state, loader = ck.restore(run_1x8.abstract_state)
    assert int(state.step) == 2 and loader["step"] == 2


@pytest.mark.parametrize("data,model", [(2, 4), (1, 2), (1, 1)])
def test_restore_onto_other_meshes(saved_1x8, data, model):
    ref_model, _ = load_model(saved_1x8, data=1, model=8)
    other, config = load_model(saved_1x8, data=data, model=model)
    assert other.wte.embedding[...].sharding.mesh.devices.shape == (data, model)
    for a, b in zip(jax.tree.leaves(nnx_state(ref_model)), jax.tree.leaves(nnx_state(other))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 1000, (4, 16)))
    np.testing.assert_allclose(np.asarray(other(tokens))[..., :1000], np.asarray(ref_model(tokens))[..., :1000],
                               rtol=1e-5, atol=1e-5)


def nnx_state(model):
    from flax import nnx
    return nnx.state(model)


def _snapshot(root):
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in pathlib.Path(root).rglob("*") if p.is_file()}


def test_shape_mismatch_names_the_parameter(saved_1x8):
    before = _snapshot(saved_1x8)
    config = train_config(1, 8, steps=2)
    config.model.hidden_size = 128
    run = setup(config)
    with pytest.raises(CheckpointError, match=r"parameter params/\S+ has shape"):
        Checkpointer(saved_1x8, checkpoint_settings(config)).restore(run.abstract_state)
    assert _snapshot(saved_1x8) == before


# tensorstore's reader leaves an asyncio callback behind when a read fails; harmless, but pytest reports it.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_damaged_checkpoint_is_a_clear_error(saved_1x8, run_1x8, tmp_path):
    workdir = tmp_path / "w"
    shutil.copytree(saved_1x8, workdir)
    data_files = [f for f in (workdir / "checkpoints" / "2" / "state" / "d").rglob("*") if f.is_file()]
    for f in data_files:
        f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 3])
    before = _snapshot(workdir)
    names = "|".join(re.escape(n) for n in _arrays(_to_tree(run_1x8.abstract_state)))
    with pytest.raises(CheckpointError, match=rf"damaged or incomplete: array ({names}) \(the first that failed\) "
                                              r"cannot be read .*"
                                              r"--config\.checkpoint\.restore_step=N \(steps available in .*: 1\)"):
        Checkpointer(workdir, checkpoint_settings(train_config())).restore(run_1x8.abstract_state)
    with pytest.raises(CheckpointError, match=r"damaged or incomplete: array [\w/]+ \(the first that failed\) "
                                              r"cannot be read .*"
                                              r"Load an earlier step by passing its directory, e\.g\. \S+/1 "):
        load_model(workdir)
    assert _snapshot(workdir) == before


def test_keeps_last_k_and_every_mth(tmp_path):
    config = train_config(steps=5, eval_batches=0)
    config.checkpoint.update(every_steps=1, keep=2, keep_period=3, async_save=False)
    train(config, tmp_path)
    kept = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert kept == [3, 4, 5]  # the last 2, and every 3rd


def test_relative_paths(saved_1x8, run_1x8, tmp_path, monkeypatch):
    reference, _ = load_model(saved_1x8)
    monkeypatch.chdir(saved_1x8.parent)
    name = saved_1x8.name
    assert read_config(name)["model"]["hidden_size"] == 64
    assert read_config(f"{name}/checkpoints/1")["model"]["hidden_size"] == 64
    for path in (name, f"{name}/checkpoints", f"{name}/checkpoints/2"):
        model, _ = load_model(path)
        for a, b in zip(jax.tree.leaves(nnx_state(reference)), jax.tree.leaves(nnx_state(model))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    state, _ = Checkpointer(name, checkpoint_settings(train_config())).restore(run_1x8.abstract_state)
    assert int(state.step) == 2
    monkeypatch.chdir(tmp_path)
    out = save_params("export", nnx_state_dict(reference), json.dumps(read_config(saved_1x8)))
    assert out == tmp_path / "export" / "0"
    exported, _ = load_model("export")
    for a, b in zip(jax.tree.leaves(nnx_state(reference)), jax.tree.leaves(nnx_state(exported))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def nnx_state_dict(model):
    from flax import nnx
    return nnx.to_pure_dict(nnx.state(model))


def _flip_bytes(step_dir: pathlib.Path) -> None:
    """Flips one bit in the middle of the largest data file: zstd has no checksum, so this still decodes."""
    largest = max((f for f in (step_dir / "state").rglob("*") if f.is_file() and f.parent.name == "d"),
                  key=lambda f: f.stat().st_size)
    data = bytearray(largest.read_bytes())
    data[len(data) // 2] ^= 0x40
    largest.write_bytes(bytes(data))


def _differing(a, b) -> set[str]:
    a, b = _arrays(_to_tree(a)), _arrays(_to_tree(b))
    return {n for n in a if not np.array_equal(np.asarray(a[n]), np.asarray(b[n]))}


def test_changed_bytes_name_the_array(saved_1x8, run_1x8, tmp_path):
    workdir = tmp_path / "w"
    shutil.copytree(saved_1x8, workdir)
    _flip_bytes(workdir / "checkpoints" / "2")
    before = _snapshot(workdir)
    with pytest.raises(CheckpointError) as error:
        Checkpointer(workdir, checkpoint_settings(train_config())).restore(run_1x8.abstract_state)
    message = str(error.value)
    assert re.search(r"checkpoints/2 is damaged: array \S+ does not match the digest", message), message
    assert "pass --config.checkpoint.restore_step=N (steps available in " in message and message.endswith(": 1).")
    assert _snapshot(workdir) == before
    # Without its digests (as written before they existed) the same checkpoint loads unverified: the arrays that
    # really differ from the intact copy are exactly the one the error named.
    shutil.rmtree(workdir / "checkpoints" / "2" / "digests")
    damaged, _ = Checkpointer(workdir, checkpoint_settings(train_config())).restore(run_1x8.abstract_state)
    intact, _ = Checkpointer(saved_1x8, checkpoint_settings(train_config())).restore(run_1x8.abstract_state)
    named = re.search(r"array (\S+) does not match", message).group(1)
    assert _differing(damaged, intact) == {named}


def test_load_model_checks_digests_of_exports(saved_1x8, tmp_path):
    reference, config = load_model(saved_1x8)
    out = save_params(tmp_path / "export", nnx_state_dict(reference), config.to_json(), dtype="bfloat16")
    model, _ = load_model(out)  # bfloat16 on disk, float32 in memory: verified by casting back (exact)
    assert model.wte.embedding[...].dtype == jnp.float32
    record_file = out / "digests" / "metadata"
    record = json.loads(record_file.read_text())
    assert record["arrays"]["wte/embedding"]["dtype"] == "bfloat16"
    digest = record["arrays"]["wte/embedding"]["digest"]
    record["arrays"]["wte/embedding"]["digest"] = f"{int(digest, 16) ^ 1:016x}"
    record_file.write_text(json.dumps(record))
    with pytest.raises(CheckpointError, match=r"export/0 is damaged: array wte/embedding does not match the digest"
                                              r".* No other step is saved beside it"):
        load_model(out)


def test_resume_from_an_earlier_step(saved_1x8, run_1x8, tmp_path):
    workdir = tmp_path / "w"
    shutil.copytree(saved_1x8, workdir)
    ck = Checkpointer(workdir, checkpoint_settings(train_config()))
    with pytest.raises(CheckpointError, match=r"checkpoint\.restore_step=5, but \S+ holds no step 5 \(steps "
                                              r"available: 1, 2\); pass one of them, or 0 for the latest"):
        ck.resume(run_1x8.abstract_state, 5)
    state, loader = ck.resume(run_1x8.abstract_state, 1)
    assert int(state.step) == 1 and loader["step"] == 1
    assert ck.latest_step() == 1  # step 2 is out of the way of this run's next saves...
    [aside] = (workdir / "superseded").iterdir()
    assert sorted(p.name for p in aside.iterdir()) == ["2"]  # ...and kept
    ck.close()


def test_negative_keep_and_restore_step_are_config_errors():
    for field in ("keep", "restore_step"):
        config = train_config()
        config.checkpoint[field] = -1
        with pytest.raises(ConfigError, match=rf"checkpoint\.{field}=-1; use 0 "):
            setup(config)
