"""Preference pairs (``data.source=preference``): prompt / chosen / rejected rows from JSONL, each pair packed into a
decoder's row as two documents, the objective's batch (``megajax.models.preference``).

A row of the file is ``{"prompt": str, "chosen": str, "rejected": str}``, or a chat whose ``chosen`` and ``rejected``
are message lists: either whole conversations sharing every turn but their last (the assistant's answers), or the
answers alone beside a ``"prompt"`` list of the turns before them. A chat is rendered with the chat template of
``data.tokenizer``'s folder as the SFT path renders it (``megajax.data.sft.render_chat``). A completion's ids are
``encode(prompt) + encode(completion) + [end-of-document id]``, each text encoded alone with no special tokens added;
its log-probability counts the completion's ids and the end id given the prompt. A pair takes ``2 len(prompt) +
len(chosen) + len(rejected)`` tokens of a row: the prompt with the chosen completion, then the prompt with the rejected
one, each a document (attention within it, positions from 0); up to ``data.pairs_per_row`` pairs share a row (default
one), so a pair never spans rows, micro-batches or data shards. A row without ``"rejected"``, with the same chosen and
rejected text, an empty prompt or completion is bad: refused with its line number, or skipped and counted with
``data.sft_skip_bad_rows``. A pair longer than a row is refused, or with ``data.sft_truncate`` each of its two sequences
(the prompt and a completion) is cut to half a row (counted; a prompt as long as that is refused).
``model.max_seq_len=0`` (``configs/dpo.py``) makes a row as long as the longest pair, rounded up.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import pathlib
from collections.abc import Callable

import jinja2
import numpy as np

from megajax.data.documents import packed_row
from megajax.data.settings import PREFERENCE, DataSettings
from megajax.data.sft import (
    SEQ_MULTIPLE,
    BadRow,
    PackedRows,
    fine_tuning_file,
    render_chat,
    split_file,
    training_flag,
)
from megajax.data.text_files import text_lines
from megajax.data.tokenizer import TextTokenizer
from megajax.data.tokenizer_folder import ChatTemplate
from megajax.errors import ConfigError

NOT_COUNTED = -1  # a target no completion counts (a prompt's, padding)


@dataclasses.dataclass(frozen=True)
class Pair:
    """One pair's ids: the prompt's, and each completion's ending with the end-of-document id."""

    prompt: tuple[int, ...]
    chosen: tuple[int, ...]
    rejected: tuple[int, ...]
    line: int  # its line in the file, from 1

    def __len__(self) -> int:
        """The tokens it takes of a row: the prompt twice and both completions."""
        return 2 * len(self.prompt) + len(self.chosen) + len(self.rejected)


def _messages(value, name: str) -> list:
    if not isinstance(value, list):
        raise BadRow(f'"{name}" must be a list of messages, as "chosen" and "rejected" are')
    return value


def pair_texts(text: str, compiled: Callable[[], jinja2.Template], template: ChatTemplate) -> tuple[str, str, str]:
    """(prompt, chosen, rejected) texts of one row's JSON text; BadRow saying why it makes no pair."""
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadRow(f"not JSON ({e.msg})") from None
    if not isinstance(row, dict):
        raise BadRow("not a JSON object")
    missing = [k for k in ("chosen", "rejected") if k not in row]
    if missing:
        raise BadRow(f'the row has no "{missing[0]}": a pair holds "prompt", "chosen" and "rejected"')
    chosen, rejected, prompt = row["chosen"], row["rejected"], row.get("prompt")
    if isinstance(chosen, str) and isinstance(rejected, str):
        if not isinstance(prompt, str):
            raise BadRow('"chosen" and "rejected" are strings: the row needs a "prompt" string')
    elif isinstance(chosen, list) and isinstance(rejected, list):
        turns = _messages(prompt, "prompt") if prompt is not None else []
        try:
            prompt, chosen = render_chat(turns + chosen, compiled(), template.specials)
            other, rejected = render_chat(turns + _messages(rejected, "rejected"), compiled(), template.specials)
        except jinja2.TemplateError as e:
            raise BadRow(f"the chat template ({template.source}) refuses the conversation ({e})") from None
        if other != prompt:
            raise BadRow('"chosen" and "rejected" do not share the turns before their answers')
    else:
        raise BadRow('"chosen" and "rejected" are both strings (with a "prompt" string) or both message lists')
    if not prompt:
        raise BadRow("the prompt is empty: a completion's log-probability is taken given its prompt")
    if not chosen or not rejected:
        raise BadRow(f"the {'chosen' if not chosen else 'rejected'} completion is empty")
    if chosen == rejected:
        raise BadRow("chosen and rejected are the same text: there is nothing to prefer")
    return prompt, chosen, rejected


