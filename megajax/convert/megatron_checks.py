"""Consistency of a Megatron-LM checkpoint before conversion: its ranks against each other, its stored ``args``
against its tensors and against the user's flags, and the vocabulary (Megatron stores only the padded size).
The checks serve GPT and BERT alike; ``model`` arguments are ``config.model.name``, ``given`` ones the model of the
user's ``--config`` (its family's config type), None without one."""

from __future__ import annotations

import argparse
import pathlib

import numpy as np

from megajax.config import padded_vocab_size
from megajax.models.transformer import TransformerConfig

# args that every rank of one save stores alike (rank-local ones such as args.rank are left out); the
# tensor-parallel size first, as the likeliest to tell two saves apart.
SHARED_ARGS = ("tensor_model_parallel_size", "num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size",
               "max_position_embeddings", "padded_vocab_size", "make_vocab_size_divisible_by",
               "pipeline_model_parallel_size", "tokenizer_type")
# config.model.name -> args naming model variants -> what that megajax model computes (a missing arg means
# Megatron's default). BERT without its binary head (--bert-no-binary-head) has no sentence-order logits to map.
_COMMON = {"swiglu": False, "untie_embeddings_and_output_weights": False,
           "position_embedding_type": "learned_absolute", "normalization": "LayerNorm", "group_query_attention": False,
           "add_bias_linear": True, "apply_residual_connection_post_layernorm": False, "num_experts": None,
           "pipeline_model_parallel_size": 1}
MEGAJAX_COMPUTES = {"gpt": _COMMON, "bert": {**_COMMON, "bert_binary_head": True}}
VARIANT_ARGS = tuple(dict.fromkeys(key for computes in MEGAJAX_COMPUTES.values() for key in computes))
# The vocabulary a user most likely means, per model, for the hint when --vocab_size is missing.
VOCABULARY_EXAMPLE = {"gpt": "--vocab_size=50257 for GPT-2's BPE",
                      "bert": "--vocab_size=30522 for BERT's uncased WordPiece"}
CONFIG_FIELDS = {"num_layers": "model.num_layers", "hidden_size": "model.hidden_size",
                 "num_attention_heads": "model.num_heads", "max_position_embeddings": "model.max_seq_len",
                 "ffn_hidden_size": "model.mlp_ratio x model.hidden_size"}
Claims = dict[str, list[tuple[object, str]]]  # size name -> [(value, who says so)]


def args_of(checkpoint: dict) -> dict | None:
    """A rank file's stored Megatron args as a dict (None if it was saved without them)."""
    args = checkpoint.get("args")
    return vars(args) if isinstance(args, argparse.Namespace) else (dict(args) if args is not None else None)


def common_args(checkpoints: list[dict], files: list[pathlib.Path]) -> dict | None:
    """The args all ranks share (None when no rank stores any); errors name the ranks that disagree."""
    per_rank = [args_of(ck) for ck in checkpoints]
    ranks = [f.parent.name for f in files]
    if any(a is None for a in per_rank) and any(a is not None for a in per_rank):
        without = [r for r, a in zip(ranks, per_rank) if a is None]
        raise ValueError(f"{', '.join(without)} store(s) no args but other ranks do: the ranks in "
                         f"{files[0].parent.parent} do not come from one save")
    for key in dict.fromkeys((*SHARED_ARGS, "checkpoint_version", *VARIANT_ARGS)):
        values = [ck.get(key) if key == "checkpoint_version" else (a or {}).get(key)
                  for ck, a in zip(checkpoints, per_rank)]
        if any(v != values[0] for v in values):
            said = ", ".join(f"{r} has {v!r}" for r, v in zip(ranks, values))
            raise ValueError(f"the ranks in {files[0].parent.parent} disagree on {key} ({said}): they do not come "
                             "from one save (two tensor-parallel degrees written into one directory?)")
    return per_rank[0]


def check_given(given: TransformerConfig | None, family: type[TransformerConfig], model: str) -> None:
    """A --config must describe a model of the checkpoint's family: ``model``, whose config type is ``family``."""
    if given is not None and type(given) is not family:
        raise ValueError(f"--config describes a {type(given).__name__} model; a Megatron-LM {model.upper()} "
                         f"checkpoint needs a config with model.name={model!r}")


def require_sizes(args: dict | None, given: TransformerConfig | None, where: pathlib.Path, model: str) -> None:
    """The model sizes must come from somewhere: the checkpoint's args or the user's --config."""
    if args is None and given is None:
        raise ValueError(f"{where} stores no args (saved without them), so its model sizes are unknown: pass "
                         f"--config=NAME, a megajax {model.upper()} config describing the model (and --vocab_size=N)")


