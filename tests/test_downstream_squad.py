"""SQuAD 1.1 / 2.0: the JSON reader, document-stride windows, best-span decoding and the official EM / F1."""

import json
import re

import numpy as np
import pytest
from downstream_fixtures import wordpiece_tokenizer

from megajax.data.tasks.files import TaskDataError
from megajax.data.tasks.squad import Answer, SquadExample, featurize_squad, read_squad, windows
from megajax.evaluation.squad_decode import SpanPrediction, answers_at, best_span, decode_squad
from megajax.evaluation.squad_metrics import f1, f1_v1, normalize_answer, squad_scores

CONTEXT = ("Denver Broncos won the Super Bowl in 1990. The game was played in Paris, France at the city park. "
           "Mary played the big red ball and John ran to the long blue river.")
LONG_QUESTION = "What did Mary do with the big red ball, and what did John do at the long blue river in the city park?"


def _qa(qid, question, *answers, impossible=None):
    qa = {"id": qid, "question": question,
          "answers": [{"text": text, "answer_start": CONTEXT.index(text)} for text in answers]}
    if impossible is not None:
        qa["is_impossible"] = impossible
        if impossible:
            qa["plausible_answers"] = [{"text": "Paris", "answer_start": CONTEXT.index("Paris")}]
    return qa


def _write(tmp_path, name, qas):
    path = tmp_path / name
    path.write_text(json.dumps({"version": "x", "data": [{"title": "t", "paragraphs": [
        {"context": CONTEXT, "qas": qas}]}]}))
    return path


@pytest.fixture()
def squad1(tmp_path):
    return _write(tmp_path, "train-v1.1.json", [
        _qa("q1", "Who won the Super Bowl?", "Denver Broncos", "Broncos"),
        _qa("q2", "Where was the game played?", "Paris, France"),
        _qa("q3", LONG_QUESTION, "John ran to the long blue river")])


@pytest.fixture()
def squad2(tmp_path):
    return _write(tmp_path, "dev-v2.0.json", [
        _qa("q1", "Who won the Super Bowl?", "Denver Broncos", impossible=False),
        _qa("q4", "Who won the world cup?", impossible=True),
        _qa("q3", LONG_QUESTION, "the long blue river", impossible=False)])


# ---------------------------------------------------------------------------------------------------- reader


def test_read_squad_1_keeps_every_answer(squad1):
    data = read_squad(squad1)
    assert not data.version_2 and [e.qid for e in data.examples] == ["q1", "q2", "q3"]
    assert data.examples[0].answers == (Answer("Denver Broncos", 0), Answer("Broncos", 7))
    assert all(e.context == CONTEXT and not e.is_impossible for e in data.examples)


def test_read_squad_2_impossible_questions_have_no_answers(squad2):
    data = read_squad(squad2)
    assert data.version_2
    q1, q4, q3 = data.examples
    assert q4.is_impossible and q4.answers == ()  # plausible_answers are not answers
    assert not q1.is_impossible and q1.answers == (Answer("Denver Broncos", 0),)
    assert q3.answers == (Answer("the long blue river", CONTEXT.index("the long blue river")),)


@pytest.mark.parametrize("record, message", [
    ({"version": "1.1"}, "no 'data' list"),
    ({"data": [{"paragraphs": [{"qas": []}]}]}, "data[0].paragraphs[0] has no 'context'"),
    ({"data": [{"paragraphs": [{"context": "abc", "qas": [{"id": "x", "question": "q", "answers": [
        {"text": "b", "answer_start": 9}]}]}]}]}, "answer_start 9 outside"),
    ({"data": [{"paragraphs": [{"context": "abc", "qas": [{"id": "x", "question": "q", "answers": []}]}]}]},
     "no answers and is not marked is_impossible"),
    ({"data": [{"paragraphs": [{"context": "abc", "qas": 2 * [{"id": "x", "question": "q", "answers": [
        {"text": "b", "answer_start": 1}]}]}]}]}, "appears twice"),
])
def test_read_squad_errors_name_the_file(tmp_path, record, message):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(record))
    with pytest.raises(TaskDataError, match=re.escape(message)) as e:
        read_squad(path)
    assert str(path) in str(e.value)


