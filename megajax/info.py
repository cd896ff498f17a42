"""Model size and per-device memory for a config and mesh, without allocating the model.

    python -m megajax.info --config=configs/gpt_8p3b.py --mesh=64x8 --device_memory_gb=32 --precision=fp16
    python -m megajax.info --config=gpt_tiny --mesh=2x4 --cpu_devices=8 --compiled
    python -m megajax.info --config=gpt_8p3b --mesh=64x8 --precision=fp16 --sequence  # parallel.sequence

Counts come from ``jax.eval_shape`` and the sharding rules, so the mesh can be far larger than the host.
Training state is fp32 master parameters, fp32 gradients and AdamW's two fp32 moments: 16 bytes per parameter,
as in the paper's accounting, divided by the model-parallel degree for the sharded weights (LayerNorms, position
embeddings and row-parallel biases stay replicated). The step's peak adds what ``megajax.memory_planner`` counts
(the activations JAX keeps, ZeRO-1's split gradients, the batch); ``--compiled``
prints it beside the compiled step's own memory plan (``memory_analysis()``; needs the mesh's devices).
``--sequence`` turns on sequence parallelism: the activations of the LayerNorm, dropout and residual regions are
split over ``model`` too.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":  # --cpu_devices must act before jax is imported
    from megajax.cli import simulate_cpu_devices

    simulate_cpu_devices(sys.argv)

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import math  # noqa: E402

import jax  # noqa: E402
import ml_collections  # noqa: E402
from flax import nnx  # noqa: E402

from megajax.builder import abstract_model  # noqa: E402
from megajax.cli import add_parallel_flags, apply_parallel_flags, load_config, parse_mesh  # noqa: E402
from megajax.config import rules_of, sequence_parallel, state_split, validate  # noqa: E402
from megajax.memory_planner import (FP32, Activations, CompiledMemory, activations, compiled_memory,  # noqa: E402
                                    gradient_bytes, word_embedding_grad_bytes)
from megajax.sharding import fsdp_spec, logical_to_spec, spec_axes  # noqa: E402
from megajax.training.objectives import objective_for  # noqa: E402

GiB = 1024**3
MAX_MICRO_BATCH = 1 << 16  # the search for the largest micro-batch stops here


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Per-device memory in bytes for one (data, model) mesh and micro-batch."""

    num_params: int
    params_per_device: int
    param_bytes: int  # fp32 master
    grad_bytes: int  # fp32, one per parameter held (the paper's accounting)
    optimizer_bytes: int  # AdamW m and v, fp32 (split over data with parallel.shard_optimizer or fsdp)
    activation_bytes: int  # one micro-batch: activations.total
    data: int
    model: int
    activations: Activations  # the activation estimate's parts
    step_grad_bytes: int  # gradients as the compiled step holds them (split over data with ZeRO-1, FSDP)
    batch_bytes: int  # the step's input batch on this device
    sequence: bool = False  # parallel.sequence: the residual stream's activations split over model
    fsdp: bool = False  # parallel.fsdp: params_per_device counts each device's data shard of them
    late_grad_bytes: int = 0  # gradients not yet written at the head's peak (the tied word embedding's)

    @property
    def total_bytes(self) -> int:
        """The paper's accounting: 16 bytes per parameter held plus the activations."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes

    @property
    def state_bytes(self) -> int:
        """The step's donated state: parameters and moments (the compiled arguments less the batch)."""
        return self.param_bytes + self.optimizer_bytes

    @property
    def temp_bytes(self) -> int:
        """What the step allocates besides its arguments (compare ``CompiledMemory.temp``): the gradients and the
        layers' activations, then the larger of the head at the start of the backward pass (before the tied word
        embedding's gradient is written) and one recomputed layer."""
        a = self.activations
        return self.step_grad_bytes + a.layers + max(a.head - self.late_grad_bytes, a.recompute)

    @property
    def peak_bytes(self) -> int:
        """The step's peak on one device (compare ``CompiledMemory.peak``); what ``fits`` checks."""
        return self.state_bytes + self.batch_bytes + self.temp_bytes

    def fits(self, device_bytes: float) -> bool:
        return self.peak_bytes <= device_bytes


