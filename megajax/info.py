"""Model size and per-device memory for a config and mesh, without allocating the model.

    python -m megajax.info --config=configs/gpt_8p3b.py --mesh=64x8 --device_memory_gb=32

Counts come from ``jax.eval_shape`` and the sharding rules, so the mesh can be far larger than the host.
Training state is fp32 master parameters, fp32 gradients and AdamW's two fp32 moments: 16 bytes per parameter,
as in the paper's accounting, divided by the model-parallel degree for the sharded weights (LayerNorms, position
embeddings and row-parallel biases stay replicated).
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import jax
import ml_collections
from flax import nnx

from megajax.config import model_config, resolve_precision, rules_of, validate
from megajax.builder import abstract_model
from megajax.cli import load_config
from megajax.sharding import logical_to_spec

GiB = 1024**3


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Per-device memory in bytes for one (data, model) mesh."""

    num_params: int
    params_per_device: int
    param_bytes: int  # fp32 master
    grad_bytes: int  # fp32
    optimizer_bytes: int  # AdamW m and v, fp32
    activation_bytes: int  # estimate for one micro-batch
    data: int
    model: int

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes


def params_per_device(config: ml_collections.ConfigDict, mesh_shape: dict[str, int]) -> tuple[int, int]:
    """(total parameters, parameters held by one device) for a mesh given as ``{'data': D, 'model': M}``."""
    rules = rules_of(config)
    state = nnx.state(abstract_model(config))
    total = per_device = 0
    for var in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        spec = logical_to_spec(var.get_metadata()["out_sharding"], rules)
        shards = math.prod(mesh_shape[a] for a in spec if a is not None)
        total += math.prod(var.shape)
        per_device += math.prod(var.shape) // shards
    return total, per_device


def activation_bytes(config: ml_collections.ConfigDict, micro_batch: int, tp: int, bytes_per_value: int) -> int:
    """Activation estimate per device after Korthikanti et al. 2022 (Eq. 2, no sequence parallelism).

    One layer keeps s*b*h*(10 + 24/t + 5*a*s/(h*t)) bytes at 16-bit; ``selective`` recomputation drops the
    attention core's 5*a*s/(h*t) term (its s x s tensors); with full recompute (and ``save_dots``, counted alike)
    only each layer's input (2*s*b*h bytes) is kept, plus one layer recomputed at a time. Scaled by
    bytes_per_value/2 for fp32.
    """
    m = config.model
    s, b, h, a, L = m.max_seq_len, micro_batch, m.hidden_size, m.num_heads, m.num_layers
    core = 0 if m.remat == "selective" else 5 * a * s / (h * tp)
    per_layer = s * b * h * (10 + 24 / tp + core)
    kept = L * 2 * s * b * h + per_layer if m.remat in ("full", "save_dots") else L * per_layer
    logits = 4 * s * b * model_config(config).padded_vocab_size / tp * 2  # fp32 logits and their gradient
    return int(kept * bytes_per_value / 2 + logits)


def memory_report(config: ml_collections.ConfigDict, data: int, model: int, micro_batch: int = 1) -> MemoryReport:
    """Per-device memory of training ``config`` on a ``data x model`` mesh."""
    config = ml_collections.ConfigDict(config)
    config.mesh.data, config.mesh.model = data, model
    validate(config, data * model)
    total, local = params_per_device(config, {"data": data, "model": model})
    act_width = 4 if resolve_precision(config.train.get("precision", "auto")) == "fp32" else 2
    zero = config.get("parallel", {}).get("shard_optimizer", False)  # ZeRO-1: moments split over data too
    return MemoryReport(total, local, 4 * local, 4 * local, 8 * local // (data if zero else 1),
                        activation_bytes(config, micro_batch, model, act_width), data, model)


def format_report(r: MemoryReport, device_memory_gb: float | None) -> str:
    g = lambda x: f"{x / GiB:8.2f} GiB"  # noqa: E731
    lines = [
        f"parameters           {r.num_params:,} ({r.num_params / 1e9:.3f} B)",
        f"mesh                 data={r.data} x model={r.model} ({r.data * r.model} devices)",
        f"params per device    {r.params_per_device:,}",
        f"  fp32 parameters    {g(r.param_bytes)}",
        f"  fp32 gradients     {g(r.grad_bytes)}",
        f"  AdamW m, v (fp32)  {g(r.optimizer_bytes)}"
        + ("  (split over data: parallel.shard_optimizer)" if r.optimizer_bytes < 8 * r.params_per_device else ""),
        f"  = model state      {g(r.param_bytes + r.grad_bytes + r.optimizer_bytes)}"
        f"  ({(r.param_bytes + r.grad_bytes + r.optimizer_bytes) / r.num_params:.2f} bytes/param of the whole model)",
        f"  activations (est.) {g(r.activation_bytes)}",
        f"  total              {g(r.total_bytes)}",
    ]
    if device_memory_gb:
        fits = r.total_bytes <= device_memory_gb * GiB
        lines.append(f"fits a {device_memory_gb:g} GiB device: {'yes' if fits else 'NO'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="config file, path or bare name (gpt_8p3b)")
    p.add_argument("--mesh", default=None, help="DATAxMODEL, e.g. 64x8 (default: the config's, data=1)")
    p.add_argument("--micro_batch", type=int, default=None, help="sequences per device for the activation estimate")
    p.add_argument("--device_memory_gb", type=float, default=None, help="say whether it fits this much memory")
    args = p.parse_args(argv)
    config = load_config(args.config)
    if args.mesh:
        data, model = (int(x) for x in args.mesh.lower().split("x"))
    else:
        data, model = max(config.mesh.data, 1), config.mesh.model
    micro = args.micro_batch or config.train.micro_batch_size or 1
    print(format_report(memory_report(config, data, model, micro), args.device_memory_gb))


if __name__ == "__main__":
    main()
