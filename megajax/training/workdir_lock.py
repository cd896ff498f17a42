"""One workdir, one writer: an exclusive lock on ``WORKDIR/train.lock`` for the whole training run.

The lock is a kernel ``flock``: the kernel frees it when the holding process exits, however it dies, so a lock
left by a crashed run is simply free again (on NFS the client maps flock to POSIX locks, which the server
arbitrates between hosts). The file also records who holds it (pid, host, start time, command) so a refused run
can say whom it waits for; the record is emptied on release. A free lock with a record left in it means the
holder died; if that holder was another host, that host cannot be checked from here, so the takeover is reported.

With several processes only process 0 takes the lock (they all share the workdir) and broadcasts the outcome, so
every process refuses together.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import json
import os
import pathlib
import socket
import sys
from collections.abc import Iterator

import numpy as np

from megajax.errors import UserError
from megajax.outputs import LOCK_NAME

_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)
_MESSAGE_BYTES = 2048  # room for the refusal message when it is broadcast to the other processes


class WorkdirInUseError(UserError, RuntimeError):
    """Another live run holds the workdir; the message names it and says what to do."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


class WorkdirLock:
    """``acquire()`` / ``release()`` of ``WORKDIR/train.lock`` by this process."""

    def __init__(self, workdir: str | pathlib.Path):
        self.path = pathlib.Path(workdir).expanduser().absolute() / LOCK_NAME
        self.created: list[pathlib.Path] = []  # what acquiring made: the workdir if it was new, else the lock file
        self._file = None
        self._kernel_lock = False

    def _holder(self, f) -> dict | None:
        f.seek(0)
        text = f.read().strip()
        try:
            return json.loads(text) if text else None
        except json.JSONDecodeError:
            return {"pid": "?", "host": "?", "started": "?", "command": f"unreadable record {text[:80]!r}"}

    def _refusal(self, holder: dict | None) -> str:
        who = (f"pid {holder.get('pid')} on host {holder.get('host')}, started {holder.get('started')} "
               f"({holder.get('command', '')})" if holder else "a process that has not recorded itself yet")
        stop = f"stop it (kill {holder.get('pid')} on {holder.get('host')})" if holder else "stop it"
        return (f"workdir {self.path.parent} is in use by another training run: {who}. Two runs cannot share a "
                f"workdir: wait for that run to finish, {stop}, or pass a different --workdir. The lock "
                f"({self.path}) is freed by itself when that process exits.")

    def _lock(self, f) -> bool:
        """Takes the kernel lock; False when the filesystem has none. Raises WorkdirInUseError if it is held."""
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._holder(f)
            f.close()
            raise WorkdirInUseError(self._refusal(holder)) from None
        except OSError as e:
            if e.errno not in _NO_LOCKS:
                f.close()
                raise
            return False
        return True

    def acquire(self) -> str | None:
        """Takes the lock or raises WorkdirInUseError; returns a note when it recovered one left by a dead run."""
        created = [p for p in (self.path.parent, self.path) if not p.exists()][:1]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+")  # never truncate here: a refused run must not erase the holder's record
        self._kernel_lock = self._lock(f)
        previous = self._holder(f)
        if not self._kernel_lock and previous and previous.get("host") == socket.gethostname() \
                and isinstance(previous.get("pid"), int) and _pid_alive(previous["pid"]):
            f.close()
            raise WorkdirInUseError(self._refusal(previous))
        f.seek(0)
        f.truncate()
        f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                            "command": " ".join(sys.argv)[:300]}))
        f.flush()
        self._file = f
        self.created = created
        return self._notes(previous)

    def _notes(self, previous: dict | None) -> str | None:
        notes = [] if self._kernel_lock else [f"{self.path}: this filesystem has no file locks; only a pid on "
                                              "this host can be checked"]
        if previous:
            notes.append(f"{self.path}: recovered the lock left by pid {previous.get('pid')} on host "
                         f"{previous.get('host')} (started {previous.get('started')}), which ended without "
                         "releasing it")
            if previous.get("host") != socket.gethostname():
                notes.append("that host cannot be checked from here: if that run is still alive there, this "
                             "filesystem does not share locks between hosts; stop one of the two")
        return "; ".join(notes) or None

    def release(self) -> None:
        """Empties the record and frees the lock (the file stays: deleting it would race with a new holder)."""
        if self._file is None:
            return
        self._file.seek(0)
        self._file.truncate()
        self._file.flush()
        if self._kernel_lock:
            fcntl.flock(self._file, fcntl.LOCK_UN)
        self._file.close()
        self._file = None


def _agree(message: str | None) -> str | None:
    """Process 0's refusal (or None) on every process; free for a single process."""
    import jax

    if jax.process_count() == 1:
        return message
    from jax.experimental import multihost_utils

    encoded = (message or "").encode()[:_MESSAGE_BYTES]
    buffer = np.zeros(_MESSAGE_BYTES, np.uint8)
    buffer[:len(encoded)] = np.frombuffer(encoded, np.uint8)
    shared = np.asarray(multihost_utils.broadcast_one_to_all(buffer))
    return bytes(shared).rstrip(b"\0").decode(errors="replace") or None


@contextlib.contextmanager
def hold_workdir(workdir: str | pathlib.Path) -> Iterator[list[pathlib.Path]]:
    """Holds the workdir for the ``with`` body (process 0 locks; every process refuses together); yields what
    taking it created (the workdir, or the lock file; nothing on other processes)."""
    import jax

    lock = WorkdirLock(workdir) if jax.process_index() == 0 else None
    refusal = None
    if lock:
        try:
            note = lock.acquire()
            if note:
                print(f"note: {note}", file=sys.stderr)
        except (WorkdirInUseError, OSError) as e:
            refusal = (str(e) if isinstance(e, WorkdirInUseError)
                       else f"cannot lock workdir {workdir}: {e}; pass a --workdir this user can write")
    try:
        refusal = _agree(refusal)
        if refusal:
            raise WorkdirInUseError(refusal)
        yield lock.created if lock else []
    finally:
        if lock:
            lock.release()
