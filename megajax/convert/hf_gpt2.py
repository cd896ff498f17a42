"""Hugging Face ``GPT2LMHeadModel`` <-> megajax GPT.

HF's ``Conv1D`` stores weights as (in, out); its fused ``c_attn`` columns are [q | k | v], each split into heads.
megajax keeps QKV as (H, heads, 3, head_dim), so each model shard holds whole heads with their own q, k, v.
"""

from __future__ import annotations

import re

import ml_collections
import numpy as np

from megajax.config import base_config
from megajax.convert.config_json import number
from megajax.models.gpt import GPTConfig

Params = dict
HF_CLASSES = {"gpt2": "GPT2LMHeadModel"}  # config.json model_type -> the transformers class the weights fit


def config_from_hf(hf: dict, make_vocab_size_divisible_by: int = 1024) -> ml_collections.ConfigDict:
    """A megajax config for an HF GPT-2 ``config.json``; errors on variants megajax does not implement."""
    if hf.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
        raise ValueError(f"activation_function={hf['activation_function']!r}: megajax GPT uses tanh GeLU (gelu_new)")
    for flag, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                       ("reorder_and_upcast_attn", False), ("tie_word_embeddings", True)):
        if hf.get(flag, want) != want:
            raise ValueError(f"HF config {flag}={hf[flag]} is not supported (megajax computes {flag}={want})")
    h = number(hf, "n_embd")
    inner = number(hf, "n_inner", default=4 * h, null=4 * h)  # transformers: null is 4 x n_embd
    if inner % h:
        raise ValueError(f"n_inner={inner} is not a multiple of n_embd={h}")
    c = base_config()
    fraction = dict(whole=False, minimum=0)
    c.model.update(vocab_size=number(hf, "vocab_size"), make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                   num_layers=number(hf, "n_layer"), hidden_size=h, num_heads=number(hf, "n_head"),
                   max_seq_len=number(hf, "n_positions"), mlp_ratio=inner // h,
                   dropout=number(hf, "resid_pdrop", default=0.1, **fraction),
                   layernorm_eps=number(hf, "layer_norm_epsilon", default=1e-5, **fraction),
                   init_std=number(hf, "initializer_range", default=0.02, **fraction))
    return c


def hf_config(cfg: GPTConfig) -> dict:
    """The HF ``config.json`` for a megajax GPT (true vocabulary size; the padding rows are dropped)."""
    return {"architectures": [HF_CLASSES["gpt2"]], "model_type": "gpt2", "vocab_size": cfg.vocab_size,
            "n_positions": cfg.max_seq_len, "n_embd": cfg.hidden_size, "n_layer": cfg.num_layers,
            "n_head": cfg.num_heads, "n_inner": cfg.mlp_ratio * cfg.hidden_size, "activation_function": "gelu_new",
            "resid_pdrop": cfg.dropout, "embd_pdrop": cfg.dropout, "attn_pdrop": cfg.dropout,
            "layer_norm_epsilon": cfg.layernorm_eps, "initializer_range": cfg.init_std, "tie_word_embeddings": True,
            "bos_token_id": cfg.vocab_size - 1, "eos_token_id": cfg.vocab_size - 1}


