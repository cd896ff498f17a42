"""The checks that run before anything is allocated, and the resolved run.

Nothing below this layer reads the ConfigDict: ``resolve`` turns it into a frozen ``RunSpec``, the whole run (the
model's spec and config, the rules, the mesh shape, the parallelism, the precision, the micro-batching, and the
typed sections of training: ``train``, ``optimizer``, ``loss_scale``, ``checkpoint``, ``dataset`` (``config.data``),
``init_from``), which the model, the step, the loop, the optimizer, the data pipeline and the checkpointer are built
from. The config itself travels only as JSON text (``RunSpec.config_json``), stored with each checkpoint. A
checkpoint's stored config is read as a ``StoredRun`` (its model, data and layer order, typed), and a tool that
weighs another mesh or batch for a run asks ``replanned`` for that choice's RunSpec.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax
import ml_collections

from megajax.checkpoint.manager import CheckpointSettings, read_config
from megajax.config.data_checks import check_data, check_packing
from megajax.config.defaults import with_model_defaults
from megajax.config.migrate import drop_shared_model_fields, migrate_config
from megajax.config.settings import (
    LossScaleSettings,
    OptimizerSettings,
    TrainSettings,
    checkpoint_settings,
    loss_scale_settings,
    optimizer_settings,
    settings_from,
    train_settings,
)
from megajax.data.settings import DataSettings
from megajax.data.sft import default_seq_len
from megajax.errors import ConfigError, ShardingConfigError
from megajax.models import MODELS, ModelSpec, TransformerConfig, model_spec
from megajax.models.objectives import Field
from megajax.models.spec import LayerKind, Stack
from megajax.parallel.mesh import MeshShape
from megajax.parallel.pipeline import CIRCULAR, GPIPE, ONE_F_ONE_B, SCHEDULES
from megajax.parallel.sharding import (
    CONTEXT_AXIS,
    EXPERT_AXIS,
    PIPE_AXIS,
    SEQUENCE_PARALLEL_NAME,
    ParallelContext,
    PipelineSettings,
    Rules,
    entry_axes,
)

_PRECISION_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def resolve_precision(precision: str) -> str:
    """'auto' is bf16 on GPU/TPU and fp32 on CPU."""
    if precision != "auto":
        return precision
    return "fp32" if jax.default_backend() == "cpu" else "bf16"


def model_config(config: ml_collections.ConfigDict) -> TransformerConfig:
    """The model family's own frozen config (its spec's ``config`` type) from ``config.model``, the compute dtype
    from ``train.precision``. A field the family's type lacks is unknown: ConfigError naming the family's fields."""
    m = config.model
    spec = model_spec(m.name)  # an unknown name fails first, naming the choices
    precision = resolve_precision(config.train.precision)
    if precision not in _PRECISION_DTYPES:
        raise ConfigError(f"train.precision={precision!r}; choose one of {sorted(_PRECISION_DTYPES)}")
    fields = spec.config.fields()
    if unknown := set(m) - set(fields) - {"name"}:
        raise ConfigError(f"model.name={m.name} has no field {', '.join(f'model.{f}' for f in sorted(unknown))}; "
                          f"its fields ({spec.config.__name__}) are name, {', '.join(fields)}")
    try:
        return spec.config(**{f: m[f] for f in fields if f in m}, dtype=_PRECISION_DTYPES[precision])
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from e


def stored_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A config read from a checkpoint (its JSON brought up to today's fields by ``config.migrate.migrate_config``;
    ``config.load.run_config``) as its family reads it today: without the fields every model's section held before
    each family had its own config type (``migrate.SHARED_MODEL_FIELDS``) where its family has none, and with the
    family's defaults for what it leaves out (``with_model_defaults``). An unknown family is left for
    ``model_config`` to name."""
    if config.model.get("name") not in MODELS:
        return config
    return with_model_defaults(drop_shared_model_fields(config, model_spec(config.model.name).config.fields()))


