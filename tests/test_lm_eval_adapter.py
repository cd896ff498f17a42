"""The lm-evaluation-harness adapter on a tiny GPT checkpoint: its log-likelihoods against megajax's scorer and a
naive float64 softmax (meshes 1x1 and 2x4), its rolling log-likelihoods against lm-eval's own windows scored by a
plain forward, greedy generate_until against megajax's generation, an offline lm-eval run of a local YAML task
over a jsonl file, and the output folder named as lm-eval names a Hugging Face model's."""

import functools
import json
import math
import re

import jax
import numpy as np
import pytest
from flax import nnx

pytest.importorskip("lm_eval")

from conftest import small_config  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

from megajax.checkpoint import save_params  # noqa: E402
from megajax.config import (
    abstract_model,  # noqa: E402
    rules_of,  # noqa: E402
)
from megajax.data.indexed import IndexedWriter  # noqa: E402
from megajax.data.tokenizer import train_tokenizer  # noqa: E402
from megajax.evaluation.generate import Sampling, generate  # noqa: E402
from megajax.evaluation.lm_eval_adapter import MegajaxLM  # noqa: E402
from megajax.evaluation.scoring import Scorer, cloze_rows  # noqa: E402
from megajax.parallel.mesh import MeshShape
from megajax.parallel.sharding import ParallelContext, activate  # noqa: E402

SEQ_LEN = 16
CORPUS = [f"the cat {w} on the mat . a dog ran {w} far away ; blue sky {i}" for i, w in
          enumerate(["sat", "lay", "slept", "stood", "ate", "sang"] * 8)]
PAIRS = [("the cat sat on", " the mat"), ("a dog ran", " far away ; blue"), ("", "the cat"),
         ("the cat lay on the mat . a dog ran far away ; blue sky 3 the cat slept on the mat .", " a dog"),
         ("blue sky ", "12")]  # trailing context space (moved), empty context, context longer than max_seq_len
# Lengths 3, 36 (three windows, the last of 4 tokens), 78 (five), 1 and 0 tokens.
DOCS = ["the cat sat", " ".join(CORPUS[i] for i in (0, 7)), " ".join(CORPUS[i] for i in (0, 7, 14, 21)), "x", ""]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(export path, in-memory model, tokenizer): the tokenizer found the way eval.py finds it, through the
    training data's sidecar named in the checkpoint's config."""
    root = tmp_path_factory.mktemp("lmeval")
    tok = train_tokenizer(CORPUS, "bpe", 300)
    tok.save(root / "tok.json")
    writer = IndexedWriter(root / "data", np.uint16)
    writer.add(np.asarray(tok.encode_batch(CORPUS[:1])[0]))
    writer.commit({"tokenizer": str(root / "tok.json"), "vocab_size": tok.vocab_size})
    config = small_config()
    config.model.update(max_seq_len=SEQ_LEN, vocab_size=tok.vocab_size)  # every id decodes to text
    config.data.update(source="indexed", path=str(root / "data"))
    # Parameters drawn in numpy (an eager or jitted initialiser costs 10-20 s on 2 CPU cores). LayerNorms start as
    # the identity: random LN biases make one token the argmax after every context, and greedy text one word.
    graphdef, abstract = nnx.split(abstract_model(config))
    rng = np.random.default_rng(3)

    def draw(path, a):
        name = str(path[-1].key)
        if name == "scale":
            return np.ones(a.shape, a.dtype)
        return np.zeros(a.shape, a.dtype) if name == "bias" else (rng.standard_normal(a.shape) * 0.2).astype(a.dtype)
    params = jax.tree_util.tree_map_with_path(draw, nnx.to_pure_dict(abstract))
    path = save_params(root / "ck", params, config.to_json())
    return path, nnx.merge(graphdef, params), tok


@pytest.fixture(scope="module")
def adapters(checkpoint):
    """The adapter on each mesh, built once (each compiles its scorer)."""
    return {mesh: MegajaxLM(str(checkpoint[0]), mesh=mesh, batch_size=3, max_gen_toks=6)
            for mesh in ("1x1", "2x4")}


@pytest.fixture(params=["1x1", "2x4"])
def lm(request, adapters):
    return adapters[request.param]


def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's causal split: trailing context spaces join the continuation; the whole is encoded and split;
    an empty context is the end-of-document token."""
    if not context:
        return [tok.eod_id], tok.encode_batch([continuation])[0]
    stripped = context.rstrip()
    continuation, context = context[len(stripped):] + continuation, stripped
    whole, ctx = tok.encode_batch([context + continuation, context])
    return ctx, whole[len(ctx):]


@functools.cache
def _forward(model):
    graphdef, state = nnx.split(model)
    forward = jax.jit(lambda state, tokens: nnx.merge(graphdef, state)(tokens))
    return lambda tokens: forward(state, tokens)