def params_per_device(config: ml_collections.ConfigDict, mesh_shape: dict[str, int],
                      split_over_data: bool = False) -> tuple[int, int]:
    """(total parameters, parameters held by one device) for a mesh given as ``{'data': D, 'model': M}``, as the
    rules lay them out, or with ``split_over_data`` as ``parallel.fsdp`` stores them (``sharding.fsdp_spec``)."""
    rules = rules_of(config)
    state = nnx.state(abstract_model(config))
    total = per_device = 0
    for var in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable)):
        names = var.get_metadata()["out_sharding"]
        spec = fsdp_spec(names, var.shape, rules, mesh_shape) if split_over_data else logical_to_spec(names, rules)
        total += math.prod(var.shape)
        per_device += math.prod(var.shape) // math.prod(mesh_shape[a] for a in spec_axes(spec))
    return total, per_device


def activation_bytes(config: ml_collections.ConfigDict, micro_batch: int, tp: int, bytes_per_value: int) -> int:
    """Activation bytes per device for one micro-batch with ``bytes_per_value``-byte (4: fp32, 2: 16-bit) compute
    (``megajax.memory_planner.activations``: the residuals JAX keeps per layer, the head or one recomputed layer)."""
    config = ml_collections.ConfigDict(config)
    config.train.precision = "fp32" if bytes_per_value == FP32 else "bf16"
    return activations(config, micro_batch, tp).total


def _num_micro(config: ml_collections.ConfigDict, data: int, micro_batch: int) -> int:
    """Accumulation steps the config's global batch implies at this micro-batch (1 if it does not divide)."""
    steps, rest = divmod(config.train.global_batch_size, micro_batch * data)
    return max(steps, 1) if not rest else 1


def memory_report(config: ml_collections.ConfigDict, data: int, model: int, micro_batch: int = 1,
                  num_micro: int | None = None) -> MemoryReport:
    """Per-device memory of training ``config`` on a ``data x model`` mesh, ``micro_batch`` sequences per device
    per accumulation step (``num_micro`` steps; default: what the config's global batch implies)."""
    config = ml_collections.ConfigDict(config)
    config.mesh.data, config.mesh.model = data, model
    validate(config, data * model)
    moments_split, fsdp = state_split(config)  # FSDP: parameters, so gradients and moments, split over data
    zero = moments_split and not fsdp  # ZeRO-1: the moments and gradients only
    total, local = params_per_device(config, {"data": data, "model": model}, split_over_data=fsdp)
    num_micro = num_micro or _num_micro(config, data, micro_batch)
    optimizer = 8 * local // (data if zero else 1)
    act = activations(config, micro_batch, model)
    fields = objective_for(config.model.name).fields(config.model.max_seq_len).values()
    batch = micro_batch * num_micro * sum(math.prod(f.row_shape) * f.dtype.itemsize for f in fields)
    late = word_embedding_grad_bytes(config, data, model, split_over_data=moments_split)
    return MemoryReport(total, local, FP32 * local, FP32 * local, optimizer, act.total, data, model, act,
                        gradient_bytes(local, data, zero, num_micro), batch, sequence_parallel(config), fsdp, late)


def largest_micro_batch(config: ml_collections.ConfigDict, data: int, model: int, device_bytes: float) -> int:
    """The largest micro-batch whose step peak (by formula, no accumulation) fits ``device_bytes``; 0 if none."""
    one = memory_report(config, data, model, 1, num_micro=1)  # only the activations and the batch grow with it

    def fits(micro_batch: int) -> bool:
        act = activations(config, micro_batch, model)
        return dataclasses.replace(one, activation_bytes=act.total, activations=act,
                                   batch_bytes=one.batch_bytes * micro_batch).fits(device_bytes)

    if not fits(1):
        return 0
    low, high = 1, 2  # fits(low); double high until it does not fit, then bisect
    while high <= MAX_MICRO_BATCH and fits(high):
        low, high = high, 2 * high
    if high > MAX_MICRO_BATCH:
        return low
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def _g(x: float) -> str:
    return f"{x / GiB:10.3f} GiB"


