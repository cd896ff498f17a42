"""Tokenizers, preprocessing, the indexed format and the GPT loader: round trips, filters, determinism, bad input."""

import gzip
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import host_batch
from tokenizers import Tokenizer

from megajax.data.dedup import jaccard
from megajax.data.gpt_dataset import GPTBatches, split_by_documents
from megajax.data.indexed import DatasetError, IndexedTokens
from megajax.data.loader import Loader, LoaderStateError
from megajax.data.preprocess import main as preprocess_main
from megajax.data.preprocess import preprocess
from megajax.data.tokenizer import load_tokenizer, train_tokenizer, vocabulary_fingerprint

RNG = np.random.default_rng(0)
WORDS = [f"w{i}" for i in range(3000)] + ["the", "a", "of", "é", "naïve", "日本", "data"]


def _doc(n_words: int, rng=RNG) -> str:
    return " ".join(rng.choice(WORDS, n_words)) + "."


@pytest.fixture(scope="module")
def corpus_texts():
    return [_doc(int(n)) for n in RNG.integers(150, 400, 40)]


@pytest.fixture(scope="module")
def tokenizer(corpus_texts):
    return train_tokenizer(corpus_texts, "bpe", 600)


def _jsonl(path: pathlib.Path, texts) -> pathlib.Path:
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def test_round_trip_reproduces_documents(tmp_path, corpus_texts, tokenizer):
    """A gzip-compressed .jsonl and a plain .txt, document for document."""
    a = tmp_path / "a.jsonl.gz"
    a.write_bytes(gzip.compress(_jsonl(tmp_path / "a.jsonl", corpus_texts[:30]).read_bytes()))
    txt = tmp_path / "b.txt"
    txt.write_text(corpus_texts[30])
    counts = preprocess([str(a), str(txt)], tokenizer, tmp_path / "out", min_tokens=0)
    data = IndexedTokens.open(tmp_path / "out")
    assert counts.kept == data.meta["documents"] == 31
    for d, text in enumerate(corpus_texts[:31]):
        ids = data.document(d)
        assert ids[-1] == tokenizer.eod_id
        assert tokenizer.decode(ids[:-1]) == text
    assert data.tokens.dtype == np.uint16 and data.meta["counts"]["tokens"] == len(data.tokens)


def test_samples_are_windows_of_the_token_file(tmp_path, corpus_texts, tokenizer):
    preprocess([str(_jsonl(tmp_path / "a.jsonl", corpus_texts))], tokenizer, tmp_path / "out", min_tokens=0)
    data = IndexedTokens.open(tmp_path / "out")
    seq, batch = 32, 4
    batches = GPTBatches(data.tokens, seq, batch, seed=7)
    n = len(batches.source)
    steps = n // batch
    seen = []
    for step in range(steps):
        for row in batches.batch(step)["tokens"]:
            starts = [w for w in range(n) if np.array_equal(data.tokens[w * seq:w * seq + seq + 1], row)]
            assert starts, "a sample is not a window of the token file"
            seen.append(starts[0])
    assert len(set(seen)) == len(seen) == steps * batch  # one epoch: no window twice
    # Decoding the windows in file order reproduces the text of the token stream.
    ordered = np.concatenate([data.tokens[w * seq:(w + 1) * seq] for w in sorted(set(range(n)))])
    assert tokenizer.decode(ordered) == tokenizer.decode(data.tokens[:n * seq])


def test_filters_drop_exactly_short_and_duplicate_documents(tmp_path, tokenizer):
    rng = np.random.default_rng(5)
    originals = [_doc(300, rng) for _ in range(6)]
    words = originals[0].split()
    near = " ".join(words[:150] + ["changed"] + words[151:])  # one word changed: Jaccard ~0.97
    assert jaccard(near, originals[0]) > 0.9 and max(jaccard(a, b) for a in originals for b in originals
                                                     if a is not b) < 0.05
    short = [_doc(10, rng), _doc(12, rng)]
    docs = originals[:3] + [originals[1]] + short[:1] + [near] + originals[3:] + short[1:] + [originals[4]]
    path = _jsonl(tmp_path / "c.jsonl", docs)
    counts = preprocess([str(path)], tokenizer, tmp_path / "f", min_tokens=128, dedup=True)
    assert (counts.kept, counts.dropped_short, counts.dropped_exact_duplicate, counts.dropped_near_duplicate) == \
        (6, 2, 2, 1)
    data = IndexedTokens.open(tmp_path / "f")
    kept = [tokenizer.decode(data.document(d)[:-1]) for d in range(6)]
    assert kept == originals  # first occurrences survive, in order
    parallel = preprocess([str(path)], tokenizer, tmp_path / "p", min_tokens=128, dedup=True, workers=2)
    assert parallel == counts  # MinHash signatures computed in worker processes agree
    without = preprocess([str(path)], tokenizer, tmp_path / "g", min_tokens=128, dedup=False)
    assert (without.kept, without.dropped_exact_duplicate, without.dropped_near_duplicate) == (7, 2, 0)


