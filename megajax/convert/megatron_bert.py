"""Megatron-LM BERT checkpoints (legacy layout) <-> megajax BERT, for any tensor-parallel degree.

A rank's ``model`` holds ``language_model`` (``embedding``: word, position and tokentype embeddings; ``encoder``:
the layers and ``final_layernorm``; ``pooler``: ``dense``), ``lm_head`` (``dense``, ``layernorm``, ``bias``) and
``binary_head``. The embedding and the layers have GPT's names and layouts, so they go through ``megatron_gpt``'s
key table, QKV interleaving and rank split/merge. BERT adds replicated layers (tokentype embedding, pooler, lm_head
dense and LayerNorm, binary head) and one vocab-parallel tensor, the lm_head bias, split on the vocabulary like the
word embedding whose logits it is added to.

Megatron's BERT is the paper's pre-LN model (Figure 7b), so the megajax config has ``post_layernorm=False``. Its
binary head is the sentence-order head with megajax's labels (0: in order, 1: swapped). Megatron's GeLU is the
exact erf unless ``args.openai_gelu`` (then tanh); its fused bias-GeLU, on by default, evaluates the tanh form in
the MLP (at most 4.8e-4 from erf), which megajax's single ``model.activation`` does not reproduce.
"""

from __future__ import annotations

import argparse
import pathlib
import re

import jax
import ml_collections
import numpy as np
from flax import nnx

from megajax.builder import abstract_model
from megajax.config import base_config, padded_vocab_size
from megajax.convert import megatron_gpt, torch_io

Params = dict
# Canonical name -> key in a rank's flattened model (after "language_model." is stripped), beyond GPT's.
BERT_KEYS = {"tte": "embedding.tokentype_embeddings.weight",
             "pooler_w": "pooler.dense.weight", "pooler_b": "pooler.dense.bias",
             "mlm_dense_w": "lm_head.dense.weight", "mlm_dense_b": "lm_head.dense.bias",
             "mlm_ln_w": "lm_head.layernorm.weight", "mlm_ln_b": "lm_head.layernorm.bias",
             "mlm_bias": "lm_head.bias", "sop_w": "binary_head.weight", "sop_b": "binary_head.bias"}
NAMES = {**megatron_gpt.LEGACY, **BERT_KEYS}
ALIASES = (*megatron_gpt.LEGACY_ALIASES, ("lm_head.norm.", "lm_head.layernorm."))  # newer legacy code says "norm"
VOCAB_PARALLEL = "mlm_bias"  # GPT's split table covers the rest of the vocab-parallel tensors
# args naming variants megajax's BERT does not compute -> the value it does compute (missing: Megatron's default).
MEGAJAX_COMPUTES = {"apply_residual_connection_post_layernorm": False, "position_embedding_type": "learned_absolute",
                    "normalization": "LayerNorm", "swiglu": False, "add_bias_linear": True,
                    "untie_embeddings_and_output_weights": False, "group_query_attention": False, "num_experts": None,
                    "bert_binary_head": True, "pipeline_model_parallel_size": 1}


def _args(checkpoint: dict) -> dict | None:
    args = checkpoint.get("args")
    return vars(args) if isinstance(args, argparse.Namespace) else (dict(args) if args is not None else None)


def _load_ranks(it_dir: pathlib.Path, allow_pickle: bool) -> tuple[list[dict], list[pathlib.Path]]:
    rank_dirs = sorted(p for p in it_dir.glob("mp_rank_*") if p.is_dir())
    if not rank_dirs:
        raise FileNotFoundError(f"no mp_rank_NN directories in {it_dir}")
    if any(re.fullmatch(r"mp_rank_\d+_\d+", p.name) for p in rank_dirs):
        raise ValueError(f"{it_dir} is pipeline-parallel (mp_rank_TT_PPP); convert it with pipeline size 1 first")
    files = [p / "model_optim_rng.pt" for p in rank_dirs]
    return [torch_io.load(f, allow_pickle) for f in files], files


def holds_bert(directory: str | pathlib.Path, iteration: int | None = None, allow_pickle: bool = False) -> bool:
    """Whether a Megatron-LM checkpoint is a BERT: its rank 0 (read here, once more than a conversion needs) holds
    an ``lm_head`` or a ``binary_head``."""
    it_dir = megatron_gpt._iteration_dir(pathlib.Path(directory), iteration)
    rank_0 = sorted(p for p in it_dir.glob("mp_rank_*") if p.is_dir())[:1]
    if not rank_0:
        return False  # the GPT reader reports what is missing
    model = torch_io.load(rank_0[0] / "model_optim_rng.pt", allow_pickle).get("model", {})
    return "lm_head" in model or "binary_head" in model


