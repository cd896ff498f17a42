"""SQuAD 1.1 / 2.0: the official JSON and document-stride windows with answer positions.

File layout: ``{"data": [{"paragraphs": [{"context", "qas": [{"id", "question", "answers": [{"text",
"answer_start"}], "is_impossible" (2.0)}]}]}]}``.

Each question becomes one or more features ``[CLS] question [SEP] context window [SEP]``: the question cut to
``max_query_length`` tokens, the context tokenized once with character offsets (the ``tokenizers`` library's
alignment to the original text, so no re-tokenizing of words) and covered by windows of as many tokens as fit,
each starting ``doc_stride`` tokens after the previous one (less for the last). A window that holds the whole
first gold answer points ``start_positions`` / ``end_positions`` at its first and last token; every other window,
and every 2.0 impossible question, points both at 0 ([CLS]).

For training, a question that would teach a wrong span is left out and counted by reason (``DROP_REASONS``); for
evaluation every question is kept, as the official scripts score every one.
"""

from __future__ import annotations

import collections
import dataclasses
import pathlib
from collections.abc import Sequence

import numpy as np
from tokenizers import Tokenizer

from megajax.data.tasks.encoding import SPECIALS_PER_PAIR, EncodedTask, PackedPairs, encode, wordpiece_backend
from megajax.data.tasks.files import TaskDataError, existing_file, read_json
from megajax.data.tokenizer import TextTokenizer

NO_ANSWER = 0  # the position ([CLS]) that start/end point at when a window holds no answer
# Why a training question is left out, in the order they are tested.
EMPTY_CONTEXT = "empty context"
OFFSET_MISMATCH = "answer text not at its answer_start"
NO_WINDOW = "no window holds the whole answer"
DROP_REASONS = (EMPTY_CONTEXT, OFFSET_MISMATCH, NO_WINDOW)
FIRST_IDS = 5  # question ids named per reason in reports and errors


@dataclasses.dataclass(frozen=True)
class Answer:
    text: str
    start: int  # character offset of the answer in the context


@dataclasses.dataclass(frozen=True)
class SquadExample:
    """One question; ``answers`` is empty for a 2.0 impossible question (its ``plausible_answers`` are unused).

    ``listed_answers``: the answers as the file lists them, when they differ from ``answers`` (an is_impossible
    question that lists answers); None otherwise. The official scripts score against the listed ones.
    """

    qid: str
    question: str
    context: str
    answers: tuple[Answer, ...]
    is_impossible: bool = False
    listed_answers: tuple[Answer, ...] | None = None

    @property
    def gold_texts(self) -> list[str]:
        """The answer texts the official scripts score this question against (all listed, in file order)."""
        return [a.text for a in (self.answers if self.listed_answers is None else self.listed_answers)]

    @property
    def offsets_match(self) -> bool:
        """Whether every listed answer's text is found at its ``answer_start`` in the context."""
        return all(_at_offset(self.context, a)
                   for a in (self.answers if self.listed_answers is None else self.listed_answers))


@dataclasses.dataclass(frozen=True)
class SquadData:
    """A file's questions; ``version_2`` when its questions carry ``is_impossible`` (SQuAD 2.0)."""

    path: str
    examples: list[SquadExample]
    version_2: bool


def read_squad(path: str | pathlib.Path) -> SquadData:
    """Every question of an official SQuAD 1.1 or 2.0 JSON file, in file order."""
    p = existing_file(path, "SQuAD")
    record = read_json(p, "SQuAD")
    if not isinstance(record, dict) or not isinstance(record.get("data"), list):
        raise TaskDataError(f"SQuAD file {p} has no 'data' list: give the official train-v1.1.json / dev-v2.0.json")
    examples, seen, version_2 = [], set(), False
    for i, article in enumerate(record["data"]):
        for j, paragraph in enumerate(_field(article, "paragraphs", list, p, f"data[{i}]")):
            where = f"data[{i}].paragraphs[{j}]"
            context = _field(paragraph, "context", str, p, where)
            for k, qa in enumerate(_field(paragraph, "qas", list, p, where)):
                example = _example(qa, context, p, f"{where}.qas[{k}]")
                if example.qid in seen:
                    raise TaskDataError(f"SQuAD file {p}: question id {example.qid!r} appears twice")
                seen.add(example.qid)
                version_2 |= isinstance(qa, dict) and "is_impossible" in qa
                examples.append(example)
    if not examples:
        raise TaskDataError(f"SQuAD file {p} holds no questions")
    return SquadData(str(p), examples, version_2)


def _field(record, key: str, kind: type | tuple[type, ...], path: pathlib.Path, where: str):
    if not isinstance(record, dict) or not isinstance(record.get(key), kind):
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise TaskDataError(f"SQuAD file {path}: {where} has no {key!r} ({names})")
    return record[key]


