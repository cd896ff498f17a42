"""The embedded default corpora, found on every fresh machine: for GPT the Python standard library's own source;
for BERT the English prose shipped with Python (the language reference's help topics and the modules' docstrings),
split into sentences.

Built once (a byte-level BPE or a WordPiece trained on the corpus with ``tokenizers``, then the same preprocessing
pipeline as user corpora) and cached under ``~/.cache/megajax`` (or ``$MEGAJAX_CACHE``). No network; no text is
stored in this repository.
"""

from __future__ import annotations

import inspect
import os
import pathlib
import re
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


BERT_MAX_BYTES = 3 * 2**20  # more than all the prose there is (Python 3.11: 2.1 MB)


# A triple-quoted string that opens a module or follows a line ending in ':' (a def/class header): a docstring.
# A regular expression instead of ast.parse: ten times faster on the whole library, and it finds ~95% of the text.
DOCSTRING = re.compile(r'(?:\A(?:[ \t]*(?:#[^\n]*)?\n)*|:[ \t]*(?:#[^\n]*)?\n)[ \t]*[rRuU]?("""|\'\'\')(.*?)\1', re.S)


def _docstrings(source: str) -> str:
    """The docstrings of a module's source, doctest lines dropped, one paragraph each."""
    texts = []
    for match in DOCSTRING.finditer(source):
        lines = inspect.cleandoc(match.group(2)).splitlines()
        texts.append("\n".join(ln for ln in lines if not ln.lstrip().startswith((">>>", "..."))).strip())
    return "\n\n".join(t for t in texts if t)


def stdlib_prose(max_bytes: int = BERT_MAX_BYTES) -> list[str]:
    """English prose shipped with Python: each topic of the language reference's help text (pydoc_data.topics)
    is a document, then each standard library module's docstrings (tests and site-packages excluded) are one."""
    from pydoc_data.topics import topics

    docs = [text for _, text in sorted(topics.items())]
    total = sum(len(d.encode()) for d in docs)
    root = pathlib.Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        if total >= max_bytes:
            break
        if set(path.relative_to(root).parts) & SKIP_DIRS:
            continue
        try:
            text = _docstrings(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
        if text:
            docs.append(text)
            total += len(text.encode())
    return docs


def default_bert_corpus(vocab_size: int) -> tuple[IndexedTokens, pathlib.Path]:
    """The sentence-split, WordPiece (lower-cased) stdlib prose corpus and its tokenizer.json, built on first use
    and cached like ``default_corpus``."""
    tag = f"stdlib-prose-py{sys.version_info.major}{sys.version_info.minor}-wordpiece{vocab_size}-v1"
    prefix = cache_root() / tag / "corpus"
    if not pathlib.Path(f"{prefix}{META}").is_file():
        print(f"building the default BERT corpus ({tag}) once, cached in {prefix.parent}", file=sys.stderr)
        docs = stdlib_prose()
        show = sys.stderr.isatty()
        tokenizer = train_tokenizer(docs, "wordpiece", vocab_size, show_progress=show)
        write_documents(docs, tokenizer, prefix, meta={"source": "python stdlib prose"}, min_tokens=0,
                        split_sentences=True, progress=show)
    data = IndexedTokens.open(prefix)
    return data, data.tokenizer_path()
