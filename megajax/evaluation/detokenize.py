"""The invertible WikiText detokenizer used for zero-shot evaluation (paper Appendix E.1).

WikiText-103 ships word-tokenized ("the U.S. @-@ based", "end .") while the model was trained on ordinary text;
these rules undo the tokenization artifacts. The original token count T_o must be taken *before* detokenizing.
"""

from __future__ import annotations

import re

# Plain substitutions, applied in this order.
_REPLACEMENTS: tuple[tuple[str, str], ...] = (
    ("s '", "s'"),  # plural possessive
    (" @-@ ", "-"), (" @,@ ", ","), (" @.@ ", "."),  # number and compound separators
    (" : ", ": "), (" ; ", "; "), (" . ", ". "), (" ! ", "! "), (" ? ", "? "), (" , ", ", "),  # punctuation
)
# Bracket and quote pairs lose the spaces inside them.
_PAIRS: tuple[tuple[re.Pattern, str], ...] = (
    (re.compile(r"\(\s*([^\)]*?)\s*\)"), r"(\1)"),
    (re.compile(r"\[\s*([^\]]*?)\s*\]"), r"[\1]"),
    (re.compile(r"{\s*([^}]*?)\s*}"), r"{\1}"),
    (re.compile(r"\"\s*([^\"]*?)\s*\""), r'"\1"'),
    (re.compile(r"'\s*([^']*?)\s*'"), r"'\1'"),
)
_AFTER: tuple[tuple[str, str], ...] = (
    ("= = = =", "===="), ("= = =", "==="), ("= =", "=="),  # section headings
    (" \u00b0 ", "\u00b0"),  # degree sign
    (" \n", "\n"), ("\n ", "\n"),
    (" N ", " 1 "),  # the placeholder for numbers
    (" 's", "'s"),
)


def wikitext_detokenize(text: str) -> str:
    """Undo WikiText's word-level tokenization (rules above, in order)."""
    for old, new in _REPLACEMENTS:
        text = text.replace(old, new)
    text = re.sub(r"/' [0-9]/", r"/'[0-9]/", text)
    for pattern, repl in _PAIRS:
        text = pattern.sub(repl, text)
    for old, new in _AFTER:
        text = text.replace(old, new)
    return text


def original_token_count(raw: str) -> int:
    """T_o: WikiText's own word-level tokens, counted on the raw text split on single spaces."""
    return len(raw.strip().split(" "))
