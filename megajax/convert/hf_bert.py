"""Hugging Face ``BertForPreTraining`` and ``MegatronBertForPreTraining`` <-> megajax BERT.

``model_type`` "bert" is the original post-LN BERT (an embedding LayerNorm, LayerNorms after each residual add, no
final one): megajax ``post_layernorm=True``. "megatron-bert" is Megatron's pre-LN BERT (``attention.ln`` before
attention, ``ln`` before the MLP, a final ``encoder.ln``, no embedding LayerNorm): ``post_layernorm=False``.

HF's Linear layers store (out, in) weights, with separate query/key/value projections whose outputs are split into
heads; megajax keeps QKV as (H, heads, 3, head_dim) so a model shard holds whole heads with their own q, k and v.

The MLM decoder is tied to the word embedding (its bias is ``cls.predictions.bias``, padded with zeros to the padded
vocabulary). HF's next-sentence head maps onto megajax's sentence-order head unchanged: HF's class 0 is "B follows
A" and 1 "B is random"; megajax's 0 is "A then B in the document's order" and 1 "swapped". Class 0 is the
document's order in both.
"""

from __future__ import annotations

import jax
import ml_collections
import numpy as np

from megajax.config import base_config
from megajax.convert.config_json import number
from megajax.convert.hf_tensors import HFTensors
from megajax.models.bert import BertConfig

Params = dict
HF_CLASSES = {"bert": "BertForPreTraining", "megatron-bert": "MegatronBertForPreTraining"}  # by model_type
MODEL_TYPES = {"bert": True, "megatron-bert": False}  # config.json model_type -> megajax post_layernorm
HF_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}  # hidden_act -> megajax
LAYER_NORMS = {True: ("attention.output.LayerNorm", "output.LayerNorm"), False: ("attention.ln", "ln")}  # ln_1, ln_2
# Tensors save_pretrained may hold that megajax does not store: buffers, and the decoder tied to other tensors.
BUFFERS = ("bert.embeddings.position_ids", "bert.embeddings.token_type_ids")
TIED = {"cls.predictions.decoder.weight": "bert.embeddings.word_embeddings.weight",
        "cls.predictions.decoder.bias": "cls.predictions.bias"}


