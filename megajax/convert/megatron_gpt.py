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
from megajax.convert import torch_io

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


def _canonical(model_sd: dict, num_layers: int) -> dict[str, np.ndarray]:
    """One rank's tensors under canonical names (``qkv_w.3`` = layer 3's QKV weight), float32."""
    flat = {k.removeprefix("model.").removeprefix("language_model."): v for k, v in _flatten(model_sd).items()
            if not k.endswith("_extra_state")}
    core = any(k.startswith("decoder.") for k in flat)
    names = CORE if core else LEGACY
    for old, new in CORE_ALIASES if core else LEGACY_ALIASES:
        flat = {k.replace(old, new): v for k, v in flat.items()}
    out = {}
    for key, fmt in names.items():
        for i in (range(num_layers) if key in LAYER_KEYS else [None]):
            name = fmt.format(i) if i is not None else fmt
            if name not in flat:
                raise KeyError(f"Megatron checkpoint has no tensor {name!r} (found e.g. {sorted(flat)[:4]})")
            out[f"{key}.{i}" if i is not None else key] = torch_io.to_numpy(flat[name]) \
                if not isinstance(flat[name], np.ndarray) else flat[name].astype(np.float32)
    return out


def _merge_ranks(ranks: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    merged = {}
    for name in ranks[0]:
        dim = SPLIT_DIM.get(name.split(".")[0])
        parts = [r[name] for r in ranks]
        if dim is None:
            if any(not np.array_equal(parts[0], p) for p in parts[1:]):
                raise ValueError(f"replicated tensor {name} differs between tensor-parallel ranks")
            merged[name] = parts[0]
        else:
            merged[name] = np.concatenate(parts, axis=dim)
    return merged


def _split_ranks(full: dict[str, np.ndarray], tp: int) -> list[dict[str, np.ndarray]]:
    return [{name: (np.split(a, tp, axis=SPLIT_DIM[name.split(".")[0]])[r]
                    if name.split(".")[0] in SPLIT_DIM else a) for name, a in full.items()} for r in range(tp)]


def params_from_canonical(c: dict[str, np.ndarray], config: ml_collections.ConfigDict) -> Params:
    m = config.model
    h, nh, L = m.hidden_size, m.num_heads, m.num_layers
    d = h // nh

    def stack(key, fn=lambda x: x):
        return np.stack([fn(c[f"{key}.{i}"]) for i in range(L)])

    rows = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by)
    wte = np.zeros((rows, h), np.float32)
    n = min(rows, c["wte"].shape[0])
    wte[:n] = c["wte"][:n]  # Megatron pads to its own multiple; rows past the true vocabulary are never used
    return {
        "wte": {"embedding": wte}, "wpe": c["wpe"], "ln_f": {"scale": c["lnf_w"], "bias": c["lnf_b"]},
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


def _iteration_dir(directory: pathlib.Path, iteration: int | None) -> pathlib.Path:
    if iteration is None:
        tracker = directory / "latest_checkpointed_iteration.txt"
        if not tracker.is_file():
            raise FileNotFoundError(f"{tracker} not found: give --iteration or a Megatron checkpoint directory")
        text = tracker.read_text().strip()
        return directory / ("release" if text == "release" else f"iter_{int(text):07d}")
    return directory / f"iter_{iteration:07d}"


def config_from_args(args: argparse.Namespace | dict, vocab_size: int) -> ml_collections.ConfigDict:
    """A megajax config from the Megatron ``args`` stored in a checkpoint."""
    a = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
    c = base_config()
    h = a["hidden_size"]
    c.model.update(vocab_size=vocab_size, num_layers=a["num_layers"], hidden_size=h,
                   num_heads=a["num_attention_heads"], max_seq_len=a["max_position_embeddings"],
                   mlp_ratio=(a.get("ffn_hidden_size") or 4 * h) // h)
    return c


def read_megatron(directory: str | pathlib.Path, config: ml_collections.ConfigDict | None = None, *,
                  iteration: int | None = None, vocab_size: int = 50257,
                  allow_pickle: bool = False) -> tuple[Params, ml_collections.ConfigDict]:
    """(megajax parameters, config) from a Megatron-LM checkpoint at any tensor-parallel degree."""
    it_dir = _iteration_dir(pathlib.Path(directory), iteration)
    rank_dirs = sorted(p for p in it_dir.glob("mp_rank_*") if p.is_dir())
    if not rank_dirs:
        raise FileNotFoundError(f"no mp_rank_NN directories in {it_dir}")
    if any(re.fullmatch(r"mp_rank_\d+_\d+", p.name) for p in rank_dirs):
        raise ValueError(f"{it_dir} is pipeline-parallel (mp_rank_TT_PPP); convert it with pipeline size 1 first")
    checkpoints = [torch_io.load(p / "model_optim_rng.pt", allow_pickle) for p in rank_dirs]
    if config is None:
        if "args" not in checkpoints[0]:
            raise ValueError("the checkpoint stores no args: pass a megajax --config describing the model")
        config = config_from_args(checkpoints[0]["args"], vocab_size)
    version = checkpoints[0].get("checkpoint_version", 0)
    if version < 2:
        raise ValueError(f"checkpoint_version {version}: QKV rows are not interleaved per head; only >= 2 is supported")
    ranks = [_canonical(ck["model"], config.model.num_layers) for ck in checkpoints]
    return params_from_canonical(_merge_ranks(ranks), config), config


def write_megatron(directory: str | pathlib.Path, params: Params, config: ml_collections.ConfigDict, tp: int, *,
                   iteration: int = 0, names: str = "legacy", dtype: str = "float32") -> pathlib.Path:
    """Writes a Megatron-LM checkpoint with ``tp`` tensor-parallel ranks; returns its iteration directory."""
    m = config.model
    if m.num_heads % tp or params["wte"]["embedding"].shape[0] % tp:
        raise ValueError(f"tensor-parallel size {tp} must divide the heads ({m.num_heads}) and the padded vocabulary")
    key_names = {"legacy": LEGACY, "core": CORE}[names]
    args = argparse.Namespace(num_layers=m.num_layers, hidden_size=m.hidden_size, num_attention_heads=m.num_heads,
                              ffn_hidden_size=m.mlp_ratio * m.hidden_size, max_position_embeddings=m.max_seq_len,
                              padded_vocab_size=params["wte"]["embedding"].shape[0], tensor_model_parallel_size=tp,
                              pipeline_model_parallel_size=1, make_vocab_size_divisible_by=m.make_vocab_size_divisible_by)
    it_dir = pathlib.Path(directory) / f"iter_{iteration:07d}"
    for r, rank in enumerate(_split_ranks(params_to_canonical(params, config), tp)):
        sd = {}
        for name, a in rank.items():
            key, _, layer = name.partition(".")
            sd[key_names[key].format(layer) if layer else key_names[key]] = torch_io.to_torch(a, dtype)
        model = {"language_model": _nest_legacy(sd)} if names == "legacy" else sd
        (it_dir / f"mp_rank_{r:02d}").mkdir(parents=True, exist_ok=True)
        torch_io.save({"model": model, "checkpoint_version": 3.0, "iteration": iteration, "args": args},
                      it_dir / f"mp_rank_{r:02d}" / "model_optim_rng.pt")
    (pathlib.Path(directory) / "latest_checkpointed_iteration.txt").write_text(str(iteration))
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
