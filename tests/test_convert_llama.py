"""Llama conversion: Hugging Face LlamaForCausalLM (multi-head and grouped-query attention, tied and untied output
layers, Llama 3's rotary scaling) converts to megajax and back exactly, gives transformers' logits and greedy tokens
on 1x1, 1x4 and 2x4 meshes, and refuses the variants megajax's Llama does not compute before writing anything."""

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_greedy_matches_hf, hf_conversions
from flax import nnx

import megajax
from megajax.checkpoint import CheckpointError
from megajax.config import model_config
from megajax.config.load import inference_config, read_run_config
from megajax.convert import hf_io, hf_llama
from megajax.convert.__main__ import main as convert_main
from megajax.models.llama import kv_copies
from megajax.parallel.sharding import ParallelContext, activate

torch = pytest.importorskip("torch")  # the `test` extra installs it (CPU build)
transformers = pytest.importorskip("transformers")

LOGIT_ATOL = 1e-4  # fp32, XLA vs PyTorch kernels
SEQ = 40  # longer than the llama3 model's original_max_position_embeddings (16)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16}
# Two tiny models (2 layers, hidden 64). mha: 4 heads = 4 key/value heads, tied embedding, plain rotary, vocab 256
# kept unpadded (the converter's default). gqa: 8 heads sharing 2 key/value heads (so mesh.model=4 replicates
# them), untied lm_head, Llama 3.1's frequency scaling, vocab 250 padded to 256, an MLP width not a multiple of h.
MODELS = {
    "mha": dict(vocab_size=256, num_attention_heads=4, num_key_value_heads=4, intermediate_size=128,
                tie_word_embeddings=True),
    "gqa": dict(vocab_size=250, num_attention_heads=8, num_key_value_heads=2, intermediate_size=96,
                tie_word_embeddings=False, rope_theta=500000.0, rope_scaling=LLAMA3),
}
PAD_FLAGS = {"mha": [], "gqa": ["--make_vocab_size_divisible_by=128"]}


def hf_model(name: str):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, max_position_embeddings=64,
                                   rms_norm_eps=1e-5, initializer_range=0.1, **MODELS[name])
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # RMSNorm scales off 1, so swapping two of them would show
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.2)
    return model


def megajax_logits(loaded: megajax.LoadedModel, tokens: np.ndarray) -> tuple[np.ndarray, int]:
    """(logits, key/value heads each step computes) of a loaded model, traced under its mesh and rules as
    training and evaluation trace it (outside ``activate`` no layout decision, the replicated heads included, runs)."""
    graphdef, state = nnx.split(loaded.model)
    with activate(loaded.mesh, ParallelContext(loaded.spec.rules)):
        logits = jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, jnp.asarray(tokens))
        return np.asarray(logits), kv_copies(loaded.spec.model)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """name -> (HF directory saved in 100 KB shards, the HF model, its megajax conversion), each built once."""
    return hf_conversions(tmp_path_factory, hf_model, lambda name: PAD_FLAGS[name])


@pytest.mark.parametrize("name", sorted(MODELS))
def test_hf_round_trip_is_exact(name, converted, tmp_path):
    src, _, mj = converted(name)
    convert_main(["megajax-to-hf", f"--checkpoint={mj}", f"--output={tmp_path / 'back'}"])
    original, back = hf_io.read_weights(src), hf_io.read_weights(tmp_path / "back")
    assert ("lm_head.weight" in original) == (name == "gqa")  # save_pretrained leaves out a tied head
    assert set(back) == set(original)
    for k, v in original.items():
        assert back[k].dtype == v.dtype, k
        np.testing.assert_array_equal(back[k], v, err_msg=k)
    want = transformers.LlamaConfig.from_pretrained(src).to_dict()
    got = transformers.LlamaConfig.from_pretrained(tmp_path / "back").to_dict()
    assert {k: v for k, v in got.items() if k != "transformers_version"} == \
           {k: v for k, v in want.items() if k != "transformers_version"}
    loaded, info = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert loaded.config.tie_word_embeddings == (name == "mha")


