"""``eval.py --task=sft``: a fine-tuned decoder on held-out prompt / completion (or chat) JSONL rows, read, rendered
and packed as training reads them (``megajax.data.sft``): the loss over the completions' tokens (the training
loss's token-weighted mean) and the exact-match rate of greedy answers (each prompt extended until its completion's
length; a match is every id of the completion, the end-of-document id included). Bad rows are skipped and
over-long examples cut as the checkpoint's run trained (its ``data.sft_skip_bad_rows`` / ``data.sft_truncate``)
unless ``--sft_skip_bad_rows`` / ``--sft_truncate`` (or their ``--no-`` forms) say otherwise."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from megajax.config import StoredRun
from megajax.data.sft import Example, pack, read_examples
from megajax.data.tokenizer import TextTokenizer
from megajax.data.tokenizer_folder import ChatTemplate, read_chat_template
from megajax.evaluation import inputs
from megajax.evaluation.evaluator import Evaluator
from megajax.evaluation.generate import Sampling, generate
from megajax.evaluation.registry import EvalTask, Loaded, Request, register
from megajax.models.objectives import documents
from megajax.parallel.losses import vocab_parallel_cross_entropy


@dataclasses.dataclass(frozen=True)
class SFTInput:
    """The held-out file's examples, its path, the tokenizer that encoded them, whether over-long ones are cut,
    the rows skipped and the chat template's file."""

    examples: list[Example]
    path: str
    tokenizer: TextTokenizer
    truncate: bool
    skipped: int
    chat_template: str


def flag(name: str) -> str:
    """How eval.py spells a row-reading option (``--sft_truncate``)."""
    return f"--{name}"


@dataclasses.dataclass(frozen=True)
class RowReading:
    """How a held-out fine-tuning file is read: the tokenizer, its chat template, whether bad rows are skipped and
    over-long ones cut (as the checkpoint's run trained, unless the flags say otherwise), and the file's name in
    messages."""

    tokenizer: TextTokenizer
    template: ChatTemplate
    skip: bool
    truncate: bool
    what: str


def row_reading(stored: StoredRun, request: Request, task: str, rows: str) -> RowReading:
    """``RowReading`` of ``request.data`` for ``--task=task`` (``rows``: what its rows hold, for the message)."""
    if not request.data:
        raise inputs.InputError(f"--task={task} needs --data=FILE.jsonl ({rows})")
    tok = inputs.tokenizer_for(stored, request.tokenizer)
    inputs.check_tokenizer(tok, stored)
    trained = stored.dataset
    skip = trained.sft_skip_bad_rows if request.sft_skip_bad_rows is None else request.sft_skip_bad_rows
    truncate = trained.sft_truncate if request.sft_truncate is None else request.sft_truncate
    return RowReading(tok, read_chat_template(tok.source), skip, truncate, f"--data={request.data}")


def _read(stored: StoredRun, request: Request) -> SFTInput:
    reading = row_reading(stored, request, "sft", "prompt / completion or chat rows")
    tok, template, truncate, what = reading.tokenizer, reading.template, reading.truncate, reading.what
    examples, skipped = read_examples(request.data, tok, template, reading.skip, what, flag)
    if not examples:
        raise inputs.InputError(f"{what} holds no example ({len(skipped)} rows skipped)")
    pack(examples, stored.model.max_seq_len, tok.eod_id, True, truncate, what, flag)  # refuses what does not fit
    return SFTInput(examples, request.data, tok, truncate, len(skipped), template.source)


def _row_sums(model, batch) -> dict:
    """Each row's summed completion-token loss and its counted tokens."""
    tokens = batch["tokens"]
    nll = vocab_parallel_cross_entropy(model(tokens[:, :-1], **documents(batch)), tokens[:, 1:])
    weights = batch["loss_weights"]
    return {"nll": (nll * weights).sum(-1), "tokens": weights.sum(-1)}


def _run(loaded: Loaded, task_input: SFTInput, request: Request) -> dict:
    rows = pack(task_input.examples, loaded.seq_len, task_input.tokenizer.eod_id, True, task_input.truncate)
    evaluate, state = Evaluator.of(loaded.model, _row_sums, loaded.mesh, loaded.rules)
    sums = evaluate.map_rows(state, {k: jnp.asarray(v) for k, v in rows.fields.items()}, request.batch_size)
    tokens = float(np.sum(sums["tokens"]))
    matches = 0
    by_length: dict[int, list[Example]] = {}  # one generation per prompt length: the rows of a call align
    for ex in task_input.examples:
        by_length.setdefault(len(ex.prompt), []).append(ex)
    for length, group in by_length.items():
        new = max(len(ex.completion) for ex in group)
        if length == 0 or length + new > loaded.seq_len:
            continue  # nothing to condition on, or no room: counted as a miss
        prompt = np.asarray([ex.prompt for ex in group], np.int32)
        out = generate(loaded.model, loaded.mesh, loaded.rules, prompt, new, Sampling(greedy=True))
        matches += sum(list(row[length:length + len(ex.completion)]) == list(ex.completion)
                       for row, ex in zip(out, group))
    return {"task": "sft", "data": task_input.path, "examples": len(task_input.examples),
            "loss": float(np.sum(sums["nll"])) / max(tokens, 1.0), "tokens": int(tokens),
            "exact_match": matches / len(task_input.examples), "truncated": rows.truncated,
            "skipped": task_input.skipped, "chat_template": task_input.chat_template}


register(EvalTask("sft", _read, _run, sft_rows=True))
