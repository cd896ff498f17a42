"""The evaluation tasks behind eval.py, on inputs already read and checked (``inputs.py``): each returns a
JSON-ready dict of results."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np

from megajax.evaluation.evaluator import Evaluator, objective_metrics
from megajax.evaluation.inputs import WikiText
from megajax.evaluation.scoring import Scorer, cloze_rows, sliding_windows, stream_log_likelihood


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