def test_determinism_resume_and_disjoint_data_shards():
    tokens = np.arange(10_000, dtype=np.uint16) % 997
    a, b = GPTBatches(tokens, 16, 8, seed=3), GPTBatches(tokens, 16, 8, seed=3)
    np.testing.assert_array_equal(a.batch(5)["tokens"], b.batch(5)["tokens"])
    assert not np.array_equal(a.batch(5)["tokens"], GPTBatches(tokens, 16, 8, seed=4).batch(5)["tokens"])
    loader = Loader(a)
    for _ in range(3):
        host_batch(loader)
    state = json.loads(json.dumps(loader.get_state()))  # survives serialisation
    expected = host_batch(loader)["tokens"]
    resumed = Loader(GPTBatches(tokens, 16, 8, seed=3))
    resumed.set_state(state)
    np.testing.assert_array_equal(host_batch(resumed)["tokens"], expected)
    with pytest.raises(LoaderStateError, match="another dataset or seed"):
        Loader(GPTBatches(tokens, 16, 8, seed=9)).set_state(state)
    # Another global batch size moves the data position: refused unless allowed, and the message says how.
    with pytest.raises(LoaderStateError, match="global_batch_size=8 but this run uses 4.*allow_batch_size_change"):
        Loader(GPTBatches(tokens, 16, 4, seed=3)).set_state(state)
    Loader(GPTBatches(tokens, 16, 4, seed=3)).set_state(state, allow_batch_size_change=True)
    old = {k: v for k, v in state.items() if k != "global_batch"}  # checkpoints from before the field existed
    Loader(GPTBatches(tokens, 16, 8, seed=3)).set_state(old)
    # 2-way data parallel: shard 0 reads rows 0:4, shard 1 rows 4:8 of every global batch.
    rows = lambda s, i, j: a.rows(s, i, j)["tokens"]  # noqa: E731
    shard0 = {rows(s, 0, 4)[i].tobytes() for s in range(50) for i in range(4)}
    shard1 = {rows(s, 4, 8)[i].tobytes() for s in range(50) for i in range(4)}
    assert len(shard0) == len(shard1) == 200 and not shard0 & shard1
    np.testing.assert_array_equal(np.concatenate([rows(7, 0, 4), rows(7, 4, 8)]), a.batch(7)["tokens"])


def test_split_is_29_to_1_at_a_document_boundary():
    offsets = np.arange(0, 30_001, 100)
    (t0, t1), (v0, v1) = split_by_documents(offsets, 1 / 30)
    assert (t0, t1, v0, v1) == (0, 29_000, 29_000, 30_000) and t1 in offsets


def test_bad_inputs(tmp_path, tokenizer, corpus_texts):
    good = _jsonl(tmp_path / "good.jsonl", corpus_texts[:3])
    preprocess([str(good)], tokenizer, tmp_path / "keep", min_tokens=0)
    before = (tmp_path / "keep.bin").read_bytes()

    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        preprocess([str(good), str(tmp_path / "missing.jsonl")], tokenizer, tmp_path / "keep", min_tokens=0)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ValueError, match="no documents left"):
        preprocess([str(empty)], tokenizer, tmp_path / "keep", min_tokens=0)
    big = train_tokenizer(corpus_texts, "bpe", 600)
    big.tokenizer.add_tokens([f"<extra{i}>" for i in range(70_000)])
    with pytest.raises(ValueError, match="does not fit uint16"):
        preprocess([str(good)], big, tmp_path / "keep", min_tokens=0, dtype="uint16")
    # The earlier complete dataset is untouched and nothing temporary is left behind.
    assert (tmp_path / "keep.bin").read_bytes() == before and IndexedTokens.open(tmp_path / "keep")
    assert not list(tmp_path.glob("*.tmp-*"))

    mixed = tmp_path / "mixed.jsonl"
    mixed.write_bytes(json.dumps({"text": corpus_texts[0]}).encode() + b"\n" + b'{"text": "bad \xff\xfe"}\n'
                      + b"not json\n" + json.dumps({"body": "x"}).encode() + b"\n" + json.dumps({"text": " "}).encode())
    counts = preprocess([str(mixed)], tokenizer, tmp_path / "mixed", min_tokens=0)
    assert (counts.kept, counts.skipped_invalid_utf8, counts.skipped_bad_json, counts.skipped_empty) == (1, 1, 2, 1)
    assert IndexedTokens.open(tmp_path / "mixed").meta["counts"]["skipped_invalid_utf8"] == 1

    (tmp_path / "half.bin").write_bytes(b"\0" * 10)
    with pytest.raises(ValueError, match="did not finish"):
        IndexedTokens.open(tmp_path / "half")
    with pytest.raises(FileNotFoundError, match="no preprocessed dataset"):
        IndexedTokens.open(tmp_path / "nothing")
    with pytest.raises(ValueError, match=r"expected \.jsonl"):
        preprocess([str(tmp_path / "keep.bin")], tokenizer, tmp_path / "x")


