"""Exact and near-duplicate detection (paper Section 4.1: LSH de-duplication at Jaccard similarity > 0.7).

Near duplicates use MinHash signatures of word 5-gram shingles in ``datasketch``'s MinHashLSH; a document is
dropped when it collides with an earlier kept one, so the first occurrence survives. ``datasketch`` is imported
where near duplicates are looked for, not with this module: with scipy it takes half a second, and every
``train.py`` imports this module (the default corpus is written by ``preprocess``) where few ever deduplicate.
"""

from __future__ import annotations

import hashlib
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from datasketch import LeanMinHash

_WORD = re.compile(r"\w+", re.UNICODE)


def shingles(text: str, n: int = 5) -> set[bytes]:
    words = _WORD.findall(text.lower())
    if len(words) < n:
        return {" ".join(words).encode()}
    return {" ".join(words[i:i + n]).encode() for i in range(len(words) - n + 1)}


def minhash(text: str, num_perm: int = 128, seed: int = 1) -> LeanMinHash:
    from datasketch import LeanMinHash, MinHash  # (the module docstring: imported where used)

    m = MinHash(num_perm=num_perm, seed=seed)
    m.update_batch(list(shingles(text)))
    return LeanMinHash(m)


def exact_key(text: str) -> bytes:
    return hashlib.sha1(text.strip().encode()).digest()


class Deduplicator:
    """Streaming filter: ``check(text)`` returns None to keep, or 'exact' / 'near' to drop."""

    def __init__(self, threshold: float = 0.7, num_perm: int = 128, near: bool = True):
        self.num_perm = num_perm
        self._seen: set[bytes] = set()
        self._lsh = None
        if near:
            from datasketch import MinHashLSH  # (the module docstring: imported where used)

            self._lsh = MinHashLSH(threshold=threshold, num_perm=num_perm)
        self._count = 0

    def check(self, text: str, signature: LeanMinHash | None = None) -> str | None:
        key = exact_key(text)
        if key in self._seen:
            return "exact"
        if self._lsh is not None:
            signature = signature or minhash(text, self.num_perm)
            if self._lsh.query(signature):
                return "near"
            self._lsh.insert(str(self._count), signature)
        self._seen.add(key)
        self._count += 1
        return None


def jaccard(a: str, b: str) -> float:
    """Exact Jaccard similarity of two texts' shingle sets (for tests and reports)."""
    sa, sb = shingles(a), shingles(b)
    return len(sa & sb) / max(len(sa | sb), 1)
