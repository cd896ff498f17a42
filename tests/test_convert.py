"""Conversion: Hugging Face GPT-2 and Megatron-LM (legacy and Core names, TP 1/2/4) round trips and logits."""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import small_config

from megajax.checkpoint import load_model, save_params
from megajax.config import model_config
from megajax.convert import hf_io, megatron_gpt
from megajax.convert.__main__ import main as convert_main

torch = pytest.importorskip("torch")  # the `test` extra installs it (CPU build); CI runs these
transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A small random GPT2LMHeadModel saved locally (no download)."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=1000, n_positions=32, n_embd=64, n_layer=2, n_head=8,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    with torch.no_grad():  # non-trivial biases and LayerNorm parameters
        for name, p in model.named_parameters():
            if "ln_" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    out = tmp_path_factory.mktemp("hf")
    model.save_pretrained(out)
    return out, model


def test_hf_round_trip_is_exact(hf_dir, tmp_path):
    src, _ = hf_dir
    convert_main(["hf-to-megajax", f"--hf={src}", f"--output={tmp_path / 'mj'}", "--make_vocab_size_divisible_by=128"])
    convert_main(["megajax-to-hf", f"--checkpoint={tmp_path / 'mj'}", f"--output={tmp_path / 'back'}"])
    original = hf_io.read_weights(src)
    back = hf_io.read_weights(tmp_path / "back")
    original = {k: v for k, v in original.items() if k != "lm_head.weight"}
    assert set(back) == set(original)
    for k, v in original.items():
        np.testing.assert_array_equal(back[k], v, err_msg=k)


def test_converted_logits_match_transformers(hf_dir, tmp_path):
    src, model = hf_dir
    convert_main(["hf-to-megajax", f"--hf={src}", f"--output={tmp_path / 'mj'}", "--make_vocab_size_divisible_by=128"])
    tokens = np.random.default_rng(0).integers(0, 1000, (2, 32))
    with torch.no_grad():
        want = model(torch.from_numpy(tokens)).logits.numpy()
    for data, model_axis in [(1, 1), (2, 4)]:
        ours, config = load_model(tmp_path / "mj", data=data, model=model_axis)
        got = np.asarray(ours(jnp.asarray(tokens)))[..., :1000]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert config.model.vocab_size == 1000 and model_config(config).padded_vocab_size == 1024


def test_hf_pytorch_bin_loads_without_pickle(hf_dir, tmp_path):
    src, model = hf_dir
    (tmp_path / "bin").mkdir()
    torch.save(model.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    (tmp_path / "bin" / "config.json").write_text((src / "config.json").read_text())
    sd = hf_io.read_weights(tmp_path / "bin")
    ref = hf_io.read_weights(src)
    np.testing.assert_array_equal(sd["transformer.h.1.attn.c_attn.weight"], ref["transformer.h.1.attn.c_attn.weight"])


@pytest.fixture(scope="module")
def megajax_params():
    """Random parameters of the small model (8 heads, 2 layers), as host arrays."""
    from flax import nnx

    from megajax.models.gpt import GPT

    config = small_config()
    model = GPT(model_config(config), rngs=nnx.Rngs(3))
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model)))
    rng = np.random.default_rng(1)
    params = jax.tree.map(lambda x: x + rng.normal(0, 0.05, x.shape).astype(np.float32), params)  # biases, LNs
    return params, config


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("names", ["legacy", "core"])
def test_megatron_round_trip_is_exact(megajax_params, tmp_path, tp, names):
    params, config = megajax_params
    megatron_gpt.write_megatron(tmp_path, params, model_config(config), tp, iteration=100, names=names)
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "100"
    assert sorted(p.name for p in (tmp_path / "iter_0000100").iterdir()) == [f"mp_rank_{r:02d}" for r in range(tp)]
    back, back_config = megatron_gpt.read_megatron(tmp_path, vocab_size=1000)
    assert back_config.model.num_heads == 8 and back_config.model.num_layers == 2
    for key in ("layernorm_eps", "dropout", "init_std"):  # stored as args.layernorm_epsilon, hidden_dropout, ...
        assert back_config.model[key] == config.model[key], key
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(params), jax.tree.leaves(back)):
        np.testing.assert_array_equal(a, b, err_msg=jax.tree_util.keystr(path))