def test_tokenizer_file_layouts(tmp_path, tokenizer, corpus_texts):
    want = tokenizer.encode_batch(corpus_texts[:3])
    tokenizer.save(tmp_path / "tokenizer.json")
    hf = tmp_path / "hf"
    hf.mkdir()
    tokenizer.tokenizer.model.save(str(hf))  # vocab.json + merges.txt
    openai = tmp_path / "openai"
    openai.mkdir()
    (openai / "encoder.json").write_text((hf / "vocab.json").read_text())
    (openai / "vocab.bpe").write_text((hf / "merges.txt").read_text())
    for path in (tmp_path / "tokenizer.json", tmp_path, hf, hf / "merges.txt", openai, openai / "encoder.json"):
        loaded = load_tokenizer(path)
        assert loaded.encode_batch(corpus_texts[:3]) == want, path
        assert loaded.decode(want[1]) == corpus_texts[1]
        assert loaded.eod_id == tokenizer.eod_id
    with pytest.raises(ValueError, match="no tokenizer found"):
        load_tokenizer(_empty_dir(tmp_path))


def _empty_dir(root):
    d = root / "empty"
    d.mkdir()
    return d


def test_wordpiece_vocab_txt(tmp_path, corpus_texts):
    wp = train_tokenizer(corpus_texts, "wordpiece", 800)
    wp.tokenizer.model.save(str(tmp_path))  # vocab.txt
    loaded = load_tokenizer(tmp_path / "vocab.txt")
    assert loaded.eod_id == loaded.tokenizer.token_to_id("[SEP]")
    assert loaded.encode_batch(corpus_texts[:2]) == wp.encode_batch(corpus_texts[:2])
    assert loaded.decode(loaded.encode_batch(["the naïve data"])[0]) == "the naive data"  # BERT strips accents


def test_cli(tmp_path, corpus_texts, tokenizer, capsys):
    tokenizer.save(tmp_path / "tok.json")
    src = _jsonl(tmp_path / "in.jsonl", corpus_texts[:5])
    preprocess_main([f"--input={src}", f"--tokenizer={tmp_path / 'tok.json'}", f"--output_prefix={tmp_path / 'o'}",
                     "--min_tokens=0", "--workers=1"])
    assert json.loads(capsys.readouterr().out)["kept"] == 5


def test_token_file_of_partial_ids_is_refused(tmp_path, corpus_texts, tokenizer):
    preprocess([str(_jsonl(tmp_path / "a.jsonl", corpus_texts[:2]))], tokenizer, tmp_path / "out", min_tokens=0)
    with open(tmp_path / "out.bin", "ab") as f:
        f.write(b"\0")  # half a uint16 id
    with pytest.raises(DatasetError, match=r"out\.bin has \d+ bytes, not a whole number of uint16 ids"):
        IndexedTokens.open(tmp_path / "out")


def test_cli_input_errors_print_a_message_not_a_traceback(tmp_path, corpus_texts, tokenizer):
    src = _jsonl(tmp_path / "in.jsonl", corpus_texts[:2])
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(src.read_bytes())[:30])
    for args, message in [([f"--input={src}", f"--tokenizer={tmp_path / 'nope.json'}"], "nope.json does not exist"),
                          ([f"--input={tmp_path / 'missing.jsonl'}", f"--tokenizer={tmp_path / 'tok.json'}"],
                           "missing.jsonl"),
                          ([f"--input={tmp_path / 'cut.jsonl.gz'}", f"--tokenizer={tmp_path / 'tok.json'}"],
                           "cut.jsonl.gz: the gzip data is damaged")]:
        tokenizer.save(tmp_path / "tok.json")
        with pytest.raises(SystemExit) as exit_info:
            preprocess_main([*args, f"--output_prefix={tmp_path / 'o'}", "--workers=1"])
        assert str(exit_info.value).startswith("error: ") and message in str(exit_info.value)
    assert not list(tmp_path.glob("o.*"))


