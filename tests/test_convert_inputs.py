"""Conversion inputs and outputs: Megatron vocabulary and args against tensors and flags, disagreeing rank files,
unsupported HF architectures, missing inputs, outputs that already hold something, and relative paths."""

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from megajax.checkpoint import load_model, save_params
from megajax.config import abstract_model, base_config, model_config
from megajax.config.load import read_run_config
from megajax.convert import hf_gpt2, hf_io, megatron_gpt
from megajax.convert.__main__ import host_params
from megajax.convert.__main__ import main as convert_main
from megajax.outputs import OutputPathError

ROOT = pathlib.Path(__file__).resolve().parent.parent
torch = pytest.importorskip("torch")  # the `test` extra installs it (CPU build)


def tiny_config(vocab_size: int = 1000, divisible_by: int = 128):
    """2 layers, hidden 16, 4 heads, 8 positions: small enough that a save takes milliseconds."""
    c = base_config()
    c.model.update(vocab_size=vocab_size, make_vocab_size_divisible_by=divisible_by, num_layers=2, hidden_size=16,
                   num_heads=4, max_seq_len=8, dropout=0.0, remat="none")
    return c


def tiny_params(config, seed: int = 0) -> dict:
    """Random host parameters in the model's own tree (shapes from the abstract model, nothing allocated on device)."""
    rng = np.random.default_rng(seed)
    shapes = nnx.to_pure_dict(nnx.state(abstract_model(config)))
    return jax.tree.map(lambda s: rng.normal(0, 0.1, s.shape).astype(np.float32), shapes)


@pytest.fixture(scope="module")
def tiny():
    config = tiny_config()
    return tiny_params(config), config


def megatron_checkpoint(path, tiny, tp: int = 1, iteration: int = 0):
    params, config = tiny
    megatron_gpt.write_megatron(path, params, model_config(config), tp, iteration=iteration)
    return path


def rank_files(path, iteration: int = 0):
    return sorted((path / f"iter_{iteration:07d}").glob("mp_rank_*/model_optim_rng.pt"))


def edit_ranks(path, edit, iteration: int = 0):
    """Loads each rank file, calls ``edit(checkpoint, rank_name)``, saves it back."""
    for f in rank_files(path, iteration):
        ck = torch.load(f, weights_only=False)
        edit(ck, f.parent.name)
        torch.save(ck, f)


def convert(*argv):
    convert_main([str(a) for a in argv])


# --- item 4: the vocabulary and the sizes come from the checkpoint, never from a silent default ---------------------

def test_padded_only_vocabulary_asks_for_the_flag(tiny, tmp_path):
    """The issue's case: args.padded_vocab_size=1024 and no --vocab_size used to give 50257 ids over 51200 rows."""
    src = megatron_checkpoint(tmp_path / "mt", tiny)
    assert torch.load(rank_files(src)[0], weights_only=False)["args"].padded_vocab_size == 1024
    with pytest.raises(ValueError, match=r"only the padded vocabulary \(1024 embedding rows\).*--vocab_size=50257"):
        convert("megatron-to-megajax", f"--megatron={src}", f"--output={tmp_path / 'out'}")
    with pytest.raises(ValueError, match=r"--vocab_size=50257 does not fit the checkpoint's 1024 embedding rows"):
        convert("megatron-to-megajax", f"--megatron={src}", f"--output={tmp_path / 'out'}", "--vocab_size=50257")
    assert not (tmp_path / "out").exists()
    # As a user runs it (relative paths): the message and exit code 1, no traceback.
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "megajax.convert", "megatron-to-megajax", "--megatron=mt", "--output=out"]
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stderr.startswith("error: ") and "Traceback" not in result.stderr
    assert "--vocab_size=50257" in result.stderr, result.stderr
    convert("megatron-to-megajax", f"--megatron={src}", f"--output={tmp_path / 'out'}", "--vocab_size=1000")
    config = read_run_config(tmp_path / "out")
    assert (config.model.vocab_size, config.model.make_vocab_size_divisible_by) == (1000, 128)
    model, _ = load_model(tmp_path / "out", data=1, model=1)
    np.testing.assert_array_equal(np.asarray(model.wte.embedding[...]), tiny[0]["wte"]["embedding"])


