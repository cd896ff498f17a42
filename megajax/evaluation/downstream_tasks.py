"""eval.py's fine-tuning tasks (paper Table 5): a fine-tuned task model's metrics on the task's dev files.

``read_splits`` reads and encodes the evaluation files before the model is loaded (mistakes fail first);
``evaluate`` runs the model over every row once (fixed-size batches, the last padded) and scores each split:

| task | files (in ``--data``, default the run's ``data.task_dir``) | metrics (%) |
| --- | --- | --- |
| mnli | ``dev_matched.tsv``, ``dev_mismatched.tsv`` | accuracy per split (the paper's m / mm) |
| qqp | ``dev.tsv`` | accuracy, F1 of the duplicate class |
| squad1 | ``dev-v1.1.json`` | evaluate-v1.1.py's exact match, F1 |
| squad2 | ``dev-v2.0.json`` | evaluate-v2.0.py's figures with the null odds as --na-prob-file |
| race | ``dev/``, ``test/`` (each with ``middle/``, ``high/``) | accuracy on middle, high and all, per split |

``--data`` may also name one file (or one RACE split folder); it is then the only split, named after it.

The predictions file (``write_predictions``): for SQuAD the official format, ``{question id: answer text}`` (SQuAD
evaluates one file), so the official scripts score it as is; for squad2 the null odds (null score minus the best
span's score) go beside it, ``NAME.null_odds.json``, and the answer is "" where they exceed the null threshold (BERT
run_squad.py's null_score_diff_threshold, default 0). The SQuAD figures are the official scripts' on these files
(``squad_metrics``). Other tasks write ``{split: {id: prediction}}`` with the files' own ids (MNLI's index, QQP's
id, RACE's article id and question index). Each split's results also count what its reader left out or found broken:
QQP's skipped rows, SQuAD's questions whose answer is not at its answer_start (all are scored, as officially).
"""

from __future__ import annotations

import dataclasses
import pathlib
import sys
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from megajax.data.tasks import glue, race, squad
from megajax.data.tasks.encoding import EncodedTask
from megajax.data.tasks.files import TaskDataError
from megajax.data.tasks.glue import MNLI_LABELS, QQP_LABELS
from megajax.data.tasks.task_data import TASK_CLASSES
from megajax.data.tokenizer import load_tokenizer
from megajax.evaluation import task_metrics as metrics
from megajax.evaluation.evaluator import Evaluator
from megajax.evaluation.inputs import InputError, check_tokenizer
from megajax.evaluation.squad_decode import answers_at, decode_squad, null_odds
from megajax.evaluation.squad_metrics import squad1_scores, squad2_scores
from megajax.models.objectives import PAIR_FIELDS
from megajax.outputs import write_json

DOWNSTREAM_TASKS = ("mnli", "qqp", "squad1", "squad2", "race")
DEV_FILES = {"mnli": {"matched": "dev_matched.tsv", "mismatched": "dev_mismatched.tsv"}, "qqp": {"dev": "dev.tsv"},
             "squad1": {"dev": "dev-v1.1.json"}, "squad2": {"dev": "dev-v2.0.json"},
             "race": {"dev": "dev", "test": "test"}}
MAX_ANSWER_LENGTH = 30  # SQuAD: answer tokens at most (BERT's and Megatron's default)
OPTION_LETTERS = "ABCD"


@dataclasses.dataclass(frozen=True)
class Split:
    """One evaluation file, encoded: ``rows`` (the model's inputs and targets) and what scoring needs besides:
    ``ids`` (one per example, for the predictions file), RACE's ``examples`` or SQuAD's ``features``; ``counts``:
    what the reader left out or found broken, for the results."""

    name: str
    path: pathlib.Path
    rows: EncodedTask
    ids: list[str]
    extra: Any = None
    counts: dict = dataclasses.field(default_factory=dict)


def check_classes(task: str, config: ml_collections.ConfigDict) -> None:
    """Raises InputError when a classification task's classes differ from the checkpoint's classifier's."""
    classes = TASK_CLASSES.get(task, 0)
    if classes and config.model.num_classes != classes:
        raise InputError(f"--task={task} has {classes} classes but this checkpoint's classifier has "
                         f"{config.model.num_classes} (it was fine-tuned on data.task={config.data.task!r})")


