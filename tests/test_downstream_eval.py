"""eval.py --task=mnli|qqp|squad1|squad2|race on fine-tuned (here: freshly initialised) task checkpoints: the
metrics equal those computed by hand from the model run one example at a time, on 1x1 (SQuAD 2.0, the task with
the most steps between logits and metrics, also on 2x4), with padded last batches; bad inputs fail before the
model is loaded."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from downstream_fixtures import wordpiece_tokenizer
from flax import nnx

from megajax.checkpoint import save_params
from megajax.config import bert_base_config, build_mesh, create_model
from megajax.data.tasks.task_data import TASK_CLASSES
from megajax.evaluation.inputs import InputError
from megajax.evaluation.runner import run
from megajax.models import task_models

SENTENCES = ["the cat sat on the mat .", "a dog ran in the park .", "john played the big red ball .",
             "mary was at the river .", "the team won the game !", "what did the cat do ?",
             "where is the long blue river ?", "denver won the super bowl in 1990 .", "it was not the same game ."]
CONTEXT = ("Denver Broncos won the Super Bowl in 1990. The game was played in Paris, France at the city park. "
           "Mary played the big red ball and John ran to the long blue river. The team did not play in London. "
           "The cat sat on the mat and the dog ran in the park. Who played the game? The team played it in the city "
           "and the big dog sat at the river. Mary and John were not at the park when the team won.")
MNLI_HEADER = ("index promptID pairID genre sentence1_binary_parse sentence2_binary_parse sentence1_parse "
               "sentence2_parse sentence1 sentence2 label1 gold_label").split()
MNLI_LABELS = ("contradiction", "entailment", "neutral")
SEQ = {"mnli": 24, "qqp": 24, "squad1": 72, "squad2": 72, "race": 32}  # SQuAD: 64 query tokens at most + 3 + context


def _tsv(path, header, rows):
    path.write_text("\n".join("\t".join(r) for r in [header, *rows]) + "\n", encoding="utf-8")


def _squad(path, version_2):
    qas = [("q1", "Who won the Super Bowl?", "Denver Broncos"), ("q2", "Where was the game played?", "Paris, France"),
           ("q3", "Who ran to the river?", "John"), ("q4", "Where did the dog run?", "in the park"),
           ("q5", "Who won the world cup?", None)]
    records = []
    for qid, question, answer in qas if version_2 else qas[:4]:
        record = {"id": qid, "question": question,
                  "answers": [] if answer is None else [{"text": answer, "answer_start": CONTEXT.rindex(answer)}]}
        if version_2:
            record["is_impossible"] = answer is None
        records.append(record)
    path.write_text(json.dumps({"version": "x", "data": [{"title": "t", "paragraphs": [
        {"context": CONTEXT, "qas": records}]}]}))


def _race(folder, level, name, n):
    folder.joinpath(level).mkdir(parents=True, exist_ok=True)
    questions = [SENTENCES[(i + n) % 9].replace(" .", " _ .") for i in range(n)]
    options = [[SENTENCES[(i + j) % 9][:12] for j in range(4)] for i in range(n)]
    folder.joinpath(level, name).write_text(json.dumps({
        "id": name, "article": " ".join(SENTENCES[n:]), "questions": questions, "options": options,
        "answers": ["ABCD"[(i * 3 + n) % 4] for i in range(n)]}))


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Task folders as the tasks are downloaded, and a tiny WordPiece tokenizer.json."""
    root = tmp_path_factory.mktemp("tasks")
    tokenizer = root / "tokenizer.json"
    wordpiece_tokenizer().save(str(tokenizer))
    pairs = [(a, b) for a in SENTENCES for b in SENTENCES[:3]]
    (root / "mnli").mkdir()
    for name, part in (("dev_matched.tsv", pairs[:11]), ("dev_mismatched.tsv", pairs[11:20])):
        _tsv(root / "mnli" / name, MNLI_HEADER, [[str(i), "p", "q", "g", "(", ")", "(", ")", a, b,
                                                   MNLI_LABELS[i % 3], MNLI_LABELS[i % 3]]
                                                  for i, (a, b) in enumerate(part)])
    (root / "qqp").mkdir()
    _tsv(root / "qqp" / "dev.tsv", "id qid1 qid2 question1 question2 is_duplicate".split(),
         [[str(i), "1", "2", a, b, str(i % 2)] for i, (a, b) in enumerate(pairs[:13])])
    (root / "squad").mkdir()
    _squad(root / "squad" / "dev-v1.1.json", False)
    _squad(root / "squad" / "dev-v2.0.json", True)
    for split, parts in (("dev", (("middle", "1.txt", 3), ("high", "2.txt", 2))), ("test", (("middle", "3.txt", 4),))):
        for level, name, n in parts:
            _race(root / "race" / split, level, name, n)
    return root, tokenizer


