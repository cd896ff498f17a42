"""Fine-tuning data (``data.source='task'``): a task's train and validation rows as ``EncodedTask``s.

Real tasks read the files users download (``megajax.data.tasks`` readers) with the model's WordPiece tokenizer;
synthetic tasks are generated from ``data.seed`` over a small vocabulary, learnable from scratch by a tiny BERT, so
tests and CPU runs fine-tune without downloads. Every row is ``[CLS] A [SEP] B [SEP]`` as in pretraining.

What a reader leaves out (SQuAD training questions that would teach a wrong span, QQP's malformed rows) is counted
in ``TaskData.report`` (the training start record shows it). A training file that loses more than
``data.max_dropped_fraction`` of its questions or rows is refused, naming the first ids or lines and why.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from collections.abc import Callable

import numpy as np

from megajax.data.settings import DataSettings
from megajax.data.tasks import glue, race, squad
from megajax.data.tasks.encoding import SPECIALS_PER_PAIR, EncodedTask, PackedPairs, Specials
from megajax.data.tasks.files import TaskDataError
from megajax.data.tasks.race import NUM_OPTIONS
from megajax.data.tokenizer import TextTokenizer, load_tokenizer
from megajax.errors import ConfigError

# The classification tasks' classes (the model that fine-tunes on each task is named by its spec in models/)
TASK_CLASSES = {"mnli": 3, "qqp": 2, "synthetic_pair": 2}
SYNTHETIC_ROWS = {"train": 8192, "valid": 1024}
FIRST_WORD, NUM_WORDS = 5, 11  # synthetic words are ids 5..15 (few: a tiny model learns the tasks in seconds)
HALF = FIRST_WORD + NUM_WORDS // 2  # synthetic_pair: words below it are the first half
SYNTHETIC_SPECIALS = Specials(cls_id=1, sep_id=2, pad_id=0, vocab_size=FIRST_WORD + NUM_WORDS)  # 3, 4: markers


@dataclasses.dataclass(frozen=True)
class TaskData:
    """The encoded rows of both splits; ``report``: per split ("train", "valid") the file read and what its
    reader counted and left out (empty for synthetic tasks)."""

    train: EncodedTask
    valid: EncodedTask
    report: dict = dataclasses.field(default_factory=dict)
    tokenizer_fingerprint: str = ""  # the real tasks' tokenizer (tokenizer.vocabulary_fingerprint); "" synthetic


def check_task(d: DataSettings) -> None:
    """Raises ConfigError when data.task does not fit the model (classes, sizes); which model trains on which
    task is checked with the config (``megajax.config.resolve.check_data_source``)."""
    classes = TASK_CLASSES.get(d.task, 0)
    if classes and d.num_classes != classes:
        raise ConfigError(f"data.task={d.task} has {classes} classes; set --config.model.num_classes={classes}")
    if d.task in _SYNTHETIC and (d.vocab_size < SYNTHETIC_SPECIALS.vocab_size or d.max_seq_len < 24):
        raise ConfigError(f"synthetic tasks need model.vocab_size >= {SYNTHETIC_SPECIALS.vocab_size} and "
                          f"model.max_seq_len >= 24; got {d.vocab_size} and {d.max_seq_len}")
    if d.task in REAL_TASKS and d.max_seq_len < REAL_TASKS[d.task].min_seq_len:  # SQuAD: no room for a context
        raise ConfigError(f"model.max_seq_len={d.max_seq_len} leaves no room for a SQuAD context: a window holds up "
                          f"to {squad.MAX_QUERY_LENGTH} question tokens and {SPECIALS_PER_PAIR} special tokens "
                          f"besides; set --config.model.max_seq_len to at least {squad.MIN_SEQ_LEN} (BERT's SQuAD "
                          "runs use 384)")
    if not 0.0 <= d.max_dropped_fraction <= 1.0:
        raise ConfigError(f"data.max_dropped_fraction={d.max_dropped_fraction}: must be in [0, 1] (1 allows any)")


def load_task(d: DataSettings) -> TaskData:
    """Both splits of ``data.task``, encoded to ``model.max_seq_len`` (checked first: ``check_task``)."""
    check_task(d)
    seq = d.max_seq_len
    if d.task in _SYNTHETIC:
        make = _SYNTHETIC[d.task]
        return TaskData(*(make(np.random.default_rng([d.seed, i]), SYNTHETIC_ROWS[s], seq, f"{d.task}/{s}")
                          for i, s in enumerate(("train", "valid"))))
    return _read_task(d)


def _read_task(d: DataSettings) -> TaskData:
    seq = d.max_seq_len
    task = REAL_TASKS[d.task]
    if not d.task_dir or not d.tokenizer:
        raise ConfigError(f"data.task={d.task} needs --config.data.task_dir (the task's files: "
                          f"{', '.join(task.files)}) and --config.data.tokenizer (the model's vocab.txt)")
    tokenizer = load_tokenizer(d.tokenizer)
    if tokenizer.vocab_size > d.vocab_size:
        raise ConfigError(f"the tokenizer has {tokenizer.vocab_size} ids but model.vocab_size={d.vocab_size}")
    paths = [pathlib.Path(d.task_dir).expanduser() / f for f in task.files]
    return task.read(d.task, paths, tokenizer, seq, d.max_dropped_fraction)


def _read_pairs(read: Callable) -> Callable[..., TaskData]:
    """MNLI / QQP (GLUE's tab-separated files): a training file losing too many rows is refused."""

    def read_task(name: str, paths: list[pathlib.Path], tokenizer: TextTokenizer, seq: int,
                  max_dropped: float) -> TaskData:
        pairs = [read(p) for p in paths]
        train = pairs[0]
        skipped = sum(train.skipped.values())
        _refuse_above(max_dropped, skipped, len(train.examples) + skipped, "rows", f"{name.upper()} file {paths[0]}",
                      train.skipped_summary(), "check that it is GLUE's tab-separated file with its header line")
        return TaskData(*(glue.featurize_pairs(data.examples, tokenizer, seq, f"{name}/{p.name}")
                          for data, p in zip(pairs, paths)),
                        _report(paths, [data.report() for data in pairs]), tokenizer.fingerprint)

    return read_task


def _read_race(name: str, paths: list[pathlib.Path], tokenizer: TextTokenizer, seq: int,
               max_dropped: float) -> TaskData:
    splits = [race.read_race(p) for p in paths]
    return TaskData(*(race.featurize_race(examples, tokenizer, seq, f"{name}/{p.name}")
                      for examples, p in zip(splits, paths)),
                    _report(paths, [{"questions": len(examples)} for examples in splits]), tokenizer.fingerprint)


def _read_squad(name: str, paths: list[pathlib.Path], tokenizer: TextTokenizer, seq: int,
                max_dropped: float) -> TaskData:
    features = [squad.featurize_squad(squad.read_squad(p).examples, tokenizer, seq, training=training,
                                      name=f"{name}/{p.name}", source=f"SQuAD file {p}")
                for p, training in zip(paths, (True, False))]
    train = features[0]
    _refuse_above(max_dropped, train.dropped, train.questions, "questions", f"SQuAD file {paths[0]}",
                  train.drop_summary(), "answer_start must be the 0-based character offset of the answer's text "
                  "in its context (a question no window holds needs a longer model.max_seq_len)")
    return TaskData(features[0].task, features[1].task, _report(paths, [f.report() for f in features]),
                    tokenizer.fingerprint)


@dataclasses.dataclass(frozen=True)
class RealTask:
    """A downloaded task's training data: its (train, validation) files or folders under ``data.task_dir``, as
    the task is distributed, how both are read and encoded (``read(name, paths, tokenizer, seq_len,
    max_dropped_fraction)``), and the shortest ``model.max_seq_len`` its rows fit."""

    files: tuple[str, str]
    read: Callable[[str, list[pathlib.Path], TextTokenizer, int, float], TaskData]
    min_seq_len: int = 0


REAL_TASKS: dict[str, RealTask] = {
    "mnli": RealTask(("train.tsv", "dev_matched.tsv"), _read_pairs(glue.read_mnli)),
    "qqp": RealTask(("train.tsv", "dev.tsv"), _read_pairs(glue.read_qqp)),
    "squad1": RealTask(("train-v1.1.json", "dev-v1.1.json"), _read_squad, squad.MIN_SEQ_LEN),
    "squad2": RealTask(("train-v2.0.json", "dev-v2.0.json"), _read_squad, squad.MIN_SEQ_LEN),
    "race": RealTask(("train", "dev"), _read_race),
}


def _report(paths: list[pathlib.Path], counts: list[dict]) -> dict:
    return {split: {"file": str(p), **c} for split, p, c in zip(("train", "valid"), paths, counts)}


def _refuse_above(limit: float, dropped: int, total: int, unit: str, where: str, why: str, advice: str) -> None:
    """Raises TaskDataError when ``dropped`` of ``total`` training ``unit`` exceed the fraction ``limit``."""
    if dropped > limit * total:
        raise TaskDataError(f"{where}: {dropped} of its {total} training {unit} ({100 * dropped / total:.1f}%) "
                            f"cannot be used, more than data.max_dropped_fraction={limit:g}: {why}. {advice}; or "
                            f"set --config.data.max_dropped_fraction={_enough(dropped, total)} to train on the rest")


def _enough(dropped: int, total: int) -> str:
    """``dropped / total`` rounded up to 2 significant digits: a data.max_dropped_fraction that lets the run
    through."""
    fraction = dropped / total
    scale = 10.0 ** (1 - math.floor(math.log10(fraction)))
    return f"{min(math.ceil(fraction * scale) / scale, 1.0):g}"


def _words(rng: np.random.Generator, n: int | tuple[int, ...]) -> np.ndarray:
    return FIRST_WORD + rng.integers(0, NUM_WORDS, n)


def synthetic_pair(rng: np.random.Generator, rows: int, seq_len: int, name: str) -> EncodedTask:
    """A and B: 3 words each; label 1 iff A holds more words of the upper half of the word list than B (a
    comparison across the segments; rows with equal counts are left out, so the classes are balanced)."""
    a, b = _words(rng, (2 * rows, 3)), _words(rng, (2 * rows, 3))
    high_a, high_b = (a >= HALF).sum(1), (b >= HALF).sum(1)
    keep = np.flatnonzero(high_a != high_b)[:rows]  # about 69% of rows differ: 2 * rows always suffice
    pairs = [(a[i].tolist(), b[i].tolist()) for i in keep]
    labels = (high_a[keep] > high_b[keep]).astype(np.int32)
    return EncodedTask(name, PackedPairs.build(pairs, seq_len, SYNTHETIC_SPECIALS), {"labels": labels})


def synthetic_span(rng: np.random.Generator, rows: int, seq_len: int, name: str) -> EncodedTask:
    """A: 3 question words; B: 16 context words holding one span that starts with marker 3 and ends with marker 4
    (2-5 tokens, markers included); the targets are the markers' positions in the row."""
    pairs, starts, ends = [], [], []
    context_len = min(16, seq_len - SPECIALS_PER_PAIR - 3)
    for _ in range(rows):
        a, b = _words(rng, 3), _words(rng, context_len)
        length = rng.integers(2, 6)
        open_at = rng.integers(0, context_len - length + 1)
        b[open_at], b[open_at + length - 1] = 3, 4
        pairs.append((a.tolist(), b.tolist()))
        starts.append(len(a) + 2 + open_at)  # after [CLS] A [SEP]
        ends.append(len(a) + 2 + open_at + length - 1)
    return EncodedTask(name, PackedPairs.build(pairs, seq_len, SYNTHETIC_SPECIALS),
                       {"start_positions": np.asarray(starts, np.int32), "end_positions": np.asarray(ends, np.int32)})


def synthetic_choice(rng: np.random.Generator, rows: int, seq_len: int, name: str) -> EncodedTask:
    """A: a 2-word question; 4 options as B, the right one equal to the question, the others random words."""
    pairs, labels = [], rng.integers(0, NUM_OPTIONS, rows)
    for label in labels:
        question = _words(rng, 2).tolist()
        for option in range(NUM_OPTIONS):
            pairs.append((question, question if option == label else _words(rng, 2).tolist()))
    return EncodedTask(name, PackedPairs.build(pairs, seq_len, SYNTHETIC_SPECIALS, (NUM_OPTIONS,)),
                       {"labels": labels.astype(np.int32)})


_SYNTHETIC = {"synthetic_pair": synthetic_pair, "synthetic_span": synthetic_span,
              "synthetic_choice": synthetic_choice}
