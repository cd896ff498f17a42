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
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from megajax.config import StoredRun
from megajax.data.tasks import glue, race, squad
from megajax.data.tasks.encoding import EncodedTask
from megajax.data.tasks.files import TaskDataError
from megajax.data.tasks.glue import MNLI_LABELS, QQP_LABELS
from megajax.data.tasks.task_data import TASK_CLASSES
from megajax.data.tokenizer import TextTokenizer, load_tokenizer
from megajax.evaluation import task_metrics as metrics
from megajax.evaluation.evaluator import Evaluator
from megajax.evaluation.inputs import InputError, check_tokenizer
from megajax.evaluation.registry import EvalTask, Loaded, Request, register
from megajax.evaluation.squad_decode import answers_at, decode_squad, null_odds
from megajax.evaluation.squad_metrics import squad1_scores, squad2_scores
from megajax.models.objectives import PAIR_FIELDS
from megajax.outputs import write_json

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


@dataclasses.dataclass(frozen=True)
class Downstream:
    """A fine-tuning task's evaluation: its dev files (split name -> file or folder in the task's folder), how one
    file is read and encoded (``read(name, path, tokenizer, seq_len, label)``), how a split's model outputs are
    scored (``score(split, outputs, null threshold) -> (metrics, predictions by id, null odds or None)``).
    ``official_file``: the predictions are the official scripts' one flat ``{id: answer}`` file (SQuAD);
    ``null_odds``: it writes the null odds beside them and takes the null threshold (SQuAD 2.0);
    ``split_folder(path)``: whether a folder given is one split rather than the task's folder (RACE)."""

    name: str
    dev_files: dict[str, str]
    read: Callable[[str, pathlib.Path, TextTokenizer, int, str], Split]
    score: Callable[[Split, tuple[np.ndarray, ...], float], tuple[dict, dict, dict | None]]
    official_file: bool = False
    null_odds: bool = False
    split_folder: Callable[[pathlib.Path], bool] = lambda path: False


def check_classes(task: str, stored: StoredRun) -> None:
    """Raises InputError when a classification task's classes differ from the checkpoint's classifier's."""
    classes = TASK_CLASSES.get(task, 0)
    if classes and stored.model.num_classes != classes:
        raise InputError(f"--task={task} has {classes} classes but this checkpoint's classifier has "
                         f"{stored.model.num_classes} (it was fine-tuned on data.task={stored.dataset.task!r})")


def _split_paths(task: Downstream, data: pathlib.Path) -> list[tuple[str, pathlib.Path]]:
    if task.split_folder(data):
        return [(data.name, data)]
    if data.is_file():
        return [(data.stem, data)]
    files = ", ".join(task.dev_files.values())
    if not data.is_dir():
        raise InputError(f"--data={data} does not exist; give the folder holding {files}, or one of those files")
    found = [(name, data / f) for name, f in task.dev_files.items() if (data / f).exists()]
    if not found:
        raise InputError(f"--data={data} holds none of {files} (--task={task.name}); give the task's folder as "
                         "downloaded, or one evaluation file")
    return found


def read_splits(task: str, stored: StoredRun, data: str | None, tokenizer: str | None) -> list[Split]:
    """Every evaluation split of ``task`` (the checkpoint's model already checked to be the task's), encoded to
    the model's ``max_seq_len`` with its tokenizer (``--tokenizer``, else the run's ``data.tokenizer``). Raises
    InputError for a missing or unreadable input."""
    check_classes(task, stored)
    spec = DOWNSTREAM[task]
    where = data or stored.dataset.task_dir
    if not where:
        raise InputError(f"--task={task} needs --data (the folder holding {', '.join(spec.dev_files.values())}); "
                         "this checkpoint does not name its task_dir")
    vocab = tokenizer or stored.dataset.tokenizer
    if not vocab:
        raise InputError("this checkpoint does not name its tokenizer; pass --tokenizer=PATH (the model's vocab.txt "
                         "or tokenizer.json)")
    try:
        tok = load_tokenizer(pathlib.Path(vocab).expanduser())
    except (OSError, ValueError) as e:
        given = "--tokenizer" if tokenizer else "the run's data.tokenizer"
        raise InputError(f"{given}={vocab}: {e}; pass --tokenizer=PATH") from e
    check_tokenizer(tok, stored)
    seq, out = stored.model.max_seq_len, []
    try:
        for name, path in _split_paths(spec, pathlib.Path(where).expanduser()):
            out.append(spec.read(name, path, tok, seq, f"{task}/{name}"))
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


def _read_pairs(read: Callable, counted: bool) -> Callable[..., Split]:
    """MNLI / QQP: sentence pairs (``counted``: the reader's skipped rows go to the results)."""

    def read_split(name: str, path: pathlib.Path, tok: TextTokenizer, seq: int, label: str) -> Split:
        pairs = read(path)
        counts = {k: v for k, v in pairs.report().items() if k != "examples"} if counted else {}
        return Split(name, path, glue.featurize_pairs(pairs.examples, tok, seq, label),
                     [e.guid for e in pairs.examples], counts=counts)

    return read_split


def _read_race(name: str, path: pathlib.Path, tok: TextTokenizer, seq: int, label: str) -> Split:
    examples = race.read_race(path)
    return Split(name, path, race.featurize_race(examples, tok, seq, label), [e.qid for e in examples], examples)


def _read_squad(version_2: bool) -> Callable[..., Split]:
    def read_split(name: str, path: pathlib.Path, tok: TextTokenizer, seq: int, label: str) -> Split:
        squad_data = squad.read_squad(path)
        if version_2 and not squad_data.version_2:
            print(f"note: {path} has no is_impossible field (a SQuAD 1.1 file?)", flush=True)
        features = squad.featurize_squad(squad_data.examples, tok, seq, training=False, name=label)
        counts = {k: v for k, v in features.report().items() if k.startswith("broken_offset")}
        return Split(name, path, features.task, [e.qid for e in features.examples], features, counts)

    return read_split


