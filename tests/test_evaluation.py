"""Evaluation: window arithmetic, sliding-window perplexity vs a naive reference, the detokenizer, LAMBADA scoring,
cached generation, and equal results on every mesh."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import small_config
from megajax.checkpoint import save_params
from megajax.config import model_config, rules_of
from megajax.data.tokenizer import train_tokenizer
from megajax.evaluation.detokenize import original_token_count, wikitext_detokenize
from megajax.evaluation.generate import Sampling, generate
from megajax.evaluation.runner import run
from megajax.evaluation.scoring import Scorer, sliding_windows, stream_log_likelihood
from megajax.evaluation.tasks import lambada
from megajax.models.gpt import GPT
from megajax.sharding import make_mesh


@pytest.mark.parametrize("seq_len,stride", [(8, 1), (8, 3), (8, 8), (16, 5), (16, 16)])
def test_every_target_scored_once_with_enough_context(seq_len, stride):
    for n in [0, 1, 2, 3] + list(range(seq_len - 2, seq_len + 3)) + list(range(seq_len + stride - 2, 3 * seq_len + 3)):
        windows = sliding_windows(n, seq_len, stride)
        scored = [t for _, first, end in windows for t in range(first, end + 1)]
        assert sorted(scored) == list(range(1, n)) and len(scored) == len(set(scored)), (n, windows)
        for k, (start, first, end) in enumerate(windows):
            assert start >= 0 and end - start <= seq_len
            if k:  # later windows keep at least seq_len - stride tokens of context before their first target
                assert first - start >= seq_len - stride and end - start == seq_len


@pytest.fixture(scope="module")
def tiny_model():
    config = small_config()
    config.model.max_seq_len = 16
    model = GPT(model_config(config), rngs=nnx.Rngs(1))
    return model, config


def _naive_scorer(model):
    """-log p(tokens[target] | context) for one context at a time: the context is written at the start of a
    seq_len buffer (what follows it cannot affect a causal model) and the logits read at its last position."""
    graphdef, state = nnx.split(model)

    @jax.jit
    def nll(state, buffer, length, target_token):
        logits = nnx.merge(graphdef, state)(buffer[None])[0]
        logp = jax.nn.log_softmax(jax.lax.dynamic_index_in_dim(logits, length - 1, keepdims=False))
        return -logp[target_token]

    def score(tokens, target, start):
        buffer = np.zeros(16, np.int32)
        buffer[:target - start] = tokens[start:target]
        return float(nll(state, jnp.asarray(buffer), target - start, int(tokens[target])))
    return score


@pytest.mark.parametrize("stride", [1, 4, 16])
def test_sliding_window_nll_equals_naive_reference(tiny_model, stride):
    model, config = tiny_model
    tokens = np.random.default_rng(2).integers(0, 1000, 45)
    scorer = Scorer(model, make_mesh(1, 1), rules_of(config), batch_size=4, seq_len=16)
    total, count = stream_log_likelihood(scorer, tokens, stride)
    windows = sliding_windows(len(tokens), 16, stride)
    start_of = {t: start for start, first, end in windows for t in range(first, end + 1)}
    if stride == 1:  # the full left context, capped at seq_len
        assert all(start_of[t] == max(0, t - 16) for t in range(1, 45))
    naive_nll = _naive_scorer(model)
    naive = sum(naive_nll(tokens, t, start_of[t]) for t in range(1, 45))
    assert count == 44
    np.testing.assert_allclose(total, naive, rtol=1e-5)


@pytest.mark.parametrize("raw,want", [
    ("the U.S. @-@ based firm", "the U.S.-based firm"),
    ("1 @,@ 000 people", "1,000 people"),
    ("3 @.@ 5 million", "3.5 million"),
    ("He said : yes", "He said: yes"),
    ("one ; two", "one; two"),
    ("It ended . Then", "It ended. Then"),
    ("Stop ! Now", "Stop! Now"),
    ("Why ? Because", "Why? Because"),
    ("red , green", "red, green"),
    ("the ( big ) dog", "the (big) dog"),
    ("a [ note ] here", "a [note] here"),
    ("a { set } here", "a {set} here"),
    ('he said " hello " twice', 'he said "hello" twice'),
    (" = = Career = = \n", " == Career ==\n"),
    (" = = = Early life = = = \n", " === Early life ===\n"),
    ("at 20 \u00b0 C", "at 20\u00b0C"),
    ("the players ' union", "the players' union"),
    ("John 's book", "John's book"),
    ("line end \n next", "line end\nnext"),
    ("about N people", "about 1 people"),
])
def test_wikitext_detokenizer_rules(raw, want):
    assert wikitext_detokenize(raw) == want


def test_original_token_count_is_taken_before_detokenizing():
    raw = " = Title = \n the U.S. @-@ based firm , it said . \n"
    assert original_token_count(raw) == len(raw.strip().split(" ")) == 13
    assert len(wikitext_detokenize(raw).strip().split(" ")) < 13


class OracleScorer:
    """Predicts the next token right only after tokens listed in ``knows`` (teacher forcing)."""

    seq_len = 32

    def __init__(self, knows):
        self.knows = knows

    def __call__(self, inputs, labels):
        hit = np.vectorize(lambda x, y: (int(x), int(y)) in self.knows)(inputs, labels)
        return np.zeros(inputs.shape, np.float32), hit


def test_lambada_whole_word_and_last_subword(tmp_path):
    corpus = ["the cat sat on the mat", "a dog ran far away", "blue sky above us"] * 20
    tok = train_tokenizer(corpus, "bpe", 300)
    texts = ["the cat sat on the mat", "a dog ran far zqxvw", "blue sky above zqxvw", "the cat sat on the zqxvw"]
    path = tmp_path / "lambada.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    ids = {t: tok.encode_batch([t[:t.rfind(" ")], t[t.rfind(" "):]]) for t in texts}
    assert len(ids[texts[0]][1]) == 1 and len(ids[texts[1]][1]) > 2  # one subword / several subwords
    knows = set()
    ctx, tgt = ids[texts[0]]  # single subword, right
    knows.add((ctx[-1], tgt[0]))
    ctx, tgt = ids[texts[1]]  # several subwords, all right
    seq = ctx + tgt
    knows |= {(seq[i - 1], seq[i]) for i in range(len(ctx), len(seq))}
    ctx, tgt = ids[texts[2]]  # several subwords, only the last right: partly right
    knows.add((tgt[-2], tgt[-1]))
    result = lambada(OracleScorer(knows), tok, str(path))
    # texts[3] ends with the same word as texts[1] but after "the": its first subword is not known.
    assert result["examples"] == 4
    assert result["accuracy"] == 2 / 4  # texts 0 and 1
    assert result["last_subword_accuracy"] == 4 / 4  # texts 2 and 3 get their last subword right
    bad = tmp_path / "bad.jsonl"
    bad.write_text("just text\n")
    with pytest.raises(ValueError, match="'text' field"):
        lambada(OracleScorer(set()), tok, str(bad))


@pytest.mark.parametrize("mesh", [(1, 1), (1, 4)])
def test_generation_with_cache_equals_without(tiny_model, mesh):
    model, config = tiny_model
    prompt = np.random.default_rng(3).integers(0, 1000, (2, 5)).astype(np.int32)
    from conftest import place
    m, graphdef, state = place(model, config, *mesh)
    sharded = nnx.merge(graphdef, state)
    greedy = Sampling(greedy=True)
    cached = generate(sharded, m, rules_of(config), prompt, 10, greedy)
    plain = generate(sharded, m, rules_of(config), prompt, 10, greedy, use_cache=False)
    np.testing.assert_array_equal(cached, plain)
    ref = generate(model, make_mesh(1, 1), rules_of(config), prompt, 10, greedy)
    np.testing.assert_array_equal(cached, ref)
    sampled = generate(sharded, m, rules_of(config), prompt, 10, Sampling(temperature=0.8, top_k=50, top_p=0.9),
                       seed=4)
    assert (sampled[:, :5] == prompt).all() and (sampled < 1000).all()


@pytest.fixture(scope="module")
def eval_checkpoint(tmp_path_factory, tiny_model):
    model, config = tiny_model
    root = tmp_path_factory.mktemp("evalck")
    text = " = Title = \n " + " ".join(f"w{i % 37} , x{i % 11} ." for i in range(60)) + " \n"
    tok = train_tokenizer([text], "bpe", 300)
    tok.save(root / "tok.json")
    (root / "wiki.tokens").write_text(text)
    (root / "lambada.jsonl").write_text("".join(json.dumps({"text": f"w{i} , x{i} . w{i}"}) + "\n" for i in range(6)))
    save_params(root / "ck", jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model))), config)
    return root


def test_results_equal_across_meshes(eval_checkpoint):
    root = eval_checkpoint
    results = {}
    for mesh in [(1, 1), (1, 4), (2, 4)]:
        common = dict(tokenizer=str(root / "tok.json"), mesh_data=mesh[0], mesh_model=mesh[1], batch_size=4)
        wiki = run(str(root / "ck"), "wikitext103", data=str(root / "wiki.tokens"), stride=4, **common)
        lam = run(str(root / "ck"), "lambada", data=str(root / "lambada.jsonl"), **common)
        results[mesh] = (wiki, lam)
        assert wiki["mesh"] == f"{mesh[0]}x{mesh[1]}"
    (w1, l1) = results[(1, 1)]
    assert w1["original_tokens"] == original_token_count((root / "wiki.tokens").read_text())
    assert w1["scored_targets"] == w1["subword_tokens"] - 1
    assert w1["adjusted_ppl"] > w1["ppl"]  # fewer original tokens than subwords
    for mesh, (w, lam) in results.items():
        np.testing.assert_allclose(w["loss"], w1["loss"], rtol=1e-5)
        assert lam["accuracy"] == l1["accuracy"] and lam["last_subword_accuracy"] == l1["last_subword_accuracy"]


def test_eval_cli_writes_json(eval_checkpoint, tmp_path):
    import subprocess
    import sys
    import pathlib
    root = eval_checkpoint
    repo = pathlib.Path(__file__).resolve().parent.parent
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(repo / "eval.py"), f"--checkpoint={root / 'ck'}", "--task=lambada",
                           f"--data={root / 'lambada.jsonl'}", f"--tokenizer={root / 'tok.json'}",
                           "--config.mesh.model=2", f"--output={out}"], capture_output=True, text=True,
                          env={**__import__("os").environ, "PYTHONPATH": str(repo)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(out.read_text())["mesh"].endswith("x2")
