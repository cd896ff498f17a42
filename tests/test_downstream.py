"""GLUE MNLI / QQP and RACE readers, BERT pair rows, TrainBatches and classification metrics."""

import json

import numpy as np
import pytest
from downstream_fixtures import token_id, wordpiece_tokenizer

from megajax.data.tasks import race
from megajax.data.tasks.batches import TrainBatches
from megajax.data.tasks.encoding import EncodedTask, PackedPairs, Specials, truncate_longer_first, wordpiece_backend
from megajax.data.tasks.files import TaskDataError
from megajax.data.tasks.glue import MNLI_LABELS, featurize_pairs, read_mnli, read_qqp
from megajax.data.tasks.race import ChoiceExample, featurize_race, fill_blank, read_race
from megajax.data.tokenizer import TextTokenizer
from megajax.evaluation.task_metrics import accuracy, positive_f1, race_accuracy

CLS, SEP, PAD = (token_id(t) for t in ("[CLS]", "[SEP]", "[PAD]"))

# GLUE's MNLI train.tsv columns (dev_matched.tsv has label1..label5 before gold_label) and QQP's.
MNLI_HEADER = ("index promptID pairID genre sentence1_binary_parse sentence2_binary_parse sentence1_parse "
               "sentence2_parse sentence1 sentence2 label1 gold_label").split()
QQP_HEADER = "id qid1 qid2 question1 question2 is_duplicate".split()


def _tsv(path, header, rows):
    path.write_text("\n".join("\t".join(r) for r in [header, *rows]) + "\n", encoding="utf-8")
    return path


def _mnli_row(i, a, b, label):
    return [str(i), "p", "q", "fiction", "(x)", "(y)", "(X)", "(Y)", a, b, label, label]


# ---------------------------------------------------------------------------------------------------- GLUE


def test_read_mnli(tmp_path):
    path = _tsv(tmp_path / "train.tsv", MNLI_HEADER, [
        _mnli_row(0, "The cat sat.", 'He said "yes', "entailment"),  # an unbalanced quote stays text
        _mnli_row(1, "A dog ran.", "No dog ran.", "contradiction"),
        [],  # a blank line
        _mnli_row(2, "John played.", "Mary played.", "neutral")])
    data = read_mnli(path)
    assert [(e.text_a, e.text_b, e.label) for e in data.examples] == [
        ("The cat sat.", 'He said "yes', MNLI_LABELS.index("entailment")),
        ("A dog ran.", "No dog ran.", 0), ("John played.", "Mary played.", 2)]
    assert [e.guid for e in data.examples] == ["0", "1", "2"]  # the index column, so predictions join the file
    assert data.skipped == {} and data.summary() == f"3 examples from {path}"


def test_read_qqp_skips_and_counts_bad_rows(tmp_path):
    path = _tsv(tmp_path / "dev.tsv", QQP_HEADER, [
        ["1", "1", "2", "Why is it blue?", "Why is the sky blue?", "1"],
        ["2", "3", "4", "How many?", "1"],  # a field missing (QQP's train.tsv has a few such rows)
        ["3", "5", "6", "Who won?", "Who lost?", "0"],
        ["4", "7", "8", "Where?", "When?", "2"]])  # an unknown label
    data = read_qqp(path)
    assert [(e.text_a, e.label) for e in data.examples] == [("Why is it blue?", 1), ("Who won?", 0)]
    assert data.skipped == {"rows with the wrong number of fields": 1, "with label '2'": 1}
    assert data.first_skipped == {"rows with the wrong number of fields": 3, "with label '2'": 5}
    assert data.summary() == (f"2 examples from {path}; skipped 2 rows (1 rows with the wrong number of fields "
                              "(first on line 3), 1 with label '2' (first on line 5))")
    assert [e.guid for e in data.examples] == ["1", "3"]  # QQP's id column
    assert data.report() == {"examples": 2, "skipped_rows": 2, "skipped": {
        "rows with the wrong number of fields": {"rows": 1, "first_line": 3},
        "with label '2'": {"rows": 1, "first_line": 5}}}