def read_pairs(path: str | pathlib.Path, tok: TextTokenizer, template: ChatTemplate, skip_bad: bool,
               what: str = "", flag: Callable[[str], str] = training_flag) -> tuple[list[Pair], list[str]]:
    """The file's pairs in order and, with ``skip_bad``, why each skipped row was (else ConfigError on the first bad
    row, naming its line); ``what`` and ``flag`` as ``data.sft.read_examples`` takes them."""
    what = what or f"data.path={path}"
    compiled = functools.cache(template.compiled)
    pairs, skipped = [], []
    for line, text in text_lines(path, what):
        if not text.strip():
            continue
        try:
            texts = pair_texts(text, compiled, template)
        except BadRow as e:
            if not skip_bad:
                raise ConfigError(f"{what}, line {line}: {e}; fix the row, or pass {flag('sft_skip_bad_rows')} to "
                                  "skip such rows (counted)") from None
            skipped.append(f"line {line}: {e}")
            continue
        p, c, r = tok.encode_batch(list(texts))
        pairs.append(Pair(tuple(p), tuple(c) + (tok.eod_id,), tuple(r) + (tok.eod_id,), line))
    return pairs, skipped


def _fitted(pair: Pair, width: int, truncate: bool, what: str, flag: Callable[[str], str]) -> tuple[Pair, bool]:
    """``pair`` as a row holds it: whole, or cut to half a row a completion where ``truncate`` (and whether it was)."""
    if len(pair) <= width:
        return pair, False
    seq_len = width - 1
    if not truncate:
        longer = "raise model.max_seq_len, " if flag is training_flag else ""
        raise ConfigError(f"{what}, line {pair.line}: the pair takes {len(pair)} tokens (the prompt twice and both "
                          f"completions), more than a row's {width} (model.max_seq_len={seq_len} + 1): shorten the "
                          f"row, {longer}or pass {flag('sft_truncate')} to cut its completions to half a row each "
                          "(counted)")
    room = width // 2 - len(pair.prompt)
    if room < 1:
        raise ConfigError(f"{what}, line {pair.line}: the prompt alone has {len(pair.prompt)} tokens, half a row is "
                          f"{width // 2}: shorten the prompt or raise model.max_seq_len")
    if pair.chosen[:room] == pair.rejected[:room]:
        raise ConfigError(f"{what}, line {pair.line}: cut to half a row ({width // 2} tokens with the prompt), the "
                          "chosen and rejected completions are the same: raise model.max_seq_len or shorten the row")
    return dataclasses.replace(pair, chosen=pair.chosen[:room], rejected=pair.rejected[:room]), True


def pack_pairs(pairs: list[Pair], seq_len: int, pad_id: int, pairs_per_row: int, truncate: bool, what: str = "",
               flag: Callable[[str], str] = training_flag) -> PackedRows:
    """``pairs`` in order into rows of ``seq_len + 1`` tokens, up to ``pairs_per_row`` whole pairs a row, the rest
    padding: ``tokens``, ``segments``, ``positions``, ``completion_slots`` (each target's completion: 2 j chosen,
    2 j + 1 rejected, ``NOT_COUNTED`` else) and ``reference_logps`` (R, 2 pairs_per_row) zeros, which training
    fills (``megajax.training.preference``)."""
    width, rows, row, used, truncated = seq_len + 1, [], [], 0, 0
    for pair in pairs:
        pair, cut = _fitted(pair, width, truncate, what or "data.path", flag)
        truncated += cut
        if row and (len(row) == pairs_per_row or used + len(pair) > width):
            rows.append(row)
            row, used = [], 0
        row.append(pair)
        used += len(pair)
    if row:
        rows.append(row)
    return PackedRows(_row_fields(rows, width, pad_id, pairs_per_row), len(pairs), truncated)