# config.model fields that say how a model trains, not what function its parameters compute; every other field
# (a new family's too) must match for a checkpoint to be resumed
TRAINING_ONLY_FIELDS = ("dropout", "init_std", "remat")


def _values(section: ml_collections.ConfigDict | RunSpec) -> dict:
    """Each field of ``section``'s family (its spec's config type): as the section sets it, else the default (a
    resolved run: its model's)."""
    if isinstance(section, (RunSpec, StoredRun)):
        return {"name": section.model_name, **{f: getattr(section.model, f) for f in section.model.fields()}}
    if section.get("name") not in MODELS:
        return dict(section)
    defaults = model_spec(section.name).config()
    return {"name": section.name, **{f: section.get(f, getattr(defaults, f)) for f in defaults.fields()}}


def model_differences(saved: ml_collections.ConfigDict | StoredRun,
                      requested: ml_collections.ConfigDict | RunSpec | StoredRun,
                      ignore: tuple[str, ...] = ()) -> dict[str, tuple[Any, Any]]:
    """field -> (saved, requested) for each field where two ``config.model`` sections (or a resolved or stored
    run's model) differ, over every field of either family but ``TRAINING_ONLY_FIELDS`` and ``ignore``, the name
    first. A field a section leaves out reads as its family's default; one its family does not have, as None."""
    ours, theirs = _values(saved), _values(requested)
    names = (set(ours) | set(theirs)) - set(TRAINING_ONLY_FIELDS) - set(ignore)
    return {f: (ours.get(f), theirs.get(f)) for f in sorted(names, key=lambda f: (f != "name", f))
            if ours.get(f) != theirs.get(f)}


def describe_differences(differences: dict[str, tuple[Any, Any]]) -> str:
    """``"model.F: A saved, B here; ..."`` for ``model_differences``."""
    return "; ".join(f"model.{f}: {a!r} saved, {b!r} here" for f, (a, b) in differences.items())


def rules_of(config: ml_collections.ConfigDict) -> Rules:
    """The logical-axis rules as a hashable tuple of pairs, with targets checked against the mesh axes.

    ``parallel.sequence`` maps the residual stream's sequence (``seq_sp``) to ``model``; ``mesh.expert`` > 1 the
    stacked experts to ``expert`` and the batch to its axes and ``expert`` (expert parallelism inside data
    parallelism: outside the experts, the expert shards are data shards); ``mesh.context`` > 1 every sequence
    (``seq``, and the residual stream's ``seq_sp`` before ``model``) to ``context``.
    """
    rules = tuple((str(k), None if v is None else str(v)) for k, v in config.sharding.rules)
    if config.parallel.sequence:
        rules = tuple((k, "model" if k == SEQUENCE_PARALLEL_NAME else v) for k, v in rules)
    try:  # what the model leaves unsplit on this many model shards (replicated key/value heads)
        overrides = model_config(config).rule_overrides(config.mesh.model)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    rules = tuple((k, overrides.get(k, v)) for k, v in rules)
    if config.mesh.pipe > 1:  # pipeline stages own contiguous layers of the stacked blocks, and their share of the
        # batch at the ends (the embedding, head and loss run on it: megajax.parallel.pipeline)
        rules = tuple((k, PIPE_AXIS if k == "layers" else (*entry_axes(v), PIPE_AXIS) if k == "batch" else v)
                      for k, v in rules)
    if config.mesh.expert > 1:
        rules = tuple((k, EXPERT_AXIS if k == "experts" else (*entry_axes(v), EXPERT_AXIS) if k == "batch" else v)
                      for k, v in rules)
    if config.mesh.context > 1:  # the sequence split for the whole stack; attention gathers its keys and values
        rules = tuple((k, CONTEXT_AXIS if k == "seq" else (CONTEXT_AXIS, *entry_axes(v))
                       if k == SEQUENCE_PARALLEL_NAME else v) for k, v in rules)
        rules = tuple((k, v[0] if isinstance(v, tuple) and len(v) == 1 else v) for k, v in rules)
    axes = MeshShape.of(config.mesh).axes
    for name, axis in rules:
        if any(a not in axes for a in entry_axes(axis)):
            raise ShardingConfigError(f"sharding rule ({name!r}, {axis!r}) names no mesh axis; use one of "
                                      f"{axes} or None")
    return rules


