"""Megatron-LM BERT checkpoints (legacy layout) <-> megajax BERT, for any tensor-parallel degree.

A rank's ``model`` holds ``language_model`` (``embedding``: word, position and tokentype embeddings; ``encoder``:
the layers and ``final_layernorm``; ``pooler``: ``dense``), ``lm_head`` (``dense``, ``layernorm``, ``bias``) and
``binary_head``. The embedding and the layers have GPT's names and layouts, so reading and writing go through
``megatron_gpt`` (key table, QKV interleaving, rank merge and split, the files) and ``megatron_checks`` (ranks, args
against tensors and flags, variants, vocabulary). BERT adds replicated tensors (tokentype embedding, pooler, lm_head
dense and LayerNorm, binary head) and one vocab-parallel tensor, the lm_head bias, split on the vocabulary like the
word embedding whose logits it is added to.

Megatron's BERT is the paper's pre-LN model (Figure 7b), so the megajax config has ``post_layernorm=False``. Its
binary head is the sentence-order head with megajax's labels (0: in order, 1: swapped). Megatron's GeLU is the
exact erf unless ``args.openai_gelu`` (then tanh); its fused bias-GeLU, on by default, evaluates the tanh form in
the MLP (at most 4.8e-4 from erf), which megajax's single ``model.activation`` does not reproduce.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib

import ml_collections
import numpy as np

from megajax.convert import megatron_checks as checks
from megajax.convert import megatron_files, megatron_gpt, torch_io
from megajax.models import bert

Params = dict
# Canonical name -> key in a rank's flattened model (after "language_model." is stripped), beyond GPT's.
BERT_KEYS = {"tte": "embedding.tokentype_embeddings.weight",
             "pooler_w": "pooler.dense.weight", "pooler_b": "pooler.dense.bias",
             "mlm_dense_w": "lm_head.dense.weight", "mlm_dense_b": "lm_head.dense.bias",
             "mlm_ln_w": "lm_head.layernorm.weight", "mlm_ln_b": "lm_head.layernorm.bias",
             "mlm_bias": "lm_head.bias", "sop_w": "binary_head.weight", "sop_b": "binary_head.bias"}
NAMES = {**megatron_gpt.LEGACY, **BERT_KEYS}
ALIASES = (*megatron_gpt.LEGACY_ALIASES, ("lm_head.norm.", "lm_head.layernorm."))  # newer legacy code says "norm"
SPLIT_DIM = {**megatron_gpt.SPLIT_DIM, "mlm_bias": 0}  # the lm_head bias is vocab-parallel, like the embedding
HEADS = ("lm_head", "binary_head")  # beside language_model in a rank's model dict


def holds_bert(directory: str | pathlib.Path, iteration: int | None = None, allow_pickle: bool = False) -> bool:
    """Whether a Megatron-LM checkpoint is a BERT: its rank 0 (read here, once more than a conversion needs) holds
    an ``lm_head`` or a ``binary_head``. Errors are the readers' own: the directory and rank files are checked."""
    it_dir = megatron_files.iteration_dir(pathlib.Path(directory), iteration)
    model = torch_io.load(megatron_files.rank_files(it_dir)[0], allow_pickle).get("model", {})
    return any(head in model for head in HEADS)