def test_glue_repeated_ids(tmp_path):
    """Two rows under one id would share a prediction: an error in MNLI, a skipped row in QQP."""
    path = _tsv(tmp_path / "dev_matched.tsv", MNLI_HEADER, [_mnli_row(7, "a", "b", "neutral"),
                                                            _mnli_row(7, "c", "d", "neutral")])
    with pytest.raises(TaskDataError, match="line 3: index '7' is also on line 2"):
        read_mnli(path)
    path = _tsv(tmp_path / "dev.tsv", QQP_HEADER, [["1", "1", "2", "a?", "b?", "1"], ["1", "3", "4", "c?", "d?", "0"]])
    data = read_qqp(path)
    assert [e.guid for e in data.examples] == ["1"] and data.first_skipped == {"with a repeated id": 3}


def test_qqp_skipped_rows_in_the_training_report(tmp_path):
    from megajax.config import bert_base_config, data_settings, stored_run
    from megajax.data.tasks.task_data import load_task
    from megajax.evaluation.downstream_tasks import read_splits

    good = [[str(i), "1", "2", "why is it blue ?", "what is it ?", str(i % 2)] for i in range(300)]
    _tsv(tmp_path / "train.tsv", QQP_HEADER, good + [["x", "y"], ["300", "1", "2", "a", "b", "2"]])  # 2 of 302
    _tsv(tmp_path / "dev.tsv", QQP_HEADER, good[:5] + [["x", "y"]])
    tokenizer = tmp_path / "tokenizer.json"
    wordpiece_tokenizer().save(str(tokenizer))
    c = bert_base_config()
    c.model.update(name="bert_classifier", num_classes=2, vocab_size=128, max_seq_len=24)
    c.data.update(source="task", task="qqp", task_dir=str(tmp_path), tokenizer=str(tokenizer))
    report = load_task(data_settings(c)).report
    assert report["train"] == {"file": str(tmp_path / "train.tsv"), "examples": 300, "skipped_rows": 2, "skipped": {
        "rows with the wrong number of fields": {"rows": 1, "first_line": 302},
        "with label '2'": {"rows": 1, "first_line": 303}}}
    assert report["valid"]["skipped_rows"] == 1
    (split,) = read_splits("qqp", stored_run(c), None, None)  # eval.py's dev split: the counts go into its results
    assert split.counts == {"skipped_rows": 1, "skipped": {"rows with the wrong number of fields": {
        "rows": 1, "first_line": 7}}}
    _tsv(tmp_path / "train.tsv", QQP_HEADER, good[:10] + [["x", "y"]] * 5)  # 5 of 15: a damaged file
    with pytest.raises(TaskDataError, match=r"QQP file .*train.tsv: 5 of its 15 training rows \(33.3%\) cannot be "
                                            r"used, .*skipped 5 rows \(5 rows with the wrong number of fields \(first "
                                            r"on line 12\)\).*max_dropped_fraction=0.34 "):
        load_task(data_settings(c))


def test_read_qqp_skips_empty_questions(tmp_path):
    path = _tsv(tmp_path / "train.tsv", QQP_HEADER, [["1", "1", "2", " ", "Why?", "1"], ["2", "3", "4", "a", "b", "0"],
                                                     ["3", "5", "6", "Why?", "", "0"]])
    data = read_qqp(path)
    assert len(data.examples) == 1 and data.skipped == {"with an empty question": 2}


@pytest.mark.parametrize("row, message", [
    (["0", "p", "q", "fiction", "a", "b"], "line 3: 6 fields, the header has 12"),
    (_mnli_row(1, "a", "b", "-"), "line 3: label '-' is not one of"),
])
def test_read_mnli_bad_row_names_file_and_line(tmp_path, row, message):
    path = _tsv(tmp_path / "dev_matched.tsv", MNLI_HEADER, [_mnli_row(0, "a", "b", "neutral"), row])
    with pytest.raises(TaskDataError, match=message) as e:
        read_mnli(path)
    assert str(path) in str(e.value)


def test_glue_columns_found_by_name(tmp_path):
    path = _tsv(tmp_path / "x.tsv", ["label", "sentence2", "sentence1"], [["neutral", "b", "a"]])
    (example,) = read_mnli(path).examples
    assert (example.text_a, example.text_b, example.label) == ("a", "b", 2)
    assert example.guid == "x.tsv:2"  # no index column: file name and line