@pytest.mark.parametrize("tokenizer, want", [
    ("GPT2BPETokenizer", r"args.tokenizer_type is GPT2BPETokenizer: pass --vocab_size=50257 \(at most 50304\)"),
    ("HuggingFaceTokenizer", r"args.tokenizer_type=HuggingFaceTokenizer\), e.g. --vocab_size=50257 for GPT-2's BPE"),
])
def test_vocabulary_hint_names_the_tokenizer(tmp_path, tokenizer, want):
    config = tiny_config(vocab_size=50257)
    megatron_gpt.write_megatron(tmp_path, tiny_params(config), model_config(config), 1)
    edit_ranks(tmp_path, lambda ck, _: setattr(ck["args"], "tokenizer_type", tokenizer))
    with pytest.raises(ValueError, match=want):
        megatron_gpt.read_megatron(tmp_path)


def test_vocabulary_far_below_the_padding_is_refused(tiny, tmp_path):
    """Megatron pads by fewer than make_vocab_size_divisible_by x tp rows: 1024 rows cannot hold a 500-token vocab."""
    megatron_checkpoint(tmp_path, tiny, tp=2)
    with pytest.raises(ValueError, match=r"--vocab_size=500 leaves 524 padding rows.*not 1024"):
        megatron_gpt.read_megatron(tmp_path, vocab_size=500)


@pytest.mark.parametrize("key, value", [("num_layers", 3), ("hidden_size", 32), ("max_position_embeddings", 16),
                                        ("ffn_hidden_size", 32), ("padded_vocab_size", 2048),
                                        ("tensor_model_parallel_size", 4)])
def test_args_that_contradict_the_tensors_are_refused(tiny, tmp_path, key, value):
    megatron_checkpoint(tmp_path, tiny, tp=2)
    edit_ranks(tmp_path, lambda ck, _: setattr(ck["args"], key, value))
    want = (r"lacks mp_rank_02, mp_rank_03: its args say tensor_model_parallel_size=4 but only "
            r"mp_rank_00..mp_rank_01 are there" if key == "tensor_model_parallel_size"  # the ranks it names
            else rf"inconsistent: {key}: {value} in args.{key}, \d+ in the ")
    with pytest.raises(ValueError, match=want):
        megatron_gpt.read_megatron(tmp_path, vocab_size=1000)


def test_config_that_contradicts_the_args_is_refused(tiny, tmp_path):
    megatron_checkpoint(tmp_path, tiny)
    other = tiny_config()
    other.model.num_heads = 8
    with pytest.raises(ValueError, match=r"num_attention_heads: 4 in args.num_attention_heads, 8 in --config "
                                         r"model.num_heads.*pass a --config that matches"):
        megatron_gpt.read_megatron(tmp_path, model_config(other), vocab_size=1000)


def test_checkpoint_without_args_needs_a_config(tiny, tmp_path):
    src = megatron_checkpoint(tmp_path / "mt", tiny, tp=2)
    edit_ranks(src, lambda ck, _: ck.pop("args"))
    with pytest.raises(ValueError, match=r"stores no args.*pass --config=NAME"):
        convert("megatron-to-megajax", f"--megatron={src}", f"--output={tmp_path / 'a'}", "--vocab_size=1000")
    (tmp_path / "tiny_cfg.py").write_text("from megajax.config import base_config\n\n\ndef get_config():\n"
                                          "    c = base_config()\n    c.model.update(vocab_size=1000, num_layers=2, "
                                          "hidden_size=16, num_heads=4, max_seq_len=8)\n    return c\n")
    convert("megatron-to-megajax", f"--megatron={src}", f"--output={tmp_path / 'a'}",
            f"--config={tmp_path / 'tiny_cfg.py'}")  # the config's vocab_size, padded to the checkpoint's 1024 rows
    back, config = load_model(tmp_path / "a", data=1, model=1)
    assert config.model.make_vocab_size_divisible_by == 1024  # the config's own padding, which gives 1024 rows
    np.testing.assert_array_equal(np.asarray(back.wpe[...]), tiny[0]["wpe"])
    with pytest.raises(ValueError, match=r"--config model.vocab_size=50257 does not fit the checkpoint's 1024 "):
        megatron_gpt.read_megatron(src, model_config(tiny_config(vocab_size=50257)))
    wrong = tiny_config()
    wrong.model.max_seq_len = 16
    with pytest.raises(ValueError, match=r"max_position_embeddings: 16 in --config model.max_seq_len, 8 in the "
                                         r"tensors \(embedding.position_embeddings.weight is \(8, 16\)\)"):
        megatron_gpt.read_megatron(src, model_config(wrong))


