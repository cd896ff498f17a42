"""eval.py's inputs, read and checked against the checkpoint's model before any model is loaded or compiled:
the tokenizer, the data files, token ids against the model's vocabulary, and the sliding-window stride. What a
checkpoint says of its model and training data comes as its ``StoredRun`` (``config.load.read_stored_run``), read
before the mesh is known."""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np

from megajax.config import StoredRun
from megajax.data.indexed import META, IndexedTokens
from megajax.data.sources import CONVERTED, make_loader, trained_tokenizer
from megajax.data.text_files import text_lines
from megajax.data.tokenizer import TextTokenizer, load_tokenizer
from megajax.errors import ConfigError, UserError
from megajax.evaluation.detokenize import original_token_count, wikitext_detokenize

PAPER_STRIDE = 32  # the paper's WikiText-103 overlap (Megatron-LM's --overlapping-eval default)


class InputError(UserError, ValueError):
    """A bad eval.py input (flag, file or checkpoint/data mismatch); the message says what to change."""


def tokenizer_for(stored: StoredRun, explicit: str | None) -> TextTokenizer:
    """The tokenizer given, else the one the checkpoint's training data used."""
    if explicit:
        return load_tokenizer(explicit)
    d = stored.dataset
    if d.source == CONVERTED and not d.tokenizer:
        raise InputError("this checkpoint was converted from a model directory that held no tokenizer megajax reads "
                         "(tokenizer.json, vocab.json + merges.txt, or vocab.txt); pass --tokenizer=PATH")
    try:
        path = trained_tokenizer(d, stored.model_spec.examples)
        if path:
            return load_tokenizer(path)
    except (OSError, ValueError, KeyError) as e:
        raise InputError(f"the tokenizer this checkpoint was trained with cannot be loaded (config.data.source="
                         f"{d.source!r}; the training data may have moved or been deleted): {e}; pass --tokenizer="
                         "PATH (its tokenizer.json, vocab.json + merges.txt, or vocab.txt)") from e
    raise InputError("this checkpoint does not say which tokenizer it was trained with; pass --tokenizer=PATH")


def check_vocabulary(fingerprint: str, stored: StoredRun, what: str) -> None:
    """Raises InputError when ``what`` (a tokenizer or a dataset) has another vocabulary than the one the
    checkpoint's training data had (``data.tokenizer_fingerprint``; either unknown: no check): of the same size, it
    would pass every other check while the model reads every id as another token."""
    recorded = stored.dataset.tokenizer_fingerprint
    if recorded and fingerprint and recorded != fingerprint:
        raise InputError(f"{what} has another vocabulary than the checkpoint was trained with (tokenizer "
                         f"fingerprints {fingerprint} and {recorded}): the model would read every id as another "
                         "token; use the tokenizer of its training data (--tokenizer=PATH), or data made with it")


def check_tokenizer(tokenizer: TextTokenizer, stored: StoredRun) -> None:
    """Raises when the tokenizer can produce ids the model cannot embed (they would score NaN), or is not the
    vocabulary the checkpoint was trained with."""
    vocab_size = stored.model.vocab_size
    if tokenizer.vocab_size > vocab_size:
        raise InputError(f"tokenizer {tokenizer.source} has {tokenizer.vocab_size} ids but the checkpoint's model "
                         f"has model.vocab_size={vocab_size}; pass --tokenizer=PATH with the tokenizer the model "
                         "was trained with")
    check_vocabulary(tokenizer.fingerprint, stored, f"tokenizer {tokenizer.source}")


def read_text(path: str | pathlib.Path) -> str:
    """A UTF-8 data file (plain or compressed: ``megajax.data.text_files``) that holds more than whitespace."""
    p = pathlib.Path(path)
    text = "".join(line for _, line in text_lines(p, f"--data={p}", keep_ends=True))
    if not text.strip():
        raise InputError(f"--data={p} is empty (or only whitespace): nothing to evaluate")
    return text


@dataclasses.dataclass
class WikiText:
    """A WikiText test file, detokenized and encoded, with its original word-level token count T_o."""

    path: str
    tokens: np.ndarray  # (T,) int32 subword ids
    original_tokens: int


def read_wikitext(path: str | pathlib.Path, tokenizer: TextTokenizer) -> WikiText:
    raw = read_text(path)
    tokens = np.asarray(tokenizer.encode_batch([wikitext_detokenize(raw)])[0], np.int32)
    if len(tokens) < 2:
        raise InputError(f"--data={path} encodes to {len(tokens)} token(s); at least 2 are needed to score one")
    return WikiText(str(path), tokens, original_token_count(raw))  # T_o counted before detokenizing