def sequence_parallel(config: ml_collections.ConfigDict) -> bool:
    """Whether the rules split the residual stream's sequence over ``model`` (``parallel.sequence``, or a ``seq_sp``
    rule), beyond the ``context`` split every sequence has under context parallelism."""
    table = dict(rules_of(config))
    return bool(set(entry_axes(table[SEQUENCE_PARALLEL_NAME])) - set(entry_axes(table["seq"])))


def state_split(config: ml_collections.ConfigDict) -> tuple[bool, bool]:
    """(moments split over data, parameters split over data): ``parallel.shard_optimizer`` (ZeRO-1) gives
    (True, False), ``parallel.fsdp`` (ZeRO-3) (True, True)."""
    fsdp = bool(config.parallel.fsdp)
    return bool(config.parallel.shard_optimizer) or fsdp, fsdp


def validate(config: ml_collections.ConfigDict, num_devices: int) -> MeshShape:
    """Checks a config against the device count; returns its mesh shape, ``data=-1`` resolved.

    Runs before any allocation, so a bad config fails in milliseconds with a message that says what to change.
    """
    mesh = MeshShape.of(config.mesh)  # every degree checked before anything divides by one
    tp = mesh.model
    # name, sizes >= 1, hidden % heads, dropout, precision, remat, activation: before anything divides by them
    cfg = model_config(config)
    if cfg.num_heads % tp:
        raise ConfigError(f"model.num_heads={cfg.num_heads} is not divisible by mesh.model={tp}: each model shard "
                          f"must hold whole heads; pick mesh.model from the divisors of {cfg.num_heads}")
    if cfg.hidden_size % tp:
        raise ConfigError(f"model.hidden_size={cfg.hidden_size} is not divisible by mesh.model={tp}")
    if cfg.ffn_size % tp:
        raise ConfigError(f"the MLP width {cfg.ffn_size} is not divisible by mesh.model={tp}")
    if mesh.expert > 1 and not any(stack.kind.routed for stack in model_spec(config.model.name).stacks(cfg)):
        raise ConfigError(f"mesh.expert={mesh.expert} splits a mixture-of-experts model's experts, and this model has "
                          "none: set mesh.expert=1")
    try:
        cfg.check_mesh(tp, config.mesh.pipe, config.mesh.expert)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    padded = cfg.padded_vocab_size
    if padded % tp:
        raise ConfigError(f"the padded vocabulary {padded} (model.make_vocab_size_divisible_by="
                          f"{cfg.make_vocab_size_divisible_by}) is not divisible by mesh.model={tp}; make "
                          f"make_vocab_size_divisible_by a multiple of {tp}")
    if sequence_parallel(config) and cfg.max_seq_len % tp:
        raise ConfigError(f"parallel.sequence splits the sequence over mesh.model={tp}, but model.max_seq_len="
                          f"{cfg.max_seq_len} is not divisible by it: make max_seq_len a multiple of {tp}, pick "
                          f"mesh.model from its divisors, or set parallel.sequence=False")
    _check_pipeline(config)
    _check_context(config, cfg)
    mesh = mesh.resolved(num_devices)
    rules_of(config)
    if config.checkpoint.keep < 0:
        raise ConfigError(f"checkpoint.keep={config.checkpoint.keep}; use 0 to keep every checkpoint or K > 0 "
                          "to keep the newest K")
    if config.checkpoint.restore_step < 0:
        raise ConfigError(f"checkpoint.restore_step={config.checkpoint.restore_step}; use 0 for the latest step "
                          "or a step number listed in WORKDIR/checkpoints")
    return mesh


