"""Hugging Face ``DeepseekV3ForCausalLM`` (DeepSeek-V3, Moonlight, Kimi K2's layout) <-> megajax DeepSeek decoders.

Tensors are read from and written in the published per-expert layout (what ``save_pretrained`` writes): a routed
layer's ``mlp.experts.E.gate_proj`` / ``up_proj`` / ``down_proj``, ``mlp.gate.weight`` (the router) and
``mlp.gate.e_score_correction_bias``, ``mlp.shared_experts.*``; the first ``first_k_dense_replace`` layers'
``mlp.gate_proj`` / ``up_proj`` / ``down_proj``. Latent attention's ``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``
(or ``q_proj``), ``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj`` and ``o_proj`` become megajax's
``x @ kernel`` projections with the heads split out. Where ``rope_interleave`` (DeepSeek's published layout: a head's
rotary dimensions in pairs (x0, x1), (x2, x3), ...) the rotary rows of ``q_b_proj`` and ``kv_a_proj_with_mqa`` are
permuted to megajax's rotate-half layout (evens, then odds: the same scores), and written back interleaved, so a
published checkpoint converts back to its own tensors. ``rope_interleave`` false (transformers' other layout) is
refused.

Not modelled, refused in one line: FP8 block-quantised weights (``quantization_config``: cast them to bf16 first),
another scoring or top-k method than DeepSeek-V3's (sigmoid, ``noaux_tc``), attention biases, a rope scaling other
than YaRN.

Multi-token prediction: the first ``num_nextn_predict_layers`` layers past ``num_hidden_layers`` (DeepSeek-V3's
layer 61) become the model's MTP depths (``mtp_depth``): each a routed layer's tensors and ``enorm``, ``hnorm``,
``eh_proj`` and ``shared_head.norm``; its copies of the embedding and output layer (``embed_tokens``,
``shared_head.head``) must equal the model's (megajax shares them) and are written back as copies. Layers past those
are dropped with a note (set ``num_nextn_predict_layers`` to 0 in config.json to convert without MTP). Where the
weights hold fewer MTP layers than config.json names (transformers' ``save_pretrained`` leaves them out, and its
config defaults to one), the model has as many as they hold, said in a note (``as_held``).
"""

from __future__ import annotations

import re
import sys

import jax
import ml_collections
import numpy as np

from megajax.config import base_config, model_config
from megajax.convert.config_json import number
from megajax.convert.hf_llama import DecoderTensors, Params, decoder_from_hf, decoder_to_hf
from megajax.models import deepseek
from megajax.models.moe import DENSE_STACK
from megajax.models.transformer import STACK

HF_CLASSES = {"deepseek_v3": "DeepseekV3ForCausalLM"}
YARN_KEYS = {"factor": "rope_factor", "original_max_position_embeddings": "rope_original_max_len",
             "beta_fast": "yarn_beta_fast", "beta_slow": "yarn_beta_slow", "mscale": "yarn_mscale",
             "mscale_all_dim": "yarn_mscale_all_dim"}
LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _refuse(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _rope(hf: dict) -> dict:
    """The rotary fields: rope_theta, and YaRN's from ``rope_scaling`` (v4) or ``rope_parameters`` (v5)."""
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    _refuse(isinstance(rope, dict), f"config.json rope settings {rope!r}: give a dict or null")
    kind = rope.get("rope_type", rope.get("type", "default"))
    _refuse(kind in ("default", "yarn"), f"config.json rope_type={kind!r}: megajax's DeepSeek takes plain rotary "
                                         "embeddings or yarn")
    real = dict(whole=False, minimum=None)
    fields = {"rope_theta": float(number(rope, "rope_theta", default=number(hf, "rope_theta", default=10000.0,
                                                                           **real), **real)),
              "rope_scaling": "yarn" if kind == "yarn" else "none"}
    if kind == "yarn":
        defaults = {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}
        for key, field in YARN_KEYS.items():
            whole = key == "original_max_position_embeddings"
            value = number(rope, key, default=defaults.get(key), null=defaults.get(key), whole=whole,
                           minimum=None if not whole else 1)
            _refuse(value is not None, f"config.json rope_scaling (yarn) has no {key}")
            fields[field] = value if whole else float(value)
    return fields


def config_from_hf(hf: dict, make_vocab_size_divisible_by: int = 1) -> ml_collections.ConfigDict:
    """A megajax ``model.name=deepseek`` config for a DeepSeek-V3-layout ``config.json``; ValueError on what megajax
    does not model (module docstring) or what the family refuses (``DeepSeekConfig``'s checks)."""
    kind = hf.get("model_type")
    _refuse(kind in HF_CLASSES, f"config.json model_type={kind!r}: hf_deepseek converts deepseek_v3 "
                                f"({HF_CLASSES['deepseek_v3']})")
    _refuse(not hf.get("quantization_config"), "config.json has a quantization_config (DeepSeek's published FP8 "
                                               "block-quantised weights): cast them to bf16 first (DeepSeek's "
                                               "fp8_cast_bf16.py), then convert")
    _refuse(hf.get("scoring_func", "sigmoid") == "sigmoid", f"config.json scoring_func={hf.get('scoring_func')!r}: "
                                                            "megajax's DeepSeek routes by sigmoid scores")
    _refuse(hf.get("topk_method", "noaux_tc") == "noaux_tc", f"config.json topk_method={hf.get('topk_method')!r}: "
                                                             "megajax's DeepSeek routes as noaux_tc (the corrected "
                                                             "scores' group-limited top-k)")
    _refuse(hf.get("rope_interleave", True) is True, f"config.json rope_interleave={hf.get('rope_interleave')!r}: "
                                                     "megajax reads DeepSeek's published interleaved rotary layout")
    _refuse(not hf.get("attention_bias"), "config.json attention_bias=true: megajax's latent attention has no biases")
    _refuse(hf.get("hidden_act", "silu") == "silu", f"config.json hidden_act={hf.get('hidden_act')!r}: megajax's "
                                                    "DeepSeek MLPs are SwiGLU (silu)")
    tied = hf.get("tie_word_embeddings", False)
    _refuse(isinstance(tied, bool), f"config.json tie_word_embeddings={tied!r} is not true or false")
    norm = hf.get("norm_topk_prob", True)
    _refuse(isinstance(norm, bool), f"config.json norm_topk_prob={norm!r} is not true or false")
    real = dict(whole=False, minimum=None)
    c = base_config(deepseek.NAME)
    c.model.update(
        vocab_size=number(hf, "vocab_size"), make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        num_layers=number(hf, "num_hidden_layers"), hidden_size=number(hf, "hidden_size"),
        num_heads=number(hf, "num_attention_heads"), num_kv_heads=0, ffn_hidden_size=number(hf, "intermediate_size"),
        max_seq_len=number(hf, "max_position_embeddings", default=4096), dropout=0.0,
        init_std=float(number(hf, "initializer_range", default=0.02, **real)),
        layernorm_eps=float(number(hf, "rms_norm_eps", default=1e-6, **real)), tie_embeddings=tied,
        num_experts=number(hf, "n_routed_experts"), experts_per_token=number(hf, "num_experts_per_tok"),
        moe_ffn_hidden_size=number(hf, "moe_intermediate_size"), norm_topk_prob=norm,
        q_lora_rank=number(hf, "q_lora_rank", default=0, null=0), kv_lora_rank=number(hf, "kv_lora_rank"),
        qk_nope_head_dim=number(hf, "qk_nope_head_dim"), qk_rope_head_dim=number(hf, "qk_rope_head_dim"),
        v_head_dim=number(hf, "v_head_dim"), n_shared_experts=number(hf, "n_shared_experts", default=0, null=0,
                                                                     minimum=0),
        routed_scaling_factor=float(number(hf, "routed_scaling_factor", default=1.0, **real)),
        n_group=number(hf, "n_group", default=1, null=1), topk_group=number(hf, "topk_group", default=1, null=1),
        first_k_dense_replace=number(hf, "first_k_dense_replace", default=0, null=0, minimum=0),
        mtp_depth=number(hf, "num_nextn_predict_layers", default=0, null=0, minimum=0), **_rope(hf))
    model_config(c)  # the family's own checks before any tensor is read
    return c


def hf_config(cfg: deepseek.DeepSeekConfig) -> dict:
    """The HF ``config.json`` of a megajax DeepSeek decoder (v4's ``rope_scaling`` spelling, which v4 and v5 read;
    ``rope_interleave`` true: the tensors are written in DeepSeek's published rotary layout)."""
    rope = None
    if cfg.rope_scaling == "yarn":
        rope = {"rope_type": "yarn", **{key: getattr(cfg, field) for key, field in YARN_KEYS.items()}}
    return {"architectures": [HF_CLASSES["deepseek_v3"]], "model_type": "deepseek_v3",
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_size,
            "moe_intermediate_size": cfg.expert_ffn_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_heads,
            "n_shared_experts": cfg.n_shared_experts, "n_routed_experts": cfg.num_experts,
            "routed_scaling_factor": cfg.routed_scaling_factor, "kv_lora_rank": cfg.kv_lora_rank,
            "q_lora_rank": cfg.q_lora_rank or None, "qk_rope_head_dim": cfg.qk_rope_head_dim,
            "v_head_dim": cfg.v_head_dim, "qk_nope_head_dim": cfg.qk_nope_head_dim, "n_group": cfg.n_group,
            "topk_group": cfg.topk_group, "num_experts_per_tok": cfg.experts_per_token,
            "first_k_dense_replace": cfg.first_k_dense_replace, "norm_topk_prob": cfg.norm_topk_prob,
            "scoring_func": "sigmoid", "topk_method": "noaux_tc", "hidden_act": "silu",
            "max_position_embeddings": cfg.max_seq_len, "initializer_range": cfg.init_std,
            "rms_norm_eps": cfg.layernorm_eps, "tie_word_embeddings": bool(cfg.tie_embeddings),
            "rope_theta": cfg.rope_theta, "rope_scaling": rope, "rope_interleave": True, "attention_bias": False,
            "attention_dropout": 0.0, "num_nextn_predict_layers": cfg.mtp_depth, "torch_dtype": "float32",
            "use_cache": True}


def _half_order(d: int) -> np.ndarray:
    """The rotary dimensions' order from interleaved pairs to rotate-half: evens, then odds."""
    return np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])


