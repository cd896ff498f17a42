"""SQuAD exact match and F1 exactly as the official scripts evaluate-v1.1.py and evaluate-v2.0.py compute them on a
predictions file (question id -> answer text) and, for 2.0, a no-answer-odds file (``--na-prob-file``), written
here from their published definitions.

An answer is normalised by lower-casing, removing punctuation, removing the articles a / an / the and collapsing
whitespace. EM is 1 when the normalised prediction equals a normalised gold answer; F1 is the harmonic mean of the
precision and recall of the prediction's tokens against a gold answer's (bag-of-words overlap); both take the
maximum over the gold answers. Scores are percentages. Where the two scripts differ:

- v1.1 scores against every listed answer text, and its F1 is 0 whenever prediction and gold share no token, two
  empty answers included;
- v2.0 drops gold answers that normalise to nothing, uses the single gold "" when none remain (so an empty
  prediction scores 1), and its F1 of two empty answers is 1. A question is answerable when the file lists answers.

For 2.0 each question also has its no-answer odds (``SpanPrediction.null_margin``, the null score minus the best
span's). ``exact`` / ``f1`` replace the score of every question whose odds exceed ``na_prob_thresh`` (the script's
default 1.0) by 1 if it is unanswerable, else 0. ``best_exact`` / ``best_f1`` sweep the questions in increasing
odds (file order on ties) from "no answer everywhere", adding one question at a time: an answerable one adds its
score, an unanswerable one -1 if its prediction is a non-empty string (even one that normalises to nothing) else 0;
the best running total and the odds of the question that first reached it are reported (0.0 when no prefix beats
"no answer everywhere"), as the script does.

A question without a prediction scores 0 and is named on stderr with the script's message. (evaluate-v2.0.py
itself stops with a KeyError on such a file after that message, so there is no official figure to match.)
"""

from __future__ import annotations

import collections
import re
import string
import sys
from collections.abc import Mapping, Sequence

from megajax.data.tasks.squad import SquadExample

ARTICLES = re.compile(r"\b(a|an|the)\b")
PUNCTUATION = frozenset(string.punctuation)
NA_PROB_THRESH = 1.0  # evaluate-v2.0.py's --na-prob-thresh default


def normalize_answer(text: str) -> str:
    """Lower case, no punctuation, no articles, single spaces."""
    text = "".join(c for c in text.lower() if c not in PUNCTUATION)
    return " ".join(ARTICLES.sub(" ", text).split())


def exact_match(gold: str, prediction: str) -> float:
    """1.0 when the normalised answers are equal, else 0.0 (both scripts)."""
    return float(normalize_answer(gold) == normalize_answer(prediction))


def _overlap_f1(gold_tokens: list[str], predicted: list[str]) -> float:
    same = sum((collections.Counter(gold_tokens) & collections.Counter(predicted)).values())
    if not same:
        return 0.0
    precision, recall = same / len(predicted), same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def f1(gold: str, prediction: str) -> float:
    """evaluate-v2.0.py's token-overlap F1 of the normalised answers: 1 if both are empty, 0 if only one is."""
    gold_tokens, predicted = normalize_answer(gold).split(), normalize_answer(prediction).split()
    if not gold_tokens or not predicted:
        return float(gold_tokens == predicted)
    return _overlap_f1(gold_tokens, predicted)


def f1_v1(gold: str, prediction: str) -> float:
    """evaluate-v1.1.py's token-overlap F1: 0 when no token is shared, also when both answers are empty."""
    return _overlap_f1(normalize_answer(gold).split(), normalize_answer(prediction).split())


def gold_answers(example: SquadExample) -> list[str]:
    """The answers v2.0 scores an example against: its listed texts that normalise to something, else [""]."""
    return [text for text in example.gold_texts if normalize_answer(text)] or [""]


def _missing(examples: Sequence[SquadExample], answers: Mapping[str, str], message: str) -> set[str]:
    missing = {e.qid for e in examples if e.qid not in answers}
    for e in examples:
        if e.qid in missing:
            print(message.format(e.qid), file=sys.stderr)
    return missing


def squad1_scores(examples: Sequence[SquadExample], answers: Mapping[str, str]) -> dict[str, float]:
    """evaluate-v1.1.py's figures: ``exact`` (its ``exact_match``) and ``f1`` in %, and ``total`` questions. A
    question without gold answers (none in SQuAD 1.1; the script cannot score one) is scored against ""."""
    if not examples:
        raise ValueError("no questions to score")
    missing = _missing(examples, answers, "Unanswered question {} will receive score 0.")
    exact = overlap = 0.0
    for e in examples:
        if e.qid in missing:
            continue
        golds = e.gold_texts or [""]
        exact += max(exact_match(g, answers[e.qid]) for g in golds)
        overlap += max(f1_v1(g, answers[e.qid]) for g in golds)
    return {"exact": 100.0 * exact / len(examples), "f1": 100.0 * overlap / len(examples), "total": len(examples)}


