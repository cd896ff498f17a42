"""BERT data: sentence-split preprocessing, the sample map, A/B pairs with SOP, whole-word n-gram masking, batches.

The synthetic corpus gives every token position of the corpus its own id, so each original token of a sample names
its document and position: crossing a document, a wrong split or a wrong truncation shows up exactly.
"""

import json

import numpy as np
import pytest

from megajax.data.bert_dataset import BERTBatches, _truncate, build_sample_map, documents_in
from megajax.data.bert_vocab import BertVocab
from megajax.data.indexed import IndexedTokens, IndexedWriter
from megajax.data.masking import mask_whole_word_ngrams
from megajax.data.preprocess import main as preprocess_main
from megajax.data.preprocess import write_documents
from megajax.data.sentences import split_sentences
from megajax.data.tokenizer import BERT_SPECIALS, load_tokenizer, train_tokenizer

PAD, UNK, CLS, SEP, MASK = range(5)
FIRST_ID = 5
SEQ = 128
CHECKED_ROWS = 1024  # rows checked one by one; the statistics use all 4096
NGRAM_TARGET = np.array([1, 1 / 2, 1 / 3]) / (1 + 1 / 2 + 1 / 3)  # 6/11, 3/11, 2/11


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """300 documents of 1-12 sentences of 1-40 tokens; every position its own id, ~30% of them '##' pieces."""
    rng = np.random.default_rng(0)
    prefix = tmp_path_factory.mktemp("bert") / "synthetic"
    writer = IndexedWriter(prefix, np.uint16)
    next_id, continuation = FIRST_ID, []
    for _ in range(300):
        sentences = []
        for length in rng.integers(1, 41, rng.integers(1, 13)):
            ids = np.arange(next_id, next_id + length)
            flags = rng.random(length) < 0.3
            flags[0] = False  # a sentence starts with a word
            continuation.extend(flags)
            sentences.append(ids.tolist())
            next_id += int(length)
        writer.add_sentences(sentences, SEP)
    writer.commit({"vocab_size": next_id})
    is_continuation = np.concatenate([np.zeros(FIRST_ID, bool), continuation])
    is_special = np.zeros(next_id, bool)
    is_special[:FIRST_ID] = True
    vocab = BertVocab(CLS, SEP, MASK, PAD, next_id, is_continuation, is_special)
    return IndexedTokens.open(prefix), vocab


@pytest.fixture(scope="module")
def batches(corpus):
    data, vocab = corpus
    return BERTBatches(data, vocab, SEQ, global_batch=64, seed=11)


@pytest.fixture(scope="module")
def drawn(batches):
    """4096 samples (64 steps of 64) as one dict of arrays, and the originals under the masks."""
    steps = [batches.batch(s) for s in range(64)]
    out = {k: np.concatenate([b[k] for b in steps]) for k in steps[0]}
    out["original"] = np.where(out["mlm_weights"] == 1, out["mlm_labels"], out["tokens"])
    return out


def _layout(row_tokens: np.ndarray) -> tuple[int, int, int]:
    """Positions of the two [SEP]s and the real length of an original row."""
    seps = np.flatnonzero(row_tokens == SEP)
    return int(seps[0]), int(seps[1]), int(seps[1]) + 1


def test_sample_layout_types_padding_and_specials(drawn, batches):
    for k in range(CHECKED_ROWS):
        orig = drawn["original"][k]
        first_sep, second_sep, length = _layout(orig)
        assert orig[0] == CLS and len(np.flatnonzero(orig[:length] == SEP)) == 2
        assert 1 < first_sep < second_sep - 1 and length <= SEQ  # A and B both non-empty
        types = np.r_[np.zeros(first_sep + 1), np.ones(length - first_sep - 1), np.zeros(SEQ - length)]
        np.testing.assert_array_equal(drawn["token_types"][k], types)
        np.testing.assert_array_equal(drawn["padding_mask"][k], np.arange(SEQ) < length)
        assert (drawn["tokens"][k, length:] == PAD).all()
        special = np.isin(orig, (CLS, SEP, PAD))
        assert not drawn["mlm_weights"][k][special].any()  # [CLS], [SEP], padding never masked
    assert set(batches.fields) == set(drawn) - {"original"}
    for name, (shape, dtype) in batches.fields.items():
        assert drawn[name].shape[1:] == shape and drawn[name].dtype == dtype


