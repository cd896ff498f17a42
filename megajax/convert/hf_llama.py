"""Hugging Face ``LlamaForCausalLM`` <-> megajax Llama.

HF's Linear layers store (out, in) weights; megajax keeps every projection as ``x @ kernel`` with its heads split
out: q (H, heads, head_dim), the key and value projections fused as (H, kv_heads, 2, head_dim) so a model shard
holds whole key/value heads with both halves, attention-out (heads, head_dim, H). megajax's rotary embedding uses
HF's rotate-half pairing, so the q/k rows are taken as they are (no interleaving permutation, unlike Meta's
original checkpoints). The vocabulary is padded with zero rows only when ``make_vocab_size_divisible_by`` asks.

config.json is read in both of transformers' spellings of the rotary settings: v4's top-level ``rope_theta`` with
``rope_scaling`` ({"rope_type" or "type": "llama3", ...}) and v5's ``rope_parameters`` (which holds rope_theta).
``hf_config`` writes v4's spelling, which v4 and v5 both read.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import jax
import ml_collections
import numpy as np

from megajax.config import base_config
from megajax.convert.config_json import number
from megajax.convert.hf_tensors import HFTensors
from megajax.models import llama
from megajax.models.transformer import STACK

Params = dict
HF_CLASSES = {"llama": "LlamaForCausalLM"}  # config.json model_type -> the transformers class the weights fit

# LlamaConfig's defaults for the fields a config.json may leave out (transformers fills them in the same way).
HF_DEFAULTS = {"hidden_act": "silu", "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
               "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False}
REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
ROPE_TYPES = {"default": "none", "llama3": "llama3"}  # HF rope_type -> megajax model.rope_scaling
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor")
# Non-parameter tensors older transformers versions saved with the weights (the rotary table is recomputed).
BUFFER = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")


def _refuse(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _rope(hf: dict) -> dict:
    """The megajax rope fields of a config.json, from either transformers spelling; ValueError on other kinds."""
    # v5 reads rope_scaling first when both are present; do the same.
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    _refuse(isinstance(rope, dict) and not any(isinstance(v, dict) for v in rope.values()),
            f"config.json rope settings {rope!r}: megajax's Llama has one rotary embedding for every layer")
    kind = rope.get("rope_type", rope.get("type", "default"))
    _refuse(kind in ROPE_TYPES, f"config.json rope_type={kind!r}: megajax's Llama supports rope_scaling null "
                                f"(plain rotary embeddings) or rope_type 'llama3' (Llama 3.1's frequency scaling); "
                                f"not linear, dynamic, yarn or longrope")
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    _refuse(partial == 1.0, f"config.json partial_rotary_factor={partial}: megajax rotates the whole head")
    real = dict(whole=False, minimum=None)
    theta = number(rope, "rope_theta", default=number(hf, "rope_theta", **real), **real)
    fields = {"rope_theta": float(theta), "rope_scaling": ROPE_TYPES[kind]}
    if kind == "llama3":
        missing = [k for k in LLAMA3_KEYS if k not in rope]
        _refuse(not missing, f"config.json rope_scaling (llama3) has no {', '.join(missing)}")
        factor, low, high = (float(number(rope, k, **real)) for k in LLAMA3_KEYS)
        _refuse(factor > 0 and high > low > 0, f"config.json llama3 rope scaling factor={factor}, low_freq_factor="
                                               f"{low}, high_freq_factor={high}: needs factor > 0 and "
                                               "high_freq_factor > low_freq_factor > 0")
        # transformers falls back to max_position_embeddings where original_max_position_embeddings is absent
        key = "original_max_position_embeddings"
        original = number(rope, key, default=number(hf, key, default=hf["max_position_embeddings"]))
        fields.update(rope_factor=factor, rope_low_freq_factor=low, rope_high_freq_factor=high,
                      rope_original_max_len=original)
    return fields


def config_from_hf(hf: dict, make_vocab_size_divisible_by: int = 1) -> ml_collections.ConfigDict:
    """A megajax Llama config for an HF Llama ``config.json``; ValueError on variants megajax does not implement.

    ``make_vocab_size_divisible_by`` defaults to 1: the embedding keeps exactly the checkpoint's rows (Llama's
    vocabularies, 32000 and 128256, already split evenly over 8 model shards).
    """
    _refuse(hf.get("model_type") == "llama", f"config.json model_type={hf.get('model_type')!r}: hf_llama converts "
                                             f"llama ({HF_CLASSES['llama']})")
    c = base_config(llama.NAME)
    c.model.update(decoder_fields(hf, make_vocab_size_divisible_by))
    return c


def decoder_fields(hf: dict, make_vocab_size_divisible_by: int, head_dim_free: bool = False) -> dict:
    """The ``config.model`` fields of a Llama-trunk ``config.json`` (sizes, key/value heads, norms, rotary
    positions, tying), its variants megajax does not implement refused (ValueError). ``head_dim_free``: the family
    has a head size of its own (``kv_channels``) rather than hidden_size / num_attention_heads."""
    sizes = {k: number(hf, k) for k in REQUIRED}
    h, heads = sizes["hidden_size"], sizes["num_attention_heads"]
    kv_heads = number(hf, "num_key_value_heads", default=heads, null=heads)  # transformers: null is the heads'
    head_dim = number(hf, "head_dim", default=h // heads, null=h // heads)
    max_len = number(hf, "max_position_embeddings", default=HF_DEFAULTS["max_position_embeddings"])
    hf = {**HF_DEFAULTS, **{k: v for k, v in hf.items() if v is not None or k not in HF_DEFAULTS},
          "max_position_embeddings": max_len}
    _refuse(hf["hidden_act"] == "silu", f"config.json hidden_act={hf['hidden_act']!r}: megajax's Llama MLP is "
                                        "SwiGLU (silu)")
    for flag in ("attention_bias", "mlp_bias"):
        _refuse(not hf[flag], f"config.json {flag}={hf[flag]!r}: megajax's Llama has no biases")
    _refuse(h % heads == 0, f"config.json hidden_size={h} is not a multiple of num_attention_heads={heads}")
    _refuse(head_dim_free or head_dim == h // heads, f"config.json head_dim={head_dim}: megajax's Llama heads are "
                                                     f"hidden_size / num_attention_heads = {h // heads} wide")
    _refuse(heads % kv_heads == 0, f"config.json num_key_value_heads={kv_heads} does not divide "
                                   f"num_attention_heads={heads}")
    tied = hf["tie_word_embeddings"]
    _refuse(isinstance(tied, bool), f"config.json tie_word_embeddings={tied!r} is not true or false")
    return dict(
        vocab_size=sizes["vocab_size"], make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        num_layers=sizes["num_hidden_layers"], hidden_size=h, num_heads=heads,
        num_kv_heads=kv_heads, ffn_hidden_size=sizes["intermediate_size"], max_seq_len=max_len,
        dropout=0.0, init_std=hf.get("initializer_range") or 0.02, layernorm_eps=float(hf["rms_norm_eps"]),
        tie_embeddings=tied, **_rope(hf), **({"kv_channels": head_dim} if head_dim_free else {}))


def hf_config(cfg: llama.LlamaConfig) -> dict:
    """The HF ``config.json`` for a megajax Llama (true vocabulary size; the padding rows are dropped)."""
    return {"architectures": [HF_CLASSES["llama"]], "model_type": "llama", **decoder_config(cfg)}


def decoder_config(cfg: llama.LlamaConfig) -> dict:
    """The ``config.json`` fields of a Llama-trunk model (``decoder_fields`` read back)."""
    rope_scaling = None
    if cfg.rope_scaling == "llama3":
        rope_scaling = {"rope_type": "llama3", "factor": cfg.rope_factor, "low_freq_factor": cfg.rope_low_freq_factor,
                        "high_freq_factor": cfg.rope_high_freq_factor,
                        "original_max_position_embeddings": cfg.rope_original_max_len}
    return {"vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads, "head_dim": cfg.head_dim,
            "hidden_act": "silu", "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.layernorm_eps,
            "rope_theta": cfg.rope_theta, "rope_scaling": rope_scaling,
            "tie_word_embeddings": bool(cfg.tie_embeddings),
            # HF's Llama drops out only attention probabilities, megajax the residual branches: nothing to carry
            "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
            "initializer_range": cfg.init_std, "torch_dtype": "float32", "use_cache": True}


class DecoderTensors(HFTensors):
    """The HF state dict of a Llama-trunk model (``classes``: its transformers class); a bare model's tensors lack
    the "model." prefix (the head never has one)."""

    def __init__(self, sd: dict[str, np.ndarray], cfg: llama.LlamaConfig, classes: str = HF_CLASSES["llama"]):
        super().__init__({k if k.startswith(("model.", "lm_head.")) else f"model.{k}": v for k, v in sd.items()},
                         f"vocab_size={cfg.vocab_size}, hidden_size={cfg.hidden_size}, intermediate_size="
                         f"{cfg.ffn_size}, num_attention_heads={cfg.num_heads}, num_key_value_heads={cfg.kv_heads}",
                         classes)

    def check_rest(self, tied: bool) -> None:
        """Everything not taken must be a buffer or, tied, an lm_head equal to the embedding."""
        copies = {"lm_head.weight": "model.embed_tokens.weight"} if tied else {}
        rest = {k for k in self.rest(copies, "config.json says tie_word_embeddings=true")
                if not BUFFER.fullmatch(k)}
        _refuse(not rest, f"the HF weights hold tensors megajax's model has no place for: {sorted(rest)[:4]} "
                          "(layers past num_hidden_layers, biases, or another model's heads)")


def _pad_rows(a: np.ndarray, rows: int) -> np.ndarray:
    """Zero rows appended up to the padded vocabulary (never predicted: those logits are masked)."""
    return np.concatenate([a, np.zeros((rows - a.shape[0], *a.shape[1:]), a.dtype)])


def attention_from_hf(t: DecoderTensors, pre: str, cfg: llama.LlamaConfig) -> Params:
    """A layer's attention parameters (q, the fused key/value, out) from its HF tensors (names from ``pre``)."""
    h, n, kv, d = cfg.hidden_size, cfg.num_heads, cfg.kv_heads, cfg.head_dim

    def proj(name: str, n_out: int) -> np.ndarray:  # torch (out, in) -> x @ kernel (in, out)
        return t.take(f"{pre}{name}.weight", (n_out, h)).T

    k, v = (proj(f"self_attn.{x}_proj", kv * d).reshape(h, kv, d) for x in "kv")
    return {"q": {"kernel": proj("self_attn.q_proj", n * d).reshape(h, n, d)},
            "kv": {"kernel": np.stack([k, v], axis=2)},
            "out": {"kernel": t.take(pre + "self_attn.o_proj.weight", (h, n * d)).T.reshape(n, d, h)}}


