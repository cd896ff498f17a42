"""Sentence splitting for BERT preprocessing, with ``sentencex`` (rule-based, compiled wheel, no model download).

``split_sentences`` cuts a text into pieces that concatenate back to it exactly. A cut is made only where a
non-space character is followed by whitespace, and the whitespace goes to the start of the next piece: tokenizers
that split words at whitespace (GPT-2's byte-level regex, BERT's pre-tokenizer) then give the same ids for the
pieces one after another as for the whole text, so a sentence-split corpus reads the same as a plain one.
"""

from __future__ import annotations

import sentencex

# The languages with rules of their own in sentencex's source (src/languages/); any other code falls back to
# another language's rules or to English's without a word, so the preprocessor refuses it.
LANGUAGES = ("am", "ar", "bg", "bn", "ca", "da", "de", "el", "en", "es", "fi", "fr", "gu", "hi", "hy", "it", "ja", "kk",
             "kn", "ml", "mr", "my", "nl", "pa", "pl", "pt", "ru", "sk", "ta", "te", "uk")


def split_sentences(text: str, language: str = "en") -> list[str]:
    """The sentences of ``text`` (paragraph breaks also end one); ``"".join(result) == text``."""
    cuts, position = [], 0
    for segment in sentencex.segment(language, text):
        content = segment.strip()
        if not content:
            continue
        found = text.find(content, position)  # located in the text: sentencex may drop whitespace between segments
        if found < 0:
            continue
        position = found + len(content)
        if position < len(text) and text[position].isspace():
            cuts.append(position)
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