def _expected_shapes(cfg: GPTConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name (``h.{}.`` for every layer) -> the shape a config.json of these sizes implies."""
    h, f = cfg.hidden_size, cfg.mlp_ratio * cfg.hidden_size
    layer = {"ln_1.weight": (h,), "ln_1.bias": (h,), "ln_2.weight": (h,), "ln_2.bias": (h,),
             "attn.c_attn.weight": (h, 3 * h), "attn.c_attn.bias": (3 * h,), "attn.c_proj.weight": (h, h),
             "attn.c_proj.bias": (h,), "mlp.c_fc.weight": (h, f), "mlp.c_fc.bias": (f,), "mlp.c_proj.weight": (f, h),
             "mlp.c_proj.bias": (h,)}
    return {"wte.weight": (cfg.vocab_size, h), "wpe.weight": (cfg.max_seq_len, h), "ln_f.weight": (h,),
            "ln_f.bias": (h,), **{f"h.{{}}.{k}": v for k, v in layer.items()}}


def _check_layers_and_head(sd: dict[str, np.ndarray], num_layers: int) -> None:
    """No layer past config.json's n_layer, and no lm_head other than the tied word embedding."""
    extra = sorted({int(k.split(".")[1]) for k in sd if re.match(r"h\.\d+\.", k)} - set(range(num_layers)))
    if extra:
        raise ValueError(f"the HF weights hold layers {extra} but config.json says n_layer={num_layers}")
    head = sd.get("lm_head.weight")
    if head is not None and not np.array_equal(np.asarray(head), np.asarray(sd["wte.weight"])):
        raise ValueError("the HF weights hold an lm_head.weight that differs from wte.weight (untied output layer): "
                         "megajax's GPT ties them")


def params_from_hf(sd: dict[str, np.ndarray], cfg: GPTConfig) -> Params:
    """megajax parameters of the GPT ``cfg`` from an HF GPT-2 state dict (with or without the ``transformer.``
    prefix)."""
    sd = {k.removeprefix("transformer."): v for k, v in sd.items()}
    h, nh, L = cfg.hidden_size, cfg.num_heads, cfg.num_layers
    d = h // nh
    shapes = _expected_shapes(cfg)

    def get(name: str) -> np.ndarray:
        if name not in sd:
            raise KeyError(f"HF checkpoint has no tensor {name!r}")
        want = shapes[re.sub(r"^h\.\d+\.", "h.{}.", name)]
        if tuple(sd[name].shape) != want:
            raise ValueError(f"HF tensor {name} is {tuple(sd[name].shape)}, but config.json (vocab_size="
                             f"{cfg.vocab_size}, n_positions={cfg.max_seq_len}, n_embd={h}, n_inner="
                             f"{cfg.mlp_ratio * h}) implies {want}")
        return np.asarray(sd[name], np.float32)

    def stack(fmt: str, fn=lambda x: x) -> np.ndarray:
        return np.stack([fn(get(fmt.format(i))) for i in range(L)])

    wte = get("wte.weight")
    _check_layers_and_head(sd, L)
    padded = np.zeros((cfg.padded_vocab_size, h), np.float32)
    padded[:wte.shape[0]] = wte
    return {
        "wte": {"embedding": padded},
        "wpe": get("wpe.weight"),
        "ln_f": {"scale": get("ln_f.weight"), "bias": get("ln_f.bias")},
        "blocks": {
            "ln_1": {"scale": stack("h.{}.ln_1.weight"), "bias": stack("h.{}.ln_1.bias")},
            "ln_2": {"scale": stack("h.{}.ln_2.weight"), "bias": stack("h.{}.ln_2.bias")},
            "attn": {
                "qkv": {"kernel": stack("h.{}.attn.c_attn.weight",
                                        lambda w: w.reshape(h, 3, nh, d).transpose(0, 2, 1, 3)),
                        "bias": stack("h.{}.attn.c_attn.bias", lambda b: b.reshape(3, nh, d).transpose(1, 0, 2))},
                "out": {"kernel": stack("h.{}.attn.c_proj.weight", lambda w: w.reshape(nh, d, h)),
                        "bias": stack("h.{}.attn.c_proj.bias")},
            },
            "mlp": {"up": {"kernel": stack("h.{}.mlp.c_fc.weight"), "bias": stack("h.{}.mlp.c_fc.bias")},
                    "down": {"kernel": stack("h.{}.mlp.c_proj.weight"), "bias": stack("h.{}.mlp.c_proj.bias")}},
        },
    }


def params_to_hf(p: Params, cfg: GPTConfig) -> dict[str, np.ndarray]:
    """An HF GPT2LMHeadModel state dict of the GPT ``cfg``'s parameters (tied ``lm_head`` omitted, as
    ``save_pretrained`` does)."""
    h = cfg.hidden_size
    b = p["blocks"]
    sd = {"transformer.wte.weight": p["wte"]["embedding"][:cfg.vocab_size], "transformer.wpe.weight": p["wpe"],
          "transformer.ln_f.weight": p["ln_f"]["scale"], "transformer.ln_f.bias": p["ln_f"]["bias"]}
    for i in range(cfg.num_layers):
        pre = f"transformer.h.{i}."
        sd.update({
            pre + "ln_1.weight": b["ln_1"]["scale"][i], pre + "ln_1.bias": b["ln_1"]["bias"][i],
            pre + "ln_2.weight": b["ln_2"]["scale"][i], pre + "ln_2.bias": b["ln_2"]["bias"][i],
            pre + "attn.c_attn.weight": b["attn"]["qkv"]["kernel"][i].transpose(0, 2, 1, 3).reshape(h, 3 * h),
            pre + "attn.c_attn.bias": b["attn"]["qkv"]["bias"][i].transpose(1, 0, 2).reshape(3 * h),
            pre + "attn.c_proj.weight": b["attn"]["out"]["kernel"][i].reshape(h, h),
            pre + "attn.c_proj.bias": b["attn"]["out"]["bias"][i],
            pre + "mlp.c_fc.weight": b["mlp"]["up"]["kernel"][i], pre + "mlp.c_fc.bias": b["mlp"]["up"]["bias"][i],
            pre + "mlp.c_proj.weight": b["mlp"]["down"]["kernel"][i],
            pre + "mlp.c_proj.bias": b["mlp"]["down"]["bias"][i],
        })
    return {k: np.ascontiguousarray(v, np.float32) for k, v in sd.items()}