def _task_config(task, files):
    root, tokenizer = files
    model, classes = task_models()[task].name, TASK_CLASSES.get(task, 0)
    c = bert_base_config(model)
    c.model.update(**({"num_classes": classes} if classes else {}), vocab_size=128, make_vocab_size_divisible_by=64,
                   num_layers=1, hidden_size=32, num_heads=4, max_seq_len=SEQ[task], dropout=0.0, remat="none")
    c.mesh.data = c.mesh.model = 1
    folder = {"squad1": "squad", "squad2": "squad"}.get(task, task)
    c.data.update(source="task", task=task, task_dir=str(root / folder), tokenizer=str(tokenizer))
    c.train.precision = "fp32"
    return c


@pytest.fixture(scope="module")
def checkpoints(files, tmp_path_factory):
    """Per task: a params-only task-model checkpoint (random weights) and the 1x1 model itself."""
    out, root = {}, tmp_path_factory.mktemp("checkpoints")
    for i, task in enumerate(SEQ):
        config = _task_config(task, files)
        model = create_model(config, build_mesh(config), seed=i)
        save_params(root / task, nnx.to_pure_dict(nnx.state(model)), config.to_json())
        out[task] = (root / task, model)
    return out


def _one_at_a_time(model, rows):
    """The model's float32 outputs for each row alone (batch 1, no padding rows), stacked."""
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda s, *x: nnx.merge(graphdef, s)(*x))
    outs = []
    for i in range(len(rows)):
        row = rows.rows(np.array([i]))
        out = forward(state, *(jnp.asarray(row[k]) for k in ("tokens", "token_types", "padding_mask")))
        outs.append([np.asarray(x[0], np.float32) for x in (out if isinstance(out, tuple) else (out,))])
    return [np.stack(x) for x in zip(*outs)]


def _reference(task, model, files):
    """Per split: (metrics computed here from per-example outputs, predicted ids)."""
    from megajax.data.tasks import glue, race, squad
    from megajax.evaluation.squad_decode import answers_at, decode_squad
    from megajax.evaluation.squad_metrics import squad1_scores, squad2_scores

    root, tokenizer = files
    seq = SEQ[task]
    if task in ("mnli", "qqp"):
        read = glue.read_mnli if task == "mnli" else glue.read_qqp
        names = {"mnli": ("matched", "mismatched"), "qqp": ("dev",)}[task]
        out = {}
        for name in names:
            path = root / task / ("dev.tsv" if task == "qqp" else f"dev_{name}.tsv")
            rows = glue.featurize_pairs(read(path).examples, wordpiece_tokenizer(), seq, name)
            pred = _one_at_a_time(model, rows)[0].argmax(-1)
            labels = rows.targets["labels"]
            metrics = {"accuracy": 100 * np.mean(pred == labels), "examples": len(labels)}
            if task == "qqp":
                tp, fp, fn = (np.sum((pred == p) & (labels == g)) for p, g in ((1, 1), (1, 0), (0, 1)))
                metrics.update(f1=100 * 2 * tp / (2 * tp + fp + fn), skipped_rows=0)
            out[name] = metrics
        return out
    if task == "race":
        out = {}
        for split in ("dev", "test"):
            examples = race.read_race(root / "race" / split)
            pred = _one_at_a_time(model, race.featurize_race(examples, wordpiece_tokenizer(), seq))[0].argmax(-1)
            right = pred == np.array([e.label for e in examples])
            levels = np.array([e.level for e in examples])
            out[split] = {lvl: 100 * right[levels == lvl].mean() for lvl in ("middle", "high") if (levels == lvl).any()}
            out[split].update(all=100 * right.mean(), examples=len(examples))
        return out
    name = "dev-v1.1.json" if task == "squad1" else "dev-v2.0.json"
    data = squad.read_squad(root / "squad" / name)
    features = squad.featurize_squad(data.examples, wordpiece_tokenizer(), seq, training=False)
    assert len(features) > len(data.examples)  # the context needs several windows: they are merged per question
    spans = decode_squad(features, *_one_at_a_time(model, features.task), max_answer_length=30)
    if task == "squad1":
        scores = squad1_scores(data.examples, answers_at(spans, None))
    else:  # the predictions file at null threshold 0 and its null odds
        scores = squad2_scores(data.examples, answers_at(spans, 0.0), {q: p.null_margin for q, p in spans.items()})
    return {"dev": {**scores, "windows": len(features), "broken_offsets": 0}}


@pytest.mark.parametrize("task, meshes", [("mnli", [(1, 1)]), ("qqp", [(1, 1)]), ("race", [(1, 1)]),
                                          ("squad1", [(1, 1)]), ("squad2", [(1, 1), (2, 4)])])