def _canonical(model_sd: dict, where: pathlib.Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """``megatron_gpt.take_canonical`` for a BERT rank: legacy names only, and the binary head required."""
    flat = megatron_gpt.flat_tensors(model_sd)
    if any(k.startswith(("decoder.", "output_layer.")) for k in flat):
        raise ValueError(f"{where} has Megatron-Core names; megajax converts BERT in the legacy layout only")
    if not any(k.startswith("binary_head.") for k in flat):
        raise ValueError(f"{where} has no binary_head (trained with --bert-no-binary-head): megajax's BERT always "
                         "has the sentence-order head")
    return megatron_gpt.take_canonical(flat, NAMES, ALIASES, where, "bert")


def _dense(c: dict[str, np.ndarray], key: str) -> dict[str, np.ndarray]:
    return {"kernel": c[f"{key}_w"].T, "bias": c[f"{key}_b"]}


def params_from_canonical(c: dict[str, np.ndarray], cfg: bert.BertConfig) -> Params:
    """The BERT ``cfg``'s parameters from merged canonical tensors (``cfg`` pads the vocabulary to their rows)."""
    return {**megatron_gpt.params_from_canonical(c, cfg), "tte": c["tte"], "pooler": _dense(c, "pooler"),
            "mlm_dense": _dense(c, "mlm_dense"), "mlm_ln": {"scale": c["mlm_ln_w"], "bias": c["mlm_ln_b"]},
            "mlm_bias": c["mlm_bias"], "sop": _dense(c, "sop")}


def params_to_canonical(p: Params, cfg: bert.BertConfig) -> dict[str, np.ndarray]:
    """Full (unsplit) canonical tensors of the BERT ``cfg``'s parameters, float32, Megatron's (out, in) weights."""
    extra = {"tte": p["tte"], "mlm_bias": p["mlm_bias"], "mlm_ln_w": p["mlm_ln"]["scale"],
             "mlm_ln_b": p["mlm_ln"]["bias"]}
    for key in ("pooler", "mlm_dense", "sop"):
        extra[f"{key}_w"], extra[f"{key}_b"] = p[key]["kernel"].T, p[key]["bias"]
    return {**megatron_gpt.params_to_canonical(p, cfg),
            **{k: np.ascontiguousarray(v, np.float32) for k, v in extra.items()}}


def config_from_args(args: dict, num_token_types: int) -> bert.BertConfig:
    """The BERT of the Megatron ``args`` stored in a checkpoint (its vocabulary: see ``read_megatron``)."""
    return bert.BertConfig(**megatron_gpt.trunk_fields(args), num_token_types=num_token_types, post_layernorm=False,
                           activation="gelu_tanh" if args.get("openai_gelu") else "gelu")


def _check_config(given: bert.BertConfig | None) -> None:
    checks.check_given(given, bert.BertConfig, bert.NAME)
    if given is not None and given.post_layernorm:
        raise ValueError("--config has model.post_layernorm=True; a Megatron-LM BERT is pre-LN: it needs "
                         "post_layernorm=False")


def _token_type_claims(merged: dict[str, np.ndarray], names: dict[str, str],
                       given: bert.BertConfig | None) -> checks.Claims:
    """The token types the tensors hold, and --config's (Megatron's args do not store them)."""
    tte = merged["tte"].shape
    claims = [(tte[0], f"the tensors ({names['tte']} is {tte})")]
    if given is not None:
        claims.append((given.num_token_types, "--config model.num_token_types"))
    return {"num_token_types": claims}


def _head_shapes(cfg: bert.BertConfig, rows: int) -> dict[str, tuple[int, ...]]:
    """The shapes of BERT's own tensors (the rest, GPT's, ``megatron_checks.check_shapes`` knows)."""
    h = cfg.hidden_size
    return {"tte": (cfg.num_token_types, h), "pooler_w": (h, h), "mlm_dense_w": (h, h), "mlm_bias": (rows,),
            "sop_w": (2, h), "sop_b": (2,)}


def read_megatron(directory: str | pathlib.Path, given: bert.BertConfig | None = None, *,
                  iteration: int | None = None, vocab_size: int | None = None,
                  allow_pickle: bool = False) -> tuple[Params, ml_collections.ConfigDict]:
    """(megajax parameters, their megajax config) from a Megatron-LM BERT checkpoint at any tensor-parallel degree.

    Sizes come from the checkpoint's args, or ``given`` (the user's --config's model) for one saved without args;
    both must agree with each other and the tensors. The true vocabulary is ``vocab_size`` (else ``given``'s); the
    embedding and lm_head bias keep the checkpoint's padded rows exactly.
    """
    _check_config(given)
    it_dir = megatron_files.iteration_dir(pathlib.Path(directory), iteration)
    args, merged, names, tp = megatron_gpt.load_merged(it_dir, given, allow_pickle, model=bert.NAME,
                                                       canonical=_canonical, split_dim=SPLIT_DIM)
    rows = merged["wte"].shape[0]
    cfg = given if given is not None else config_from_args(args, num_token_types=merged["tte"].shape[0])
    checks.check_agreement(it_dir, checks.args_claims(args), checks.config_claims(given),
                           checks.tensor_claims(merged, names, tp), _token_type_claims(merged, names, given))
    checks.check_shapes(merged, names, cfg, tp, _head_shapes(cfg, rows))
    cfg = dataclasses.replace(cfg, **checks.vocabulary_fields(rows, vocab_size, given, args, tp, it_dir, bert.NAME))
    return params_from_canonical(merged, cfg), megatron_gpt.megajax_config(bert.NAME, cfg)


def _rank_model(rank: dict[str, np.ndarray], dtype: str) -> dict:
    """One rank's canonical tensors as Megatron's nested legacy BertModel ``model`` dict."""
    nested = megatron_gpt.nest_legacy(megatron_gpt.named_tensors(rank, NAMES, dtype))
    return {"language_model": {k: v for k, v in nested.items() if k not in HEADS},
            **{head: nested[head] for head in HEADS}}


def write_megatron(directory: str | pathlib.Path, params: Params, cfg: bert.BertConfig, tp: int, *,
                   iteration: int = 0, names: str = "legacy", dtype: str = "float32") -> pathlib.Path:
    """Writes the BERT ``cfg``'s parameters as a Megatron-LM BERT checkpoint (legacy layout) with ``tp`` ranks into
    a new or empty directory; returns its iteration directory."""
    if names != "legacy":
        raise ValueError(f"--names={names}: megajax writes Megatron BERT checkpoints in the legacy layout only")
    if cfg.post_layernorm:
        raise ValueError("model.post_layernorm=True (the original BERT) has no Megatron-LM layout: Megatron's BERT is "
                         "pre-LN; convert this model to Hugging Face (megajax-to-hf) instead")
    args = argparse.Namespace(**vars(megatron_gpt.megatron_args(cfg, params["wte"]["embedding"].shape[0], tp)),
                              openai_gelu=cfg.activation == "gelu_tanh", bert_binary_head=True,
                              bias_gelu_fusion=False)  # unfused: Megatron's MLP then computes the erf GeLU too
    models = (_rank_model(rank, dtype) for rank in megatron_gpt.split_ranks(params_to_canonical(params, cfg), tp,
                                                                            SPLIT_DIM))
    return megatron_files.write_ranks(pathlib.Path(directory), models, args, iteration)
