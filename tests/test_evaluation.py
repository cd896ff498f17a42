"""Evaluation: the sliding windows against Megatron-LM's overlapping evaluation, sliding-window perplexity vs a
naive reference, the detokenizer, LAMBADA scoring, generation (cache, temperature 0), the stride used, and equal
results on every mesh. Input checks: test_eval_inputs.py."""

import functools
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import small_config
from flax import nnx

from megajax.checkpoint import save_params
from megajax.config import model_config, rules_of
from megajax.data.indexed import IndexedTokens, IndexedWriter
from megajax.data.tokenizer import load_tokenizer, train_tokenizer
from megajax.evaluation.detokenize import original_token_count, wikitext_detokenize
from megajax.evaluation.evaluator import Evaluator
from megajax.evaluation.generate import Sampling, generate, sample_logits
from megajax.evaluation.inputs import InputError, read_lambada
from megajax.evaluation.runner import run
from megajax.evaluation.scoring import Scorer, sliding_windows, stream_log_likelihood
from megajax.evaluation.tasks import lambada
from megajax.models.gpt import GPT
from megajax.parallel.losses import mask_padded_vocab
from megajax.parallel.mesh import MeshShape


def megatron_context_starts(num_tokens: int, seq_len: int, stride: int) -> dict[int, int]:
    """{target: first token of its context} as Megatron-LM's overlapping evaluation assigns them, simulated
    literally: max(ceil(max(T-1-k, 0)/k) + 1, 1) windows; window i holds tokens [i*k, i*k+L] (shorter at the end,
    padding masked); window 0 scores every target, later windows only their last k positions."""
    k = stride
    windows = max(math.ceil(max(num_tokens - 1 - k, 0) / k) + 1, 1)
    starts = {}
    for i in range(windows):
        real = len(range(i * k, min(i * k + seq_len + 1, num_tokens)))
        mask = ([1] * real + [0] * (seq_len + 1 - real))[1:]  # one flag per input position
        if k != seq_len and i != 0:
            mask[:-k] = [0] * (seq_len - k)
        for pos in range(seq_len):
            if mask[pos]:
                assert i * k + pos + 1 not in starts
                starts[i * k + pos + 1] = i * k
    return starts


def windows_context_starts(windows) -> dict[int, int]:
    starts = {}
    for start, first, end in windows:
        for t in range(first, end + 1):
            assert t not in starts, (t, windows)
            starts[t] = start
    return starts


@pytest.mark.parametrize("seq_len", [1, 5, 16, 32])
def test_windows_match_megatron_for_every_length_and_stride(seq_len):
    for stride in range(1, seq_len + 1):
        for n in range(3 * seq_len + 3):
            windows = sliding_windows(n, seq_len, stride)
            want = megatron_context_starts(n, seq_len, stride)
            assert sorted(want) == list(range(1, n))  # the reference itself scores every target once
            assert windows_context_starts(windows) == want, (n, stride, windows)
            for start, first, end in windows:
                assert start % stride == 0 and 0 < end - start <= seq_len and first <= end


@pytest.mark.parametrize("stride", [0, -1, 17])
def test_stride_outside_one_to_seq_len_is_an_error(stride):
    with pytest.raises(ValueError, match=r"stride must be in 1\.\.16"):
        sliding_windows(40, 16, stride)


@pytest.fixture(scope="module")
def tiny_model():
    config = small_config()
    config.model.max_seq_len = 16
    model = GPT(model_config(config), rngs=nnx.Rngs(1))
    return model, config


@pytest.fixture(scope="module")
def naive_nll(tiny_model):
    """-log p(tokens[target] | tokens[start:target]), one direct model call per (start, target), cached: the
    context is written at the start of a seq_len buffer (what follows cannot affect a causal model) and the logits
    read at its end."""
    model, config = tiny_model
    seq_len = config.model.max_seq_len
    graphdef, state = nnx.split(model)

    @jax.jit
    def nll(state, buffer, length, target_token):
        logits = nnx.merge(graphdef, state)(buffer[None])[0]
        logp = jax.nn.log_softmax(jax.lax.dynamic_index_in_dim(logits, length - 1, keepdims=False))
        return -logp[target_token]

    @functools.cache
    def score(tokens: tuple, target: int, start: int) -> float:
        assert 0 < target - start <= seq_len
        buffer = np.zeros(seq_len, np.int32)
        buffer[:target - start] = tokens[start:target]
        return float(nll(state, jnp.asarray(buffer), target - start, tokens[target]))
    return score


@pytest.fixture(scope="module")
def one_device_scorer(tiny_model):
    model, config = tiny_model
    return Scorer(model, MeshShape(1, 1).make(), rules_of(config), batch_size=8, seq_len=config.model.max_seq_len)


