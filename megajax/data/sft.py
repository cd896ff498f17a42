"""Supervised fine-tuning data (``data.source=sft``): prompt / completion pairs from JSONL, packed into a decoder's
rows with the loss on the completions only.

A row of the file is ``{"prompt": str, "completion": str}`` or a chat, ``{"messages": [{"role", "content"}, ...]}``
whose last message is the assistant's answer. A chat is rendered with the chat template of the tokenizer's
``tokenizer_config.json`` (beside ``data.tokenizer``) as transformers renders it (jinja2, the same environment
options); without one, with ``DEFAULT_TEMPLATE``. Its prompt is the conversation before the answer with the
generation prompt; its completion, the rest of the whole conversation's text. Each example's ids are
``encode(prompt) + encode(completion) + [end-of-document id]``, each text encoded alone with no special tokens
added (a template's own special tokens are in its text). The loss counts the completion's ids and the end id (a
token-weighted mean over the step's batch: ``megajax.training.step``). Examples are packed one after another into
rows of ``max_seq_len + 1`` tokens (``data.sft_packing``; else one per row), each a document of the row
(``megajax.data.documents``: attention within it, positions from 0), the rest of a row padding that counts for
nothing. A bad row is refused with its line number, or skipped and counted with ``data.sft_skip_bad_rows``; an
example longer than a row is refused, or cut to it with ``data.sft_truncate`` (counted).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import pathlib

import grain
import jinja2
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

from megajax.data.documents import packed_row
from megajax.data.settings import DataSettings
from megajax.data.tokenizer import TextTokenizer, load_tokenizer
from megajax.errors import ConfigError

# A documented default for tokenizers without a chat template: one "role: content" line per message, and
# "assistant: " as the generation prompt.
DEFAULT_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                    "{% if add_generation_prompt %}assistant: {% endif %}")


@dataclasses.dataclass(frozen=True)
class Example:
    """One example's ids: the prompt's, then the completion's ending with the end-of-document id."""

    prompt: tuple[int, ...]
    completion: tuple[int, ...]
    line: int  # its line in the file, from 1


def chat_template(tokenizer_path: str | pathlib.Path) -> tuple[str | None, dict[str, str]]:
    """The chat template of the ``tokenizer_config.json`` beside a tokenizer (its default one where it names
    several) and the special tokens' texts a template reads (``bos_token``, ``eos_token``, ...); (None, {}) where
    there is none."""
    p = pathlib.Path(tokenizer_path)
    config = (p if p.is_dir() else p.parent) / "tokenizer_config.json"
    if not config.is_file():
        return None, {}
    data = json.loads(config.read_text(encoding="utf-8"))
    template = data.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}]: the default one
        template = {t["name"]: t["template"] for t in template}.get("default")
    specials = {k: (v["content"] if isinstance(v, dict) else v) for k, v in data.items()
                if k.endswith("_token") and isinstance(v, (str, dict))}
    return template, specials


def compile_template(template: str):
    """A jinja2 template in the environment transformers renders chat templates in (sandboxed, blocks trimmed,
    loop controls, ``raise_exception``, ``strftime_now``, a ``tojson`` that leaves non-ASCII as it is)."""
    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.datetime.now().strftime(f))
    return env.from_string(template)


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


def read_examples(path: str | pathlib.Path, tok: TextTokenizer, template, specials: dict[str, str],
                  skip_bad: bool) -> tuple[list[Example], list[str]]:
    """The file's examples in order and, with ``skip_bad``, why each skipped row was (else ConfigError on the
    first bad row, naming its line)."""
    examples, skipped = [], []
    with open(path, encoding="utf-8") as f:
        for line, text in enumerate(f, 1):
            if not text.strip():
                continue
            try:
                try:
                    row = json.loads(text)
                except json.JSONDecodeError as e:
                    raise BadRow(f"not JSON ({e.msg})") from None
                if not isinstance(row, dict):
                    raise BadRow("not a JSON object")
                if "messages" in row:
                    try:
                        prompt, completion = render_chat(row["messages"], template, specials)
                    except jinja2.TemplateError as e:  # the template's own refusal (raise_exception) or a fault
                        raise BadRow(f"the chat template refuses the conversation ({e})") from None
                elif isinstance(row.get("prompt"), str) and isinstance(row.get("completion"), str):
                    prompt, completion = row["prompt"], row["completion"]
                else:
                    raise BadRow('a row holds "prompt" and "completion" strings, or "messages"')
                if not completion:
                    raise BadRow("the completion is empty: there is nothing to learn")
            except BadRow as e:
                if not skip_bad:
                    raise ConfigError(f"data.path={path}, line {line}: {e}; fix the row, or pass "
                                      "--config.data.sft_skip_bad_rows=True to skip such rows (counted)") from None
                skipped.append(f"line {line}: {e}")
                continue
            p, c = tok.encode_batch([prompt, completion])
            examples.append(Example(tuple(p), tuple(c) + (tok.eod_id,), line))
    return examples, skipped


