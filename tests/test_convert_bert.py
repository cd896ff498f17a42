"""BERT conversion: Hugging Face BertForPreTraining (post-LN) and MegatronBertForPreTraining (pre-LN) give the
logits transformers computes and round-trip exactly; Megatron-LM BERT checkpoints round-trip exactly at TP 1/2/4,
with the vocab-parallel tensors split on the vocabulary and the heads nested where Megatron keeps them."""

import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from megajax.checkpoint import load_model, save_params
from megajax.config import base_config, build_mesh, model_config, rules_of
from megajax.convert import hf_bert, hf_io, megatron_bert
from megajax.convert.__main__ import main as convert_main
from megajax.parallel.sharding import ParallelContext, activate

torch = pytest.importorskip("torch")  # the `test` extra installs it (CPU build)
transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH = 1000, 32, 4
HF_MODELS = {"bert": ("BertConfig", "BertForPreTraining"),
             "megatron-bert": ("MegatronBertConfig", "MegatronBertForPreTraining")}
LOGIT_ATOL = 1e-4  # fp32, XLA vs PyTorch kernels


@pytest.fixture(scope="module", params=sorted(HF_MODELS))
def hf_dir(request, tmp_path_factory):
    """A small random HF BERT (2 layers, hidden 64, 4 heads, vocab 1000) saved locally, and the model."""
    config_cls, model_cls = (getattr(transformers, n) for n in HF_MODELS[request.param])
    torch.manual_seed(0)
    cfg = config_cls(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=256, max_position_embeddings=SEQ, type_vocab_size=2,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = model_cls(cfg).eval()
    with torch.no_grad():  # every tensor non-trivial: biases and LayerNorms move off 0/1, weights grow
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    out = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(out)
    return out, model


@pytest.fixture(scope="module")
def batch():
    """Sentence pairs (types 0 then 1) padded at the end to lengths 32, 27, 19 and 8."""
    rng = np.random.default_rng(0)
    pos = np.arange(SEQ)[None]
    lengths = np.array([[32], [27], [19], [8]])
    valid = (pos < lengths).astype(np.int64)
    types = (pos >= lengths // 2) * valid
    return rng.integers(0, VOCAB, (BATCH, SEQ)) * valid, types, valid


def megajax_logits(path, data: int, model_axis: int, batch):
    """MLM and SOP logits of the checkpoint at ``path`` loaded onto a data x model mesh."""
    model, config = load_model(path, data=data, model=model_axis)
    graphdef, state = nnx.split(model)
    with activate(build_mesh(config), ParallelContext(rules_of(config))):
        mlm, sop = jax.jit(lambda s, *b: nnx.merge(graphdef, s)(*b))(state, *batch)
    return np.asarray(mlm), np.asarray(sop), config


def test_converted_logits_match_transformers(hf_dir, batch, tmp_path):
    src, model = hf_dir
    convert_main(["hf-to-megajax", f"--hf={src}", f"--output={tmp_path / 'mj'}", "--make_vocab_size_divisible_by=128"])
    tokens, types, valid = batch
    with torch.no_grad():
        want = model(input_ids=torch.from_numpy(tokens), token_type_ids=torch.from_numpy(types),
                     attention_mask=torch.from_numpy(valid))
    real = valid.astype(bool)  # HF and megajax both let padded queries attend, but to different things
    for data, model_axis in [(1, 1), (2, 4)]:
        mlm, sop, config = megajax_logits(tmp_path / "mj", data, model_axis, batch)
        mlm_diff = np.abs(mlm[..., :VOCAB][real] - want.prediction_logits.numpy()[real]).max()
        sop_diff = np.abs(sop - want.seq_relationship_logits.numpy()).max()
        assert mlm_diff < LOGIT_ATOL and sop_diff < LOGIT_ATOL, (data, model_axis, mlm_diff, sop_diff)
        assert (mlm[..., VOCAB:] == np.finfo(np.float32).min).all()  # padded vocabulary rows never predicted
    assert config.model.name == "bert" and config.model.post_layernorm == (model.config.model_type == "bert")
    assert (config.model.num_token_types, config.model.activation, config.model.layernorm_eps) == (2, "gelu", 1e-12)


def test_hf_round_trip_is_exact(hf_dir, tmp_path):
    src, _ = hf_dir
    convert_main(["hf-to-megajax", f"--hf={src}", f"--output={tmp_path / 'mj'}", "--make_vocab_size_divisible_by=128"])
    convert_main(["megajax-to-hf", f"--checkpoint={tmp_path / 'mj'}", f"--output={tmp_path / 'back'}"])
    original_hf, original = hf_io.read_config(src), hf_io.read_weights(src)
    back_hf, back = hf_io.read_config(tmp_path / "back"), hf_io.read_weights(tmp_path / "back")
    assert set(back) == set(original)
    for k, v in original.items():
        np.testing.assert_array_equal(back[k], v, err_msg=k)
    for key in ("model_type", "architectures", "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size",
                "hidden_act", "max_position_embeddings", "type_vocab_size", "layer_norm_eps"):
        assert back_hf[key] == original_hf[key], key
    _, info = transformers.AutoModelForPreTraining.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info


@pytest.mark.parametrize("change,match", [({"hidden_act": "relu"}, "hidden_act"),
                                          ({"position_embedding_type": "relative_key"}, "position_embedding_type"),
                                          ({"tie_word_embeddings": False}, "tie_word_embeddings"),
                                          ({"intermediate_size": 100}, "intermediate_size"),
                                          ({"model_type": "roberta"}, "model_type")])
def test_hf_unsupported_configs_are_refused(change, match):
    hf = {"model_type": "bert", "vocab_size": VOCAB, "hidden_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "intermediate_size": 256, "max_position_embeddings": SEQ, **change}
    with pytest.raises(ValueError, match=match):
        hf_bert.config_from_hf(hf)


def test_hf_weights_that_do_not_fit_are_refused(hf_dir):
    src, _ = hf_dir
    hf, sd = hf_io.read_config(src), hf_io.read_weights(src)
    model = model_config(hf_bert.config_from_hf(hf, 128))
    with pytest.raises(KeyError, match="cls.seq_relationship.weight"):
        hf_bert.params_from_hf({k: v for k, v in sd.items() if not k.startswith("cls.seq")}, model)
    with pytest.raises(ValueError, match="no place for.*classifier"):
        hf_bert.params_from_hf({**sd, "classifier.weight": sd["cls.seq_relationship.weight"]}, model)
    with pytest.raises(ValueError, match="implies"):
        hf_bert.params_from_hf(sd, model_config(hf_bert.config_from_hf({**hf, "max_position_embeddings": 64}, 128)))


def bert_config(post_layernorm: bool = False):
    c = base_config()
    c.model.update(name="bert", vocab_size=VOCAB, make_vocab_size_divisible_by=128, num_layers=2, hidden_size=64,
                   num_heads=4, max_seq_len=SEQ, num_token_types=2, activation="gelu", layernorm_eps=1e-12,
                   post_layernorm=post_layernorm, dropout=0.0, remat="none")
    return c


@pytest.fixture(scope="module")
def megajax_params():
    """Random values for every pre-LN BERT parameter (Megatron's layout), shaped as the model's, as host arrays."""
    from megajax.config import abstract_model

    config = bert_config()
    rng = np.random.default_rng(1)
    shapes = nnx.to_pure_dict(nnx.state(abstract_model(config)))
    return jax.tree.map(lambda x: rng.normal(0, 0.05, x.shape).astype(np.float32), shapes), config


def assert_same_tree(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_megatron_round_trip_is_exact(megajax_params, tmp_path, tp):
    params, config = megajax_params
    megatron_bert.write_megatron(tmp_path, params, model_config(config), tp, iteration=100)
    assert sorted(p.name for p in (tmp_path / "iter_0000100").iterdir()) == [f"mp_rank_{r:02d}" for r in range(tp)]
    assert megatron_bert.holds_bert(tmp_path)
    back, back_config = megatron_bert.read_megatron(tmp_path, vocab_size=VOCAB)
    assert_same_tree(params, back)
    for key in ("name", "vocab_size", "num_layers", "hidden_size", "num_heads", "max_seq_len", "num_token_types",
                "activation", "layernorm_eps", "post_layernorm"):
        assert back_config.model[key] == config.model[key], key
    assert back_config.model.make_vocab_size_divisible_by == 128


def test_megatron_bert_layout(megajax_params, tmp_path):
    """At TP=2 rank r holds vocabulary rows 512r..512r+511 of the word embedding and of the lm_head bias; the
    pooler, tokentype embedding, lm_head dense/LayerNorm and binary head are whole on every rank, as torch Linear
    (out, in) weights nested where Megatron's BertModel keeps them."""
    params, config = megajax_params
    megatron_bert.write_megatron(tmp_path, params, model_config(config), 2, iteration=1)
    for r in range(2):
        ck = torch.load(tmp_path / "iter_0000001" / f"mp_rank_{r:02d}" / "model_optim_rng.pt", weights_only=False)
        m, rows = ck["model"], slice(512 * r, 512 * (r + 1))
        lm = m["language_model"]
        assert set(m) == {"language_model", "lm_head", "binary_head"}
        assert set(lm) == {"embedding", "encoder", "pooler"}
        np.testing.assert_array_equal(lm["embedding"]["word_embeddings"]["weight"], params["wte"]["embedding"][rows])
        np.testing.assert_array_equal(m["lm_head"]["bias"], params["mlm_bias"][rows])
        np.testing.assert_array_equal(lm["embedding"]["tokentype_embeddings"]["weight"], params["tte"])
        np.testing.assert_array_equal(lm["pooler"]["dense.weight"], params["pooler"]["kernel"].T)
        np.testing.assert_array_equal(m["lm_head"]["dense.weight"], params["mlm_dense"]["kernel"].T)
        np.testing.assert_array_equal(m["lm_head"]["layernorm.bias"], params["mlm_ln"]["bias"])
        np.testing.assert_array_equal(m["binary_head"]["weight"], params["sop"]["kernel"].T)
        np.testing.assert_array_equal(lm["encoder"]["final_layernorm.weight"], params["ln_f"]["scale"])
        assert ck["args"].padded_vocab_size == 1024 and ck["args"].make_vocab_size_divisible_by == 64
        assert not ck["args"].openai_gelu and ck["args"].layernorm_epsilon == 1e-12


def test_tp4_and_tp1_checkpoints_convert_to_the_same_model(megajax_params, batch, tmp_path):
    params, config = megajax_params
    save_params(tmp_path / "mj", params, config.to_json())
    for tp in (1, 4):
        convert_main(["megajax-to-megatron", f"--checkpoint={tmp_path / 'mj'}", f"--output={tmp_path / f'tp{tp}'}",
                      f"--tp={tp}"])
        convert_main(["megatron-to-megajax", f"--megatron={tmp_path / f'tp{tp}'}", f"--output={tmp_path / f'mj{tp}'}",
                      f"--vocab_size={VOCAB}"])
    a, _ = load_model(tmp_path / "mj1", data=1, model=1)
    b, config_b = load_model(tmp_path / "mj4", data=1, model=4)
    assert config_b.model.name == "bert"
    assert_same_tree(nnx.to_pure_dict(nnx.state(a)), nnx.to_pure_dict(nnx.state(b)))
    assert_same_tree(params, nnx.to_pure_dict(nnx.state(a)))


def test_megatron_needs_the_true_vocabulary(megajax_params, tmp_path):
    params, config = megajax_params
    megatron_bert.write_megatron(tmp_path, params, model_config(config), 2)
    with pytest.raises(ValueError, match=r"only the padded vocabulary \(1024 embedding rows\).*e.g. "
                                         r"--vocab_size=30522 for BERT's uncased WordPiece"):
        megatron_bert.read_megatron(tmp_path)
    with pytest.raises(ValueError, match="padding rows"):
        megatron_bert.read_megatron(tmp_path, vocab_size=800)  # Megatron would have padded 800 to 896, not 1024
    with pytest.raises(ValueError, match="pre-LN"):
        megatron_bert.write_megatron(tmp_path / "post", params, model_config(bert_config(post_layernorm=True)), 1)


def edit_ranks(iter_dir, edit):
    """Loads each rank file of ``iter_dir``, calls ``edit(checkpoint, rank_name)``, saves it back."""
    for f in sorted(iter_dir.glob("mp_rank_*/model_optim_rng.pt")):
        ck = torch.load(f, weights_only=False)
        edit(ck, f.parent.name)
        torch.save(ck, f)


@pytest.mark.parametrize("edit, want", [
    (lambda ck, _: setattr(ck["args"], "num_layers", 3),
     r"inconsistent: num_layers: 3 in args.num_layers, 2 in the tensors"),
    (lambda ck, _: setattr(ck["args"], "bert_binary_head", False),
     r"args.bert_binary_head=False, but megajax's BERT computes bert_binary_head=True"),
    (lambda ck, _: setattr(ck["args"], "swiglu", True), r"args.swiglu=True, but megajax's BERT computes swiglu=False"),
    (lambda ck, _: ck["model"].pop("binary_head"), r"has no binary_head \(trained with --bert-no-binary-head\)"),
    (lambda ck, rank: ck["model"]["lm_head"]["dense.bias"].add_(rank == "mp_rank_01"),
     r"replicated tensor mlm_dense_b differs between mp_rank_00 and mp_rank_01"),
    (lambda ck, rank: setattr(ck["args"], "hidden_size", 32 if rank == "mp_rank_01" else 64),
     r"disagree on hidden_size \(mp_rank_00 has 64, mp_rank_01 has 32\)"),
])
def test_megatron_bert_inputs_are_checked_like_gpt(megajax_params, tmp_path, edit, want):
    """The BERT reader shares the GPT reader's checks: args against tensors, ranks against each other, variants."""
    params, config = megajax_params
    it_dir = megatron_bert.write_megatron(tmp_path, params, model_config(config), 2)
    edit_ranks(it_dir, edit)
    with pytest.raises(ValueError, match=want):
        megatron_bert.read_megatron(tmp_path, vocab_size=VOCAB)


def test_megatron_bert_missing_rank_and_token_types_are_named(megajax_params, tmp_path):
    params, config = megajax_params
    it_dir = megatron_bert.write_megatron(tmp_path, params, model_config(config), 4)
    wrong = bert_config()
    wrong.model.num_token_types = 3
    with pytest.raises(ValueError, match=r"num_token_types: 2 in the tensors \(embedding.tokentype_embeddings.weight "
                                         r"is \(2, 64\)\), 3 in --config model.num_token_types"):
        megatron_bert.read_megatron(tmp_path, model_config(wrong))
    shutil.rmtree(it_dir / "mp_rank_02")
    with pytest.raises(ValueError, match=r"lacks mp_rank_02 \(it holds mp_rank_00, mp_rank_01, mp_rank_03\)"):
        convert_main(["megatron-to-megajax", f"--megatron={tmp_path}", f"--output={tmp_path.parent / 'out'}",
                      f"--vocab_size={VOCAB}"])
    assert not (tmp_path / "out").exists()