def test_samples_are_two_runs_of_one_document_split_at_a_sentence(drawn, corpus, batches):
    data, _ = corpus
    doc_of = np.repeat(np.arange(len(data.offsets) - 1), np.diff(data.offsets))
    position = {int(t): i for i, t in enumerate(data.tokens)}  # every id occurs once
    sentence_starts = set(data.sentences[:, 0].tolist())
    for k in range(CHECKED_ROWS):
        orig = drawn["original"][k]
        first_sep, second_sep, _ = _layout(orig)
        a = np.array([position[int(t)] for t in orig[1:first_sep]])
        b = np.array([position[int(t)] for t in orig[first_sep + 1:second_sep]])
        assert len(set(doc_of[np.r_[a, b]])) == 1, "a sample crosses a document"
        assert (np.diff(a) == 1).all() and (np.diff(b) == 1).all(), "A or B is not one run of the document"
        early, late = (b, a) if drawn["sop_labels"][k] else (a, b)
        assert early[-1] < late[0], "sop_labels does not say which segment comes first"
        assert any(early[-1] < s <= late[0] for s in sentence_starts), "A and B not split at a sentence start"
        assert len(a) + len(b) <= SEQ - 3


def test_sop_labels_are_balanced(drawn):
    assert abs(drawn["sop_labels"].mean() - 0.5) < 0.02  # 4096 samples: sd 0.008


def test_masking_statistics(drawn, corpus):
    _, vocab = corpus
    weights, tokens, orig = drawn["mlm_weights"], drawn["tokens"], drawn["original"]
    real = drawn["padding_mask"].astype(bool) & ~np.isin(orig, (CLS, SEP))
    fraction = weights.sum() / real.sum()
    assert abs(fraction - 0.15) < 0.005, fraction
    masked = weights == 1
    as_mask = (tokens[masked] == MASK).mean()
    unchanged = (tokens[masked] == orig[masked]).mean()
    replaced = tokens[masked][(tokens[masked] != MASK) & (tokens[masked] != orig[masked])]
    assert abs(as_mask - 0.8) < 0.01 and abs(unchanged - 0.1) < 0.01, (as_mask, unchanged)
    assert abs(len(replaced) / masked.sum() - 0.1) < 0.01 and not vocab.is_special[replaced].any()
    np.testing.assert_array_equal(drawn["mlm_labels"][masked], orig[masked])
    assert not drawn["mlm_labels"][~masked].any()


def test_whole_words_are_masked_together(drawn, corpus):
    _, vocab = corpus
    cont = vocab.is_continuation[drawn["original"]]
    w = drawn["mlm_weights"].astype(bool)
    # A masked '##' piece has its masked word start before it; a masked token's following '##' piece is masked.
    assert not (w[:, 1:] & cont[:, 1:] & ~w[:, :-1]).any()
    assert not (w[:, :-1] & cont[:, 1:] & ~w[:, 1:]).any()
    # '##' pieces cut from their word by truncation (right after [CLS]/[SEP]) are never masked.
    orphan = cont[:, 1:] & np.isin(drawn["original"][:, :-1], (CLS, SEP))
    assert orphan.any() and not w[:, 1:][orphan].any()


def test_ngram_lengths_follow_one_over_n(drawn, corpus):
    """Spans reported by the masker, each checked against the tokens: n whole words, counted from the flags."""
    _, vocab = corpus
    counts, rng = np.zeros(4), np.random.default_rng(5)
    for k in range(len(drawn["original"])):
        orig, types = drawn["original"][k], drawn["token_types"][k]
        length = int(drawn["padding_mask"][k].sum())
        masked = mask_whole_word_ngrams(orig[:length], types[:length], vocab, rng)
        for first, end, n in masked.spans:
            starts = ~vocab.is_continuation[orig[first:end]]
            assert starts[0] and starts.sum() == n and not vocab.is_continuation[orig[end]]
            assert len(set(types[first:end])) == 1  # a span stays in one segment
            counts[n] += 1
    shares = counts[1:] / counts[1:].sum()
    assert counts.sum() > 10_000 and np.abs(shares - NGRAM_TARGET).max() < 0.01, shares