def _example(qa, context: str, path: pathlib.Path, where: str) -> SquadExample:
    qid = str(_field(qa, "id", (str, int), path, where))
    question = _field(qa, "question", str, path, where)
    impossible = bool(qa.get("is_impossible", False))
    answers = []
    for a, answer in enumerate(_field(qa, "answers", list, path, where)):
        text = _field(answer, "text", str, path, f"{where}.answers[{a}] (id {qid})")
        start = _field(answer, "answer_start", int, path, f"{where}.answers[{a}] (id {qid})")
        if not 0 <= start <= len(context):
            raise TaskDataError(f"SQuAD file {path}: question {qid} has answer_start {start} outside its context "
                                f"of {len(context)} characters")
        answers.append(Answer(text, start))
    if not impossible and not answers:
        raise TaskDataError(f"SQuAD file {path}: question {qid} has no answers and is not marked is_impossible")
    listed = tuple(answers) if impossible and answers else None
    return SquadExample(qid, question, context, () if impossible else tuple(answers), impossible, listed)


@dataclasses.dataclass(frozen=True)
class SquadFeatures:
    """The windows of every question: model rows plus what decoding needs to map positions back to text.

    ``task``: rows with targets ``start_positions`` / ``end_positions``. Per feature f: ``example_index[f]`` (into
    ``examples``), ``window_start[f]`` / ``window_length[f]`` (its context tokens, indices into the example's
    ``context_offsets``), ``context_position[f]`` (the sequence position of its first context token, = question
    tokens + 2). ``context_offsets[i]`` (T_i, 2): the character span [begin, end) of each context token of example
    i in its context. ``questions``: how many questions were given. ``dropped_questions`` (reason -> question ids,
    in file order) and ``dropped_features`` (reason -> the windows they would have had): training questions left
    out (``featurize_squad``). ``broken_offsets``: the ids of the questions given with an answer that is not at
    its answer_start (kept for evaluation, dropped for training).
    """

    task: EncodedTask
    examples: list[SquadExample]
    context_offsets: list[np.ndarray]
    example_index: np.ndarray
    window_start: np.ndarray
    window_length: np.ndarray
    context_position: np.ndarray
    questions: int = 0
    dropped_questions: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    dropped_features: dict[str, int] = dataclasses.field(default_factory=dict)
    broken_offsets: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.example_index)

    @property
    def dropped(self) -> int:
        """How many questions were left out."""
        return sum(len(ids) for ids in self.dropped_questions.values())

    def drop_summary(self) -> str:
        """The questions left out per reason with their first ids, e.g. ``3 answer text not at its answer_start
        (ids a, b, c)``; empty when none was."""
        return drop_summary(self.dropped_questions)

    def report(self) -> dict:
        """What was read and what was left out, for the training start record and eval.py's results."""
        out = {"questions": self.questions, "features": len(self), "broken_offsets": len(self.broken_offsets)}
        if self.broken_offsets:
            out["broken_offset_ids"] = list(self.broken_offsets[:FIRST_IDS])
        if self.dropped:
            out["dropped_questions"] = self.dropped
            out["dropped_features"] = sum(self.dropped_features.values())
            out["dropped"] = {reason: {"questions": len(ids), "features": self.dropped_features[reason],
                                       "first_ids": list(ids[:FIRST_IDS])}
                              for reason, ids in self.dropped_questions.items()}
        return out

    def context_mask(self, feature: int) -> np.ndarray:
        """(S,) bool: the positions of ``feature`` that hold context tokens."""
        positions = np.arange(self.task.inputs.seq_len) - self.context_position[feature]
        return (positions >= 0) & (positions < self.window_length[feature])

    def position_offsets(self, feature: int) -> np.ndarray:
        """(S, 2) int32: the context character span [begin, end) of each position of ``feature``; -1 outside the
        context ([CLS], the question, [SEP]s, padding)."""
        out = np.full((self.task.inputs.seq_len, 2), -1, np.int32)
        first, n = self.context_position[feature], self.window_length[feature]
        start = self.window_start[feature]
        out[first:first + n] = self.context_offsets[self.example_index[feature]][start:start + n]
        return out


def windows(num_tokens: int, max_tokens: int, doc_stride: int) -> list[tuple[int, int]]:
    """(start, length) of the windows over ``num_tokens`` context tokens: each at most ``max_tokens`` long, each
    starting ``min(length, doc_stride)`` after the previous, the last one reaching the end (one empty window for
    an empty context, so every question gets a prediction)."""
    out, start = [], 0
    while True:
        length = min(num_tokens - start, max_tokens)
        out.append((start, length))
        if start + length >= num_tokens:
            return out
        start += min(length, doc_stride)


def answer_tokens(offsets: np.ndarray, answer: Answer) -> tuple[int, int] | None:
    """The first and last context token overlapping the answer's characters, or None when no token does (an
    answer of whitespace only)."""
    begin, end = answer.start, answer.start + len(answer.text)
    first = int(np.searchsorted(offsets[:, 1], begin, side="right"))  # first token ending after the answer begins
    last = int(np.searchsorted(offsets[:, 0], end, side="left")) - 1  # last token beginning before it ends
    return (first, last) if first <= last else None


def _at_offset(context: str, answer: Answer) -> bool:
    return context[answer.start:answer.start + len(answer.text)] == answer.text


