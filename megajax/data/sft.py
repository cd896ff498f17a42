"""Supervised fine-tuning data (``data.source=sft``): prompt / completion pairs from JSONL, packed into a decoder's
rows with the loss on the completions only.

A row of the file is ``{"prompt": str, "completion": str}`` or a chat, ``{"messages": [{"role", "content"}, ...]}``
whose last message is the assistant's answer (a row with both is refused). A chat is rendered with the chat
template of ``data.tokenizer``'s folder, found and rendered as transformers does (``megajax.data.tokenizer_folder``);
without one, with its default, which the start record names. The file may be gzip- or zstandard-compressed
(``megajax.data.text_files``). Its prompt is the conversation before the answer with the
generation prompt; its completion, the rest of the whole conversation's text. Each example's ids are
``encode(prompt) + encode(completion) + [end-of-document id]``, each text encoded alone with no special tokens
added (a template's own special tokens are in its text). The loss counts the completion's ids and the end id (a
token-weighted mean over the step's batch: ``megajax.training.step``). Examples are packed one after another into
rows of ``max_seq_len + 1`` tokens (``data.sft_packing``; else one per row), each a document of the row
(``megajax.data.documents``: attention within it, positions from 0), the rest of a row padding that counts for
nothing. A bad row is refused with its line number, or skipped and counted with ``data.sft_skip_bad_rows``; an
example longer than a row is refused, or cut to it with ``data.sft_truncate`` (counted). Where the model's
``max_seq_len`` is left at 0 (``configs/sft.py``), a row is as long as the longest example, rounded up
(``default_seq_len``), not the converted model's whole context.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import pathlib
from collections.abc import Callable

import grain
import jinja2
import numpy as np

from megajax.data.documents import packed_row
from megajax.data.settings import DataSettings
from megajax.data.text_files import check_file, text_lines
from megajax.data.tokenizer import TextTokenizer, load_tokenizer
from megajax.data.tokenizer_folder import ChatTemplate, read_chat_template
from megajax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Example:
    """One example's ids: the prompt's, then the completion's ending with the end-of-document id."""

    prompt: tuple[int, ...]
    completion: tuple[int, ...]
    line: int  # its line in the file, from 1


# model.max_seq_len=0 rounds the longest example's inputs up to a multiple of this (divisible by the mesh's usual
# model, context and sequence-parallel splits)
SEQ_MULTIPLE = 128


class BadRow(ValueError):
    """A row of the file that makes no example (the message says why)."""


def render_chat(messages: list, template, specials: dict[str, str]) -> tuple[str, str]:
    """(prompt, completion) texts of a chat: the conversation before its last (assistant) message with the
    generation prompt, and the rest of the whole conversation's rendering."""
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise BadRow('"messages" must be a non-empty list of {"role": str, "content": str}')
    if messages[-1]["role"] != "assistant":
        raise BadRow(f'the last message is the {messages[-1]["role"]!r} one; it must be the assistant\'s answer')
    prompt = template.render(messages=messages[:-1], add_generation_prompt=True, **specials)
    whole = template.render(messages=messages, add_generation_prompt=False, **specials)
    if not whole.startswith(prompt):
        raise BadRow("the chat template renders the conversation without its prompt as its start, so the answer "
                     "cannot be told from the prompt")
    return prompt, whole[len(prompt):]


def training_flag(name: str) -> str:
    """How train.py spells turning on ``data.NAME``."""
    return f"--config.data.{name}=True"


def read_examples(path: str | pathlib.Path, tok: TextTokenizer, template: ChatTemplate, skip_bad: bool,
                  what: str = "", flag: Callable[[str], str] = training_flag) -> tuple[list[Example], list[str]]:
    """The file's examples in order and, with ``skip_bad``, why each skipped row was (else ConfigError on the
    first bad row, naming its line). ``what`` names the file as the user gave it (default ``data.path=PATH``);
    ``flag`` spells the command's option that skips bad rows."""
    what = what or f"data.path={path}"
    compiled = functools.cache(template.compiled)  # at the first chat row: prompt / completion files need none
    examples, skipped = [], []
    for line, text in text_lines(path, what):
        if not text.strip():
            continue
        try:
            prompt, completion = _texts(text, compiled, template)
        except BadRow as e:
            if not skip_bad:
                raise ConfigError(f"{what}, line {line}: {e}; fix the row, or pass {flag('sft_skip_bad_rows')} to "
                                  "skip such rows (counted)") from None
            skipped.append(f"line {line}: {e}")
            continue
        p, c = tok.encode_batch([prompt, completion])
        examples.append(Example(tuple(p), tuple(c) + (tok.eod_id,), line))
    return examples, skipped


