"""Faults a user meets, driven through train.py: a second run on a busy workdir, a lock left by a dead run,
keep=0, a damaged checkpoint named with the way out, and resuming from an earlier step. The lock's own logic
is tested in-process (fast); the train.py runs share one workdir, in order."""

import errno
import json
import os
import pathlib
import re
import socket
import subprocess
import sys

import pytest
from conftest import child_env

from megajax.training import workdir_lock
from megajax.training.workdir_lock import WorkdirInUseError, WorkdirLock, hold_workdir

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Every run has the same model and schedule (only checkpoint.* differs), so the later ones load the first one's
# compiled step from JAX's persistent cache instead of compiling it again.
FLAGS = ["--config=gpt_tiny", "--config.data.source=random", "--config.train.log_every=1",
         "--config.train.global_batch_size=8", "--config.train.eval_batches=0", "--config.train.steps=8",
         "--config.checkpoint.every_steps=1", "--config.checkpoint.async_save=False"]


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _record(path: pathlib.Path) -> dict:
    return json.loads(path.read_text())


# --- the lock, in-process ------------------------------------------------------------------------------------

def test_second_holder_is_refused_with_the_holders_name(tmp_path):
    first, second = WorkdirLock(tmp_path), WorkdirLock(tmp_path)
    assert first.acquire() is None
    held = _record(first.path)
    assert held["pid"] == os.getpid() and held["host"] == socket.gethostname()
    with pytest.raises(WorkdirInUseError) as refused:
        second.acquire()
    message = str(refused.value)
    assert f"pid {os.getpid()} on host {socket.gethostname()}, started {held['started']}" in message
    assert "wait for that run to finish, stop it" in message and "pass a different --workdir" in message
    assert _record(first.path) == held  # the refused attempt left the holder's record alone
    first.release()
    assert first.path.read_text() == ""
    assert second.acquire() is None
    second.release()


