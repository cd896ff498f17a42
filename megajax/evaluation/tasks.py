"""eval.py's language-model tasks (wikitext103, lambada, ppl, generate) and BERT's mlm, registered with
``registry``: each reads and checks its inputs (``inputs.py``) before the model is loaded, then returns a JSON-ready
dict of results."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np

from megajax.config import StoredRun
from megajax.evaluation import inputs
from megajax.evaluation.evaluator import Evaluator, objective_metrics
from megajax.evaluation.generate import check_generation, generate
from megajax.evaluation.inputs import PAPER_STRIDE, InputError, WikiText
from megajax.evaluation.registry import EvalTask, Loaded, Request, register
from megajax.evaluation.scoring import Scorer, cloze_rows, sliding_windows, stream_log_likelihood
from megajax.parallel.sharding import batch_shards


def _windowed_nll(scorer: Scorer, tokens: np.ndarray, stride: int, desc: str) -> tuple[float, int]:
    """(summed NLL, scored targets) over overlapping windows, with a progress bar on a terminal."""
    import sys

    from tqdm import tqdm

    if len(tokens) < 2:
        raise ValueError(f"{desc}: {len(tokens)} token(s); at least 2 are needed to score one")
    bar = tqdm(total=len(sliding_windows(len(tokens), scorer.seq_len, stride)), desc=desc,
               disable=not sys.stderr.isatty())
    nll, count = stream_log_likelihood(scorer, tokens, stride, bar.update)
    bar.close()
    return nll, count


def wikitext103(scorer: Scorer, text: WikiText, stride: int) -> dict:
    """Perplexity per subword token and adjusted by WikiText's own token count T_o (paper Eq. 4)."""
    nll, count = _windowed_nll(scorer, text.tokens, stride, "wikitext103")
    return {"task": "wikitext103", "data": text.path, "seq_len": scorer.seq_len, "stride": stride,
            "subword_tokens": int(len(text.tokens)), "original_tokens": text.original_tokens,
            "scored_targets": count, "loss": nll / count, "ppl": math.exp(nll / count),
            "adjusted_ppl": math.exp(nll / text.original_tokens)}


def lambada(scorer: Scorer, examples: Sequence[tuple[Sequence[int], Sequence[int]]]) -> dict:
    """Cloze accuracy: every subword of the last word predicted (teacher-forced); and the last-subword variant."""
    if not examples:
        raise ValueError("lambada: no examples")
    rows = [cloze_rows(context, target, scorer.seq_len) for context, target in examples]
    inputs, labels, mask = (np.stack(x) for x in zip(*rows))
    _, hit = scorer(inputs, labels)
    whole = np.all(hit | ~mask, axis=1)
    last = np.array([hit[i, np.nonzero(mask[i])[0][-1]] for i in range(len(examples))])
    return {"task": "lambada", "examples": len(examples), "accuracy": float(whole.mean()),
            "last_subword_accuracy": float(last.mean()),
            "note": "accuracy: all subwords of the last word correct (the paper's metric); last_subword_accuracy: "
                    "only the final subword, teacher-forced (looser)"}


def perplexity(scorer: Scorer, tokens: np.ndarray, stride: int, data: str) -> dict:
    """Loss and perplexity over a whole preprocessed token file (``data`` only names it in the results)."""
    nll, count = _windowed_nll(scorer, np.asarray(tokens), stride, "ppl")
    return {"task": "ppl", "data": str(data), "seq_len": scorer.seq_len, "stride": stride, "scored_targets": count,
            "loss": nll / count, "ppl": math.exp(nll / count)}


def mlm(model, mesh, rules, objective, batches, num_batches: int) -> dict:
    """Masked-LM loss and accuracy and sentence-order accuracy over ``num_batches`` deterministic BERT batches
    (masked-token metrics weighted by masked tokens, SOP by sequences); ``objective``: the model's (MLM + SOP)."""
    evaluate, state = Evaluator.of(model, objective_metrics(objective), mesh, rules)
    sums = {"mlm_nll": 0.0, "mlm_hits": 0.0, "masked": 0.0, "sop_hits": 0.0, "sequences": 0}
    for step in range(num_batches):
        batch = batches.batch(step)
        m = jax.device_get(evaluate(state, batch))
        masked = float(batch["mlm_weights"].sum())
        sums["mlm_nll"] += float(m["mlm_loss"]) * masked
        sums["mlm_hits"] += float(m["mlm_accuracy"]) * masked
        sums["masked"] += masked
        sums["sop_hits"] += float(m["sop_accuracy"]) * len(batch["sop_labels"])
        sums["sequences"] += len(batch["sop_labels"])
    loss = sums["mlm_nll"] / sums["masked"]
    return {"task": "mlm", "sequences": sums["sequences"], "masked_tokens": int(sums["masked"]),
            "mlm_loss": loss, "mlm_ppl": math.exp(loss), "mlm_accuracy": sums["mlm_hits"] / sums["masked"],
            "sop_accuracy": sums["sop_hits"] / sums["sequences"]}