def _attention_from_hf(t: DecoderTensors, pre: str, cfg: deepseek.DeepSeekConfig) -> Params:
    h, n, r, rope = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    nope, qk, v = cfg.qk_nope_head_dim, cfg.head_dim, cfg.v_head_dim
    order = _half_order(rope)
    a = pre + "self_attn."

    def heads(w: np.ndarray, rows: int) -> np.ndarray:  # torch (n qk, in) -> (in, n, qk), rotary part reordered
        w = w.T.reshape(rows, n, qk)
        return np.concatenate([w[..., :nope], w[..., nope:][..., order]], -1)

    if cfg.q_lora_rank:
        q = {"q_down": {"kernel": t.take(a + "q_a_proj.weight", (cfg.q_lora_rank, h)).T},
             "q_norm": {"scale": t.take(a + "q_a_layernorm.weight", (cfg.q_lora_rank,))},
             "q": {"kernel": heads(t.take(a + "q_b_proj.weight", (n * qk, cfg.q_lora_rank)), cfg.q_lora_rank)}}
    else:
        q = {"q": {"kernel": heads(t.take(a + "q_proj.weight", (n * qk, h)), h)}}
    down = t.take(a + "kv_a_proj_with_mqa.weight", (r + rope, h)).T
    return {**q, "kv_down": {"kernel": np.concatenate([down[:, :r], down[:, r:][:, order]], -1)},
            "kv_norm": {"scale": t.take(a + "kv_a_layernorm.weight", (r,))},
            "kv_up": {"kernel": t.take(a + "kv_b_proj.weight", (n * (nope + v), r)).T.reshape(r, n, nope + v)},
            "out": {"kernel": t.take(a + "o_proj.weight", (h, n * v)).T.reshape(n, v, h)}}


def _attention_to_hf(attn: Params, pre: str, cfg: deepseek.DeepSeekConfig) -> dict[str, np.ndarray]:
    h, n, r, rope = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    nope, v = cfg.qk_nope_head_dim, cfg.v_head_dim
    back = np.argsort(_half_order(rope))  # rotate-half -> interleaved pairs
    a = pre + "self_attn."

    def heads(w: np.ndarray) -> np.ndarray:  # (in, n, qk) -> torch (n qk, in)
        w = np.concatenate([w[..., :nope], w[..., nope:][..., back]], -1)
        return w.reshape(w.shape[0], -1).T

    sd = {a + "q_b_proj.weight" if cfg.q_lora_rank else a + "q_proj.weight": heads(attn["q"]["kernel"])}
    if cfg.q_lora_rank:
        sd.update({a + "q_a_proj.weight": attn["q_down"]["kernel"].T,
                   a + "q_a_layernorm.weight": attn["q_norm"]["scale"]})
    down = attn["kv_down"]["kernel"]
    return {**sd, a + "kv_a_proj_with_mqa.weight": np.concatenate([down[:, :r], down[:, r:][:, back]], -1).T,
            a + "kv_a_layernorm.weight": attn["kv_norm"]["scale"],
            a + "kv_b_proj.weight": attn["kv_up"]["kernel"].reshape(r, n * (nope + v)).T,
            a + "o_proj.weight": attn["out"]["kernel"].reshape(n * v, h).T}