@pytest.mark.parametrize("name", sorted(MODELS))
def test_converted_config(name, converted):
    _, _, mj = converted(name)
    m = model_config(inference_config(mj, data=1, model=1))
    assert (m.num_heads, m.kv_heads, m.head_dim, m.ffn_size) == ((4, 4, 16, 128) if name == "mha" else (8, 2, 8, 96))
    assert m.tie_embeddings == (name == "mha") and m.layernorm_eps == 1e-5 and m.dropout == 0.0
    assert m.padded_vocab_size == 256 and m.vocab_size == (256 if name == "mha" else 250)
    if name == "gqa":
        assert (m.rope_scaling, m.rope_theta, m.rope_factor, m.rope_original_max_len) == ("llama3", 5e5, 8.0, 16)
    else:
        assert (m.rope_scaling, m.rope_theta) == ("none", 10000.0)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_converted_logits_match_transformers(name, converted):
    _, model, mj = converted(name)
    vocab = model.config.vocab_size
    if name == "gqa":  # the scaling changes the frequencies (all four of a head of 8 at original length 16)
        plain = 1.0 / 5e5 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8)
        assert not torch.isclose(model.model.rotary_emb.inv_freq, plain).any()
    tokens = np.random.default_rng(0).integers(0, vocab, (2, SEQ))
    with torch.no_grad():
        want = model(torch.from_numpy(tokens)).logits.numpy()
    assert np.abs(want).max() > 1.0  # logits far from 0, so the tolerance below is a tight one
    diffs = {}
    for data, model_axis in [(1, 1), (1, 4), (2, 4)]:
        loaded = megajax.load_model(mj, data=data, model=model_axis)
        got, copies = megajax_logits(loaded, tokens)
        assert copies == (4 if name == "gqa" and model_axis == 4 else model.config.num_key_value_heads)
        diffs[f"{data}x{model_axis}"] = float(np.abs(got[..., :vocab] - want).max())
        assert (got[..., vocab:] == np.finfo(np.float32).min).all()  # padded rows never predicted
    print(f"\n{name} logits max |megajax - transformers|: {diffs}")
    assert max(diffs.values()) < LOGIT_ATOL, diffs


def test_greedy_generation_matches_transformers(converted):
    """On the gqa model: replicated key/value heads at 1x4, the rope scaling past position 16, the cache."""
    _, model, mj = converted("gqa")
    prompt = np.random.default_rng(1).integers(0, model.config.vocab_size, (2, 12))
    assert_greedy_matches_hf(model, mj, prompt, [dict(data=1, model=1), dict(data=1, model=4)])


def test_bf16_checkpoint_converts(tmp_path):
    """Most Llama checkpoints are bfloat16, which safetensors' numpy loader cannot represent."""
    model = hf_model("gqa").to(torch.bfloat16)
    model.save_pretrained(tmp_path / "hf")
    convert_main(["hf-to-megajax", f"--hf={tmp_path / 'hf'}", f"--output={tmp_path / 'mj'}",
                  "--make_vocab_size_divisible_by=128"])
    convert_main(["megajax-to-hf", f"--checkpoint={tmp_path / 'mj'}", f"--output={tmp_path / 'back'}"])
    back = hf_io.read_weights(tmp_path / "back")
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(back[k], v.float().numpy(), err_msg=k)  # widened exactly


def hf_dict(**change) -> dict:
    hf = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2}
    return {**hf, **change}


@pytest.mark.parametrize("change,match", [
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"head_dim": 16}, "head_dim"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type='yarn'.*llama3"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_type='linear'"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "rope_type='dynamic'"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "low_freq_factor"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({"model_type": "mistral"}, "model_type"),
    ({"intermediate_size": None}, "intermediate_size"),
])
def test_unsupported_configs_are_refused(change, match):
    hf = {k: v for k, v in hf_dict(**change).items() if v is not None}
    with pytest.raises(ValueError, match=match):
        hf_llama.config_from_hf(hf)


def test_both_rope_spellings_read_the_same():
    """transformers v4's top-level rope_theta + rope_scaling ("type" or "rope_type") and v5's rope_parameters."""
    v4 = hf_llama.config_from_hf(hf_dict(rope_theta=5e5, rope_scaling={**LLAMA3, "type": "llama3"}))
    v5 = hf_llama.config_from_hf(hf_dict(rope_parameters={**LLAMA3, "rope_theta": 5e5}))
    assert v4.model.to_dict() == v5.model.to_dict()
    assert (v4.model.rope_scaling, v4.model.rope_theta, v4.model.rope_original_max_len) == ("llama3", 5e5, 16)
    default = hf_llama.config_from_hf(hf_dict(rope_scaling=None)).model
    assert (default.rope_scaling, default.rope_theta, default.make_vocab_size_divisible_by) == ("none", 1e4, 1)
    assert default.tie_embeddings is False and default.max_seq_len == 2048  # LlamaConfig's defaults


