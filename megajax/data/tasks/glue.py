"""MNLI and QQP from GLUE's TSV files, and their ``[CLS] A [SEP] B [SEP]`` classification rows.

Columns are found by header name, so GLUE's files (MNLI: ``train.tsv``, ``dev_matched.tsv``,
``dev_mismatched.tsv``; QQP: ``train.tsv``, ``dev.tsv``) and re-exports with other column orders both read.
Fields are split on tabs only (no quoting: GLUE's sentences contain unbalanced quotes). In an MNLI file a row
with the wrong number of fields or an unknown label is an error naming the file and line (as Megatron asserts); in
a QQP file such rows, and rows with an empty question, are skipped and counted with the first line of each kind
(QQP's train.tsv has a few, which Megatron skips too). A file with no usable row is an error.

Each example is named by the file's own id (MNLI's ``index`` column, QQP's ``id``), so predictions join with the
file; a file without that column names its examples ``file name:line``. A repeated id is an error in MNLI and a
skipped row in QQP.
"""

from __future__ import annotations

import collections
import csv
import dataclasses
import pathlib
from collections.abc import Sequence

import numpy as np
from tokenizers import Tokenizer

from megajax.data.tasks.encoding import (
    SPECIALS_PER_PAIR,
    EncodedTask,
    PackedPairs,
    token_ids,
    truncate_longer_first,
    wordpiece_backend,
)
from megajax.data.tasks.files import TaskDataError, existing_file
from megajax.data.tokenizer import TextTokenizer

# Label id = position in these tuples (fixed; the classifier's output order).
MNLI_LABELS = ("contradiction", "entailment", "neutral")
QQP_LABELS = ("0", "1")  # is_duplicate: 0 = different questions, 1 = duplicates (the F1 positive class)


@dataclasses.dataclass(frozen=True)
class PairExample:
    """One sentence pair; ``guid`` is the file's id of the row (module docstring) or ``file name:line``."""

    guid: str
    text_a: str
    text_b: str
    label: int


@dataclasses.dataclass(frozen=True)
class PairData:
    """The usable examples of a file and the rows skipped, counted by reason, with the first line of each reason."""

    path: str
    examples: list[PairExample]
    skipped: dict[str, int]
    first_skipped: dict[str, int] = dataclasses.field(default_factory=dict)

    def summary(self) -> str:
        """One line for the log: what was read and what was skipped."""
        line = f"{len(self.examples)} examples from {self.path}"
        if self.skipped:
            line += f"; {self.skipped_summary()}"
        return line

    def skipped_summary(self) -> str:
        """``skipped N rows (n reason (first on line L), ...)``; empty when none was."""
        if not self.skipped:
            return ""
        reasons = ", ".join(f"{n} {reason}" + (f" (first on line {self.first_skipped[reason]})"
                                               if reason in self.first_skipped else "")
                            for reason, n in sorted(self.skipped.items()))
        return f"skipped {sum(self.skipped.values())} rows ({reasons})"

    def report(self) -> dict:
        """The counts of ``summary`` for the training start record and eval.py's results."""
        out = {"examples": len(self.examples), "skipped_rows": sum(self.skipped.values())}
        if self.skipped:
            out["skipped"] = {reason: {"rows": n, "first_line": self.first_skipped.get(reason)}
                              for reason, n in sorted(self.skipped.items())}
        return out


@dataclasses.dataclass(frozen=True)
class _TsvSpec:
    task: str
    text_columns: tuple[str, str]
    id_column: str  # the examples' ids, when the header has it
    label_columns: tuple[str, ...]  # the first one in the header is used
    labels: tuple[str, ...]
    skip_bad_rows: bool  # skip (and count) a malformed row instead of stopping at it


MNLI = _TsvSpec("MNLI", ("sentence1", "sentence2"), "index", ("gold_label", "label"), MNLI_LABELS, False)
QQP = _TsvSpec("QQP", ("question1", "question2"), "id", ("is_duplicate",), QQP_LABELS, True)


def read_mnli(path: str | pathlib.Path) -> PairData:
    """MNLI examples from a GLUE TSV (sentence1, sentence2, gold_label or label as a label name)."""
    return _read_tsv(path, MNLI)


