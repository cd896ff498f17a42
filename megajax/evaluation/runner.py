"""eval.py's library side: check the inputs against the checkpoint, load it on a mesh, run a task, write JSON."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

import jax

from megajax.config import StoredRun
from megajax.config.load import inference_config, read_stored_run, restore_model
from megajax.errors import ShardingConfigError
from megajax.evaluation import (  # noqa: F401 - they register eval.py's tasks
    downstream_tasks,
    dpo_task,
    inputs,
    sft_task,
    tasks,
)
from megajax.evaluation.generate import Sampling
from megajax.evaluation.registry import EVAL_TASKS, EvalTask, Loaded, Request, names_where
from megajax.models import eval_task_models
from megajax.outputs import Kind, OutputPathError, claim_file, write_json
from megajax.parallel.mesh import MeshShape

TASKS = tuple(eval_task_models())  # every model's eval tasks (models/: each spec lists its own), all registered


def task_named(task: str) -> EvalTask:
    """The eval task ``task``; InputError naming the choices otherwise."""
    if task not in TASKS:
        raise inputs.InputError(f"--task={task!r}; choose one of {TASKS}")
    return EVAL_TASKS[task]


def resolve_stride(task: str, stride: int | None, seq_len: int) -> int | None:
    """The sliding-window stride ``task`` uses (``EvalTask.stride``): as given, else the paper's 32 (at most
    ``seq_len``) for wikitext103 and ``seq_len`` (non-overlapping windows) for ppl; None for tasks without
    windows."""
    return task_named(task).stride(stride, seq_len)


def read_inputs(task: str, stored: StoredRun, *, data: str | None, prompt: str | None, tokenizer: str | None,
                stride: int | None, batch_size: int, max_new_tokens: int, sampling: Sampling) -> tuple[Any, Request]:
    """(task input, the request with its stride resolved): everything a task needs from disk, checked against the
    checkpoint's model and training data (``stored``: ``config.load.read_stored_run``) so that mistakes fail here,
    before the model is loaded or anything is compiled."""
    return _read(task_named(task), stored, Request(data, prompt, tokenizer, stride, batch_size, max_new_tokens,
                                                   sampling))


def _read(task: EvalTask, stored: StoredRun, request: Request) -> tuple[Any, Request]:
    inputs.check_model_kind(task.name, stored)
    if request.batch_size < 1:
        raise inputs.InputError(f"--batch_size={request.batch_size}: must be >= 1")
    request = dataclasses.replace(request, stride=task.stride(request.stride, stored.model.max_seq_len))
    return task.read(stored, request), request


def run(checkpoint: str, task: str, *, data: str | None = None, prompt: str | None = None,
        tokenizer: str | None = None, mesh_data: int | None = None, mesh_model: int | None = None,
        mesh_expert: int | None = None,
        batch_size: int = 8, stride: int | None = None, max_new_tokens: int = 64, sampling: Sampling | None = None,
        seed: int = 0, output: str | None = None, predictions: str | None = None,
        null_score_diff_threshold: float | None = None, overwrite: bool = False,
        sft_skip_bad_rows: bool | None = None, sft_truncate: bool | None = None, reference: str | None = None,
        dpo_loss: str | None = None, dpo_beta: float | None = None, dpo_label_smoothing: float | None = None) -> dict:
    """Runs ``task`` on ``checkpoint``; prints and (with ``output``) writes the JSON results.

    ``stride`` (wikitext103 and ppl only): windows start every ``stride`` tokens and each window after the first
    scores its last ``stride`` targets (Megatron-LM's overlapping evaluation); default 32 (the paper's, at most
    max_seq_len) for wikitext103 and max_seq_len (non-overlapping) for ppl. The results report the stride used.
    ``predictions`` (fine-tuning tasks only): also write each example's prediction there as JSON: SQuAD's official
    ``{question id: answer text}`` ("" = no answer; squad2 also writes its null odds beside it, named in the results'
    ``null_odds_file``), other tasks per split (id -> label or option letter). ``null_score_diff_threshold``
    (squad2, default 0): answer "" where the null odds exceed it. ``sft_skip_bad_rows`` / ``sft_truncate``
    (``--task=sft``, ``dpo``; None: as the checkpoint's run trained): skip bad rows, cut over-long examples.
    ``reference`` (``--task=dpo``): the frozen reference checkpoint; ``dpo_loss`` / ``dpo_beta`` /
    ``dpo_label_smoothing`` the preference loss (None: TRL's sigmoid, 0.1, 0). The output
    files go where ``megajax.outputs.claim_file`` allows (never on or in an input, a checkpoint or a dataset; an
    existing results file only with ``overwrite``). Input mistakes raise ``InputError`` before the model is loaded.
    """
    request = Request(data, prompt, tokenizer, stride, batch_size, max_new_tokens, sampling or Sampling(), seed,
                      null_score_diff_threshold, predictions, sft_skip_bad_rows, sft_truncate, reference, dpo_loss,
                      dpo_beta, dpo_label_smoothing)
    try:
        MeshShape(-1 if mesh_data is None else mesh_data, 1 if mesh_model is None else mesh_model,
                  expert=1 if mesh_expert is None else mesh_expert)  # its degrees checked before any input is read
        chosen = task_named(task)
        if predictions and not chosen.predictions:
            raise inputs.InputError(f"--predictions applies to --task={'|'.join(names_where(_predicts))}")
        if null_score_diff_threshold is not None and not chosen.null_threshold:
            takes = " or ".join(names_where(lambda t: t.null_threshold))
            raise inputs.InputError(f"--null_score_diff_threshold applies to --task={takes}")
        for flag, value in (("sft_skip_bad_rows", sft_skip_bad_rows), ("sft_truncate", sft_truncate)):
            if value is not None and not chosen.sft_rows:
                raise inputs.InputError(f"--{flag} applies to --task={' or '.join(names_where(lambda t: t.sft_rows))}")
        given = {"reference": reference, "dpo_loss": dpo_loss, "dpo_beta": dpo_beta,
                 "dpo_label_smoothing": dpo_label_smoothing}
        for flag, value in given.items():
            if value is not None and not chosen.reference:
                raise inputs.InputError(f"--{flag} applies to --task={' or '.join(names_where(lambda t: t.reference))}")
        stored = read_stored_run(checkpoint)  # its model and training data, for every check below
        # what the task reads: the flags', and the data the checkpoint was trained on (a task's default data)
        trained_on = stored.dataset
        _claim_outputs(output, predictions, chosen, overwrite, read=[checkpoint, data, tokenizer, trained_on.path,
                                                                     trained_on.task_dir, trained_on.tokenizer,
                                                                     reference])
        task_input, request = _read(chosen, stored, request)
    except inputs.InputError:
        raise
    except (ValueError, FileNotFoundError) as e:  # from reading the checkpoint's config or a tokenizer
        raise inputs.InputError(str(e)) from e
    try:
        model, spec, mesh = restore_model(checkpoint, inference_config(checkpoint, mesh_data, mesh_model,
                                                                       mesh_expert))
    except ShardingConfigError as e:  # a --mesh these devices cannot hold
        n = jax.device_count()
        raise inputs.InputError(f"{e}; pass --mesh=DATAxMODEL with DATA x MODEL = {n} (the devices here), or "
                                f"leave --mesh out to use them all (e.g. --mesh={n}x1)") from None
    loaded = Loaded(model, mesh, spec.rules, spec.model_spec.objective, spec.model.max_seq_len)
    result = chosen.run(loaded, task_input, request)
    result.update(checkpoint=str(checkpoint), mesh=spec.mesh.spelling)
    if not chosen.streams:
        print(json.dumps(result, indent=1))
    if output:
        write_json(output, result)
        print(f"wrote {output}", file=sys.stderr)
    return result


def _predicts(task: EvalTask) -> bool:
    return task.predictions


def _claim_outputs(output: str | None, predictions: str | None, task: EvalTask, overwrite: bool,
                   read: list[str | None]) -> None:
    """Every file this evaluation will write, checked before any work (``megajax.outputs.claim_file``): the
    results, the predictions and what the task writes beside them (squad2's null odds), each a different file."""
    files = [("output", output, None), ("predictions", predictions, None)]
    if predictions:
        files += [("predictions", path, label) for path, label in task.extra_files(predictions)]
    claimed = {}
    for flag, path, label in files:
        kind = Kind.RESULTS if flag == "output" else Kind.PREDICTIONS
        where = claim_file(path, flag=flag, inputs=read, overwrite=overwrite, label=label, kind=kind)
        real = where and os.path.realpath(where)
        if real in claimed:
            raise OutputPathError(f"{label or f'--{flag}={path}'} is also where {claimed[real]} goes; give each "
                                  "output its own file")
        if real:
            claimed[real] = label or f"--{flag}"
