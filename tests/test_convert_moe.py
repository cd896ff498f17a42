"""Hugging Face Mixtral and Qwen3-MoE <-> megajax mixture of experts: the round trip bit-equal in the published
per-expert layout (sharded safetensors, bf16 too), the logits equal transformers' on one device and on data, tensor
and expert-parallel meshes, greedy generation with the key/value cache equal to transformers', the refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_greedy_matches_hf, hf_conversions
from flax import nnx

import megajax
from megajax.config import model_config
from megajax.config.load import inference_config
from megajax.convert import hf_io, hf_moe
from megajax.convert.__main__ import main as convert_main
from megajax.parallel.sharding import ParallelContext, activate

torch = pytest.importorskip("torch")  # the `test` extra installs it (CPU build)
transformers = pytest.importorskip("transformers")

LOGIT_ATOL = 1e-4  # fp32, XLA vs PyTorch kernels
SEQ = 24
COMMON = dict(vocab_size=250, hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
              max_position_embeddings=64, rms_norm_eps=1e-5, initializer_range=0.1, tie_word_embeddings=False)
# mixtral: 4 experts of width 96, top-2 (renormalised); qwen3: 8 experts of width 48, top-3, not renormalised,
# heads of 16 (not 64 / 8), each query and key head RMS-normalised; qwen3_dense: the same in 4 layers, of which only
# layer 1 is routed (decoder_sparse_step=2 makes 0 and 2 dense, mlp_only_layers=[3] the last): dense, routed, dense x 2
MODELS = {
    "mixtral": (transformers.MixtralForCausalLM, transformers.MixtralConfig(
        **COMMON, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2, rope_theta=1e6)),
    "qwen3": (transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(
        **COMMON, intermediate_size=128, moe_intermediate_size=48, num_experts=8, num_experts_per_tok=3,
        norm_topk_prob=False, head_dim=16)),
    "qwen3_dense": (transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(
        **{**COMMON, "num_hidden_layers": 4}, intermediate_size=128, moe_intermediate_size=48, num_experts=8,
        num_experts_per_tok=3, norm_topk_prob=False, head_dim=16, decoder_sparse_step=2, mlp_only_layers=[3])),
}


def routed_layers(config) -> list[int]:
    """The HF model's routed layers (transformers' rule, applied here independently of megajax's)."""
    step, dense = getattr(config, "decoder_sparse_step", 1), getattr(config, "mlp_only_layers", [])
    return [i for i in range(config.num_hidden_layers) if i not in dense and (i + 1) % step == 0]
MESHES = [(1, 1, 1), (2, 2, 1), (1, 1, 2), (2, 1, 4)]  # data, model, expert


def hf_model(name: str):
    torch.manual_seed(0)
    cls, cfg = MODELS[name]
    model = cls(cfg).eval()
    with torch.no_grad():  # norm scales off 1, so swapping two of them would show
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(torch.randn_like(p) * 0.2)
    return model


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """name -> (HF directory saved in 100 KB shards, the HF model, its megajax conversion), each built once."""
    return hf_conversions(tmp_path_factory, hf_model, lambda name: ["--make_vocab_size_divisible_by=128"])


@pytest.mark.parametrize("name", sorted(MODELS))
def test_hf_round_trip_is_exact(name, converted, tmp_path):
    src, model, mj = converted(name)
    convert_main(["megajax-to-hf", f"--checkpoint={mj}", f"--output={tmp_path / 'back'}"])
    original, back = hf_io.read_weights(src), hf_io.read_weights(tmp_path / "back")
    assert set(back) == set(original)
    experts = 3 * model.config.num_local_experts  # per expert, as published, in each routed layer
    assert sum(".experts." in k for k in back) == len(routed_layers(model.config)) * experts
    assert sum(".mlp.gate_proj." in k for k in back) == model.config.num_hidden_layers - len(routed_layers(
        model.config))  # the dense layers' SwiGLU
    for k, v in original.items():
        np.testing.assert_array_equal(back[k], v, err_msg=k)
    cls, _ = MODELS[name]
    loaded, info = cls.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    want, got = (type(model.config).from_pretrained(d).to_dict() for d in (src, tmp_path / "back"))
    for key in ("num_local_experts", "num_experts_per_tok", "norm_topk_prob", "intermediate_size",
                "moe_intermediate_size", "num_key_value_heads", "rope_parameters", "rms_norm_eps",
                "decoder_sparse_step", "mlp_only_layers"):
        assert got.get(key) == want.get(key), key
    head_dim = want.get("head_dim") or want["hidden_size"] // want["num_attention_heads"]  # Mixtral's: None
    assert got["head_dim"] == head_dim