def _data(task: str, request: Request) -> str:
    if not request.data:
        raise InputError(f"--task={task} needs --data")
    return request.data


def _checked_tokenizer(stored: StoredRun, request: Request):
    """The tokenizer given, else the checkpoint's training data's, checked against the model."""
    tok = inputs.tokenizer_for(stored, request.tokenizer)
    inputs.check_tokenizer(tok, stored)
    return tok


def _given_tokenizer_is_the_models(stored: StoredRun, request: Request) -> None:
    """mlm and ppl read token ids already: a tokenizer given is only checked to be the model's."""
    if request.tokenizer:
        inputs.check_tokenizer(inputs.tokenizer_for(stored, request.tokenizer), stored)


def _scorer(loaded: Loaded, request: Request) -> Scorer:
    return Scorer(loaded.model, loaded.mesh, loaded.rules, request.batch_size, loaded.seq_len)


def _read_wikitext(stored: StoredRun, request: Request) -> WikiText:
    data = _data("wikitext103", request)
    return inputs.read_wikitext(data, _checked_tokenizer(stored, request))


def _read_lambada(stored: StoredRun, request: Request):
    data = _data("lambada", request)
    return inputs.read_lambada(data, _checked_tokenizer(stored, request), stored.model.max_seq_len)


def _read_ppl(stored: StoredRun, request: Request) -> np.ndarray:
    data = _data("ppl", request)
    _given_tokenizer_is_the_models(stored, request)
    return inputs.read_token_file(data, stored)


def _read_mlm(stored: StoredRun, request: Request):
    _given_tokenizer_is_the_models(stored, request)
    return inputs.bert_eval_batches(stored, request.data, request.batch_size)


def _run_mlm(loaded: Loaded, task_input, request: Request) -> dict:
    """One pass over the evaluation sentence pairs (masking fixed by the data seed), at least one batch."""
    batches, where = task_input
    shards = batch_shards(loaded.mesh, loaded.rules)
    if batches.global_batch % shards:
        raise InputError(f"--batch_size={batches.global_batch} is not a multiple of the mesh's data axis "
                         f"({shards})")
    result = mlm(loaded.model, loaded.mesh, loaded.rules, loaded.objective, batches,
                 max(len(batches) // batches.global_batch, 1))
    result["data"] = where
    return result


def _read_prompt(stored: StoredRun, request: Request):
    tok = _checked_tokenizer(stored, request)
    ids = np.asarray([tok.encode_batch([request.prompt or ""])[0] or [tok.eod_id]], np.int32)
    check_generation(request.sampling, ids.shape[1], request.max_new_tokens, stored.model.max_seq_len,
                     stored.model.vocab_size)
    return ids, tok


def _run_generate(loaded: Loaded, task_input, request: Request) -> dict:
    """Prints the prompt and each new token as it comes; the results hold the continuation."""
    ids, tok = task_input
    print(request.prompt or "", end="", flush=True)
    stream = lambda col: print(tok.decode([int(col[0])]), end="", flush=True)  # noqa: E731
    out = generate(loaded.model, loaded.mesh, loaded.rules, ids, request.max_new_tokens, request.sampling,
                   seed=request.seed, on_token=stream)
    print()
    return {"task": "generate", "prompt": request.prompt, "text": tok.decode(out[0, ids.shape[1]:].tolist())}


register(EvalTask("wikitext103", _read_wikitext,
                  lambda loaded, text, request: wikitext103(_scorer(loaded, request), text, request.stride),
                  default_stride=lambda seq_len: min(PAPER_STRIDE, seq_len)))
register(EvalTask("lambada", _read_lambada,
                  lambda loaded, examples, request: lambada(_scorer(loaded, request), examples)))
register(EvalTask("ppl", _read_ppl,
                  lambda loaded, tokens, request: perplexity(_scorer(loaded, request), tokens, request.stride,
                                                             request.data),
                  default_stride=lambda seq_len: seq_len))  # non-overlapping windows
register(EvalTask("mlm", _read_mlm, _run_mlm))
register(EvalTask("generate", _read_prompt, _run_generate, streams=True))