def format_report(r: MemoryReport, device_memory_gb: float | None,
                  largest: int | None = None) -> str:
    a = r.activations
    state = r.param_bytes + r.grad_bytes + r.optimizer_bytes
    lines = [
        f"parameters           {r.num_params:,} ({r.num_params / 1e9:.3f} B)",
        f"mesh                 data={r.data} x model={r.model} ({r.data * r.model} devices)",
        f"params per device    {r.params_per_device:,}" + ("  (split over data: parallel.fsdp)" if r.fsdp else ""),
        f"  fp32 parameters    {_g(r.param_bytes)}",
        f"  fp32 gradients     {_g(r.grad_bytes)}",
        f"  AdamW m, v (fp32)  {_g(r.optimizer_bytes)}"
        + ("  (split over data: parallel.shard_optimizer)" if r.optimizer_bytes < 8 * r.params_per_device else ""),
        f"  = model state      {_g(state)}  ({state / r.num_params:.2f} bytes/param of the whole model)",
        f"  activations (est.) {_g(r.activation_bytes)}  (layers {a.layers / GiB:.3f}, then the larger of the head "
        f"{a.head / GiB:.3f} and one recomputed layer {a.recompute / GiB:.3f})"
        + ("  (LayerNorm / dropout / residual split over model: parallel.sequence)" if r.sequence else ""),
        f"  total              {_g(r.total_bytes)}",
        f"step peak (est.)     {_g(r.peak_bytes)}  (+ gradients as held {r.step_grad_bytes / GiB:.3f}, batch)",
    ]
    if device_memory_gb:
        lines.append(f"fits a {device_memory_gb:g} GiB device: {'yes' if r.fits(device_memory_gb * GiB) else 'NO'}")
        if largest is not None:
            lines.append(f"largest micro-batch that fits: {largest}" + ("" if largest else " (not even 1)"))
    return "\n".join(lines)


def compare_rows(r: MemoryReport, c: CompiledMemory) -> list[tuple[str, int, int]]:
    """(quantity, formula bytes, compiled bytes) for what XLA's memory plan separates."""
    return [("state (params + moments)", r.state_bytes, c.state), ("batch", r.batch_bytes, c.batch),
            ("temp (grads + activations)", r.temp_bytes, c.temp), ("peak", r.peak_bytes, c.peak)]


def format_comparison(r: MemoryReport, c: CompiledMemory) -> str:
    mib = lambda x: f"{x / 2**20:12.1f} MiB"  # noqa: E731
    lines = [f"{'':42s} {'formula':>16s} {'compiled':>16s}  ratio (compiled / formula)"]
    for name, formula, compiled in compare_rows(r, c):
        lines.append(f"{name:42s} {mib(formula)} {mib(compiled)}  {compiled / formula:.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="config file, path or bare name (gpt_8p3b)")
    p.add_argument("--mesh", default=None, help="DATAxMODEL, e.g. 64x8 (default: the config's, data=1)")
    p.add_argument("--micro_batch", type=int, default=None, help="sequences per device per accumulation step "
                   "(default: the config's; global batch / data without accumulation)")
    p.add_argument("--device_memory_gb", type=float, default=None, help="say whether it fits this much memory")
    p.add_argument("--precision", default=None, help="fp32 | bf16 | fp16 (default: the config's; auto is fp32 "
                                                     "on a CPU host)")
    p.add_argument("--compiled", action="store_true", help="also compile the step (abstract inputs, nothing "
                                                           "allocated) and print XLA's memory plan beside the formula")
    p.add_argument("--cpu_devices", type=int, default=0, help="simulate N CPU devices (applied before jax starts)")
    add_parallel_flags(p)
    args = p.parse_args(argv)
    config = load_config(args.config)
    apply_parallel_flags(args, config)
    if args.mesh:
        data, model = parse_mesh(args.mesh)
    else:
        data, model = max(config.mesh.data, 1), config.mesh.model
    if args.precision:
        config.train.precision = args.precision
    # the config's micro-batch; with no accumulation (0) each data shard runs its share of the global batch
    micro = args.micro_batch or config.train.micro_batch_size or max(config.train.global_batch_size // data, 1)
    report = memory_report(config, data, model, micro, num_micro=1 if args.compiled else None)
    largest = largest_micro_batch(config, data, model, args.device_memory_gb * GiB) if args.device_memory_gb else None
    print(format_report(report, args.device_memory_gb, largest))
    if args.compiled:
        if data * model > jax.device_count():
            raise SystemExit(f"--compiled needs {data * model} devices, this host has {jax.device_count()}; "
                             f"add --cpu_devices={data * model}")
        print(f"\nthe compiled step (micro-batch {micro}, no accumulation):")
        print(format_comparison(report, compiled_memory(config, data, model, micro)))


if __name__ == "__main__":
    from megajax.cli import exit_on_user_error

    exit_on_user_error(main)