def _refuse(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def config_from_hf(hf: dict, make_vocab_size_divisible_by: int = 1024) -> ml_collections.ConfigDict:
    """A megajax BERT config for an HF BERT / Megatron-BERT ``config.json``; errors on variants megajax lacks."""
    model_type = hf.get("model_type")
    _refuse(model_type in MODEL_TYPES, f"config.json model_type={model_type!r}: hf_bert converts "
                                       + ", ".join(f"{t} ({HF_CLASSES[t]})" for t in MODEL_TYPES))
    act = hf.get("hidden_act", "gelu")
    _refuse(act in HF_ACTIVATIONS, f"config.json hidden_act={act!r}: megajax's BERT computes one of "
                                   f"{sorted(HF_ACTIVATIONS)} (exact-erf or tanh GeLU)")
    position = hf.get("position_embedding_type", "absolute")
    _refuse(position == "absolute", f"config.json position_embedding_type={position!r}: megajax's BERT has "
                                    "learned absolute position embeddings only")
    for flag, want in (("is_decoder", False), ("add_cross_attention", False), ("tie_word_embeddings", True)):
        _refuse(hf.get(flag, want) == want, f"config.json {flag}={hf.get(flag)!r} is not supported (megajax's BERT "
                                            f"is a bidirectional encoder with a tied MLM output: {flag}={want})")
    h = number(hf, "hidden_size")
    inner = number(hf, "intermediate_size", default=4 * h)
    _refuse(inner % h == 0, f"config.json intermediate_size={inner} is not a multiple of hidden_size={h}")
    types = number(hf, "type_vocab_size", default=2)  # megajax's BERT needs at least one token type
    fraction = dict(whole=False, minimum=0)
    c = base_config("bert")
    c.model.update(vocab_size=number(hf, "vocab_size"), make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                   num_layers=number(hf, "num_hidden_layers"), hidden_size=h,
                   num_heads=number(hf, "num_attention_heads"), max_seq_len=number(hf, "max_position_embeddings"),
                   mlp_ratio=inner // h, num_token_types=types,
                   dropout=number(hf, "hidden_dropout_prob", default=0.1, **fraction),
                   init_std=number(hf, "initializer_range", default=0.02, **fraction),
                   layernorm_eps=number(hf, "layer_norm_eps", default=1e-12, **fraction),
                   activation=HF_ACTIVATIONS[act], post_layernorm=MODEL_TYPES[model_type])
    return c


def hf_config(cfg: BertConfig) -> dict:
    """The HF ``config.json`` for a megajax BERT (true vocabulary size; the padding rows are dropped)."""
    model_type = "bert" if cfg.post_layernorm else "megatron-bert"
    return {"architectures": [HF_CLASSES[model_type]], "model_type": model_type,
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
            "num_attention_heads": cfg.num_heads, "intermediate_size": cfg.mlp_ratio * cfg.hidden_size,
            "hidden_act": {"gelu": "gelu", "gelu_tanh": "gelu_new"}[cfg.activation],
            "hidden_dropout_prob": cfg.dropout, "attention_probs_dropout_prob": cfg.dropout,
            "max_position_embeddings": cfg.max_seq_len, "type_vocab_size": cfg.num_token_types,
            "initializer_range": cfg.init_std, "layer_norm_eps": cfg.layernorm_eps, "tie_word_embeddings": True}


class _Tensors(HFTensors):
    """The HF BERT state dict, its TF-era LayerNorm names (gamma/beta) read as weight/bias."""

    def __init__(self, sd: dict[str, np.ndarray], cfg: BertConfig):
        renamed = (k.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
                   for k in sd)
        super().__init__(dict(zip(renamed, sd.values())),
                         f"vocab_size={cfg.vocab_size}, hidden_size={cfg.hidden_size}, intermediate_size="
                         f"{cfg.mlp_ratio * cfg.hidden_size}, max_position_embeddings={cfg.max_seq_len}, "
                         f"type_vocab_size={cfg.num_token_types}", " or ".join(HF_CLASSES.values()))

    def linear(self, name: str, n_in: int, n_out: int) -> dict[str, np.ndarray]:
        """A torch Linear (out, in) as a megajax dense layer: kernel (in, out)."""
        return {"kernel": self.take(f"{name}.weight", (n_out, n_in)).T, "bias": self.take(f"{name}.bias", (n_out,))}

    def layernorm(self, name: str, h: int) -> dict[str, np.ndarray]:
        return {"scale": self.take(f"{name}.weight", (h,)), "bias": self.take(f"{name}.bias", (h,))}

    def check_rest(self) -> None:
        """Everything not taken must be a buffer or a tied copy; anything else has no place in megajax's BERT."""
        rest = self.rest(TIED, "megajax ties them") - set(BUFFERS)
        _refuse(not rest, f"the HF weights hold tensors megajax's BERT has no place for: {sorted(rest)[:4]} (layers "
                          "past num_hidden_layers, or another model's heads)")


def _layer_from_hf(t: _Tensors, i: int, cfg: BertConfig) -> Params:
    h, nh, f = cfg.hidden_size, cfg.num_heads, cfg.mlp_ratio * cfg.hidden_size
    pre = f"bert.encoder.layer.{i}."
    q, k, v = (t.linear(f"{pre}attention.self.{n}", h, h) for n in ("query", "key", "value"))
    out = t.linear(f"{pre}attention.output.dense", h, h)
    ln_1, ln_2 = LAYER_NORMS[bool(cfg.post_layernorm)]
    return {
        "ln_1": t.layernorm(pre + ln_1, h), "ln_2": t.layernorm(pre + ln_2, h),
        "attn": {"qkv": {"kernel": np.stack([p["kernel"].reshape(h, nh, h // nh) for p in (q, k, v)], axis=2),
                         "bias": np.stack([p["bias"].reshape(nh, h // nh) for p in (q, k, v)], axis=1)},
                 "out": {"kernel": out["kernel"].reshape(nh, h // nh, h), "bias": out["bias"]}},
        "mlp": {"up": t.linear(f"{pre}intermediate.dense", h, f), "down": t.linear(f"{pre}output.dense", f, h)},
    }


def params_from_hf(sd: dict[str, np.ndarray], cfg: BertConfig) -> Params:
    """The BERT ``cfg``'s parameters from an HF BertForPreTraining / MegatronBertForPreTraining state dict."""
    h, vocab, rows = cfg.hidden_size, cfg.vocab_size, cfg.padded_vocab_size
    t = _Tensors(sd, cfg)
    layers = [_layer_from_hf(t, i, cfg) for i in range(cfg.num_layers)]
    params = {
        "wte": {"embedding": _pad_rows(t.take("bert.embeddings.word_embeddings.weight", (vocab, h)), rows)},
        "wpe": t.take("bert.embeddings.position_embeddings.weight", (cfg.max_seq_len, h)),
        "tte": t.take("bert.embeddings.token_type_embeddings.weight", (cfg.num_token_types, h)),
        "blocks": jax.tree.map(lambda *xs: np.stack(xs), *layers),
        "pooler": t.linear("bert.pooler.dense", h, h),
        "mlm_dense": t.linear("cls.predictions.transform.dense", h, h),
        "mlm_ln": t.layernorm("cls.predictions.transform.LayerNorm", h),
        "mlm_bias": _pad_rows(t.take("cls.predictions.bias", (vocab,)), rows),
        "sop": t.linear("cls.seq_relationship", h, 2),
    }
    if cfg.post_layernorm:
        params["ln_emb"] = t.layernorm("bert.embeddings.LayerNorm", h)
    else:
        params["ln_f"] = t.layernorm("bert.encoder.ln", h)
    t.check_rest()
    return params


def _pad_rows(a: np.ndarray, rows: int) -> np.ndarray:
    """Zero rows appended up to the padded vocabulary (never selected: those ids are masked out of the softmax)."""
    return np.concatenate([a, np.zeros((rows - a.shape[0], *a.shape[1:]), a.dtype)])


def params_to_hf(p: Params, cfg: BertConfig) -> dict[str, np.ndarray]:
    """An HF state dict of the BERT ``cfg``'s parameters for ``hf_config(cfg)``'s class (tied decoder omitted, as
    ``save_pretrained`` does)."""
    h, vocab = cfg.hidden_size, cfg.vocab_size
    sd = {"bert.embeddings.word_embeddings.weight": p["wte"]["embedding"][:vocab],
          "bert.embeddings.position_embeddings.weight": p["wpe"],
          "bert.embeddings.token_type_embeddings.weight": p["tte"],
          "cls.predictions.bias": p["mlm_bias"][:vocab]}

    def linear(name: str, kernel: np.ndarray, bias: np.ndarray) -> None:
        sd[f"{name}.weight"], sd[f"{name}.bias"] = kernel.T, bias

    def layernorm(name: str, ln: dict) -> None:
        sd[f"{name}.weight"], sd[f"{name}.bias"] = ln["scale"], ln["bias"]

    for name, key in (("bert.pooler.dense", "pooler"), ("cls.predictions.transform.dense", "mlm_dense"),
                      ("cls.seq_relationship", "sop")):
        linear(name, p[key]["kernel"], p[key]["bias"])
    layernorm("cls.predictions.transform.LayerNorm", p["mlm_ln"])
    if cfg.post_layernorm:
        layernorm("bert.embeddings.LayerNorm", p["ln_emb"])
    else:
        layernorm("bert.encoder.ln", p["ln_f"])
    ln_1, ln_2 = LAYER_NORMS[bool(cfg.post_layernorm)]
    for i in range(cfg.num_layers):
        b = jax.tree.map(lambda x: x[i], p["blocks"])
        pre = f"bert.encoder.layer.{i}."
        qkv = b["attn"]["qkv"]
        for j, name in enumerate(("query", "key", "value")):
            linear(f"{pre}attention.self.{name}", qkv["kernel"][:, :, j].reshape(h, h), qkv["bias"][:, j].reshape(h))
        linear(f"{pre}attention.output.dense", b["attn"]["out"]["kernel"].reshape(h, h), b["attn"]["out"]["bias"])
        linear(f"{pre}intermediate.dense", b["mlp"]["up"]["kernel"], b["mlp"]["up"]["bias"])
        linear(f"{pre}output.dense", b["mlp"]["down"]["kernel"], b["mlp"]["down"]["bias"])
        layernorm(pre + ln_1, b["ln_1"])
        layernorm(pre + ln_2, b["ln_2"])
    return {k: np.ascontiguousarray(v, np.float32) for k, v in sd.items()}
