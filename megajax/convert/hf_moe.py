"""Hugging Face ``MixtralForCausalLM`` and ``Qwen3MoeForCausalLM`` <-> megajax mixture-of-experts decoders.

The attention, norms, embeddings and head are Llama's (``hf_llama``); Qwen3 adds each head's query and key norm
(``self_attn.q_norm`` / ``k_norm``), and its dense layers (``decoder_sparse_step``, ``mlp_only_layers``) are Llama
layers with those norms, kept on a stack of their own (``moe.DENSE_STACK``). Each routed layer's experts are read
from and written in the published per-expert layout (what ``save_pretrained`` writes, transformers v4 and v5
alike): Mixtral's
``block_sparse_moe.experts.E.w1`` (gate), ``w3`` (up) and ``w2`` (down) with the router ``block_sparse_moe.gate``,
Qwen3-MoE's ``mlp.experts.E.gate_proj`` / ``up_proj`` / ``down_proj`` with ``mlp.gate``; megajax stacks them on a
leading experts axis as ``x @ kernel``: gate and up (E, H, F), down (E, F, H), the router (H, E).
"""

from __future__ import annotations

import ml_collections
import numpy as np

from megajax.config import base_config, model_config
from megajax.convert.config_json import number
from megajax.convert.hf_llama import (
    DecoderTensors,
    Params,
    attention_from_hf,
    attention_to_hf,
    decoder_config,
    decoder_fields,
    decoder_from_hf,
    decoder_to_hf,
    layer_from_hf,
    layer_to_hf,
)
from megajax.models import moe
from megajax.models.transformer import STACK

HF_CLASSES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
# model_type -> (the layer's MoE prefix, the experts' (gate, up, down) names)
LAYOUT = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
          "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"))}