def test_cli_refuses_before_writing(converted, tmp_path):
    src, _, _ = converted("mha")
    shutil.copytree(src, tmp_path / "hf")
    config = json.loads((src / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "attention_bias": True}))
    with pytest.raises(ValueError, match="attention_bias=True: megajax's Llama has no biases"):
        convert_main(["hf-to-megajax", f"--hf={tmp_path / 'hf'}", f"--output={tmp_path / 'out'}"])
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # no staging directory left beside it either


def test_weights_that_do_not_fit_are_refused(converted):
    src, _, _ = converted("gqa")  # untied: its lm_head can be missing
    hf, sd = hf_io.read_config(src), hf_io.read_weights(src)
    model = model_config(hf_llama.config_from_hf(hf))
    with pytest.raises(KeyError, match="lm_head.weight"):
        hf_llama.params_from_hf({k: v for k, v in sd.items() if k != "lm_head.weight"}, model)
    with pytest.raises(ValueError, match="no place for.*q_proj.bias"):
        hf_llama.params_from_hf({**sd, "model.layers.0.self_attn.q_proj.bias": np.zeros(64, np.float32)}, model)
    with pytest.raises(ValueError, match="no place for.*layers.2"):
        hf_llama.params_from_hf({**sd, "model.layers.2.input_layernorm.weight": np.ones(64, np.float32)}, model)
    with pytest.raises(ValueError, match="k_proj.weight is \\(16, 64\\).*implies \\(32, 64\\)"):
        hf_llama.params_from_hf(sd, model_config(hf_llama.config_from_hf({**hf, "num_key_value_heads": 4})))
    buffers = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": np.ones(4, np.float32) for i in range(2)}
    hf_llama.params_from_hf({**sd, **buffers}, model)  # older transformers saved these; they are recomputed


# Llama 3's pre-tokenizer regex (tiktoken's cl100k split: numbers in groups of at most 3 digits).
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                r"\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                   "<|eot_id|>"]
TEXTS = ["Hello, world! It's 2024: 1234567 tokens.", "  leading spaces\n\nand\ttabs   ",
         "ünïcödé — 日本語のテキスト 🙂", "<|end_of_text|>"]


@pytest.fixture(scope="module")
def llama3_tokenizer_json(tmp_path_factory):
    """A tokenizer.json laid out as Llama 3's: byte-level BPE behind the regex split, the special tokens after the
    merges, <|begin_of_text|> prepended by the post-processor. Trained here on a few sentences (no download)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    corpus = ["The quick brown fox jumps over the lazy dog.", "Llama models read tokens; megajax trains them.",
              *TEXTS[:3]] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens(LLAMA3_SPECIALS)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
                                      special_tokens=[("<|begin_of_text|>", bos)])])
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def test_llama3_tokenizer_json_round_trips(llama3_tokenizer_json):
    """megajax's TextTokenizer (encode_batch without the BOS template, decode keeping specials) on Llama 3's
    layout: every text comes back exactly, digits split in threes, the end-of-text token is one id."""
    from tokenizers import Tokenizer

    from megajax.data.tokenizer import TextTokenizer

    raw = Tokenizer.from_file(str(llama3_tokenizer_json))
    eod = raw.token_to_id("<|end_of_text|>")
    tok = TextTokenizer(raw, eod, str(llama3_tokenizer_json))
    ids = tok.encode_batch(TEXTS)
    assert [tok.decode(i) for i in ids] == TEXTS
    assert ids[3] == [eod] and raw.token_to_id("<|begin_of_text|>") not in ids[0]
    pieces = raw.encode("1234567", add_special_tokens=False).tokens
    assert "".join(pieces) == "1234567" and max(map(len, pieces)) <= 3
    specials = [raw.token_to_id(t) for t in LLAMA3_SPECIALS]  # after the BPE's ids, as Llama 3's 128000..
    assert specials == list(range(tok.vocab_size - len(specials), tok.vocab_size))


def test_load_tokenizer_reads_llama3_tokenizer_json(llama3_tokenizer_json):
    from megajax.data.tokenizer import load_tokenizer

    tok = load_tokenizer(llama3_tokenizer_json)
    assert tok.eod_id == tok.tokenizer.token_to_id("<|end_of_text|>")
    assert [tok.decode(i) for i in tok.encode_batch(TEXTS)] == TEXTS


def test_llama_has_no_megatron_writer(converted, tmp_path):
    _, _, mj = converted("mha")
    with pytest.raises(ValueError, match="megajax-to-megatron writes GPT and BERT only"):
        convert_main(["megajax-to-megatron", f"--checkpoint={mj}", f"--output={tmp_path / 'mt'}", "--tp=1"])
    assert not (tmp_path / "mt").exists()


def test_training_continues_from_a_converted_checkpoint(converted, tmp_path):
    """``init_from`` reads every parameter of a converted checkpoint: two steps at learning rate 0 on 2x4 (the 2
    key/value heads replicated) leave the weights bit-equal to the conversion; a config of another shape is refused
    before compiling, naming the flag that fixes it."""
    _, _, mj = converted("gqa")
    config = read_run_config(mj)
    config.init_from = str(mj)
    config.data.source = "random"
    config.mesh.update(data=2, model=4)
    config.train.update(steps=2, global_batch_size=8, log_every=1, eval_batches=0, precision="fp32")
    config.optimizer.update(lr=0.0, min_lr=0.0, warmup_steps=0)
    records = megajax.train(config, tmp_path / "run")
    assert np.isfinite([r["loss"] for r in records if "loss" in r]).all()
    trained, start = (nnx.to_pure_dict(nnx.state(megajax.load_model(p, data=1, model=1).model))
                      for p in (tmp_path / "run", mj))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(trained), jax.tree.leaves(start)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
    config.model.make_vocab_size_divisible_by = 64  # 250 -> 256 rows as well: the same embedding
    config.train.steps = 3
    megajax.train(config, tmp_path / "other")
    config.model.make_vocab_size_divisible_by = 100
    with pytest.raises(CheckpointError, match=r"has 256 embedding rows .* this config 300; set "
                                              r"--config.model.make_vocab_size_divisible_by=128"):
        megajax.train(config, tmp_path / "third")
    config.model.update(make_vocab_size_divisible_by=128, ffn_hidden_size=128)
    with pytest.raises(CheckpointError, match=r"model.ffn_hidden_size: 96 saved, 128 here.*"
                                              r"set --config.model.ffn_hidden_size=96"):
        megajax.train(config, tmp_path / "fourth")


def _torch_nll(model, ids, last: int | None = None) -> float:
    """transformers' summed next-token NLL of the last ``last`` targets of the row ``ids`` (default all), float64."""
    ids = np.asarray(ids, np.int64)
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.from_numpy(ids[:-1])[None]).logits[0].double(), -1).numpy()
    nll = -logp[np.arange(len(ids) - 1), ids[1:]]
    return float(nll[-(last or len(nll)):].sum())