def check_features(args: dict, model: str) -> None:
    """Refuses model variants the megajax ``model`` (config.model.name) does not implement."""
    for key, want in MEGAJAX_COMPUTES[model].items():
        if args.get(key, want) != want:
            raise ValueError(f"the checkpoint's args.{key}={args[key]!r}, but megajax's {model.upper()} computes "
                             f"{key}={want!r}: this model cannot be converted")


def check_rank_shapes(ranks: list[dict[str, np.ndarray]], files: list[pathlib.Path]) -> None:
    """Every rank holds the same tensors with the same shapes (a rank's share of one split)."""
    first = files[0].parent.name
    for rank, f in zip(ranks[1:], files[1:]):
        if set(rank) != set(ranks[0]):
            differ = sorted(set(rank) ^ set(ranks[0]))[:4]
            raise ValueError(f"{f.parent.name} and {first} hold different tensors (e.g. {differ}): they do not come "
                             "from one save")
        for name, a in rank.items():
            if a.shape != ranks[0][name].shape:
                raise ValueError(f"tensor {name} is {ranks[0][name].shape} in {first} but {a.shape} in "
                                 f"{f.parent.name}: the ranks come from different tensor-parallel degrees or models")


def args_claims(args: dict | None) -> Claims:
    """The sizes the checkpoint's args state."""
    claimed = (*CONFIG_FIELDS, "padded_vocab_size", "tensor_model_parallel_size")
    return {k: [(args[k], f"args.{k}")] for k in claimed if args and args.get(k) is not None}


def config_claims(given: TransformerConfig | None) -> Claims:
    """The sizes a user's --config states, under Megatron's names."""
    if given is None:
        return {}
    values = {"num_layers": given.num_layers, "hidden_size": given.hidden_size,
              "num_attention_heads": given.num_heads, "max_position_embeddings": given.max_seq_len,
              "ffn_hidden_size": given.mlp_ratio * given.hidden_size}
    return {k: [(v, f"--config {CONFIG_FIELDS[k]}")] for k, v in values.items()}


def tensor_claims(merged: dict[str, np.ndarray], names: dict[str, str], tp: int) -> Claims:
    """The sizes the tensors themselves show (num_layers from the layer indices, tp from the rank count)."""
    wpe, fc1 = merged["wpe"].shape, merged["fc1_w.0"].shape
    layers = sum(1 for k in merged if k.startswith("qkv_w."))
    return {"num_layers": [(layers, f"the tensors (layers 0..{layers - 1})")],
            "hidden_size": [(wpe[1], f"the tensors ({names['wpe']} is {wpe})")],
            "max_position_embeddings": [(wpe[0], f"the tensors ({names['wpe']} is {wpe})")],
            "ffn_hidden_size": [(fc1[0], f"the tensors ({names['fc1_w.0']} is {fc1} over {tp} rank(s))")],
            "padded_vocab_size": [(merged["wte"].shape[0], f"the tensors ({names['wte']} has "
                                                           f"{merged['wte'].shape[0]} rows over {tp} rank(s))")],
            "tensor_model_parallel_size": [(tp, f"the mp_rank_NN directories ({tp})")]}


def check_agreement(where: pathlib.Path, *sources: Claims) -> None:
    """Every size that two sources state must agree; the error lists each disagreement with who said what."""
    claims: Claims = {}
    for source in sources:
        for key, said in source.items():
            claims.setdefault(key, []).extend(said)
    problems = [f"{key}: " + ", ".join(f"{v} in {who}" for v, who in said)
                for key, said in claims.items() if len({v for v, _ in said}) > 1]
    if problems:
        fix = ("pass a --config that matches the checkpoint (or none: its args describe it)"
               if any("--config" in p for p in problems)
               else "its args and tensors do not describe one model (a rank missing, or files from different saves?)")
        raise ValueError(f"{where} is inconsistent: {'; '.join(problems)}. {fix}")