def _best_threshold(order: list[int], base: float, scores: list[float], answerable: list[bool],
                    answered: list[bool], odds: list[float], present: list[bool]) -> tuple[float, float, int]:
    """(best running total, its threshold, how many questions of ``order`` it answers): the sweep of the module
    docstring."""
    total = best = base
    threshold, length = 0.0, 0
    for n, i in enumerate(order, 1):
        if not present[i]:
            continue
        total += scores[i] if answerable[i] else (-1 if answered[i] else 0)
        if total > best:
            best, threshold, length = total, odds[i], n
    return best, threshold, length


def squad2_scores(examples: Sequence[SquadExample], answers: Mapping[str, str], null_odds: Mapping[str, float],
                  na_prob_thresh: float = NA_PROB_THRESH) -> dict[str, float]:
    """evaluate-v2.0.py's figures for the predictions file ``answers`` (question id -> text as written, "" = no
    answer) with ``null_odds`` as its --na-prob-file: ``exact``, ``f1``, ``total``, ``HasAns_*`` / ``NoAns_*``
    (``exact``, ``f1``, ``total`` over the answerable / unanswerable questions, each when there are any),
    ``best_exact`` / ``best_exact_thresh``, ``best_f1`` / ``best_f1_thresh`` (module docstring), and besides
    ``exact_at_best_f1_thresh`` (EM with the questions that ``best_f1`` answers)."""
    if not examples:
        raise ValueError("no questions to score")
    missing = _missing(examples, answers, "Missing prediction for {}")
    present = [e.qid not in missing for e in examples]
    lacking = [e.qid for e, p in zip(examples, present) if p and e.qid not in null_odds]
    if lacking:
        raise ValueError(f"{len(lacking)} questions have no null odds (first: {lacking[0]!r})")
    answerable = [bool(e.gold_texts) for e in examples]
    odds = [float(null_odds[e.qid]) if p else 0.0 for e, p in zip(examples, present)]
    raw = {"exact": [], "f1": []}
    for e, p in zip(examples, present):
        golds, prediction = gold_answers(e), answers.get(e.qid, "")
        raw["exact"].append(max(exact_match(g, prediction) for g in golds) if p else 0.0)
        raw["f1"].append(max(f1(g, prediction) for g in golds) if p else 0.0)
    # a question whose odds exceed the threshold counts as predicted "no answer"
    kept = {name: [(float(not a) if o > na_prob_thresh else s) if p else 0.0
                   for s, a, o, p in zip(scores, answerable, odds, present)] for name, scores in raw.items()}
    out = {"exact": 100.0 * sum(kept["exact"]) / len(examples), "f1": 100.0 * sum(kept["f1"]) / len(examples),
           "total": len(examples)}
    for part, wanted in (("HasAns", True), ("NoAns", False)):
        mine = [i for i, a in enumerate(answerable) if a == wanted]
        if mine:
            for name in ("exact", "f1"):
                out[f"{part}_{name}"] = 100.0 * sum(kept[name][i] for i in mine) / len(mine)
            out[f"{part}_total"] = len(mine)
    order = sorted(range(len(examples)), key=lambda i: odds[i])  # stable: file order on ties
    answered = [bool(answers.get(e.qid, "")) for e in examples]  # the raw string: "the" is an answer here
    base = sum(1 for a, p in zip(answerable, present) if p and not a)
    for name, scores in raw.items():
        best, threshold, length = _best_threshold(order, base, scores, answerable, answered, odds, present)
        out[f"best_{name}"], out[f"best_{name}_thresh"] = 100.0 * best / len(examples), threshold
        if name == "f1":
            exact = base + sum((raw["exact"][i] if answerable[i] else (-1 if answered[i] else 0))
                               for i in order[:length] if present[i])
            out["exact_at_best_f1_thresh"] = 100.0 * exact / len(examples)
    return out


def squad_scores(examples: Sequence[SquadExample], answers: Mapping[str, str],
                 null_odds: Mapping[str, float] | None = None) -> dict[str, float]:
    """evaluate-v1.1.py's figures (``squad1_scores``) or, with ``null_odds``, evaluate-v2.0.py's with that
    --na-prob-file (``squad2_scores``), of the predictions file ``answers`` (question id -> answer text)."""
    if null_odds is None:
        return squad1_scores(examples, answers)
    return squad2_scores(examples, answers, null_odds)
