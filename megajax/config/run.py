"""The resolved run: ``RunSpec``, what the model, the mesh and the step are and how it trains, each fact held once.

What follows from the facts is a property, computed when asked: the rules as the run applies them (``rules_for``),
the compute precision (the model's dtype), the accumulation steps, the data cut for the model and the batch
(``dataset``) and the config stored with each checkpoint (``config``). So a tool that weighs another choice changes
a fact with ``dataclasses.replace`` (``config.resolve.replanned``) and everything that follows moves with it.
``StoredRun`` is a checkpoint's stored run as the code that compares against it reads it.
"""

from __future__ import annotations

import dataclasses
import functools

import ml_collections

from megajax.checkpoint.manager import CheckpointSettings
from megajax.config.settings import DPOSettings, LossScaleSettings, OptimizerSettings, TrainSettings
from megajax.data.settings import PREFERENCE, DataSettings, DataSource
from megajax.errors import ConfigError, ShardingConfigError
from megajax.models import ModelSpec, TransformerConfig, model_spec
from megajax.models.objectives import Field, Objective
from megajax.models.preference import preference_objective
from megajax.models.spec import LayerKind, Stack
from megajax.parallel.mesh import MeshShape
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

# train.precision -> the model's compute dtype
PRECISION_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "bfloat16"}
# the precision whose blocks' GEMMs run in FP8 (megajax.parallel.fp8), everything else in its dtype (bf16)
FP8_PRECISION = "fp8"


def splits_sequence(rules: Rules) -> bool:
    """Whether ``rules`` split the residual stream's sequence (``seq_sp``) over more than every sequence (``seq``):
    sequence parallelism."""
    table = dict(rules)
    return bool(set(entry_axes(table.get(SEQUENCE_PARALLEL_NAME))) - set(entry_axes(table.get("seq"))))


@functools.lru_cache(maxsize=1024)
def rules_for(given: Rules, model: TransformerConfig, mesh: MeshShape, sequence: bool) -> Rules:
    """The logical-axis rules a run applies: ``given`` (``config.sharding.rules``) with what the run makes of them,
    every target checked against the mesh's axes (ShardingConfigError; ConfigError where the model cannot be split
    over ``mesh.model``).

    ``sequence`` maps the residual stream's sequence (``seq_sp``) to ``model``; the model leaves unsplit what it
    must on ``mesh.model`` shards (Llama's replicated key/value heads); ``mesh.pipe`` > 1 puts the stacked layers and
    each stage's share of the batch on ``pipe``; ``mesh.expert`` > 1 the stacked experts on ``expert`` and the batch
    on its axes and ``expert`` (outside the experts, the expert shards are data shards); ``mesh.context`` > 1 every
    sequence (``seq``, and the residual stream's ``seq_sp`` before ``model``) on ``context``.
    """
    rules = given
    if sequence and not splits_sequence(given):  # (a seq_sp rule that splits the sequence already is kept)
        rules = tuple((k, "model" if k == SEQUENCE_PARALLEL_NAME else v) for k, v in rules)
    try:
        overrides = model.rule_overrides(mesh.model)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    rules = tuple((k, overrides.get(k, v)) for k, v in rules)
    if mesh.pipe > 1:  # pipeline stages own contiguous layers of the stacked blocks, and their share of the batch at
        # the ends (the embedding, head and loss run on it: megajax.parallel.pipeline)
        rules = tuple((k, PIPE_AXIS if k == "layers" else (*entry_axes(v), PIPE_AXIS) if k == "batch" else v)
                      for k, v in rules)
    if mesh.expert > 1:
        rules = tuple((k, EXPERT_AXIS if k == "experts" else (*entry_axes(v), EXPERT_AXIS) if k == "batch" else v)
                      for k, v in rules)
    if mesh.context > 1:  # the sequence split for the whole stack; attention gathers its keys and values
        rules = tuple((k, CONTEXT_AXIS if k == "seq" else (CONTEXT_AXIS, *entry_axes(v))
                       if k == SEQUENCE_PARALLEL_NAME else v) for k, v in rules)
        rules = tuple((k, v[0] if isinstance(v, tuple) and len(v) == 1 else v) for k, v in rules)
    axes = mesh.axes
    for name, axis in rules:
        if any(a not in axes for a in entry_axes(axis)):
            raise ShardingConfigError(f"sharding rule ({name!r}, {axis!r}) names no mesh axis; use one of "
                                      f"{axes} or None")
    return rules