@pytest.mark.parametrize("reader, header, rows, message", [
    (read_qqp, ["id", "question1", "question2"], [["1", "a", "b"]], "no is_duplicate column"),
    (read_mnli, ["sentence1", "gold_label"], [["a", "neutral"]], "no sentence2 column"),
    (read_qqp, ["id", "question1", "question2"], [], "no is_duplicate column"),  # a test file: no labels
    (read_qqp, QQP_HEADER, [["1", "a"]], "has no usable row"),
    (read_qqp, QQP_HEADER, [["1", "1", "2", "a", "b", "yes"]], "has no usable row"),
])
def test_glue_errors_name_the_file(tmp_path, reader, header, rows, message):
    path = _tsv(tmp_path / "bad.tsv", header, rows)
    with pytest.raises(TaskDataError, match=message) as e:
        reader(path)
    assert str(path) in str(e.value) and ("line 1" in str(e.value)) == ("column" in message)


def test_glue_empty_missing_and_non_utf8_files(tmp_path):
    (tmp_path / "empty.tsv").write_text("")
    with pytest.raises(TaskDataError, match="empty.tsv is empty"):
        read_qqp(tmp_path / "empty.tsv")
    (tmp_path / "latin.tsv").write_bytes("\t".join(QQP_HEADER).encode() + b"\n1\t1\t2\tcaf\xe9\tb\t1\n")
    with pytest.raises(TaskDataError, match="latin.tsv is not UTF-8"):
        read_qqp(tmp_path / "latin.tsv")
    with pytest.raises(FileNotFoundError, match="missing.tsv"):
        read_mnli(tmp_path / "missing.tsv")


@pytest.mark.parametrize("a, b, budget, expected", [
    (5, 3, 6, (3, 3)),  # a: 5 -> 4 -> 3
    (3, 3, 5, (3, 2)),  # ties cut b
    (2, 9, 6, (2, 4)),
    (2, 2, 9, (2, 2)),
])
def test_truncate_longer_first(a, b, budget, expected):
    kept = truncate_longer_first(list(range(a)), list(range(b)), budget)
    assert tuple(map(len, kept)) == expected and kept == (list(range(expected[0])), list(range(expected[1])))


def test_featurize_pairs_rows(tmp_path):
    path = _tsv(tmp_path / "dev.tsv", QQP_HEADER, [
        ["1", "1", "2", "Who won?", "The Denver Broncos won the Super Bowl in 1990.", "1"],
        ["2", "3", "4", "Why?", "No.", "0"]])
    examples = read_qqp(path).examples
    tok = wordpiece_tokenizer()
    task = featurize_pairs(examples, TextTokenizer(tok, SEP, "test"), 10, "qqp")
    rows = task.rows(np.arange(2))
    a, b = (tok.encode(t, add_special_tokens=False).ids for t in ("Who won?", "The Denver Broncos won"))
    # 3 + 9 tokens into 7: the longer B loses its end.
    assert rows["tokens"][0].tolist() == [CLS, *a, SEP, *b[:4], SEP]
    assert rows["token_types"][0].tolist() == [0] * 5 + [1] * 5 and rows["padding_mask"][0].tolist() == [1] * 10
    why, no = (tok.encode(t, add_special_tokens=False).ids for t in ("Why?", "No."))
    assert rows["tokens"][1].tolist() == [CLS, *why, SEP, *no, SEP] + [PAD] * 3
    assert rows["token_types"][1].tolist() == [0, 0, 0, 0, 1, 1, 1, 0, 0, 0]
    assert rows["padding_mask"][1].tolist() == [1] * 7 + [0] * 3
    assert rows["labels"].tolist() == [1, 0] and all(v.dtype == np.int32 for v in rows.values())
    assert task.inputs.tokens.dtype == np.uint16  # stored compactly
    assert task.fields == {"tokens": ((10,), np.int32), "token_types": ((10,), np.int32),
                           "padding_mask": ((10,), np.int32), "labels": ((), np.int32)}