def test_batches_are_a_function_of_seed_and_step(corpus, batches):
    data, vocab = corpus
    again = BERTBatches(data, vocab, SEQ, global_batch=64, seed=11)
    for step in (0, 7, 40):  # 40 is past the first epoch
        full, other = batches.batch(step), again.batch(step)
        for name in full:
            np.testing.assert_array_equal(full[name], other[name])
            np.testing.assert_array_equal(batches.rows(step, 10, 30)[name], full[name][10:30])
    reseeded = BERTBatches(data, vocab, SEQ, global_batch=64, seed=12).batch(0)
    assert not np.array_equal(reseeded["tokens"], batches.batch(0)["tokens"])
    assert json.loads(json.dumps(batches.identity())) == batches.identity()
    assert batches.identity()["samples"] == len(batches) and batches.identity()["seed"] == 11
    # An epoch visits every chunk of the map once; the next epoch masks the same chunk differently.
    n = len(batches)
    seen = [batches._order[k] for k in range(n)]
    assert sorted(seen) == list(range(n))
    assert not np.array_equal(batches.sample(0, 3)["tokens"], batches.sample(1, 3)["tokens"])


def test_sample_map_rules(corpus):
    data, _ = corpus
    sizes = data.sentences[:, 1] - data.sentences[:, 0]
    max_tokens = 60
    rows = build_sample_map(data.sentences, data.doc_sentences, (0, 300), max_tokens, 0.1, seed=3)
    by_doc = {}
    for doc, first, end, target in rows:
        by_doc.setdefault(int(doc), []).append((int(first), int(end), int(target)))
    for d in range(300):
        begin, stop = int(data.doc_sentences[d]), int(data.doc_sentences[d + 1])
        chunks = by_doc.get(d, [])
        if stop - begin < 2:
            assert not chunks  # a one-sentence document makes no pair
            continue
        assert [c[0] for c in chunks] == [begin] + [c[1] for c in chunks[:-1]] and chunks[-1][1] == stop
        for i, (first, end, target) in enumerate(chunks):
            assert end - first >= 2 and 2 <= target <= max_tokens
            if i < len(chunks) - 1:  # closed at the first sentence that reached the target
                assert sizes[first:end].sum() >= target
                assert sizes[first:end - 1].sum() < target or end - first == 2
    big = np.stack([np.arange(0, 400_000, 10), np.arange(10, 400_010, 10)], 1)  # 40 000 sentences of 10 tokens
    targets = build_sample_map(big, np.arange(0, 40_001, 4), (0, 10_000), max_tokens, 0.1, seed=1)[:, 3]
    assert abs((targets < max_tokens).mean() - 0.1 * (1 - 1 / (max_tokens - 1))) < 0.01


def test_truncation_matches_one_token_at_a_time():
    rng = np.random.default_rng(0)
    for len_a, len_b, target in [(10, 3, 8), (3, 10, 8), (7, 7, 9), (50, 60, 20), (1, 40, 2), (5, 5, 20)]:
        a, b = np.arange(len_a), np.arange(100, 100 + len_b)
        keep_a, keep_b = len_a, len_b
        while keep_a + keep_b > target:  # Megatron's rule: cut the longer, B on ties
            keep_a, keep_b = (keep_a - 1, keep_b) if keep_a > keep_b else (keep_a, keep_b - 1)
        for _ in range(20):
            ta, tb = _truncate(a, b, target, rng)
            assert (len(ta), len(tb)) == (keep_a, keep_b)
            assert (np.diff(ta) == 1).all() and (np.diff(tb) == 1).all()  # a run of the original


