"""The answer to a SQuAD question from the start / end logits of all its windows.

A span (s, e) of a window scores ``start[s] + end[e]``; it is allowed when both ends are context positions,
``e >= s``, it is at most ``max_answer_length`` tokens long, and the window is the one where the token at ``s``
has the most context (BERT's rule for tokens that several windows share: the largest
``min(tokens left, tokens right) + 0.01 * window length``). With ``n_best`` only the ``n_best`` highest start
logits and end logits among the allowed positions are candidates (BERT's search); ``n_best=None`` searches every
allowed pair. The answer is the best allowed span over all windows, cut from the context by the tokens'
character offsets. For SQuAD 2.0 the null score is ``start[0] + end[0]`` ([CLS]), the minimum over the windows.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from megajax.data.tasks.squad import SquadFeatures


@dataclasses.dataclass(frozen=True)
class SpanPrediction:
    """The best span of a question: its text (empty when no window allows one), score (-inf then), where it was
    found (feature index and sequence positions, -1 when none) and the question's null score."""

    text: str
    score: float
    null_score: float
    feature: int
    start: int
    end: int

    @property
    def null_margin(self) -> float:
        """``null_score - score``: the no-answer score (the official script's na_prob); above a threshold the
        prediction is no answer."""
        return self.null_score - self.score


def max_context(window_start: np.ndarray, window_length: np.ndarray, context_position: np.ndarray,
                seq_len: int) -> np.ndarray:
    """(W, S) bool for one question's windows: the positions whose token has its most context in that window
    (the first such window on ties)."""
    num_tokens = int(np.max(window_start + window_length))
    token = np.arange(num_tokens)
    left = token[None, :] - window_start[:, None]
    right = (window_start + window_length - 1)[:, None] - token[None, :]
    score = np.where((left >= 0) & (right >= 0), np.minimum(left, right) + 0.01 * window_length[:, None], -np.inf)
    best = np.argmax(score, axis=0)  # (T,) the window each token belongs to
    out = np.zeros((len(window_start), seq_len), bool)
    for w in range(len(window_start)):
        mine = token[(best == w) & (left[w] >= 0) & (right[w] >= 0)]
        out[w, context_position[w] + mine - window_start[w]] = True
    return out


def _top(logits: np.ndarray, allowed: np.ndarray, n_best: int | None) -> np.ndarray:
    """``allowed`` narrowed to the ``n_best`` highest logits among it (earlier positions first on ties)."""
    if n_best is None or allowed.sum() <= n_best:
        return allowed
    ranked = np.flatnonzero(allowed)[np.argsort(-logits[allowed], kind="stable")[:n_best]]
    out = np.zeros_like(allowed)
    out[ranked] = True
    return out


def best_span(start_logits: np.ndarray, end_logits: np.ndarray, start_allowed: np.ndarray, end_allowed: np.ndarray,
              max_answer_length: int, n_best: int | None) -> tuple[float, int, int] | None:
    """(score, start, end) of the best allowed span of one window (the shortest, then the earliest, on ties), or
    None when no span is allowed."""
    n = len(start_logits)
    starts, ends = _top(start_logits, start_allowed, n_best), _top(end_logits, end_allowed, n_best)
    extra = np.arange(max_answer_length)[:, None]  # row d: spans of d + 1 tokens
    end = np.arange(n)[None, :] + extra
    inside = end < n
    end = np.where(inside, end, 0)
    ok = inside & starts[None, :] & ends[end]
    if not ok.any():
        return None
    score = np.where(ok, start_logits[None, :] + end_logits[end], -np.inf)
    d, s = np.unravel_index(np.argmax(score), score.shape)
    return float(score[d, s]), int(s), int(s + d)


def decode_squad(features: SquadFeatures, start_logits: np.ndarray, end_logits: np.ndarray, *,
                 max_answer_length: int = 30, n_best: int | None = 20) -> dict[str, SpanPrediction]:
    """The best span of every question (module docstring), keyed by question id. ``start_logits`` /
    ``end_logits``: (F, S), one row per feature of ``features`` in order."""
    shape = (len(features), features.task.inputs.seq_len)
    if start_logits.shape != shape or end_logits.shape != shape:
        raise ValueError(f"start/end logits have shapes {start_logits.shape} / {end_logits.shape}; the features "
                         f"need {shape}")
    if max_answer_length < 1 or (n_best is not None and n_best < 1):
        raise ValueError(f"max_answer_length={max_answer_length} and n_best={n_best} must be >= 1")
    start_logits, end_logits = np.asarray(start_logits, np.float64), np.asarray(end_logits, np.float64)
    bounds = np.flatnonzero(np.diff(features.example_index)) + 1
    out = {}
    for group in np.split(np.arange(len(features)), bounds):
        example = features.examples[features.example_index[group[0]]]
        starts_ok = max_context(features.window_start[group], features.window_length[group],
                                features.context_position[group], shape[1])
        best = (-np.inf, -1, -1, -1)  # score, feature, start, end
        for f, start_ok in zip(group, starts_ok):
            found = best_span(start_logits[f], end_logits[f], start_ok, features.context_mask(f), max_answer_length,
                              n_best)
            if found is not None and found[0] > best[0]:
                best = (found[0], int(f), found[1], found[2])
        score, f, s, e = best
        text = ""
        if f >= 0:
            offsets = features.position_offsets(f)
            text = example.context[offsets[s, 0]:offsets[e, 1]]
        null = float(np.min(start_logits[group, 0] + end_logits[group, 0]))
        out[example.qid] = SpanPrediction(text, score, null, f, s, e)
    return out


def answers_at(predictions: dict[str, SpanPrediction], threshold: float | None) -> dict[str, str]:
    """The answer texts: no answer ("") where ``null_margin > threshold`` (BERT's null_score_diff_threshold);
    ``threshold=None`` always answers (SQuAD 1.1)."""
    return {qid: "" if threshold is not None and p.null_margin > threshold else p.text
            for qid, p in predictions.items()}


def null_odds(predictions: dict[str, SpanPrediction]) -> dict[str, float]:
    """Each question's ``null_margin`` (inf when no span is allowed), in question order: the no-answer odds file
    that evaluate-v2.0.py reads as --na-prob-file (BERT's null_odds.json)."""
    return {qid: float(p.null_margin) for qid, p in predictions.items()}