def _swiglu_from_hf(t: DecoderTensors, pre: str, h: int, f: int) -> Params:
    return {"gate": {"kernel": t.take(pre + "gate_proj.weight", (f, h)).T},
            "up": {"kernel": t.take(pre + "up_proj.weight", (f, h)).T},
            "down": {"kernel": t.take(pre + "down_proj.weight", (h, f)).T}}


def _swiglu_to_hf(mlp: Params, pre: str) -> dict[str, np.ndarray]:
    return {f"{pre}{name}_proj.weight": mlp[name]["kernel"].T for name in ("gate", "up", "down")}


def _layer_from_hf(t: DecoderTensors, i: int, cfg: deepseek.DeepSeekConfig) -> Params:
    h, f, e = cfg.hidden_size, cfg.expert_ffn_size, cfg.num_experts
    pre = f"model.layers.{i}."
    layer = {"ln_1": {"scale": t.take(pre + "input_layernorm.weight", (h,))},
             "ln_2": {"scale": t.take(pre + "post_attention_layernorm.weight", (h,))},
             "attn": _attention_from_hf(t, pre, cfg)}
    if i < cfg.first_k_dense_replace:
        return {**layer, "mlp": _swiglu_from_hf(t, pre + "mlp.", h, cfg.ffn_size)}

    def experts(name: str, shape: tuple[int, int]) -> np.ndarray:  # E x torch (out, in) -> (E, in, out)
        return np.stack([t.take(f"{pre}mlp.experts.{x}.{name}_proj.weight", shape).T for x in range(e)])

    mlp = {"router": t.take(pre + "mlp.gate.weight", (e, h)).T,
           "correction_bias": t.take(pre + "mlp.gate.e_score_correction_bias", (e,)),
           "gate": experts("gate", (f, h)), "up": experts("up", (f, h)), "down": experts("down", (h, f))}
    if cfg.n_shared_experts:
        mlp["shared"] = _swiglu_from_hf(t, pre + "mlp.shared_experts.", h, cfg.shared_ffn_size)
    return {**layer, "mlp": mlp}


def _layer_to_hf(b: Params, i: int, cfg: deepseek.DeepSeekConfig) -> dict[str, np.ndarray]:
    pre = f"model.layers.{i}."
    sd = {pre + "input_layernorm.weight": b["ln_1"]["scale"],
          pre + "post_attention_layernorm.weight": b["ln_2"]["scale"], **_attention_to_hf(b["attn"], pre, cfg)}
    mlp = b["mlp"]
    if i < cfg.first_k_dense_replace:
        return {**sd, **_swiglu_to_hf(mlp, pre + "mlp.")}
    sd.update({pre + "mlp.gate.weight": mlp["router"].T,
               pre + "mlp.gate.e_score_correction_bias": mlp["correction_bias"]})
    for name in ("gate", "up", "down"):
        sd.update({f"{pre}mlp.experts.{x}.{name}_proj.weight": w.T for x, w in enumerate(mlp[name])})
    if cfg.n_shared_experts:
        sd.update(_swiglu_to_hf(mlp["shared"], pre + "mlp.shared_experts."))
    return sd


def _stack_of(cfg: deepseek.DeepSeekConfig):
    return lambda i: DENSE_STACK if i < cfg.first_k_dense_replace else STACK


MTP_SHARED = {"embed_tokens": "model.embed_tokens.weight", "shared_head.head": "lm_head.weight"}  # megajax's shared


def _mtp_from_hf(t: DecoderTensors, cfg: deepseek.DeepSeekConfig) -> Params:
    """The multi-token prediction depths' parameters (stacked) from layers num_layers .. + mtp_depth."""
    h, depths = cfg.hidden_size, []
    for i in range(cfg.num_layers, cfg.num_layers + cfg.mtp_depth):
        pre = f"model.layers.{i}."
        for name, source in MTP_SHARED.items():
            source = "model.embed_tokens.weight" if cfg.tie_embeddings else source
            copy = t.take(f"{pre}{name}.weight", (cfg.vocab_size, h))
            _refuse(source in t.sd, f"the HF weights have no {source}: give a {HF_CLASSES['deepseek_v3']} directory "
                                    "whose config.json matches its weights")
            _refuse(np.array_equal(copy, t.sd[source]), f"the HF weights hold a {pre}{name}.weight that differs from "
                                                        f"{source}: megajax's multi-token prediction shares the "
                                                        "model's embedding and output layer")
        depths.append({**_layer_from_hf(t, i, cfg),
                       "enorm": {"scale": t.take(pre + "enorm.weight", (h,))},
                       "hnorm": {"scale": t.take(pre + "hnorm.weight", (h,))},
                       "proj": {"kernel": t.take(pre + "eh_proj.weight", (h, 2 * h)).T},
                       "norm": {"scale": t.take(pre + "shared_head.norm.weight", (h,))}})
    return jax.tree.map(lambda *xs: np.stack(xs), *depths)


