"""Stop cleanly on SIGTERM / SIGINT: finish the current step, save a checkpoint, exit with the signal's status.

With several processes the decision must be collective (a checkpoint save is), so they agree through JAX's
preemption sync point; a single process just checks the flag its signal handler set.
"""

from __future__ import annotations

import signal
import threading

import jax

from megajax.errors import UserError


class TrainingStopped(UserError):
    """A stop signal ended training before ``train.steps``, after saving a checkpoint; ``exit_status`` is the
    shell's for a process that the signal ended (128 + its number: 143 for SIGTERM, 130 for SIGINT), so a
    scheduler or a ``train.py && eval.py`` chain sees an unfinished run."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum
        self.exit_status = 128 + signum


class StopRequest:
    """``should_stop(step)`` turns True once a stop signal arrived (on every process at the same step)."""

    def __init__(self):
        self._flag = threading.Event()
        self.signum = signal.SIGTERM  # the one received (another process's, with several: reported as SIGTERM)
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        self.signum = signum
        self._flag.set()

    def should_stop(self, step: int) -> bool:
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            local = self._flag.is_set() or multihost_utils.reached_preemption_sync_point(step)
            return bool(multihost_utils.process_allgather(local).any())
        return self._flag.is_set()

    def restore_handlers(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
