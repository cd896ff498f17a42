"""SQuAD exact match and F1, written from the official evaluation's definitions (v1.1 and v2.0 agree on answerable
questions).

An answer is normalised by lower-casing, removing punctuation, removing the articles a / an / the and collapsing
whitespace. EM is 1 when the normalised prediction equals a normalised gold answer; F1 is the harmonic mean of the
precision and recall of the prediction's tokens against a gold answer's (bag-of-words overlap); both take the
maximum over the gold answers. A question without gold answers (2.0, or whose answers all normalise to nothing)
has the single gold answer "", so it scores 1 exactly when the prediction is empty. Scores are percentages.

For SQuAD 2.0 each question also has a no-answer score (``SpanPrediction.null_margin``): at threshold t the
prediction is empty where the score exceeds t. ``squad_scores`` reports EM / F1 at t = 0 and, as the official
script's best_exact / best_f1, the best EM and the best F1 over all thresholds with the thresholds that give them.
"""

from __future__ import annotations

import collections
import re
import string
from collections.abc import Mapping, Sequence

import numpy as np

from megajax.data.tasks.squad import SquadExample

ARTICLES = re.compile(r"\b(a|an|the)\b")
PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces."""
    text = "".join(c for c in text.lower() if c not in PUNCTUATION)
    return " ".join(ARTICLES.sub(" ", text).split())


def exact_match(gold: str, prediction: str) -> float:
    return float(normalize_answer(gold) == normalize_answer(prediction))


def f1(gold: str, prediction: str) -> float:
    """Token-overlap F1 of the normalised answers; 1 if both are empty, 0 if only one is."""
    gold_tokens, predicted = normalize_answer(gold).split(), normalize_answer(prediction).split()
    if not gold_tokens or not predicted:
        return float(gold_tokens == predicted)
    same = sum((collections.Counter(gold_tokens) & collections.Counter(predicted)).values())
    if not same:
        return 0.0
    precision, recall = same / len(predicted), same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def gold_answers(example: SquadExample) -> list[str]:
    """The answers an example is scored against: its answer texts that normalise to something, else [""]."""
    return [a.text for a in example.answers if normalize_answer(a.text)] or [""]


def raw_scores(examples: Sequence[SquadExample], answers: Mapping[str, str]) -> tuple[np.ndarray, np.ndarray]:
    """(EM, F1) per example, in [0, 1], each the maximum over the example's gold answers."""
    missing = [e.qid for e in examples if e.qid not in answers]
    if missing:
        raise ValueError(f"{len(missing)} questions have no prediction (first: {missing[0]!r})")
    golds = [gold_answers(e) for e in examples]
    exact = [max(exact_match(g, answers[e.qid]) for g in gold) for e, gold in zip(examples, golds)]
    overlap = [max(f1(g, answers[e.qid]) for g in gold) for e, gold in zip(examples, golds)]
    return np.asarray(exact), np.asarray(overlap)


def best_threshold(scores: np.ndarray, margins: np.ndarray, answered: np.ndarray,
                   has_answer: np.ndarray) -> tuple[float, float]:
    """(best mean score in %, threshold) over all thresholds t. At t a question keeps its prediction where
    ``answered`` (the prediction is not empty) and ``margin <= t`` and scores ``scores``; otherwise it predicts
    no answer and scores 1 without a gold answer, else 0. As the official find_best_thresh, the lowest threshold
    with the best score; but questions with equal margins switch together (the official loop, one question at a
    time, can report a score inside such a group that no threshold gives), and when no threshold beats answering
    nothing the threshold returned lies below every margin (the official 0.0 need not give that score)."""
    base = (~has_answer).astype(np.float64)  # the score of predicting no answer
    gain = np.where(answered, scores, base) - base
    order = np.argsort(margins, kind="stable")
    totals = base.sum() + np.cumsum(gain[order])
    last_of_tie = np.r_[margins[order][1:] != margins[order][:-1], True]
    candidates = np.flatnonzero(last_of_tie)
    best = candidates[np.argmax(totals[candidates])]  # the first (lowest) threshold with the best total
    if totals[best] <= base.sum():
        return 100.0 * base.sum() / len(scores), float(margins.min()) - 1.0
    return 100.0 * totals[best] / len(scores), float(margins[order][best])


def squad_scores(examples: Sequence[SquadExample], answers: Mapping[str, str],
                 null_margins: Mapping[str, float] | None = None) -> dict[str, float]:
    """EM and F1 (%) of ``answers`` (question id -> text). SQuAD 1.1: ``exact``, ``f1``, ``total``. SQuAD 2.0
    (``null_margins`` given, question id -> no-answer score; ``answers`` then the best non-empty spans, e.g.
    ``answers_at(predictions, None)``): ``exact`` / ``f1`` at threshold 0 with their ``HasAns_*`` / ``NoAns_*``
    parts, ``best_exact`` / ``best_exact_thresh``, ``best_f1`` / ``best_f1_thresh`` and
    ``exact_at_best_f1_thresh`` (EM with the threshold that maximises F1)."""
    if not examples:
        raise ValueError("no questions to score")
    if null_margins is None:
        exact, overlap = raw_scores(examples, answers)
        return {"exact": 100.0 * exact.mean(), "f1": 100.0 * overlap.mean(), "total": len(examples)}
    missing = [e.qid for e in examples if e.qid not in null_margins]
    if missing:
        raise ValueError(f"{len(missing)} questions have no null margin (first: {missing[0]!r})")
    margins = np.asarray([null_margins[e.qid] for e in examples], np.float64)
    has_answer = np.asarray([bool(e.answers) for e in examples])
    exact, overlap = raw_scores(examples, answers)
    answered = np.asarray([answers[e.qid] != "" for e in examples])
    out = {"total": len(examples)}
    for name, raw in (("exact", exact), ("f1", overlap)):
        at_zero = np.where(answered & (margins <= 0), raw, (~has_answer).astype(np.float64))
        out[name] = 100.0 * at_zero.mean()
        for part, mask in (("HasAns", has_answer), ("NoAns", ~has_answer)):
            if mask.any():
                out[f"{part}_{name}"] = 100.0 * at_zero[mask].mean()
                out[f"{part}_total"] = int(mask.sum())
        out[f"best_{name}"], out[f"best_{name}_thresh"] = best_threshold(raw, margins, answered, has_answer)
    keep = answered & (margins <= out["best_f1_thresh"])
    out["exact_at_best_f1_thresh"] = 100.0 * np.where(keep, exact, (~has_answer).astype(np.float64)).mean()
    return out