def test_packing_and_task_checks():
    specials = Specials(CLS, SEP, PAD, 70_000)
    packed = PackedPairs.build([([1], [2, 3])], 6, specials)
    assert packed.tokens.dtype == np.int32 and packed.tokens.tolist() == [[CLS, 1, SEP, 2, 3, SEP]]
    with pytest.raises(ValueError, match="needs 7 positions but seq_len is 6"):
        PackedPairs.build([([1, 1], [2, 3])], 6, specials)
    with pytest.raises(ValueError, match="whole examples"):
        PackedPairs.build([([1], [2])] * 3, 6, specials, (4,))
    with pytest.raises(ValueError, match="has no examples"):
        EncodedTask("t", PackedPairs.build([], 6, specials), {})
    with pytest.raises(ValueError, match="target labels has shape"):
        EncodedTask("t", packed, {"labels": np.zeros(2, np.int32)})
    with pytest.raises(ValueError, match="at least 5 positions"):
        featurize_pairs([], wordpiece_tokenizer(), 4, "qqp")
    with pytest.raises(ValueError, match="at least 4 positions"):
        featurize_race([], wordpiece_tokenizer(), 3)


def test_wordpiece_backend_turns_off_truncation_and_padding():
    tok = wordpiece_tokenizer()
    tok.enable_truncation(3)
    tok.enable_padding(length=20)
    backend, specials = wordpiece_backend(tok)
    assert specials == Specials(CLS, SEP, PAD, tok.get_vocab_size())
    assert len(backend.encode("the cat sat on the mat", add_special_tokens=False).ids) == 6
    assert tok.truncation is not None  # the caller's tokenizer is left as it was


def test_wordpiece_backend_needs_bert_specials():
    from tokenizers import Tokenizer, models
    with pytest.raises(ValueError, match=r"\[CLS\], \[SEP\], \[PAD\]"):
        wordpiece_backend(Tokenizer(models.WordPiece({"a": 0, "[UNK]": 1}, unk_token="[UNK]")))
    with pytest.raises(TypeError):
        wordpiece_backend("vocab.txt")


# ---------------------------------------------------------------------------------------------------- RACE


def _article(tmp_path, level, name, article, questions, options, answers):
    folder = tmp_path / "dev" / level
    folder.mkdir(parents=True, exist_ok=True)
    (folder / name).write_text(json.dumps({"id": name, "article": article, "questions": questions,
                                           "options": options, "answers": answers}))


@pytest.fixture()
def race_dir(tmp_path):
    _article(tmp_path, "middle", "2.txt", "Mary played the big red ball.", ["What did Mary play?", "Mary was _ ."],
             [["the ball", "a dog", "a cat", "the park"], ["big", "red", "blue", "long"]], ["A", "C"])
    _article(tmp_path, "middle", "10.txt", "John ran.", ["Who ran?"], [["John", "Mary", "a dog", "a cat"]], ["A"])
    _article(tmp_path, "high", "1.txt", "The game was played in Paris.", ["Where was the game?"],
             [["London", "Denver", "Paris", "France"]], ["C"])
    return tmp_path / "dev"


def test_read_race(race_dir):
    examples = read_race(race_dir)
    # file id:question index, the ids of the release's files (there "high132.txt"; here the file names)
    assert [(e.qid, e.label, e.level) for e in examples] == [
        ("10.txt:0", 0, "middle"), ("2.txt:0", 0, "middle"), ("2.txt:1", 2, "middle"), ("1.txt:0", 2, "high")]
    assert examples[1].options == ("the ball", "a dog", "a cat", "the park")
    assert examples[3].article == "The game was played in Paris."


@pytest.mark.parametrize("question, option, expected", [
    ("Mary was _ .", "big", "Mary was big ."),
    ("Mary was ____ and _ .", "big", "Mary was big and big ."),
    ("Who ran?", "John", "Who ran? John"),
])
def test_fill_blank(question, option, expected):
    assert fill_blank(question, option) == expected


def test_featurize_race_rows(race_dir):
    examples = read_race(race_dir)
    tok = wordpiece_tokenizer()
    task = featurize_race(examples, tok, 12)
    assert task.inputs.tokens.shape == (4, 4, 12) and task.targets["labels"].tolist() == [0, 0, 2, 2]
    rows = task.rows(np.array([2, 0]))
    assert rows["tokens"].shape == rows["token_types"].shape == (2, 4, 12)
    article = tok.encode("Mary played the big red ball.", add_special_tokens=False).ids  # 7 tokens
    for j, option in enumerate(["big", "red", "blue", "long"]):
        qa = tok.encode(f"Mary was {option} .", add_special_tokens=False).ids  # 4 tokens: the article keeps 5
        # Megatron's order: [CLS] question+option [SEP] article [SEP], the article cut from its end.
        assert rows["tokens"][0, j].tolist() == [CLS, *qa, SEP, *article[:5], SEP]
        assert rows["token_types"][0, j].tolist() == [0] * 6 + [1] * 6
        assert rows["padding_mask"][0, j].tolist() == [1] * 12
    john = tok.encode("John ran.", add_special_tokens=False).ids
    qa = tok.encode("Who ran? John", add_special_tokens=False).ids
    n = 3 + len(john) + len(qa)
    assert rows["tokens"][1, 0].tolist() == [CLS, *qa, SEP, *john, SEP] + [PAD] * (12 - n)
    assert rows["token_types"][1, 0].tolist() == [0] * (len(qa) + 2) + [1] * (len(john) + 1) + [0] * (12 - n)
    assert rows["padding_mask"][1, 0].tolist() == [1] * n + [0] * (12 - n)