def test_megatron_qkv_layout_per_head(megajax_params, tmp_path):
    """Rank r of TP=2 holds heads 4r..4r+3; its query_key_value rows are [head, (q, k, v), head_dim] with
    weight[row, :] = W_{q|k|v} of that head (torch Linear: out x in). Built here head by head."""
    params, config = megajax_params
    tp, nh, d, h = 2, 8, 8, 64
    megatron_gpt.write_megatron(tmp_path, params, model_config(config), tp, iteration=1)
    kernel = params["blocks"]["attn"]["qkv"]["kernel"][1]  # layer 1: (H, heads, 3, head_dim)
    bias = params["blocks"]["attn"]["qkv"]["bias"][1]
    for r in range(tp):
        ck = torch.load(tmp_path / "iter_0000001" / f"mp_rank_{r:02d}" / "model_optim_rng.pt", weights_only=False)
        enc = ck["model"]["language_model"]["encoder"]
        w = enc["layers.1.self_attention.query_key_value.weight"].numpy()
        b = enc["layers.1.self_attention.query_key_value.bias"].numpy()
        assert w.shape == (3 * h // tp, h)
        row = 0
        for local_head in range(nh // tp):
            head = r * (nh // tp) + local_head
            for j in range(3):  # q, k, v
                for e in range(d):
                    np.testing.assert_array_equal(w[row], kernel[:, head, j, e])
                    assert b[row] == bias[head, j, e]
                    row += 1
        dense = enc["layers.1.self_attention.dense.weight"].numpy()  # (H, H/tp): input columns split by heads
        out_kernel = params["blocks"]["attn"]["out"]["kernel"][1]  # (heads, head_dim, H)
        np.testing.assert_array_equal(dense, out_kernel[r * 4:(r + 1) * 4].reshape(-1, h).T)
        wte = ck["model"]["language_model"]["embedding"]["word_embeddings"]["weight"].numpy()
        np.testing.assert_array_equal(wte, params["wte"]["embedding"][r * 512:(r + 1) * 512])
        assert ck["checkpoint_version"] == 3.0


def test_tp4_and_tp1_checkpoints_convert_to_the_same_model(megajax_params, tmp_path):
    params, config = megajax_params
    megatron_gpt.write_megatron(tmp_path / "tp1", params, model_config(config), 1)
    megatron_gpt.write_megatron(tmp_path / "tp4", params, model_config(config), 4)
    convert_main(["megatron-to-megajax", f"--megatron={tmp_path / 'tp1'}", f"--output={tmp_path / 'a'}",
                  "--vocab_size=1000"])
    convert_main(["megatron-to-megajax", f"--megatron={tmp_path / 'tp4'}", f"--output={tmp_path / 'b'}",
                  "--vocab_size=1000"])
    a, _ = load_model(tmp_path / "a", data=1, model=1)
    b, _ = load_model(tmp_path / "b", data=1, model=4)
    from flax import nnx
    for x, y in zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b))):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_megatron_dtype_and_bf16_params_export(megajax_params, tmp_path):
    params, config = megajax_params
    save_params(tmp_path / "mj", params, config.to_json(), step=7)
    convert_main(["megajax-to-megatron", f"--checkpoint={tmp_path / 'mj'}", f"--output={tmp_path / 'mt'}",
                  "--tp=2", "--dtype=float16"])
    ck = torch.load(tmp_path / "mt" / "iter_0000000" / "mp_rank_01" / "model_optim_rng.pt", weights_only=False)
    assert ck["model"]["language_model"]["encoder"]["final_layernorm.weight"].dtype == torch.float16
    convert_main(["export", f"--checkpoint={tmp_path / 'mj'}", f"--output={tmp_path / 'bf16'}"])
    import orbax.checkpoint as ocp
    meta = ocp.PyTreeCheckpointHandler().metadata(tmp_path / "bf16" / "0" / "params").tree
    assert {str(x.dtype) for x in jax.tree.leaves(meta)} == {"bfloat16"}
    model, _ = load_model(tmp_path / "bf16")
    np.testing.assert_allclose(np.asarray(model.wpe[...]), params["wpe"], rtol=1e-2, atol=1e-3)


def test_unsafe_pickle_is_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))
    ck = tmp_path / "iter_0000001" / "mp_rank_00"
    ck.mkdir(parents=True)
    torch.save({"model": {}, "evil": Evil(), "args": argparse.Namespace(x=1)}, ck / "model_optim_rng.pt")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1")
    with pytest.raises(ValueError, match="weights_only=True"):
        megatron_gpt.read_megatron(tmp_path)
