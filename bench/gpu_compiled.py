"""The paper's and Llama's configs compiled for H100s on this CPU host: compiled memory beside the planner's, FLOPs, the
largest micro-batch that fits 80 GB, and the MFU the scaling model predicts (compiled, not measured).

    python bench/gpu_compiled.py [--cases=gpt_1p2b,llama3_8b] [--output=/tmp/megajax_gpu_compiled.json]
    python bench/gpu_compiled.py --planned    # each decoder config at its mesh.auto plan for one 8-GPU host
    python bench/gpu_compiled.py --planned --precision=fp8    # the same, the blocks' GEMMs in FP8

Per case: the config in bf16 as ``train.py`` runs it on a GPU (its remat and dropout), the mesh of the table, the
largest micro-batch whose planned peak fits one H100 (``memory_planner.largest_micro_batch``), compiled for that
micro-batch with megajax's XLA options (``megajax.tools.gpu_target``). Needs ``pip install 'megajax[gpu-compile]'``
and ptxas. Prints a markdown table (bench/README.md holds the last one) and writes every figure as JSON.
``--planned``: instead of the table's mesh, the plan ``mesh.auto`` makes for the case's GPUs on ``dgx_h100``
(``tools.auto_plan.choose_plan``: mesh, micro-batch and its accumulation steps, remat and switches; BERT is not
planned), compiled as it runs, the plan's predicted MFU and memory beside XLA's.
"""

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

# (config, hosts of 8 GPUs, mesh DATAxMODEL)
CASES = {"gpt_1p2b": (1, (8, 1)), "gpt_2p5b": (1, (4, 2)), "gpt_8p3b": (64, (64, 8)), "bert_336m": (1, (8, 1)),
         "llama3_8b": (1, (1, 8)), "llama3p2_1b": (1, (1, 8))}


def planned_row(name: str, hosts: int, precision: str = "bf16") -> dict | None:
    """The case at ``mesh.auto``'s plan for its GPUs in ``precision`` (None: a model the scaling model does not
    plan)."""
    from megajax.cli import load_config
    from megajax.config import ConfigError, resolve
    from megajax.tools.auto_plan import apply_plan, choose_plan
    from megajax.tools.gpu_target import TARGETS, compile_step
    from megajax.tools.scaling import DGX_H100, jax_memory

    config = load_config(name)
    config.train.precision = precision
    try:
        plan = choose_plan(config, 8 * hosts, jax_memory(DGX_H100))  # what mesh.auto plans on the H100s
    except ConfigError:  # a model the scaling model does not plan (BERT)
        return None
    apply_plan(config, plan)
    run = resolve(config, 8 * hosts, training=False)
    start = time.perf_counter()
    try:
        step = compile_step(run, "h100", hosts, micro_batch=plan.micro_batch, num_micro=plan.num_micro)
    except ValueError as e:  # the collective audit of a loop it cannot count (open: bench/README.md)
        return {"config": name, "hosts": hosts, "plan": plan.mesh.flag, "error": str(e)[:200]}
    gpu = TARGETS["h100"]
    return {"config": name, "hosts": hosts, "precision": precision, "fp8_gemm_calls": step.fp8_gemms,
            "plan": plan.mesh.flag, "micro_batch": plan.micro_batch,
            "accumulation_steps": plan.num_micro, "remat": run.model.remat, "sequence": run.sequence,
            "state_split": "FSDP" if run.fsdp else "ZeRO-1" if run.shard_optimizer else "none",
            "schedule": run.pipeline.schedule if run.mesh.pipe > 1 else None, "attention": step.attention,
            "compiled_peak_gib": step.compiled.peak / 2**30, "planned_peak_gib": step.planned.peak_bytes / 2**30,
            "scaling_model_gib": plan.memory_bytes / 2**30, "fits_80gb": step.compiled.peak <= gpu.memory_bytes,
            "predicted_mfu": plan.mfu, "predicted_step_s": plan.step_s, "compile_s": time.perf_counter() - start}