def drop_summary(dropped: dict[str, Sequence[str]]) -> str:
    """``N reason (ids a, b, ...)`` per reason, joined by commas; the first ``FIRST_IDS`` ids of each."""
    return ", ".join(f"{len(ids)} {reason} (id{'s' if len(ids) > 1 else ''} "
                     f"{', '.join(ids[:FIRST_IDS])}{', ...' if len(ids) > FIRST_IDS else ''})"
                     for reason, ids in dropped.items() if ids)


def _drop_reason(example: SquadExample, context_ids: Sequence[int], span: tuple[int, int] | None,
                 cover: list[tuple[int, int]]) -> str | None:
    """Why a training question would teach a wrong span, or None when it can train; ``cover``: its windows."""
    if not context_ids:
        return EMPTY_CONTEXT
    if not example.answers:
        return None  # 2.0 impossible: every window points at [CLS]
    if not _at_offset(example.context, example.answers[0]):
        return OFFSET_MISMATCH
    if span is None or not any(start <= span[0] and span[1] < start + length for start, length in cover):
        return NO_WINDOW  # all its windows would teach "no answer"
    return None


MAX_QUERY_LENGTH = 64  # question tokens kept (BERT's run_squad.py)
MIN_SEQ_LEN = MAX_QUERY_LENGTH + SPECIALS_PER_PAIR + 1  # the shortest window that holds a context token


def featurize_squad(examples: Sequence[SquadExample], tokenizer: TextTokenizer | Tokenizer, max_seq_len: int = 384,
                    *, doc_stride: int = 128, max_query_length: int = MAX_QUERY_LENGTH, training: bool,
                    name: str = "squad", source: str = "") -> SquadFeatures:
    """Windows of every question (module docstring). With ``training``, a question whose context has no token,
    whose first answer's text is not at its ``answer_start``, or whose first answer no window holds whole, is
    left out and counted by reason (``dropped_questions``, ``dropped_features``): it would teach a wrong span. When
    every question is left out, TaskDataError names the reasons and ``source`` (default ``name``). For evaluation
    every question is kept so each gets a prediction."""
    if not (doc_stride >= 1 and max_query_length >= 1 and max_seq_len - max_query_length - SPECIALS_PER_PAIR >= 1):
        raise ValueError(f"doc_stride={doc_stride} and max_query_length={max_query_length} must be >= 1 and leave "
                         f"at least one context token in max_seq_len={max_seq_len} (max_seq_len - max_query_length "
                         "- 3 >= 1)")
    backend, specials = wordpiece_backend(tokenizer)
    questions = [e.ids[:max_query_length] for e in encode(backend, [e.question for e in examples])]
    contexts = list(dict.fromkeys(e.context for e in examples))  # a paragraph's questions share its context
    encoded = dict(zip(contexts, encode(backend, contexts)))
    offsets = {c: np.asarray(e.offsets, np.int32).reshape(-1, 2) for c, e in encoded.items()}
    keep, dropped, dropped_windows = [], collections.defaultdict(list), collections.Counter()
    pairs, starts, ends, meta = [], [], [], []
    for example, question in zip(examples, questions):
        context_ids = encoded[example.context].ids
        cover = windows(len(context_ids), max_seq_len - len(question) - SPECIALS_PER_PAIR, doc_stride)
        aligned = bool(example.answers) and _at_offset(example.context, example.answers[0])
        span = answer_tokens(offsets[example.context], example.answers[0]) if aligned else None
        reason = _drop_reason(example, context_ids, span, cover) if training else None
        if reason is not None:
            dropped[reason].append(example.qid)
            dropped_windows[reason] += len(cover)
            continue
        i, first = len(keep), len(question) + 2
        keep.append(example)
        for start, length in cover:
            pairs.append((question, context_ids[start:start + length]))
            inside = span is not None and start <= span[0] and span[1] < start + length
            starts.append(first + span[0] - start if inside else NO_ANSWER)
            ends.append(first + span[1] - start if inside else NO_ANSWER)
            meta.append((i, start, length, first))
    dropped = {reason: tuple(dropped[reason]) for reason in DROP_REASONS if dropped[reason]}
    if not keep:
        raise TaskDataError(f"{source or name}: none of its {len(examples)} questions can train: "
                            f"{drop_summary(dropped)}. answer_start must be the 0-based character offset of the "
                            "answer's text in its context; check the file (or raise model.max_seq_len if no window "
                            "holds the answers)")
    targets = {"start_positions": np.asarray(starts, np.int32), "end_positions": np.asarray(ends, np.int32)}
    task = EncodedTask(name, PackedPairs.build(pairs, max_seq_len, specials), targets)
    example_index, window_start, window_length, context_position = np.asarray(meta, np.int32).T
    broken = tuple(e.qid for e in examples if not e.offsets_match)
    return SquadFeatures(task, keep, [offsets[e.context] for e in keep], example_index, window_start,
                         window_length, context_position, len(examples), dropped,
                         {reason: dropped_windows[reason] for reason in dropped}, broken)