def _split_paths(task: str, data: pathlib.Path) -> list[tuple[str, pathlib.Path]]:
    if task == "race" and ((data / "middle").is_dir() or (data / "high").is_dir()):
        return [(data.name, data)]  # one split folder
    if data.is_file():
        return [(data.stem, data)]
    if not data.is_dir():
        raise InputError(f"--data={data} does not exist; give the folder holding "
                         f"{', '.join(DEV_FILES[task].values())}, or one of those files")
    found = [(name, data / f) for name, f in DEV_FILES[task].items() if (data / f).exists()]
    if not found:
        raise InputError(f"--data={data} holds none of {', '.join(DEV_FILES[task].values())} (--task={task}); give "
                         "the task's folder as downloaded, or one evaluation file")
    return found


def read_splits(task: str, config: ml_collections.ConfigDict, data: str | None,
                tokenizer: str | None) -> list[Split]:
    """Every evaluation split of ``task`` (the checkpoint's model already checked to be the task's), encoded to
    the model's ``max_seq_len`` with its tokenizer (``--tokenizer``, else the run's ``data.tokenizer``). Raises
    InputError for a missing or unreadable input."""
    check_classes(task, config)
    where = data or config.data.task_dir
    if not where:
        raise InputError(f"--task={task} needs --data (the folder holding {', '.join(DEV_FILES[task].values())}); "
                         "this checkpoint does not name its task_dir")
    vocab = tokenizer or config.data.tokenizer
    if not vocab:
        raise InputError("this checkpoint does not name its tokenizer; pass --tokenizer=PATH (the model's vocab.txt "
                         "or tokenizer.json)")
    try:
        tok = load_tokenizer(pathlib.Path(vocab).expanduser())
    except (OSError, ValueError) as e:
        given = "--tokenizer" if tokenizer else "the run's data.tokenizer"
        raise InputError(f"{given}={vocab}: {e}; pass --tokenizer=PATH") from e
    check_tokenizer(tok, config)
    seq, out = config.model.max_seq_len, []
    try:
        for name, path in _split_paths(task, pathlib.Path(where).expanduser()):
            label = f"{task}/{name}"
            if task in ("mnli", "qqp"):
                pairs = (glue.read_mnli if task == "mnli" else glue.read_qqp)(path)
                rows = glue.featurize_pairs(pairs.examples, tok, seq, label)
                counts = {k: v for k, v in pairs.report().items() if k != "examples"} if task == "qqp" else {}
                out.append(Split(name, path, rows, [e.guid for e in pairs.examples], counts=counts))
            elif task == "race":
                examples = race.read_race(path)
                out.append(Split(name, path, race.featurize_race(examples, tok, seq, label),
                                 [e.qid for e in examples], examples))
            else:
                squad_data = squad.read_squad(path)
                if task == "squad2" and not squad_data.version_2:
                    print(f"note: {path} has no is_impossible field (a SQuAD 1.1 file?)", flush=True)
                features = squad.featurize_squad(squad_data.examples, tok, seq, training=False, name=label)
                counts = {k: v for k, v in features.report().items() if k.startswith("broken_offset")}
                out.append(Split(name, path, features.task, [e.qid for e in features.examples], features, counts))
    except InputError:
        raise
    except (TaskDataError, FileNotFoundError) as e:
        raise InputError(str(e)) from e
    except ValueError as e:  # a sequence too short for the task's rows, a tokenizer without [CLS]/[SEP]
        raise InputError(f"--task={task}: {e}") from e
    return out


def predict(model, mesh, rules, rows: EncodedTask, batch_size: int) -> tuple[np.ndarray, ...]:
    """The model's outputs (float32) for every row of ``rows`` in order: classifier / multiple-choice logits
    (N, C), or SQuAD start and end logits (N, S) each. ``batch_size`` is rounded up to a multiple of the mesh's
    data axis; the last batch is padded and the padding dropped."""
    evaluate, state = Evaluator.of(model, _outputs, mesh, rules)
    return evaluate.map_rows(state, {k: v for k, v in rows.rows(np.arange(len(rows))).items() if k in PAIR_FIELDS},
                             batch_size)