def attention_to_hf(attn: Params, pre: str, cfg: llama.LlamaConfig) -> dict[str, np.ndarray]:
    """``attention_from_hf`` reversed."""
    h, n, kv, d = cfg.hidden_size, cfg.num_heads, cfg.kv_heads, cfg.head_dim
    kv_kernel = attn["kv"]["kernel"]  # (h, kv, 2, d)
    return {pre + "self_attn.q_proj.weight": attn["q"]["kernel"].reshape(h, n * d).T,
            pre + "self_attn.k_proj.weight": kv_kernel[:, :, 0].reshape(h, kv * d).T,
            pre + "self_attn.v_proj.weight": kv_kernel[:, :, 1].reshape(h, kv * d).T,
            pre + "self_attn.o_proj.weight": attn["out"]["kernel"].reshape(n * d, h).T}


def layer_from_hf(t: DecoderTensors, i: int, cfg: llama.LlamaConfig) -> Params:
    """Llama layer ``i``'s parameters: norms, attention, SwiGLU (``cfg.ffn_size``)."""
    h, f = cfg.hidden_size, cfg.ffn_size
    pre = f"model.layers.{i}."
    return {
        "ln_1": {"scale": t.take(pre + "input_layernorm.weight", (h,))},
        "ln_2": {"scale": t.take(pre + "post_attention_layernorm.weight", (h,))},
        "attn": attention_from_hf(t, pre, cfg),
        "mlp": {"gate": {"kernel": t.take(pre + "mlp.gate_proj.weight", (f, h)).T},
                "up": {"kernel": t.take(pre + "mlp.up_proj.weight", (f, h)).T},
                "down": {"kernel": t.take(pre + "mlp.down_proj.weight", (h, f)).T}},
    }


