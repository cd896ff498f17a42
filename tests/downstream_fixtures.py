"""A tiny WordPiece tokenizer built in memory (no downloads) for the downstream task tests."""

from __future__ import annotations

from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from megajax.data.tokenizer import BERT_SPECIALS

WORDS = ("the a an cat dog sat ran on in at mat park what where who when did do does is was it and to big red "
         "ball john mary played denver broncos won super bowl 1990 paris france london city of river long blue "
         "question answer yes no not same how many why game team ? . , ! ' - _ ##s ##ed ##ing").split()


def wordpiece_tokenizer() -> Tokenizer:
    """BERT's uncased pipeline over a vocabulary of ``BERT_SPECIALS`` then ``WORDS`` (ids in that order)."""
    vocab = {token: i for i, token in enumerate((*BERT_SPECIALS, *WORDS))}
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.add_special_tokens(list(BERT_SPECIALS))
    return tok


def token_id(token: str) -> int:
    return (*BERT_SPECIALS, *WORDS).index(token)
