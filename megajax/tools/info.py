"""Model size and per-device memory for a config and mesh, without allocating the model.

    python -m megajax.info --config=configs/gpt_8p3b.py --mesh=64x8 --device_memory_gb=32 --precision=fp16
    python -m megajax.info --config=gpt_tiny --mesh=2x4 --cpu_devices=8 --compiled
    python -m megajax.info --config=gpt_8p3b --mesh=64x8 --precision=fp16 --sequence  # parallel.sequence
    python -m megajax.info --config=llama3_8b --config.model.max_seq_len=131072 --mesh=1x8,context=16 \
        --target=h100 --hosts=16  # does a 128K sequence fit 128 H100s with 16 context shards?

Counts come from ``jax.eval_shape`` and the sharding rules, so the mesh can be far larger than the host.
Training state is fp32 master parameters, fp32 gradients and AdamW's two fp32 moments: 16 bytes per parameter,
as in the paper's accounting, divided by the model-parallel degree for the sharded weights (LayerNorms, position
embeddings and row-parallel biases stay replicated). The step's peak adds what ``megajax.tools.memory_planner`` counts
(the activations JAX keeps, ZeRO-1's split gradients, the batch); ``--compiled``
prints it beside the compiled step's own memory plan (``memory_analysis()``; needs the mesh's devices).
``--sequence`` turns on sequence parallelism: the activations of the LayerNorm, dropout and residual regions are
split over ``model`` too. ``--config.FIELD=VALUE`` overrides a field of the config, as train.py's flags do.
"""

from __future__ import annotations

import sys

import jax

from megajax.cli import (
    ArgumentParser,
    add_parallel_flags,
    apply_config_overrides,
    apply_mesh,
    apply_parallel_flags,
    load_config,
    start_backend,
    use_cpu_devices,
)
from megajax.config import resolve
from megajax.models.transformer import attention_reason
from megajax.outputs import HLO_HEADER, Kind, claim_file, write_text
from megajax.parallel.mesh import MeshShape
from megajax.tools.gpu_target import EXTRA, TARGETS, GpuStep, check_target, compile_step
from megajax.tools.gpu_target import overlap as gpu_overlap
from megajax.tools.memory_planner import (
    CompiledMemory,
    GiB,
    MemoryReport,
    compiled_memory,
    largest_micro_batch,
    memory_report,
)
from megajax.training.metrics import model_flops_per_step


def _g(x: float) -> str:
    return f"{x / GiB:10.3f} GiB"


