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
"""

from __future__ import annotations

import argparse
import pathlib
import re

import ml_collections
import numpy as np

from megajax.config import base_config, padded_vocab_size
from megajax.convert import megatron_checks as checks
from megajax.convert import megatron_files, torch_io
from megajax.convert.paths import require_empty

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


def _canonical(model_sd: dict, where: pathlib.Path) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """One rank's tensors under canonical names (``qkv_w.3`` = layer 3's QKV weight) as float32, and each canonical
    name's key in the file; the layers are those the keys hold, and a tensor megajax has no place for is refused."""
    flat = {k.removeprefix("model.").removeprefix("language_model."): v for k, v in _flatten(model_sd).items()
            if not k.endswith("_extra_state")}
    core = any(k.startswith("decoder.") for k in flat)
    for old, new in CORE_ALIASES if core else LEGACY_ALIASES:
        flat = {k.replace(old, new): v for k, v in flat.items()}
    layers = sorted({int(m[1]) for k in flat if (m := re.match(r"(?:en|de)coder\.layers\.(\d+)\.", k))})
    if layers != list(range(len(layers))) or not layers:
        raise ValueError(f"{where} holds layers {layers or 'none'}; a GPT checkpoint has layers 0..N-1")
    out, names = {}, {}
    for key, fmt in (CORE if core else LEGACY).items():
        for i in (layers if key in LAYER_KEYS else [None]):
            name = fmt.format(i) if i is not None else fmt
            if name not in flat:
                raise KeyError(f"{where} has no tensor {name!r} (found e.g. {sorted(flat)[:4]})")
            canonical = f"{key}.{i}" if i is not None else key
            v = flat.pop(name)
            out[canonical] = v.astype(np.float32) if isinstance(v, np.ndarray) else torch_io.to_numpy(v)
            names[canonical] = name
    if flat:
        raise ValueError(f"{where} holds tensors megajax's GPT has no place for: {sorted(flat)[:4]} (an untied "
                         "output layer, or another model variant)")
    return out, names


def _merge_ranks(ranks: list[dict[str, np.ndarray]], files: list[pathlib.Path]) -> dict[str, np.ndarray]:
    merged = {}
    for name in ranks[0]:
        dim = SPLIT_DIM.get(name.split(".")[0])
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


def _split_ranks(full: dict[str, np.ndarray], tp: int) -> list[dict[str, np.ndarray]]:
    return [{name: (np.split(a, tp, axis=SPLIT_DIM[name.split(".")[0]])[r]
                    if name.split(".")[0] in SPLIT_DIM else a) for name, a in full.items()} for r in range(tp)]


def params_from_canonical(c: dict[str, np.ndarray], config: ml_collections.ConfigDict) -> Params:
    """megajax parameters from the merged canonical tensors; the config must pad the vocabulary to their rows."""
    m = config.model
    h, nh, L = m.hidden_size, m.num_heads, m.num_layers
    d = h // nh

    def stack(key, fn=lambda x: x):
        return np.stack([fn(c[f"{key}.{i}"]) for i in range(L)])

    rows = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by)
    if rows != c["wte"].shape[0]:
        raise ValueError(f"model.vocab_size={m.vocab_size} padded to a multiple of {m.make_vocab_size_divisible_by} "
                         f"is {rows} rows, but the word embedding has {c['wte'].shape[0]}")
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


def params_to_canonical(p: Params, config: ml_collections.ConfigDict) -> dict[str, np.ndarray]:
    m = config.model
    h, b = m.hidden_size, p["blocks"]
    out = {"wte": p["wte"]["embedding"], "wpe": p["wpe"], "lnf_w": p["ln_f"]["scale"], "lnf_b": p["ln_f"]["bias"]}
    for i in range(m.num_layers):
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


