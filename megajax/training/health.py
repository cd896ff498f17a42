"""Stop a run whose loss goes non-finite before it can harm a checkpoint.

The step applies no update when its loss or gradient norm is inf/nan and flags it. The loop hands every step's
flag to ``NonFiniteGuard`` without waiting for it, and calls ``check`` before each save and log: the flags are
read then (one host sync per log or save, not per step), and more than ``max_nonfinite_steps`` consecutive bad
steps raise ``TrainingDiverged`` naming the first bad step and the last good checkpoint.
"""

from __future__ import annotations

import jax

from megajax.errors import UserError


class TrainingDiverged(UserError, RuntimeError):
    """The loss or gradient norm stayed non-finite; nothing was saved from the bad state."""


class NonFiniteGuard:
    """Counts consecutive non-finite steps from the step's ``nonfinite`` metric."""

    def __init__(self, max_nonfinite_steps: int, checkpointer=None):
        self.tolerance = max_nonfinite_steps
        self.checkpointer = checkpointer
        self.pending: list[tuple[int, dict]] = []  # (step, device metrics) not read yet
        self.run_length, self.first_bad = 0, None

    def add(self, step: int, metrics: dict) -> None:
        self.pending.append((step, {k: metrics[k] for k in ("nonfinite", "loss", "grad_norm")}))

    def check(self) -> None:
        """Reads the pending flags; raises TrainingDiverged past the tolerance."""
        pending, self.pending = jax.device_get(self.pending), []
        for step, m in pending:
            if not int(m["nonfinite"]):
                self.run_length, self.first_bad = 0, None
                continue
            self.run_length += 1
            self.first_bad = self.first_bad or (step, float(m["loss"]), float(m["grad_norm"]))
            if self.run_length > self.tolerance:
                raise TrainingDiverged(self._message(step))

    def _message(self, step: int) -> str:
        first, loss, norm = self.first_bad
        last_good = self.checkpointer.latest_step() if self.checkpointer is not None else None
        where = (f"the last good checkpoint is step {last_good} in {self.checkpointer.directory} (re-running the same "
                 "command resumes from it)" if last_good is not None else "no checkpoint was saved yet")
        return (f"training stopped at step {step}: the loss or gradient norm has not been finite since step {first} "
                f"(loss={loss}, grad_norm={norm}; {self.run_length} consecutive step(s), more than "
                f"train.max_nonfinite_steps={self.tolerance}). Those updates were not applied and nothing was saved "
                f"from that state; {where}. Lower optimizer.lr (or raise optimizer.warmup_steps), check the data, or "
                "set --config.train.max_nonfinite_steps=N to skip isolated bad steps.")