def _outputs(model, batch) -> tuple[jax.Array, ...]:
    out = model(*(batch[k] for k in PAIR_FIELDS))
    return tuple(x.astype(jnp.float32) for x in (out if isinstance(out, tuple) else (out,)))


def _score(task: str, split: Split, outputs: tuple[np.ndarray, ...],
           null_threshold: float) -> tuple[dict, dict, dict | None]:
    """(metrics, predictions by example id, SQuAD 2.0's null odds by question id or None) of one split."""
    if task in ("squad1", "squad2"):
        features = split.extra
        spans = decode_squad(features, *outputs, max_answer_length=MAX_ANSWER_LENGTH)
        if task == "squad1":
            texts = answers_at(spans, None)
            return {**squad1_scores(features.examples, texts), "windows": len(features)}, texts, None
        odds, texts = null_odds(spans), answers_at(spans, null_threshold)
        scores = squad2_scores(features.examples, texts, odds)  # what evaluate-v2.0.py says of the files written
        return {**scores, "null_score_diff_threshold": null_threshold, "windows": len(features)}, texts, odds
    predicted = outputs[0].argmax(-1)
    labels = split.rows.targets["labels"]
    if task == "race":
        result = metrics.race_accuracy(predicted, split.extra)
        result["examples"] = len(predicted)
        return result, {q: OPTION_LETTERS[p] for q, p in zip(split.ids, predicted)}, None
    names = MNLI_LABELS if task == "mnli" else QQP_LABELS
    result = {"accuracy": metrics.accuracy(predicted, labels), "examples": len(predicted)}
    if task == "qqp":
        result["f1"] = metrics.positive_f1(predicted, labels)
    return result, {g: names[p] for g, p in zip(split.ids, predicted)}, None


def evaluate(model, mesh, rules, task: str, splits: list[Split], batch_size: int,
             null_threshold: float = 0.0) -> tuple[dict, dict, dict]:
    """(results, predictions, null odds): per split its metrics, counts and file; per split each example id's
    prediction (the class label, RACE's option letter, SQuAD's answer text, "" for no answer: for squad2 where the
    null odds exceed ``null_threshold``); per split (squad2 only) each question's null odds."""
    results, predictions, odds = {"task": task}, {}, {}
    for split in splits:
        metrics, predicted, split_odds = _score(task, split, predict(model, mesh, rules, split.rows, batch_size),
                                                null_threshold)
        results[split.name] = {**metrics, **split.counts, "file": str(split.path)}
        predictions[split.name] = predicted
        if split_odds is not None:
            odds[split.name] = split_odds
    return results, predictions, odds


def null_odds_path(predictions_file: str | pathlib.Path) -> pathlib.Path:
    """Where the null odds of a squad2 predictions file go: beside it, ``NAME.null_odds.json``."""
    path = pathlib.Path(predictions_file)
    return path.with_name(f"{path.stem}.null_odds.json")


def write_predictions(path: str | pathlib.Path, task: str, predictions: dict,
                      odds: dict | None = None) -> dict[str, str]:
    """Writes ``evaluate``'s predictions to ``path`` (module docstring: SQuAD's official flat file, else per split)
    and, for squad2, the null odds beside it; returns what the results add: ``{"null_odds_file": path}``."""
    if task not in ("squad1", "squad2"):
        _write_json(path, predictions)
        return {}
    if len(predictions) != 1:
        raise ValueError(f"--task={task} evaluates one file; got splits {sorted(predictions)}")
    (split, answers), = predictions.items()
    _write_json(path, answers)
    if task != "squad2":
        return {}
    odds_file = null_odds_path(path)
    _write_json(odds_file, odds[split])  # inf (no span allowed) is written as Infinity, which json.load reads
    return {"null_odds_file": str(odds_file)}


def _write_json(path: str | pathlib.Path, value: Any) -> None:
    write_json(path, value)
    print(f"wrote {path}", file=sys.stderr)