def _check_pipeline(config: ml_collections.ConfigDict) -> None:
    """mesh.pipe, parallel.pipeline_microbatches and parallel.pipeline_repeats against the model and the other
    switches (what the pipeline does not compute yet is refused, naming the field to change)."""
    p, v, m = config.mesh.pipe, config.parallel.pipeline_repeats, config.model
    schedule = config.parallel.pipeline_schedule
    _require(config.parallel.pipeline_microbatches >= 0, "parallel.pipeline_microbatches must be >= 0 (0: mesh.pipe "
             f"of them), got {config.parallel.pipeline_microbatches}")
    _require(p > 1 or config.parallel.pipeline_microbatches == 0, "parallel.pipeline_microbatches="
             f"{config.parallel.pipeline_microbatches} cuts the batch for pipeline stages: set mesh.pipe > 1 "
             "(--mesh=PIPExDATAxMODEL), or leave pipeline_microbatches=0 (train.micro_batch_size sets the "
             "micro-batches of gradient accumulation)")
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
    _require(schedule != ONE_F_ONE_B or config.mesh.context == 1 or m.dropout == 0, "parallel.pipeline_schedule="
             f"1f1b does not run dropout with context shards yet (mesh.context={config.mesh.context}, model.dropout="
             f"{m.dropout}): set pipeline_schedule=gpipe or circular, mesh.context=1, or model.dropout=0")
    stacks = model_spec(m.name).stacks(model_config(config))
    _require(schedule == ONE_F_ONE_B or not config.parallel.pipeline_stage_recompute,
             "parallel.pipeline_stage_recompute=True recomputes a 1F1B stage's forward in its backward; "
             f"parallel.pipeline_schedule={schedule} has none to recompute: set pipeline_schedule=1f1b, or "
             "pipeline_stage_recompute=False")
    _require(v == 1 or p > 1, f"parallel.pipeline_repeats={v} sets the circular pipeline schedule, which needs "
             "pipeline stages: set mesh.pipe > 1, or parallel.pipeline_repeats=1")
    if p == 1:
        return
    # the layers the stages split: every layer but those of stacks run whole on each stage (``Stack.pipelined``)
    staged = [stack.count for stack in stacks if stack.pipelined]
    layers = staged[0] if len(staged) == 1 else m.num_layers
    what = "model.num_layers" if layers == m.num_layers else "the pipelined stack's layers (model.num_layers less " \
        f"the {m.num_layers - layers} run whole on each stage)"
    _require(layers % p == 0, f"mesh.pipe={p} splits {what}={layers} into equal stages: pick "
             f"mesh.pipe from the divisors of {layers}")
    _require(layers % (p * v) == 0, f"mesh.pipe={p} x parallel.pipeline_repeats={v} splits "
             f"{what}={layers} into equal chunks: pick a product that divides {layers}")


def _check_context(config: ml_collections.ConfigDict, cfg: TransformerConfig) -> None:
    """mesh.context against the sequence: each device holds two chunks of every sequence (load balance:
    ``megajax.parallel.context``), so 2 x context x (model under sequence parallelism) divides it."""
    c = config.mesh.context
    if c == 1:
        return
    split = 2 * c * (config.mesh.model if sequence_parallel(config) else 1)
    _require(cfg.max_seq_len % split == 0, f"mesh.context={c} gives each device 2 chunks of every sequence"
             f"{' (each split over mesh.model by parallel.sequence)' if sequence_parallel(config) else ''}: "
             f"model.max_seq_len={cfg.max_seq_len} must be a multiple of {split}")


def _check_pipeline_microbatches(config: ml_collections.ConfigDict, rows: int) -> None:
    """Each data replica's ``rows`` (per accumulation step) are split over the stages (the embedding and head run on
    each stage's share), so they are a multiple of mesh.pipe; a ``parallel.pipeline_microbatches`` given is a
    multiple of mesh.pipe (each stage holds whole microbatches) that cuts them evenly (0: one per stage)."""
    p, wanted = config.mesh.pipe, config.parallel.pipeline_microbatches
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


