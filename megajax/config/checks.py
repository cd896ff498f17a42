"""The checks a run passes before anything is allocated: ``checked(run, num_devices)``, over the typed run, so a
config (``config.resolve.resolve``) and a tool's changed run (``config.resolve.replanned``) meet the same ones. Each
failure is a ConfigError (ShardingConfigError for the mesh) that names the config field to change; a bad config
fails in milliseconds."""

from __future__ import annotations

import dataclasses

from megajax.config.data_checks import check_packing
from megajax.config.run import RunSpec
from megajax.config.settings import LossScaleSettings, OptimizerSettings
from megajax.data.settings import PREFERENCE
from megajax.errors import ConfigError
from megajax.parallel.pipeline import CIRCULAR, GPIPE, ONE_F_ONE_B, SCHEDULES


def checked(run: RunSpec, num_devices: int, training: bool = True) -> RunSpec:
    """``run`` checked against itself and ``num_devices``, its mesh's ``data=-1`` resolved. ``training=False`` (a
    model loaded for inference, a planner's candidate) skips the fields only training reads and the batch's
    micro-batches."""
    cfg, tp = run.model, run.mesh.model
    if cfg.num_heads % tp:
        raise ConfigError(f"model.num_heads={cfg.num_heads} is not divisible by mesh.model={tp}: each model shard "
                          f"must hold whole heads; pick mesh.model from the divisors of {cfg.num_heads}")
    if cfg.hidden_size % tp:
        raise ConfigError(f"model.hidden_size={cfg.hidden_size} is not divisible by mesh.model={tp}")
    if cfg.ffn_size % tp:
        raise ConfigError(f"the MLP width {cfg.ffn_size} is not divisible by mesh.model={tp}")
    if run.mesh.expert > 1 and not any(stack.kind.routed for stack in run.stacks):
        raise ConfigError(f"mesh.expert={run.mesh.expert} splits a mixture-of-experts model's experts, and this model "
                          "has none: set mesh.expert=1")
    try:
        cfg.check_mesh(tp, run.mesh.pipe, run.mesh.expert)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    padded = cfg.padded_vocab_size
    if padded % tp:
        raise ConfigError(f"the padded vocabulary {padded} (model.make_vocab_size_divisible_by="
                          f"{cfg.make_vocab_size_divisible_by}) is not divisible by mesh.model={tp}; make "
                          f"make_vocab_size_divisible_by a multiple of {tp}")
    run.rules  # noqa: B018 - what the run makes of the given rules, checked against the mesh's axes
    if run.sequence and cfg.max_seq_len % tp:
        raise ConfigError(f"parallel.sequence splits the sequence over mesh.model={tp}, but model.max_seq_len="
                          f"{cfg.max_seq_len} is not divisible by it: make max_seq_len a multiple of {tp}, pick "
                          f"mesh.model from its divisors, or set parallel.sequence=False")
    _check_pipeline(run)
    _check_context(run)
    run = dataclasses.replace(run, mesh=run.mesh.resolved(num_devices))
    _require(run.checkpoint.keep >= 0, f"checkpoint.keep={run.checkpoint.keep}; use 0 to keep every checkpoint "
                                       "or K > 0 to keep the newest K")
    _require(run.checkpoint.restore_step >= 0, f"checkpoint.restore_step={run.checkpoint.restore_step}; use 0 "
                                               "for the latest step or a step number listed in WORKDIR/checkpoints")
    check_packing(run.model_spec, run.data)
    if not training:  # the batch in one step: nothing else is checked of it
        return dataclasses.replace(run, train=dataclasses.replace(run.train, micro_batch_size=0))
    _check_training(run)
    _check_preference(run)
    _check_pipeline_microbatches(run)
    return run