def config_from_args(args: argparse.Namespace | dict) -> ml_collections.ConfigDict:
    """A megajax config with the model sizes of the Megatron ``args`` stored in a checkpoint (vocabulary: see
    ``read_megatron``)."""
    a = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
    c = base_config()
    h = a["hidden_size"]
    ffn = a.get("ffn_hidden_size") or 4 * h
    if ffn % h:
        raise ValueError(f"args.ffn_hidden_size={ffn} is not a multiple of args.hidden_size={h}: megajax's MLP is "
                         "model.mlp_ratio x hidden_size wide")
    c.model.update(num_layers=a["num_layers"], hidden_size=h, num_heads=a["num_attention_heads"],
                   max_seq_len=a["max_position_embeddings"], mlp_ratio=ffn // h)
    return c


def _load_ranks(it_dir: pathlib.Path, allow_pickle: bool):
    """(shared args or None, per-rank canonical tensors, Megatron names of rank 0's tensors, rank files)."""
    files = megatron_files.rank_files(it_dir)
    checkpoints = [torch_io.load(f, allow_pickle) for f in files]
    args = checks.common_args(checkpoints, files)
    version = checkpoints[0].get("checkpoint_version", 0)
    if version < 2:
        raise ValueError(f"checkpoint_version {version}: QKV rows are not interleaved per head; only >= 2 is supported")
    if args is not None:
        checks.check_features(args)
    canonical = [_canonical(ck["model"], f) for ck, f in zip(checkpoints, files)]
    ranks = [tensors for tensors, _ in canonical]
    checks.check_rank_shapes(ranks, files)
    return args, ranks, canonical[0][1], files


def read_megatron(directory: str | pathlib.Path, config: ml_collections.ConfigDict | None = None, *,
                  iteration: int | None = None, vocab_size: int | None = None,
                  allow_pickle: bool = False) -> tuple[Params, ml_collections.ConfigDict]:
    """(megajax parameters, config) from a Megatron-LM checkpoint at any tensor-parallel degree.

    The model sizes come from the checkpoint's args, or from ``config`` for a checkpoint saved without args; when
    both exist they must agree with each other and with the tensors. Megatron stores only the padded vocabulary,
    so the true size is ``vocab_size`` (else ``config``'s); there is no silent default. The output keeps the
    checkpoint's embedding rows exactly.
    """
    it_dir = megatron_files.iteration_dir(pathlib.Path(directory), iteration)
    args, ranks, names, files = _load_ranks(it_dir, allow_pickle)
    if args is None and config is None:
        raise ValueError(f"{it_dir} stores no args (saved without them), so its model sizes are unknown: pass "
                         "--config=NAME, a megajax config describing the model (and --vocab_size=N)")
    merged, tp = _merge_ranks(ranks, files), len(files)
    out = config.copy_and_resolve_references() if config is not None else config_from_args(args)
    checks.check_agreement(it_dir, checks.args_claims(args), checks.config_claims(config),
                           checks.tensor_claims(merged, names, tp))
    checks.check_shapes(merged, names, out, tp)
    rows = merged["wte"].shape[0]
    if vocab_size is None and config is not None:
        vocab = checks.vocabulary(rows, config.model.vocab_size, args, tp, it_dir, "--config model.vocab_size")
    else:
        vocab = checks.vocabulary(rows, vocab_size, args, tp, it_dir)
    megatron_multiple = ((args or {}).get("make_vocab_size_divisible_by") or 0) * tp
    out.model.vocab_size = vocab
    out.model.make_vocab_size_divisible_by = checks.megajax_divisor(
        vocab, rows, [config.model.make_vocab_size_divisible_by if config is not None else None, megatron_multiple])
    return params_from_canonical(merged, out), out


def _megatron_divisor(vocab_size: int, rows: int, divisible_by: int, tp: int) -> int:
    """args.make_vocab_size_divisible_by such that Megatron, padding to a multiple of it x ``tp``, gets ``rows``."""
    if divisible_by % tp == 0 and padded_vocab_size(vocab_size, divisible_by) == rows:
        return divisible_by // tp
    return rows // tp  # a multiple of rows itself always pads a vocabulary of at most rows to rows


def write_megatron(directory: str | pathlib.Path, params: Params, config: ml_collections.ConfigDict, tp: int, *,
                   iteration: int = 0, names: str = "legacy", dtype: str = "float32") -> pathlib.Path:
    """Writes a Megatron-LM checkpoint with ``tp`` tensor-parallel ranks into a new or empty directory (so no
    ranks or iterations of another save mix in); returns its iteration directory."""
    m = config.model
    rows = params["wte"]["embedding"].shape[0]
    if m.num_heads % tp or rows % tp:
        raise ValueError(f"tensor-parallel size {tp} must divide the heads ({m.num_heads}) and the padded "
                         f"vocabulary ({rows})")
    directory = pathlib.Path(directory)
    require_empty(directory, "the Megatron output directory")
    key_names = {"legacy": LEGACY, "core": CORE}[names]
    args = argparse.Namespace(num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_heads,
                              ffn_hidden_size=m.mlp_ratio * m.hidden_size, max_position_embeddings=m.max_seq_len,
                              padded_vocab_size=rows, tensor_model_parallel_size=tp, pipeline_model_parallel_size=1,
                              make_vocab_size_divisible_by=_megatron_divisor(m.vocab_size, rows,
                                                                             m.make_vocab_size_divisible_by, tp))
    it_dir = directory / megatron_files.iteration_name(iteration)
    for r, rank in enumerate(_split_ranks(params_to_canonical(params, config), tp)):
        sd = {}
        for name, a in rank.items():
            key, _, layer = name.partition(".")
            sd[key_names[key].format(layer) if layer else key_names[key]] = torch_io.to_torch(a, dtype)
        model = {"language_model": _nest_legacy(sd)} if names == "legacy" else sd
        (it_dir / f"mp_rank_{r:02d}").mkdir(parents=True)
        torch_io.save({"model": model, "checkpoint_version": 3.0, "iteration": iteration, "args": args},
                      it_dir / f"mp_rank_{r:02d}" / megatron_files.RANK_FILE)
    (directory / megatron_files.TRACKER).write_text(str(iteration))
    return it_dir


def _nest_legacy(sd: dict) -> dict:
    """Megatron's legacy nesting: embedding.word_embeddings.weight as dicts, encoder's keys flat."""
    out = {"embedding": {}, "encoder": {}}
    for k, v in sd.items():
        top, _, rest = k.partition(".")
        if top == "embedding":
            table, _, leaf = rest.partition(".")
            out["embedding"].setdefault(table, {})[leaf] = v
        else:
            out["encoder"][rest] = v
    return out
