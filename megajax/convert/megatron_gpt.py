"""Megatron-LM GPT checkpoints <-> megajax, for any tensor-parallel degree.

Layout read and written: ``DIR/latest_checkpointed_iteration.txt`` and
``DIR/iter_XXXXXXX/mp_rank_NN/model_optim_rng.pt`` (pipeline parallelism 1), ``checkpoint_version`` 3.0.
Two key-name families are understood:

* legacy: ``language_model.embedding.word_embeddings.weight``, ``language_model.encoder.layers.N.
  self_attention.query_key_value.weight``, ``...dense``, ``mlp.dense_h_to_4h``, ``mlp.dense_4h_to_h``,
  ``input_layernorm``, ``post_attention_layernorm``, ``encoder.final_layernorm`` (older ``transformer.`` and
  ``attention.`` spellings too);
* Megatron-Core: ``embedding.word_embeddings.weight``, ``decoder.layers.N.self_attention.linear_qkv``,
  ``linear_proj``, ``mlp.linear_fc1``, ``mlp.linear_fc2``, LayerNorms either fused into the linear layers
  (``linear_qkv.layer_norm_weight``) or separate (``input_layernorm``, ``pre_mlp_layernorm``).

Weights are torch ``Linear`` (out, in). ``query_key_value`` rows are interleaved per head, ``[heads, 3, head_dim]``
(checkpoint version >= 2), so a rank's rows are whole heads; column-parallel weights are split on rows, row-parallel
weights on columns, the word embedding on the (padded) vocabulary; biases of row-parallel layers and LayerNorms are
replicated.

The pieces of reading and writing (``take_canonical``, ``load_merged``, ``merge_ranks`` / ``split_ranks``,
``megatron_args``, ``named_tensors``, ``nest_legacy``) serve ``megatron_bert`` too, whose trunk has GPT's names.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import re
from collections.abc import Callable

import ml_collections
import numpy as np

from megajax.config import base_config
from megajax.convert import megatron_checks as checks
from megajax.convert import megatron_files, torch_io
from megajax.models import gpt
from megajax.models.transformer import TransformerConfig

Params = dict
LAYER_KEYS = ("ln1_w", "ln1_b", "qkv_w", "qkv_b", "proj_w", "proj_b", "ln2_w", "ln2_b",
              "fc1_w", "fc1_b", "fc2_w", "fc2_b")
SPLIT_DIM = {"wte": 0, "qkv_w": 0, "qkv_b": 0, "fc1_w": 0, "fc1_b": 0, "proj_w": 1, "fc2_w": 1}  # else replicated

LEGACY = {"wte": "embedding.word_embeddings.weight", "wpe": "embedding.position_embeddings.weight",
          "lnf_w": "encoder.final_layernorm.weight", "lnf_b": "encoder.final_layernorm.bias",
          "ln1_w": "encoder.layers.{}.input_layernorm.weight", "ln1_b": "encoder.layers.{}.input_layernorm.bias",
          "qkv_w": "encoder.layers.{}.self_attention.query_key_value.weight",
          "qkv_b": "encoder.layers.{}.self_attention.query_key_value.bias",
          "proj_w": "encoder.layers.{}.self_attention.dense.weight",
          "proj_b": "encoder.layers.{}.self_attention.dense.bias",
          "ln2_w": "encoder.layers.{}.post_attention_layernorm.weight",
          "ln2_b": "encoder.layers.{}.post_attention_layernorm.bias",
          "fc1_w": "encoder.layers.{}.mlp.dense_h_to_4h.weight", "fc1_b": "encoder.layers.{}.mlp.dense_h_to_4h.bias",
          "fc2_w": "encoder.layers.{}.mlp.dense_4h_to_h.weight", "fc2_b": "encoder.layers.{}.mlp.dense_4h_to_h.bias"}
CORE = {"wte": "embedding.word_embeddings.weight", "wpe": "embedding.position_embeddings.weight",
        "lnf_w": "decoder.final_layernorm.weight", "lnf_b": "decoder.final_layernorm.bias",
        "ln1_w": "decoder.layers.{}.self_attention.linear_qkv.layer_norm_weight",
        "ln1_b": "decoder.layers.{}.self_attention.linear_qkv.layer_norm_bias",
        "qkv_w": "decoder.layers.{}.self_attention.linear_qkv.weight",
        "qkv_b": "decoder.layers.{}.self_attention.linear_qkv.bias",
        "proj_w": "decoder.layers.{}.self_attention.linear_proj.weight",
        "proj_b": "decoder.layers.{}.self_attention.linear_proj.bias",
        "ln2_w": "decoder.layers.{}.mlp.linear_fc1.layer_norm_weight",
        "ln2_b": "decoder.layers.{}.mlp.linear_fc1.layer_norm_bias",
        "fc1_w": "decoder.layers.{}.mlp.linear_fc1.weight", "fc1_b": "decoder.layers.{}.mlp.linear_fc1.bias",
        "fc2_w": "decoder.layers.{}.mlp.linear_fc2.weight", "fc2_b": "decoder.layers.{}.mlp.linear_fc2.bias"}
# Other spellings: older legacy names, and Core's unfused ("local") LayerNorms.
LEGACY_ALIASES = (("transformer.", "encoder."), (".attention.", ".self_attention."))
CORE_ALIASES = ((".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight"),
                (".input_layernorm.bias", ".self_attention.linear_qkv.layer_norm_bias"),
                (".pre_mlp_layernorm.weight", ".mlp.linear_fc1.layer_norm_weight"),
                (".pre_mlp_layernorm.bias", ".mlp.linear_fc1.layer_norm_bias"))


def _flatten(tree, prefix: str = "") -> dict:
    out = {}
    for k, v in tree.items():
        name = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, name + "."))
        else:
            out[name] = v
    return out


def flat_tensors(model_sd: dict) -> dict:
    """A rank's ``model`` dict flattened to dotted keys, less the ``model.`` / ``language_model.`` prefixes and
    Transformer Engine's ``_extra_state`` entries."""
    return {k.removeprefix("model.").removeprefix("language_model."): v for k, v in _flatten(model_sd).items()
            if not k.endswith("_extra_state")}