def _check_pipeline(run: RunSpec) -> None:
    """mesh.pipe, parallel.pipeline_microbatches and parallel.pipeline_repeats against the model and the other
    switches (what the pipeline does not compute yet is refused, naming the field to change)."""
    p, m, pipeline = run.mesh.pipe, run.model, run.pipeline
    v, schedule = pipeline.repeats, pipeline.schedule
    _require(pipeline.microbatches >= 0, "parallel.pipeline_microbatches must be >= 0 (0: mesh.pipe of them), got "
             f"{pipeline.microbatches}")
    _require(p > 1 or pipeline.microbatches == 0, f"parallel.pipeline_microbatches={pipeline.microbatches} cuts the "
             "batch for pipeline stages: set mesh.pipe > 1 (--mesh=PIPExDATAxMODEL), or leave "
             "pipeline_microbatches=0 (train.micro_batch_size sets the micro-batches of gradient accumulation)")
    _require(v >= 1, f"parallel.pipeline_repeats must be >= 1 (1: GPipe), got {v}")
    _require(schedule in SCHEDULES, f"parallel.pipeline_schedule={schedule!r} is not one of {', '.join(SCHEDULES)}")
    _require(schedule != CIRCULAR or v > 1, "parallel.pipeline_schedule=circular holds parallel.pipeline_repeats "
             f">= 2 chunks of layers per stage, got pipeline_repeats={v}: set pipeline_repeats >= 2, or "
             "pipeline_schedule=gpipe")
    _require(schedule != GPIPE or v == 1, f"parallel.pipeline_repeats={v} chunks of layers per stage is the "
             f"circular or the interleaved 1F1B schedule; parallel.pipeline_schedule={schedule} holds one: set "
             "pipeline_schedule=circular or 1f1b, or pipeline_repeats=1")
    _require(schedule != ONE_F_ONE_B or p > 1, "parallel.pipeline_schedule=1f1b needs pipeline stages: set "
             "mesh.pipe > 1, or parallel.pipeline_schedule=gpipe")
    # (the context-parallel attention's shard_map inside 1F1B's, whose other axes are automatic: jax 0.10's
    # fold_in rejects the dropout key's mesh there; without dropout the step equals the plain one)
    _require(schedule != ONE_F_ONE_B or run.mesh.context == 1 or m.dropout == 0, "parallel.pipeline_schedule="
             f"1f1b does not run dropout with context shards yet (mesh.context={run.mesh.context}, model.dropout="
             f"{m.dropout}): set pipeline_schedule=gpipe or circular, mesh.context=1, or model.dropout=0")
    _require(schedule == ONE_F_ONE_B or not pipeline.stage_recompute,
             "parallel.pipeline_stage_recompute=True recomputes a 1F1B stage's forward in its backward; "
             f"parallel.pipeline_schedule={schedule} has none to recompute: set pipeline_schedule=1f1b, or "
             "pipeline_stage_recompute=False")
    _require(v == 1 or p > 1, f"parallel.pipeline_repeats={v} sets the circular pipeline schedule, which needs "
             "pipeline stages: set mesh.pipe > 1, or parallel.pipeline_repeats=1")
    if p == 1:
        return
    # the layers the stages split: every layer but those of stacks run whole on each stage (``Stack.pipelined``)
    staged = [stack.count for stack in run.stacks if stack.pipelined]
    layers = staged[0] if len(staged) == 1 else m.num_layers
    what = "model.num_layers" if layers == m.num_layers else "the pipelined stack's layers (model.num_layers less " \
        f"the {m.num_layers - layers} run whole on each stage)"
    _require(layers % p == 0, f"mesh.pipe={p} splits {what}={layers} into equal stages: pick "
             f"mesh.pipe from the divisors of {layers}")
    _require(layers % (p * v) == 0, f"mesh.pipe={p} x parallel.pipeline_repeats={v} splits "
             f"{what}={layers} into equal chunks: pick a product that divides {layers}")


def _check_context(run: RunSpec) -> None:
    """mesh.context against the sequence: each device holds two chunks of every sequence (load balance:
    ``megajax.parallel.context``), so 2 x context x (model under sequence parallelism) divides it."""
    c = run.mesh.context
    if c == 1:
        return
    split = 2 * c * (run.mesh.model if run.sequence else 1)
    _require(run.model.max_seq_len % split == 0, f"mesh.context={c} gives each device 2 chunks of every sequence"
             f"{' (each split over mesh.model by parallel.sequence)' if run.sequence else ''}: "
             f"model.max_seq_len={run.model.max_seq_len} must be a multiple of {split}")