def test_bad_input(corpus, tmp_path):
    data, vocab = corpus
    with pytest.raises(ValueError, match="at least 5 positions"):
        BERTBatches(data, vocab, 4, 8, 0)
    with pytest.raises(ValueError, match="not inside"):
        BERTBatches(data, vocab, 32, 8, 0, documents=(10, 400))
    plain = IndexedWriter(tmp_path / "plain", np.uint16)
    plain.add([5, 6, 7, SEP])
    plain.commit({"vocab_size": vocab.vocab_size})
    with pytest.raises(ValueError, match="--split_sentences"):
        BERTBatches(IndexedTokens.open(tmp_path / "plain"), vocab, 32, 8, 0)
    one = IndexedWriter(tmp_path / "one", np.uint16)
    one.add_sentences([[5, 6, 7]], SEP)
    one.commit({"vocab_size": vocab.vocab_size})
    with pytest.raises(ValueError, match="no document with two sentences"):
        BERTBatches(IndexedTokens.open(tmp_path / "one"), vocab, 32, 8, 0)
    plain = IndexedWriter(tmp_path / "one", np.uint16)  # a plain dataset over a split one: no stale sentence files
    plain.add([5, 6, 7, SEP])
    plain.commit({"vocab_size": vocab.vocab_size})
    assert IndexedTokens.open(tmp_path / "one").sentences is None and not list(tmp_path.glob("one.*sentences*"))
    with pytest.raises(ValueError, match="add_sentences"):
        plain = IndexedWriter(tmp_path / "mixed", np.uint16)
        plain.add_sentences([[5], [6]], SEP)
        plain.add([7, SEP])
    plain.abort()
    assert documents_in(data.offsets, (0, int(data.offsets[10]))) == (0, 10)
    assert documents_in(data.offsets, (int(data.offsets[10]), int(data.offsets[-1]))) == (10, 300)


# --- preprocessing with sentence splitting ---------------------------------------------------------------------

WORDS = ["data", "model", "layer", "token", "parallel", "tensor", "naïve", "x86", "attention", "gradient"]


def _prose(rng, n_paragraphs: int) -> str:
    def sentence():
        words = list(rng.choice(WORDS, rng.integers(3, 12)))
        return " ".join([words[0].capitalize(), *words[1:]]) + str(rng.choice([".", "!", "?", " e.g. too."]))
    return "\n\n".join(" ".join(sentence() for _ in range(rng.integers(1, 5))) for _ in range(n_paragraphs))


def test_split_sentences_cuts_before_whitespace():
    text = "  Dr. Smith came home.  It rained!\n\nA new paragraph\nwrapped over lines. End"
    pieces = split_sentences(text)
    assert "".join(pieces) == text
    assert pieces == ["  Dr. Smith came home.", "  It rained!", "\n\nA new paragraph\nwrapped over lines.", " End"]
    assert split_sentences("") == [] and split_sentences("   ") == ["   "]


@pytest.mark.parametrize("kind", ["bpe", "wordpiece"])
def test_sentence_split_preprocessing_keeps_the_gpt_view(tmp_path, kind):
    rng = np.random.default_rng(1)
    texts = [_prose(rng, int(rng.integers(1, 6))) for _ in range(30)]
    tok = train_tokenizer(texts, kind, 300)
    plain = write_documents(texts, tok, tmp_path / "plain", min_tokens=0)
    split = write_documents(texts, tok, tmp_path / "split", min_tokens=0, split_sentences=True)
    a, b = IndexedTokens.open(tmp_path / "plain"), IndexedTokens.open(tmp_path / "split")
    np.testing.assert_array_equal(a.tokens, b.tokens)  # the documents (GPT's view) are unchanged
    np.testing.assert_array_equal(a.offsets, b.offsets)
    assert a.sentences is None and plain.kept == split.kept == 30
    assert b.meta["sentences"] == split.sentences == len(b.sentences) > 60
    for d, text in enumerate(texts):
        sentences = [b.tokens[s:e] for s, e in b.sentences[b.doc_sentences[d]:b.doc_sentences[d + 1]]]
        expected = [s for s in split_sentences(text) if tok.encode_batch([s])[0]]
        assert len(sentences) == len(expected)
        for ids, sentence in zip(sentences, expected):
            if kind == "bpe":  # byte-level BPE decodes to the exact text
                assert tok.decode(ids) == sentence
            else:
                assert tok.decode(ids) == tok.decode(tok.encode_batch([sentence])[0])
        bounds = b.sentences[b.doc_sentences[d]:b.doc_sentences[d + 1]]
        assert bounds[0, 0] == b.offsets[d] and bounds[-1, 1] == b.offsets[d + 1] - 1  # all but the EOD
        assert (bounds[1:, 0] == bounds[:-1, 1]).all()
    assert b.tokenizer_path() is not None and load_tokenizer(b.tokenizer_path()).encode_batch(texts[:2]) == \
        tok.encode_batch(texts[:2])