def take_canonical(flat: dict, key_names: dict[str, str], aliases: tuple[tuple[str, str], ...], where: pathlib.Path,
                   model: str) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """One rank's tensors under canonical names (``qkv_w.3`` = layer 3's QKV weight) as float32, and each canonical
    name's key in the file. ``key_names``: canonical key -> Megatron key (``{}`` for the layer); ``aliases``: other
    spellings rewritten first. The layers are those the keys hold; a tensor the table has no place for is refused."""
    for old, new in aliases:
        flat = {k.replace(old, new): v for k, v in flat.items()}
    layers = sorted({int(m[1]) for k in flat if (m := re.match(r"(?:en|de)coder\.layers\.(\d+)\.", k))})
    if layers != list(range(len(layers))) or not layers:
        raise ValueError(f"{where} holds layers {layers or 'none'}; a {model.upper()} checkpoint has layers 0..N-1")
    out, names = {}, {}
    for key, fmt in key_names.items():
        for i in (layers if key in LAYER_KEYS else [None]):
            name = fmt.format(i) if i is not None else fmt
            if name not in flat:
                raise KeyError(f"{where} has no tensor {name!r} (found e.g. {sorted(flat)[:4]})")
            canonical = f"{key}.{i}" if i is not None else key
            v = flat.pop(name)
            out[canonical] = v.astype(np.float32) if isinstance(v, np.ndarray) else torch_io.to_numpy(v)
            names[canonical] = name
    if flat:
        raise ValueError(f"{where} holds tensors megajax's {model.upper()} has no place for: {sorted(flat)[:4]} (an "
                         "untied output layer, or another model variant)")
    return out, names


