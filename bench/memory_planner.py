"""The memory formula beside XLA's plan for the larger configs that compile on a CPU host (nothing is allocated).

    python bench/memory_planner.py                 # 27 cases, tiny to 355m (~5-10 s of compiling each)
    python bench/memory_planner.py --cases gpt_125m:1x1:1:full gpt_355m:1x8:1:none:zero

A case is CONFIG:DATAxMODEL:MICRO_BATCH:REMAT[:zero|:fsdp][:sp][:accN] (sp: sequence parallelism). For each it
prints the formula's state, temp and peak per device (``megajax.tools.memory_planner.memory_report``), the compiled
step's (``compiled_memory``) and the ratios compiled / formula. bench/README.md records a run.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from megajax.cli import load_config, parse_mesh, use_cpu_devices  # noqa: E402
from megajax.config import resolve  # noqa: E402
from megajax.tools.memory_planner import compiled_memory, memory_report  # noqa: E402

use_cpu_devices(8)  # before jax starts its backends

DEFAULT_CASES = ("gpt_tiny:1x1:1:none", "gpt_tiny:1x1:4:none", "gpt_tiny:2x4:4:full", "gpt_tiny:1x1:2:none:acc2",
                 "gpt_tiny:2x4:2:full:acc4", "bert_tiny:1x1:4:none", "bert_tiny:4x2:4:full",
                 "bert_tiny:1x1:1:none:acc2", "bert_tiny:2x4:2:selective:acc4",
                 "gpt_125m:1x1:1:none", "gpt_125m:1x1:2:full", "gpt_125m:1x1:2:selective", "gpt_125m:1x1:2:save_dots",
                 "gpt_125m:1x4:2:none", "gpt_125m:2x4:2:full", "gpt_125m:4x2:2:selective:zero",
                 "gpt_125m:1x1:1:full:acc2", "gpt_125m:1x4:1:none:acc2", "gpt_125m:1x1:1:selective:acc2",
                 "gpt_355m:1x8:1:none", "gpt_355m:2x4:2:full:zero", "bert_336m:1x8:1:selective",
                 "gpt_125m:8x1:2:full:fsdp", "gpt_355m:4x2:2:full:fsdp", "gpt_355m:4x2:2:full:fsdp:sp",
                 "gpt_125m:2x4:2:full:fsdp", "bert_336m:4x2:2:full:fsdp")
MiB = 1024**2


def run_case(case: str) -> str:
    name, mesh, micro, remat, *flags = case.split(":")
    data, model = parse_mesh(mesh)
    config = load_config(name)
    config.model.remat = remat
    config.parallel.shard_optimizer = "zero" in flags
    config.parallel.fsdp = "fsdp" in flags
    config.parallel.sequence = "sp" in flags
    config.mesh.update(data=data, model=model)
    run = resolve(config, data * model, training=False)  # the batch is the case's: compiled_memory sets it
    num_micro = next((int(f[3:]) for f in flags if f.startswith("acc")), 1)
    report = memory_report(run, int(micro), num_micro=num_micro)
    start = time.perf_counter()
    compiled = compiled_memory(run, int(micro), num_micro)
    seconds = time.perf_counter() - start
    cells = [f"{f / MiB:9.1f} {c / MiB:9.1f} {c / f:6.3f}" for f, c in (
        (report.state_bytes, compiled.state), (report.temp_bytes, compiled.temp), (report.peak_bytes, compiled.peak))]
    return f"{case:34s} " + "  ".join(cells) + f"  {seconds:5.0f}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="*", default=list(DEFAULT_CASES),
                   help="CONFIG:DATAxMODEL:MICRO:REMAT[:zero|:fsdp][:sp][:accN]")
    args = p.parse_args(argv)
    print(f"{'':34s} " + "  ".join(f"{q:^26s}" for q in ("state MiB", "temp MiB", "peak MiB")))
    print(f"{'case':34s} " + "  ".join(f"{'formula':>9s} {'XLA':>9s} {'ratio':>6s}" for _ in range(3))
          + "  compile s")
    for case in args.cases:
        print(run_case(case), flush=True)


if __name__ == "__main__":
    main()
