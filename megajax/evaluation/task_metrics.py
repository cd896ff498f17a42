"""Classification metrics for MNLI, QQP and RACE, as percentages; ``valid`` (1 = a real row) drops padding rows."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from megajax.data.tasks.race import LEVELS, ChoiceExample


def _real(predictions: np.ndarray, labels: np.ndarray, valid: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    predictions, labels = np.asarray(predictions), np.asarray(labels)
    if predictions.shape != labels.shape:
        raise ValueError(f"predictions {predictions.shape} and labels {labels.shape} differ in shape")
    if valid is not None:
        keep = np.asarray(valid).astype(bool)
        predictions, labels = predictions[keep], labels[keep]
    if not len(labels):
        raise ValueError("no rows to score")
    return predictions, labels


def accuracy(predictions: np.ndarray, labels: np.ndarray, valid: np.ndarray | None = None) -> float:
    """Percent of rows whose predicted class is the label."""
    predictions, labels = _real(predictions, labels, valid)
    return 100.0 * float(np.mean(predictions == labels))


def positive_f1(predictions: np.ndarray, labels: np.ndarray, valid: np.ndarray | None = None,
                positive: int = 1) -> float:
    """F1 (%) of the ``positive`` class (QQP: duplicates): 2 TP / (2 TP + FP + FN); 0 when there is no positive
    row, predicted or gold."""
    predictions, labels = _real(predictions, labels, valid)
    tp = np.sum((predictions == positive) & (labels == positive))
    wrong = np.sum((predictions == positive) != (labels == positive))  # FP + FN
    return 100.0 * float(2 * tp / (2 * tp + wrong)) if tp + wrong else 0.0


def race_accuracy(predictions: np.ndarray, examples: Sequence[ChoiceExample]) -> dict[str, float]:
    """Accuracy (%) on the middle and high school questions present, and on all (``predictions`` in example
    order, padding already removed)."""
    predictions = np.asarray(predictions)  # a list would not take the per-level boolean index below
    labels = np.asarray([e.label for e in examples])
    levels = np.asarray([e.level for e in examples])
    if predictions.shape != labels.shape:
        raise ValueError(f"{predictions.shape} predictions for {len(examples)} RACE questions")
    out = {level: accuracy(predictions[levels == level], labels[levels == level])
           for level in LEVELS if np.any(levels == level)}
    out["all"] = accuracy(predictions, labels)
    return out
