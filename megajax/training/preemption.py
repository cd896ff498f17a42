"""Stop cleanly on SIGTERM / SIGINT: finish the current step, save a checkpoint, exit with the signal's status.

With several processes the decision must be collective (a checkpoint save is), so they agree through JAX's
preemption sync point; a single process just checks the flag its signal handler set.
"""

from __future__ import annotations

import signal
import threading

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
    """``should_stop(step)`` turns True once a stop signal arrived (on every process at the same step).

    One per process at a time (``watch``): ``train.py`` starts watching before anything heavy is imported, so a
    signal during start-up or compilation is recorded too (Python's default SIGINT would raise KeyboardInterrupt
    wherever it lands, inside jax's C++ callbacks included), and ``train`` reads it at its next check."""

    _current: StopRequest | None = None

    def __init__(self):
        self._flag = threading.Event()
        self.signum = signal.SIGTERM  # the one received (another process's, with several: reported as SIGTERM)
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)

    @classmethod
    def watch(cls, received: list[int] | tuple[int, ...] = ()) -> StopRequest:
        """The process's watcher, started if none is; ``received``: signals a caller's own earlier handler recorded
        (train.py's, installed before even this module is imported)."""
        if cls._current is None:
            cls._current = cls()
        for signum in received:
            cls._current._handle(signum, None)
        return cls._current

    def _handle(self, signum, frame) -> None:
        self.signum = signum
        self._flag.set()

    # jax is imported where it is used: train.py imports this module first, before anything heavy
    def check(self, when: str) -> None:
        """Raises TrainingStopped if a stop signal arrived (``when``: what did not happen, e.g. "before the first
        step"); with one process only (several agree at a step, in ``should_stop``)."""
        import jax

        if self._flag.is_set() and jax.process_count() == 1:
            name = signal.Signals(self.signum).name
            raise TrainingStopped(f"stopped by {name} {when}: nothing was saved; run the same command to start "
                                  "again", self.signum)

    def should_stop(self, step: int) -> bool:
        import jax

        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            local = self._flag.is_set() or multihost_utils.reached_preemption_sync_point(step)
            return bool(multihost_utils.process_allgather(local).any())
        return self._flag.is_set()

    def restore_handlers(self) -> None:
        """Stops watching: the handlers there were before (for a library caller of ``train``)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        if StopRequest._current is self:
            StopRequest._current = None