def validate_training(config: ml_collections.ConfigDict, data_parallel: int) -> int:
    """Checks the fields only training reads; returns the number of micro-batches per step."""
    t, c, d = config.train, config.checkpoint, config.data
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
    _validate_optimizer(config.optimizer, config.loss_scale)
    b, micro = t.global_batch_size, t.micro_batch_size or 0
    _require(b >= 1 and micro >= 0, f"train.global_batch_size must be >= 1 and train.micro_batch_size >= 0 "
                                    f"(0: no accumulation); got {b} and {micro}")
    _require(b % data_parallel == 0,
             f"train.global_batch_size={b} is not divisible by the data-parallel size {data_parallel}")
    micro = micro or b // data_parallel
    _require(b % (micro * data_parallel) == 0, f"train.global_batch_size={b} is not a multiple of "
                                               f"train.micro_batch_size={micro} x data={data_parallel}")
    return b // (micro * data_parallel)


def _validate_optimizer(o: ml_collections.ConfigDict, s: ml_collections.ConfigDict) -> None:
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


def data_settings(config: ml_collections.ConfigDict) -> DataSettings:
    """``config.data`` with what its data is cut for: the model's vocabulary, sequence length and classes, and the
    global batch."""
    cfg = model_config(config)
    return settings_from(DataSettings, config.data, vocab_size=cfg.vocab_size, max_seq_len=cfg.max_seq_len,
                     num_classes=getattr(cfg, "num_classes", 0), global_batch_size=config.train.global_batch_size)


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """A config resolved once, the whole run: what the model, the mesh and the step are, and how it trains; read
    everywhere downstream. A model resolved for inference (``resolve(..., training=False)``) has no training
    sections (None) and no ``init_from``; its ``dataset`` says what its training data was (the tokenizer)."""

    model_name: str
    model: TransformerConfig
    rules: Rules
    mesh: MeshShape  # data=-1 resolved
    precision: str  # fp32 | bf16 | fp16 (``auto`` resolved)
    global_batch: int
    num_micro: int  # accumulation steps per optimizer step
    shard_optimizer: bool = False  # ZeRO-1: AdamW's moments also split over `data`
    sequence: bool = False  # sequence parallelism: the residual stream's sequence split over `model` (in ``rules``)
    fsdp: bool = False  # ZeRO-3: parameters (and so gradients and moments) also split over `data`
    pipeline: PipelineSettings = PipelineSettings()  # how the pipelined layer stack runs (parallel.pipeline_*)
    train: TrainSettings | None = None
    optimizer: OptimizerSettings | None = None
    loss_scale: LossScaleSettings | None = None
    checkpoint: CheckpointSettings | None = None
    dataset: DataSettings | None = None  # config.data
    init_from: str = ""  # a checkpoint whose trunk starts the run ("": none)
    # the config (with every field of its model's family) as JSON text: stored with each checkpoint, and read back
    # only by ``replanned``
    config_json: str = ""

    def with_tokenizer_fingerprint(self, fingerprint: str) -> RunSpec:
        """This run with its data's tokenizer fingerprint recorded (``dataset`` and the stored config alike)."""
        stored = json.loads(self.config_json)
        stored["data"]["tokenizer_fingerprint"] = fingerprint
        return dataclasses.replace(self, dataset=dataclasses.replace(self.dataset, tokenizer_fingerprint=fingerprint),
                                   config_json=json.dumps(stored))

    @property
    def layer_layout(self) -> tuple[int, int]:
        """(stages, repeats): how the stacked layers are ordered in memory (``pipeline.layer_order``)."""
        return self.mesh.pipe, self.pipeline.repeats

    @property
    def model_spec(self) -> ModelSpec:
        """The model family's spec (``megajax.models.spec``)."""
        return model_spec(self.model_name)

    @property
    def stacks(self) -> tuple[Stack, ...]:
        """The model's layer stacks (``ModelSpec.stacks``): what the tools iterate."""
        return self.model_spec.stacks(self.model)

    @property
    def _routed_kind(self) -> LayerKind | None:
        """The model's routed layer kind (a mixture of experts'), or None."""
        return next((stack.kind for stack in self.stacks if stack.kind.routed), None)

    @property
    def routed_experts(self) -> tuple[int, int]:
        """(experts per routed layer, experts each token is routed to): (0, 0) for a model without routed layers
        (``LayerKind.experts``)."""
        kind = self._routed_kind
        return kind.experts(self.model) if kind else (0, 0)

    @property
    def routed_layers(self) -> int:
        """The model's layers whose MLP is routed (a routed ``LayerKind``'s stacks)."""
        return sum(stack.count for stack in self.stacks if stack.kind.routed)

    def exchange_rows(self, rows: int, expert: int) -> int:
        """Rows of each destination's block when a shard of ``rows`` sequences sends its tokens to their experts on
        ``expert`` shards (``LayerKind.exchange_rows``); 0 without routed layers."""
        kind = self._routed_kind
        return kind.exchange_rows(self.model, rows, expert) if kind else 0

    @property
    def batch_fields(self) -> dict[str, Field]:
        """The step's batch: its objective's fields at the model's sequence length, packed rows' where
        ``data.document_masking`` (``megajax.data.documents``)."""
        packed = self.dataset is not None and self.dataset.packed
        return self.model_spec.objective.batch_fields(self.model.max_seq_len, packed)

    @property
    def micro_batch(self) -> int:
        """Sequences per batch shard (data x expert shards) per accumulation step."""
        return self.global_batch // (self.mesh.batch_shards * self.num_micro)

    @property
    def parallel_context(self) -> ParallelContext:
        """What a traced model reads under ``sharding.activate``: the rules, FSDP's split parameters and the
        pipeline's schedule; training and its validation both trace under this one object."""
        return ParallelContext(self.rules, params_split=self.fsdp, pipeline=self.pipeline)


