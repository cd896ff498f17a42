"""eval.py's tasks as registered objects, as models are specs: a task says how it reads and checks its inputs
(before the model is loaded), how it runs on the loaded model, and what else it takes or writes. ``runner.py``
asks the task and never compares its name; the modules that define tasks (``tasks.py``, ``downstream_tasks.py``)
register them on import."""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Callable
from typing import Any

import jax

from megajax.config import StoredRun
from megajax.evaluation.generate import Sampling
from megajax.evaluation.inputs import InputError
from megajax.evaluation.scoring import check_stride


@dataclasses.dataclass(frozen=True)
class Request:
    """What eval.py was asked besides the checkpoint and the task (each task reads the flags that apply to it)."""

    data: str | None = None
    prompt: str | None = None
    tokenizer: str | None = None
    stride: int | None = None
    batch_size: int = 8
    max_new_tokens: int = 64
    sampling: Sampling = dataclasses.field(default_factory=Sampling)
    seed: int = 0
    null_score_diff_threshold: float | None = None
    predictions: str | None = None  # where to write each example's prediction (tasks with ``predictions``)
    # fine-tuning rows (tasks with ``sft_rows``): skip bad rows, cut over-long examples; None: as the run trained
    sft_skip_bad_rows: bool | None = None
    sft_truncate: bool | None = None
    # preference pairs (tasks with ``reference``): the frozen reference checkpoint, the loss (None: TRL's defaults)
    reference: str | None = None
    dpo_loss: str | None = None
    dpo_beta: float | None = None
    dpo_label_smoothing: float | None = None


@dataclasses.dataclass(frozen=True)
class Loaded:
    """The checkpoint's model restored on a mesh, with its sharding rules and its maximum sequence length."""

    model: Any
    mesh: jax.sharding.Mesh
    rules: Any
    objective: Any  # the model's training objective (its spec's)
    seq_len: int


@dataclasses.dataclass(frozen=True)
class EvalTask:
    """One ``eval.py --task``.

    ``read(stored, request)`` reads and checks everything the task needs from disk against the checkpoint's
    ``StoredRun`` (its model and training data) and returns the task's input (raising ``inputs.InputError`` for a
    mistake); ``run(loaded, input, request)`` returns the JSON-ready results (and writes ``request.predictions``).
    ``default_stride(seq_len)``: the sliding windows' default stride, for tasks that score windows (None: the task
    takes no ``--stride``).
    ``predictions``: the task writes ``--predictions``, and ``extra_files(path)`` names (path, what it is) of the
    files it writes beside it. ``null_threshold``: it takes ``--null_score_diff_threshold``. ``sft_rows``: it reads
    fine-tuning rows and takes ``--sft_skip_bad_rows`` / ``--sft_truncate``. ``streams``: it prints its own output
    as it goes, and its results are not printed as JSON. ``reference``: it compares the checkpoint with a
    ``--reference`` one and takes the ``--dpo_*`` flags.
    """

    name: str
    read: Callable[[StoredRun, Request], Any]
    run: Callable[[Loaded, Any, Request], dict]
    default_stride: Callable[[int], int] | None = None
    predictions: bool = False
    extra_files: Callable[[str | pathlib.Path], list[tuple[pathlib.Path, str]]] = lambda path: []
    null_threshold: bool = False
    sft_rows: bool = False
    streams: bool = False
    reference: bool = False

    def stride(self, given: int | None, seq_len: int) -> int | None:
        """The sliding-window stride the task uses: as given, else its default; None for tasks without windows
        (where a stride given is refused)."""
        if self.default_stride is None:
            if given is not None:
                windowed = names_where(lambda task: task.default_stride is not None)
                raise InputError(f"--stride applies to --task={' or '.join(windowed)}, not --task={self.name}")
            return None
        stride = self.default_stride(seq_len) if given is None else given
        try:
            check_stride(stride, seq_len)
        except ValueError as e:
            raise InputError(str(e)) from None
        return stride


EVAL_TASKS: dict[str, EvalTask] = {}


def register(task: EvalTask) -> EvalTask:
    """Adds ``task`` to ``EVAL_TASKS`` (a name registered twice is a bug in the defining modules)."""
    if task.name in EVAL_TASKS:
        raise ValueError(f"eval task {task.name!r} is registered twice")
    EVAL_TASKS[task.name] = task
    return task


def names_where(predicate: Callable[[EvalTask], bool]) -> tuple[str, ...]:
    """The registered tasks for which ``predicate`` holds, in registration order (for messages)."""
    return tuple(name for name, task in EVAL_TASKS.items() if predicate(task))