def _check_pipeline_microbatches(run: RunSpec) -> None:
    """Each data replica's rows per accumulation step are split over the stages (the embedding and head run on
    each stage's share), so they are a multiple of mesh.pipe; a ``parallel.pipeline_microbatches`` given is a
    multiple of mesh.pipe (each stage holds whole microbatches) that cuts them evenly (0: one per stage)."""
    p, wanted, rows = run.mesh.pipe, run.pipeline.microbatches, run.micro_batch
    if p == 1:
        return
    _require(rows % p == 0, f"mesh.pipe={p} splits each data replica's {rows} rows per step (train.global_batch_size "
             f"/ (data x accumulation steps)) over the stages, where the embedding and head run: make them a multiple "
             f"of {p} (train.global_batch_size, or train.micro_batch_size)")
    if not wanted or (wanted % p == 0 and rows % wanted == 0):
        return
    fits = [m for m in range(p, rows + 1, p) if rows % m == 0]
    raise ConfigError(f"parallel.pipeline_microbatches={wanted} must be a multiple of mesh.pipe={p} (each stage "
                      f"holds whole microbatches of its share of the batch) that cuts the {rows} rows each data "
                      f"replica holds per step (train.global_batch_size / (data x accumulation steps)) evenly; pick "
                      f"one of {', '.join(map(str, fits))}, or 0 (one per stage)")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _check_training(run: RunSpec) -> None:
    """The fields only training reads, and the batch against the data shards."""
    t, c, d = run.train, run.checkpoint, run.data
    _require(t.steps >= 1, f"train.steps must be >= 1 (optimizer steps to train to), got {t.steps}")
    _require(t.log_every >= 1, f"train.log_every must be >= 1 (log every N steps), got {t.log_every}")
    _require(t.eval_every >= 0 and t.eval_batches >= 0,
             f"train.eval_every and train.eval_batches must be >= 0 (0: off), got {t.eval_every}, {t.eval_batches}")
    _require(t.max_nonfinite_steps >= 0, f"train.max_nonfinite_steps must be >= 0, got {t.max_nonfinite_steps}")
    _require(not c.enabled or c.every_steps >= 1,
             f"checkpoint.every_steps must be >= 1, got {c.every_steps}; to save no checkpoints set "
             "checkpoint.enabled=False")
    _require(0.0 <= d.valid_fraction < 1.0, f"data.valid_fraction must be in [0, 1), got {d.valid_fraction}")
    _require(0.0 < d.mask_prob < 1.0 and d.max_ngram >= 1 and 0.0 <= d.short_seq_prob <= 1.0,
             f"data.mask_prob must be in (0, 1), data.max_ngram >= 1 and data.short_seq_prob in [0, 1]; got "
             f"{d.mask_prob}, {d.max_ngram}, {d.short_seq_prob}")
    _check_optimizer(run.optimizer, run.loss_scale)
    b, micro, shards = run.global_batch, t.micro_batch_size or 0, run.mesh.batch_shards
    _require(b >= 1 and micro >= 0, f"train.global_batch_size must be >= 1 and train.micro_batch_size >= 0 "
                                    f"(0: no accumulation); got {b} and {micro}")
    _require(b % shards == 0, f"train.global_batch_size={b} is not divisible by the data-parallel size {shards}")
    micro = micro or b // shards
    _require(b % (micro * shards) == 0, f"train.global_batch_size={b} is not a multiple of "
                                        f"train.micro_batch_size={micro} x data={shards}")


def _check_optimizer(o: OptimizerSettings, s: LossScaleSettings) -> None:
    """The optimizer's, schedule's and fp16 loss scale's fields: a negative rate or clip norm would train
    (the loss climbing) rather than fail."""
    _require(o.lr >= 0 and 0 <= o.min_lr <= o.lr,
             f"optimizer.lr must be >= 0 and optimizer.min_lr in [0, lr] (as Megatron's scheduler asserts); got "
             f"lr={o.lr}, min_lr={o.min_lr}")
    _require(o.warmup_steps >= 0 and o.decay_steps >= 0, f"optimizer.warmup_steps and optimizer.decay_steps must be "
                                                          f">= 0 (decay_steps 0: until train.steps); got "
                                                          f"{o.warmup_steps} and {o.decay_steps}")
    _require(o.decay in ("cosine", "linear"), f"optimizer.decay={o.decay!r}; choose 'cosine' or 'linear'")
    _require(0 <= o.b1 < 1 and 0 <= o.b2 < 1 and o.eps > 0,
             f"optimizer.b1 and optimizer.b2 must be in [0, 1) and optimizer.eps > 0; got {o.b1}, {o.b2}, {o.eps}")
    _require(o.weight_decay >= 0 and o.clip_norm > 0, f"optimizer.weight_decay must be >= 0 and optimizer.clip_norm "
                                                      f"> 0; got {o.weight_decay} and {o.clip_norm}")
    _require(s.initial > 0 and 0 < s.min_scale <= s.initial and s.growth_interval >= 1 and s.hysteresis >= 1,
             f"loss_scale needs initial > 0, min_scale in (0, initial], growth_interval >= 1 and hysteresis >= 1; "
             f"got {s.initial}, {s.min_scale}, {s.growth_interval}, {s.hysteresis}")


def _check_preference(run: RunSpec) -> None:
    """ConfigError where ``data.source=preference`` has no loss or no reference model to compare with."""
    if run.data.source != PREFERENCE:
        return
    try:
        run.dpo.preference_loss.check()
    except ValueError as e:
        raise ConfigError(str(e)) from None
    _require(run.data.pairs_per_row >= 1, f"data.pairs_per_row={run.data.pairs_per_row} must be >= 1")
    _require(bool(run.init_from), "data.source=preference tunes a trained model against a frozen reference (by "
             "default the same checkpoint) and this run starts from none: set --config.init_from=CHECKPOINT (an SFT "
             "run or a converted model)")
    _require(not any(stack.kind.routed for stack in run.stacks), f"data.source=preference: DPO of a mixture of "
             f"experts (model.name={run.model_name}) would train without its router's balancing losses, which megajax "
             "does not add to the preference loss yet: tune a dense decoder")
