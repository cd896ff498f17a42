"""eval.py's library side: check the inputs against the checkpoint, load it on a mesh, run a task, write JSON."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import jax
import ml_collections
import numpy as np

from megajax.checkpoint import read_config
from megajax.config.load import inference_config, restore_model
from megajax.data.tokenizer import TextTokenizer
from megajax.errors import ShardingConfigError
from megajax.evaluation import downstream_tasks, inputs, tasks
from megajax.evaluation.generate import Sampling, check_generation, generate
from megajax.evaluation.scoring import Scorer
from megajax.models import eval_task_models
from megajax.outputs import Kind, OutputPathError, claim_file, write_json

TASKS = tuple(eval_task_models())  # every model's eval tasks (models/: each spec lists its own)


def read_inputs(task: str, config: ml_collections.ConfigDict, *, data: str | None, prompt: str | None,
                tokenizer: str | None, stride: int | None, batch_size: int, max_new_tokens: int,
                sampling: Sampling) -> tuple[Any, TextTokenizer | None, int | None]:
    """(task input, tokenizer, stride): everything a task needs from disk, checked against the checkpoint's model
    (``config``) so that mistakes fail here, before the model is loaded or anything is compiled."""
    if task not in TASKS:
        raise inputs.InputError(f"--task={task!r}; choose one of {TASKS}")
    inputs.check_model_kind(task, config)
    if batch_size < 1:
        raise inputs.InputError(f"--batch_size={batch_size}: must be >= 1")
    vocab_size, seq_len = config.model.vocab_size, config.model.max_seq_len
    stride = inputs.resolve_stride(task, stride, seq_len)
    if task in downstream_tasks.DOWNSTREAM_TASKS:
        return downstream_tasks.read_splits(task, config, data, tokenizer), None, None
    if task not in ("generate", "mlm") and not data:
        raise inputs.InputError(f"--task={task} needs --data")
    if task in ("mlm", "ppl") and tokenizer:  # their data is token ids already: a tokenizer given must be the model's
        inputs.check_tokenizer(inputs.tokenizer_for(config, tokenizer), config)
    if task == "mlm":
        return inputs.bert_eval_batches(config, data, batch_size), None, None
    if task == "ppl":
        return inputs.read_token_file(data, config), None, stride
    tok = inputs.tokenizer_for(config, tokenizer)
    inputs.check_tokenizer(tok, config)
    if task == "wikitext103":
        return inputs.read_wikitext(data, tok), tok, stride
    if task == "lambada":
        return inputs.read_lambada(data, tok, seq_len), tok, stride
    ids = np.asarray([tok.encode_batch([prompt or ""])[0] or [tok.eod_id]], np.int32)
    check_generation(sampling, ids.shape[1], max_new_tokens, seq_len, vocab_size)
    return ids, tok, stride


def _mlm(model, mesh, rules, objective, batches, where: str) -> dict:
    """One pass over the evaluation sentence pairs (masking fixed by the data seed), at least one batch."""
    if batches.global_batch % mesh.shape["data"]:
        raise inputs.InputError(f"--batch_size={batches.global_batch} is not a multiple of the mesh's data axis "
                                f"({mesh.shape['data']})")
    result = tasks.mlm(model, mesh, rules, objective, batches, max(len(batches) // batches.global_batch, 1))
    result["data"] = where
    return result


def run(checkpoint: str, task: str, *, data: str | None = None, prompt: str | None = None,
        tokenizer: str | None = None, mesh_data: int | None = None, mesh_model: int | None = None,
        batch_size: int = 8, stride: int | None = None, max_new_tokens: int = 64, sampling: Sampling | None = None,
        seed: int = 0, output: str | None = None, predictions: str | None = None,
        null_score_diff_threshold: float | None = None, overwrite: bool = False) -> dict:
    """Runs ``task`` on ``checkpoint``; prints and (with ``output``) writes the JSON results.

    ``stride`` (wikitext103 and ppl only): windows start every ``stride`` tokens and each window after the first
    scores its last ``stride`` targets (Megatron-LM's overlapping evaluation); default 32 (the paper's, at most
    max_seq_len) for wikitext103 and max_seq_len (non-overlapping) for ppl. The results report the stride used.
    ``predictions`` (fine-tuning tasks only): also write each example's prediction there as JSON: SQuAD's official
    ``{question id: answer text}`` ("" = no answer; squad2 also writes its null odds beside it, named in the results'
    ``null_odds_file``), other tasks per split (id -> label or option letter). ``null_score_diff_threshold``
    (squad2, default 0): answer "" where the null odds exceed it. The output files go where
    ``megajax.outputs.claim_file`` allows (never on or in an input, a checkpoint or a dataset; an existing results
    file only with ``overwrite``). Input mistakes raise ``InputError`` before the model is loaded.
    """
    sampling = sampling or Sampling()
    try:
        if predictions and task not in downstream_tasks.DOWNSTREAM_TASKS:
            raise inputs.InputError(f"--predictions applies to --task={'|'.join(downstream_tasks.DOWNSTREAM_TASKS)}")
        if null_score_diff_threshold is not None and task != "squad2":
            raise inputs.InputError("--null_score_diff_threshold applies to --task=squad2")
        config = read_config(checkpoint)
        # what the task reads: the flags', and the data the checkpoint was trained on (a task's default data)
        _claim_outputs(output, predictions, task, overwrite, read=[checkpoint, data, tokenizer, config.data.path,
                                                                   config.data.task_dir, config.data.tokenizer])
        task_input, tok, stride = read_inputs(task, config, data=data, prompt=prompt, tokenizer=tokenizer,
                                              stride=stride, batch_size=batch_size, max_new_tokens=max_new_tokens,
                                              sampling=sampling)
    except inputs.InputError:
        raise
    except (ValueError, FileNotFoundError) as e:  # from reading the checkpoint's config or a tokenizer
        raise inputs.InputError(str(e)) from e
    try:
        model, spec, mesh = restore_model(checkpoint, inference_config(checkpoint, mesh_data, mesh_model))
    except ShardingConfigError as e:  # a --mesh these devices cannot hold
        n = jax.device_count()
        raise inputs.InputError(f"{e}; pass --mesh=DATAxMODEL with DATA x MODEL = {n} (the devices here), or "
                                f"leave --mesh out to use them all (e.g. --mesh={n}x1)") from None
    rules = spec.rules
    if task == "mlm":
        result = _mlm(model, mesh, rules, spec.model_spec.objective, *task_input)
    elif task in downstream_tasks.DOWNSTREAM_TASKS:
        result, predicted, odds = downstream_tasks.evaluate(model, mesh, rules, task, task_input, batch_size,
                                                            null_score_diff_threshold or 0.0)
        if predictions:
            result.update(downstream_tasks.write_predictions(predictions, task, predicted, odds))
    elif task == "generate":
        print(prompt or "", end="", flush=True)
        stream = lambda col: print(tok.decode([int(col[0])]), end="", flush=True)  # noqa: E731
        out = generate(model, mesh, rules, task_input, max_new_tokens, sampling, seed=seed, on_token=stream)
        print()
        result = {"task": "generate", "prompt": prompt,
                  "text": tok.decode(out[0, task_input.shape[1]:].tolist())}
    else:
        scorer = Scorer(model, mesh, rules, batch_size, spec.model.max_seq_len)
        if task == "wikitext103":
            result = tasks.wikitext103(scorer, task_input, stride)
        elif task == "lambada":
            result = tasks.lambada(scorer, task_input)
        else:
            result = tasks.perplexity(scorer, task_input, stride, data)
    result.update(checkpoint=str(checkpoint), mesh=f"{mesh.shape['data']}x{mesh.shape['model']}")
    if task != "generate":
        print(json.dumps(result, indent=1))
    if output:
        write_json(output, result)
        print(f"wrote {output}", file=sys.stderr)
    return result


def _claim_outputs(output: str | None, predictions: str | None, task: str, overwrite: bool,
                   read: list[str | None]) -> None:
    """Every file this evaluation will write, checked before any work (``megajax.outputs.claim_file``): the
    results, the predictions and squad2's null odds beside them, each a different file."""
    files = [("output", output, None), ("predictions", predictions, None)]
    if predictions and task == "squad2":
        odds = downstream_tasks.null_odds_path(predictions)
        files.append(("predictions", odds, f"squad2's null odds file {odds} (beside --predictions)"))
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
