"""The embedded default corpus: the Python standard library's own source, found on every fresh machine.

Built once (a byte-level BPE trained on the corpus with ``tokenizers``, then the same preprocessing pipeline as
user corpora) and cached under ``~/.cache/megajax`` (or ``$MEGAJAX_CACHE``). No network; no text is stored in
this repository.
"""

from __future__ import annotations

import os
import pathlib
import sys
import sysconfig

from megajax.data.indexed import META, IndexedTokens
from megajax.data.preprocess import write_documents
from megajax.data.tokenizer import train_tokenizer

MAX_BYTES = 12 * 2**20  # enough for a tiny model to learn from; keeps the one-off build under a minute
SKIP_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}


def cache_root() -> pathlib.Path:
    return pathlib.Path(os.environ.get("MEGAJAX_CACHE", pathlib.Path.home() / ".cache" / "megajax"))


def stdlib_documents(max_bytes: int = MAX_BYTES) -> list[str]:
    """The standard library's .py files (tests and site-packages excluded), in a fixed order, up to max_bytes."""
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    docs, total = [], 0
    for path in sorted(root.rglob("*.py")):
        if set(path.relative_to(root).parts) & SKIP_DIRS:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # a few files are deliberately not UTF-8
        if text.strip():
            docs.append(text)
            total += len(text.encode())
        if total >= max_bytes:
            break
    if not docs:
        raise FileNotFoundError(f"no Python standard library sources under {root}; preprocess a corpus and pass "
                                "--config.data.source=indexed --config.data.path=PREFIX")
    return docs


def default_corpus(vocab_size: int) -> tuple[IndexedTokens, pathlib.Path]:
    """The indexed stdlib corpus and its tokenizer.json, built on first use (with a progress bar) and cached."""
    tag = f"stdlib-py{sys.version_info.major}{sys.version_info.minor}-bpe{vocab_size}-v2"
    prefix = cache_root() / tag / "corpus"
    tokenizer_path = cache_root() / tag / "tokenizer.json"
    if not pathlib.Path(f"{prefix}{META}").is_file():
        print(f"building the default corpus ({tag}) once, cached in {prefix.parent}", file=sys.stderr)
        docs = stdlib_documents()
        show = sys.stderr.isatty()
        tokenizer = train_tokenizer(docs, "bpe", vocab_size, show_progress=show)
        prefix.parent.mkdir(parents=True, exist_ok=True)
        tokenizer.save(tokenizer_path)
        write_documents(docs, tokenizer, prefix, meta={"source": "python stdlib"}, progress=show)
    return IndexedTokens.open(prefix), tokenizer_path
