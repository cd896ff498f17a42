"""Steady-state training throughput of a config on this machine's devices.

    python bench/train_throughput.py --config=gpt_125m --batch=4 --seq=512 --steps=3 [--mesh=1x1] [--precision=fp32]
    python bench/train_throughput.py --config=bert_tiny --batch=32 --seq=128 --steps=5

Compiles the step ahead of time, runs one warm-up step, then times ``--steps`` steps (AdamW, no dropout change).
Prints tokens/s and model TFLOP/s per device as JSON. Timings on a shared CPU swing by 30% between runs: compare
with another program only side by side, in one run.
"""

import argparse
import json
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))


def measure(config, steps: int, warmup: int = 1, options: dict | None = None) -> dict:
    """Compiles ``config``'s step ahead of time (XLA ``options``: default megajax's for the platform), runs
    ``warmup`` untimed steps and times ``steps`` more on one real batch (reused). Returns the figures as a dict
    (seconds, tokens/s, model TFLOP/s per device, the compiled step's memory plan and the device's peak use)."""
    import jax

    from megajax.training.data import make_loader
    from megajax.training.loop import setup
    from megajax.training.metrics import model_flops_per_step, sequences_per_step

    t0 = time.perf_counter()
    run = setup(config, options=options)
    state = run.init_state()
    compile_s = time.perf_counter() - t0
    batch = make_loader(run.spec).next_global(run.batch_shardings)  # one real batch (GPT or BERT), reused
    for _ in range(warmup):
        state, m = run.step_fn(state, batch)
    jax.block_until_ready(m)
    t = time.perf_counter()
    for _ in range(steps):
        state, m = run.step_fn(state, batch)
    jax.block_until_ready(m)
    step_s = (time.perf_counter() - t) / steps
    seq = config.model.max_seq_len
    flops = model_flops_per_step(run.spec, seq)
    devices = run.spec.mesh.data * run.spec.mesh.model  # the mesh's, not every device jax sees
    return {"device": jax.devices()[0].device_kind, "devices": devices,
            "mesh": f"{run.spec.mesh.data}x{run.spec.mesh.model}", "global_batch": run.spec.global_batch, "seq": seq,
            "precision": run.spec.precision, "remat": run.spec.model.remat, "params": run.num_params,
            "setup_and_compile_s": round(compile_s, 1), "step_s": round(step_s, 4),
            "tokens_per_s": round(sequences_per_step(run.spec) * seq / step_s, 1),
            "model_tflops_per_device": round(flops / step_s / devices / 1e12, 4),
            "compiled_temp_bytes": run.step_fn.memory_analysis().temp_size_in_bytes,
            "device_peak_bytes": (jax.local_devices()[0].memory_stats() or {}).get("peak_bytes_in_use"),
            "loss": float(m["loss"])}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="gpt_125m")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--mesh", default="1x1")
    p.add_argument("--precision", default="auto")
    p.add_argument("--remat", default="none")
    args = p.parse_args()

    from megajax.cli import load_config, parse_mesh

    config = load_config(args.config)
    data, model = parse_mesh(args.mesh)
    config.mesh.update(data=data, model=model)
    config.model.update(max_seq_len=args.seq, remat=args.remat)
    config.train.update(global_batch_size=args.batch, precision=args.precision, steps=1000)
    print(json.dumps({"config": args.config, **measure(config, args.steps)}, indent=1))


if __name__ == "__main__":
    main()
