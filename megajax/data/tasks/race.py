"""RACE reading comprehension: the official per-article JSON files and 4-way multiple-choice rows.

A split directory holds ``middle/`` and ``high/`` (e.g. ``RACE/dev``), each a folder of ``*.txt`` files, one JSON
object per article: ``{"article": str, "questions": [str], "options": [[4 str]], "answers": ["A".."D"]}``. Each
question becomes one example with 4 rows ``[CLS] question+option [SEP] article [SEP]`` (Megatron's order, so
question+option is token type 0 and the article type 1): a question with a blank (``_``) has it filled with the
option, any other gets the option appended after a space. Question+option keeps at most ``MAX_QA_LENGTH`` tokens
and the article fills the rest of the row, cut from its end.

A question is named ``file id:question index`` (the article's ``id``, e.g. ``high132.txt:0``), so predictions join
with the release's files; an article without an ``id`` is named by ``level/file name``.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
from collections.abc import Sequence

import numpy as np
from tokenizers import Tokenizer

from megajax.data.tasks.encoding import SPECIALS_PER_PAIR, EncodedTask, PackedPairs, token_ids, wordpiece_backend
from megajax.data.tasks.files import TaskDataError, read_json
from megajax.data.tokenizer import TextTokenizer

LEVELS = ("middle", "high")
ANSWER_LETTERS = "ABCD"
NUM_OPTIONS = len(ANSWER_LETTERS)
BLANK = re.compile(r"_+")  # one blank, however many underscores it is drawn with
MAX_QA_LENGTH = 128  # Megatron's cap on question+option tokens


@dataclasses.dataclass(frozen=True)
class ChoiceExample:
    """One RACE question; ``qid`` is ``file id:question index`` (module docstring), ``label`` the right option
    (0-3)."""

    qid: str
    article: str
    question: str
    options: tuple[str, ...]
    label: int
    level: str


def read_race(split_dir: str | pathlib.Path) -> list[ChoiceExample]:
    """Every question under ``split_dir/middle`` and ``split_dir/high`` (either may be absent), files sorted."""
    root = pathlib.Path(split_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"RACE split directory {root} does not exist")
    present = [level for level in LEVELS if (root / level).is_dir()]
    if not present:
        raise TaskDataError(f"RACE split directory {root} has neither middle/ nor high/: give a split directory of "
                            "the official release, e.g. RACE/dev")
    examples, seen = [], {}
    for level in present:
        files = sorted((root / level).glob("*.txt"))
        if not files:
            raise TaskDataError(f"RACE directory {root / level} holds no *.txt article files")
        for path in files:
            article_id, questions = _read_article(path, level)
            if article_id in seen:  # two articles under one id would share their questions' prediction keys
                raise TaskDataError(f"RACE files {seen[article_id]} and {path} have the same id {article_id!r}; "
                                    "give each article its own id")
            seen[article_id] = path
            examples.extend(questions)
    return examples


def _read_article(path: pathlib.Path, level: str) -> tuple[str, list[ChoiceExample]]:
    record = read_json(path, "RACE")
    keys = ("article", "questions", "options", "answers")
    if not isinstance(record, dict) or any(k not in record for k in keys):
        raise TaskDataError(f"RACE file {path} is not an article object with keys {list(keys)}")
    questions, options, answers = record["questions"], record["options"], record["answers"]
    if not (isinstance(questions, list) and isinstance(options, list) and isinstance(answers, list)
            and len(questions) == len(options) == len(answers)):
        raise TaskDataError(f"RACE file {path}: questions, options and answers must be lists of one length")
    article_id = record.get("id")
    if not isinstance(article_id, str) or not article_id:
        article_id = f"{level}/{path.name}"
    out = []
    for i, (question, choices, answer) in enumerate(zip(questions, options, answers)):
        if not (isinstance(choices, list) and len(choices) == NUM_OPTIONS and all(isinstance(c, str) for c in choices)):
            raise TaskDataError(f"RACE file {path}, question {i}: expected {NUM_OPTIONS} option strings, "
                                f"got {choices!r}")
        if not (isinstance(answer, str) and len(answer) == 1 and answer in ANSWER_LETTERS):
            raise TaskDataError(f"RACE file {path}, question {i}: answer {answer!r} is not one of A, B, C, D")
        if not isinstance(question, str) or not isinstance(record["article"], str):
            raise TaskDataError(f"RACE file {path}, question {i}: the article and the question must be strings")
        out.append(ChoiceExample(f"{article_id}:{i}", record["article"], question, tuple(choices),
                                 ANSWER_LETTERS.index(answer), level))
    return article_id, out


def fill_blank(question: str, option: str) -> str:
    """The question with its blank filled by ``option``, or ``question option`` when it has no blank."""
    if "_" in question:
        return BLANK.sub(lambda _: option, question)
    return f"{question} {option}"


def _truncate_qa_article(qa: Sequence[int], article: Sequence[int],
                         budget: int) -> tuple[Sequence[int], Sequence[int]]:
    """Question+option cut to ``MAX_QA_LENGTH`` and ``budget`` tokens (from its front, keeping the option that
    ends it), then the article cut from its end to the positions left."""
    qa = qa[max(0, len(qa) - min(MAX_QA_LENGTH, budget)):]
    return qa, article[:budget - len(qa)]


def featurize_race(examples: Sequence[ChoiceExample], tokenizer: TextTokenizer | Tokenizer, max_seq_len: int,
                   name: str = "race") -> EncodedTask:
    """Rows (N, 4, max_seq_len) ``[CLS] question+option [SEP] article [SEP]`` and ``labels`` (N,)."""
    if max_seq_len < SPECIALS_PER_PAIR + 1:
        raise ValueError(f"max_seq_len={max_seq_len}: a RACE row needs at least 4 positions")
    backend, specials = wordpiece_backend(tokenizer)
    articles = list(dict.fromkeys(e.article for e in examples))  # each article once, in order
    article_ids = dict(zip(articles, token_ids(backend, articles)))
    qa_ids = token_ids(backend, [fill_blank(e.question, o) for e in examples for o in e.options])
    budget = max_seq_len - SPECIALS_PER_PAIR
    pairs = [_truncate_qa_article(qa_ids[NUM_OPTIONS * i + j], article_ids[e.article], budget)
             for i, e in enumerate(examples) for j in range(NUM_OPTIONS)]
    labels = np.asarray([e.label for e in examples], np.int32)
    return EncodedTask(name, PackedPairs.build(pairs, max_seq_len, specials, (NUM_OPTIONS,)), {"labels": labels})