def full_logits(model, ids) -> np.ndarray:
    """float64 logits over the real vocabulary for one row of up to SEQ_LEN tokens (1x1 mesh)."""
    with activate(MeshShape(1, 1).make(), ParallelContext(rules_of(small_config()))):
        logits = _forward(model)(np.asarray([list(ids) + [0] * (SEQ_LEN - len(ids))], np.int32))
    return np.asarray(logits[0, :len(ids), :model.cfg.vocab_size], np.float64)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def naive_loglikelihood(model, ctx, cont) -> tuple[float, bool]:
    ids = (ctx + cont)[-(SEQ_LEN + 1):]
    logits = full_logits(model, ids[:-1])[-len(cont):]
    return float(log_softmax(logits)[np.arange(len(cont)), cont].sum()), bool((logits.argmax(-1) == cont).all())


def lm_eval_rolling(model, tokens, prefix) -> tuple[float, int]:
    """(log-likelihood, windows) as lm-eval's HF model computes it: lm-eval's windows (context of one token, made
    disjoint), each row (context + continuation)[-(SEQ_LEN + 1):][:-1] through a plain forward, its last
    len(continuation) positions scored in float64, summed."""
    windows = [make_disjoint_window(w) for w in get_rolling_token_windows(tokens, prefix, SEQ_LEN, 1)]
    total = 0.0
    for context, continuation in windows:
        ids = (context + continuation)[-(SEQ_LEN + 1):]
        logp = log_softmax(full_logits(model, ids[:-1])[-len(continuation):])
        total += float(logp[np.arange(len(continuation)), continuation].sum())
    return total, len(windows)


@pytest.fixture(scope="module")
def reference(checkpoint):
    """What the adapter must return, computed once on the in-memory model (1x1): megajax's scorer and a naive
    float64 softmax for the log-likelihoods, megajax's greedy generation for the continuations."""
    _, model, tok = checkpoint
    scorer = Scorer(model, MeshShape(1, 1).make(), rules_of(small_config()), 4, SEQ_LEN)
    encoded = [encode_pair(tok, *pair) for pair in PAIRS]
    assert len(encoded[3][0]) > SEQ_LEN  # the long context is cut from the left
    inputs, labels, mask = (np.stack(x) for x in zip(*[cloze_rows(c, t, SEQ_LEN) for c, t in encoded]))
    nll, hit = scorer(inputs, labels)
    pairs = [(-n[m].astype(np.float64).sum(), bool(h[m].all()), *naive_loglikelihood(model, c, t))
             for n, h, m, (c, t) in zip(nll, hit, mask, encoded)]
    rolling = [lm_eval_rolling(model, tok.encode_batch([d])[0], tok.eod_id) for d in DOCS]
    assert [n for _, n in rolling] == [1, 3, 5, 1, 0]
    prompts = np.asarray(tok.encode_batch(CONTEXTS), np.int32)  # equal lengths: one batch, one compile
    out = generate(model, MeshShape(1, 1).make(), rules_of(small_config()), prompts, 6, Sampling(temperature=0.0))
    full = [tok.decode(row[prompts.shape[1]:].tolist()) for row in out]
    return {"pairs": pairs, "rolling": rolling, "generated": full, "scorer": scorer}


def close(a: float, b: float) -> bool:
    """Within 1e-5, relative to the sum (float32 log-probs summed over up to a few hundred tokens)."""
    return math.isclose(a, b, rel_tol=1e-5, abs_tol=1e-5)


CONTEXTS = ["the cat sat on", "the cat lay on", "a dog ran far"]


def test_loglikelihood_equals_megajax_scorer_and_naive_softmax(lm, reference):
    got = lm.loglikelihood([Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(PAIRS)])
    for (ll, greedy), (scorer_ll, scorer_greedy, naive_ll, naive_greedy) in zip(got, reference["pairs"]):
        assert close(ll, scorer_ll) and close(ll, naive_ll), (ll, scorer_ll, naive_ll)
        assert greedy == scorer_greedy == naive_greedy


def test_loglikelihood_rolling_equals_lm_eval_windows_scored_by_a_plain_forward(lm, reference):
    """Within 1e-4 nats per document (float32 forwards on a mesh against a float64 softmax of an unsharded one)."""
    got = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (d,), i) for i, d in enumerate(DOCS)])
    assert len(got) == len(DOCS)
    for ll, (want, _) in zip(got, reference["rolling"]):
        assert abs(ll - want) <= 1e-4, (ll, want)
    assert got[-1] == 0.0  # an empty document has no windows


def test_stride_is_refused(checkpoint):
    """The old Megatron-window ``stride`` fails, naming eval.py's ppl task, instead of being silently ignored."""
    with pytest.raises(ValueError, match="--task=ppl"):
        MegajaxLM(str(checkpoint[0]), stride=6)