def test_featurize_race_long_question_keeps_its_end(monkeypatch):
    example = ChoiceExample("x", "John ran.", "the big red ball " * 4 + "_", ("a", "b", "c", "d"), 0, "high")
    task = featurize_race([example], wordpiece_tokenizer(), 8)
    # 17 tokens of question + option for 5 positions: its last 5 ("b" is unknown), no article.
    assert task.inputs.tokens[0, 1].tolist() == [CLS, *[token_id(t) for t in ("the", "big", "red", "ball", "[UNK]")],
                                                 SEP, SEP]
    monkeypatch.setattr(race, "MAX_QA_LENGTH", 3)  # Megatron's cap (128) on question + option, made small
    task = featurize_race([example], wordpiece_tokenizer(), 10)
    assert task.inputs.tokens[0, 1].tolist() == [CLS, *[token_id(t) for t in ("red", "ball", "[UNK]")], SEP,
                                                 *[token_id(t) for t in ("john", "ran", ".")], SEP, PAD]


@pytest.mark.parametrize("options, answers, message", [
    ([["a", "b", "c"]], ["A"], "expected 4 option strings"),
    ([["a", "b", "c", "d"]], ["E"], "answer 'E' is not one of A, B, C, D"),
    ([["a", "b", "c", "d"]], [], "lists of one length"),
])
def test_race_errors_name_the_file(tmp_path, options, answers, message):
    _article(tmp_path, "high", "7.txt", "An article.", ["Q?"], options, answers)
    with pytest.raises(TaskDataError, match=message) as e:
        read_race(tmp_path / "dev")
    assert str(tmp_path / "dev" / "high" / "7.txt") in str(e.value)


def test_race_ids(tmp_path):
    _article(tmp_path, "middle", "1.txt", "An article.", ["Q?"], [["a", "b", "c", "d"]], ["A"])
    _article(tmp_path, "high", "1.txt", "An article.", ["Q?"], [["a", "b", "c", "d"]], ["B"])
    with pytest.raises(TaskDataError, match=r"RACE files .*middle/1.txt and .*high/1.txt have the same id '1.txt'"):
        read_race(tmp_path / "dev")
    record = json.loads((tmp_path / "dev" / "high" / "1.txt").read_text())
    del record["id"]  # no id: named by level and file
    (tmp_path / "dev" / "high" / "1.txt").write_text(json.dumps(record))
    assert [e.qid for e in read_race(tmp_path / "dev")] == ["1.txt:0", "high/1.txt:0"]


def test_race_directory_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_race(tmp_path / "nowhere")
    with pytest.raises(TaskDataError, match="neither middle/ nor high/"):
        read_race(tmp_path)
    (tmp_path / "middle").mkdir()
    with pytest.raises(TaskDataError, match="no \\*.txt article files"):
        read_race(tmp_path)
    (tmp_path / "middle" / "1.txt").write_text("[1, 2]")
    with pytest.raises(TaskDataError, match="not an article object"):
        read_race(tmp_path)


# ---------------------------------------------------------------------------------------------------- batches


def _task(n: int) -> EncodedTask:
    """n rows whose A segment is [row] and label is the row number."""
    specials = Specials(CLS, SEP, PAD, 100)
    pairs = [([i % 50 + 10], [7] * (i % 3)) for i in range(n)]
    return EncodedTask("t", PackedPairs.build(pairs, 8, specials), {"labels": np.arange(n, dtype=np.int32)})