def test_cli_refuses_a_language_the_splitter_has_no_rules_for(tmp_path, corpus_texts, tokenizer, capsys):
    tokenizer.save(tmp_path / "tok.json")
    src = _jsonl(tmp_path / "in.jsonl", corpus_texts[:2])
    with pytest.raises(SystemExit) as exit_info:
        preprocess_main([f"--input={src}", f"--tokenizer={tmp_path / 'tok.json'}", f"--output_prefix={tmp_path / 'o'}",
                         "--split_sentences", "--language=xx"])
    assert exit_info.value.code == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("error: argument --language: invalid choice: 'xx' (choose from 'am', 'ar',") \
        and "'en'," in line
    with pytest.raises(ValueError, match="the sentence splitter has rules for am, ar"):
        preprocess([str(src)], tokenizer, tmp_path / "o", split_sentences=True, language="xx")
    assert not list(tmp_path.glob("o.*"))


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_preprocess_leaves_no_temporary_files(tmp_path, corpus_texts, tokenizer, stop):
    """SIGTERM (a scheduler) or SIGINT (Ctrl-C) mid-run: exit 128 + the signal, one line, nothing written and the
    run's temporaries removed; files a SIGKILLed run left are removed by the next run on the same prefix (their
    process is gone), a live writer's are not."""
    tokenizer.save(tmp_path / "tok.json")
    fifo = tmp_path / "in.jsonl"
    os.mkfifo(fifo)  # the run blocks reading it, mid-run, with its temporary files open
    run = subprocess.Popen([sys.executable, "-m", "megajax.data.preprocess", f"--input={fifo}",
                            f"--tokenizer={tmp_path / 'tok.json'}", f"--output_prefix={tmp_path / 'o'}",
                            "--min_tokens=0", "--workers=1"], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while run.poll() is None and time.monotonic() < deadline:
        try:  # opens once the run has opened the input to read it
            feed = os.fdopen(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK), "w")
            break
        except OSError:  # ENXIO: no reader yet
            time.sleep(0.05)
    assert run.poll() is None, run.stderr.read()
    with feed:
        feed.write(json.dumps({"text": corpus_texts[0]}) + "\n")
        feed.flush()
        while not list(tmp_path.glob("o.tmp-*.bin")) and time.monotonic() < deadline:
            time.sleep(0.05)  # polling for the run to start writing
        assert list(tmp_path.glob("o.tmp-*.bin")), "the run never started writing"
        run.send_signal(stop)
    # the feed closed: the run's read of the fifo returns and the next batch sees the signal the handler recorded
    assert run.wait(timeout=60) == 128 + stop
    stderr = run.stderr.read()
    assert stderr.strip().splitlines()[-1] == (f"error: preprocess stopped by {stop.name}; nothing was written to "
                                               f"{tmp_path / 'o'}"), stderr
    assert "Traceback" not in stderr and "Exception ignored" not in stderr
    assert not list(tmp_path.glob("o.*"))

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        left = [tmp_path / f"o.tmp-{dead.pid}.bin", tmp_path / f"o.tmp-{dead.pid}.idx.npy",
                tmp_path / f"o.tmp-{live.pid}.bin"]
        for path in left:
            path.write_bytes(b"\0\0")
        preprocess([str(_jsonl(tmp_path / "a.jsonl", corpus_texts[:2]))], tokenizer, tmp_path / "o", min_tokens=0)
        assert sorted(p.name for p in tmp_path.glob("o.tmp-*")) == [f"o.tmp-{live.pid}.bin"]
    finally:
        live.kill()
        live.wait()


def test_the_sidecar_records_the_tokenizers_vocabulary(tmp_path, corpus_texts, tokenizer):
    """The fingerprint the checks compare: one vocabulary agrees whichever file it is read from (a dataset written
    before fingerprints falls back to its saved tokenizer file); the same size with two ids exchanged differs."""
    preprocess([str(_jsonl(tmp_path / "a.jsonl", corpus_texts[:3]))], tokenizer, tmp_path / "out", min_tokens=0)
    data = IndexedTokens.open(tmp_path / "out")
    assert data.meta["tokenizer_fingerprint"] == tokenizer.fingerprint == data.tokenizer_fingerprint()
    meta = json.loads((tmp_path / "out.json").read_text())
    del meta["tokenizer_fingerprint"]
    (tmp_path / "out.json").write_text(json.dumps(meta))
    assert IndexedTokens.open(tmp_path / "out").tokenizer_fingerprint() == tokenizer.fingerprint
    tokenizer.save(tmp_path / "tok.json")
    assert load_tokenizer(tmp_path / "tok.json").fingerprint == tokenizer.fingerprint
    spec = json.loads(tokenizer.tokenizer.to_str())
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[-2:]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    swapped = Tokenizer.from_str(json.dumps(spec))
    assert swapped.get_vocab_size() == tokenizer.vocab_size and vocabulary_fingerprint(swapped) != tokenizer.fingerprint
