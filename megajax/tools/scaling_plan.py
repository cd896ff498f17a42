"""Chooses a mesh for a cluster with the scaling model (``megajax.tools.scaling``), and its command.

    python -m megajax.scaling --config=gpt_8p3b --gpus=512 --cluster=dgx2h [--global_batch=512] [--pipe=P]
    python -m megajax.scaling --config=llama3_8b --gpus=128 --cluster=dgx_h100 --context=16 \
        --config.model.max_seq_len=131072 --global_batch=8   # every sequence over 16 context shards
    python -m megajax.scaling --config=llama3_8b --cluster=dgx_h100 --mesh=8x1 --micro_batch=2 --json

prints every (pipe, data, model) mesh of the GPUs (a mixture of experts: (data, expert, model), or in stages
(pipe, data, model)) with its
predicted step time (compute, tensor-parallel, point-to-point over pipe, exposed data-parallel, the experts'
all-to-alls), the pipeline's bubble, model TFLOP/s per GPU (active parameters' FLOPs), MFU and memory, and
recommends the fastest one that fits, as train.py flags. Per mesh it chooses (``recommend_mesh``):

* the micro-batch, so the accumulation steps (``micro_batches``; unless ``--micro_batch`` or ``--keep_choices``);

* with pipeline stages (pipe dividing the layers), the schedule and microbatches (``pipelines``): GPipe, 1F1B
  (holding residuals or recomputing), or the circular or interleaved 1F1B schedule with v chunks per stage (v up to
  ``MAX_REPEATS``, dividing L/p), at
  M = p, 2p, 4p, ... (the smallest divisor of the layer stack's batch from each) and one sequence per microbatch;
* the remat policy, sequence parallelism and how much state to split over data: none, ZeRO-1 or FSDP
  (``variants``; ``--keep_choices``: the config's). With stages the step model covers neither sequence
  parallelism nor FSDP (megajax runs both there; not modelled yet), and ``save_dots`` keeps what ``full`` keeps, so
  none of them is tried there.

Each mesh's row is its fastest choice that fits (else the one needing least memory) in the memory a JAX process has
on each GPU (``scaling_clusters.jax_memory``: JAX's allocator's share, 75% unless ``XLA_PYTHON_CLIENT_MEM_FRACTION``
says otherwise). The config's own mesh is not
kept (``--pipe`` restricts the stages): ``main`` resolves the config on one GPU without stages, and each candidate
is that run placed on its mesh (``config.replanned``); the flags name all three axes, so a config with mesh.pipe > 1
takes them. ``--context=C`` plans meshes with C context shards (``scaling_context``: no stages, no expert shards),
the (data, model) meshes of the GPUs / C left; ``--mesh=SPEC`` evaluates that one mesh (train.py's spelling, with
``,expert=E`` / ``,context=C``; --gpus then defaults to its devices), still choosing the rest unless
``--keep_choices``; ``--json`` ends the output with the chosen plan as one JSON object (``plan_json``: where none
fits, the row needing least memory, ``"fits": false``); ``--config.FIELD=V`` overrides a field of the config.
"""

from __future__ import annotations

import dataclasses
import json

import ml_collections

from megajax.cli import ArgumentParser, apply_config_overrides, apply_mesh, load_config
from megajax.config import NO_SCHEDULE, RunSpec, resolve
from megajax.parallel.mesh import MeshShape
from megajax.tools.scaling import (
    CLUSTERS,
    MEMORY_FRACTION_VARIABLE,
    Cluster,
    GiB,
    Prediction,
    flash_attention,
    jax_memory,
    memory_bytes,
    predict,
)
from megajax.tools.scaling_layout import (
    choice_flags,
    choices,
    parameters_per_gpu,
    splits_evenly,
    with_choices,
)
from megajax.tools.scaling_pipeline import Pipeline


