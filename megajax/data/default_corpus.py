"""The embedded default corpus: the Python standard library's own source, found on every fresh machine.

Built once (BPE trained on the corpus with the ``tokenizers`` library, then the whole corpus encoded) and cached
under ``~/.cache/megajax`` (or ``$MEGAJAX_CACHE``). No network; no text is stored in this repository.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import sysconfig
import tempfile

import numpy as np

EOS = "<|endoftext|>"
MAX_BYTES = 12 * 2**20  # enough for a tiny model to learn from; keeps the one-off build under a minute


def cache_root() -> pathlib.Path:
    return pathlib.Path(os.environ.get("MEGAJAX_CACHE", pathlib.Path.home() / ".cache" / "megajax"))


def stdlib_documents(max_bytes: int = MAX_BYTES) -> list[str]:
    """The standard library's .py files (tests and site-packages excluded), in a fixed order, up to max_bytes."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    docs, total = [], 0
    for path in sorted(root.rglob("*.py")):
        parts = set(path.relative_to(root).parts)
        if parts & {"site-packages", "test", "tests", "idle_test", "__pycache__"}:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a few files are deliberately not UTF-8
        if not text.strip():
            continue
        docs.append(text)
        total += len(text.encode())
        if total >= max_bytes:
            break
    if not docs:
        raise FileNotFoundError(f"no Python standard library sources under {root}; pass a token file with "
                                "--config.data.source=tokens --config.data.path=FILE.npy")
    return docs


def _train_tokenizer(docs: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=sys.stderr.isatty(),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(docs, trainer)
    return tok


def default_corpus(vocab_size: int) -> tuple[np.ndarray, pathlib.Path]:
    """(tokens as uint16, tokenizer.json path) for the stdlib corpus; built on first use, then memory-mapped."""
    if vocab_size > 2**16:
        raise ValueError(f"default corpus vocab_size {vocab_size} does not fit uint16")
    tag = f"stdlib-py{sys.version_info.major}{sys.version_info.minor}-bpe{vocab_size}-v1"
    out = cache_root() / tag
    tokens_path, tok_path = out / "tokens.npy", out / "tokenizer.json"
    if not tokens_path.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        print(f"building the default corpus ({tag}) once; cached in {out}", file=sys.stderr)
        docs = stdlib_documents()
        tok = _train_tokenizer(docs, vocab_size)
        eos = tok.token_to_id(EOS)
        ids = []
        for enc in tok.encode_batch(docs):
            ids.extend(enc.ids)
            ids.append(eos)
        tmp = pathlib.Path(tempfile.mkdtemp(dir=out.parent, prefix=tag + ".tmp"))
        np.save(tmp / "tokens.npy", np.asarray(ids, dtype=np.uint16))
        tok.save(str(tmp / "tokenizer.json"))
        (tmp / "meta.json").write_text(json.dumps({"documents": len(docs), "tokens": len(ids),
                                                   "vocab_size": vocab_size, "eos_id": eos}))
        try:
            tmp.rename(out)  # atomic: a half-built cache is never taken for a complete one
        except OSError:  # another process finished first
            pass
    return np.load(tokens_path, mmap_mode="r"), tok_path
