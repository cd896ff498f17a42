"""Direct preference optimisation (Rafailov et al. 2023) of a decoder: the objective of ``data.source=preference``.

A batch row holds up to ``pairs`` preference pairs (``megajax.data.preference``), each two documents of the row: the
prompt with its chosen completion, then the prompt with its rejected one. ``completion_slots`` (B, S) names, for each
target, the completion it belongs to (``2 j``: pair ``j``'s chosen, ``2 j + 1``: its rejected; -1: a prompt token or
padding), so a completion's log-probability is the sum of its targets' (its ids and the end-of-document id, given the
prompt: the SFT convention). ``reference_logps`` (B, 2 pairs) holds the frozen reference model's sums of the same
targets, computed once before training (``megajax.training.preference``). With x = (policy chosen - policy rejected) -
(reference chosen - reference rejected), the losses are TRL's:

* ``sigmoid`` (DPO): ``-log sigmoid(beta x) (1 - eps) - log sigmoid(-beta x) eps`` (``label_smoothing`` eps);
* ``ipo``: ``(x - 1 / (2 beta))^2``, its log-probabilities each completion's mean over its targets, as TRL takes;
* ``hinge``: ``max(0, 1 - beta x)``.

The metrics are TRL's, means over the pairs: ``rewards/chosen`` and ``rewards/rejected`` (beta times the policy's
log-probability less the reference's), ``rewards/accuracies`` (chosen's reward above rejected's), ``rewards/margins``,
``logps/chosen`` and ``logps/rejected`` (the policy's).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from megajax.models.objectives import Batch, Field, Metrics, Objective, documents, next_tokens, packed_lm_fields
from megajax.parallel import pipeline
from megajax.parallel.losses import OWN, Means, vocab_parallel_cross_entropy
from megajax.parallel.sharding import positions_of

SIGMOID, IPO, HINGE = "sigmoid", "ipo", "hinge"
LOSSES = (SIGMOID, IPO, HINGE)
SLOTS = "completion_slots"
REFERENCE = "reference_logps"


@dataclasses.dataclass(frozen=True)
class PreferenceLoss:
    """``dpo.beta``, ``dpo.loss`` and ``dpo.label_smoothing``: what the objective computes from the four
    log-probabilities of each pair."""

    beta: float = 0.1
    loss: str = SIGMOID
    label_smoothing: float = 0.0

    def check(self) -> None:
        """ValueError naming the field where a value makes no loss."""
        if self.loss not in LOSSES:
            raise ValueError(f"dpo.loss={self.loss!r}; choose one of {', '.join(LOSSES)}")
        if not self.beta > 0:
            raise ValueError(f"dpo.beta={self.beta} must be > 0")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"dpo.label_smoothing={self.label_smoothing} must be in [0, 0.5)")
        if self.label_smoothing and self.loss != SIGMOID:
            raise ValueError(f"dpo.label_smoothing applies to dpo.loss={SIGMOID} (TRL's); dpo.loss={self.loss} "
                             "takes none: set it to 0")

    def per_pair(self, policy: jax.Array, reference: jax.Array) -> tuple[jax.Array, dict[str, jax.Array]]:
        """(each pair's loss, each pair's metric values) from (..., 2) log-probabilities (chosen, rejected) of the
        policy and the reference (already each completion's mean under ``ipo``)."""
        x = (policy[..., 0] - policy[..., 1]) - (reference[..., 0] - reference[..., 1])
        if self.loss == SIGMOID:
            eps = self.label_smoothing
            losses = -jax.nn.log_sigmoid(self.beta * x) * (1 - eps) - jax.nn.log_sigmoid(-self.beta * x) * eps
        elif self.loss == IPO:
            losses = (x - 1 / (2 * self.beta)) ** 2
        else:
            losses = jax.nn.relu(1 - self.beta * x)
        rewards = jax.lax.stop_gradient(self.beta * (policy - reference))
        logps = jax.lax.stop_gradient(policy)
        return losses, {"rewards/chosen": rewards[..., 0], "rewards/rejected": rewards[..., 1],
                        "rewards/accuracies": (rewards[..., 0] > rewards[..., 1]).astype(jnp.float32),
                        "rewards/margins": rewards[..., 0] - rewards[..., 1],
                        "logps/chosen": logps[..., 0], "logps/rejected": logps[..., 1]}


def slot_sums(token_logps: jax.Array, slots: jax.Array, pairs: int) -> tuple[jax.Array, jax.Array]:
    """(sums, counts), each (B, pairs, 2): each completion's summed target log-probabilities and its target count,
    from (B, S) per-target values and their ``completion_slots``."""
    onehot = jax.nn.one_hot(slots, 2 * pairs, dtype=jnp.float32)  # -1 (not counted): a row of zeros
    sums = jnp.einsum("bs,bsk->bk", token_logps.astype(jnp.float32), onehot)
    counts = onehot.sum(axis=1)
    return sums.reshape(-1, pairs, 2), counts.reshape(-1, pairs, 2)


def completion_logps(model: nnx.Module, batch: Batch, pairs: int, key: jax.Array | None = None,
                     stack: pipeline.StackRunner = pipeline.run_stack) -> tuple[jax.Array, jax.Array]:
    """(sums, counts) (B, pairs, 2) of ``model``'s log-probabilities of each completion's targets in a preference
    batch (``slot_sums``); the model reads the packed rows as next-token prediction does (``next_tokens``)."""
    rows = next_tokens(batch)
    with positions_of(rows.pop("order", None)):  # context parallelism's order keys dropout by true position
        logits = model(rows["inputs"], dropout_key=key, stack=stack, **documents(rows))
    return slot_sums(-vocab_parallel_cross_entropy(logits, rows["targets"]), rows[SLOTS], pairs)


def _dpo(settings: PreferenceLoss, pairs: int, model: nnx.Module, batch: Batch, key: jax.Array | None,
         means: Means = OWN, stack: pipeline.StackRunner = pipeline.run_stack) -> tuple[jax.Array, Metrics]:
    """The preference loss and TRL's metrics, means over the batch's pairs (a pair counts where its chosen
    completion has targets)."""
    sums, counts = completion_logps(model, batch, pairs, key, stack)
    return preference_loss(settings, sums, batch[REFERENCE].reshape(sums.shape), counts, means)


def preference_loss(settings: PreferenceLoss, policy: jax.Array, reference: jax.Array, counts: jax.Array,
                    means: Means = OWN) -> tuple[jax.Array, Metrics]:
    """The loss and TRL's metrics, means over the pairs, from (..., pairs, 2) log-probability sums of the policy and
    the reference and each completion's target count (a pair counts where its chosen completion has targets;
    ``ipo`` takes each completion's mean, as TRL does)."""
    policy, reference = policy.astype(jnp.float32), reference.astype(jnp.float32)
    if settings.loss == IPO:
        policy, reference = policy / jnp.maximum(counts, 1), reference / jnp.maximum(counts, 1)
    losses, values = settings.per_pair(policy, reference)
    present = (counts[..., 0] > 0).astype(jnp.float32)
    return means.mean(losses, present), {k: means.mean(v, present) for k, v in values.items()}


def _pairs(batch: Batch) -> jax.Array:
    """The pairs a batch holds (``Objective.counted``): the chosen completions' slots that have targets."""
    slots = batch[SLOTS]
    pairs = batch[REFERENCE].shape[-1] // 2
    return (slots[..., None] == 2 * jnp.arange(pairs)).any(axis=1).sum()


def _fields(pairs: int, seq_len: int) -> dict[str, Field]:
    """Packed rows' tokens, documents and positions, each target's completion slot and each completion's
    reference log-probability."""
    packed = {k: v for k, v in packed_lm_fields(seq_len).items() if k != "loss_weights"}
    return {**packed, SLOTS: Field((seq_len,), np.dtype(np.int32), ("batch", "seq")),
            REFERENCE: Field((2 * pairs,), np.dtype(np.float32), ("batch", None))}


@functools.cache
def preference_objective(settings: PreferenceLoss, pairs: int) -> Objective:
    """The DPO objective for ``pairs`` pairs per row (one value per settings, so the tools' caches keyed on the
    objective hold)."""
    fields = functools.partial(_fields, pairs)
    return Objective(functools.partial(_dpo, settings, pairs), fields, fields, counted=_pairs)