def _canonical(model_sd: dict, where: pathlib.Path) -> dict[str, np.ndarray]:
    """One rank's tensors under canonical names (``qkv_w.3``: layer 3's QKV weight) as float32; a tensor megajax's
    BERT has no place for is refused."""
    flat = {k.removeprefix("model.").removeprefix("language_model."): v
            for k, v in megatron_gpt._flatten(model_sd).items() if not k.endswith("_extra_state")}
    for old, new in ALIASES:
        flat = {k.replace(old, new): v for k, v in flat.items()}
    if any(k.startswith(("decoder.", "output_layer.")) for k in flat):
        raise ValueError(f"{where} has Megatron-Core names; megajax converts BERT in the legacy layout only")
    if "binary_head.weight" not in flat:
        raise ValueError(f"{where} has no binary_head (trained with --bert-no-binary-head): megajax's BERT always "
                         "has the sentence-order head")
    layers = sorted({int(m[1]) for k in flat if (m := re.match(r"encoder\.layers\.(\d+)\.", k))})
    if not layers or layers != list(range(len(layers))):
        raise ValueError(f"{where} holds layers {layers or 'none'}; a BERT checkpoint has layers 0..N-1")
    out = {}
    for key, fmt in NAMES.items():
        for i in (layers if key in megatron_gpt.LAYER_KEYS else [None]):
            name = fmt.format(i) if i is not None else fmt
            if name not in flat:
                raise KeyError(f"{where} has no tensor {name!r} (found e.g. {sorted(flat)[:4]})")
            v = flat.pop(name)
            out[f"{key}.{i}" if i is not None else key] = (v.astype(np.float32) if isinstance(v, np.ndarray)
                                                           else torch_io.to_numpy(v))
    if flat:
        raise ValueError(f"{where} holds tensors megajax's BERT has no place for: {sorted(flat)[:4]}")
    return out


def _without(tensors: dict, name: str) -> dict:
    return {k: v for k, v in tensors.items() if k != name}


