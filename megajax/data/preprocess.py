"""Turn a corpus of documents into the indexed token format, once.

    python -m megajax.data.preprocess --input=corpus/*.jsonl --tokenizer=gpt2/ --output_prefix=data/corpus \
        [--json_key=text] [--min_tokens=128] [--dedup] [--dedup_threshold=0.7] [--dtype=auto] [--workers=N] \
        [--split_sentences [--language=en]]

Inputs: ``.jsonl`` (one JSON object per line, the text in ``--json_key``) or ``.txt`` (one document per file), either
possibly gzip- or zstandard-compressed (``.jsonl.gz``, ``.txt.zst``: ``megajax.data.text_files``).
Each kept document is followed by the tokenizer's end-of-document id. Documents shorter than ``min_tokens``
(paper: 128) are dropped, then exact and (with ``--dedup``) near duplicates (MinHash LSH, Jaccard > 0.7).
Lines that are not valid UTF-8 or not valid JSON, and empty documents, are skipped and counted in the sidecar.
``--split_sentences`` (for BERT) also records where each sentence starts and ends; the documents' tokens are the
same as without it, so one corpus serves GPT and BERT. The tokenizer is saved beside the dataset.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import multiprocessing
import pathlib
import signal
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence

from megajax.cli import ArgumentParser, fail
from megajax.data.dedup import Deduplicator, minhash
from megajax.data.indexed import IndexedWriter, choose_dtype
from megajax.data.sentences import LANGUAGES
from megajax.data.sentences import split_sentences as sentences_of
from megajax.data.text_files import data_suffix, read_bytes
from megajax.data.tokenizer import TextTokenizer, load_tokenizer
from megajax.outputs import claim_dataset


@dataclasses.dataclass
class Counts:
    files: int = 0
    bytes: int = 0
    documents_read: int = 0
    kept: int = 0
    dropped_short: int = 0
    dropped_exact_duplicate: int = 0
    dropped_near_duplicate: int = 0
    skipped_invalid_utf8: int = 0
    skipped_bad_json: int = 0
    skipped_empty: int = 0
    tokens: int = 0
    sentences: int = 0


def _expand(inputs: Sequence[str]) -> list[pathlib.Path]:
    paths = []
    for pattern in inputs:
        matches = sorted(glob.glob(pattern)) if any(c in pattern for c in "*?[") else [pattern]
        if not matches:
            raise FileNotFoundError(f"no input files match {pattern!r}")
        for m in matches:
            p = pathlib.Path(m)
            if p.is_dir():
                raise ValueError(f"input {p} is a directory: give its files, e.g. --input='{p / '*.jsonl'}'")
            if not (p.is_file() or p.is_fifo()):  # a named pipe streams a corpus without a copy on disk
                raise FileNotFoundError(f"input file {p} does not exist")
            if data_suffix(p) not in (".jsonl", ".txt"):
                raise ValueError(f"input {p}: expected .jsonl (one JSON document per line) or .txt, either possibly "
                                 "compressed (.gz, .zst)")
            paths.append(p)
    return paths


def read_documents(paths: Sequence[pathlib.Path], json_key: str, counts: Counts) -> Iterator[str]:
    """Yields document texts; counts what it skips instead of failing mid-corpus."""
    for path in paths:
        counts.files += 1
        raw, jsonl = read_bytes(path, f"input {path}"), data_suffix(path) == ".jsonl"
        counts.bytes += len(raw)
        chunks = raw.splitlines() if jsonl else [raw]
        for chunk in chunks:
            if jsonl and not chunk.strip():
                continue  # blank line between records
            counts.documents_read += 1
            try:
                text = chunk.decode("utf-8")
            except UnicodeDecodeError:
                counts.skipped_invalid_utf8 += 1
                continue
            if jsonl:
                try:
                    text = json.loads(text)[json_key]
                except (json.JSONDecodeError, KeyError, TypeError):
                    counts.skipped_bad_json += 1
                    continue
                if not isinstance(text, str):
                    counts.skipped_bad_json += 1
                    continue
            if not text.strip():
                counts.skipped_empty += 1
                continue
            yield text


def _batched(it: Iterator[str], n: int) -> Iterator[list[str]]:
    batch = []
    for x in it:
        batch.append(x)
        if len(batch) == n:
            yield batch
            batch = []
    if batch:
        yield batch


def preprocess(inputs: Sequence[str], tokenizer: TextTokenizer, output_prefix: str | pathlib.Path, *,
               json_key: str = "text", **options) -> Counts:
    """Tokenizes, filters and writes the files ``inputs`` to ``output_prefix``; returns the counts (also in the
    sidecar). ``options`` are those of ``write_documents``."""
    paths = _expand(inputs)  # every input checked before anything is written
    counts = Counts()
    return write_documents(read_documents(paths, json_key, counts), tokenizer, output_prefix, counts=counts,
                           meta={"inputs": [str(p) for p in paths]}, **options)


def _tokenize(texts: list[str], tokenizer: TextTokenizer, split: bool, language: str) -> list[list[list[int]]]:
    """Each text's ids, as one piece or (``split``) one piece per sentence, all encoded in one parallel batch."""
    pieces = [sentences_of(t, language) if split else [t] for t in texts]
    flat = tokenizer.encode_batch([p for ps in pieces for p in ps])
    out, i = [], 0
    for ps in pieces:
        out.append(flat[i:i + len(ps)])
        i += len(ps)
    return out