@dataclasses.dataclass(frozen=True)
class PackedRows:
    """Rows of packed examples: ``tokens`` (R, S + 1) and the packed fields (R, S) (``megajax.data.documents``)."""

    fields: dict[str, np.ndarray]
    examples: int
    truncated: int

    def __len__(self) -> int:
        return len(self.fields["tokens"])


def pack(examples: list[Example], seq_len: int, pad_id: int, packing: bool, truncate: bool,
         path: str = "") -> PackedRows:
    """``examples`` in order into rows of ``seq_len + 1`` tokens: as many whole examples as fit (one where not
    ``packing``), the rest padding. An example longer than a row is cut to it where ``truncate``, else refused."""
    width, rows, row, used, truncated = seq_len + 1, [], [], 0, 0
    for ex in examples:
        n = len(ex.prompt) + len(ex.completion)
        if n > width:
            if not truncate:
                raise ConfigError(f"data.path={path}, line {ex.line}: the example has {n} tokens and a row "
                                  f"{width} (model.max_seq_len + 1): raise model.max_seq_len, shorten the row, or "
                                  "pass --config.data.sft_truncate=True to cut such examples to the row (counted)")
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

    @property
    def report(self) -> dict:
        """What the start record says of the file (examples, rows, what was cut or skipped)."""
        return {"examples": self.train.examples + self.valid.examples, "train_rows": len(self.train),
                "valid_rows": len(self.valid), "truncated": self.train.truncated + self.valid.truncated,
                "skipped": len(self.skipped), **({"first_skipped": self.skipped[:3]} if self.skipped else {})}


def load_sft(d: DataSettings) -> SFTData:
    """``data.path``'s examples with ``data.tokenizer``, the last ``data.valid_fraction`` of them for validation,
    packed for the model's ``max_seq_len``; ConfigError naming the field or line to change."""
    if not d.path or not pathlib.Path(d.path).is_file():
        raise ConfigError(f"data.source=sft reads a JSONL file: set --config.data.path=FILE.jsonl (got {d.path!r})")
    if not d.tokenizer:
        raise ConfigError("data.source=sft needs --config.data.tokenizer=tokenizer.json (the model's tokenizer; a "
                          "tokenizer_config.json beside it gives the chat template)")
    try:
        tok = load_tokenizer(d.tokenizer)
    except (OSError, ValueError) as e:
        raise ConfigError(f"data.tokenizer={d.tokenizer!r}: {e}") from None
    if tok.vocab_size > d.vocab_size:
        raise ConfigError(f"data.tokenizer has {tok.vocab_size} ids but model.vocab_size={d.vocab_size}: use the "
                          "model's tokenizer")
    text, specials = chat_template(d.tokenizer)
    examples, skipped = read_examples(d.path, tok, compile_template(text or DEFAULT_TEMPLATE), specials,
                                      d.sft_skip_bad_rows)
    valid = round(len(examples) * d.valid_fraction) if d.valid_fraction > 0 else 0
    train_ex, valid_ex = examples[:len(examples) - valid], examples[len(examples) - valid:]
    if not train_ex:
        raise ConfigError(f"data.path={d.path} holds no example to train on ({len(skipped)} rows skipped)")
    args = (d.max_seq_len, tok.eod_id, d.sft_packing, d.sft_truncate, d.path)
    train = pack(train_ex, *args)
    digest = hashlib.sha256(train.fields["tokens"].tobytes() + train.fields["loss_weights"].tobytes()).hexdigest()
    return SFTData(train, pack(valid_ex, *args), tok.fingerprint, digest[:16], skipped)


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