def candidate_meshes(run: RunSpec, num_gpus: int, cluster: Cluster, global_batch: int,
                     micro_batch: int | None = None, pipe: int | None = None) -> list[MeshShape]:
    """The meshes (pipe x data x expert x model) of ``num_gpus`` with model parallelism within a node that the model
    allows (``scaling_layout.splits_evenly``: whole heads and equal hidden / MLP / vocabulary slices per shard),
    expert shards of whole experts and stages of whole layers where the model runs them (``check_mesh`` of its
    config: a dense model has no experts, a mixture of experts no expert shards in stages), and the batch split
    evenly over data x expert (and micro-batches). ``pipe``: only that many stages (None: every count that divides
    the layers)."""
    out, layers = [], run.model.num_layers
    fits = {t: splits_evenly(run, t) for t in range(1, min(num_gpus, cluster.gpus_per_node) + 1)}
    experts = [e for e in range(1, (run.routed_experts[0] or 1) + 1) if _runs(run, 1, 1, e)]
    for stages in range(1, num_gpus + 1):
        if num_gpus % stages or layers % stages or (pipe is not None and stages != pipe) or not _runs(run, 1, stages):
            continue
        for tensor in range(1, min(num_gpus // stages, cluster.gpus_per_node) + 1):
            if (num_gpus // stages) % tensor or not fits[tensor]:
                continue
            for expert in experts:
                if stages > 1 and not _runs(run, 1, stages, expert):
                    continue
                data, rest = divmod(num_gpus, stages * tensor * expert)
                if rest or global_batch % (data * expert):
                    continue
                if micro_batch and (global_batch // (data * expert)) % micro_batch:
                    continue
                out.append(MeshShape(data, tensor, pipe=stages, expert=expert))
    return out


def _runs(run: RunSpec, tensor: int, pipe: int, expert: int = 1) -> bool:
    """Whether the run's model takes these mesh degrees (``TransformerConfig.check_mesh``)."""
    try:
        run.model.check_mesh(tensor, pipe, expert)
    except ValueError:
        return False
    return True


REMAT_CHOICES = ("none", "selective", "save_dots", "full")  # least recomputation first


SPLIT_CHOICES = ((False, False), (True, False), (True, True))  # (shard_optimizer, fsdp): none, ZeRO-1, FSDP
MAX_REPEATS = 8  # the circular schedule's chunks per stage the planner tries (every divisor of L/p up to this)


def variants(run: RunSpec, mesh: MeshShape, choose: bool) -> list[RunSpec]:
    """The run as given, or (``choose``) the run with every remat policy x sequence parallelism (model-parallel
    meshes whose t divides the sequence) x the state split over data (none, ZeRO-1, FSDP: data-parallel meshes)
    that could run on ``mesh`` (``with_choices``); a run whose sequence parallelism the mesh cannot split (t not
    dividing the sequence) has none there, as ``config.validate`` refuses it. With stages (``mesh.pipe`` > 1) the step
    model does not cover sequence parallelism or FSDP (megajax runs both under stages, FSDP gathering each stage's
    layers once per step: not modelled yet), so a run that asks for them has no pipelined variant; ``save_dots``
    keeps and recomputes what ``full`` does (so it is not tried)."""
    data, tensor = mesh.data, mesh.model
    splits_sequence = run.model.max_seq_len % tensor == 0
    if mesh.pipe > 1:
        if not choose:
            return [] if run.sequence or run.fsdp else [run]
        return [with_choices(run, remat=r, sequence=False, shard_optimizer=z, fsdp=False)
                for r in REMAT_CHOICES if r != "save_dots" for z in ((False, True) if data > 1 else (False,))]
    if not choose:
        return [run] if splits_sequence or not run.sequence else []
    return [with_choices(run, remat=r, sequence=sp, shard_optimizer=z, fsdp=f) for r in REMAT_CHOICES
            for sp in ((False, True) if tensor > 1 and splits_sequence else (False,))
            for z, f in (SPLIT_CHOICES if data > 1 else SPLIT_CHOICES[:1])]


def pipelines(run: RunSpec, stages: int, rows: int) -> list[Pipeline]:
    """The schedules the planner tries on ``stages`` stages for a layer-stack batch of ``rows`` sequences: GPipe and
    the circular schedule, and 1F1B holding residuals or recomputing the chunks, each with every v up to
    ``MAX_REPEATS`` that splits the layers evenly (v = 1: GPipe, plain 1F1B; v > 1: circular, interleaved 1F1B), at
    M = the
    smallest multiple of p dividing ``rows`` from p, 2p, 4p, ... up, and all ``rows`` (one sequence per
    microbatch); none where the rows are not a multiple of p (each stage's share of the batch holds whole
    microbatches)."""
    if stages == 1:
        return [Pipeline()]
    if rows % stages:
        return []
    divisors = [m for m in range(stages, rows + 1, stages) if rows % m == 0]
    counts, want = set(), stages
    while want <= rows:
        counts.add(next(m for m in divisors if m >= want))
        want *= 2
    counts.add(rows)
    repeats = [v for v in range(1, MAX_REPEATS + 1) if run.model.num_layers % (stages * v) == 0]
    return [Pipeline(stages, m, v, one_f_one_b=f, stage_recompute=r) for v in repeats for m in sorted(counts)
            for f, r in ((False, False), (True, False), (True, True))]


def micro_batches(shard: int) -> list[int]:
    """The micro-batches the search tries for a batch shard of ``shard`` sequences: the powers of two that divide
    it, and the whole shard (no accumulation)."""
    return sorted({m for m in (2**k for k in range(shard.bit_length())) if shard % m == 0} | {shard})


def recommend_mesh(run: RunSpec, num_gpus: int, cluster: Cluster, global_batch: int,
                   micro_batch: int | None = None, grad_bytes: int = 4, choose: bool = False,
                   pipe: int | None = None, context: int = 1, only: MeshShape | None = None,
                   search_micro: bool = False) -> tuple[Prediction | None, list[Prediction]]:
    """(the fastest mesh that fits in HBM or None, one prediction per candidate mesh, fastest first).

    Meshes are pipe x data x expert x model (``candidate_meshes``; ``pipe``: only that many stages); those that do not
    divide the model or the batch are not candidates; those over HBM are listed, never recommended. With stages, every
    schedule and microbatch count of ``pipelines`` is tried. ``choose``: besides the mesh, pick the remat policy,
    sequence parallelism and ZeRO-1 / FSDP (each mesh's row is its fastest choice that fits, else its least memory);
    otherwise the run's own are kept. ``context``: every mesh with that many context shards (of the ``num_gpus``;
    no stages). ``only``: that mesh alone, where it is a candidate (else the table is empty). ``search_micro``:
    every micro-batch of ``micro_batches`` is tried too (``micro_batch`` then unused), so the accumulation steps
    are chosen with the rest."""
    table = []
    micro_batch = None if search_micro else micro_batch
    meshes = candidate_meshes(run, num_gpus // context, cluster, global_batch, micro_batch, 1 if context > 1 else pipe)
    for mesh in (m.replace(context=context) for m in meshes):
        if only is not None and mesh != only:
            continue
        shard = global_batch // mesh.batch_shards
        micros = micro_batches(shard) if search_micro else [micro_batch or shard]
        options = sorted((predict(c, mesh, global_batch, cluster, micro, grad_bytes, memory=False, pipeline=pl)
                          for micro in micros for pl in pipelines(run, mesh.pipe, micro)
                          for c in variants(run, mesh, choose)
                          if context == 1 or
                          c.model.max_seq_len % (2 * context * (mesh.model if c.sequence else 1)) == 0),
                         key=lambda p: p.step_s)
        row = None
        for option in options:  # fastest first: the first that fits is the row; else the one needing least memory
            need = memory_bytes(option.run, mesh, option.micro_batch, option.pipeline,
                                flash_attention(option.run, cluster), option.num_micro)
            option = dataclasses.replace(option, memory_bytes=need, fits=need <= cluster.hbm_bytes)
            if option.fits:
                row = option
                break
            row = option if row is None or need < row.memory_bytes else row
        if row is not None:
            table.append(row)
    table.sort(key=lambda p: p.step_s)
    return next((p for p in table if p.fits), None), table


def format_table(table: list[Prediction], best: Prediction | None) -> str:
    """The CLI's table of meshes and its recommendation (a mixture of experts' with the expert shards and the time
    of their all-to-alls)."""
    routed = any(p.run.routed_experts[0] for p in table)
    contexts = any(p.mesh.context > 1 for p in table)
    lines = [f"{'pipe':>4} {'mesh':>8} {'expert':>6} " * routed + f"{'pipe':>4} {'mesh':>8} " * (not routed) +
             f"{'ctx':>4} " * contexts +
             f"{'sched':>7} {'M':>4} {'micro':>5} {'remat':>9} {'SP':>3} {'ZeRO':>4} "
             f"{'step s':>8} {'compute':>8} {'TP comm':>8} {'PP comm':>8} {'DP comm':>8} " +
             f"{'EP comm':>8} " * routed + f"{'CP comm':>8} " * contexts + f"{'bubble':>6} "
             f"{'TFLOP/s':>8} {'MFU':>6} {'vs 1GPU':>7} {'GiB/GPU':>8} fits"]
    yes = lambda b: "yes" if b else "-"  # noqa: E731
    for p in table:
        (remat, sequence, shard_optimizer, fsdp), pl = choices(p.run), p.pipeline
        zero = "3" if fsdp else "1" if shard_optimizer else "-"
        lines.append(f"{pl.stages:>4} {p.mesh.data:>4}x{p.mesh.model:<3} " + f"{p.mesh.expert:>6} " * routed +
                     f"{p.mesh.context:>4} " * contexts + f"{_schedule(pl):>7} "
                     f"{pl.microbatches if pl.stages > 1 else '-':>4} {p.micro_batch:>5} {remat:>9} "
                     f"{yes(sequence):>3} {zero:>4} {p.step_s:8.3f} {p.compute_s:8.3f} {p.tensor_comm_s:8.3f} "
                     f"{p.pipe_comm_s:8.3f} {p.data_comm_s:8.3f} " + f"{p.expert_comm_s:8.3f} " * routed +
                     f"{p.context_comm_s:8.3f} " * contexts +
                     f"{p.bubble:6.1%} {p.tflops_per_gpu:8.1f} "
                     f"{p.mfu:6.1%} {p.efficiency:7.1%} {p.memory_bytes / GiB:8.1f} {'yes' if p.fits else 'NO'}")
    if best is None:
        lines.append("recommendation: none fits; add GPUs, shrink the micro-batch, or split the state over data "
                     "(parallel.shard_optimizer, parallel.fsdp)")
    else:
        pl = best.pipeline
        schedule = (f" ({pl.schedule}{f' v={pl.repeats}' if pl.repeats > 1 else ''}, {pl.microbatches} "
                    f"microbatches, bubble {pl.bubble():.1%})" if pl.stages > 1 else "")
        remat, sequence, _, _ = choices(best.run)
        experts = f" x expert={best.mesh.expert}" if best.run.routed_experts[0] else ""
        experts += f" x context={best.mesh.context}" if best.mesh.context > 1 else ""
        lines.append(f"recommendation: pipe={pl.stages} x data={best.mesh.data}{experts} x model={best.mesh.model}"
                     f"{schedule}, "
                     f"remat={remat}, sequence parallelism {'on' if sequence else 'off'}, "
                     f"state split over data: {_split_name(best.run)}: {best.step_s:.3f} s/step, "
                     f"{best.tflops_per_gpu:.1f} TFLOP/s per GPU, {best.gpu_hours_per_trillion_tokens:,.0f} GPU-hours "
                     f"per trillion tokens\n  {flags(best)}")
    return "\n".join(lines)


def flags(prediction: Prediction) -> str:
    """The train.py flags of a prediction's mesh, schedule and choices."""
    pl, m = prediction.pipeline, prediction.mesh
    experts = f" --config.mesh.expert={m.expert}" if prediction.run.routed_experts[0] else ""
    experts += f" --config.mesh.context={m.context}" if m.context > 1 else ""
    mesh = f"--config.mesh.pipe={m.pipe} --config.mesh.data={m.data}{experts} --config.mesh.model={m.model}"
    return " ".join(f for f in (mesh, pl.flags(), choice_flags(prediction.run)) if f)


def plan_json(prediction: Prediction) -> str:
    """The plan as one JSON object: its mesh (``--mesh``'s spelling), micro-batch and accumulation steps, schedule,
    choices, predicted step, model TFLOP/s per GPU (no recomputation counted), MFU, peak memory per GPU, whether it
    fits, GPU-hours per trillion tokens, and the train.py flags that run it."""
    p, pl = prediction, prediction.pipeline
    remat, sequence, _, _ = choices(p.run)
    return json.dumps({
        "mesh": p.mesh.flag, "micro_batch": p.micro_batch, "accumulation_steps": p.num_micro,
        "schedule": pl.schedule if pl.stages > 1 else None,
        "pipeline_microbatches": pl.microbatches if pl.stages > 1 else None,
        "pipeline_repeats": pl.repeats if pl.stages > 1 else None,
        "remat": remat, "sequence_parallel": sequence, "state_split": _split_name(p.run),
        "step_s": round(p.step_s, 5), "model_tflops_per_gpu": round(p.tflops_per_gpu, 2), "mfu": round(p.mfu, 4),
        "peak_gib": round(p.memory_bytes / GiB, 3), "fits": p.fits,
        "gpu_hours_per_trillion_tokens": round(p.gpu_hours_per_trillion_tokens, 1), "flags": flags(p)})


def given_mesh(text: str, gpus: int) -> MeshShape:
    """``--mesh``'s value as a MeshShape (train.py's spelling; ``data=-1`` takes the ``gpus`` the rest leave)."""
    scratch = ml_collections.ConfigDict({"mesh": {"pipe": 1, "data": 1, "model": 1, "expert": 1, "context": 1}})
    apply_mesh(scratch, text)
    mesh = MeshShape.of(scratch.mesh)
    return mesh.resolved(gpus) if mesh.data == -1 or gpus else mesh


def _schedule(pipeline: Pipeline) -> str:
    """The table's short name: 'gpipe', '1f1b', or with v chunks 'circV' (circular) / 'intlV' (interleaved 1F1B)."""
    if pipeline.repeats == 1:
        return pipeline.schedule
    return {"circular": "circ", "interleaved": "intl"}[pipeline.schedule] + str(pipeline.repeats)


def _split_name(run: RunSpec) -> str:
    return "FSDP" if run.fsdp else "ZeRO-1" if run.shard_optimizer else "none"


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="config file, path or bare name (gpt_8p3b)")
    p.add_argument("--gpus", type=int, default=0, help="the GPUs to plan for (with --mesh: its devices)")
    p.add_argument("--mesh", default=None, help="evaluate this one mesh, as train.py spells it: DATAxMODEL or "
                   "PIPExDATAxMODEL, then ',expert=E' and/or ',context=C' (the remat policy, sequence parallelism, "
                   "state split and schedule are still chosen unless --keep_choices)")
    p.add_argument("--json", action="store_true", help="end with the chosen plan as one JSON object on the last line")
    p.add_argument("--cluster", default="dgx2h", choices=sorted(CLUSTERS))
    p.add_argument("--global_batch", type=int, default=None, help="default: the config's train.global_batch_size")
    p.add_argument("--micro_batch", type=int, default=None, help="sequences per accumulation step per batch shard "
                   "(0: the whole shard; default: chosen with the mesh, or with --keep_choices the config's "
                   "train.micro_batch_size)")
    p.add_argument("--grad_bytes", type=int, default=4, help="bytes per all-reduced gradient (Megatron 2019: 2)")
    p.add_argument("--pipe", type=int, default=0, help="only meshes of this many pipeline stages (default: every "
                   "count that divides the layers; the config's mesh.pipe is not kept, as its data and model are not)")
    p.add_argument("--keep_choices", action="store_true", help="keep the config's remat, parallel.sequence, "
                   "parallel.shard_optimizer and parallel.fsdp instead of choosing them per mesh")
    p.add_argument("--context", type=int, default=1, help="context shards: every sequence split over this many GPUs "
                   "(of --gpus; no stages, no expert shards)")
    args, overrides = p.parse_known_args(argv)
    only = None
    if args.mesh is not None:
        if args.pipe or args.context != 1:
            p.error(f"--mesh={args.mesh} gives the stages and context shards: drop --pipe and --context")
        only = given_mesh(args.mesh, args.gpus)
        if args.gpus and only.devices != args.gpus:
            p.error(f"--mesh={args.mesh} spans {only.devices} GPUs, not --gpus={args.gpus}: drop --gpus or change one")
        if only.context > 1 and (only.pipe > 1 or only.expert > 1):
            p.error(f"--mesh={args.mesh}: the scaling model plans context shards without stages or expert shards")
        args.gpus, args.pipe, args.context = only.devices, only.pipe, only.context
    elif args.gpus < 1:
        p.error(f"--gpus={args.gpus}: give the GPUs to plan for (or one mesh: --mesh=DATAxMODEL)")
    if args.global_batch is not None and args.global_batch < 1:
        p.error(f"--global_batch={args.global_batch}: give the sequences per step (>= 1), or leave it out for the "
                "config's")
    if args.micro_batch is not None and args.micro_batch < 0:
        p.error(f"--micro_batch={args.micro_batch}: give the sequences per accumulation step per batch shard (>= 1), "
                "0 for the whole shard, or leave it out to have it chosen")
    config = load_config(args.config)
    apply_config_overrides(config, overrides)
    if args.context < 1 or args.gpus % args.context:
        p.error(f"--context={args.context} must be >= 1 and divide --gpus={args.gpus}")
    if args.context > 1 and args.pipe > 1:
        p.error("--context plans meshes without pipeline stages: drop --pipe")
    # the plan places the model on each mesh itself: resolved here once, on one GPU without stages
    config.mesh.update(pipe=1, data=1, model=1, expert=1)
    config.parallel.update(NO_SCHEDULE)
    run = resolve(config, 1, training=False)
    if not run.model_spec.causal_lm:
        raise SystemExit(f"error: the scaling model covers causal language models (GPT configs); {args.config} is "
                         f"{run.model_name}")
    if args.context > 1 and run.routed_experts[0]:
        p.error("--context plans dense models' meshes (no expert shards); this config is a mixture of experts")
    cluster = jax_memory(CLUSTERS[args.cluster])  # what a megajax step can use of each GPU's memory
    if run.model.fp8 and not cluster.fp8_peak_flops:
        raise SystemExit(f"error: train.precision=fp8: --cluster={args.cluster}'s GPUs have no FP8 tensor cores; plan "
                         f"it on {', '.join(n for n, c in CLUSTERS.items() if c.fp8_peak_flops)} or in bf16")
    if args.pipe > 1:  # a model that does not run in stages (a mixture with dense layers) says why, before the search
        try:
            run.model.check_mesh(1, args.pipe, 1)
        except ValueError as e:
            raise SystemExit(f"error: --pipe={args.pipe}: {e}") from None
    batch = args.global_batch if args.global_batch is not None else config.train.global_batch_size
    # without --micro_batch the search chooses it, but where the config's choices are kept (so is its micro-batch)
    search = args.micro_batch is None and not args.keep_choices
    micro = args.micro_batch if args.micro_batch is not None else config.train.micro_batch_size
    best, table = recommend_mesh(run, args.gpus, cluster, batch, micro or None, args.grad_bytes,
                                 choose=not args.keep_choices, pipe=args.pipe or None, context=args.context, only=only,
                                 search_micro=search)
    if not table and only is not None:
        micros = f" (and micro-batches of {micro})" if micro and not search else ""
        raise SystemExit(f"error: --mesh={args.mesh} does not place {args.config} with a global batch of {batch}"
                         f"{micros}: data x expert must split the batch, model its heads and vocabulary (at most "
                         f"{cluster.gpus_per_node}, one node), pipe its layers, expert its experts; try another "
                         "--mesh, or leave it out to list the meshes that do")
    if not table:
        axes = "(data, expert, model)" if run.routed_experts[0] else "(pipe, data, model)"
        parts = "layers, heads" + (", experts" if run.routed_experts[0] else "")
        micros = f" (and micro-batches of {micro})" if micro and not search else ""
        raise SystemExit(f"error: no {axes} mesh of {args.gpus} GPUs divides the model (its {parts}) and the global "
                         f"batch of {batch}{micros}; try another --gpus or --global_batch")
    total = parameters_per_gpu(run)[0]
    active = run.model_spec.active_parameters(run.model, total)
    print(f"{args.config}: {total:,} parameters{f' ({active:,} active per token)' if active != total else ''}, "
          f"{args.gpus} GPUs on {cluster.name} ({cluster.hbm_bytes / GiB:.1f} GiB each: JAX's allocator's share, "
          f"{MEMORY_FRACTION_VARIABLE}), global batch {batch}")
    print(format_table(table, best))
    if any(p.mesh.expert > 1 for p in table) and not run.model.capacity_factor and not run.model.expert_room:
        print("note: dropless, an expert shard's receive buffer has room for the worst case (every shard of its "
              "expert group sending it all it can); --config.model.expert_room=1.25 bounds it to 1.25 x its own "
              "routed rows, dropping and counting what does not fit (which then depends on the mesh)")
    if args.json:
        print(plan_json(best or min(table, key=lambda p: p.memory_bytes)))
