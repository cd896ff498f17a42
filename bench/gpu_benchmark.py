"""The GPU figures in one command, the first thing to run on a new GPU (about 9 minutes on one H100 host): gpt_1p2b and
llama3p2_1b trained on every local GPU, each with megajax's XLA options and without (``parallel.xla_options``), and
each as ``mesh.auto`` plans it (``megajax.tools.auto_plan``: the scaling model's mesh, micro-batch, remat and
switches for these GPUs at the same global batch), whose measured step checks the fitted ``dgx_h100`` prediction,
and on GPUs with FP8 tensor cores (Ada, Hopper) once more as planned with ``train.precision=fp8`` (``--no-fp8``:
skip). Before them (``--no-kernels``: skip), megajax's Pallas grouped GEMM, the experts' GEMMs on NVIDIA GPUs, against
XLA's ``ragged_dot`` (a few seconds). Its first lines say what it will measure and about how long that takes.

    python bench/gpu_benchmark.py                              # gpt_1p2b and llama3p2_1b on all local GPUs
    python bench/gpu_benchmark.py --configs=gpt_8p3b --mesh=1x8 --micro_batch=4 --steps=20
    python bench/gpu_benchmark.py --allow_cpu --configs=gpt_tiny --seq=128 --steps=2   # checks the script only

Per config: half precision (bf16; fp16 before Ampere, e.g. V100, which has no bf16 tensor cores), dropout off
(cuDNN's flash attention has none: with it off, ``jax.nn.dot_product_attention`` runs cuDNN, see
``megajax.models.transformer.attention_implementation``; so the figures are not those of a run with Megatron's
dropout), sequence 1024, the mesh ``--mesh`` or all GPUs as data
parallel over the config's model-parallel degree, ``--micro_batch`` sequences per data replica, and the lightest
recomputation (none, selective, full) whose planned peak fits the GPU's memory (``memory_planner.memory_report`` with
``gpu=True``, within 0.92-1.15 of the compiled H100 plans in bench/README.md).
The step is compiled ahead of time, 2 warm-up steps are untimed, then ``--steps`` steps are timed. Printed per
config: tokens/s, model TFLOP/s per GPU (Megatron's formula, no recomputation counted) and MFU against the
datasheet peak (``megajax.training.metrics.PEAK_FLOPS``; an unlisted GPU gets no MFU rather than a guess).
Each config is compiled and timed twice, with megajax's XLA options and with none (``--options=both``; ``on`` or
``off`` for one), then once more as planned (``--planned``, on by default; the plan's predicted step beside the
measured one), and the device's peak memory is printed beside the compiled plan and the planner's prediction
(``memory_planner.memory_report``), which ``bench/gpu_compiled.py`` made without a GPU: the first check of those
predictions. Every figure goes to ``--output`` as JSON as soon as it is measured. Without a GPU it refuses, unless
``--allow_cpu``.
"""

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

REMAT_ORDER = ("none", "selective", "full")  # cheapest recomputation first


def lightest_remat(run, micro_batch: int, device_bytes: float | None) -> str:
    """The first of ``REMAT_ORDER`` whose planned per-device peak of ``run`` (a ``RunSpec``) with that policy fits
    ``device_bytes`` (None: unknown, 'none'); 'full' if none fits (the compile then says by how much)."""
    from megajax.tools.memory_planner import memory_report
    from megajax.tools.scaling_layout import with_choices

    if device_bytes is None:
        return "none"
    for remat in REMAT_ORDER:
        planned = with_choices(run, remat=remat)
        if memory_report(planned, micro_batch, num_micro=1, gpu=True).fits(device_bytes):
            return remat
    return "full"


def half_precision_is_bf16(device) -> bool:
    """bf16 where the tensor cores have it (compute capability 8.0 on, Ampere and later; non-CUDA devices), else
    fp16 (V100, T4, ...)."""
    capability = getattr(device, "compute_capability", None)
    return capability is None or float(capability) >= 8.0


