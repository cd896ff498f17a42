"""The training sections of a RunSpec (``config.train``, ``config.optimizer``, ``config.loss_scale``,
``config.checkpoint``, ``config.dpo``) as frozen settings, built once by ``config.resolve.resolve`` from the config's
fields."""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections

from megajax.checkpoint.manager import CheckpointSettings
from megajax.models.preference import PreferenceLoss


@dataclasses.dataclass(frozen=True)
class TrainSettings:
    """``config.train`` resolved (the global batch aside: ``RunSpec.global_batch``)."""

    steps: int  # optimizer steps to train to (the global batch: ``RunSpec.global_batch``)
    micro_batch_size: int  # sequences per data shard per accumulation step (0: no accumulation)
    seed: int
    log_every: int
    eval_every: int  # validation every N steps (0: only at the end)
    eval_batches: int  # validation batches per evaluation (0: never)
    max_nonfinite_steps: int  # consecutive non-finite steps tolerated (fp16's routine overflows aside)
    allow_batch_size_change: bool  # resume with another global_batch_size
    peak_flops_per_device: float  # the MFU denominator (0: looked up by device kind)
    # as the config asks it, 'auto' too: what a checkpoint stores, so its model evaluates in the precision of the
    # machine it is loaded on; what it resolved to here is the model's dtype (``RunSpec.precision``)
    precision: str


@dataclasses.dataclass(frozen=True)
class OptimizerSettings:
    """``config.optimizer``: AdamW, global-norm clipping and the learning-rate schedule
    (``megajax.training.optimizer``)."""

    lr: float
    min_lr: float
    warmup_steps: int
    decay: str  # cosine | linear
    decay_steps: int  # 0: until train.steps
    b1: float
    b2: float
    eps: float
    weight_decay: float
    clip_norm: float


@dataclasses.dataclass(frozen=True)
class LossScaleSettings:
    """``config.loss_scale``: fp16's dynamic loss scale (``megajax.training.loss_scale``)."""

    initial: float
    growth_interval: int
    hysteresis: int
    min_scale: float


@dataclasses.dataclass(frozen=True)
class DPOSettings:
    """``config.dpo``: direct preference optimisation's loss and its frozen reference model (read with
    ``data.source=preference``)."""

    beta: float
    loss: str
    label_smoothing: float
    reference: str  # the reference model's checkpoint ("": the run's init_from)

    @property
    def preference_loss(self) -> PreferenceLoss:
        """What the objective computes (``models.preference.PreferenceLoss``)."""
        return PreferenceLoss(self.beta, self.loss, self.label_smoothing)


def settings_from(cls: type, section: ml_collections.ConfigDict, **given: Any) -> Any:
    """``cls`` (a frozen settings type) from the fields of ``section`` it declares, but those ``given``."""
    return cls(**{f.name: section[f.name] for f in dataclasses.fields(cls) if f.name not in given}, **given)


def train_settings(config: ml_collections.ConfigDict) -> TrainSettings:
    """``config.train`` as the frozen settings the RunSpec carries."""
    return settings_from(TrainSettings, config.train)


def optimizer_settings(config: ml_collections.ConfigDict) -> OptimizerSettings:
    """``config.optimizer`` as the frozen settings the RunSpec carries."""
    return settings_from(OptimizerSettings, config.optimizer)


def loss_scale_settings(config: ml_collections.ConfigDict) -> LossScaleSettings:
    """``config.loss_scale`` as the frozen settings the RunSpec carries."""
    return settings_from(LossScaleSettings, config.loss_scale)


def dpo_settings(config: ml_collections.ConfigDict) -> DPOSettings:
    """``config.dpo`` as the frozen settings the RunSpec carries."""
    return settings_from(DPOSettings, config.dpo)


def checkpoint_settings(config: ml_collections.ConfigDict) -> CheckpointSettings:
    """``config.checkpoint`` as the frozen settings the RunSpec carries."""
    return settings_from(CheckpointSettings, config.checkpoint)