def format_report(r: MemoryReport, device_memory_gb: float | None,
                  largest: int | None = None) -> str:
    a = r.activations
    state = r.param_bytes + r.grad_bytes + r.optimizer_bytes
    lines = [
        f"parameters           {r.num_params:,} ({r.num_params / 1e9:.3f} B)"
        + (f", {r.active_params:,} active per token" if r.active_params != r.num_params else ""),
        f"mesh                 {' x '.join(f'{a}={n}' for a, n in r.mesh.sizes.items())} ({r.mesh.devices} devices)",
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
    if r.rough:
        lines.append(f"rough estimate: {r.rough}")
    if device_memory_gb:
        lines.append(f"fits a {device_memory_gb:.4g} GiB device: {'yes' if r.fits(device_memory_gb * GiB) else 'NO'}")
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


def format_gpu_step(step: GpuStep, model_flops: float) -> str:
    """What ``--target --compiled`` reads from the step compiled for the GPU: its memory beside the planner's, the
    attention implementation, FLOPs, and every collective with its bytes and whether it overlaps compute."""
    gpu, c, r = step.target, step.compiled, step.planned
    room = gpu.memory_bytes - c.peak
    lines = [f"\nthe step compiled for {gpu.kind} (mesh {_mesh(step)}, XLA options: "
             f"{'megajax' + chr(39) + 's' if step.options else 'none'}; compiled, not measured):",
             format_comparison(r, c),
             f"fits one {gpu.kind} ({gpu.memory_bytes / GiB:.1f} GiB): {'yes' if room >= 0 else 'NO'}, "
             f"{abs(room) / GiB:.2f} GiB {'to spare' if room >= 0 else 'over'} (compiled peak; the cuDNN workspace "
             "is not sized without the device)",
             f"attention            {step.attention}" + ("" if step.attention == "cudnn" else
                                                         "  (" + attention_reason(step.run.spec.model) + ")")]
    lines.append(f"GEMMs                {step.fp8_gemms} FP8 cuBLASLt calls, {step.gemms - step.fp8_gemms} others "
                 "(each call in the HLO once, loops not unrolled)")
    lines.append(f"model FLOPs          {model_flops / step.run.mesh.devices.size / 1e12:.4g} TFLOP per GPU per step "
                 "(the model's spec; no recomputation counted)")
    overlapped = gpu_overlap(step.hlo)
    rows: dict = {}
    for coll in step.collectives:
        key = (coll.op, ",".join(sorted(coll.axes)) or "-", coll.phase, coll.dtype, coll.elements)
        runs, names = rows.get(key, (0, set()))
        rows[key] = (runs + coll.executions, names | {coll.instruction})
    lines.append(f"collectives          {'op':<20}{'axes':<15}{'phase':<10}{'bytes':>14}{'runs':>6}  schedule")
    for (op, axes, phase, dtype, elements), (runs, names) in sorted(rows.items(), key=lambda kv: -kv[0][4] * kv[1][0]):
        nbytes = elements * jax.numpy.dtype(_DTYPES.get(dtype, dtype)).itemsize
        between = [overlapped[n][1] for n in names if n in overlapped]
        how = ("synchronous" if not between else
               f"async, {min(between)}-{max(between)} compute ops overlap" if max(between) else "async, exposed")
        lines.append(f"{'':21s}{op:<20}{axes:<15}{phase:<10}{nbytes:>14,}{runs:>6}  {how}")
    return "\n".join(lines)


_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "s32": "int32", "u32": "uint32", "s64": "int64",
           "u64": "uint64", "pred": "bool"}


