"""Hugging Face model directories: ``config.json``, the weight files, and which converter takes which model_type."""

from __future__ import annotations

import json
import pathlib
from types import ModuleType

import numpy as np

from megajax.convert import hf_bert, hf_deepseek, hf_gpt2, hf_llama, hf_moe, torch_io
from megajax.convert.paths import require_empty

# config.json "model_type" -> the module converting it (it defines HF_CLASSES, config_from_hf, params_from_hf,
# params_to_hf, hf_config; and as_held(hf, sd), config.json as the weights hold it, where that can differ:
# DeepSeek's multi-token prediction layers).
CONVERTERS: dict[str, ModuleType] = {
    "gpt2": hf_gpt2,
    "bert": hf_bert,
    "megatron-bert": hf_bert,
    "llama": hf_llama,
    "mixtral": hf_moe,
    "qwen3_moe": hf_moe,
    "deepseek_v3": hf_deepseek,
}
# megajax config.model.name -> the module writing that model as HF weights (hf_config picks the model_type).
WRITERS: dict[str, ModuleType] = {"gpt": hf_gpt2, "bert": hf_bert, "llama": hf_llama, "moe": hf_moe,
                                  "deepseek": hf_deepseek}


def read_config(directory: str | pathlib.Path) -> dict:
    """The ``config.json`` of an HF model directory (what ``save_pretrained`` writes)."""
    path = pathlib.Path(directory) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{directory} has no config.json: give a directory written by save_pretrained")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e})") from None


def converter_for(hf: dict, directory: str | pathlib.Path) -> ModuleType:
    """The converter module for an HF config; ValueError naming the supported model types otherwise."""
    model_type = hf.get("model_type")
    if model_type in CONVERTERS:
        return CONVERTERS[model_type]
    classes = f" ({', '.join(hf['architectures'])})" if hf.get("architectures") else ""
    supported = ", ".join(f"{name} ({module.HF_CLASSES[name]})" for name, module in CONVERTERS.items())
    raise ValueError(f"{pathlib.Path(directory) / 'config.json'} is model_type {model_type!r}{classes}; "
                     f"megajax converts only: {supported}")


def writer_for(name: str) -> ModuleType:
    """The converter module writing a megajax model of family ``name`` (``config.model.name``) as HF weights."""
    if name not in WRITERS:
        raise ValueError(f"model.name={name!r} has no Hugging Face conversion; megajax converts {sorted(WRITERS)}")
    return WRITERS[name]


def read_weights(directory: str | pathlib.Path, allow_pickle: bool = False) -> dict[str, np.ndarray]:
    """The state dict of an HF model directory: model.safetensors or pytorch_model.bin, either possibly sharded."""
    d = pathlib.Path(directory)
    for name, load in (("model.safetensors", _load_safetensors), ("pytorch_model.bin", _load_torch)):
        if (d / name).is_file():
            return load(d / name, allow_pickle)
        index = d / f"{name}.index.json"
        if index.is_file():  # shards listed in weight_map (tensor name -> file)
            sd = {}
            for shard in sorted(set(json.loads(index.read_text())["weight_map"].values())):
                sd.update(load(d / shard, allow_pickle))
            return sd
    raise FileNotFoundError(f"{d} has neither model.safetensors nor pytorch_model.bin (nor a sharded .index.json)")


def _load_safetensors(path: pathlib.Path, allow_pickle: bool) -> dict[str, np.ndarray]:
    del allow_pickle  # safetensors holds no code
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    try:
        try:
            return load_file(str(path))
        except TypeError:  # numpy has no bfloat16, so safetensors.numpy refuses BF16 files (most Llama checkpoints)
            import jax
            from safetensors.flax import load_file as load_jax_file

            with jax.default_device(jax.local_devices(backend="cpu")[0]):  # host memory, whatever the accelerator
                return {name: np.asarray(a) for name, a in load_jax_file(str(path)).items()}  # ml_dtypes' bfloat16
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path} cannot be read as safetensors ({e}): the file is missing, truncated or damaged; "
                         "copy or download it again") from None


def _load_torch(path: pathlib.Path, allow_pickle: bool) -> dict[str, np.ndarray]:
    return {k: torch_io.to_numpy(v) for k, v in torch_io.load(path, allow_pickle).items()}


def write(directory: str | pathlib.Path, sd: dict[str, np.ndarray], hf: dict) -> None:
    """Writes ``model.safetensors`` and ``config.json`` into a new or empty directory."""
    from safetensors.numpy import save_file

    d = pathlib.Path(directory)
    require_empty(d, "the HF output directory")
    d.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    write_config(d, hf)


def write_config(directory: str | pathlib.Path, hf: dict) -> None:
    """Writes (or replaces) an HF model directory's ``config.json``."""
    (pathlib.Path(directory) / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
