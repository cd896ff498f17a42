"""SQuAD 1.1 / 2.0: the official JSON and document-stride windows with answer positions.

File layout: ``{"data": [{"paragraphs": [{"context", "qas": [{"id", "question", "answers": [{"text",
"answer_start"}], "is_impossible" (2.0)}]}]}]}``.

Each question becomes one or more features ``[CLS] question [SEP] context window [SEP]``: the question cut to
``max_query_length`` tokens, the context tokenized once with character offsets (the ``tokenizers`` library's
alignment to the original text, so no re-tokenizing of words) and covered by windows of as many tokens as fit,
each starting ``doc_stride`` tokens after the previous one (less for the last). A window that holds the whole
first gold answer points ``start_positions`` / ``end_positions`` at its first and last token; every other window,
and every 2.0 impossible question, points both at 0 ([CLS]).
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Sequence

import numpy as np
from tokenizers import Tokenizer

from megajax.data.tasks.encoding import SPECIALS_PER_PAIR, EncodedTask, PackedPairs, encode, wordpiece_backend
from megajax.data.tasks.files import TaskDataError, existing_file, read_json
from megajax.data.tokenizer import TextTokenizer

NO_ANSWER = 0  # the position ([CLS]) that start/end point at when a window holds no answer


@dataclasses.dataclass(frozen=True)
class Answer:
    text: str
    start: int  # character offset of the answer in the context


@dataclasses.dataclass(frozen=True)
class SquadExample:
    """One question; ``answers`` is empty for a 2.0 impossible question (its ``plausible_answers`` are unused)."""

    qid: str
    question: str
    context: str
    answers: tuple[Answer, ...]
    is_impossible: bool = False


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
    return SquadExample(qid, question, context, () if impossible else tuple(answers), impossible)


@dataclasses.dataclass(frozen=True)
class SquadFeatures:
    """The windows of every question: model rows plus what decoding needs to map positions back to text.

    ``task``: rows with targets ``start_positions`` / ``end_positions``. Per feature f: ``example_index[f]`` (into
    ``examples``), ``window_start[f]`` / ``window_length[f]`` (its context tokens, indices into the example's
    ``context_offsets``), ``context_position[f]`` (the sequence position of its first context token, = question
    tokens + 2). ``context_offsets[i]`` (T_i, 2): the character span [begin, end) of each context token of example
    i in its context. ``dropped``: training questions left out (see ``featurize_squad``).
    """

    task: EncodedTask
    examples: list[SquadExample]
    context_offsets: list[np.ndarray]
    example_index: np.ndarray
    window_start: np.ndarray
    window_length: np.ndarray
    context_position: np.ndarray
    dropped: int

    def __len__(self) -> int:
        return len(self.example_index)

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


def _is_aligned(example: SquadExample) -> bool:
    answer = example.answers[0]
    return example.context[answer.start:answer.start + len(answer.text)] == answer.text


def featurize_squad(examples: Sequence[SquadExample], tokenizer: TextTokenizer | Tokenizer, max_seq_len: int = 384,
                    *, doc_stride: int = 128, max_query_length: int = 64, training: bool,
                    name: str = "squad") -> SquadFeatures:
    """Windows of every question (module docstring). With ``training``, questions whose first answer's text is
    not found at its ``answer_start`` are dropped (counted in ``dropped``): they would teach a wrong span. For
    evaluation every question is kept so each gets a prediction."""
    if not (doc_stride >= 1 and max_query_length >= 1 and max_seq_len - max_query_length - SPECIALS_PER_PAIR >= 1):
        raise ValueError(f"doc_stride={doc_stride} and max_query_length={max_query_length} must be >= 1 and leave "
                         f"at least one context token in max_seq_len={max_seq_len} (max_seq_len - max_query_length "
                         "- 3 >= 1)")
    backend, specials = wordpiece_backend(tokenizer)
    keep = [e for e in examples if not (training and e.answers and not _is_aligned(e))]
    questions = [e.ids[:max_query_length] for e in encode(backend, [e.question for e in keep])]
    contexts = list(dict.fromkeys(e.context for e in keep))  # a paragraph's questions share its context
    encoded = dict(zip(contexts, encode(backend, contexts)))
    offsets = {c: np.asarray(e.offsets, np.int32).reshape(-1, 2) for c, e in encoded.items()}
    pairs, starts, ends, meta = [], [], [], []
    for i, (example, question) in enumerate(zip(keep, questions)):
        context_ids = encoded[example.context].ids
        span = answer_tokens(offsets[example.context], example.answers[0]) if example.answers else None
        first = len(question) + 2
        for start, length in windows(len(context_ids), max_seq_len - len(question) - SPECIALS_PER_PAIR, doc_stride):
            pairs.append((question, context_ids[start:start + length]))
            inside = span is not None and start <= span[0] and span[1] < start + length
            starts.append(first + span[0] - start if inside else NO_ANSWER)
            ends.append(first + span[1] - start if inside else NO_ANSWER)
            meta.append((i, start, length, first))
    targets = {"start_positions": np.asarray(starts, np.int32), "end_positions": np.asarray(ends, np.int32)}
    task = EncodedTask(name, PackedPairs.build(pairs, max_seq_len, specials), targets)
    example_index, window_start, window_length, context_position = np.asarray(meta, np.int32).T
    return SquadFeatures(task, keep, [offsets[e.context] for e in keep], example_index, window_start,
                         window_length, context_position, len(examples) - len(keep))