def read_lambada(path: str | pathlib.Path, tokenizer: TextTokenizer, seq_len: int) -> list[tuple[list[int], list[int]]]:
    """(context ids, last-word ids) for each line ``{"text": ...}`` of a LAMBADA jsonl; blank lines are skipped,
    any other unusable line is an error naming it."""
    examples = []
    for n, line in enumerate(read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            text = json.loads(line)["text"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise InputError(f"{path}:{n}: expected one JSON object with a 'text' field per line "
                             "(lambada_test.jsonl)") from e
        text = text.strip() if isinstance(text, str) else ""
        cut = text.rfind(" ")
        context, target = tokenizer.encode_batch([text[:cut], text[cut:]]) if cut > 0 else ([], [])
        if not context or not target:
            raise InputError(f"{path}:{n}: 'text' must be a context and a last word separated by a space, "
                             f"got {text[:80]!r}")
        if len(target) > seq_len:
            raise InputError(f"{path}:{n}: the last word is {len(target)} tokens, more than the model's "
                             f"max_seq_len={seq_len}")
        examples.append((context, target))
    return examples


def read_token_file(prefix: str | pathlib.Path, stored: StoredRun) -> np.ndarray:
    """The (memory-mapped) tokens of a preprocessed dataset, checked to hold only ids the model embeds, made with
    the checkpoint's vocabulary."""
    vocab_size = stored.model.vocab_size
    try:
        data = IndexedTokens.open(prefix)
    except (OSError, ValueError) as e:
        raise InputError(f"--data={prefix}: {e}") from e
    check_vocabulary(data.tokenizer_fingerprint(), stored, f"--data={prefix}")
    made_for = data.meta.get("vocab_size")
    if made_for is not None and made_for > vocab_size:
        raise InputError(f"--data={prefix} was preprocessed with a tokenizer of {made_for} ids ({prefix}{META}) but "
                         f"the model has model.vocab_size={vocab_size}; preprocess the data with the model's "
                         "tokenizer")
    if len(data.tokens) < 2:
        raise InputError(f"--data={prefix} holds {len(data.tokens)} token(s); at least 2 are needed to score one")
    top = int(data.tokens.max())  # one pass over the file; damaged or foreign files hold larger ids
    if top >= vocab_size:
        raise InputError(f"--data={prefix} holds token id {top}, but the model has model.vocab_size={vocab_size} "
                         "(ids 0..vocab_size-1): the .bin file is damaged or from another tokenizer; preprocess "
                         "the data again with the model's tokenizer")
    return data.tokens


def check_model_kind(task: str, stored: StoredRun) -> None:
    """Raises InputError unless the checkpoint's model is the one ``task`` evaluates (the model's spec lists its
    eval tasks), naming the tasks that apply to it instead."""
    spec = stored.model_spec
    if task not in spec.eval_tasks:
        hint = f"use --task={' or '.join(spec.eval_tasks)}" if spec.eval_tasks else "eval.py has no task for it"
        raise InputError(f"--task={task} does not apply to this checkpoint's model ({spec.name}); {hint}")


def bert_eval_batches(stored: StoredRun, prefix: str | None, batch_size: int):
    """(BERT batches, what they are) for ``--task=mlm``: the whole of ``--data=PREFIX`` (sentence-split), else the
    validation split of the checkpoint's own training data; checked against the model's vocabulary."""
    dataset = dataclasses.replace(stored.dataset, global_batch_size=batch_size)
    if prefix:
        dataset = dataclasses.replace(dataset, source="indexed", path=str(prefix), valid_fraction=0.0)
        try:
            fingerprint = IndexedTokens.open(prefix).tokenizer_fingerprint()
        except (OSError, ValueError):
            fingerprint = ""  # the loader below opens it again and says what is wrong
        check_vocabulary(fingerprint, stored, f"--data={prefix}")
    where = f"--data={prefix}" if prefix else f"the validation split of the checkpoint's data ({dataset.source})"
    try:
        return make_loader(dataset, stored.model_spec.examples, "train" if prefix else "valid").batches, where
    except (ConfigError, OSError, ValueError) as e:
        raise InputError(f"{where}: {e}" + ("" if prefix else "; pass --data=PREFIX")) from e