def read_qqp(path: str | pathlib.Path) -> PairData:
    """QQP examples from a GLUE TSV (question1, question2, is_duplicate)."""
    return _read_tsv(path, QQP)


def _columns(header: list[str], spec: _TsvSpec, path: pathlib.Path) -> tuple[int, int, int]:
    found = [c for c in spec.label_columns if c in header]
    missing = [c for c in spec.text_columns if c not in header]
    if missing or not found:
        need = " and ".join(missing + ([] if found else [" or ".join(spec.label_columns)]))
        raise TaskDataError(f"{spec.task} file {path} has no {need} column (its header, line 1: {header}); give a "
                            f"labelled GLUE {spec.task} file (test files carry no labels)")
    return header.index(spec.text_columns[0]), header.index(spec.text_columns[1]), header.index(found[0])


def _read_tsv(path: str | pathlib.Path, spec: _TsvSpec) -> PairData:
    p = existing_file(path, spec.task)
    label_ids = {name: i for i, name in enumerate(spec.labels)}
    examples, skipped, first_skipped, seen = [], collections.Counter(), {}, {}
    try:
        with p.open(encoding="utf-8", newline="") as f:
            reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
            header = next(reader, None)
            if header is None:
                raise TaskDataError(f"{spec.task} file {p} is empty")
            a, b, label = _columns(header, spec, p)
            key = header.index(spec.id_column) if spec.id_column in header else None
            for row in reader:
                if not row:
                    continue  # blank line
                if len(row) != len(header):
                    problem = "rows with the wrong number of fields"
                    detail = f"{len(row)} fields, the header has {len(header)}"
                elif row[label] not in label_ids:
                    problem, detail = f"with label {row[label]!r}", f"label {row[label]!r} is not one of {spec.labels}"
                elif spec.skip_bad_rows and not (row[a].strip() and row[b].strip()):
                    problem = detail = "with an empty question"
                elif key is not None and row[key] in seen:  # two predictions under one id would overwrite
                    problem = f"with a repeated {spec.id_column}"
                    detail = f"{spec.id_column} {row[key]!r} is also on line {seen[row[key]]}"
                else:
                    guid = row[key] if key is not None else f"{p.name}:{reader.line_num}"
                    if key is not None:
                        seen[guid] = reader.line_num
                    examples.append(PairExample(guid, row[a], row[b], label_ids[row[label]]))
                    continue
                if not spec.skip_bad_rows:
                    raise TaskDataError(f"{spec.task} file {p}, line {reader.line_num}: {detail}")
                skipped[problem] += 1
                first_skipped.setdefault(problem, reader.line_num)
    except UnicodeDecodeError as e:
        raise TaskDataError(f"{spec.task} file {p} is not UTF-8 text: {e}") from e
    if not examples:
        raise TaskDataError(f"{spec.task} file {p} has no usable row (labels must be one of {list(spec.labels)}; "
                            f"skipped: {dict(skipped) or 'none, the file has only a header'})")
    return PairData(str(p), examples, dict(skipped), first_skipped)


def featurize_pairs(examples: Sequence[PairExample], tokenizer: TextTokenizer | Tokenizer, max_seq_len: int,
                    name: str) -> EncodedTask:
    """``[CLS] a [SEP] b [SEP]`` rows of ``max_seq_len`` (the longer text cut first, from its end) and ``labels``."""
    if max_seq_len < SPECIALS_PER_PAIR + 2:
        raise ValueError(f"max_seq_len={max_seq_len}: a pair needs at least 5 positions ([CLS] a [SEP] b [SEP])")
    backend, specials = wordpiece_backend(tokenizer)
    texts_a = token_ids(backend, [e.text_a for e in examples])
    texts_b = token_ids(backend, [e.text_b for e in examples])
    budget = max_seq_len - SPECIALS_PER_PAIR
    pairs = [truncate_longer_first(a, b, budget) for a, b in zip(texts_a, texts_b)]
    labels = np.asarray([e.label for e in examples], np.int32)
    return EncodedTask(name, PackedPairs.build(pairs, max_seq_len, specials), {"labels": labels})