def mesh_for(mesh: str | None, config_model: int, count: int, name: str) -> tuple[int, int]:
    """(data, model): ``--mesh`` DATAxMODEL, or every device as data parallel over the config's ``mesh.model``;
    exits with a message when that does not fit the devices."""
    from megajax.cli import parse_mesh

    if mesh:
        try:
            data, model = parse_mesh(mesh)
        except ValueError as e:
            sys.exit(f"error: --{e}")
    else:
        model, data = config_model, count // config_model
    if not mesh and (data < 1 or count % model):
        sys.exit(f"error: {name} has mesh.model={model}, which does not divide the {count} device(s) here; "
                 "pass --mesh=DATAxMODEL")
    if data < 1 or model < 1 or data * model > count:
        sys.exit(f"error: --mesh={mesh} needs {data * model} devices, {count} are here")
    return data, model


COMPILE_S = 60  # assumed per run (setup, compile, two warm-up steps) until a GPU has measured it


def with_precision(config, precision: str):
    """A copy of ``config`` training in ``precision``."""
    copy = config.copy_and_resolve_references()
    copy.train.precision = precision
    return copy


def has_fp8(device) -> bool:
    """Whether ``device`` is an NVIDIA GPU with FP8 tensor cores (``parallel.fp8``)."""
    from megajax.parallel.fp8 import fp8_refusal, nvidia_capability

    capability = nvidia_capability(device)
    return capability is not None and not fp8_refusal(device.device_kind, capability)