def cut_data(data: DataSource, model: TransformerConfig, global_batch: int) -> DataSettings:
    """``data`` cut for ``model`` (its vocabulary, sequence length and classes) and ``global_batch`` rows a step."""
    return DataSettings.cut(data, model.vocab_size, model.max_seq_len, getattr(model, "num_classes", 0),
                            global_batch)


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """A config resolved once, the whole run: what the model, the mesh and the step are, and how it trains; read
    everywhere downstream. A run resolved without the training checks (``resolve(..., training=False)``: a model
    loaded for inference, a planner's candidate) reads its whole batch in one step (``train.micro_batch_size`` 0)."""

    model_name: str
    model: TransformerConfig  # its dtype: the compute precision (``precision``)
    mesh: MeshShape  # data=-1 resolved
    given_rules: Rules  # config.sharding.rules as given (``rules``: as the run applies them)
    global_batch: int  # sequences per optimizer step
    sequence: bool  # sequence parallelism: the residual stream's sequence split over `model` (``rules``)
    shard_optimizer: bool  # ZeRO-1: AdamW's moments also split over `data`
    fsdp: bool  # ZeRO-3: parameters (and so gradients and moments) also split over `data`
    pipeline: PipelineSettings  # how the pipelined layer stack runs (parallel.pipeline_*)
    data: DataSource  # config.data (``dataset``: cut for the model and the batch)
    train: TrainSettings
    optimizer: OptimizerSettings
    loss_scale: LossScaleSettings
    checkpoint: CheckpointSettings
    init_from: str  # a checkpoint whose trunk starts the run ("": none)
    dpo: DPOSettings  # read with data.source=preference

    def with_tokenizer_fingerprint(self, fingerprint: str) -> RunSpec:
        """This run with its data's tokenizer fingerprint recorded (stored with each checkpoint)."""
        return dataclasses.replace(self, data=dataclasses.replace(self.data, tokenizer_fingerprint=fingerprint))

    @property
    def rules(self) -> Rules:
        """The logical-axis rules as the run applies them (``rules_for``)."""
        return rules_for(self.given_rules, self.model, self.mesh, self.sequence)

    @property
    def precision(self) -> str:
        """fp32 | bf16 | fp16 | fp8: the model's compute dtype, and fp8 where its blocks' GEMMs are FP8
        (``train.precision`` resolved on this machine)."""
        if self.model.fp8:
            return FP8_PRECISION
        return next(p for p, dtype in PRECISION_DTYPES.items() if dtype == self.model.dtype)

    @property
    def dataset(self) -> DataSettings:
        """The run's data cut for its model and its global batch (what ``megajax.data`` reads)."""
        return cut_data(self.data, self.model, self.global_batch)

    @property
    def micro_batch(self) -> int:
        """Sequences per batch shard (data x expert shards) per accumulation step (``train.micro_batch_size``, 0:
        the whole batch's share)."""
        return self.train.micro_batch_size or self.global_batch // self.mesh.batch_shards

    @property
    def num_micro(self) -> int:
        """Accumulation steps per optimizer step."""
        micro = self.train.micro_batch_size
        return self.global_batch // (micro * self.mesh.batch_shards) if micro else 1

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

    def receive_rows(self, rows: int, expert: int) -> int:
        """Rows an expert shard's receive buffer holds when its group's shards of ``rows`` sequences each send it
        their assignments (``LayerKind.receive_rows``); 0 without routed layers."""
        kind = self._routed_kind
        return kind.receive_rows(self.model, rows, expert) if kind else 0

    @property
    def objective(self) -> Objective:
        """What the run trains: its model's objective, or with ``data.source=preference`` direct preference
        optimisation of it (``models.preference``)."""
        if self.data.source == PREFERENCE:
            return preference_objective(self.dpo.preference_loss, self.data.pairs_per_row)
        return self.model_spec.objective

    @property
    def perplexity_of(self) -> str | None:
        """The validation metric whose exp is the perplexity (the model's; none of a preference loss)."""
        return None if self.data.source == PREFERENCE else self.model_spec.perplexity_of

    @property
    def batch_fields(self) -> dict[str, Field]:
        """The step's batch: its objective's fields at the model's sequence length, packed rows' where
        ``data.document_masking`` (``megajax.data.documents``)."""
        packed = self.data.packed
        return self.objective.batch_fields(self.model.max_seq_len, packed)

    @property
    def parallel_context(self) -> ParallelContext:
        """What a traced model reads under ``sharding.activate``: the rules, FSDP's split parameters and the
        pipeline's schedule; training and its validation both trace under this one object."""
        return ParallelContext(self.rules, params_split=self.fsdp, pipeline=self.pipeline)

    def config(self) -> ml_collections.ConfigDict:
        """The config this run is (every field of its model's family, the mesh resolved, the precision as asked),
        stored with each checkpoint (``config_json``) and read back by resuming, fine-tuning and evaluation."""
        p = self.pipeline
        return ml_collections.ConfigDict({
            "model": {"name": self.model_name, **{f: getattr(self.model, f) for f in self.model.fields()}},
            "init_from": self.init_from,
            "mesh": dataclasses.asdict(self.mesh),
            "sharding": {"rules": self.given_rules},
            "parallel": {"shard_optimizer": self.shard_optimizer, "sequence": self.sequence, "fsdp": self.fsdp,
                         "pipeline_microbatches": p.microbatches, "pipeline_schedule": p.schedule,
                         "pipeline_stage_recompute": p.stage_recompute, "pipeline_repeats": p.repeats},
            "train": {**dataclasses.asdict(self.train), "global_batch_size": self.global_batch},
            "checkpoint": dataclasses.asdict(self.checkpoint),
            "loss_scale": dataclasses.asdict(self.loss_scale),
            "optimizer": dataclasses.asdict(self.optimizer),
            "data": dataclasses.asdict(self.data),
            "dpo": dataclasses.asdict(self.dpo),
        })

    @property
    def config_json(self) -> str:
        """``config()`` as JSON text: what each checkpoint stores beside the state."""
        return self.config().to_json()


@dataclasses.dataclass(frozen=True)
class StoredRun:
    """A checkpoint's stored config (``config.resolve.stored_config``) as the code that compares against it reads
    it: its model, the data it was trained on, and the order its stacked layers were saved in; resolved without the
    current devices (a checkpoint of a larger mesh still reads)."""

    model_name: str
    model: TransformerConfig
    data: DataSource
    global_batch: int  # the batch the run trained with
    layer_layout: tuple[int, int]  # (stages, repeats): ``pipeline.layer_order``

    @property
    def model_spec(self) -> ModelSpec:
        """The model family's spec."""
        return model_spec(self.model_name)

    @property
    def dataset(self) -> DataSettings:
        """Its data cut for its model and the batch it trained with."""
        return cut_data(self.data, self.model, self.global_batch)
