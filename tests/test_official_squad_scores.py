"""SQuAD scores equal the official scripts', file for file: evaluate-v1.1.py and evaluate-v2.0.py (re-implemented
below from their published logic, reading the JSON files as they do) on the predictions and null-odds files that
eval.py's code path writes give exactly eval.py's figures, key for key. Edge cases where megajax used to differ:
an unanswerable question whose non-empty prediction normalises to "" (best-threshold sweep), v1.1 gold answers
that normalise to "", an answerable question whose gold answers all normalise to "", a missing prediction, tied
odds, infinite odds. Also a short fine-tune then eval.py --predictions.

Tolerance: none. The reference adds the same float64 numbers in the same order as megajax, so the figures are
compared with ==.
"""

import collections
import importlib.util
import json
import pathlib
import re
import string

import numpy as np
import pytest
from downstream_fixtures import wordpiece_tokenizer

from megajax.config import bert_base_config, stored_run
from megajax.evaluation import downstream_tasks
from megajax.evaluation.squad_metrics import squad1_scores, squad2_scores

# ---------------------------------------------------------------------------------------------------- reference


def _normalise(text):
    text = text.lower()
    text = "".join(ch for ch in text if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def _tokens(text):
    return _normalise(text).split() if text else []


def _questions(dataset):
    for article in dataset["data"]:
        for paragraph in article["paragraphs"]:
            yield from paragraph["qas"]


def official_v1(dataset, predictions, messages):
    """evaluate-v1.1.py: every listed gold answer, F1 0 without a shared token; a missing prediction scores 0."""
    def f1(prediction, gold):
        p, g = _normalise(prediction).split(), _normalise(gold).split()
        shared = sum((collections.Counter(p) & collections.Counter(g)).values())
        if shared == 0:
            return 0
        precision, recall = 1.0 * shared / len(p), 1.0 * shared / len(g)
        return (2 * precision * recall) / (precision + recall)

    exact = overlap = total = 0
    for qa in _questions(dataset):
        total += 1
        if qa["id"] not in predictions:
            messages.append(f"Unanswered question {qa['id']} will receive score 0.")
            continue
        golds = [a["text"] for a in qa["answers"]]
        prediction = predictions[qa["id"]]
        exact += max(_normalise(prediction) == _normalise(g) for g in golds)
        overlap += max(f1(prediction, g) for g in golds)
    return {"exact_match": 100.0 * exact / total, "f1": 100.0 * overlap / total}


def official_v2(dataset, predictions, na_probs, messages, na_prob_thresh=1.0):
    """evaluate-v2.0.py DATA PRED --na-prob-file NA_PROBS."""
    def exact(gold, prediction):
        return int(_normalise(gold) == _normalise(prediction))

    def f1(gold, prediction):
        g, p = _tokens(gold), _tokens(prediction)
        if not g or not p:
            return int(g == p)
        shared = sum((collections.Counter(g) & collections.Counter(p)).values())
        if shared == 0:
            return 0
        precision, recall = 1.0 * shared / len(p), 1.0 * shared / len(g)
        return (2 * precision * recall) / (precision + recall)

    has_answer = {qa["id"]: bool(qa["answers"]) for qa in _questions(dataset)}
    raw_exact, raw_f1 = {}, {}
    for qa in _questions(dataset):
        golds = [a["text"] for a in qa["answers"] if _normalise(a["text"])] or [""]
        if qa["id"] not in predictions:
            messages.append(f"Missing prediction for {qa['id']}")
            continue
        raw_exact[qa["id"]] = max(exact(g, predictions[qa["id"]]) for g in golds)
        raw_f1[qa["id"]] = max(f1(g, predictions[qa["id"]]) for g in golds)

    def thresholded(scores):
        return {q: float(not has_answer[q]) if na_probs[q] > na_prob_thresh else s for q, s in scores.items()}

    def figures(exact_scores, f1_scores, ids=None):
        if not ids:
            n = len(exact_scores)
            return {"exact": 100.0 * sum(exact_scores.values()) / n, "f1": 100.0 * sum(f1_scores.values()) / n,
                    "total": n}
        n = len(ids)
        return {"exact": 100.0 * sum(exact_scores[q] for q in ids) / n,
                "f1": 100.0 * sum(f1_scores[q] for q in ids) / n, "total": n}

    exact_t, f1_t = thresholded(raw_exact), thresholded(raw_f1)
    out = figures(exact_t, f1_t)
    for part, wanted in (("HasAns", True), ("NoAns", False)):
        ids = [q for q, h in has_answer.items() if h == wanted]
        if ids:
            out.update({f"{part}_{k}": v for k, v in figures(exact_t, f1_t, ids).items()})

    def best(scores):
        running = top = sum(1 for h in has_answer.values() if not h)
        threshold = 0.0
        for q in sorted(na_probs, key=lambda k: na_probs[k]):
            if q not in scores:
                continue
            running += scores[q] if has_answer[q] else (-1 if predictions[q] else 0)
            if running > top:
                top, threshold = running, na_probs[q]
        return 100.0 * top / len(scores), threshold

    out["best_exact"], out["best_exact_thresh"] = best(raw_exact)
    out["best_f1"], out["best_f1_thresh"] = best(raw_f1)
    return out


V2_KEYS = ("exact", "f1", "total", "HasAns_exact", "HasAns_f1", "HasAns_total", "NoAns_exact", "NoAns_f1",
           "NoAns_total", "best_exact", "best_exact_thresh", "best_f1", "best_f1_thresh")

# ---------------------------------------------------------------------------------------------------- the sets

CONTEXT = "Denver Broncos won the Super Bowl in 1990. The game was played in Paris, France at the city park."
# id: (gold answers (text, answer_start or None = found in CONTEXT), is_impossible, predicted span, null odds)
V2 = {
    "a1": ([("Denver Broncos", None)], False, "Denver Broncos", -2.0),
    "a2": ([("Paris, France", None), ("Paris", None)], False, "Paris, France at the city park", -1.5),
    "a3": ([("1990", None)], False, "Super Bowl", -0.5),
    "n2": ([], True, ".", -0.5),  # (a) normalises to "": -1 in the sweep; its odds tie a3's (file order)
    "a4": ([("the city park", None)], False, "city park", 0.25),  # above threshold 0: written ""
    "a5": ([("Paris", None)], False, "Paris", 1.5),  # above --na-prob-thresh 1.0 too
    "n1": ([], True, "the", -1.0),  # (a)
    "n3": ([], True, "game", 0.75),
    "n4": ([], True, "The game", -0.25),
    "c1": ([("the", None)], False, "won", 0.5),  # (c) gold normalises to "": "" scores 1
    "c2": ([("The", None)], False, "won", 1.25),  # (c), but above --na-prob-thresh: 0
    "b1": ([("Super Bowl", 5)], False, "Super Bowl", -3.0),  # a broken answer_start: scored all the same
    "t1": ([("won", None)], False, "won", 0.0),  # t1, t2: tied odds
    "t2": ([], True, "1990", 0.0),
    "i1": ([("Denver Broncos", None)], True, "Denver Broncos", -0.75),  # is_impossible with listed answers
}
V1 = {
    "a1": ([("Denver Broncos", None), ("Broncos", None)], False, "Denver Broncos", 0.0),
    "a2": ([("Paris, France", None)], False, "Paris", 0.0),
    "e1": ([("the", None), ("1990", None)], False, "The", 0.0),  # (b) v1.1 keeps "the": EM 1, F1 0
    "e2": ([("the", None), ("1990", None)], False, "1990", 0.0),
    "m1": ([("Paris", None)], False, "Paris", 0.0),  # removed from the predictions: scores 0
    "b1": ([("Super Bowl", 5)], False, "Super Bowl", 0.0),
}
SEQ = 72  # eval.py's SQuAD windows: 64 question tokens at most + 3 + context; one window holds CONTEXT


def _record(qid, question, answers, impossible, version_2):
    qa = {"id": qid, "question": question,
          "answers": [{"text": t, "answer_start": CONTEXT.index(t) if s is None else s} for t, s in answers]}
    if version_2:
        qa["is_impossible"] = impossible
    return qa


def _write_set(path, questions, version_2):
    qas = [_record(q, f"what did {q} do ?", a, imp, version_2) for q, (a, imp, _, _) in questions.items()]
    paragraphs = [{"context": CONTEXT, "qas": qas}]
    if version_2:  # an empty context: no span is allowed, odds inf (written as Infinity)
        paragraphs.append({"context": "", "qas": [{"id": "e0", "question": "who ?", "answers": [],
                                                   "is_impossible": True}]})
    path.write_text(json.dumps({"version": "x", "data": [{"title": "t", "paragraphs": paragraphs}]}))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("official")
    tokenizer = root / "tokenizer.json"
    wordpiece_tokenizer().save(str(tokenizer))
    return _write_set(root / "dev-v1.1.json", V1, False), _write_set(root / "dev-v2.0.json", V2, True), tokenizer


def _config(tokenizer):
    c = bert_base_config()
    c.model.update(name="bert_span", vocab_size=128, make_vocab_size_divisible_by=64, max_seq_len=SEQ)
    c.data.update(source="task", tokenizer=str(tokenizer))
    return c


def _logits(features, questions):
    """Start / end logits under which each question's best span is its predicted text (score 4) and the null
    score is 4 + its odds: exactly the odds of the table, as every number here is a binary fraction."""
    start, end = np.full((2, len(features), SEQ), -20.0)
    for f in range(len(features)):
        example = features.examples[features.example_index[f]]
        if example.qid not in questions:
            continue
        text, odds = questions[example.qid][2:]
        begin = CONTEXT.index(text)
        offsets = features.position_offsets(f)
        (s,), (e,) = np.flatnonzero(offsets[:, 0] == begin), np.flatnonzero(offsets[:, 1] == begin + len(text))
        start[f, s] = end[f, e] = 2.0
        start[f, 0], end[f, 0] = 2.0 + odds, 2.0
    return start, end


def _evaluate(task, data, tokenizer, questions, monkeypatch, tmp_path, threshold=0.0):
    """eval.py's path from files to results and written files, the model's logits replaced by ``_logits``."""
    splits = downstream_tasks.read_splits(task, stored_run(_config(tokenizer)), str(data), None)
    logits = _logits(splits[0].extra, questions)
    monkeypatch.setattr(downstream_tasks, "predict", lambda *args: logits)
    results, predictions, odds = downstream_tasks.evaluate(None, None, None, task, splits, 8, threshold)
    written = downstream_tasks.write_predictions(tmp_path / "predictions.json", task, predictions, odds)
    return results[splits[0].name], written


# ---------------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("threshold", [0.0, -0.6, 1.0])
def test_squad2_figures_equal_evaluate_v2_on_the_written_files(files, monkeypatch, tmp_path, threshold):
    _, data, tokenizer = files
    got, written = _evaluate("squad2", data, tokenizer, V2, monkeypatch, tmp_path, threshold)
    predictions = json.loads((tmp_path / "predictions.json").read_text())
    assert written == {"null_odds_file": str(tmp_path / "predictions.null_odds.json")}
    odds = json.loads(pathlib.Path(written["null_odds_file"]).read_text())
    assert set(predictions) == set(odds) == {*V2, "e0"}  # flat: {question id: answer}
    assert odds["e0"] == float("inf") and predictions["e0"] == ""
    for qid, (_, _, text, want_odds) in V2.items():
        assert odds[qid] == want_odds and predictions[qid] == ("" if want_odds > threshold else text)
    messages = []
    want = official_v2(json.loads(data.read_text()), predictions, odds, messages)
    assert not messages
    for key in V2_KEYS:
        assert got[key] == want[key], key
    assert got["null_score_diff_threshold"] == threshold
    assert got["broken_offsets"] == 1 and got["broken_offset_ids"] == ["b1"]


def test_squad2_edge_cases_at_threshold_0(files, monkeypatch, tmp_path):
    """The three cases megajax used to score differently, by hand: (a) n1 ("the") and n2 (".") each take 1 from
    the sweep; (c) c1, answerable with the gold "the" and written "", scores 1."""
    _, data, tokenizer = files
    got, _ = _evaluate("squad2", data, tokenizer, V2, monkeypatch, tmp_path)
    # exact: a1 1, a2 0, a3 0, n2 1, a4 0, a5 0 (odds > 1), n1 1, n3 1, n4 0, c1 1, c2 0 (odds > 1), b1 1, t1 1,
    # t2 0, i1 1 (listed answers: answerable), e0 1 (odds inf, unanswerable): 9 of 16
    assert got["exact"] == 100.0 * 9 / 16 and got["total"] == 16
    assert (got["HasAns_total"], got["NoAns_total"]) == (10, 6)
    # sweep from 6 (the unanswerable ones) in odds order: b1 +1 = 7, a1 +1 = 8 (the best, first reached at -2),
    # a2 +0, n1 -1 = 7 (megajax used to add 0), i1 +1 = 8, a3 +0, n2 -1 = 7, n4 -1 = 6, t1 +1 = 7, t2 -1 = 6
    # ("1990": odds 0 is not above 0), a4 +0, c1 +1 = 7, n3 +0, c2 +1 = 8, a5 +0, e0 +0
    assert got["best_exact"] == 100.0 * 8 / 16 and got["best_exact_thresh"] == -2.0


def test_squad2_missing_prediction_counts_0(files, capsys):
    """evaluate-v2.0.py prints the message and then fails (KeyError) on such a file; here the question scores 0.
    An answerable question scoring 0 moves none of the figures the reference computes with a wrong answer."""
    from megajax.data.tasks.squad import read_squad

    _, data, _ = files
    examples = read_squad(data).examples
    answers = {q: ("" if o > 0 else t) for q, (_, _, t, o) in V2.items()} | {"e0": ""}
    odds = {q: o for q, (_, _, _, o) in V2.items()} | {"e0": float("inf")}
    got = squad2_scores(examples, {q: a for q, a in answers.items() if q != "a3"}, odds)
    assert "Missing prediction for a3" in capsys.readouterr().err
    messages = []
    with pytest.raises(KeyError):  # the official script on the file without a3
        official_v2(json.loads(data.read_text()), {q: a for q, a in answers.items() if q != "a3"}, odds, messages)
    assert messages == ["Missing prediction for a3"]
    want = official_v2(json.loads(data.read_text()), answers | {"a3": "zzz"}, odds, [])
    for key in V2_KEYS:
        assert got[key] == want[key], key


def test_squad1_figures_equal_evaluate_v1_on_the_written_file(files, monkeypatch, tmp_path, capsys):
    data, _, tokenizer = files
    got, written = _evaluate("squad1", data, tokenizer, V1, monkeypatch, tmp_path)
    assert written == {}
    predictions = json.loads((tmp_path / "predictions.json").read_text())
    assert predictions == {q: t for q, (_, _, t, _) in V1.items()}
    want = official_v1(json.loads(data.read_text()), predictions, [])
    assert (got["exact"], got["f1"], got["total"]) == (want["exact_match"], want["f1"], len(V1))
    # (b): e1's "The" matches the gold "the" (EM 1, F1 0); megajax used to drop that gold and score EM 0
    assert want["exact_match"] == 100.0 * 5 / 6

    from megajax.data.tasks.squad import read_squad  # a missing prediction: the script's message, score 0

    capsys.readouterr()
    without = {q: t for q, t in predictions.items() if q != "m1"}
    messages = []
    want = official_v1(json.loads(data.read_text()), without, messages)
    got = squad1_scores(read_squad(data).examples, without)
    assert (got["exact"], got["f1"]) == (want["exact_match"], want["f1"])
    assert messages[0] in capsys.readouterr().err and messages == ["Unanswered question m1 will receive score 0."]


def test_null_threshold_flag_only_for_squad2(tmp_path):
    from megajax.evaluation.inputs import InputError
    from megajax.evaluation.runner import run

    with pytest.raises(InputError, match="--null_score_diff_threshold applies to --task=squad2"):
        run(str(tmp_path), "squad1", null_score_diff_threshold=0.5)


# ---------------------------------------------------------------------------------------------------- end to end

SENTENCES = ["the cat sat on the mat .", "a dog ran in the park .", "john played the big red ball .",
             "mary was at the river .", "the team won the game !", "denver won the super bowl in 1990 .",
             "paris is a big city of france .", "the long blue river ran to london ."]


def _synthetic_squad(path, n, seed, broken):
    """n questions over 2-sentence contexts, about a third unanswerable; ``broken`` answerable ones with their
    answer_start one character off."""
    rng = np.random.default_rng(seed)
    qas_by_context, off = collections.defaultdict(list), 0
    for i in range(n):
        a, b = rng.choice(len(SENTENCES), 2, replace=False)
        context = f"{SENTENCES[a]} {SENTENCES[b]}"
        words = SENTENCES[b].split()[:-1]
        k = int(rng.integers(0, len(words) - 1))
        answer = " ".join(words[k:k + int(rng.integers(1, 3))])
        start = len(SENTENCES[a]) + 1 + len(" ".join(words[:k])) + (1 if k else 0)
        assert context[start:start + len(answer)] == answer
        impossible = i % 3 == 2
        off += not impossible
        qa = {"id": f"s{seed}q{i}", "question": f"what {words[0]} ?", "is_impossible": impossible,
              "answers": [] if impossible else [{"text": answer, "answer_start": start + (off <= broken)}]}
        qas_by_context[context].append(qa)
    path.write_text(json.dumps({"version": "v2.0", "data": [{"title": "s", "paragraphs": [
        {"context": c, "qas": q} for c, q in qas_by_context.items()]}]}))


def test_finetune_then_eval_py_equals_evaluate_v2(tmp_path, capsys):
    from megajax.training.loop import train

    task_dir = tmp_path / "squad"
    task_dir.mkdir()
    _synthetic_squad(task_dir / "train-v2.0.json", 40, 0, broken=3)  # 3 of 40 dropped: allowed with the flag
    _synthetic_squad(task_dir / "dev-v2.0.json", 12, 1, broken=1)
    tokenizer = tmp_path / "tokenizer.json"
    wordpiece_tokenizer().save(str(tokenizer))
    c = _config(tokenizer)
    c.model.update(num_layers=1, hidden_size=32, num_heads=4, dropout=0.0, remat="none")
    c.mesh.data = c.mesh.model = 1
    c.data.update(task="squad2", task_dir=str(task_dir), max_dropped_fraction=0.1)
    c.train.update(steps=3, global_batch_size=8, precision="fp32", log_every=1000, eval_batches=0)
    c.checkpoint.update(every_steps=1000, async_save=False)
    train(c, tmp_path / "run")
    start = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    report = start["task_data"]["train"]
    assert report["questions"] == 40 and report["dropped_questions"] == 3
    assert sorted(report["dropped"]["answer text not at its answer_start"]["first_ids"]) == ["s0q0", "s0q1", "s0q3"]
    assert start["task_data"]["valid"]["broken_offsets"] == 1 and "task_data=" in capsys.readouterr().err

    repo = pathlib.Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("eval_cli", repo / "eval.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    out, predictions = tmp_path / "results.json", tmp_path / "predictions.json"
    cli.main([f"--checkpoint={tmp_path / 'run'}", "--task=squad2", "--mesh=1x1", "--batch_size=4",
              f"--output={out}", f"--predictions={predictions}", "--null_score_diff_threshold=0.5"])
    results = json.loads(out.read_text())
    odds = json.loads(pathlib.Path(results["null_odds_file"]).read_text())
    written = json.loads(predictions.read_text())
    assert len(written) == len(odds) == 12
    want = official_v2(json.loads((task_dir / "dev-v2.0.json").read_text()), written, odds, [])
    for key in V2_KEYS:
        assert results["dev"][key] == want[key], key
