"""eval.py's fine-tuning tasks (paper Table 5): a fine-tuned task model's metrics on the task's dev files.

``read_splits`` reads and encodes the evaluation files before the model is loaded (mistakes fail first);
``evaluate`` runs the model over every row once (fixed-size batches, the last padded) and scores each split:

| task | files (in ``--data``, default the run's ``data.task_dir``) | metrics (%) |
| --- | --- | --- |
| mnli | ``dev_matched.tsv``, ``dev_mismatched.tsv`` | accuracy per split (the paper's m / mm) |
| qqp | ``dev.tsv`` | accuracy, F1 of the duplicate class |
| squad1 | ``dev-v1.1.json`` | exact match, F1 |
| squad2 | ``dev-v2.0.json`` | EM / F1 at no-answer threshold 0 and at the best threshold on these questions |
| race | ``dev/``, ``test/`` (each with ``middle/``, ``high/``) | accuracy on middle, high and all, per split |

``--data`` may also name one file (or one RACE split folder); it is then the only split, named after it.
"""

from __future__ import annotations

import dataclasses
import pathlib
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
from megajax.evaluation.inputs import InputError
from megajax.evaluation.squad_decode import answers_at, decode_squad
from megajax.evaluation.squad_metrics import squad_scores
from megajax.models.objectives import PAIR_FIELDS

DOWNSTREAM_TASKS = ("mnli", "qqp", "squad1", "squad2", "race")
DEV_FILES = {"mnli": {"matched": "dev_matched.tsv", "mismatched": "dev_mismatched.tsv"}, "qqp": {"dev": "dev.tsv"},
             "squad1": {"dev": "dev-v1.1.json"}, "squad2": {"dev": "dev-v2.0.json"},
             "race": {"dev": "dev", "test": "test"}}
MAX_ANSWER_LENGTH = 30  # SQuAD: answer tokens at most (BERT's and Megatron's default)
OPTION_LETTERS = "ABCD"


@dataclasses.dataclass(frozen=True)
class Split:
    """One evaluation file, encoded: ``rows`` (the model's inputs and targets) and what scoring needs besides:
    ``ids`` (one per example, for the predictions file), RACE's ``examples`` or SQuAD's ``features``."""

    name: str
    path: pathlib.Path
    rows: EncodedTask
    ids: list[str]
    extra: Any = None


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
    if tok.vocab_size > config.model.vocab_size:
        raise InputError(f"tokenizer {vocab} has {tok.vocab_size} ids but the model has model.vocab_size="
                         f"{config.model.vocab_size}; pass the tokenizer the model was trained with")
    seq, out = config.model.max_seq_len, []
    try:
        for name, path in _split_paths(task, pathlib.Path(where).expanduser()):
            label = f"{task}/{name}"
            if task in ("mnli", "qqp"):
                pairs = (glue.read_mnli if task == "mnli" else glue.read_qqp)(path)
                rows = glue.featurize_pairs(pairs.examples, tok, seq, label)
                out.append(Split(name, path, rows, [e.guid for e in pairs.examples]))
            elif task == "race":
                examples = race.read_race(path)
                out.append(Split(name, path, race.featurize_race(examples, tok, seq, label),
                                 [e.qid for e in examples], examples))
            else:
                squad_data = squad.read_squad(path)
                if task == "squad2" and not squad_data.version_2:
                    print(f"note: {path} has no is_impossible field (a SQuAD 1.1 file?)", flush=True)
                features = squad.featurize_squad(squad_data.examples, tok, seq, training=False, name=label)
                out.append(Split(name, path, features.task, [e.qid for e in features.examples], features))
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


def _score(task: str, split: Split, outputs: tuple[np.ndarray, ...]) -> tuple[dict, dict]:
    """(metrics, predictions by example id) of one split."""
    if task in ("squad1", "squad2"):
        features = split.extra
        spans = decode_squad(features, *outputs, max_answer_length=MAX_ANSWER_LENGTH)
        texts = answers_at(spans, None)
        if task == "squad1":
            return {**squad_scores(features.examples, texts), "windows": len(features)}, texts
        scores = squad_scores(features.examples, texts, {q: p.null_margin for q, p in spans.items()})
        # the answers at the F1-best threshold (as the official script's best_f1 assumes)
        return {**scores, "windows": len(features)}, answers_at(spans, scores["best_f1_thresh"])
    predicted = outputs[0].argmax(-1)
    labels = split.rows.targets["labels"]
    if task == "race":
        result = metrics.race_accuracy(predicted, split.extra)
        result["examples"] = len(predicted)
        return result, {q: OPTION_LETTERS[p] for q, p in zip(split.ids, predicted)}
    names = MNLI_LABELS if task == "mnli" else QQP_LABELS
    result = {"accuracy": metrics.accuracy(predicted, labels), "examples": len(predicted)}
    if task == "qqp":
        result["f1"] = metrics.positive_f1(predicted, labels)
    return result, {g: names[p] for g, p in zip(split.ids, predicted)}


def evaluate(model, mesh, rules, task: str, splits: list[Split], batch_size: int) -> tuple[dict, dict]:
    """(results, predictions): per split its metrics (and file), and per split each example id's prediction
    (the class label, RACE's option letter, SQuAD's answer text, "" for no answer)."""
    results, predictions = {"task": task}, {}
    for split in splits:
        metrics, predicted = _score(task, split, predict(model, mesh, rules, split.rows, batch_size))
        results[split.name] = {**metrics, "file": str(split.path)}
        predictions[split.name] = predicted
    return results, predictions