def grouped_gemm_check(on_gpu: bool, repeats: int = 10) -> dict:
    """megajax's Pallas grouped GEMM (``parallel/grouped_gemm``, the experts' GEMMs on NVIDIA GPUs, never yet run on
    one) against XLA's ``ragged_dot`` on this device, forward and both gradients in bf16: 8 experts' groups filling
    half of a 16,384-row buffer (the exchange's room), 2,048 x 1,408 weights (DeepSeek-V2-Lite's expert). Returns the
    largest difference relative to the largest value and each one's milliseconds (off a GPU: the kernel in
    interpret mode, a tenth of the rows, to check the script only)."""
    import time

    import jax
    import jax.numpy as jnp

    from megajax.parallel.grouped_gemm import grouped_gemm

    rows, k, n, groups = (16384, 2048, 1408, 8) if on_gpu else (1024, 256, 128, 8)
    keys = jax.random.split(jax.random.key(0), 3)
    lhs = jax.random.normal(keys[0], (rows, k), jnp.bfloat16)
    rhs = (jax.random.normal(keys[1], (groups, k, n), jnp.float32) / k ** 0.5).astype(jnp.bfloat16)
    weight = jax.random.normal(keys[2], (rows, n), jnp.float32)
    sizes = jnp.full((groups,), rows // 2 // groups, jnp.int32).at[0].add(37).at[1].add(-37)  # uneven groups
    out, times = {}, {}
    for how in ("xla", "pallas" if on_gpu else "interpret"):
        f = jax.jit(jax.value_and_grad(lambda a, b, how=how: (grouped_gemm(a, b, sizes, how).astype(jnp.float32)
                                                              * weight).sum(), argnums=(0, 1)))
        result = jax.block_until_ready(f(lhs, rhs))
        start = time.perf_counter()
        for _ in range(repeats):
            jax.block_until_ready(f(lhs, rhs))
        times[how], out[how] = (time.perf_counter() - start) / repeats * 1e3, result
    ours, theirs = out.pop("xla"), next(iter(out.values()))
    error = max(float(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max() /
                      jnp.abs(a.astype(jnp.float32)).max()) for a, b in zip(jax.tree.leaves(ours),
                                                                             jax.tree.leaves(theirs)))
    return {"check": "grouped_gemm", "rows": rows, "k": k, "n": n, "groups": groups, "max_relative_difference":
            round(error, 5), **{f"{how}_ms": round(ms, 3) for how, ms in times.items()}}


def planned_config(config, devices):
    """(a copy of ``config`` as ``mesh.auto`` plans it for ``devices``, the plan)."""
    from megajax.tools.auto_plan import plan_for_devices

    planned = config.copy_and_resolve_references()
    planned.mesh.auto = True
    return planned, plan_for_devices(planned, devices)


def opening(configs: dict, plans: dict, runs: tuple, steps: int, device, count: int, fp8_plans: dict) -> str:
    """What the benchmark will measure and about how long it takes (each run's compile assumed ``COMPILE_S``, its
    steps timed as the fitted scaling model predicts the plan's)."""
    total, lines = 0.0, []
    for name in configs:
        step = plans[name][1].prediction.step_s if name in plans else None
        each = COMPILE_S + (steps + 2) * (step or 1.0)
        n = len(runs) + (name in plans)
        total += n * each
        plan = f"; planned: --mesh={plans[name][1].prediction.mesh.flag}, micro-batch " \
               f"{plans[name][1].prediction.micro_batch}, remat={plans[name][1].prediction.run.model.remat}, " \
               f"predicted {step:.3f} s/step" if name in plans else ""
        if name in fp8_plans:
            fp8 = fp8_plans[name][1].prediction
            total += COMPILE_S + (steps + 2) * fp8.step_s
            n += 1
            plan += f"; fp8 planned: --mesh={fp8.mesh.flag}, micro-batch {fp8.micro_batch}, predicted " \
                    f"{fp8.step_s:.3f} s/step"
        then = (", then as planned" if name in plans else "") + (", then in fp8 as planned" if name in fp8_plans
                                                                   else "")
        lines.append(f"  {name}: {n} runs (XLA options {'/'.join(runs)} at the config's mesh{then}), {steps} timed "
                     f"steps after 2 warm-up{plan}")
    return (f"gpu_benchmark: {count} x {device.device_kind}; about {total / 60:.0f} minutes ({COMPILE_S} s assumed per "
            f"compile):\n" + "\n".join(lines))


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="gpt_1p2b,llama3p2_1b", help="comma-separated config names or paths")
    p.add_argument("--options", choices=("both", "on", "off"), default="both",
                   help="megajax's XLA options for the GPU: compare both, or only with (on) or without (off)")
    p.add_argument("--mesh", default=None, help="DATAxMODEL; default: all GPUs, the config's mesh.model")
    p.add_argument("--micro_batch", type=int, default=8, help="sequences per data replica per step")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--output", default="/tmp/megajax_gpu_benchmark.json")
    p.add_argument("--allow_cpu", action="store_true", help="run without a GPU (to check the script)")
    p.add_argument("--planned", action=argparse.BooleanOptionalAction, default=True,
                   help="also time each config as mesh.auto plans it for these GPUs (--no-planned: skip)")
    p.add_argument("--kernels", action=argparse.BooleanOptionalAction, default=True,
                   help="first check megajax's Pallas grouped GEMM against XLA's on this GPU (a few seconds)")
    p.add_argument("--fp8", action=argparse.BooleanOptionalAction, default=True,
                   help="also time each config as planned in train.precision=fp8 where the GPUs have FP8 tensor "
                        "cores (--no-fp8: skip)")
    args = p.parse_args(argv)
    if args.micro_batch < 1 or args.seq < 1 or args.steps < 1:
        sys.exit("error: --micro_batch, --seq and --steps must be >= 1")

    import megajax  # noqa: F401 - first: it starts jax quietly where the CUDA plugin has no GPU (megajax.platform)

    # isort: split
    import jax
    from train_throughput import measure

    from megajax.cli import load_config, start_backend
    from megajax.config import resolve
    from megajax.tools.memory_planner import memory_report
    from megajax.training.metrics import peak_flops

    start_backend()
    device, count = jax.devices()[0], jax.device_count()
    if device.platform != "gpu" and not args.allow_cpu:
        sys.exit(f"error: no GPU here (jax sees {device.platform} devices); this benchmark measures GPUs. "
                 "bench/train_throughput.py and bench/compare_peer.py run on CPUs; --allow_cpu checks this script.")
    precision = "bf16" if half_precision_is_bf16(device) else "fp16"
    # The allocator's limit (by default 75% of the GPU's memory), so the remat choice errs on the safe side.
    device_bytes = (device.memory_stats() or {}).get("bytes_limit")
    results, runs = [], {"both": ("on", "off"), "on": ("on",), "off": ("off",)}[args.options]
    configs = {}
    for name in args.configs.split(","):
        config = load_config(name)
        data, model = mesh_for(args.mesh, config.mesh.model, count, name)
        config.mesh.update(data=data, model=model)
        config.model.update(max_seq_len=args.seq, dropout=0.0)
        config.train.update(global_batch_size=args.micro_batch * data, precision=precision, steps=1000)
        config.model.remat = lightest_remat(resolve(config, count), args.micro_batch, device_bytes)
        configs[name] = config
    plans = {name: planned_config(config, jax.devices()) for name, config in configs.items()} if args.planned else {}
    fp8_plans = {name: planned_config(with_precision(config, "fp8"), jax.devices()) for name, config in
                 configs.items()} if args.fp8 and (has_fp8(device) or args.allow_cpu) else {}  # XLA:CPU emulates FP8
    print(opening(configs, plans, runs, args.steps, device, count, fp8_plans), flush=True)
    if args.kernels:
        row = grouped_gemm_check(device.platform == "gpu")
        results.append(row)
        print(f"grouped GEMM (the experts'): Pallas kernel vs XLA's ragged_dot, forward and gradients in bf16, "
              f"{row['rows']} rows half filled: largest difference {row['max_relative_difference']:.2e} of the "
              f"largest value; " + ", ".join(f"{k.removesuffix('_ms')} {v:.2f} ms" for k, v in row.items()
                                             if k.endswith("_ms")), flush=True)
        pathlib.Path(args.output).write_text(json.dumps(results, indent=1) + "\n")
    for name, config in configs.items():
        planned = memory_report(resolve(config, count), args.micro_batch, num_micro=1, gpu=True).peak_bytes
        variants = [(options, config, None) for options in runs]
        if name in plans:
            variants.append(("on", *plans[name]))
        if name in fp8_plans:
            variants.append(("on", *fp8_plans[name]))
        for options, run_config, plan in variants:
            fp8 = run_config.train.precision == "fp8"
            row = {"config": name, "xla_options": options, "precision": run_config.train.precision,
                   "setting": ("fp8 planned" if fp8 else "planned") if plan else "config",
                   **measure(run_config, args.steps, warmup=2, options=None if options == "on" else {})}
            if plan:
                row.update(plan=plan.prediction.mesh.flag, predicted_step_s=round(plan.prediction.step_s, 4),
                           micro_batch=plan.prediction.micro_batch, planned_remat=plan.prediction.run.model.remat)
            peak = peak_flops(device, precision)  # fp8's MFU too: against the bf16 peak
            row["mfu"] = round(row["model_tflops_per_device"] * 1e12 / peak, 4) if peak else None
            row["planned_peak_bytes"] = planned
            results.append(row)
            mfu = f"{row['mfu']:.1%}" if peak else "n/a (device not in PEAK_FLOPS)"
            used = row["device_peak_bytes"]
            memory = (f"peak {used / 2**30:.1f} GiB (planned {planned / 2**30:.1f}; compiled temp "
                      f"{row['compiled_temp_bytes'] / 2**30:.1f})") if used else ""
            predicted = f"  predicted {plan.prediction.step_s:.3f} s/step, measured {row['step_s']:.3f}" if plan else ""
            print(f"{name:>12} {row['setting']:>11} options {options:>3} {row['mesh']:>5} {row['remat']:>9} "
                  f"{row['tokens_per_s']:>10,.0f} tokens/s {row['model_tflops_per_device']:>8.1f} TFLOP/s per GPU  "
                  f"MFU {mfu}  {memory}{predicted}", flush=True)
            pathlib.Path(args.output).write_text(json.dumps(results, indent=1) + "\n")  # kept if a later one fails
    return results


if __name__ == "__main__":
    from megajax.cli import exit_on_user_error

    exit_on_user_error(main)