def test_lock_of_a_killed_process_is_recovered(tmp_path):
    code = (f"import sys, time; sys.path.insert(0, {str(ROOT)!r}); from megajax.training.workdir_lock import "
            f"WorkdirLock; lock = WorkdirLock({str(tmp_path)!r}); lock.acquire(); print('held', flush=True); "
            "time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    with pytest.raises(WorkdirInUseError, match=f"pid {holder.pid} on host"):
        WorkdirLock(tmp_path).acquire()
    holder.kill()  # SIGKILL: no chance to release; the kernel frees the lock, the record stays
    holder.wait()
    lock = WorkdirLock(tmp_path)
    note = lock.acquire()
    assert f"recovered the lock left by pid {holder.pid} on host {socket.gethostname()}" in note
    lock.release()


def test_record_from_another_host_is_taken_over_with_a_warning(tmp_path):
    (tmp_path / "train.lock").write_text(json.dumps({"pid": 7, "host": "elsewhere", "started": "then"}))
    lock = WorkdirLock(tmp_path)
    note = lock.acquire()
    assert "pid 7 on host elsewhere" in note and "that host cannot be checked from here" in note
    lock.release()


def test_without_kernel_locks_a_live_pid_on_this_host_is_respected(tmp_path, monkeypatch):
    def no_locks(*_):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(workdir_lock.fcntl, "flock", no_locks)
    path = tmp_path / "train.lock"
    path.write_text(json.dumps({"pid": os.getppid(), "host": socket.gethostname(), "started": "then"}))
    with pytest.raises(WorkdirInUseError, match=f"pid {os.getppid()} on host"):
        WorkdirLock(tmp_path).acquire()
    path.write_text(json.dumps({"pid": _dead_pid(), "host": socket.gethostname(), "started": "then"}))
    lock = WorkdirLock(tmp_path)
    assert "this filesystem has no file locks" in lock.acquire()
    assert _record(path)["pid"] == os.getpid()
    lock.release()
    assert path.read_text() == ""


def test_hold_workdir_releases_on_error(tmp_path):
    with pytest.raises(ValueError):
        with hold_workdir(tmp_path):
            with pytest.raises(WorkdirInUseError):
                with hold_workdir(tmp_path):
                    pass
            raise ValueError("the run failed")
    with hold_workdir(tmp_path):  # free again
        pass


# --- train.py, as a user runs it -----------------------------------------------------------------------------

def _train_py(workdir, *extra, expect_ok=True) -> str:
    env = child_env()  # one CPU device: the cheapest compile
    env.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(workdir.parent / "jax_cache"),
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    result = subprocess.run([sys.executable, str(ROOT / "train.py"), f"--workdir={workdir}", *FLAGS, *extra],
                            env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert (result.returncode == 0) == expect_ok, result.stderr[-4000:]
    return result.stderr


def _steps(directory: pathlib.Path) -> list[int]:
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())


def _losses(workdir) -> dict[int, float]:
    lines = [json.loads(x) for x in (pathlib.Path(workdir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in lines if "loss" in r}


def _snapshot(root):
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in pathlib.Path(root).rglob("*") if p.is_file()}


def _flip_a_byte(step_dir: pathlib.Path) -> None:
    largest = max((f for f in (step_dir / "state").rglob("*") if f.is_file() and f.parent.name == "d"),
                  key=lambda f: f.stat().st_size)
    data = bytearray(largest.read_bytes())
    data[len(data) // 2] ^= 0x40
    largest.write_bytes(bytes(data))


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_train_py_faults(tmp_path):
    workdir = tmp_path / "run"
    checkpoints = workdir / "checkpoints"
    workdir.mkdir()
    dead = _dead_pid()
    (workdir / "train.lock").write_text(json.dumps({"pid": dead, "host": socket.gethostname(),
                                                    "started": "2026-01-01T00:00:00+00:00"}))

    # A lock left by a dead run is recovered; keep=0 keeps every checkpoint.
    stderr = _train_py(workdir, "--config.checkpoint.keep=0")
    assert f"recovered the lock left by pid {dead}" in stderr
    assert _steps(checkpoints) == [1, 2, 3, 4, 5, 6, 7, 8]
    first = _losses(workdir)

    # A second run on a busy workdir is refused, names the holder and what to do, and writes nothing.
    before = _snapshot(workdir)
    holder = WorkdirLock(workdir)
    holder.acquire()
    stderr = _train_py(workdir, expect_ok=False)
    holder.release()
    assert re.search(rf"error: workdir {re.escape(str(workdir))} is in use by another training run: "
                     rf"pid {os.getpid()} on host {re.escape(socket.gethostname())}, started ", stderr), stderr[-2000:]
    assert "pass a different --workdir" in stderr
    assert {k: v for k, v in _snapshot(workdir).items() if not k.endswith("train.lock")} == \
        {k: v for k, v in before.items() if not k.endswith("train.lock")}

    # Changed bytes in the latest checkpoint: continuing the run is refused, the array named, the way out given;
    # nothing deleted even though keep=2 is asked for.
    _flip_a_byte(checkpoints / "8")
    before = _snapshot(checkpoints)
    stderr = _train_py(workdir, "--config.checkpoint.keep=2", "--config.train.steps=9", expect_ok=False)
    assert re.search(r"error: checkpoint \S+/checkpoints/8 is damaged: array [\w/]+ (\(and .*\) )?does "
                     r"not match the digest", stderr), stderr[-3000:]
    assert "pass --config.checkpoint.restore_step=N (steps available in " in stderr
    assert ": 1, 2, 3, 4, 5, 6, 7)." in stderr
    assert _snapshot(checkpoints) == before

    # Resuming from step 4 replays exactly the first run's steps 5-8; the newer steps (8 damaged) are set aside,
    # not deleted; keep=2 then applies to the continued run.
    stderr = _train_py(workdir, "--config.checkpoint.keep=2", "--config.checkpoint.restore_step=4")
    assert "moved the newer checkpoints 5, 6, 7, 8 to" in stderr
    [aside] = (workdir / "superseded").iterdir()
    assert _steps(aside) == [5, 6, 7, 8]
    assert _steps(checkpoints) == [7, 8]
    lines = [json.loads(x) for x in (workdir / "metrics.jsonl").read_text().splitlines()]
    resumed = lines.index(next(r for r in lines if r.get("event") == "resume"))
    assert lines[resumed]["step"] == 4
    again = {r["step"]: r["loss"] for r in lines[resumed:] if "loss" in r}
    assert sorted(again) == [5, 6, 7, 8]
    assert all(again[s] == first[s] for s in again), (again, first)  # bitwise: it continued from step 4's state


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_every_process_of_a_multi_host_run_refuses_a_busy_workdir(tmp_path):
    """Two processes share the workdir: process 0 checks the lock and both refuse with its message."""
    holder = WorkdirLock(tmp_path)
    holder.acquire()
    env = child_env()
    env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{_free_port()}", JAX_NUM_PROCESSES="2", JAX_PLATFORMS="cpu",
               PYTHONPATH=str(ROOT))
    procs = [subprocess.Popen([sys.executable, str(ROOT / "train.py"), "--cpu_devices=2", f"--workdir={tmp_path}",
                               *FLAGS], env={**env, "JAX_PROCESS_ID": str(i)}, cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in range(2)]
    outputs = [p.communicate(timeout=300)[1] for p in procs]
    holder.release()
    for p, out in zip(procs, outputs):
        assert p.returncode != 0, out[-3000:]
        assert re.search(rf"error: workdir \S+ is in use by another training run: pid {os.getpid()} on "
                         rf"host ", out), out[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.lock"]  # neither process wrote anything
