"""The model is GPT-2: its logits equal a naive float64 numpy transcription of the architecture."""

import jax
import numpy as np
from flax import nnx


def _layer_norm(x, scale, bias, eps=1e-5):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * scale + bias


def _gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def numpy_gpt(p, tokens, vocab_size):
    """Pre-LN GPT-2 forward, one head and one layer at a time, in float64."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    b, s = tokens.shape
    x = p["wte"]["embedding"][tokens] + p["wpe"][:s]
    blocks = p["blocks"]
    n_layers, _, n_heads, _, d = blocks["attn"]["qkv"]["kernel"].shape
    for i in range(n_layers):
        lp = jax.tree.map(lambda a: a[i], blocks)
        h = _layer_norm(x, lp["ln_1"]["scale"], lp["ln_1"]["bias"])
        out = np.zeros_like(x)
        for n in range(n_heads):
            q, k, v = (h @ lp["attn"]["qkv"]["kernel"][:, n, j] + lp["attn"]["qkv"]["bias"][n, j] for j in range(3))
            att = q @ k.transpose(0, 2, 1) / np.sqrt(d)  # (B, S, S)
            att = np.where(np.tril(np.ones((s, s), bool)), att, -np.inf)
            att = np.exp(att - att.max(-1, keepdims=True))
            att /= att.sum(-1, keepdims=True)
            out += (att @ v) @ lp["attn"]["out"]["kernel"][n]
        x = x + out + lp["attn"]["out"]["bias"]
        h = _layer_norm(x, lp["ln_2"]["scale"], lp["ln_2"]["bias"])
        x = x + _gelu_tanh(h @ lp["mlp"]["up"]["kernel"] + lp["mlp"]["up"]["bias"]) @ lp["mlp"]["down"]["kernel"] \
            + lp["mlp"]["down"]["bias"]
    x = _layer_norm(x, p["ln_f"]["scale"], p["ln_f"]["bias"])
    return (x @ p["wte"]["embedding"].T)[..., :vocab_size]


def test_logits_match_float64_numpy(reference_model, batch):
    config, model = reference_model
    tokens = np.asarray(batch[0])
    ours = np.asarray(model(batch[0]))[..., :config.model.vocab_size]
    ref = numpy_gpt(nnx.to_pure_dict(nnx.state(model)), tokens, config.model.vocab_size)
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def test_init_statistics(reference_model):
    """N(0, 0.02) everywhere, N(0, 0.02/sqrt(2L)) for attention-out and MLP-down, zero biases, unit LN scales."""
    config, model = reference_model
    p = nnx.to_pure_dict(nnx.state(model))
    scaled = 0.02 / np.sqrt(2 * config.model.num_layers)
    for w, std in [(p["wte"]["embedding"], 0.02), (p["blocks"]["attn"]["qkv"]["kernel"], 0.02),
                   (p["blocks"]["mlp"]["up"]["kernel"], 0.02), (p["blocks"]["attn"]["out"]["kernel"], scaled),
                   (p["blocks"]["mlp"]["down"]["kernel"], scaled)]:
        assert abs(np.std(np.asarray(w)) / std - 1) < 0.05
    for b in [p["blocks"]["attn"]["qkv"]["bias"], p["blocks"]["mlp"]["down"]["bias"], p["ln_f"]["bias"]]:
        assert not np.asarray(b).any()
    np.testing.assert_array_equal(np.asarray(p["blocks"]["ln_1"]["scale"]), 1.0)
