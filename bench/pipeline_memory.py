"""The memory planner beside XLA's plan for pipelined steps: every schedule, remat policy, dropout and sequence length.

    python bench/pipeline_memory.py                      # 108 steps, ~15 min on 2 cores
    python bench/pipeline_memory.py --meshes 2x2x2:4 --schedules 1f1b:2 --seqs 32

An 8-layer GPT (hidden 64, 8 heads, vocabulary 1000, fp32, the tests' small model) on 8 simulated CPU devices, for
each mesh PIPExDATAxMODEL:MICROBATCHES, schedule (gpipe, circular with 2 chunks per stage, 1F1B, interleaved 1F1B
with 2), remat (none, full, selective), dropout (0, 0.1) and sequence length; then 16-layer steps with dropout. It
prints the compiled step's temp and peak over the planner's (``memory_planner.memory_report``) and flags those
more than 10% apart; bench/README.md records a run. Compiled with most optimizations off, as the tests compile
(the HLO passes and buffer assignment run as usual) and with XLA:CPU's fusion emitters, as train.py compiles.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from megajax.cli import use_cpu_devices  # noqa: E402

use_cpu_devices(8)  # before jax starts its backends

import jax  # noqa: E402

from megajax.config import base_config  # noqa: E402
from megajax.tools.memory_planner import memory_report, run_memory  # noqa: E402
from megajax.training.loop import setup  # noqa: E402

SCHEDULES = {"gpipe:1": ("gpipe", 1), "circular:2": ("circular", 2), "1f1b:1": ("1f1b", 1), "1f1b:2": ("1f1b", 2)}


def config(pipe: int, data: int, model: int, micro: int, schedule: str, repeats: int, remat: str, dropout: float,
           seq: int, layers: int):
    """The tests' small GPT (tests/conftest.py ``small_config``) on random data, with these settings."""
    c = base_config()
    c.model.update(vocab_size=1000, make_vocab_size_divisible_by=128, num_layers=layers, hidden_size=64, num_heads=8,
                   max_seq_len=seq, dropout=dropout, remat=remat)
    c.mesh.update(pipe=pipe, data=data, model=model)
    c.parallel.update(pipeline_microbatches=micro, pipeline_repeats=repeats, pipeline_schedule=schedule)
    c.data.source = "random"
    c.train.update(global_batch_size=8, precision="fp32", steps=1, log_every=1, eval_batches=0)
    c.checkpoint.enabled = False
    return c


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--meshes", nargs="*", default=["2x2x2:4", "4x1x2:8"], help="PIPExDATAxMODEL:MICROBATCHES")
    p.add_argument("--schedules", nargs="*", default=list(SCHEDULES), choices=list(SCHEDULES))
    p.add_argument("--seqs", nargs="*", type=int, default=[32, 256])
    p.add_argument("--no_deep", action="store_true", help="leave out the 16-layer steps")
    args = p.parse_args(argv)
    jax.config.update("jax_disable_most_optimizations", True)
    cases = []
    for mesh, schedule, remat, dropout, seq in itertools.product(args.meshes, args.schedules,
                                                                 ("none", "full", "selective"), (0.0, 0.1), args.seqs):
        shape, micro = mesh.split(":")
        cases.append((*map(int, shape.split("x")), int(micro), *SCHEDULES[schedule], remat, dropout, seq, 8))
    if not args.no_deep:
        deep = itertools.product(("1f1b:1", "circular:2", "gpipe:1"), ("none", "full"), (128, 256))
        for schedule, remat, seq in deep:
            cases.append((2, 2, 2, 4, *SCHEDULES[schedule], remat, 0.1, seq, 16))
    print(f"{'mesh':9s} {'schedule':8s} v {'remat':9s} drop    s   L   temp   peak  (compiled / formula)")
    misses = 0
    for pipe, data, model, micro, schedule, repeats, remat, dropout, seq, layers in cases:
        run = setup(config(pipe, data, model, micro, schedule, repeats, remat, dropout, seq, layers))
        report, compiled = memory_report(run.spec, 8 // data, num_micro=1), run_memory(run)
        temp, peak = compiled.temp / report.temp_bytes, compiled.peak / report.peak_bytes
        flag = "  > 10%" if abs(temp - 1) > 0.10 else ""
        misses += bool(flag)
        mesh = f"{pipe}x{data}x{model}:{micro}"
        print(f"{mesh:9s} {schedule:8s} {repeats} {remat:9s} {dropout:4.1f} {seq:4d} {layers:3d} "
              f"{temp:6.3f} {peak:6.3f}{flag}", flush=True)
        del run
        gc.collect()
        jax.clear_caches()
    print(f"{len(cases)} steps, {misses} more than 10% apart")


if __name__ == "__main__":
    main()