@pytest.mark.parametrize("edit, want", [
    (lambda ck: setattr(ck["args"], "swiglu", True), r"args.swiglu=True, but megajax's GPT computes swiglu=False"),
    (lambda ck: ck["model"]["language_model"].update(output_layer={"weight": torch.zeros(1024, 16)}),
     r"has no place for: \['output_layer.weight'\]"),
    (lambda ck: ck["model"]["language_model"]["encoder"].pop("layers.1.mlp.dense_4h_to_h.bias"),
     r"has no tensor 'encoder.layers.1.mlp.dense_4h_to_h.bias'"),
])
def test_model_variants_megajax_lacks_are_refused(tiny, tmp_path, edit, want):
    megatron_checkpoint(tmp_path, tiny)
    edit_ranks(tmp_path, lambda ck, _: edit(ck))
    with pytest.raises((ValueError, KeyError), match=want):
        megatron_gpt.read_megatron(tmp_path, vocab_size=1000)


@pytest.mark.parametrize("key", ["layernorm_epsilon", "norm_epsilon"])  # Megatron's older and newer spellings
def test_layernorm_epsilon_comes_from_the_args(tiny, tmp_path, key):
    megatron_checkpoint(tmp_path, tiny)

    def set_epsilon(ck, _):
        delattr(ck["args"], "layernorm_epsilon")
        setattr(ck["args"], key, 1e-6)
    edit_ranks(tmp_path, set_epsilon)
    _, config = megatron_gpt.read_megatron(tmp_path, vocab_size=1000)
    assert config.model.layernorm_eps == 1e-6


# --- item 14: rank files that disagree are named -----------------------------------------------------------------

def test_missing_rank_is_named(tiny, tmp_path):
    megatron_checkpoint(tmp_path, tiny, tp=4)
    shutil.rmtree(tmp_path / "iter_0000000" / "mp_rank_01")
    with pytest.raises(ValueError, match=r"lacks mp_rank_01 \(it holds mp_rank_00, mp_rank_02, mp_rank_03\)"):
        megatron_gpt.read_megatron(tmp_path, vocab_size=1000)


@pytest.mark.parametrize("with_args", [True, False])
def test_ranks_of_two_tp_degrees_are_named(tiny, tmp_path, with_args):
    """Ranks 0-1 of a TP=2 save beside ranks 2-3 of a TP=4 one: the args, or without them the shapes, disagree."""
    megatron_checkpoint(tmp_path / "two", tiny, tp=2)
    megatron_checkpoint(tmp_path / "four", tiny, tp=4)
    for r in (2, 3):
        shutil.copytree(tmp_path / "four" / "iter_0000000" / f"mp_rank_{r:02d}",
                        tmp_path / "two" / "iter_0000000" / f"mp_rank_{r:02d}")
    if with_args:
        want = r"disagree on tensor_model_parallel_size \(mp_rank_00 has 2, mp_rank_01 has 2, mp_rank_02 has 4"
        config = None
    else:
        edit_ranks(tmp_path / "two", lambda ck, _: ck.pop("args"))
        want = r"is \(512, 16\) in mp_rank_00 but \(256, 16\) in mp_rank_02: the ranks come from different"
        config = model_config(tiny_config())
    with pytest.raises(ValueError, match=want):
        megatron_gpt.read_megatron(tmp_path / "two", config, vocab_size=1000)


def test_ranks_whose_args_disagree_are_named(tiny, tmp_path):
    megatron_checkpoint(tmp_path, tiny, tp=2)
    edit_ranks(tmp_path, lambda ck, rank: setattr(ck["args"], "num_layers", 3 if rank == "mp_rank_01" else 2))
    with pytest.raises(ValueError, match=r"disagree on num_layers \(mp_rank_00 has 2, mp_rank_01 has 3\)"):
        megatron_gpt.read_megatron(tmp_path, vocab_size=1000)