@pytest.mark.parametrize("n, batch", [(9, 3), (10, 4), (5, 8)])
def test_train_batches_are_epoch_permutations_and_pure(n, batch):
    task = _task(n)
    one, two = TrainBatches(task, batch, seed=3), TrainBatches(task, batch, seed=3)
    steps = -(-3 * n // batch)
    labels = np.concatenate([one.batch(s)["labels"] for s in range(steps)])[:3 * n]
    epochs = labels.reshape(3, n)
    for epoch in epochs:
        assert sorted(epoch) == list(range(n))
    assert not (epochs[0] == epochs[1]).all() or not (epochs[1] == epochs[2]).all()  # reshuffled
    for s in reversed(range(steps)):  # any order: a batch depends on (seed, step) only
        full = two.batch(s)
        for key, value in one.batch(s).items():
            np.testing.assert_array_equal(value, full[key])
        for a, b in [(0, batch), (1, batch), (0, 1), (batch // 2, batch)]:
            part = one.rows(s, a, b)
            for key in full:
                np.testing.assert_array_equal(part[key], full[key][a:b])
    other = TrainBatches(task, batch, seed=4)
    assert any(not np.array_equal(other.batch(s)["labels"], one.batch(s)["labels"]) for s in range(steps))


def test_train_batches_rows_match_the_task():
    task = _task(10)
    batches = TrainBatches(task, 4, seed=0)
    batch = batches.batch(5)
    expected = task.rows(batch["labels"])
    for key, value in expected.items():
        np.testing.assert_array_equal(batch[key], value)
    assert set(batch) == set(batches.fields) and len(batches) == 10
    assert batches.identity() == {"task": "t", "examples": 10, "seq_len": 8, "seed": 0, "global_batch": 4,
                                  "fingerprint": task.fingerprint}
    with pytest.raises(ValueError):
        TrainBatches(task, 0, seed=0)


def test_fingerprint_follows_the_rows():
    assert _task(6).fingerprint == _task(6).fingerprint != _task(7).fingerprint
    moved = _task(6)
    changed = EncodedTask("t", moved.inputs, {"labels": moved.targets["labels"][::-1].copy()})
    assert changed.fingerprint != moved.fingerprint


# ---------------------------------------------------------------------------------------------------- metrics


def test_accuracy_and_valid_rows():
    assert accuracy([0, 1, 2, 2], [0, 1, 1, 2]) == 75.0
    assert accuracy([0, 1, 2, 2, 0], [0, 1, 1, 2, 1], valid=[1, 1, 1, 1, 0]) == 75.0  # padding dropped
    with pytest.raises(ValueError, match="shape"):
        accuracy([0, 1], [0, 1, 2])
    with pytest.raises(ValueError, match="no rows"):
        accuracy([0], [0], valid=[0])


@pytest.mark.parametrize("predictions, labels, valid, expected", [
    ([1, 1, 0, 0, 1], [1, 0, 1, 0, 1], None, 100 * 2 * 2 / (2 * 2 + 1 + 1)),  # TP 2, FP 1, FN 1: 2/3
    ([1, 1, 1, 1], [1, 0, 0, 0], None, 100 * 2 / (2 + 3)),  # TP 1, FP 3: P = 1/4, R = 1 -> 2/5
    ([0, 0, 1], [1, 1, 0], None, 0.0),  # no true positive
    ([0, 0], [0, 0], None, 0.0),  # no positive at all
    ([1, 0, 1], [1, 0, 0], [1, 1, 0], 100.0),  # the padding row's false positive is not counted
])
def test_positive_f1_table(predictions, labels, valid, expected):
    assert positive_f1(np.array(predictions), np.array(labels), valid) == pytest.approx(expected)


def test_race_accuracy_per_level():
    levels = ["middle", "middle", "high", "high", "high"]
    examples = [ChoiceExample(str(i), "a", "q", ("1", "2", "3", "4"), label, level)
                for i, (label, level) in enumerate(zip([0, 1, 2, 3, 0], levels))]
    scores = race_accuracy([0, 2, 2, 3, 1], examples)
    # middle 1 of 2, high 2 of 3, all 3 of 5
    assert scores == {"middle": 50.0, "high": pytest.approx(200 / 3), "all": 60.0}
    assert race_accuracy(np.array([0, 1]), examples[:2]) == {"middle": 100.0, "all": 100.0}
    with pytest.raises(ValueError, match="predictions for 5 RACE questions"):
        race_accuracy([0, 1], examples)