def layer_to_hf(b: Params, i: int, cfg: llama.LlamaConfig) -> dict[str, np.ndarray]:
    """``layer_from_hf`` reversed."""
    pre = f"model.layers.{i}."
    return {pre + "input_layernorm.weight": b["ln_1"]["scale"],
            pre + "post_attention_layernorm.weight": b["ln_2"]["scale"],
            **attention_to_hf(b["attn"], pre, cfg),
            pre + "mlp.gate_proj.weight": b["mlp"]["gate"]["kernel"].T,
            pre + "mlp.up_proj.weight": b["mlp"]["up"]["kernel"].T,
            pre + "mlp.down_proj.weight": b["mlp"]["down"]["kernel"].T}


def params_from_hf(sd: dict[str, np.ndarray], cfg: llama.LlamaConfig) -> Params:
    """The Llama ``cfg``'s parameters from an HF LlamaForCausalLM state dict (fp32, whatever the checkpoint's
    dtype)."""
    return decoder_from_hf(DecoderTensors(sd, cfg), cfg, layer_from_hf)


def decoder_from_hf(t: DecoderTensors, cfg: llama.LlamaConfig,
                    layer: Callable[[DecoderTensors, int, llama.LlamaConfig], Params],
                    stack_of: Callable[[int], str] = lambda i: STACK) -> Params:
    """A Llama-trunk model's parameters: the embedding, ``layer(t, i, cfg)`` of each layer stacked (in order, on the
    stack ``stack_of(i)`` names: one for most models), the final norm and the untied head; every tensor of ``t``
    accounted for."""
    h, vocab, rows = cfg.hidden_size, cfg.vocab_size, cfg.padded_vocab_size
    stacks: dict[str, list[Params]] = {}
    for i in range(cfg.num_layers):
        stacks.setdefault(stack_of(i), []).append(layer(t, i, cfg))
    params = {
        "wte": {"embedding": _pad_rows(t.take("model.embed_tokens.weight", (vocab, h)), rows)},
        **{name: jax.tree.map(lambda *xs: np.stack(xs), *layers) for name, layers in stacks.items()},
        "ln_f": {"scale": t.take("model.norm.weight", (h,))},
    }
    if not cfg.tie_embeddings:
        params["lm_head"] = {"embedding": _pad_rows(t.take("lm_head.weight", (vocab, h)), rows)}
    t.check_rest(bool(cfg.tie_embeddings))
    return params