@pytest.mark.parametrize("stride", [1, 7, 16])
def test_sliding_window_nll_equals_naive_reference(one_device_scorer, naive_nll, stride):
    """Every length T = 0..3L+2 (prefixes of one random stream): the summed NLL equals the naive one, where target
    t's context starts at 0 for t <= L, else at the multiple of the stride ceil((t - L) / stride) * stride."""
    seq_len = one_device_scorer.seq_len
    tokens = tuple(int(t) for t in np.random.default_rng(2).integers(0, 1000, 3 * seq_len + 2))
    start_of = lambda t: 0 if t <= seq_len else -(-(t - seq_len) // stride) * stride  # noqa: E731
    for n in range(len(tokens) + 1):
        total, count = stream_log_likelihood(one_device_scorer, np.asarray(tokens[:n], np.int32), stride)
        assert count == max(n - 1, 0)
        naive = math.fsum(naive_nll(tokens, t, start_of(t)) for t in range(1, n))
        np.testing.assert_allclose(total, naive, rtol=1e-6, atol=0, err_msg=f"T={n}")


def test_evaluator_maps_every_row_once_in_order_and_drops_padding():
    """10 rows at batch_size=3 on a data=2 mesh: batches of 4 (a multiple of the data axis), the last padded."""
    model = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    x = np.random.default_rng(0).normal(size=(10, 3)).astype(np.float32)
    rows = {"x": x, "i": np.arange(10, dtype=np.int32)}
    seen = []

    def fn(m, batch):
        seen.append(batch["x"].shape)  # traced once: the batch shape
        return m(batch["x"]), batch["i"] * 2

    evaluator, state = Evaluator.of(model, fn, MeshShape(2, 1).make(), rules_of(small_config()))
    y, twice = evaluator.map_rows(state, rows, batch_size=3)
    assert seen == [(4, 3)] and y.shape == (10, 2) and twice.shape == (10,)
    np.testing.assert_array_equal(twice, 2 * np.arange(10))
    want = x.astype(np.float64) @ np.asarray(model.kernel[...], np.float64) + np.asarray(model.bias[...])
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)



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
    result = lambada(OracleScorer(knows), read_lambada(path, tok, OracleScorer.seq_len))
    # texts[3] ends with the same word as texts[1] but after "the": its first subword is not known.
    assert result["examples"] == 4
    assert result["accuracy"] == 2 / 4  # texts 0 and 1
    assert result["last_subword_accuracy"] == 4 / 4  # texts 2 and 3 get their last subword right


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
    ref = generate(model, MeshShape(1, 1).make(), rules_of(config), prompt, 10, Sampling(temperature=0.0))  # greedy too
    np.testing.assert_array_equal(cached, ref)
    sampled = generate(sharded, m, rules_of(config), prompt, 10, Sampling(temperature=0.8, top_k=50, top_p=0.9),
                       seed=4)
    assert (sampled[:, :5] == prompt).all() and (sampled < 1000).all()


def test_generation_pads_a_batch_the_data_shards_do_not_divide(tiny_model):
    """One prompt on 8 data shards: the rows are padded with copies of the last and cut back, so the step sees a
    batch it can split (it used to fail in the embedding's shard_map); greedy, the same tokens as on one device."""
    model, config = tiny_model
    prompt = np.random.default_rng(5).integers(0, 1000, (1, 5)).astype(np.int32)
    from conftest import place
    m, graphdef, state = place(model, config, 8, 1)
    seen = []
    got = generate(nnx.merge(graphdef, state), m, rules_of(config), prompt, 6, Sampling(greedy=True),
                   on_token=seen.append)
    want = generate(model, MeshShape(1, 1).make(), rules_of(config), prompt, 6, Sampling(greedy=True))
    np.testing.assert_array_equal(got, want)
    assert got.shape == (1, 11) and all(column.shape == (1,) for column in seen)


def test_temperature_zero_is_greedy():
    logits = jax.random.normal(jax.random.key(0), (4, 1024)) * 3
    logits = mask_padded_vocab(logits, 1000)  # padded ids, as the model returns them
    want = np.argmax(np.asarray(logits), axis=-1)
    for sampling in [Sampling(temperature=0.0), Sampling(temperature=0.0, top_k=5, top_p=0.5)]:
        for seed in range(3):
            np.testing.assert_array_equal(sample_logits(logits, jax.random.key(seed), sampling), want)
    # a sample at temperature 1 differs from the argmax somewhere (the logits are far from one-hot)
    assert any((np.asarray(sample_logits(logits, jax.random.key(s), Sampling())) != want).any() for s in range(3))


@pytest.fixture(scope="module")
def eval_checkpoint(tmp_path_factory, tiny_model):
    model, config = tiny_model
    root = tmp_path_factory.mktemp("evalck")
    text = " = Title = \n " + " ".join(f"w{i % 37} , x{i % 11} ." for i in range(60)) + " \n"
    tok = train_tokenizer([text], "bpe", 300)
    tok.save(root / "tok.json")
    (root / "wiki.tokens").write_text(text)
    (root / "lambada.jsonl").write_text("".join(json.dumps({"text": f"w{i} , x{i} . w{i}"}) + "\n" for i in range(6)))
    writer = IndexedWriter(root / "ppl", np.uint16)
    writer.add(np.random.default_rng(5).integers(0, 1000, 60))
    writer.commit({"tokenizer": str(root / "tok.json"), "vocab_size": 1000})
    save_params(root / "ck", jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model))), config.to_json())
    return root