def _refuse(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _model_type(cfg: moe.MoEConfig) -> str:
    """Qwen3-MoE where the model has Qwen3's query/key norms, else Mixtral."""
    return "qwen3_moe" if cfg.qk_norm else "mixtral"


def config_from_hf(hf: dict, make_vocab_size_divisible_by: int = 1) -> ml_collections.ConfigDict:
    """A megajax ``model.name=moe`` config for a Mixtral or Qwen3-MoE ``config.json`` (Qwen3-MoE's dense layers among
    the routed ones too: ``decoder_sparse_step``, ``mlp_only_layers``); ValueError on what megajax does not implement
    (sliding-window attention, router jitter) or what the family refuses (``MoEConfig``'s checks)."""
    kind = hf.get("model_type")
    _refuse(kind in HF_CLASSES, f"config.json model_type={kind!r}: hf_moe converts "
                                f"{', '.join(f'{k} ({v})' for k, v in HF_CLASSES.items())}")
    qwen = kind == "qwen3_moe"
    names = ("num_experts", "num_local_experts") if qwen else ("num_local_experts", "num_experts")  # either spelling
    experts = number(hf, next((k for k in names if k in hf), names[0]))
    top_k = number(hf, "num_experts_per_tok")
    fields = decoder_fields(hf, make_vocab_size_divisible_by, head_dim_free=qwen)
    window = number(hf, "sliding_window", default=None, null=None) if (not qwen or hf.get("use_sliding_window")) \
        else None
    _refuse(window is None or window >= fields["max_seq_len"],
            f"config.json sliding_window={window}: megajax's attention sees the whole sequence")
    _refuse(not hf.get("router_jitter_noise"), f"config.json router_jitter_noise={hf.get('router_jitter_noise')}: "
                                               "megajax's router draws no noise")
    if qwen:  # dense layers among the routed ones: transformers' rule, ``MoEConfig.routed_layers``
        dense = hf.get("mlp_only_layers") or []
        _refuse(isinstance(dense, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in dense),
                f"config.json mlp_only_layers={dense!r}: give a list of layer numbers")
        fields.update(decoder_sparse_step=number(hf, "decoder_sparse_step", default=1), mlp_only_layers=tuple(dense))
    expert_width = number(hf, "moe_intermediate_size" if qwen else "intermediate_size")
    aux = number(hf, "router_aux_loss_coef", default=0.001, whole=False, minimum=0)
    c = base_config(moe.NAME)
    c.model.update(fields, num_experts=experts, experts_per_token=top_k, moe_ffn_hidden_size=expert_width,
                   norm_topk_prob=bool(hf.get("norm_topk_prob", False)) or not qwen, qk_norm=qwen,
                   router_aux_loss_coef=float(aux))
    model_config(c)  # the family's own checks (its layers' kinds, top-k within the experts) before any tensor is read
    return c


def hf_config(cfg: moe.MoEConfig) -> dict:
    """The HF ``config.json`` of a megajax mixture of experts (Qwen3-MoE where it has ``qk_norm``, else Mixtral:
    Mixtral always renormalises the top-k weights)."""
    kind = _model_type(cfg)
    base = {"architectures": [HF_CLASSES[kind]], "model_type": kind, **decoder_config(cfg),
            "num_experts_per_tok": cfg.experts_per_token, "router_aux_loss_coef": cfg.router_aux_loss_coef,
            "output_router_logits": False}
    if kind == "mixtral":
        _refuse(cfg.norm_topk_prob, "model.norm_topk_prob=False has no Mixtral form (Mixtral always renormalises); "
                                    "a Qwen3-MoE needs model.qk_norm=True")
        _refuse(len(cfg.routed_layers) == cfg.num_layers, "dense layers among the routed ones (model.mlp_only_layers, "
                                                          "model.decoder_sparse_step) have no Mixtral form; a "
                                                          "Qwen3-MoE needs model.qk_norm=True")
        return {**base, "num_local_experts": cfg.num_experts, "intermediate_size": cfg.expert_ffn_size,
                "router_jitter_noise": 0.0, "sliding_window": None}
    return {**base, "num_experts": cfg.num_experts, "moe_intermediate_size": cfg.expert_ffn_size,
            "norm_topk_prob": cfg.norm_topk_prob, "decoder_sparse_step": cfg.decoder_sparse_step,
            "mlp_only_layers": list(cfg.mlp_only_layers),
            "use_sliding_window": False, "sliding_window": None}


def _stack_of(cfg: moe.MoEConfig):
    """Layer index -> the stack megajax keeps it on: the routed layers', or the dense ones' (``moe.DENSE_STACK``)."""
    routed = set(cfg.routed_layers)
    return lambda i: STACK if i in routed else moe.DENSE_STACK


def _layer_from_hf(t: DecoderTensors, i: int, cfg: moe.MoEConfig) -> Params:
    h, f, e, d = cfg.hidden_size, cfg.expert_ffn_size, cfg.num_experts, cfg.head_dim
    pre = f"model.layers.{i}."
    block, (gate, up, down) = LAYOUT[_model_type(cfg)]

    def experts(name: str, shape: tuple[int, int]) -> np.ndarray:  # E x torch (out, in) -> (E, in, out)
        return np.stack([t.take(f"{pre}{block}.experts.{x}.{name}.weight", shape).T for x in range(e)])

    norms = {f"{x}_norm": {"scale": t.take(f"{pre}self_attn.{x}_norm.weight", (d,))} for x in "qk"} \
        if cfg.qk_norm else {}
    if i not in cfg.routed_layers:  # a dense layer: Llama's, with the query / key norms
        dense = layer_from_hf(t, i, cfg)
        dense["attn"].update(norms)
        return dense
    attn = {**attention_from_hf(t, pre, cfg), **norms}
    return {"ln_1": {"scale": t.take(pre + "input_layernorm.weight", (h,))},
            "ln_2": {"scale": t.take(pre + "post_attention_layernorm.weight", (h,))},
            "attn": attn,
            "mlp": {"router": t.take(f"{pre}{block}.gate.weight", (e, h)).T, "gate": experts(gate, (f, h)),
                    "up": experts(up, (f, h)), "down": experts(down, (h, f))}}


def _layer_to_hf(b: Params, i: int, cfg: moe.MoEConfig) -> dict[str, np.ndarray]:
    pre = f"model.layers.{i}."
    block, names = LAYOUT[_model_type(cfg)]
    norms = {f"{pre}self_attn.{x}_norm.weight": b["attn"][f"{x}_norm"]["scale"] for x in "qk"} if cfg.qk_norm else {}
    if i not in cfg.routed_layers:
        return {**layer_to_hf(b, i, cfg), **norms}
    sd = {pre + "input_layernorm.weight": b["ln_1"]["scale"],
          pre + "post_attention_layernorm.weight": b["ln_2"]["scale"],
          **attention_to_hf(b["attn"], pre, cfg), f"{pre}{block}.gate.weight": b["mlp"]["router"].T, **norms}
    for name, ours in zip(names, ("gate", "up", "down")):
        sd.update({f"{pre}{block}.experts.{x}.{name}.weight": w.T for x, w in enumerate(b["mlp"][ours])})
    return sd


def params_from_hf(sd: dict[str, np.ndarray], cfg: moe.MoEConfig) -> Params:
    """The mixture of experts ``cfg``'s parameters from an HF Mixtral / Qwen3-MoE state dict (fp32)."""
    return decoder_from_hf(DecoderTensors(sd, cfg, HF_CLASSES[_model_type(cfg)]), cfg, _layer_from_hf,
                           _stack_of(cfg))


def params_to_hf(p: Params, cfg: moe.MoEConfig) -> dict[str, np.ndarray]:
    """An HF Mixtral / Qwen3-MoE state dict of ``cfg``'s parameters (per expert, as published)."""
    return decoder_to_hf(p, cfg, _layer_to_hf, _stack_of(cfg))