def _canonical(model_sd: dict, where: pathlib.Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """``take_canonical`` for a GPT rank, legacy or Megatron-Core names (told apart by the ``decoder.`` prefix)."""
    flat = flat_tensors(model_sd)
    core = any(k.startswith("decoder.") for k in flat)
    return take_canonical(flat, CORE if core else LEGACY, CORE_ALIASES if core else LEGACY_ALIASES, where, "gpt")


def merge_ranks(ranks: list[dict[str, np.ndarray]], files: list[pathlib.Path],
                split_dim: dict[str, int] = SPLIT_DIM) -> dict[str, np.ndarray]:
    """The full tensors: those ``split_dim`` names joined along their dimension, the rest (replicated) checked to be
    the same on every rank."""
    merged = {}
    for name in ranks[0]:
        dim = split_dim.get(name.split(".")[0])
        parts = [r[name] for r in ranks]
        if dim is None:
            differ = [f.parent.name for f, p in zip(files[1:], parts[1:]) if not np.array_equal(parts[0], p)]
            if differ:
                raise ValueError(f"replicated tensor {name} differs between {files[0].parent.name} and "
                                 f"{', '.join(differ)}: the ranks do not come from one save")
            merged[name] = parts[0]
        else:
            merged[name] = np.concatenate(parts, axis=dim)
    return merged


def split_ranks(full: dict[str, np.ndarray], tp: int,
                split_dim: dict[str, int] = SPLIT_DIM) -> list[dict[str, np.ndarray]]:
    """Each rank's tensors: those ``split_dim`` names cut into ``tp`` equal parts, the rest whole on every rank."""
    return [{name: (np.split(a, tp, axis=split_dim[name.split(".")[0]])[r]
                    if name.split(".")[0] in split_dim else a) for name, a in full.items()} for r in range(tp)]


def params_from_canonical(c: dict[str, np.ndarray], cfg: TransformerConfig) -> Params:
    """The trunk's megajax parameters from the merged canonical tensors; ``cfg`` must pad the vocabulary to their
    rows."""
    h, nh, L, d = cfg.hidden_size, cfg.num_heads, cfg.num_layers, cfg.head_dim

    def stack(key, fn=lambda x: x):
        return np.stack([fn(c[f"{key}.{i}"]) for i in range(L)])

    if cfg.padded_vocab_size != c["wte"].shape[0]:
        raise ValueError(f"model.vocab_size={cfg.vocab_size} padded to a multiple of "
                         f"{cfg.make_vocab_size_divisible_by} is {cfg.padded_vocab_size} rows, but the word embedding "
                         f"has {c['wte'].shape[0]}")
    return {
        "wte": {"embedding": c["wte"]}, "wpe": c["wpe"], "ln_f": {"scale": c["lnf_w"], "bias": c["lnf_b"]},
        "blocks": {
            "ln_1": {"scale": stack("ln1_w"), "bias": stack("ln1_b")},
            "ln_2": {"scale": stack("ln2_w"), "bias": stack("ln2_b")},
            "attn": {"qkv": {"kernel": stack("qkv_w", lambda w: w.reshape(nh, 3, d, h).transpose(3, 0, 1, 2)),
                             "bias": stack("qkv_b", lambda b: b.reshape(nh, 3, d))},
                     "out": {"kernel": stack("proj_w", lambda w: w.T.reshape(nh, d, h)), "bias": stack("proj_b")}},
            "mlp": {"up": {"kernel": stack("fc1_w", lambda w: w.T), "bias": stack("fc1_b")},
                    "down": {"kernel": stack("fc2_w", lambda w: w.T), "bias": stack("fc2_b")}},
        },
    }


def params_to_canonical(p: Params, cfg: TransformerConfig) -> dict[str, np.ndarray]:
    """Full (unsplit) canonical tensors of the trunk's megajax parameters, float32, Megatron's (out, in) weights."""
    h, b = cfg.hidden_size, p["blocks"]
    out = {"wte": p["wte"]["embedding"], "wpe": p["wpe"], "lnf_w": p["ln_f"]["scale"], "lnf_b": p["ln_f"]["bias"]}
    for i in range(cfg.num_layers):
        out.update({
            f"ln1_w.{i}": b["ln_1"]["scale"][i], f"ln1_b.{i}": b["ln_1"]["bias"][i],
            f"ln2_w.{i}": b["ln_2"]["scale"][i], f"ln2_b.{i}": b["ln_2"]["bias"][i],
            f"qkv_w.{i}": b["attn"]["qkv"]["kernel"][i].transpose(1, 2, 3, 0).reshape(3 * h, h),
            f"qkv_b.{i}": b["attn"]["qkv"]["bias"][i].reshape(3 * h),
            f"proj_w.{i}": b["attn"]["out"]["kernel"][i].reshape(h, h).T, f"proj_b.{i}": b["attn"]["out"]["bias"][i],
            f"fc1_w.{i}": b["mlp"]["up"]["kernel"][i].T, f"fc1_b.{i}": b["mlp"]["up"]["bias"][i],
            f"fc2_w.{i}": b["mlp"]["down"]["kernel"][i].T, f"fc2_b.{i}": b["mlp"]["down"]["bias"][i],
        })
    return {k: np.ascontiguousarray(v, np.float32) for k, v in out.items()}


def trunk_fields(args: argparse.Namespace | dict) -> dict:
    """The ``TransformerConfig`` fields that the Megatron ``args`` stored in a checkpoint give (not the vocabulary:
    see ``read_megatron``); a missing LayerNorm epsilon, dropout or init std is Megatron's default."""
    a = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
    h = a["hidden_size"]
    ffn = a.get("ffn_hidden_size") or 4 * h
    if ffn % h:
        raise ValueError(f"args.ffn_hidden_size={ffn} is not a multiple of args.hidden_size={h}: megajax's MLP is "
                         "model.mlp_ratio x hidden_size wide")
    eps = a.get("norm_epsilon", a.get("layernorm_epsilon", 1e-5))  # newer Megatron: --norm-epsilon
    return dict(num_layers=a["num_layers"], hidden_size=h, num_heads=a["num_attention_heads"],
                max_seq_len=a["max_position_embeddings"], mlp_ratio=ffn // h, layernorm_eps=eps,
                dropout=a.get("hidden_dropout", 0.1), init_std=a.get("init_method_std", 0.02))


def megajax_config(name: str, cfg: TransformerConfig) -> ml_collections.ConfigDict:
    """The megajax config of a converted model (what is stored with it): the defaults, with the fields of ``cfg``
    as family ``name``'s ``config.model``."""
    config = base_config(name)
    config.model.update({field: getattr(cfg, field) for field in cfg.fields()})
    return config


Canonical = Callable[[dict, pathlib.Path], tuple[dict[str, np.ndarray], dict[str, str]]]  # like _canonical


def load_merged(it_dir: pathlib.Path, given: TransformerConfig | None, allow_pickle: bool, *, model: str,
                canonical: Canonical,
                split_dim: dict[str, int]) -> tuple[dict | None, dict[str, np.ndarray], dict[str, str], int]:
    """(shared args or None, the merged canonical tensors, their Megatron names, the tensor-parallel size) of an
    iteration directory, once its rank files are named, agree with each other, and hold a variant the megajax
    ``model`` computes. ``canonical(model_dict, file)`` names one rank's tensors; ``split_dim`` says how they join;
    ``given``: the --config's model, which must be there where the checkpoint stores no args."""
    files = megatron_files.rank_files(it_dir)
    checkpoints = [torch_io.load(f, allow_pickle) for f in files]
    args = checks.common_args(checkpoints, files)
    megatron_files.check_rank_count(it_dir, len(files), (args or {}).get("tensor_model_parallel_size"))
    version = checkpoints[0].get("checkpoint_version", 0)
    if version < 2:
        raise ValueError(f"checkpoint_version {version}: QKV rows are not interleaved per head; only >= 2 is supported")
    if args is not None:
        checks.check_features(args, model)
    named = [canonical(ck["model"], f) for ck, f in zip(checkpoints, files)]
    ranks = [tensors for tensors, _ in named]
    checks.check_rank_shapes(ranks, files)
    checks.require_sizes(args, given, it_dir, model)
    return args, merge_ranks(ranks, files, split_dim), named[0][1], len(files)


def read_megatron(directory: str | pathlib.Path, given: gpt.GPTConfig | None = None, *,
                  iteration: int | None = None, vocab_size: int | None = None,
                  allow_pickle: bool = False) -> tuple[Params, ml_collections.ConfigDict]:
    """(megajax parameters, their megajax config) from a Megatron-LM checkpoint at any tensor-parallel degree.

    The model sizes come from the checkpoint's args, or from ``given`` (the user's --config's model) for a
    checkpoint saved without args; when both exist they must agree with each other and with the tensors. Megatron
    stores only the padded vocabulary, so the true size is ``vocab_size`` (else ``given``'s); there is no silent
    default. The output keeps the checkpoint's embedding rows exactly.
    """
    checks.check_given(given, gpt.GPTConfig, gpt.NAME)
    it_dir = megatron_files.iteration_dir(pathlib.Path(directory), iteration)
    args, merged, names, tp = load_merged(it_dir, given, allow_pickle, model=gpt.NAME, canonical=_canonical,
                                          split_dim=SPLIT_DIM)
    cfg = given if given is not None else gpt.GPTConfig(**trunk_fields(args))
    checks.check_agreement(it_dir, checks.args_claims(args), checks.config_claims(given),
                           checks.tensor_claims(merged, names, tp))
    checks.check_shapes(merged, names, cfg, tp)
    cfg = dataclasses.replace(cfg, **checks.vocabulary_fields(merged["wte"].shape[0], vocab_size, given, args, tp,
                                                              it_dir, gpt.NAME))
    return params_from_canonical(merged, cfg), megajax_config(gpt.NAME, cfg)


def megatron_args(cfg: TransformerConfig, rows: int, tp: int) -> argparse.Namespace:
    """The args a ``tp``-way Megatron save of the model ``cfg`` stores (``rows``: its padded vocabulary), such that
    Megatron recomputes the same padded size; ValueError if ``tp`` does not divide the heads and the rows."""
    if cfg.num_heads % tp or rows % tp:
        raise ValueError(f"tensor-parallel size {tp} must divide the heads ({cfg.num_heads}) and the padded "
                         f"vocabulary ({rows})")
    return argparse.Namespace(
        num_layers=cfg.num_layers, hidden_size=cfg.hidden_size, num_attention_heads=cfg.num_heads,
        ffn_hidden_size=cfg.mlp_ratio * cfg.hidden_size, max_position_embeddings=cfg.max_seq_len,
        padded_vocab_size=rows, tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
        make_vocab_size_divisible_by=checks.megatron_divisor(cfg.vocab_size, rows, cfg.make_vocab_size_divisible_by,
                                                             tp),
        layernorm_epsilon=cfg.layernorm_eps, hidden_dropout=cfg.dropout, attention_dropout=cfg.dropout,
        init_method_std=cfg.init_std)


def named_tensors(rank: dict[str, np.ndarray], key_names: dict[str, str], dtype: str) -> dict:
    """One rank's canonical tensors as torch tensors of ``dtype`` under their Megatron keys (flat)."""
    sd = {}
    for name, a in rank.items():
        key, _, layer = name.partition(".")
        sd[key_names[key].format(layer) if layer else key_names[key]] = torch_io.to_torch(a, dtype)
    return sd


def nest_legacy(sd: dict) -> dict:
    """Megatron's legacy nesting of flat keys: ``embedding.<table>.<leaf>`` as dicts per table, every other module
    (``encoder``, BERT's ``pooler`` and heads) one dict of its flat keys."""
    out = {}
    for k, v in sd.items():
        top, _, rest = k.partition(".")
        if top == "embedding":
            table, _, leaf = rest.partition(".")
            out.setdefault("embedding", {}).setdefault(table, {})[leaf] = v
        else:
            out.setdefault(top, {})[rest] = v
    return out


def write_megatron(directory: str | pathlib.Path, params: Params, cfg: gpt.GPTConfig, tp: int, *,
                   iteration: int = 0, names: str = "legacy", dtype: str = "float32") -> pathlib.Path:
    """Writes the GPT ``cfg``'s parameters as a Megatron-LM checkpoint with ``tp`` tensor-parallel ranks into a new
    or empty directory (so no ranks or iterations of another save mix in); returns its iteration directory."""
    args = megatron_args(cfg, params["wte"]["embedding"].shape[0], tp)
    key_names = {"legacy": LEGACY, "core": CORE}[names]
    sds = (named_tensors(rank, key_names, dtype) for rank in split_ranks(params_to_canonical(params, cfg), tp))
    models = ({"language_model": nest_legacy(sd)} if names == "legacy" else sd for sd in sds)
    return megatron_files.write_ranks(pathlib.Path(directory), models, args, iteration)