def test_results_equal_across_meshes(eval_checkpoint, one_device_scorer):
    root = eval_checkpoint
    results = {}
    for mesh in [(1, 1), (1, 4), (2, 4)]:
        common = dict(tokenizer=str(root / "tok.json"), mesh_data=mesh[0], mesh_model=mesh[1], batch_size=4)
        wiki = run(str(root / "ck"), "wikitext103", data=str(root / "wiki.tokens"), stride=4, **common)
        lam = run(str(root / "ck"), "lambada", data=str(root / "lambada.jsonl"), **common)
        results[mesh] = (wiki, lam)
        assert wiki["mesh"] == f"{mesh[0]}x{mesh[1]}"
    (w1, l1) = results[(1, 1)]
    assert w1["stride"] == 4
    text = wikitext_detokenize((root / "wiki.tokens").read_text())
    tokens = np.asarray(load_tokenizer(root / "tok.json").encode_batch([text])[0])
    total, count = stream_log_likelihood(one_device_scorer, tokens, 4)
    np.testing.assert_allclose(w1["loss"], total / count, rtol=1e-6)
    assert w1["original_tokens"] == original_token_count((root / "wiki.tokens").read_text())
    assert w1["scored_targets"] == w1["subword_tokens"] - 1
    assert w1["adjusted_ppl"] > w1["ppl"]  # fewer original tokens than subwords
    for mesh, (w, lam) in results.items():
        np.testing.assert_allclose(w["loss"], w1["loss"], rtol=1e-5)
        assert lam["accuracy"] == l1["accuracy"] and lam["last_subword_accuracy"] == l1["last_subword_accuracy"]


def test_ppl_uses_and_reports_the_stride_given(eval_checkpoint, one_device_scorer):
    """The stride given (also one equal to a default) is the one scored with and reported; no stride on ppl means
    non-overlapping windows. Each result equals the sliding-window NLL computed directly with that stride."""
    root = eval_checkpoint
    tokens = np.asarray(IndexedTokens.open(root / "ppl").tokens)
    for stride, used in [(7, 7), (None, 16)]:
        result = run(str(root / "ck"), "ppl", data=str(root / "ppl"), stride=stride, mesh_data=1, mesh_model=1)
        total, count = stream_log_likelihood(one_device_scorer, tokens, used)
        assert result["stride"] == used and result["seq_len"] == 16 and result["scored_targets"] == count == 59
        np.testing.assert_allclose(result["loss"], total / count, rtol=1e-6)


def test_eval_cli_writes_json(eval_checkpoint, tmp_path):
    import pathlib
    import subprocess
    import sys
    root = eval_checkpoint
    repo = pathlib.Path(__file__).resolve().parent.parent
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, str(repo / "eval.py"), f"--checkpoint={root / 'ck'}", "--task=lambada",
                           f"--data={root / 'lambada.jsonl'}", f"--tokenizer={root / 'tok.json'}",
                           "--config.mesh.model=2", f"--output={out}"], capture_output=True, text=True,
                          env={**__import__("os").environ, "PYTHONPATH": str(repo)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(out.read_text())["mesh"].endswith("x2")


def test_a_checkpoint_of_a_wider_split_evaluates_on_the_devices_there_are(eval_checkpoint, tiny_model):
    """Saved by a run with mesh.model=8, read where a replica has fewer devices: the split falls to the largest
    divisor of 8 those devices hold, with the same results; a --mesh the devices cannot hold names the flag."""
    root = eval_checkpoint
    model, config = tiny_model
    wide = config.copy_and_resolve_references()
    wide.mesh.model = 8
    save_params(root / "ck_1x8", jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model))), wide.to_json())
    common = dict(data=str(root / "wiki.tokens"), tokenizer=str(root / "tok.json"), stride=4, batch_size=8)
    reference = run(str(root / "ck"), "wikitext103", mesh_data=1, mesh_model=1, **common)
    for mesh_data, mesh in [(None, "1x8"), (2, "2x4"), (8, "8x1")]:
        result = run(str(root / "ck_1x8"), "wikitext103", mesh_data=mesh_data, **common)
        assert result["mesh"] == mesh
        np.testing.assert_allclose(result["loss"], reference["loss"], rtol=1e-5)
    with pytest.raises(InputError, match=r"mesh 4x4 needs 16 devices but 8 are present; .*pass --mesh=DATAxMODEL "
                                         r"with DATA x MODEL = 8 \(the devices here\)"):
        run(str(root / "ck_1x8"), "wikitext103", mesh_data=4, mesh_model=4, **common)
