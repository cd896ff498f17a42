"""The evaluation tasks behind eval.py: each returns a JSON-ready dict of results."""

from __future__ import annotations

import json
import math
import pathlib

import numpy as np

from megajax.data.indexed import IndexedTokens
from megajax.data.tokenizer import TextTokenizer
from megajax.evaluation.detokenize import original_token_count, wikitext_detokenize
from megajax.evaluation.scoring import Scorer, cloze_rows, sliding_windows, stream_log_likelihood


def _progress(total: int, desc: str):
    import sys

    from tqdm import tqdm

    return tqdm(total=total, desc=desc, disable=not sys.stderr.isatty())


def _read_text(path: str | pathlib.Path) -> str:
    p = pathlib.Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"data file {p} does not exist")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{p} is not UTF-8 text (byte {e.start}); give the raw wiki.test.tokens file") from e


def wikitext103(scorer: Scorer, tokenizer: TextTokenizer, path: str, stride: int = 32) -> dict:
    """Perplexity per subword token and adjusted by WikiText's own token count T_o (paper Eq. 4)."""
    raw = _read_text(path)
    t_original = original_token_count(raw)  # before detokenizing
    tokens = np.asarray(tokenizer.encode_batch([wikitext_detokenize(raw)])[0], np.int32)
    bar = _progress(len(sliding_windows(len(tokens), scorer.seq_len, stride)), "wikitext103")
    nll, count = stream_log_likelihood(scorer, tokens, stride, bar.update)
    bar.close()
    return {"task": "wikitext103", "stride": stride, "subword_tokens": int(len(tokens)),
            "original_tokens": t_original, "scored_targets": count, "loss": nll / count,
            "ppl": math.exp(nll / count), "adjusted_ppl": math.exp(nll / t_original)}


def read_lambada(path: str) -> list[str]:
    texts = []
    for n, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            texts.append(json.loads(line)["text"])
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{n}: expected one JSON object with a 'text' field per line "
                             "(lambada_test.jsonl)") from e
    if not texts:
        raise ValueError(f"{path} holds no examples")
    return texts


def lambada(scorer: Scorer, tokenizer: TextTokenizer, path: str) -> dict:
    """Cloze accuracy: every subword of the last word predicted (teacher-forced); and the last-subword variant."""
    texts = read_lambada(path)
    rows = []
    for text in texts:
        cut = text.rstrip().rfind(" ")
        if cut <= 0:
            raise ValueError(f"LAMBADA example without a context: {text[:80]!r}")
        context, target = tokenizer.encode_batch([text[:cut], text[cut:].rstrip()])
        rows.append(cloze_rows(context, target, scorer.seq_len))
    inputs, labels, mask = (np.stack(x) for x in zip(*rows))
    _, hit = scorer(inputs, labels)
    whole = np.all(hit | ~mask, axis=1)
    last = np.array([hit[i, np.nonzero(mask[i])[0][-1]] for i in range(len(texts))])
    return {"task": "lambada", "examples": len(texts), "accuracy": float(whole.mean()),
            "last_subword_accuracy": float(last.mean()),
            "note": "accuracy: all subwords of the last word correct (the paper's metric); last_subword_accuracy: "
                    "only the final subword, teacher-forced (looser)"}


def perplexity(scorer: Scorer, prefix: str, stride: int | None = None) -> dict:
    """Loss and perplexity over a whole preprocessed token file (non-overlapping windows by default)."""
    data = IndexedTokens.open(prefix)
    stride = stride or scorer.seq_len
    bar = _progress(len(sliding_windows(len(data.tokens), scorer.seq_len, stride)), "ppl")
    nll, count = stream_log_likelihood(scorer, np.asarray(data.tokens), stride, bar.update)
    bar.close()
    return {"task": "ppl", "data": str(prefix), "stride": stride, "scored_targets": count, "loss": nll / count,
            "ppl": math.exp(nll / count)}