def _mesh(step: GpuStep) -> str:
    shape = step.run.mesh.shape
    return "x".join(str(shape[a]) for a in step.run.mesh.axis_names)


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="config file, path or bare name (gpt_8p3b)")
    p.add_argument("--mesh", default=None, help="DATAxMODEL, e.g. 64x8, or PIPExDATAxMODEL with pipeline stages, "
                                                "then ,expert=E and / or ,context=C (default: the config's, data=1)")
    p.add_argument("--micro_batch", type=int, default=None, help="sequences per device per accumulation step "
                   "(default: the config's; global batch / data without accumulation)")
    p.add_argument("--device_memory_gb", type=float, default=None, help="say whether it fits this much memory")
    p.add_argument("--precision", default=None, help="fp32 | bf16 | fp16 | fp8 (default: the config's; auto is fp32 "
                                                     "on a CPU host)")
    p.add_argument("--compiled", action="store_true", help="also compile the step (abstract inputs, nothing "
                                                           "allocated) and print XLA's memory plan beside the formula")
    p.add_argument("--cpu_devices", type=int, default=0, help="simulate N CPU devices (applied before jax starts)")
    p.add_argument("--target", choices=sorted(TARGETS), default=None,
                   help="an NVIDIA GPU: its memory (and with --compiled, the step compiled for it on this host, "
                        f"no GPU needed; needs pip install 'megajax[{EXTRA}]')")
    p.add_argument("--hosts", type=int, default=None, help="--target: hosts of 8 GPUs (default 1; mesh.data=-1 "
                                                               "takes them all)")
    p.add_argument("--hlo", default=None, help="--target --compiled: write the optimized GPU HLO to this file")
    p.add_argument("--overwrite", action="store_true", help="--hlo: replace the file an earlier run wrote there")
    add_parallel_flags(p)
    args, overrides = p.parse_known_args(argv)
    if args.hlo and not (args.target and args.compiled):
        p.error("--hlo writes the step compiled for a GPU: give it with --target=... --compiled")
    if args.hosts is not None and not args.target:
        p.error(f"--hosts={args.hosts} counts hosts of 8 GPUs of a --target: give --target="
                f"{'/'.join(sorted(TARGETS))} with it, or leave --hosts out")
    if args.hosts is not None and args.hosts < 1:
        p.error(f"--hosts={args.hosts}: give 1 or more hosts (of 8 GPUs each)")
    if args.micro_batch is not None and args.micro_batch < 0:
        p.error(f"--micro_batch={args.micro_batch}: give the sequences per device per accumulation step (>= 1), or 0 "
                "for the config's")
    if args.device_memory_gb is not None and not args.device_memory_gb > 0:
        p.error(f"--device_memory_gb={args.device_memory_gb}: give a device's memory in GB (> 0)")
    args.hosts = args.hosts or 1
    hlo = claim_file(args.hlo, flag="hlo", overwrite=args.overwrite, kind=Kind.HLO)
    use_cpu_devices(args.cpu_devices)
    start_backend(compiles_for_gpu=bool(args.target and args.compiled))
    config = load_config(args.config)
    apply_config_overrides(config, overrides)
    apply_parallel_flags(args, config)
    if args.mesh:
        apply_mesh(config, args.mesh)
    gpus = 8 * args.hosts if args.target else None
    if gpus and config.mesh.data == -1:  # every GPU of the hosts left after the other axes
        config.mesh.data = max(gpus // MeshShape.of(config.mesh).others, 1)
    config.mesh.data = max(config.mesh.data, 1)  # without a target, the config's mesh.data=-1 plans one shard
    mesh = MeshShape.of(config.mesh)
    if args.precision:
        config.train.precision = args.precision
    elif args.target and config.train.precision == "auto":  # what auto resolves to on the GPU
        config.train.precision = "bf16"
    if args.target and args.device_memory_gb is None:
        args.device_memory_gb = TARGETS[args.target].memory_bytes / GiB
    # the config's micro-batch; with no accumulation (0) each data shard runs its share of the global batch
    micro = args.micro_batch or config.train.micro_batch_size or \
        max(config.train.global_batch_size // mesh.batch_shards, 1)
    # the planned mesh's devices, however many this host has; the micro-batch is planned as given, so the training
    # checks of the config's own batch are not made
    run = resolve(config, mesh.devices, training=False)
    if args.target:
        check_target(run, args.target, args.hosts)
    gpu = bool(args.target)  # planned as the step compiles for that GPU
    report = memory_report(run, micro, num_micro=1 if args.compiled else None, gpu=gpu)
    largest = largest_micro_batch(run, args.device_memory_gb * GiB, gpu=gpu) if args.device_memory_gb else None
    print(format_report(report, args.device_memory_gb, largest))
    if args.compiled and args.target:
        step = compile_step(run, args.target, args.hosts, micro_batch=micro)
        print(format_gpu_step(step, model_flops_per_step(step.run.spec, step.run.spec.model.max_seq_len)))
        if hlo:  # marked as megajax's, so that a later run may replace it with --overwrite
            write_text(hlo, f"{HLO_HEADER}{args.config} compiled for {step.target.kind} (mesh {_mesh(step)})\n"
                       + step.hlo)
            print(f"wrote {args.hlo}", file=sys.stderr)
    elif args.compiled:
        if mesh.devices > jax.device_count():
            raise SystemExit(f"--compiled needs {mesh.devices} devices, this host has {jax.device_count()}; "
                             f"add --cpu_devices={mesh.devices}")
        print(f"\nthe compiled step (micro-batch {micro}, no accumulation):")
        print(format_comparison(report, compiled_memory(run, micro)))