def test_tensors_that_do_not_fit_the_tp_degree_are_refused(tiny, tmp_path):
    """A TP=2 save whose ranks each hold the whole (unsplit) query_key_value: joined they are twice too tall."""
    megatron_checkpoint(tmp_path / "one", tiny, tp=1)
    megatron_checkpoint(tmp_path / "two", tiny, tp=2)
    full = torch.load(rank_files(tmp_path / "one")[0], weights_only=False)["model"]["language_model"]["encoder"]

    def unsplit(ck, _):
        for k, v in ck["model"]["language_model"]["encoder"].items():
            if "query_key_value" in k:
                ck["model"]["language_model"]["encoder"][k] = full[k]
    edit_ranks(tmp_path / "two", unsplit)
    with pytest.raises(ValueError, match=r"query_key_value.weight is \(96, 16\) joined over 2 rank\(s\), but "
                                         r"hidden_size=16 and ffn_hidden_size=64 need \(48, 16\)"):
        megatron_gpt.read_megatron(tmp_path / "two", vocab_size=1000)


def test_missing_iteration_lists_the_ones_there(tiny, tmp_path):
    megatron_checkpoint(tmp_path, tiny, iteration=100)
    with pytest.raises(FileNotFoundError, match=r"iter_0000005 \(--iteration=5\) does not exist; iterations here: "
                                                r"iter_0000100"):
        megatron_gpt.read_megatron(tmp_path, iteration=5, vocab_size=1000)
    (tmp_path / "latest_checkpointed_iteration.txt").unlink()
    with pytest.raises(FileNotFoundError, match=r"give --iteration=N \(iterations here: iter_0000100\)"):
        megatron_gpt.read_megatron(tmp_path, vocab_size=1000)


# --- item 14: Hugging Face inputs ----------------------------------------------------------------------------------

def test_other_hf_architectures_name_the_supported_ones(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "mistral", "architectures":
                                                             ["MistralForCausalLM"], "hidden_size": 16}))
    with pytest.raises(ValueError, match=r"model_type 'mistral' \(MistralForCausalLM\); megajax converts only: gpt2 "
                                         r"\(GPT2LMHeadModel\), bert \(BertForPreTraining\), megatron-bert "
                                         r"\(MegatronBertForPreTraining\), llama \(LlamaForCausalLM\), mixtral "
                                         r"\(MixtralForCausalLM\), qwen3_moe \(Qwen3MoeForCausalLM\), deepseek_v3 "
                                         r"\(DeepseekV3ForCausalLM\)$"):
        convert("hf-to-megajax", f"--hf={tmp_path / 'hf'}", f"--output={tmp_path / 'out'}")
    assert not (tmp_path / "out").exists()