def check_shapes(merged: dict[str, np.ndarray], names: dict[str, str], cfg: TransformerConfig, tp: int,
                 more: dict[str, tuple[int, ...]] | None = None) -> None:
    """Each merged tensor has the shape the sizes of ``cfg`` imply (``more``: shapes of a model's own tensors, by
    canonical key), and the heads split evenly over the ranks."""
    h, f = cfg.hidden_size, cfg.mlp_ratio * cfg.hidden_size
    if h % cfg.num_heads or cfg.num_heads % tp:
        raise ValueError(f"num_attention_heads={cfg.num_heads} must divide hidden_size={h} and be divisible by the "
                         f"{tp} tensor-parallel rank(s)")
    want = {"wte": (merged["wte"].shape[0], h), "wpe": (cfg.max_seq_len, h), "qkv_w": (3 * h, h), "qkv_b": (3 * h,),
            "proj_w": (h, h), "fc1_w": (f, h), "fc1_b": (f,), "fc2_w": (h, f),
            **(more or {})}  # the rest: (hidden_size,)
    for key, a in merged.items():
        shape = want.get(key.split(".")[0], (h,))
        if a.shape != shape:
            raise ValueError(f"{names[key]} is {a.shape} joined over {tp} rank(s), but hidden_size={h} and "
                             f"ffn_hidden_size={f} need {shape}: the tensors do not fit {tp}-way tensor parallelism")


def vocabulary_fields(rows: int, vocab_size: int | None, given: TransformerConfig | None, args: dict | None,
                      tp: int, where: pathlib.Path, model: str) -> dict[str, int]:
    """``vocab_size`` (from the flag, else --config's; checked against the ``rows`` Megatron stored) and a
    ``make_vocab_size_divisible_by`` that pads it to exactly those rows, for ``dataclasses.replace``."""
    if vocab_size is None and given is not None:
        vocab = vocabulary(rows, given.vocab_size, args, tp, where, model, "--config model.vocab_size")
    else:
        vocab = vocabulary(rows, vocab_size, args, tp, where, model)
    megatron_multiple = ((args or {}).get("make_vocab_size_divisible_by") or 0) * tp
    preferred = [given.make_vocab_size_divisible_by if given is not None else None, megatron_multiple]
    return {"vocab_size": vocab, "make_vocab_size_divisible_by": megajax_divisor(vocab, rows, preferred)}


def vocabulary(rows: int, vocab_size: int | None, args: dict | None, tp: int, where: pathlib.Path, model: str,
               given_by: str = "--vocab_size") -> int:
    """The true vocabulary size: given (flag or config), checked against the padded rows Megatron stored."""
    if vocab_size is None:
        tokenizer = (args or {}).get("tokenizer_type")
        hint = ("its args.tokenizer_type is GPT2BPETokenizer: pass --vocab_size=50257"
                if tokenizer == "GPT2BPETokenizer" and rows >= 50257 else
                f"pass the tokenizer's size{f' (args.tokenizer_type={tokenizer})' if tokenizer else ''}, "
                f"e.g. {VOCABULARY_EXAMPLE[model]}")
        raise ValueError(f"{where} stores only the padded vocabulary ({rows} embedding rows); the true vocabulary "
                         f"size is not in a Megatron checkpoint: {hint} (at most {rows})")
    if not 1 <= vocab_size <= rows:
        raise ValueError(f"{given_by}={vocab_size} does not fit the checkpoint's {rows} embedding rows "
                         f"({where}): pass the size of the tokenizer this model was trained with")
    divisor = (args or {}).get("make_vocab_size_divisible_by")
    if divisor:
        # Megatron pads by fewer than divisor x tp rows (its tools may keep a lower degree's padding when raising tp).
        multiple = divisor * ((args or {}).get("tensor_model_parallel_size") or tp)
        if rows - vocab_size >= multiple:
            raise ValueError(f"{given_by}={vocab_size} leaves {rows - vocab_size} padding rows, but Megatron pads "
                             f"{vocab_size} to {padded_vocab_size(vocab_size, multiple)} (args.make_vocab_size_"
                             f"divisible_by={divisor} x tensor-parallel size), not {rows}: pass the size of the "
                             "tokenizer this model was trained with")
    return vocab_size


def megajax_divisor(vocab_size: int, rows: int, preferred: list[int | None]) -> int:
    """A make_vocab_size_divisible_by that pads ``vocab_size`` to exactly ``rows`` (the first of ``preferred`` that
    does, else the largest power of two dividing ``rows`` if it does, else ``rows`` itself)."""
    power = rows & -rows
    for d in [*preferred, power]:
        if d and padded_vocab_size(vocab_size, d) == rows:
            return d
    return rows


def megatron_divisor(vocab_size: int, rows: int, divisible_by: int, tp: int) -> int:
    """args.make_vocab_size_divisible_by such that Megatron, padding to a multiple of it x ``tp``, gets ``rows``."""
    if divisible_by % tp == 0 and padded_vocab_size(vocab_size, divisible_by) == rows:
        return divisible_by // tp
    return rows // tp  # a multiple of rows itself always pads a vocabulary of at most rows to rows