def _texts(text: str, compiled: Callable[[], jinja2.Template], template: ChatTemplate) -> tuple[str, str]:
    """(prompt, completion) of one row's JSON text; BadRow saying why it makes no example."""
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadRow(f"not JSON ({e.msg})") from None
    if not isinstance(row, dict):
        raise BadRow("not a JSON object")
    if "messages" in row:
        if "prompt" in row or "completion" in row:
            raise BadRow('the row holds both "messages" and "prompt" / "completion": keep one of them')
        try:
            prompt, completion = render_chat(row["messages"], compiled(), template.specials)
        except jinja2.TemplateError as e:  # the template's own refusal (raise_exception) or a fault
            raise BadRow(f"the chat template ({template.source}) refuses the conversation ({e})") from None
    elif isinstance(row.get("prompt"), str) and isinstance(row.get("completion"), str):
        prompt, completion = row["prompt"], row["completion"]
    else:
        raise BadRow('a row holds "prompt" and "completion" strings, or "messages"')
    if not completion:
        raise BadRow("the completion is empty: there is nothing to learn")
    return prompt, completion


@dataclasses.dataclass(frozen=True)
class PackedRows:
    """Rows of packed examples: ``tokens`` (R, S + 1) and the packed fields (R, S) (``megajax.data.documents``)."""

    fields: dict[str, np.ndarray]
    examples: int
    truncated: int

    def __len__(self) -> int:
        return len(self.fields["tokens"])


def pack(examples: list[Example], seq_len: int, pad_id: int, packing: bool, truncate: bool, what: str = "",
         flag: Callable[[str], str] = training_flag) -> PackedRows:
    """``examples`` in order into rows of ``seq_len + 1`` tokens: as many whole examples as fit (one where not
    ``packing``), the rest padding. An example longer than a row is cut to it where ``truncate``, else refused
    (``what`` and ``flag`` as ``read_examples`` takes them)."""
    width, rows, row, used, truncated = seq_len + 1, [], [], 0, 0
    for ex in examples:
        n = len(ex.prompt) + len(ex.completion)
        if n > width:
            if not truncate:
                longer = "raise model.max_seq_len, " if flag is training_flag else ""
                raise ConfigError(f"{what}, line {ex.line}: the example has {n} tokens, more than a row's {width} "
                                  f"(model.max_seq_len={seq_len} + 1): shorten the row, {longer}or pass "
                                  f"{flag('sft_truncate')} to cut such examples to the row (counted)")
            truncated += 1
        if row and (not packing or used + n > width):
            rows.append(row)
            row, used = [], 0
        row.append(ex)
        used += n
    if row:
        rows.append(row)
    return PackedRows(_row_fields(rows, width, pad_id), len(examples), truncated)


def _row_fields(rows: list[list[Example]], width: int, pad_id: int) -> dict[str, np.ndarray]:
    out = {k: [] for k in ("tokens", "segments", "positions", "loss_weights")}
    for row in rows:
        ids, docs, counted = [], [], []
        for d, ex in enumerate(row):
            ids += [*ex.prompt, *ex.completion]
            docs += [d] * (len(ex.prompt) + len(ex.completion))
            counted += [False] * len(ex.prompt) + [True] * len(ex.completion)
        ids, docs, counted = ids[:width], docs[:width], counted[:width]  # a truncated example fills the row
        pad = width - len(ids)
        ids, docs, counted = ids + [pad_id] * pad, docs + [len(row)] * pad, counted + [False] * pad
        fields = packed_row(np.asarray(docs), reset_positions=True, eod_mask_loss=True)
        fields["loss_weights"] = fields["loss_weights"] * np.asarray(counted[1:], np.float32)
        out["tokens"].append(np.asarray(ids, np.int32))
        for k in ("segments", "positions", "loss_weights"):
            out[k].append(fields[k])
    widths = {"tokens": width}  # the other fields are the row's S = width - 1 inputs'
    return {k: np.stack(v) if v else np.zeros((0, widths.get(k, width - 1)), np.float32 if k == "loss_weights"
                                              else np.int32) for k, v in out.items()}


@dataclasses.dataclass(frozen=True)
class SFTData:
    """A fine-tuning file read, split and packed: its training and validation rows and what was left out."""

    train: PackedRows
    valid: PackedRows
    tokenizer_fingerprint: str
    fingerprint: str  # of the training rows' ids
    skipped: list[str]
    chat_template: str  # the file whose template renders the chat rows, if any (ChatTemplate.source)
    max_seq_len: int  # a row's inputs
    longest_example: int  # tokens, the end-of-document id included

    @property
    def report(self) -> dict:
        """What the start record says of the file (examples, rows, what was cut or skipped, the row length beside
        the longest example, and which chat template rendered chat rows)."""
        return {"examples": self.train.examples + self.valid.examples, "train_rows": len(self.train),
                "valid_rows": len(self.valid), "truncated": self.train.truncated + self.valid.truncated,
                "skipped": len(self.skipped), **({"first_skipped": self.skipped[:3]} if self.skipped else {}),
                "max_seq_len": self.max_seq_len, "longest_example": self.longest_example,
                "chat_template": self.chat_template}


