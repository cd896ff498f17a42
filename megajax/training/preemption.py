"""Stop cleanly on SIGTERM / SIGINT: finish the current step, save a checkpoint, exit.

With several processes the decision must be collective (a checkpoint save is), so they agree through JAX's
preemption sync point; a single process just checks the flag its signal handler set.
"""

from __future__ import annotations

import signal
import threading

import jax


class StopRequest:
    """``should_stop(step)`` turns True once a stop signal arrived (on every process at the same step)."""

    def __init__(self):
        self._flag = threading.Event()
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
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