def test_cli_split_sentences_and_vocab_from_dataset(tmp_path):
    rng = np.random.default_rng(2)
    texts = [_prose(rng, 3) for _ in range(10)]
    tok = train_tokenizer(texts, "wordpiece", 300)
    tok.save(tmp_path / "tok.json")
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    preprocess_main([f"--input={src}", f"--tokenizer={tmp_path / 'tok.json'}", f"--output_prefix={tmp_path / 'o'}",
                     "--min_tokens=0", "--workers=1", "--split_sentences"])
    data = IndexedTokens.open(tmp_path / "o")
    vocab = BertVocab.from_dataset(data)
    ids = {name: tok.tokenizer.token_to_id(name) for name in BERT_SPECIALS}
    assert (vocab.cls_id, vocab.sep_id, vocab.mask_id, vocab.pad_id) == \
        (ids["[CLS]"], ids["[SEP]"], ids["[MASK]"], ids["[PAD]"])
    assert data.meta["sentence_splitter"].startswith("sentencex") and data.meta["sentences"] > 10
    batch = BERTBatches(data, vocab, 64, 4, seed=0).batch(0)
    assert batch["tokens"].shape == (4, 64) and (batch["tokens"][:, 0] == vocab.cls_id).all()


# --- the BERT WordPiece vocabulary ------------------------------------------------------------------------------

def _bert_base_layout_vocab(path):
    """A vocab.txt laid out as bert-base-uncased's (30,522 lines): [PAD] 0, [unused0-98] 1-99, [UNK] 100, [CLS] 101,
    [SEP] 102, [MASK] 103, [unused99-993], then characters, words and '##' pieces (filler words here)."""
    lines = ["[PAD]"] + [f"[unused{i}]" for i in range(99)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    lines += [f"[unused{i}]" for i in range(99, 994)]
    lines += list("!\"#$%&'()*+,-./0123456789:;<=>?@[\\]^_`abcdefghijklmnopqrstuvwxyz{|}~")
    lines += ["the", "hello", "world", "naive", "##s", "##ing", "play"]
    lines += [f"word{i}" if i % 3 else f"##x{i}" for i in range(30_522 - len(lines))]
    path.write_text("\n".join(lines) + "\n")
    return lines


def test_bert_base_vocab_txt_loads_lower_cased_with_special_tokens(tmp_path):
    lines = _bert_base_layout_vocab(tmp_path / "vocab.txt")
    tok = load_tokenizer(tmp_path / "vocab.txt")
    assert tok.vocab_size == 30_522 and tok.eod_id == 102
    ids = tok.encode_batch(["Hello WORLD, Naïve plays [SEP] [MASK]"])[0]
    assert [lines[i] for i in ids] == ["hello", "world", ",", "naive", "play", "##s", "[SEP]", "[MASK]"]
    vocab = BertVocab.from_tokenizer(tok.tokenizer)
    assert (vocab.pad_id, vocab.cls_id, vocab.sep_id, vocab.mask_id) == (0, 101, 102, 103)
    assert vocab.is_special.sum() == 5 + 994  # the specials and the [unused] slots
    assert vocab.is_continuation.sum() == sum(line.startswith("##") for line in lines)
    assert not vocab.is_special[vocab.random_ids].any() and len(vocab.random_ids) == 30_522 - 999


def test_default_bert_corpus_builds_offline(tmp_path, monkeypatch):
    from megajax.data.default_corpus import default_bert_corpus

    monkeypatch.setenv("MEGAJAX_CACHE", str(tmp_path))
    data, tokenizer_path = default_bert_corpus(2048)
    assert data.meta["documents"] > 500 and data.meta["sentences"] > 20_000 and data.meta["tokens"] > 400_000
    vocab = BertVocab.from_dataset(data)
    assert vocab.vocab_size == 2048 and tokenizer_path == data.tokenizer_path()
    assert load_tokenizer(tokenizer_path).encode_batch(["The Python"]) == \
        load_tokenizer(tokenizer_path).encode_batch(["the python"])  # lower-cased
    batch = BERTBatches(data, vocab, 128, 8, seed=0).batch(0)
    assert batch["padding_mask"].sum() > 8 * 64