def fine_tuning_file(path: str, tokenizer: str, skip_bad: bool, source: str = "sft",
                     read: Callable = read_examples) -> tuple[TextTokenizer, ChatTemplate, tuple, tuple]:
    """The tokenizer, the chat template and a fine-tuning file's items (``read``: ``read_examples``, or preference
    pairs) and skipped rows; read once per file state, since resolving a run (``default_seq_len``) and loading its
    data both need them. ``source``: the ``data.source`` the messages name."""
    if not path:
        raise ConfigError(f"data.source={source} reads a JSONL file: set --config.data.path=FILE.jsonl")
    p = check_file(path, f"data.path={path}")
    if not tokenizer:
        raise ConfigError(f"data.source={source} needs --config.data.tokenizer=tokenizer.json (the model's tokenizer; "
                          "its folder's chat template renders chat rows)")
    stat = p.stat()
    return _read_file(str(p.resolve()), stat.st_mtime_ns, stat.st_size, path, tokenizer, skip_bad, read)


@functools.lru_cache(maxsize=2)
def _read_file(resolved: str, mtime: int, size: int, path: str, tokenizer: str, skip_bad: bool, read: Callable):
    try:
        tok = load_tokenizer(tokenizer)
    except (OSError, ValueError) as e:
        raise ConfigError(f"data.tokenizer={tokenizer!r}: {e}") from None
    template = read_chat_template(tokenizer)
    items, skipped = read(path, tok, template, skip_bad)
    return tok, template, tuple(items), tuple(skipped)


def default_seq_len(path: str, tokenizer: str, skip_bad: bool, limit: int) -> tuple[int, int]:
    """(the sequence length ``model.max_seq_len=0`` means for a fine-tuning file, the longest example's tokens):
    the longest example's inputs (its tokens less the last) rounded up to a multiple of ``SEQ_MULTIPLE``, at most
    ``limit`` (the model's own; an example longer than that is refused or cut when the rows are packed)."""
    examples = fine_tuning_file(path, tokenizer, skip_bad)[2]
    longest = max((len(ex.prompt) + len(ex.completion) for ex in examples), default=1)
    return min(limit, -(-(longest - 1) // SEQ_MULTIPLE) * SEQ_MULTIPLE or SEQ_MULTIPLE), longest


def split_file(d: DataSettings, source: str = "sft", read: Callable = read_examples, item: str = "example"):
    """(tokenizer, chat template, training items, held-out items, skipped rows) of ``data.path``
    (``fine_tuning_file``), the last ``data.valid_fraction`` of them held out; ConfigError where the tokenizer
    outgrows the model or nothing is left to train on."""
    tok, template, items, skipped = fine_tuning_file(d.path, d.tokenizer, d.sft_skip_bad_rows, source, read)
    if tok.vocab_size > d.vocab_size:
        raise ConfigError(f"data.tokenizer has {tok.vocab_size} ids but model.vocab_size={d.vocab_size}: use the "
                          "model's tokenizer")
    valid = round(len(items) * d.valid_fraction) if d.valid_fraction > 0 else 0
    if len(items) == valid:
        raise ConfigError(f"data.path={d.path} holds no {item} to train on ({len(skipped)} rows skipped)")
    return tok, template, list(items[:len(items) - valid]), list(items[len(items) - valid:]), skipped


def load_sft(d: DataSettings) -> SFTData:
    """``data.path``'s examples with ``data.tokenizer``, the last ``data.valid_fraction`` of them for validation,
    packed for the model's ``max_seq_len``; ConfigError naming the field or line to change."""
    tok, template, train_ex, valid_ex, skipped = split_file(d)
    examples = train_ex + valid_ex
    args = (d.max_seq_len, tok.eod_id, d.sft_packing, d.sft_truncate, f"data.path={d.path}")
    train = pack(train_ex, *args)
    digest = hashlib.sha256(train.fields["tokens"].tobytes() + train.fields["loss_weights"].tobytes()).hexdigest()
    longest = max(len(ex.prompt) + len(ex.completion) for ex in examples)
    return SFTData(train, pack(valid_ex, *args), tok.fingerprint, digest[:16], list(skipped), template.source,
                   d.max_seq_len, longest)


class SFTBatches:
    """Training batches of packed rows (the loader protocol), shuffled lazily per epoch as the task rows are
    (``megajax.data.tasks.batches``): a batch is a pure function of (seed, step)."""

    def __init__(self, rows: PackedRows, global_batch: int, seed: int, fingerprint: str = ""):
        self.rows_, self.global_batch, self.seed, self.fingerprint = rows, global_batch, seed, fingerprint
        self.fields = {k: (v.shape[1:], v.dtype) for k, v in rows.fields.items()}
        self._order = grain.MapDataset.range(len(rows)).shuffle(seed=seed).repeat()

    def rows(self, step: int, start: int, stop: int) -> dict[str, np.ndarray]:
        """Rows ``start:stop`` of the global batch of ``step``."""
        first = step * self.global_batch
        index = np.asarray([self._order[k] for k in range(first + start, first + stop)], np.int64)
        return {k: v[index] for k, v in self.rows_.fields.items()}

    def batch(self, step: int) -> dict[str, np.ndarray]:
        return self.rows(step, 0, self.global_batch)

    def identity(self) -> dict:
        """What a resumed loader must match: the same rows (by digest) and seed."""
        return {"sft_rows": len(self.rows_), "seed": self.seed, "fingerprint": self.fingerprint}