def row(name: str, hosts: int, mesh: tuple[int, int]) -> dict:
    from megajax.cli import load_config
    from megajax.config import resolve
    from megajax.tools.gpu_target import TARGETS, compile_step
    from megajax.tools.memory_planner import largest_micro_batch
    from megajax.tools.scaling import DGX_H100, predict
    from megajax.training.metrics import model_flops_per_step

    config = load_config(name)
    config.mesh.data, config.mesh.model = mesh
    config.train.precision = "bf16"
    run = resolve(config, mesh[0] * mesh[1], training=False)  # the micro-batch is chosen below
    gpu = TARGETS["h100"]
    largest = largest_micro_batch(run, gpu.memory_bytes, gpu=True)
    micro = max(min(largest, run.global_batch // mesh[0]), 1)
    start = time.perf_counter()
    step = compile_step(run, "h100", hosts, micro_batch=micro)
    seconds = time.perf_counter() - start
    spec = step.run.spec
    devices = step.run.mesh.devices.size
    flops = model_flops_per_step(spec, spec.model.max_seq_len) / devices
    prediction = predict(run, run.mesh, micro * mesh[0], DGX_H100, micro) if spec.model_spec.causal_lm else None
    return {"config": name, "hosts": hosts, "mesh": f"{mesh[0]}x{mesh[1]}", "remat": spec.model.remat,
            "micro_batch": micro, "largest_micro_batch_planned": largest, "attention": step.attention,
            "compiled_peak_gib": step.compiled.peak / 2**30, "planned_peak_gib": step.planned.peak_bytes / 2**30,
            "compiled_temp_gib": step.compiled.temp / 2**30, "planned_temp_gib": step.planned.temp_bytes / 2**30,
            "fits_80gb": step.compiled.peak <= gpu.memory_bytes, "model_tflop_per_device": flops / 1e12,
            "predicted_mfu": prediction.mfu if prediction else None, "compile_s": seconds}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, from {', '.join(CASES)}")
    p.add_argument("--output", default="/tmp/megajax_gpu_compiled.json")
    p.add_argument("--planned", action="store_true", help="each case at mesh.auto's plan for one 8-GPU host")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp8"), help="with --planned: the run's")
    args = p.parse_args(argv)
    if args.planned:
        return _planned(args)
    rows = []
    for name in args.cases.split(","):
        if name not in CASES:
            sys.exit(f"error: --cases: {name!r} is not one of {', '.join(CASES)}")
        rows.append(row(name, *CASES[name]))
        print(json.dumps(rows[-1]), flush=True)
        pathlib.Path(args.output).write_text(json.dumps(rows, indent=1) + "\n")
    print("\n| config | GPUs | mesh | remat | micro-batch (largest planned) | attention | peak GiB compiled / planned "
          "| model TFLOP per GPU per step | predicted MFU |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        mfu = f"{r['predicted_mfu']:.1%}" if r["predicted_mfu"] is not None else "-"
        print(f"| {r['config']} | {8 * r['hosts']} | {r['mesh']} | {r['remat']} | {r['micro_batch']} "
              f"({r['largest_micro_batch_planned']}) | {r['attention']} | {r['compiled_peak_gib']:.1f} / "
              f"{r['planned_peak_gib']:.1f} ({r['compiled_peak_gib'] / r['planned_peak_gib']:.2f}) | "
              f"{r['model_tflop_per_device']:.1f} | {mfu} |")
    return rows


def _planned(args) -> list[dict]:
    rows = []
    for name in args.cases.split(","):
        if name not in CASES:
            sys.exit(f"error: --cases: {name!r} is not one of {', '.join(CASES)}")
        got = planned_row(name, 1, args.precision)
        if got is None:
            continue
        rows.append(got)
        print(json.dumps(rows[-1]), flush=True)
        pathlib.Path(args.output).write_text(json.dumps(rows, indent=1) + "\n")
    print(f"\n{args.precision}:\n| config | plan (8 H100s) | micro-batch x steps | remat, SP, split | attention | "
          "peak GiB compiled / planned | scaling model GiB | predicted MFU |\n"
          "| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if "error" in r:
            print(f"| {r['config']} | {r['plan']} | {r['error']} |")
            continue
        print(f"| {r['config']} | {r['plan']} | {r['micro_batch']} x {r['accumulation_steps']} | {r['remat']}, "
              f"{'SP' if r['sequence'] else '-'}, {r['state_split']} | {r['attention']} | "
              f"{r['compiled_peak_gib']:.1f} / {r['planned_peak_gib']:.1f} "
              f"({r['compiled_peak_gib'] / r['planned_peak_gib']:.2f}) | {r['scaling_model_gib']:.1f} | "
              f"{r['predicted_mfu']:.1%} |")
    return rows


if __name__ == "__main__":
    from megajax.cli import exit_on_user_error

    exit_on_user_error(main)