def test_eval_and_lm_eval_score_a_converted_llama_as_transformers(converted, tmp_path):
    """eval.py's ppl task on 2x4 (replicated key/value heads) scores three non-overlapping windows of max_seq_len as
    transformers does; the lm-eval adapter's loglikelihood_rolling on 1x4 follows lm-eval's windows over a document
    three windows long and sums what transformers gives for them (both within 1e-5 relative)."""
    from lm_eval.api.instance import Instance
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    from megajax.data.indexed import IndexedWriter
    from megajax.data.tokenizer import train_tokenizer
    from megajax.evaluation.lm_eval_adapter import MegajaxLM
    from megajax.evaluation.runner import run

    _, model, mj = converted("gqa")
    seq = read_run_config(mj).model.max_seq_len
    ids = np.random.default_rng(1).integers(0, 250, size=3 * seq + 1)
    writer = IndexedWriter(tmp_path / "data", np.uint16)
    writer.add(ids)
    writer.commit({"vocab_size": 250})
    result = run(str(mj), "ppl", data=str(tmp_path / "data"), mesh_data=2, mesh_model=4, batch_size=2)
    want = sum(_torch_nll(model, ids[k * seq: (k + 1) * seq + 1]) for k in range(3)) / (3 * seq)
    assert result["scored_targets"] == 3 * seq and result["mesh"] == "2x4"
    np.testing.assert_allclose(result["loss"], want, rtol=1e-5)

    words = [f"w{i}" for i in range(60)]
    tok = train_tokenizer([" ".join(words)] * 4, "wordpiece", 120)  # [SEP] ends documents
    tok.save(tmp_path / "tok.json")
    lm = MegajaxLM(pretrained=str(mj), tokenizer=str(tmp_path / "tok.json"), mesh="1x4", batch_size=2)
    document = " ".join(words[i % 60] for i in range(7 * 23))
    tokens = tok.encode_batch([document])[0]
    windows = [make_disjoint_window(w) for w in get_rolling_token_windows(tokens, tok.eod_id, seq, 1)]
    assert len(windows) == 3
    reference = -sum(_torch_nll(model, (ctx + cont)[-(seq + 1):], len(cont)) for ctx, cont in windows)
    got = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (document,), 0)])[0]
    np.testing.assert_allclose(got, reference, rtol=1e-5)