def _score_pairs(names: tuple[str, ...], f1: bool) -> Callable[..., tuple[dict, dict, None]]:
    """Accuracy (and QQP's F1 of the duplicate class); predictions are the label names."""

    def score(split: Split, outputs: tuple[np.ndarray, ...], null_threshold: float) -> tuple[dict, dict, None]:
        predicted, labels = outputs[0].argmax(-1), split.rows.targets["labels"]
        result = {"accuracy": metrics.accuracy(predicted, labels), "examples": len(predicted)}
        if f1:
            result["f1"] = metrics.positive_f1(predicted, labels)
        return result, {g: names[p] for g, p in zip(split.ids, predicted)}, None

    return score


def _score_race(split: Split, outputs: tuple[np.ndarray, ...], null_threshold: float) -> tuple[dict, dict, None]:
    predicted = outputs[0].argmax(-1)
    result = metrics.race_accuracy(predicted, split.extra)
    result["examples"] = len(predicted)
    return result, {q: OPTION_LETTERS[p] for q, p in zip(split.ids, predicted)}, None


def _score_squad1(split: Split, outputs: tuple[np.ndarray, ...], null_threshold: float) -> tuple[dict, dict, None]:
    features = split.extra
    texts = answers_at(decode_squad(features, *outputs, max_answer_length=MAX_ANSWER_LENGTH), None)
    return {**squad1_scores(features.examples, texts), "windows": len(features)}, texts, None


def _score_squad2(split: Split, outputs: tuple[np.ndarray, ...], null_threshold: float) -> tuple[dict, dict, dict]:
    features = split.extra
    spans = decode_squad(features, *outputs, max_answer_length=MAX_ANSWER_LENGTH)
    odds, texts = null_odds(spans), answers_at(spans, null_threshold)
    scores = squad2_scores(features.examples, texts, odds)  # what evaluate-v2.0.py says of the files written
    return {**scores, "null_score_diff_threshold": null_threshold, "windows": len(features)}, texts, odds


def _race_split_folder(path: pathlib.Path) -> bool:
    return (path / "middle").is_dir() or (path / "high").is_dir()


DOWNSTREAM: dict[str, Downstream] = {task.name: task for task in (
    Downstream("mnli", {"matched": "dev_matched.tsv", "mismatched": "dev_mismatched.tsv"},
               _read_pairs(glue.read_mnli, counted=False), _score_pairs(MNLI_LABELS, f1=False)),
    Downstream("qqp", {"dev": "dev.tsv"}, _read_pairs(glue.read_qqp, counted=True),
               _score_pairs(QQP_LABELS, f1=True)),
    Downstream("squad1", {"dev": "dev-v1.1.json"}, _read_squad(False), _score_squad1, official_file=True),
    Downstream("squad2", {"dev": "dev-v2.0.json"}, _read_squad(True), _score_squad2, official_file=True,
               null_odds=True),
    Downstream("race", {"dev": "dev", "test": "test"}, _read_race, _score_race, split_folder=_race_split_folder),
)}


def evaluate(model, mesh, rules, task: str, splits: list[Split], batch_size: int,
             null_threshold: float = 0.0) -> tuple[dict, dict, dict]:
    """(results, predictions, null odds): per split its metrics, counts and file; per split each example id's
    prediction (the class label, RACE's option letter, SQuAD's answer text, "" for no answer: for squad2 where the
    null odds exceed ``null_threshold``); per split (squad2 only) each question's null odds."""
    results, predictions, odds = {"task": task}, {}, {}
    for split in splits:
        metrics, predicted, split_odds = DOWNSTREAM[task].score(
            split, predict(model, mesh, rules, split.rows, batch_size), null_threshold)
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
    spec = DOWNSTREAM[task]
    if not spec.official_file:
        _write_json(path, predictions)
        return {}
    if len(predictions) != 1:
        raise ValueError(f"--task={task} evaluates one file; got splits {sorted(predictions)}")
    (split, answers), = predictions.items()
    _write_json(path, answers)
    if not spec.null_odds:
        return {}
    odds_file = null_odds_path(path)
    _write_json(odds_file, odds[split])  # inf (no span allowed) is written as Infinity, which json.load reads
    return {"null_odds_file": str(odds_file)}


def _write_json(path: str | pathlib.Path, value: Any) -> None:
    write_json(path, value)
    print(f"wrote {path}", file=sys.stderr)


def _run(loaded: Loaded, splits: list[Split], request: Request, task: str) -> dict:
    result, predicted, odds = evaluate(loaded.model, loaded.mesh, loaded.rules, task, splits, request.batch_size,
                                       request.null_score_diff_threshold or 0.0)
    if request.predictions:
        result.update(write_predictions(request.predictions, task, predicted, odds))
    return result


def _eval_task(spec: Downstream) -> EvalTask:
    def extra_files(predictions: str | pathlib.Path) -> list[tuple[pathlib.Path, str]]:
        if not spec.null_odds:
            return []
        odds = null_odds_path(predictions)
        return [(odds, f"{spec.name}'s null odds file {odds} (beside --predictions)")]

    return EvalTask(spec.name, lambda stored, request: read_splits(spec.name, stored, request.data,
                                                                    request.tokenizer),
                    lambda loaded, splits, request: _run(loaded, splits, request, spec.name),
                    predictions=True, extra_files=extra_files, null_threshold=spec.null_odds)


for _spec in DOWNSTREAM.values():
    register(_eval_task(_spec))