class Stopped(Exception):
    """A stop signal (SIGTERM, SIGINT) arrived while preprocessing; nothing was written."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def write_documents(documents: Iterable[str], tokenizer: TextTokenizer, output_prefix: str | pathlib.Path, *,
                    counts: Counts | None = None, meta: dict | None = None, min_tokens: int = 128,
                    dedup: bool = False, dedup_threshold: float = 0.7, dtype: str = "auto", workers: int = 1,
                    batch_size: int = 512, progress: bool = False, split_sentences: bool = False,
                    language: str = "en", stop_signal: Callable[[], int | None] = lambda: None) -> Counts:
    """The pipeline on document texts: tokenize (per sentence with ``split_sentences``), drop short and duplicate
    documents, write with an EOD id each. ``stop_signal()`` is asked before each batch and before the dataset is
    committed: a signal number ends the run with ``Stopped``, the temporary files removed and nothing written."""
    from tqdm import tqdm

    if split_sentences and language not in LANGUAGES:
        raise ValueError(f"language={language!r}: the sentence splitter has rules for {', '.join(LANGUAGES)}")
    token_dtype = choose_dtype(tokenizer.vocab_size, dtype)
    counts = counts or Counts()
    dedup_filter = Deduplicator(dedup_threshold, near=dedup)
    writer = IndexedWriter(output_prefix, token_dtype, tokenizer.tokenizer.to_str())
    pool = multiprocessing.get_context("spawn").Pool(workers, _ignore_stop_signals) if dedup and workers > 1 else None
    start = time.perf_counter()
    bar = tqdm(desc="preprocess", unit="doc", disable=not progress)
    try:
        for texts in _batched(iter(documents), batch_size):
            if signum := stop_signal():
                raise Stopped(signum)
            if counts.files == 0:  # documents given directly, not read from files
                counts.documents_read += len(texts)
                counts.bytes += sum(len(t.encode()) for t in texts)
            pieces = _tokenize(texts, tokenizer, split_sentences, language)
            long = [(t, p) for t, p in zip(texts, pieces) if sum(map(len, p)) >= min_tokens]
            counts.dropped_short += len(texts) - len(long)
            signatures = pool.map(minhash, [t for t, _ in long]) if pool else [None] * len(long)
            for (text, doc), sig in zip(long, signatures):
                verdict = dedup_filter.check(text, sig)
                if verdict == "exact":
                    counts.dropped_exact_duplicate += 1
                elif verdict == "near":
                    counts.dropped_near_duplicate += 1
                else:
                    if split_sentences:
                        writer.add_sentences(doc, tokenizer.eod_id)
                        counts.sentences += sum(1 for s in doc if s)
                    else:
                        writer.add(doc[0] + [tokenizer.eod_id])
                    counts.kept += 1
                    counts.tokens += sum(map(len, doc)) + 1
            bar.update(len(texts))
        if counts.kept == 0:
            raise ValueError(f"no documents left ({dataclasses.asdict(counts)}); check the inputs, --json_key and "
                             "--min_tokens")
        if signum := stop_signal():
            raise Stopped(signum)
        writer.commit({**(meta or {}), "tokenizer": tokenizer.source, "vocab_size": tokenizer.vocab_size,
                       "tokenizer_fingerprint": tokenizer.fingerprint,
                       "eod_id": tokenizer.eod_id, "min_tokens": min_tokens, "dedup": dedup,
                       "dedup_threshold": dedup_threshold, "counts": dataclasses.asdict(counts),
                       **({"sentence_splitter": f"sentencex ({language})"} if split_sentences else {}),
                       "seconds": round(time.perf_counter() - start, 3)})
    except BaseException:
        writer.abort()
        if pool:
            pool.terminate()
        raise
    finally:
        bar.close()
        if pool:
            pool.close()
    if pool:  # the workers end on close()'s sentinels; left to the pool's finalizer, its terminate() could wait on a
        pool.join()  # worker (they ignore SIGTERM) blocked on the task queue's lock: a run of the suite hung there
    return counts


def _ignore_stop_signals() -> None:
    """A deduplication worker leaves SIGINT and SIGTERM to the main process, which stops the pool."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", required=True, nargs="+", help=".jsonl/.txt files or glob patterns")
    p.add_argument("--tokenizer", required=True, help="tokenizer.json, a GPT-2 BPE directory, or a vocab.txt")
    p.add_argument("--output_prefix", required=True,
                   help="the dataset's path without suffix: writes PREFIX.bin, PREFIX.idx.npy, PREFIX.json")
    p.add_argument("--overwrite", action="store_true",
                   help="replace a dataset already at --output_prefix (once the new one is complete)")
    p.add_argument("--json_key", default="text")
    p.add_argument("--min_tokens", type=int, default=128)
    p.add_argument("--dedup", action="store_true", help="drop near duplicates (MinHash LSH)")
    p.add_argument("--dedup_threshold", type=float, default=0.7)
    p.add_argument("--dtype", default="auto", choices=["auto", "uint16", "uint32"])
    p.add_argument("--workers", type=int, default=max(multiprocessing.cpu_count() - 1, 1))
    p.add_argument("--split_sentences", action="store_true", help="record sentence boundaries (needed for BERT)")
    p.add_argument("--language", default="en", choices=LANGUAGES, metavar="LANG",
                   help=f"the sentence splitter's language, one of {', '.join(LANGUAGES)}")
    args = p.parse_args(argv)
    for flag, value, low in (("workers", args.workers, 1), ("min_tokens", args.min_tokens, 0)):
        if value < low:
            p.error(f"--{flag}={value}: give a whole number >= {low}")
    if not 0.0 < args.dedup_threshold <= 1.0:
        p.error(f"--dedup_threshold={args.dedup_threshold}: give a Jaccard similarity in (0, 1]")
    # A stop signal only records itself; the loop checks it between batches. (A handler that raised could land in
    # a garbage-collection callback, where Python prints the exception and carries on writing.)
    received = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _: received.append(signum))
    try:
        prefix = claim_dataset(args.output_prefix, inputs=[*_expand(args.input), args.tokenizer],
                               overwrite=args.overwrite)  # absolute and normalised: `a/../b` makes no `a`
        counts = preprocess(args.input, load_tokenizer(args.tokenizer), prefix, json_key=args.json_key,
                            min_tokens=args.min_tokens, dedup=args.dedup, dedup_threshold=args.dedup_threshold,
                            dtype=args.dtype, workers=args.workers, progress=sys.stderr.isatty(),
                            split_sentences=args.split_sentences, language=args.language,
                            stop_signal=lambda: received[0] if received else None)
    except Stopped as e:  # the writer removed its temporary files; the exit status says which signal
        print(f"error: preprocess {e}; nothing was written to {args.output_prefix}", file=sys.stderr)
        sys.exit(128 + e.signum)
    except (OSError, ValueError) as e:  # missing files, a bad tokenizer, nothing left, a full disk: no traceback
        fail(e, f"{e} (nothing was written to {args.output_prefix})")
    if received:  # after the last check: the dataset was complete, and stays
        print(f"note: {signal.Signals(received[0]).name} arrived after the dataset was complete; it is kept at "
              f"{args.output_prefix}", file=sys.stderr)
    print(json.dumps(dataclasses.asdict(counts), indent=1))


if __name__ == "__main__":
    main()