def params_to_hf(p: Params, cfg: llama.LlamaConfig) -> dict[str, np.ndarray]:
    """An HF LlamaForCausalLM state dict of the Llama ``cfg``'s parameters (a tied ``lm_head`` omitted, as
    ``save_pretrained`` does)."""
    return decoder_to_hf(p, cfg, layer_to_hf)


def decoder_to_hf(p: Params, cfg: llama.LlamaConfig,
                  layer: Callable[[Params, int, llama.LlamaConfig], dict[str, np.ndarray]],
                  stack_of: Callable[[int], str] = lambda i: STACK) -> dict[str, np.ndarray]:
    """``decoder_from_hf`` reversed, each layer's tensors from ``layer(block, i, cfg)``; fp32."""
    vocab = cfg.vocab_size
    sd = {"model.embed_tokens.weight": p["wte"]["embedding"][:vocab], "model.norm.weight": p["ln_f"]["scale"]}
    if not cfg.tie_embeddings:
        sd["lm_head.weight"] = p["lm_head"]["embedding"][:vocab]
    taken: dict[str, int] = {}
    for i in range(cfg.num_layers):
        name = stack_of(i)
        j = taken[name] = taken.get(name, -1) + 1  # its place in its stack
        sd.update(layer(jax.tree.map(lambda x: x[j], p[name]), i, cfg))
    return {k: np.ascontiguousarray(v, np.float32) for k, v in sd.items()}