def merge_ranks(ranks: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """GPT's merge (replicated tensors must agree) plus the lm_head bias joined on the vocabulary."""
    merged = megatron_gpt._merge_ranks([_without(r, VOCAB_PARALLEL) for r in ranks])
    merged[VOCAB_PARALLEL] = np.concatenate([r[VOCAB_PARALLEL] for r in ranks])
    return merged


def split_ranks(full: dict[str, np.ndarray], tp: int) -> list[dict[str, np.ndarray]]:
    """GPT's split plus the lm_head bias cut on the vocabulary (rank r: rows r*V/tp ..)."""
    ranks = megatron_gpt._split_ranks(_without(full, VOCAB_PARALLEL), tp)
    for rank, bias in zip(ranks, np.split(full[VOCAB_PARALLEL], tp)):
        rank[VOCAB_PARALLEL] = bias
    return ranks


def _dense(c: dict[str, np.ndarray], key: str) -> dict[str, np.ndarray]:
    return {"kernel": c[f"{key}_w"].T, "bias": c[f"{key}_b"]}


def params_from_canonical(c: dict[str, np.ndarray], config: ml_collections.ConfigDict) -> Params:
    """megajax BERT parameters from merged canonical tensors (the config pads the vocabulary to their rows)."""
    return {**megatron_gpt.params_from_canonical(c, config), "tte": c["tte"], "pooler": _dense(c, "pooler"),
            "mlm_dense": _dense(c, "mlm_dense"), "mlm_ln": {"scale": c["mlm_ln_w"], "bias": c["mlm_ln_b"]},
            "mlm_bias": c["mlm_bias"], "sop": _dense(c, "sop")}


def params_to_canonical(p: Params, config: ml_collections.ConfigDict) -> dict[str, np.ndarray]:
    """Full (unsplit) canonical tensors of megajax BERT parameters, float32, Megatron's (out, in) weights."""
    extra = {"tte": p["tte"], "mlm_bias": p["mlm_bias"], "mlm_ln_w": p["mlm_ln"]["scale"],
             "mlm_ln_b": p["mlm_ln"]["bias"]}
    for key in ("pooler", "mlm_dense", "sop"):
        extra[f"{key}_w"], extra[f"{key}_b"] = p[key]["kernel"].T, p[key]["bias"]
    return {**megatron_gpt.params_to_canonical(p, config),
            **{k: np.ascontiguousarray(v, np.float32) for k, v in extra.items()}}


def _check_features(args: dict, where: pathlib.Path) -> None:
    for key, want in MEGAJAX_COMPUTES.items():
        if args.get(key, want) != want:
            raise ValueError(f"{where}: args.{key}={args[key]!r}, but megajax's BERT computes {key}={want!r}; this "
                             "model cannot be converted")


def _vocab_size(rows: int, given: int | None, args: dict, tp: int, where: pathlib.Path) -> int:
    """The true vocabulary: Megatron stores only the padded size, so it is given (flag or config) and checked."""
    if given is None:
        tokenizer = f" (args.tokenizer_type={args['tokenizer_type']})" if args.get("tokenizer_type") else ""
        raise ValueError(f"{where} stores only the padded vocabulary ({rows} rows): pass --vocab_size=N, the size of "
                         f"the vocab file it was trained with{tokenizer}, e.g. 30522 for BERT's uncased WordPiece "
                         f"vocabulary (at most {rows})")
    if not 1 <= given <= rows:
        raise ValueError(f"--vocab_size={given} does not fit the checkpoint's {rows} embedding rows ({where})")
    multiple = (args.get("make_vocab_size_divisible_by") or 0) * (args.get("tensor_model_parallel_size") or tp)
    if multiple and rows - given >= multiple:
        raise ValueError(f"--vocab_size={given} leaves {rows - given} padding rows, but Megatron pads to a multiple "
                         f"of {multiple} (args.make_vocab_size_divisible_by x tensor-parallel size): pass the size "
                         "of the vocab file this model was trained with")
    return given


def _megajax_divisor(vocab: int, rows: int, preferred: list[int]) -> int:
    """A make_vocab_size_divisible_by padding ``vocab`` to exactly ``rows``: the first of ``preferred`` that does,
    else the largest power of two dividing ``rows`` if it does, else ``rows``."""
    return next(d for d in (*preferred, rows & -rows, rows) if d and padded_vocab_size(vocab, d) == rows)


def config_from_args(args: dict, num_token_types: int) -> ml_collections.ConfigDict:
    """A megajax BERT config with the model sizes of the Megatron ``args`` stored in a checkpoint."""
    c = base_config()
    h = args["hidden_size"]
    ffn = args.get("ffn_hidden_size") or 4 * h
    if ffn % h:
        raise ValueError(f"args.ffn_hidden_size={ffn} is not a multiple of args.hidden_size={h}")
    c.model.update(name="bert", num_layers=args["num_layers"], hidden_size=h, num_heads=args["num_attention_heads"],
                   max_seq_len=args["max_position_embeddings"], mlp_ratio=ffn // h, num_token_types=num_token_types,
                   layernorm_eps=args.get("layernorm_epsilon", 1e-5), post_layernorm=False,
                   activation="gelu_tanh" if args.get("openai_gelu") else "gelu",
                   dropout=args.get("hidden_dropout", 0.1), init_std=args.get("init_method_std", 0.02))
    return c


def _check_shapes(params: Params, config: ml_collections.ConfigDict, where: pathlib.Path) -> None:
    """Every tensor has the shape the config gives the megajax model (sizes from args or --config)."""
    def shapes(tree) -> dict[str, tuple[int, ...]]:
        return {jax.tree_util.keystr(path): tuple(a.shape) for path, a in jax.tree_util.tree_leaves_with_path(tree)}

    want, got = shapes(nnx.to_pure_dict(nnx.state(abstract_model(config)))), shapes(params)
    for name, shape in got.items():
        if want.get(name) != shape:
            raise ValueError(f"{where}: the tensors give megajax {name} the shape {shape}, but the model sizes (args "
                             f"or --config) imply {want.get(name)}")


def _resolve_config(config: ml_collections.ConfigDict | None, args: dict | None, merged: dict[str, np.ndarray],
                    vocab_size: int | None, tp: int, where: pathlib.Path) -> ml_collections.ConfigDict:
    """The megajax config: sizes from ``config`` or args, the true vocabulary, a divisor giving exactly the rows."""
    if args is None and config is None:
        raise ValueError(f"{where} stores no args: pass --config=NAME, a megajax BERT config describing the model")
    rows = merged["wte"].shape[0]
    out = config.copy_and_resolve_references() if config is not None else \
        config_from_args(args, num_token_types=merged["tte"].shape[0])
    given = vocab_size if vocab_size is not None else (config.model.vocab_size if config is not None else None)
    vocab = _vocab_size(rows, given, args or {}, tp, where)
    preferred = [config.model.make_vocab_size_divisible_by if config is not None else 0,
                 ((args or {}).get("make_vocab_size_divisible_by") or 0) * tp]  # Megatron's own padding multiple
    out.model.update(vocab_size=vocab, make_vocab_size_divisible_by=_megajax_divisor(vocab, rows, preferred))
    return out


def read_megatron(directory: str | pathlib.Path, config: ml_collections.ConfigDict | None = None, *,
                  iteration: int | None = None, vocab_size: int | None = None,
                  allow_pickle: bool = False) -> tuple[Params, ml_collections.ConfigDict]:
    """(megajax parameters, config) from a Megatron-LM BERT checkpoint at any tensor-parallel degree.

    Sizes come from the checkpoint's args, or ``config`` for one saved without args. The true vocabulary is
    ``vocab_size`` (else ``config``'s); the embedding and lm_head bias keep the checkpoint's padded rows exactly.
    """
    if config is not None and (config.model.name != "bert" or config.model.post_layernorm):
        raise ValueError(f"--config has model.name={config.model.name!r}, post_layernorm="
                         f"{config.model.post_layernorm}; a Megatron-LM BERT needs name='bert', post_layernorm=False")
    it_dir = megatron_gpt._iteration_dir(pathlib.Path(directory), iteration)
    checkpoints, files = _load_ranks(it_dir, allow_pickle)
    version = checkpoints[0].get("checkpoint_version", 0)
    if version < 2:
        raise ValueError(f"checkpoint_version {version}: QKV rows are not interleaved per head; only >= 2 is supported")
    args = _args(checkpoints[0])
    _check_features(args or {}, it_dir)
    merged = merge_ranks([_canonical(ck["model"], f) for ck, f in zip(checkpoints, files)])
    out = _resolve_config(config, args, merged, vocab_size, len(files), it_dir)
    params = params_from_canonical(merged, out)
    _check_shapes(params, out, it_dir)
    return params, out


def _megatron_divisor(vocab: int, rows: int, divisible_by: int, tp: int) -> int:
    """args.make_vocab_size_divisible_by such that Megatron, padding to a multiple of it x ``tp``, gets ``rows``."""
    if divisible_by % tp == 0 and padded_vocab_size(vocab, divisible_by) == rows:
        return divisible_by // tp
    return rows // tp  # any vocabulary of at most rows rows pads to rows


def _nest(rank: dict[str, np.ndarray], dtype: str) -> dict:
    """One rank's canonical tensors as Megatron's nested legacy ``model`` dict."""
    sd = {}
    for name, a in rank.items():
        key, _, layer = name.partition(".")
        sd[NAMES[key].format(layer) if layer else NAMES[key]] = torch_io.to_torch(a, dtype)
    model = {"language_model": megatron_gpt._nest_legacy(
        {k: v for k, v in sd.items() if k.startswith(("embedding.", "encoder."))})}
    for k, v in sd.items():
        top, _, leaf = k.partition(".")
        if top in ("pooler", "lm_head", "binary_head"):
            (model["language_model"] if top == "pooler" else model).setdefault(top, {})[leaf] = v
    return model


def write_megatron(directory: str | pathlib.Path, params: Params, config: ml_collections.ConfigDict, tp: int, *,
                   iteration: int = 0, names: str = "legacy", dtype: str = "float32") -> pathlib.Path:
    """Writes a Megatron-LM BERT checkpoint (legacy layout) with ``tp`` ranks; returns its iteration directory."""
    m = config.model
    rows = params["wte"]["embedding"].shape[0]
    if names != "legacy":
        raise ValueError(f"--names={names}: megajax writes Megatron BERT checkpoints in the legacy layout only")
    if m.post_layernorm:
        raise ValueError("model.post_layernorm=True (the original BERT) has no Megatron-LM layout: Megatron's BERT is "
                         "pre-LN; convert this model to Hugging Face (megajax-to-hf) instead")
    if m.num_heads % tp or rows % tp:
        raise ValueError(f"tensor-parallel size {tp} must divide the heads ({m.num_heads}) and the padded "
                         f"vocabulary ({rows})")
    it_dir = pathlib.Path(directory) / f"iter_{iteration:07d}"
    if it_dir.is_dir() and any(it_dir.iterdir()):
        raise FileExistsError(f"{it_dir} already holds a checkpoint; write into a new --output directory")
    args = argparse.Namespace(
        num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_heads,
        ffn_hidden_size=m.mlp_ratio * m.hidden_size, max_position_embeddings=m.max_seq_len, padded_vocab_size=rows,
        make_vocab_size_divisible_by=_megatron_divisor(m.vocab_size, rows, m.make_vocab_size_divisible_by, tp),
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, layernorm_epsilon=m.layernorm_eps,
        openai_gelu=m.activation == "gelu_tanh", bias_gelu_fusion=False,  # unfused: Megatron's MLP then uses erf
        bert_binary_head=True, hidden_dropout=m.dropout, attention_dropout=m.dropout, init_method_std=m.init_std)
    for r, rank in enumerate(split_ranks(params_to_canonical(params, config), tp)):
        (it_dir / f"mp_rank_{r:02d}").mkdir(parents=True, exist_ok=True)
        torch_io.save({"model": _nest(rank, dtype), "checkpoint_version": 3.0, "iteration": iteration, "args": args},
                      it_dir / f"mp_rank_{r:02d}" / "model_optim_rng.pt")
    (pathlib.Path(directory) / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    return it_dir
