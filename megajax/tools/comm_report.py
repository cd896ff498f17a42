"""What one training step communicates, read from its compiled HLO (no step is run).

    python -m megajax.comm_report --config=gpt_tiny --mesh=2x4 --cpu_devices=8 [--batch=8] [--sequence]
        [--shard_optimizer | --fsdp]
    python -m megajax.comm_report --config=gpt_tiny --mesh=2x2x2 --cpu_devices=8 [--pipeline_microbatches=4]
        [--pipeline_repeats=2] [--pipeline_schedule=1f1b]

Prints every collective of the compiled forward + backward + AdamW step: the mesh axes it spans, its phase, its
size in elements and how many times it runs per step (scanned layers counted by trip count); then the bytes per
category beside Megatron's analytic minimum and their ratio (``megajax.tools.comm_budget``). ``--sequence`` turns on
sequence parallelism (``parallel.sequence``): the reduce-scatters and all-gathers beside their expectation;
``--shard_optimizer`` (ZeRO-1) and ``--fsdp`` the parameter gathers over ``data`` beside ZeRO's. A mesh of
PIPExDATAXMODEL adds pipeline stages: the schedule's permutes between them beside one per tick each way (under 1F1B
the last stage's device: it runs the loss).
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
from megajax.parallel.hlo_audit import collectives, format_table
from megajax.parallel.pipeline import CIRCULAR, GPIPE, SCHEDULES
from megajax.tools.comm_budget import check_countable, step_budget
from megajax.training.loop import setup_run


def main(argv: list[str] | None = None) -> str:
    argv = sys.argv[1:] if argv is None else argv
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--mesh", default="1x1", help="DATAxMODEL or PIPExDATAxMODEL, then ,expert=E and / or "
                                                 ",context=C; --config.FIELD=V overrides a config field")
    p.add_argument("--pipeline_microbatches", type=int, default=None, help="parallel.pipeline_microbatches")
    p.add_argument("--pipeline_repeats", type=int, default=None,
                   help="parallel.pipeline_repeats (> 1: the circular schedule, or interleaved 1F1B)")
    p.add_argument("--pipeline_schedule", choices=SCHEDULES, default=None,
                   help="parallel.pipeline_schedule (default: the config's, or by --pipeline_repeats gpipe/circular)")
    p.add_argument("--batch", type=int, default=0, help="global batch (default: the config's)")
    p.add_argument("--cpu_devices", type=int, default=0)
    add_parallel_flags(p)
    args, overrides = p.parse_known_args(argv)
    use_cpu_devices(args.cpu_devices)
    start_backend()
    config = load_config(args.config)
    apply_config_overrides(config, overrides)
    apply_mesh(config, args.mesh)
    for name in ("pipeline_microbatches", "pipeline_repeats"):
        if getattr(args, name) is not None:
            config.parallel[name] = getattr(args, name)
    if args.pipeline_schedule is not None:
        config.parallel.pipeline_schedule = args.pipeline_schedule
    elif args.pipeline_repeats is not None:
        config.parallel.pipeline_schedule = CIRCULAR if args.pipeline_repeats > 1 else GPIPE
    if args.batch:
        config.train.global_batch_size = args.batch
    apply_parallel_flags(args, config)
    run = resolve(config, jax.device_count())
    check_countable(run)  # before compiling
    compiled = setup_run(run)
    table = format_table(collectives(compiled.step_fn.as_text(), compiled.mesh))
    table += "\n\n" + step_budget(compiled).table()
    print(table)
    return table