def _row_fields(rows: list[list[Pair]], width: int, pad_id: int, pairs_per_row: int) -> dict[str, np.ndarray]:
    out = {k: [] for k in ("tokens", "segments", "positions", "completion_slots")}
    for row in rows:
        ids, docs, slots = [], [], []
        for j, pair in enumerate(row):
            for k, completion in enumerate((pair.chosen, pair.rejected)):  # documents 2 j and 2 j + 1
                ids += [*pair.prompt, *completion]
                docs += [2 * j + k] * (len(pair.prompt) + len(completion))
                slots += [NOT_COUNTED] * len(pair.prompt) + [2 * j + k] * len(completion)
        pad = width - len(ids)
        ids, slots, docs = ids + [pad_id] * pad, slots + [NOT_COUNTED] * pad, docs + [2 * len(row)] * pad
        fields = packed_row(np.asarray(docs), reset_positions=True, eod_mask_loss=False)
        out["tokens"].append(np.asarray(ids, np.int32))
        out["segments"].append(fields["segments"])
        out["positions"].append(fields["positions"])
        out["completion_slots"].append(np.asarray(slots[1:], np.int32))  # the target at input t is token t + 1
    fields = {k: np.stack(v) if v else np.zeros((0, width if k == "tokens" else width - 1), np.int32)
              for k, v in out.items()}
    fields["reference_logps"] = np.zeros((len(rows), 2 * pairs_per_row), np.float32)
    return fields


@dataclasses.dataclass(frozen=True)
class PreferenceData:
    """A preference file read, split and packed: its training and validation rows and what was left out."""

    train: PackedRows
    valid: PackedRows
    tokenizer_fingerprint: str
    fingerprint: str  # of the training rows' ids
    skipped: list[str]
    chat_template: str
    max_seq_len: int
    longest_pair: int

    @property
    def report(self) -> dict:
        """What the start record says of the file."""
        return {"pairs": self.train.examples + self.valid.examples, "train_rows": len(self.train),
                "valid_rows": len(self.valid), "truncated": self.train.truncated + self.valid.truncated,
                "skipped": len(self.skipped), **({"first_skipped": self.skipped[:3]} if self.skipped else {}),
                "max_seq_len": self.max_seq_len, "longest_pair": self.longest_pair,
                "chat_template": self.chat_template}


def default_seq_len(path: str, tokenizer: str, skip_bad: bool, limit: int) -> int:
    """What ``model.max_seq_len=0`` means for a preference file: the longest pair's tokens less one, rounded up to
    a multiple of ``SEQ_MULTIPLE``, at most ``limit`` (the model's own)."""
    pairs = fine_tuning_file(path, tokenizer, skip_bad, PREFERENCE, read_pairs)[2]
    longest = max((len(p) for p in pairs), default=1)
    return min(limit, -(-(longest - 1) // SEQ_MULTIPLE) * SEQ_MULTIPLE or SEQ_MULTIPLE)


def load_preference(d: DataSettings) -> PreferenceData:
    """``data.path``'s pairs with ``data.tokenizer``, the last ``data.valid_fraction`` of them held out, packed for
    the model's ``max_seq_len``; ConfigError naming the field or line to change."""
    tok, template, train_pairs, valid_pairs, skipped = split_file(d, PREFERENCE, read_pairs, "pair")
    args = (d.max_seq_len, tok.eod_id, d.pairs_per_row, d.sft_truncate, f"data.path={d.path}")
    train = pack_pairs(train_pairs, *args)
    digest = hashlib.sha256(train.fields["tokens"].tobytes() + train.fields["completion_slots"].tobytes())
    return PreferenceData(train, pack_pairs(valid_pairs, *args), tok.fingerprint, digest.hexdigest()[:16],
                          list(skipped), template.source, d.max_seq_len, max(len(p) for p in train_pairs + valid_pairs))