LLAMA = {"model_type": "llama", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "max_position_embeddings": 64}
MOE = {**LLAMA, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2}
QWEN = {**MOE, "model_type": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": 48}
GPT2 = {"model_type": "gpt2", "vocab_size": 100, "n_embd": 16, "n_layer": 2, "n_head": 4, "n_positions": 8}
BERT = {"model_type": "bert", "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "max_position_embeddings": 16}


@pytest.mark.parametrize("hf, change, problem", [
    (MOE, {"num_experts_per_tok": None}, "num_experts_per_tok=null, where a whole number >= 1 is needed"),
    (QWEN, {"num_experts_per_tok": None}, "num_experts_per_tok=null"),
    (QWEN, {"decoder_sparse_step": None}, "decoder_sparse_step=null"),
    (MOE, {"num_local_experts": "8"}, 'num_local_experts="8" is not a whole number >= 1'),
    (MOE, {"num_experts_per_tok": 0}, "num_experts_per_tok=0: num_experts_per_tok must be a whole number >= 1"),
    (LLAMA, {"hidden_size": 64.0}, "hidden_size=64.0 is not a whole number >= 1"),
    (LLAMA, {"max_position_embeddings": None}, "max_position_embeddings=null"),
    (GPT2, {"n_layer": None}, "n_layer=null"),
    (BERT, {"type_vocab_size": True}, "type_vocab_size=true is not a whole number >= 1"),
])
def test_a_config_json_number_that_is_null_or_not_whole_is_named(tmp_path, hf, change, problem):
    """Every converter reads config.json's numbers through one rule (``convert.config_json.number``): null where
    transformers refuses it, a string, a fraction, true, a count of 0: the field and the file named, nothing
    written, the input as it was."""
    (tmp_path / "hf").mkdir()
    config = tmp_path / "hf" / "config.json"
    config.write_text(json.dumps({**hf, **change}))
    before = config.read_bytes()
    with pytest.raises(ValueError) as error:
        convert("hf-to-megajax", f"--hf={tmp_path / 'hf'}", f"--output={tmp_path / 'out'}")
    assert str(error.value).startswith(f"{config} {problem}"), str(error.value)
    assert config.read_bytes() == before and sorted(tmp_path.iterdir()) == [tmp_path / "hf"]


def test_a_null_transformers_reads_as_derived_keeps_its_meaning():
    """Fields transformers types ``int | None``: null is the heads' key/value heads, hidden_size / heads wide heads,
    GPT-2's 4 x n_embd inner width."""
    llama = hf_io.CONVERTERS["llama"].config_from_hf({**LLAMA, "num_key_value_heads": None, "head_dim": None}).model
    assert (llama.num_kv_heads, llama.hidden_size // llama.num_heads) == (8, 8)
    assert hf_gpt2.config_from_hf({**GPT2, "n_inner": None}).model.mlp_ratio == 4


@pytest.fixture(scope="module")
def hf_state(tiny):
    params, config = tiny
    return hf_gpt2.params_to_hf(params, model_config(config)), hf_gpt2.hf_config(model_config(config))


def test_hf_weights_that_contradict_config_json_are_refused(hf_state):
    sd, hf = hf_state
    model = model_config(hf_gpt2.config_from_hf(hf, 128))
    wider = dict(sd, **{"transformer.h.1.mlp.c_fc.weight": np.zeros((16, 32), np.float32)})
    with pytest.raises(ValueError, match=r"h.1.mlp.c_fc.weight is \(16, 32\), but config.json .*n_inner=64\) "
                                         r"implies \(16, 64\)"):
        hf_gpt2.params_from_hf(wider, model)
    deeper = dict(sd, **{k.replace("h.1.", "h.2."): v for k, v in sd.items() if ".h.1." in k})
    with pytest.raises(ValueError, match=r"hold layers \[2\] but config.json says n_layer=2"):
        hf_gpt2.params_from_hf(deeper, model)
    untied = dict(sd, **{"lm_head.weight": sd["transformer.wte.weight"] + 1})
    with pytest.raises(ValueError, match="untied output layer"):
        hf_gpt2.params_from_hf(untied, model)
    with pytest.raises(ValueError, match="tie_word_embeddings=False is not supported"):
        hf_gpt2.config_from_hf(dict(hf, tie_word_embeddings=False))


def test_sharded_safetensors_are_read_whole(hf_state, tmp_path):
    from safetensors.numpy import save_file

    sd, hf = hf_state
    names = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": names[:5], "model-00002-of-00002.safetensors": names[5:]}
    for shard, keys in shards.items():
        save_file({k: sd[k] for k in keys}, str(tmp_path / shard))
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    got = hf_io.read_weights(tmp_path)
    assert set(got) == set(sd)
    for k in sd:
        np.testing.assert_array_equal(got[k], sd[k], err_msg=k)


# --- item 14: inputs that do not exist, outputs that already hold something -----------------------------------------

@pytest.mark.parametrize("verb, flag", [("hf-to-megajax", "hf"), ("megajax-to-hf", "checkpoint"),
                                        ("megatron-to-megajax", "megatron"), ("megajax-to-megatron", "checkpoint"),
                                        ("export", "checkpoint")])
def test_missing_input_names_its_flag(tmp_path, verb, flag):
    extra = ["--tp=1"] if verb == "megajax-to-megatron" else []
    with pytest.raises(FileNotFoundError, match=rf"--{flag}={tmp_path / 'nope'} does not exist"):
        convert(verb, f"--{flag}={tmp_path / 'nope'}", f"--output={tmp_path / 'out'}", *extra)
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def megajax_ck(tiny, tmp_path_factory):
    params, config = tiny
    path = tmp_path_factory.mktemp("mj") / "ck"
    save_params(path, params, config.to_json())
    return path


def tree_bytes(path):
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def test_megatron_output_with_other_iterations_is_refused_then_replaced(megajax_ck, tmp_path):
    out = tmp_path / "mt"
    convert("megajax-to-megatron", f"--checkpoint={megajax_ck}", f"--output={out}", "--tp=2", "--iteration=100")
    before = tree_bytes(out)
    with pytest.raises(OutputPathError, match=r"mt already exists \(a Megatron-LM checkpoint\): pass --overwrite to "
                                              r"replace it"):
        convert("megajax-to-megatron", f"--checkpoint={megajax_ck}", f"--output={out}", "--tp=4", "--iteration=7")
    assert tree_bytes(out) == before
    with pytest.raises(FileExistsError, match="already holds iter_0000100/"):  # the library refuses too
        params, _, run = host_params(megajax_ck)
        megatron_gpt.write_megatron(out, params, run.model, 1)
    convert("megajax-to-megatron", f"--checkpoint={megajax_ck}", f"--output={out}", "--tp=4", "--iteration=7",
            "--overwrite")
    assert sorted(p.name for p in out.iterdir()) == ["iter_0000007", "latest_checkpointed_iteration.txt"]
    assert len(list((out / "iter_0000007").iterdir())) == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mt"]  # no staging or replaced directory left behind


def test_failed_overwrite_keeps_the_old_checkpoint(megajax_ck, tmp_path, monkeypatch):
    out = tmp_path / "mt"
    convert("megajax-to-megatron", f"--checkpoint={megajax_ck}", f"--output={out}", "--tp=1")
    before = tree_bytes(out)
    saves = []

    def save_then_fail(obj, path):
        saves.append(path)
        if len(saves) == 2:
            raise OSError("disk full")
        torch.save(obj, path)
    monkeypatch.setattr(megatron_gpt.torch_io, "save", save_then_fail)
    with pytest.raises(OSError, match="disk full"):
        convert("megajax-to-megatron", f"--checkpoint={megajax_ck}", f"--output={out}", "--tp=2", "--overwrite")
    assert tree_bytes(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mt"]


@pytest.mark.parametrize("verb", ["megajax-to-hf", "export"])
def test_other_verbs_refuse_a_used_output(megajax_ck, tmp_path, verb):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "model.safetensors").write_bytes(b"someone else's")
    for overwrite in ([], ["--overwrite"]):  # not an earlier output of the verb: --overwrite does not replace it
        with pytest.raises(OutputPathError, match=r"--output=.*out already holds other files \(model.safetensors\), "
                                                  r"not a .*: --overwrite replaces only"):
            convert(verb, f"--checkpoint={megajax_ck}", f"--output={tmp_path / 'out'}", *overwrite)
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == b"someone else's"
    with pytest.raises(OutputPathError, match="is the input"):
        convert(verb, f"--checkpoint={megajax_ck}", f"--output={megajax_ck}", "--overwrite")


# --- item 1: relative paths ---------------------------------------------------------------------------------------

def test_relative_paths_work_for_every_verb(tiny, tmp_path, monkeypatch):
    params, config = tiny
    save_params(tmp_path / "mj", params, config.to_json())
    monkeypatch.chdir(tmp_path)
    convert("megajax-to-hf", "--checkpoint=mj", "--output=hf")
    convert("hf-to-megajax", "--hf=hf", "--output=mj2", "--make_vocab_size_divisible_by=128")
    convert("export", "--checkpoint=mj2", "--output=sub/mj3", "--dtype=float32")
    convert("megajax-to-megatron", "--checkpoint=./sub/mj3", "--output=mt", "--tp=2")
    convert("megatron-to-megajax", "--megatron=mt", "--output=mj4", "--vocab_size=1000")
    model, back = load_model(tmp_path / "mj4", data=1, model=1)
    assert back.model.vocab_size == 1000
    want = jax.tree.map(np.copy, params)
    want["wte"]["embedding"][1000:] = 0  # HF keeps only the true vocabulary; megajax pads it again with zeros
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(want),
                            jax.tree.leaves(nnx.to_pure_dict(nnx.state(model)))):
        np.testing.assert_array_equal(a, np.asarray(b), err_msg=jax.tree_util.keystr(path))


def test_args_namespace_round_trips_megatron_padding(tiny, tmp_path):
    """Written args let Megatron recompute the padded size: multiple of make_vocab_size_divisible_by x tp."""
    params, config = tiny
    for tp in (1, 2, 4):
        megatron_gpt.write_megatron(tmp_path / str(tp), params, model_config(config), tp)
        args: argparse.Namespace = torch.load(rank_files(tmp_path / str(tp))[0], weights_only=False)["args"]
        multiple = args.make_vocab_size_divisible_by * tp
        assert -(-1000 // multiple) * multiple == args.padded_vocab_size == 1024