@dataclasses.dataclass(frozen=True)
class StoredRun:
    """A checkpoint's stored config (``stored_config``) as the code that compares against it reads it: its model,
    the data it was trained on, and the order its stacked layers were saved in; resolved without the current
    devices (a checkpoint of a larger mesh still reads)."""

    model_name: str
    model: TransformerConfig
    dataset: DataSettings
    layer_layout: tuple[int, int]  # (stages, repeats): ``pipeline.layer_order``

    @property
    def model_spec(self) -> ModelSpec:
        """The model family's spec."""
        return model_spec(self.model_name)


def stored_run(config: ml_collections.ConfigDict) -> StoredRun:
    """A stored config (as ``stored_config`` returns it) typed: ConfigError where its model is not one today's
    code reads."""
    return StoredRun(config.model.name, model_config(config), data_settings(config),
                     (config.mesh.pipe, config.parallel.pipeline_repeats))


# config.model.name of a config whose model is its init_from checkpoint's (configs/sft.py): the section's other
# fields are max_seq_len (0: the checkpoint's) and the training-only dropout and remat, which the run sets
FROM_INIT = "init_from"


def model_from_init(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """``config``, or where its ``model.name`` is ``FROM_INIT`` a copy whose model section is its ``init_from``
    checkpoint's (a converted model's, a pretraining run's), with the section's ``max_seq_len`` (where > 0),
    ``dropout`` and ``remat``: a fine-tuning config need not restate the model. ``max_seq_len=0`` keeps the
    checkpoint's, but for fine-tuning files (``data.source=sft``) means the longest example rounded up
    (``data.sft.default_seq_len``), at most the checkpoint's. ConfigError without a checkpoint."""
    if config.model.name != FROM_INIT:
        return config
    if not config.init_from:
        raise ConfigError(f"model.name={FROM_INIT} takes the model from a checkpoint: set --config.init_from=PATH (a "
                          "converted model or a training run's workdir)")
    try:
        stored = stored_config(migrate_config(read_config(config.init_from)))
    except (OSError, ValueError) as e:
        raise ConfigError(f"init_from={config.init_from!r} holds no readable checkpoint config ({e}); pass a "
                          "converted model or a training run's workdir") from None
    given = config.model
    config = config.copy_and_resolve_references()
    config.model = stored.model
    config.model.update(dropout=given.dropout, remat=given.remat)
    if given.max_seq_len > 0:
        config.model.max_seq_len = given.max_seq_len
    elif config.data.source == "sft":  # rows as long as the file needs, not the model's whole context (131K)
        config.model.max_seq_len = default_seq_len(config.data.path, config.data.tokenizer,
                                                   config.data.sft_skip_bad_rows, stored.model.max_seq_len)[0]
    return config


def resolve(config: ml_collections.ConfigDict, num_devices: int, training: bool = True) -> RunSpec:
    """Validates a config against ``num_devices`` and resolves every derived fact once. ``training=False`` (a model
    loaded for inference) skips the fields only training reads; the batch is then the config's, in one step. A
    config whose model is its ``init_from`` checkpoint's reads it first (``model_from_init``)."""
    config = model_from_init(config)
    mesh = validate(config, num_devices)
    check_packing(model_spec(config.model.name), config.data)
    num_micro = validate_training(config, mesh.batch_shards) if training else 1
    if training:
        _check_pipeline_microbatches(config, config.train.global_batch_size // (mesh.batch_shards * num_micro))
    shard_optimizer, fsdp = state_split(config)
    run = {} if not training else dict(
        train=train_settings(config), optimizer=optimizer_settings(config), loss_scale=loss_scale_settings(config),
        checkpoint=checkpoint_settings(config), init_from=config.init_from)
    return RunSpec(model_name=config.model.name, model=model_config(config), rules=rules_of(config), mesh=mesh,
                   precision=resolve_precision(config.train.precision),
                   global_batch=config.train.global_batch_size, num_micro=num_micro,
                   shard_optimizer=shard_optimizer, sequence=sequence_parallel(config), fsdp=fsdp,
                   pipeline=PipelineSettings(config.parallel.pipeline_schedule, config.parallel.pipeline_microbatches,
                                             config.parallel.pipeline_repeats,
                                             config.parallel.pipeline_stage_recompute), dataset=data_settings(config),
                   config_json=with_model_defaults(config).to_json(), **run)


def replanned(run: RunSpec, changes: dict[str, Any], num_devices: int | None = None,
              training: bool = True) -> RunSpec:
    """``run`` resolved again with some of its config's fields changed, for a tool weighing another choice:
    ``changes`` maps dotted fields to values (``{"mesh.model": 4, "train.micro_batch_size": 2}``). The run's mesh is
    kept where not changed; ``num_devices``: the devices the new mesh is checked against (default: as many as it
    takes; ``mesh.data=-1`` then keeps the run's device count). ConfigError as ``resolve`` raises it."""
    config = ml_collections.ConfigDict(json.loads(run.config_json))
    config.mesh.update(dataclasses.asdict(run.mesh))
    for dotted, value in changes.items():
        *sections, field = dotted.split(".")
        parent = config
        for name in sections:
            parent = parent[name]
        if field not in parent:
            raise ConfigError(f"{dotted} is not a config field")
        parent[field] = value
    devices = run.mesh.devices if config.mesh.data == -1 else MeshShape.of(config.mesh).devices
    return resolve(config, devices if num_devices is None else num_devices, training)


def check_data_source(config: ml_collections.ConfigDict) -> None:
    """Raises ConfigError when the model and ``config.data`` do not fit: pretraining models read corpora (their
    spec's example format), fine-tuning models ``data.source=task`` with one of the tasks their spec lists."""
    check_data(model_spec(config.model.name), config.data)


def check_run_data(run: RunSpec) -> None:
    """``check_data_source`` of a resolved run."""
    check_data(run.model_spec, run.dataset)