def _layer_indices(sd: dict[str, np.ndarray]) -> dict[str, int]:
    """Each layer tensor's layer index."""
    return {k: int(m.group(1)) for k in sd if (m := LAYER.match(k if k.startswith("model.") else f"model.{k}"))}


def as_held(hf: dict, sd: dict[str, np.ndarray]) -> dict:
    """``hf`` (config.json) with ``num_nextn_predict_layers`` lowered to the multi-token prediction layers the
    weights ``sd`` hold (consecutive from ``num_hidden_layers``), with a note where that is fewer than it names."""
    named = number(hf, "num_nextn_predict_layers", default=0, null=0, minimum=0)
    layers, first = set(_layer_indices(sd).values()), number(hf, "num_hidden_layers")
    held = next(d for d in range(named + 1) if d == named or first + d not in layers)
    if held == named:
        return hf
    print(f"note: config.json says num_nextn_predict_layers={named}, but the weights hold {held or 'no'} multi-token "
          f"prediction layer{'s' * (held != 1)} (transformers' save_pretrained leaves them out): converted with "
          f"model.mtp_depth={held}", file=sys.stderr)
    return {**hf, "num_nextn_predict_layers": held}


def params_from_hf(sd: dict[str, np.ndarray], cfg: deepseek.DeepSeekConfig) -> Params:
    """The DeepSeek ``cfg``'s parameters from an HF DeepseekV3ForCausalLM state dict (fp32; the rotary rows
    interleaved, as published), its multi-token prediction layers among them (``cfg.mtp_depth``); the layers past
    those are dropped, with a note on stderr."""
    layer_of = _layer_indices(sd)
    kept = cfg.num_layers + cfg.mtp_depth
    present = sorted({i for i in layer_of.values() if i >= cfg.num_layers})
    missing = [i for i in range(cfg.num_layers, kept) if i not in present]
    _refuse(not missing, f"model.mtp_depth={cfg.mtp_depth}, but the weights hold no tensor of layer "
                         f"{missing[0] if missing else 0} (as_held: the depths the weights hold)")
    dropped = {k for k, i in layer_of.items() if i >= kept}
    if dropped:
        layers = sorted({layer_of[k] for k in dropped})
        print(f"note: dropped the checkpoint's multi-token prediction layer{'s' * (len(layers) > 1)} "
              f"{', '.join(map(str, layers))} ({len(dropped)} tensors): config.json's num_nextn_predict_layers="
              f"{cfg.mtp_depth} keeps {'none' if not cfg.mtp_depth else f'the first {cfg.mtp_depth}'}",
              file=sys.stderr)
        sd = {k: v for k, v in sd.items() if k not in dropped}
    t = DecoderTensors(sd, cfg, HF_CLASSES["deepseek_v3"])
    mtp = {"mtp": _mtp_from_hf(t, cfg)} if cfg.mtp_depth else {}
    return {**decoder_from_hf(t, cfg, _layer_from_hf, _stack_of(cfg)), **mtp}


def params_to_hf(p: Params, cfg: deepseek.DeepSeekConfig) -> dict[str, np.ndarray]:
    """An HF DeepseekV3ForCausalLM state dict of ``cfg``'s parameters (per expert, the rotary rows interleaved, as
    published), the multi-token prediction depths as the layers after the model's, as DeepSeek publishes them."""
    sd = decoder_to_hf(p, cfg, _layer_to_hf, _stack_of(cfg))
    for d in range(cfg.mtp_depth):
        i, depth = cfg.num_layers + d, jax.tree.map(lambda x: x[d], p["mtp"])
        pre = f"model.layers.{i}."
        sd.update(_layer_to_hf(depth, i, cfg))
        sd.update({pre + "enorm.weight": depth["enorm"]["scale"], pre + "hnorm.weight": depth["hnorm"]["scale"],
                   pre + "eh_proj.weight": depth["proj"]["kernel"].T,
                   pre + "shared_head.norm.weight": depth["norm"]["scale"]})
        for name, source in MTP_SHARED.items():
            sd[f"{pre}{name}.weight"] = sd["model.embed_tokens.weight" if cfg.tie_embeddings else source]
    return {k: np.ascontiguousarray(v, np.float32) for k, v in sd.items()}
