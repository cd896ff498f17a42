"""The evaluation tasks behind eval.py, on inputs already read and checked (``inputs.py``): each returns a
JSON-ready dict of results."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

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