def test_metrics_equal_the_hand_computed_ones(task, meshes, checkpoints, files, tmp_path, monkeypatch):
    path, model = checkpoints[task]
    want = _reference(task, model, files)
    monkeypatch.chdir(path.parent)  # relative checkpoint path, default --data (the run's task_dir)
    for data, tensor in meshes:
        out = tmp_path / f"{task}_{data}x{tensor}.json"
        got = run(task, task, mesh_data=data, mesh_model=tensor, batch_size=3, output=str(out),
                  predictions=str(tmp_path / "predictions.json"), overwrite=True)  # each mesh's replaces the last
        assert got["mesh"] == f"{data}x{tensor}" and json.loads(out.read_text()) == got
        assert set(got) - {"task", "checkpoint", "mesh", "null_odds_file"} == set(want)
        for split, metrics in want.items():
            for key, value in metrics.items():
                tolerance = dict(rel=1e-5) if key.endswith("thresh") else dict(abs=1e-9)  # a logit / a percentage
                assert got[split][key] == pytest.approx(value, **tolerance), (split, key)
    predictions = json.loads((tmp_path / "predictions.json").read_text())
    if task.startswith("squad"):  # the official predictions file: {question id: answer text}, not per split
        assert sorted(predictions) == ["q1", "q2", "q3", "q4", "q5"][:4 if task == "squad1" else 5]
        assert all(isinstance(text, str) for text in predictions.values())
        assert ("null_odds_file" in got) == (task == "squad2")
        return
    assert set(predictions) == set(want)  # per split, keyed by the files' own ids
    ids = {"mnli": [str(i) for i in range(11)], "qqp": [str(i) for i in range(13)],
           "race": ["1.txt:0", "1.txt:1", "1.txt:2", "2.txt:0", "2.txt:1"]}[task]
    first = "dev" if task == "race" else next(iter(want))
    assert list(predictions[first]) == ids


def test_one_file_as_data(checkpoints, files):
    root, _ = files
    got = run(str(checkpoints["mnli"][0]), "mnli", data=str(root / "mnli" / "dev_mismatched.tsv"), mesh_data=1)
    assert set(got) == {"task", "checkpoint", "mesh", "dev_mismatched"} and got["dev_mismatched"]["examples"] == 9


def test_inputs_fail_before_loading(checkpoints, files, tmp_path):
    root, tokenizer = files
    mnli, squad = str(checkpoints["mnli"][0]), str(checkpoints["squad1"][0])
    cases = [
        (dict(checkpoint=mnli, task="qqp"), "--task=qqp has 2 classes but this checkpoint's classifier has 3"),
        (dict(checkpoint=squad, task="mnli"), r"model \(bert_span\); use --task=squad1 or squad2"),
        (dict(checkpoint=mnli, task="ppl", data="x"), r"model \(bert_classifier\); use --task=mnli or qqp"),
        (dict(checkpoint=mnli, task="mnli", data=str(tmp_path)), "holds none of dev_matched.tsv, dev_mismatched.tsv"),
        (dict(checkpoint=mnli, task="mnli", data=str(tmp_path / "nope")), "does not exist"),
        (dict(checkpoint=mnli, task="mnli", tokenizer=str(tmp_path / "nope.json")), "pass --tokenizer=PATH"),
        (dict(checkpoint=mnli, task="mnli", stride=4), "--stride applies to"),
        (dict(checkpoint=squad, task="squad1", data=str(root / "mnli" / "dev_matched.tsv")), "not JSON|JSON"),
    ]
    for kwargs, message in cases:
        with pytest.raises(InputError, match=message):
            run(**kwargs)
    with pytest.raises(InputError, match="--predictions applies to"):
        run(mnli, "ppl", data="x", predictions=str(tmp_path / "p.json"))


def test_median_over_seeds(tmp_path, capsys):
    from megajax.evaluation.median import ResultsError, main, median_of

    accuracies = [(84.0, 83.5), (85.5, 84.0), (82.0, 86.0), (84.5, 85.0), (83.0, 82.5)]
    paths = []
    for seed, (m, mm) in enumerate(accuracies):
        paths.append(tmp_path / f"seed{seed}.json")
        paths[-1].write_text(json.dumps({"task": "mnli", "matched": {"accuracy": m, "examples": 9815, "file": "x"},
                                         "mismatched": {"accuracy": mm, "examples": 9832}, "mesh": "1x8"}))
    summary = median_of(paths)
    assert summary["median"] == {"matched.accuracy": 84.0, "matched.examples": 9815,
                                 "mismatched.accuracy": 84.0, "mismatched.examples": 9832}
    assert summary["values"]["mismatched.accuracy"] == [83.5, 84.0, 86.0, 85.0, 82.5] and summary["runs"] == 5
    assert median_of(paths[:2])["median"]["matched.accuracy"] == 84.75  # an even count: the middle two's mean
    other = tmp_path / "qqp.json"
    other.write_text(json.dumps({"task": "qqp", "dev": {"accuracy": 90.0}}))
    with pytest.raises(ResultsError, match="qqp.json holds --task=qqp results"):
        median_of([paths[0], other])
    (tmp_path / "bad.json").write_text("{")
    assert main([str(paths[0]), str(tmp_path / "bad.json")]) == 1
    assert "bad.json: not an eval.py result file" in capsys.readouterr().err
    assert main([str(p) for p in paths] + ["--output", str(tmp_path / "median.json")]) == 0
    assert json.loads((tmp_path / "median.json").read_text())["median"]["matched.accuracy"] == 84.0