def test_generate_until_is_megajax_greedy_generation_cut_at_the_stop_string(lm, reference):
    full = reference["generated"]
    stop = full[0][len(full[0]) // 2:][:2]  # a stop string inside the first continuation
    assert stop and stop in full[0]
    requests = [Instance("generate_until", {}, (c, {"until": [stop], "max_gen_toks": 6, "temperature": 0.0}), i)
                for i, c in enumerate(CONTEXTS)]
    got = lm.generate_until(requests)
    assert got == [f[:f.index(stop)] if stop in f else f for f in full]
    assert 0 < len(got[0]) < len(full[0]) and len(set(full)) == len(full)  # cut mid-way; the texts differ
    for kwargs, error in [({"num_beams": 2}, "num_beams"), ({"max_gen_toks": SEQ_LEN}, "max_gen_toks=16")]:
        with pytest.raises(ValueError, match=error):  # unsupported settings fail instead of being ignored
            lm.generate_until([Instance("generate_until", {}, ("a dog", kwargs), 0)])


TASK_YAML = """task: megajax_tiny
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    higher_is_better: true
"""


def test_offline_lm_eval_run_of_a_local_task(tmp_path, monkeypatch, checkpoint, reference, adapters):
    """lm_eval.simple_evaluate on a YAML task over a local jsonl file (datasets' json builder, offline): its
    per-choice log-likelihoods equal megajax's scorer."""
    import lm_eval
    import lm_eval.evaluator
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))
    # torch's environment report (subprocesses, ~6 s on 2 cores) is not under test; torch_random_seed=None below
    # keeps lm-eval from importing torch to seed it.
    monkeypatch.setattr(lm_eval.evaluator, "add_env_info", lambda results: None)
    docs = [{"context": "the cat sat on the", "choices": ["mat", "dog", "sky"], "answer": 0},
            {"context": "a dog ran far", "choices": ["away", "blue"], "answer": 0}]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "tiny.yaml").write_text(TASK_YAML.format(data=tmp_path / "docs.jsonl"))
    tok = checkpoint[2]
    out = lm_eval.simple_evaluate(model=adapters["1x1"], tasks=["megajax_tiny"], task_manager=TaskManager(
        include_path=str(tmp_path / "tasks"), include_defaults=False), log_samples=True, bootstrap_iters=0,
        torch_random_seed=None)
    samples = out["samples"]["megajax_tiny"]
    assert len(samples) == len(docs)
    scorer = reference["scorer"]
    for sample in sorted(samples, key=lambda s: s["doc_id"]):
        doc = docs[sample["doc_id"]]
        for choice, resp in zip(doc["choices"], sample["resps"]):
            ctx, cont = encode_pair(tok, doc["context"], " " + choice)  # lm-eval's default target_delimiter
            inputs, labels, mask = cloze_rows(ctx, cont, SEQ_LEN)
            nll, _ = scorer(inputs[None], labels[None])
            assert close(resp[0][0], -nll[0][mask].astype(np.float64).sum())
    assert 0.0 <= out["results"]["megajax_tiny"]["acc,none"] <= 1.0 and not math.isnan(
        out["results"]["megajax_tiny"]["acc,none"])


TIMESTAMP = r"\d{4}-\d\d-\d\dT\d\d-\d\d-\d\d(\.\d+)?"  # datetime.isoformat() with ":" -> "-"


@pytest.mark.parametrize("model_args", ["pretrained=runs/355m,mesh=1x8", {"pretrained": "runs/355m", "mesh": "1x8"}])
def test_output_folder_is_named_as_lm_eval_names_a_pretrained_model(tmp_path, model_args):
    """--output_path's results file lands where lm-eval puts an HF model's with pretrained= the same path
    (``<output>/runs__355m/results_<timestamp>.json``): lm-eval's own naming, with megajax's pretrained= key."""
    from lm_eval.loggers import EvaluationTracker

    def results_file(source: str, args) -> tuple:
        tracker = EvaluationTracker(output_path=str(tmp_path / source))
        tracker.general_config_tracker.log_experiment_args(  # as simple_evaluate calls it
            model_source=source, model_args=args, system_instruction=None, chat_template=None,
            fewshot_as_multiturn=False)
        tracker.save_results_aggregated(results={}, samples=None)
        (path,) = (tmp_path / source).glob("*/results_*.json")
        return path.relative_to(tmp_path / source), json.loads(path.read_text())["model_name"]

    ours, name = results_file("megajax", model_args)
    hf, hf_name = results_file("hf", "pretrained=runs/355m,dtype=float32")
    assert ours.parent == hf.parent == type(ours)("runs__355m") and name == hf_name == "runs/355m"
    assert re.fullmatch(f"results_{TIMESTAMP}.json", ours.name), ours


def test_registered_under_megajax():
    """``--model megajax`` finds the adapter once its module is imported (as ``python -m megajax.lm_eval`` does)."""
    from lm_eval.api.registry import get_model

    assert get_model("megajax") is MegajaxLM