@pytest.mark.parametrize("name", sorted(MODELS))
def test_converted_config(name, converted):
    _, model, mj = converted(name)
    m = model_config(inference_config(mj, data=1, model=1))
    c = model.config
    qwen = name.startswith("qwen3")
    assert (m.num_experts, m.experts_per_token, m.head_dim) == (c.num_local_experts, c.num_experts_per_tok,
                                                                16 if qwen else 8)
    assert m.norm_topk_prob == (name == "mixtral") and m.qk_norm == qwen
    assert m.expert_ffn_size == (48 if qwen else 96)
    assert list(m.routed_layers) == routed_layers(c) == ([1] if name == "qwen3_dense" else [0, 1])


def megajax_logits(loaded: megajax.LoadedModel, tokens: np.ndarray) -> np.ndarray:
    graphdef, state = nnx.split(loaded.model)
    with activate(loaded.mesh, ParallelContext(loaded.spec.rules)):
        return np.asarray(jax.jit(lambda s, t: nnx.merge(graphdef, s)(t))(state, jnp.asarray(tokens)))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_converted_logits_match_transformers(name, converted):
    _, model, mj = converted(name)
    vocab = model.config.vocab_size
    tokens = np.random.default_rng(0).integers(0, vocab, (8, SEQ))  # rows split over up to 8 data x expert
    with torch.no_grad():
        want = model(torch.from_numpy(tokens)).logits.numpy()
    assert np.abs(want).max() > 1.0  # logits far from 0, so the tolerance below is a tight one
    diffs = {}
    for data, model_axis, expert in MESHES:
        loaded = megajax.load_model(mj, data=data, model=model_axis, expert=expert)
        got = megajax_logits(loaded, tokens)
        diffs[f"{data}x{model_axis},expert={expert}"] = float(np.abs(got[..., :vocab] - want).max())
    print(f"\n{name} logits max |megajax - transformers|: {diffs}")
    assert max(diffs.values()) < LOGIT_ATOL, diffs


@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_generation_matches_transformers(name, converted):
    _, model, mj = converted(name)
    prompt = np.random.default_rng(1).integers(0, model.config.vocab_size, (2, 10))
    assert_greedy_matches_hf(model, mj, prompt, [dict(data=1, model=1, expert=1), dict(data=1, model=1, expert=2)])


def test_bf16_checkpoint_converts(tmp_path):
    model = hf_model("mixtral").to(torch.bfloat16)
    model.save_pretrained(tmp_path / "hf")
    convert_main(["hf-to-megajax", f"--hf={tmp_path / 'hf'}", f"--output={tmp_path / 'mj'}",
                  "--make_vocab_size_divisible_by=128"])
    convert_main(["megajax-to-hf", f"--checkpoint={tmp_path / 'mj'}", f"--output={tmp_path / 'back'}"])
    original, back = hf_io.read_weights(tmp_path / "hf"), hf_io.read_weights(tmp_path / "back")
    assert set(back) == set(original)
    for k, v in original.items():
        assert str(v.dtype) == "bfloat16", k
        np.testing.assert_array_equal(back[k], np.asarray(v, np.float32), err_msg=k)  # widened exactly


@pytest.mark.parametrize("change,match", [
    ({"sliding_window": 16}, "sliding_window=16"),
    ({"router_jitter_noise": 0.1}, "router_jitter_noise"),
    ({"model_type": "qwen3_moe", "mlp_only_layers": [0, 1], "moe_intermediate_size": 48}, "no routed layer"),
    ({"model_type": "qwen3_moe", "mlp_only_layers": [2], "moe_intermediate_size": 48}, "numbered 0 to 1"),
    ({"model_type": "qwen2_moe"}, "model_type"),
    ({"num_local_experts": None}, "num_local_experts"),
])
def test_unsupported_configs_are_refused(change, match):
    hf = {"model_type": "mixtral", "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
          "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "num_local_experts": 4,
          "num_experts_per_tok": 2, "max_position_embeddings": 64, **change}
    with pytest.raises(ValueError, match=match):
        hf_moe.config_from_hf({k: v for k, v in hf.items() if v is not None})
