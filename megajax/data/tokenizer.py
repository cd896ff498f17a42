"""Tokenizers from the files users already have, or trained offline, all through the ``tokenizers`` library.

``load_tokenizer(path)`` accepts:
  * a Hugging Face ``tokenizer.json`` (or a directory holding one);
  * GPT-2 byte-level BPE as ``vocab.json`` + ``merges.txt`` (Hugging Face names) or ``encoder.json`` + ``vocab.bpe``
    (OpenAI's names): give the directory or either file;
  * BERT WordPiece ``vocab.txt`` (lower-cased unless ``lowercase=False``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
from collections.abc import Iterable, Sequence

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

GPT_EOD = "<|endoftext|>"
BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def vocabulary_fingerprint(tokenizer: Tokenizer) -> str:
    """The identity of a vocabulary: a sha256 of its (token, id) pairs, special tokens included. Two vocab.txt of
    the same size with other words differ; one vocabulary read from vocab.txt or from a tokenizer.json agrees."""
    pairs = sorted(tokenizer.get_vocab(with_added_tokens=True).items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(pairs, ensure_ascii=False).encode()).hexdigest()[:16]


@dataclasses.dataclass
class TextTokenizer:
    """A ``tokenizers.Tokenizer`` plus the id that ends a document (GPT's <|endoftext|>, BERT's [SEP])."""

    tokenizer: Tokenizer
    eod_id: int
    source: str

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def fingerprint(self) -> str:
        """``vocabulary_fingerprint``: recorded with datasets and checkpoints, compared where they meet."""
        return vocabulary_fingerprint(self.tokenizer)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids per text, without special tokens (Rust threads encode the batch in parallel)."""
        return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def save(self, path: str | pathlib.Path) -> None:
        self.tokenizer.save(str(path))


def _with_eod(tok: Tokenizer, source: str) -> TextTokenizer:
    for name in EOD_TOKENS:
        if (i := tok.token_to_id(name)) is not None:
            return TextTokenizer(tok, i, source)
    raise ValueError(f"tokenizer {source} has no end-of-document token ({', '.join(EOD_TOKENS)})")


# the first one a vocabulary holds ends each document: GPT-2's, BERT's, Llama 2's (SentencePiece), Llama 3's
EOD_TOKENS = (GPT_EOD, "[SEP]", "</s>", "<|end_of_text|>")


def _byte_level_bpe(vocab: pathlib.Path, merges: pathlib.Path) -> Tokenizer:
    tok = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)  # GPT-2's regex + byte mapping
    tok.decoder = decoders.ByteLevel()
    return tok


def _wordpiece(vocab: pathlib.Path, lowercase: bool) -> Tokenizer:
    tok = Tokenizer(models.WordPiece.from_file(str(vocab), unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase)  # lowercase also strips accents, as BERT's
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    # Registered as special (ids unchanged: they are in the vocab), so "[SEP]" in a text is one token, not 4 pieces.
    tok.add_special_tokens([name for name in BERT_SPECIALS if tok.token_to_id(name) is not None])
    return tok


def load_tokenizer(path: str | pathlib.Path, *, lowercase: bool = True) -> TextTokenizer:
    """Loads a tokenizer from any of the layouts in the module docstring; ValueError naming the file when it cannot
    be read (the tokenizers library raises a bare Exception)."""
    p = pathlib.Path(path)
    if not p.exists():
        raise FileNotFoundError(f"tokenizer path {p} does not exist")
    try:
        return _load(p, lowercase)
    except (ValueError, OSError):
        raise
    except Exception as e:  # noqa: BLE001 - tokenizers' own errors: a damaged or foreign file
        raise ValueError(f"tokenizer {p} cannot be read ({e}): give a tokenizer.json, vocab.json + merges.txt or "
                         "vocab.txt that the tokenizers library wrote") from None


def _load(p: pathlib.Path, lowercase: bool) -> TextTokenizer:
    folder = p if p.is_dir() else p.parent
    if p.is_file() and p.suffix == ".json" and p.name not in ("vocab.json", "encoder.json"):
        return _with_eod(Tokenizer.from_file(str(p)), str(p))
    if p.is_dir() and (folder / "tokenizer.json").is_file():
        return _with_eod(Tokenizer.from_file(str(folder / "tokenizer.json")), str(folder / "tokenizer.json"))
    for vocab, merges in (("vocab.json", "merges.txt"), ("encoder.json", "vocab.bpe")):
        if (folder / vocab).is_file() and (folder / merges).is_file() and (p.is_dir() or p.name in (vocab, merges)):
            return _with_eod(_byte_level_bpe(folder / vocab, folder / merges), str(folder / vocab))
    if (p.is_file() and p.name.endswith(".txt")) or (folder / "vocab.txt").is_file():
        vocab = p if p.is_file() else folder / "vocab.txt"
        return _with_eod(_wordpiece(vocab, lowercase), str(vocab))
    raise ValueError(f"no tokenizer found at {p}: expected tokenizer.json, vocab.json + merges.txt, "
                     "encoder.json + vocab.bpe, or a WordPiece vocab.txt")


def train_tokenizer(texts: Iterable[str], kind: str, vocab_size: int, *, show_progress: bool = False,
                    lowercase: bool = True) -> TextTokenizer:
    """Trains a GPT-style byte-level BPE (``kind='bpe'``) or a BERT WordPiece (``kind='wordpiece'``) offline."""
    if kind == "bpe":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[GPT_EOD], show_progress=show_progress,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    elif kind == "wordpiece":
        tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
        tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase)
        tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        tok.decoder = decoders.WordPiece()
        trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, special_tokens=list(BERT_SPECIALS),
                                            show_progress=show_progress)
    else:
        raise ValueError(f"tokenizer kind {kind!r}; choose 'bpe' or 'wordpiece'")
    tok.train_from_iterator(texts, trainer)
    return _with_eod(tok, f"trained-{kind}-{vocab_size}")