def test_read_squad_not_json(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(TaskDataError, match="bad.json"):
        read_squad(path)
    with pytest.raises(FileNotFoundError, match="missing.json"):
        read_squad(tmp_path / "missing.json")


# ---------------------------------------------------------------------------------------------------- windows


@pytest.mark.parametrize("num_tokens, max_tokens, stride, expected", [
    (10, 4, 2, [(0, 4), (2, 4), (4, 4), (6, 4)]),
    (10, 4, 3, [(0, 4), (3, 4), (6, 4)]),
    (10, 4, 5, [(0, 4), (4, 4), (8, 2)]),  # a stride longer than a window still leaves no gap
    (3, 4, 2, [(0, 3)]),
    (0, 4, 2, [(0, 0)]),  # an empty context still gets one (empty) window
])
def test_windows_table(num_tokens, max_tokens, stride, expected):
    assert windows(num_tokens, max_tokens, stride) == expected


def test_windows_cover_every_token():
    rng = np.random.default_rng(0)
    for _ in range(300):
        n, size, stride = int(rng.integers(1, 60)), int(rng.integers(1, 12)), int(rng.integers(1, 15))
        spans = windows(n, size, stride)
        covered = np.zeros(n, int)
        for start, length in spans:
            assert 1 <= length <= size
            covered[start:start + length] += 1
        assert covered.min() >= 1 and spans[-1][0] + spans[-1][1] == n
        assert all(b[0] - a[0] == min(a[1], stride) for a, b in zip(spans, spans[1:]))


# ---------------------------------------------------------------------------------------------------- features

SEQ, QUERY, STRIDE = 24, 6, 5


def _features(path, training):
    return featurize_squad(read_squad(path).examples, wordpiece_tokenizer(), SEQ, doc_stride=STRIDE,
                           max_query_length=QUERY, training=training)


def _answer_token_span(offsets, answer):
    """First and last context token overlapping the answer's characters (a plain loop, the reference)."""
    begin, end = answer.start, answer.start + len(answer.text)
    hit = [t for t, (b, e) in enumerate(offsets) if b < end and e > begin]
    return hit[0], hit[-1]


@pytest.mark.parametrize("fixture", ["squad1", "squad2"])
def test_features_windows_answers_and_rows(fixture, request):
    data = read_squad(request.getfixturevalue(fixture))
    features = _features(request.getfixturevalue(fixture), training=True)
    tok = wordpiece_tokenizer()
    cls_id, sep_id, pad_id = (tok.token_to_id(t) for t in ("[CLS]", "[SEP]", "[PAD]"))
    assert features.dropped == 0 and len(features.examples) == len(data.examples)
    rows = features.task.rows(np.arange(len(features)))
    assert set(rows) == {"tokens", "token_types", "padding_mask", "start_positions", "end_positions"}
    seen_inside = seen_outside = 0
    for i, example in enumerate(data.examples):
        context = tok.encode(example.context, add_special_tokens=False)
        question = tok.encode(example.question, add_special_tokens=False).ids[:QUERY]
        if example.question == LONG_QUESTION:
            assert len(tok.encode(example.question, add_special_tokens=False).ids) > QUERY  # really cut
        np.testing.assert_array_equal(features.context_offsets[i], context.offsets)
        mine = np.flatnonzero(features.example_index == i)
        assert len(mine) > 1 and np.all(np.diff(mine) == 1)  # several windows, contiguous
        covered = np.zeros(len(context.ids), bool)
        span = _answer_token_span(context.offsets, example.answers[0]) if example.answers else None
        for f in mine:
            start, length, first = features.window_start[f], features.window_length[f], features.context_position[f]
            covered[start:start + length] = True
            n = len(question) + length + 3
            assert first == len(question) + 2 and n <= SEQ
            assert rows["tokens"][f].tolist() == [cls_id, *question, sep_id, *context.ids[start:start + length],
                                                  sep_id] + [pad_id] * (SEQ - n)
            assert rows["token_types"][f].tolist() == [0] * first + [1] * (length + 1) + [0] * (SEQ - n)
            assert rows["padding_mask"][f].tolist() == [1] * n + [0] * (SEQ - n)
            s, e = rows["start_positions"][f], rows["end_positions"][f]
            if span is not None and start <= span[0] and span[1] < start + length:
                seen_inside += 1
                offsets = features.position_offsets(f)
                assert example.context[offsets[s, 0]:offsets[e, 1]] == example.answers[0].text
                assert s == first + span[0] - start and e == first + span[1] - start
            else:
                seen_outside += 1
                assert s == e == 0  # [CLS]
            assert features.context_mask(f).tolist() == [False] * first + [True] * length + [False] * (SEQ - first
                                                                                                        - length)
        assert covered.all()
    assert seen_inside and seen_outside


def test_answers_map_back_through_non_ascii_text_across_paragraphs(tmp_path):
    contexts = ["Café Zürich 😀 won in Paris, France.", "The big red ball is John's. Mary played in the park."]
    qas = [[("z", "Zürich"), ("p", "Paris, France")], [("j", "John's"), ("m", "the park")]]
    path = tmp_path / "dev.json"
    path.write_text(json.dumps({"data": [{"paragraphs": [
        {"context": c, "qas": [{"id": qid, "question": "where?", "answers": [{"text": t, "answer_start": c.index(t)}]}
                               for qid, t in q]} for c, q in zip(contexts, qas)]}]}, ensure_ascii=False))
    features = featurize_squad(read_squad(path).examples, wordpiece_tokenizer(), 16, doc_stride=3,
                               max_query_length=4, training=True)
    found = set()
    for f in range(len(features)):
        example = features.examples[features.example_index[f]]
        s, e = features.task.targets["start_positions"][f], features.task.targets["end_positions"][f]
        if s:
            offsets = features.position_offsets(f)
            assert example.context[offsets[s, 0]:offsets[e, 1]] == example.answers[0].text
            found.add(example.qid)
    assert found == {"z", "p", "j", "m"}


def test_training_drops_misaligned_answers_evaluation_keeps_them(tmp_path):
    qas = [_qa("ok", "Who won?", "Denver Broncos"),
           {"id": "bad", "question": "Who?", "answers": [{"text": "Denver Broncos", "answer_start": 3}]}]
    path = _write(tmp_path, "train.json", qas)
    train = _features(path, training=True)
    assert train.dropped == 1 and [e.qid for e in train.examples] == ["ok"]
    assert train.dropped_questions == {"answer text not at its answer_start": ("bad",)}
    evaluation = _features(path, training=False)
    assert evaluation.dropped == 0 and [e.qid for e in evaluation.examples] == ["ok", "bad"]
    assert evaluation.broken_offsets == ("bad",) and evaluation.report()["broken_offsets"] == 1


def test_training_drops_are_counted_by_reason(tmp_path):
    """Each reason with its questions and the windows they would have had; evaluation keeps all of them."""
    long_answer = "Paris, France at the city park. Mary played the big red ball and John ran"  # 17 tokens > 24 - 6 - 3
    path = tmp_path / "train.json"
    path.write_text(json.dumps({"data": [{"paragraphs": [
        {"context": CONTEXT, "qas": [
            _qa("ok", "Who won?", "Denver Broncos"),
            _qa("long", LONG_QUESTION, long_answer),
            {"id": "off1", "question": "Who?", "answers": [{"text": "Paris", "answer_start": 1}]},
            {"id": "off2", "question": "Who?", "answers": [{"text": "Paris", "answer_start": 2}]}]},
        {"context": " ", "qas": [{"id": "empty", "question": "Who?", "answers": [], "is_impossible": True}]}]}]}))
    examples = read_squad(path).examples
    tok = wordpiece_tokenizer()
    train = featurize_squad(examples, tok, SEQ, doc_stride=STRIDE, max_query_length=QUERY, training=True)
    evaluation = featurize_squad(examples, tok, SEQ, doc_stride=STRIDE, max_query_length=QUERY, training=False)
    windows_of = {e.qid: int(np.sum(evaluation.example_index == i)) for i, e in enumerate(evaluation.examples)}
    assert [e.qid for e in train.examples] == ["ok"] and train.questions == 5
    assert train.dropped_questions == {"empty context": ("empty",), "answer text not at its answer_start":
                                       ("off1", "off2"), "no window holds the whole answer": ("long",)}
    assert train.dropped_features == {"empty context": 1, "answer text not at its answer_start":
                                      windows_of["off1"] + windows_of["off2"],
                                      "no window holds the whole answer": windows_of["long"]}
    assert len(train) == windows_of["ok"]
    assert train.drop_summary() == ("1 empty context (id empty), 2 answer text not at its answer_start (ids off1, "
                                    "off2), 1 no window holds the whole answer (id long)")
    report = train.report()
    assert report["dropped_questions"] == 4 and report["dropped"]["empty context"] == {
        "questions": 1, "features": 1, "first_ids": ["empty"]}
    assert evaluation.dropped == 0 and len(evaluation.examples) == 5 and evaluation.broken_offsets == ("off1", "off2")


def test_training_with_every_question_dropped_names_the_cause(tmp_path):
    qas = [{"id": f"q{i}", "question": "Who?", "answers": [{"text": t, "answer_start": CONTEXT.index(t) + 1}]}
           for i, t in enumerate(["Denver", "Paris", "John"])]
    with pytest.raises(TaskDataError, match=r"none of its 3 questions can train: 3 answer text not at its "
                                            r"answer_start \(ids q0, q1, q2\)\. answer_start must be the 0-based"):
        _features(_write(tmp_path, "train.json", qas), training=True)


def test_featurize_rejects_a_query_that_leaves_no_context():
    example = SquadExample("q", "who", "Denver", (Answer("Denver", 0),))
    with pytest.raises(ValueError, match="at least one context token"):
        featurize_squad([example], wordpiece_tokenizer(), 10, max_query_length=7, training=False)


# ---------------------------------------------------------------------------------------------------- decoding


def _best_span_reference(start, end, start_ok, end_ok, max_len):
    best = None
    for s in np.flatnonzero(start_ok):
        for e in np.flatnonzero(end_ok):
            if s <= e < s + max_len and (best is None or start[s] + end[e] > best[0]):
                best = (start[s] + end[e], s, e)
    return best


def test_best_span_is_the_brute_force_best():
    rng = np.random.default_rng(1)
    for _ in range(300):
        n, max_len = int(rng.integers(1, 16)), int(rng.integers(1, 6))
        start, end = rng.normal(size=n), rng.normal(size=n)
        start_ok, end_ok = rng.random(n) < 0.6, rng.random(n) < 0.6
        found = best_span(start, end, start_ok, end_ok, max_len, None)
        reference = _best_span_reference(start, end, start_ok, end_ok, max_len)
        if reference is None:
            assert found is None
            continue
        score, s, e = found
        assert start_ok[s] and end_ok[e] and s <= e < s + max_len
        assert (s, e) == reference[1:] and score == pytest.approx(reference[0])


def test_best_span_ties_prefer_the_shortest_then_earliest():
    flat = np.zeros(5)
    assert best_span(flat, flat, np.ones(5, bool), np.ones(5, bool), 3, None) == (0.0, 0, 0)
    assert best_span(flat, flat, np.zeros(5, bool), np.ones(5, bool), 3, None) is None


def _max_context_window(features, group, token):
    """BERT's rule by its definition: the window with the largest min(left, right) + 0.01 * length, first on ties."""
    best, best_score = None, -np.inf
    for f in group:
        start, length = features.window_start[f], features.window_length[f]
        if start <= token < start + length:
            score = min(token - start, start + length - 1 - token) + 0.01 * length
            if score > best_score:
                best, best_score = f, score
    return best


def _decode_reference(features, start_logits, end_logits, max_len, n_best):
    """Best span of each question over all (start, end) pairs of all its windows; n_best keeps the n_best highest
    start (among max-context context positions) and end (among context positions) logits of each window."""
    out = {}
    for i, example in enumerate(features.examples):
        group = np.flatnonzero(features.example_index == i)
        best = (-np.inf, "")
        for f in group:
            first, start, length = (int(x[f]) for x in (features.context_position, features.window_start,
                                                        features.window_length))
            starts = [p for p in range(first, first + length)
                      if _max_context_window(features, group, start + p - first) == f]
            ends = list(range(first, first + length))
            if n_best is not None:
                starts = sorted(starts, key=lambda p: -start_logits[f, p])[:n_best]
                ends = sorted(ends, key=lambda p: -end_logits[f, p])[:n_best]
            offsets = features.context_offsets[i]
            for s in starts:
                for e in ends:
                    score = start_logits[f, s] + end_logits[f, e]
                    if s <= e < s + max_len and score > best[0]:
                        best = (score, example.context[offsets[start + s - first][0]:offsets[start + e - first][1]])
        null = min(start_logits[f, 0] + end_logits[f, 0] for f in group)
        out[example.qid] = (best[0], best[1], null)
    return out


@pytest.mark.parametrize("n_best", [None, 3])
def test_decode_squad_matches_brute_force_over_windows(squad2, n_best):
    features = _features(squad2, training=False)
    assert len(features) > 2 * len(features.examples)
    rng = np.random.default_rng(2)
    for seed in range(25):
        start_logits, end_logits = rng.normal(size=(2, len(features), SEQ)) * 3
        if seed % 2:  # the best logits outside the context ([CLS], the question, [SEP]s, padding) must not count
            outside = ~np.stack([features.context_mask(f) for f in range(len(features))])
            start_logits[outside] += 50
            end_logits[outside] += 50
        max_len = 1 + seed % 5
        predictions = decode_squad(features, start_logits, end_logits, max_answer_length=max_len, n_best=n_best)
        reference = _decode_reference(features, start_logits, end_logits, max_len, n_best)
        assert set(predictions) == set(reference)
        for qid, p in predictions.items():
            score, text, null = reference[qid]
            assert p.text == text and p.score == pytest.approx(score) and p.null_score == pytest.approx(null)
            assert p.null_margin == pytest.approx(null - score)
            assert features.examples[features.example_index[p.feature]].qid == qid
            assert features.context_mask(p.feature)[[p.start, p.end]].all()
            assert p.start <= p.end < p.start + max_len


def test_decode_squad_checks_shapes(squad1):
    features = _features(squad1, training=False)
    with pytest.raises(ValueError, match="logits"):
        decode_squad(features, np.zeros((len(features), SEQ + 1)), np.zeros((len(features), SEQ + 1)))


def test_answers_at_threshold():
    p = {"a": SpanPrediction("x", 2.0, 1.0, 0, 1, 1), "b": SpanPrediction("y", 0.0, 1.0, 1, 1, 1)}
    assert answers_at(p, None) == {"a": "x", "b": "y"}
    assert answers_at(p, 0.0) == {"a": "x", "b": ""}  # b's null margin 1.0 > 0
    assert answers_at(p, 1.0) == {"a": "x", "b": "y"}  # not strictly above


# ---------------------------------------------------------------------------------------------------- metrics


@pytest.mark.parametrize("text, normalized", [
    ("The  Cat's, hat!", "cats hat"),
    ("An apple a day", "apple day"),
    ("theater anthem", "theater anthem"),  # articles only as whole words
    ("  Denver\tBroncos\n", "denver broncos"),
    ("The", ""),
])
def test_normalize_answer(text, normalized):
    assert normalize_answer(text) == normalized


@pytest.mark.parametrize("gold, prediction, expected", [
    ("the cat sat on the mat", "cat on mat", 6 / 7),  # P = 3/3, R = 3/4
    ("x y y z", "y y y", 4 / 7),  # overlap counts repeats once per gold copy: 2; P = 2/3, R = 2/4
    ("Paris", "in Paris, France", 0.5),  # P = 1/3, R = 1
    ("Paris", "London", 0.0),
    ("", "", 1.0),  # SQuAD 2.0: no answer predicted for no answer
    ("", "London", 0.0),
    ("Paris", "", 0.0),
])
def test_f1_table(gold, prediction, expected):
    assert f1(gold, prediction) == pytest.approx(expected)
    # evaluate-v1.1.py's F1 differs only where an answer is empty: 0 without a shared token
    assert f1_v1(gold, prediction) == pytest.approx(expected if gold and prediction else 0.0)


def _example(qid, *answers):
    return SquadExample(qid, "q", "c", tuple(Answer(a, 0) for a in answers), not answers)


def test_squad_1_scores_take_the_best_gold_answer(capsys):
    examples = [_example("a", "Denver Broncos", "Broncos"), _example("b", "Paris"), _example("c", "blue river")]
    answers = {"a": "the broncos", "b": "in Paris, France", "c": "red river"}
    # a: EM 1 (matches "Broncos"), F1 1; b: EM 0, F1 1/2; c: EM 0, F1 P = R = 1/2 -> 1/2
    scores = squad_scores(examples, answers)
    assert scores == {"exact": pytest.approx(100 / 3), "f1": pytest.approx(100 * 2 / 3), "total": 3}
    # a missing prediction scores 0 with evaluate-v1.1.py's message (it used to raise ValueError)
    assert squad_scores(examples, {"a": "broncos"}) == {"exact": pytest.approx(100 / 3), "f1": pytest.approx(100 / 3),
                                                        "total": 3}
    assert "Unanswered question b will receive score 0." in capsys.readouterr().err


def test_squad_1_keeps_gold_answers_that_normalise_to_nothing():
    """evaluate-v1.1.py keeps the gold "the" (v2.0 drops it): "The" matches it (EM 1) but F1 is 0 (no token)."""
    scores = squad_scores([_example("a", "the", "1990")], {"a": "The"})
    assert scores["exact"] == 100.0 and scores["f1"] == 0.0


def test_squad_2_scores_and_best_thresholds():
    examples = [_example("q1", "Denver Broncos"), _example("q2", "Paris"), _example("q3"), _example("q4")]
    margins = {"q1": -2.0, "q2": -1.5, "q3": 0.5, "q4": -1.0}
    # The predictions file written at null threshold 0: q3 (margin 0.5) answers "".
    answers = {"q1": "Denver Broncos", "q2": "in Paris France", "q3": "", "q4": "Rome"}
    scores = squad_scores(examples, answers, margins)
    # No margin exceeds --na-prob-thresh 1.0: EM 1 + 0 + 1 + 0, F1 1 + 1/2 + 1 + 0.
    assert scores["exact"] == pytest.approx(50.0) and scores["f1"] == pytest.approx(62.5)
    assert scores["HasAns_exact"] == pytest.approx(50.0) and scores["HasAns_f1"] == pytest.approx(75.0)
    assert scores["NoAns_exact"] == pytest.approx(50.0) and scores["NoAns_f1"] == pytest.approx(50.0)
    assert scores["HasAns_total"] == 2 and scores["NoAns_total"] == 2 and scores["total"] == 4
    # The official sweep from "no answer everywhere" (2 of 4 right) in margin order q1, q2, q4, q3:
    # EM 2 -> 3 (q1) -> 3 (q2) -> 2 (q4) -> 1 (q3): best 3/4 at q1's margin -2;
    # F1 2 -> 3 -> 3.5 (q2) -> 2.5 -> 1.5: best 3.5/4 at q2's margin -1.5, where EM is 1 + 0 + 1 + 1.
    assert scores["best_exact"] == pytest.approx(75.0) and scores["best_exact_thresh"] == -2.0
    assert scores["best_f1"] == pytest.approx(87.5) and scores["best_f1_thresh"] == -1.5
    assert scores["exact_at_best_f1_thresh"] == pytest.approx(75.0)


def test_squad_2_best_threshold_when_answering_never_helps():
    examples = [_example("q1"), _example("q2", "Paris")]
    answers = {"q1": "London", "q2": "Rome"}
    scores = squad_scores(examples, answers, {"q1": 0.3, "q2": -0.2})
    # Answering q1 loses its point and q2's answer is wrong: no answer everywhere is best (1 of 2). As
    # evaluate-v2.0.py, the threshold is then 0.0 (megajax used to return one below every margin).
    assert scores["best_exact"] == scores["best_f1"] == pytest.approx(50.0)
    assert scores["best_exact_thresh"] == scores["best_f1_thresh"] == 0.0
    assert scores["exact_at_best_f1_thresh"] == pytest.approx(50.0)


def test_squad_2_equal_margins_are_swept_one_at_a_time():
    examples = [_example("q1", "Paris"), _example("q2")]
    answers = {"q1": "Paris", "q2": "Rome"}
    # Both margins 0: evaluate-v2.0.py adds q1 (+1, first in file order) then q2 (-1) and reports the running best
    # 2 of 2, although no threshold gives it (megajax used to switch tied questions together: 1 of 2).
    scores = squad_scores(examples, answers, {"q1": 0.0, "q2": 0.0})
    assert scores["best_exact"] == pytest.approx(100.0) and scores["best_exact_thresh"] == 0.0
    assert scores["exact"] == pytest.approx(50.0)


def test_squad_2_no_answer_prediction_that_normalises_to_nothing():
    """(a) evaluate-v2.0.py's sweep tests the raw string: "the" for an unanswerable question takes 1 (raw EM 1)."""
    examples = [_example("q1", "Paris"), _example("q2")]
    scores = squad_scores(examples, {"q1": "Paris", "q2": "the"}, {"q1": -1.0, "q2": -0.5})
    assert scores["exact"] == pytest.approx(100.0)  # "the" normalises to "", the gold of q2
    # sweep from 1: q1 +1 = 2 (best, at -1), q2 -1 = 1; megajax used to add 0 for q2
    assert scores["best_exact"] == pytest.approx(100.0) and scores["best_exact_thresh"] == -1.0
    scores = squad_scores(examples, {"q1": "Rome", "q2": "the"}, {"q1": -1.0, "q2": -0.5})
    assert scores["best_exact"] == pytest.approx(50.0) and scores["best_exact_thresh"] == 0.0


def test_squad_2_answerable_with_empty_golds_and_no_answer():
    """(c) gold answers that all normalise to "": v2.0 scores against "" so an empty prediction scores 1, unless
    its odds exceed --na-prob-thresh (1.0), which counts an answerable question 0."""
    examples = [_example("q1", "the"), _example("q2", "An")]
    scores = squad_scores(examples, {"q1": "", "q2": ""}, {"q1": 0.5, "q2": 1.5})
    assert scores["exact"] == scores["f1"] == pytest.approx(50.0) and scores["HasAns_total"] == 2


def test_squad_2_empty_best_span_is_no_answer():
    examples = [_example("q1", "Paris"), _example("q2")]
    # Neither question has an allowed span (text ""): q2 is right (no answer), q1 wrong, at any threshold.
    scores = squad_scores(examples, {"q1": "", "q2": ""}, {"q1": float("inf"), "q2": float("inf")})
    assert scores["exact"] == scores["f1"] == scores["best_exact"] == scores["best_f1"] == pytest.approx(50.0)


def _official_best_thresh(preds, scores, na_probs, has_answer):
    """The official v2.0 script's find_best_thresh, transcribed."""
    cur = best = sum(not h for h in has_answer.values())
    best_thresh = 0.0
    for qid in sorted(na_probs, key=lambda k: na_probs[k]):
        cur += scores[qid] if has_answer[qid] else (-1 if preds[qid] else 0)
        if cur > best:
            best, best_thresh = cur, na_probs[qid]
    return 100.0 * best / len(scores), best_thresh


def test_squad_2_best_threshold_matches_the_official_sweep():
    rng = np.random.default_rng(3)
    for _ in range(50):
        n = int(rng.integers(2, 30))
        examples = [_example(f"q{i}", "Denver Broncos") if rng.random() < 0.5 else _example(f"q{i}")
                    for i in range(n)]
        # Right ("Denver Broncos", EM 1), wrong ("Paris", EM 0) or no span (""), distinct margins (no ties).
        answers = {e.qid: str(rng.choice(["Denver Broncos", "Paris", ""])) for e in examples}
        margins = dict(zip(answers, rng.permutation(n) - n / 2 + rng.random()))
        has_answer = {e.qid: bool(e.answers) for e in examples}
        em = {q: float(has_answer[q] and a == "Denver Broncos") for q, a in answers.items()}
        scores = squad_scores(examples, answers, margins)
        best, thresh = _official_best_thresh(answers, em, margins, has_answer)
        assert scores["best_exact"] == pytest.approx(best) and scores["best_exact_thresh"] == thresh


# ---------------------------------------------------------------------------------------------------- training data


def _task_config(tmp_path, task="squad1", **data):
    from megajax.config import bert_base_config

    tokenizer = tmp_path / "tokenizer.json"
    wordpiece_tokenizer().save(str(tokenizer))
    c = bert_base_config()
    c.model.update(name="bert_span", vocab_size=128, max_seq_len=72)
    c.data.update(source="task", task=task, task_dir=str(tmp_path), tokenizer=str(tokenizer), **data)
    return c


def _squad_files(tmp_path, starts):
    """train-v1.1.json with one question per answer_start shift in ``starts`` (0 = right), and a dev file whose
    q1 has a broken offset."""
    words = ["Denver", "Paris", "John", "Mary", "river", "park", "game", "1990"]
    qas = [{"id": f"t{i}", "question": "Who?", "answers": [
        {"text": words[i % 8], "answer_start": CONTEXT.index(words[i % 8]) + shift}]} for i, shift in enumerate(starts)]
    _write(tmp_path, "train-v1.1.json", qas)
    broken = {"id": "q1", "question": "Who?", "answers": [{"text": "Paris", "answer_start": 0}]}
    _write(tmp_path, "dev-v1.1.json", [_qa("q0", "Who won?", "Denver"), broken])


def test_training_refuses_a_file_with_most_offsets_wrong_naming_ids(tmp_path):
    from megajax.config import data_settings
    from megajax.data.tasks.task_data import load_task

    _squad_files(tmp_path, [0] * 15 + [3] * 345)  # 345 of 360 wrong: the run used to train on the other 15
    config = _task_config(tmp_path)
    with pytest.raises(TaskDataError) as e:
        load_task(data_settings(config))
    message = str(e.value)
    assert message.startswith(f"SQuAD file {tmp_path / 'train-v1.1.json'}: 345 of its 360 training questions "
                              "(95.8%) cannot be used, more than data.max_dropped_fraction=0.01: 345 answer text not "
                              "at its answer_start (ids t15, t16, t17, t18, t19, ...)")
    assert "--config.data.max_dropped_fraction=0.96 to train on the rest" in message

    config.data.max_dropped_fraction = 0.96  # the flag lets it through; the report counts what was left out
    data = load_task(data_settings(config))
    train, valid = data.report["train"], data.report["valid"]
    assert train["questions"] == 360 and train["dropped_questions"] == 345 and len(data.train) == train["features"]
    assert train["dropped"]["answer text not at its answer_start"]["first_ids"] == ["t15", "t16", "t17", "t18", "t19"]
    assert valid == {"file": str(tmp_path / "dev-v1.1.json"), "questions": 2, "features": len(data.valid),
                     "broken_offsets": 1, "broken_offset_ids": ["q1"]}


def test_training_with_every_offset_off_by_one_names_the_cause(tmp_path):
    from megajax.config import data_settings
    from megajax.data.tasks.task_data import load_task

    _squad_files(tmp_path, [1] * 20)  # used to end in a traceback saying the split "has no examples"
    for fraction in (0.01, 1.0):  # the flag cannot make an empty split train
        with pytest.raises(TaskDataError, match=re.escape(
                f"SQuAD file {tmp_path / 'train-v1.1.json'}: none of its 20 questions can train: 20 answer text not "
                "at its answer_start (ids t0, t1, t2, t3, t4, ...). answer_start must be the 0-based")):
            load_task(data_settings(_task_config(tmp_path, max_dropped_fraction=fraction)))


def test_training_accepts_a_few_drops_and_checks_the_fraction(tmp_path):
    from megajax.config import data_settings
    from megajax.data.tasks.task_data import load_task
    from megajax.errors import ConfigError, UserError

    _squad_files(tmp_path, [0] * 199 + [2])  # 0.5% <= 1%
    assert load_task(data_settings(_task_config(tmp_path))).report["train"]["dropped_questions"] == 1
    with pytest.raises(ConfigError, match="data.max_dropped_fraction=1.5: must be in"):
        load_task(data_settings(_task_config(tmp_path, max_dropped_fraction=1.5)))
    assert issubclass(TaskDataError, UserError)  # train.py prints it as one error: line
