"""Training objectives: each says what its batch holds and turns (model, batch, dropout key) into (loss, metrics).

A batch is a dict of arrays; every field carries logical axis names, which also give its sharding (rows over
``data``). Each model's spec (``megajax.models.spec``) names its objective; the step, the loop and the tools read
the fields and the loss from there. Evaluation reads the fields it scores by name (``tokens``, ``mlm_weights``,
``PAIR_FIELDS``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from megajax.data.tasks.race import NUM_OPTIONS as NUM_CHOICES
from megajax.parallel import pipeline
from megajax.parallel.context import balanced
from megajax.parallel.losses import OWN, Means, lm_loss, vocab_parallel_nll_and_hit
from megajax.parallel.sharding import positions_of

Batch = dict[str, jax.Array]
Metrics = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class Field:
    """One batch entry: its shape without the batch dimension, its dtype and its logical axis names."""

    row_shape: tuple[int, ...]
    dtype: np.dtype
    names: tuple[str | None, ...]  # including the leading 'batch'


@dataclasses.dataclass(frozen=True)
class StateUpdate:
    """Parameters a model moves outside the gradient after each applied update (DeepSeek-V3's routing biases). The
    loss returns the ``sums`` it needs among its metrics, each a sum over the loss's batch; the step adds them over
    its micro-batches unweighted, logs none of them, and after the optimizer's update calls ``apply(model, sums)``,
    which sets the model's variables (no gradient reaches them: the optimizer leaves them as they are)."""

    sums: tuple[str, ...]
    apply: Callable[[nnx.Module, Metrics], None]
    moved: tuple[str, ...] = ()  # the names of the parameters it moves (their gradient is zero: none is reduced)


@dataclasses.dataclass(frozen=True)
class Objective:
    """``loss(model, batch, dropout_key, means=OWN, stack=run_stack) -> (scalar loss, metrics)`` and the batch it
    reads; every mean the loss and its metrics take is ``means.mean`` (``parallel.losses.Means``: the 1F1B step
    divides a microbatch's by the whole batch's counts), and the model's pipelined layer stack runs by ``stack``
    (``pipeline.StackRunner``: the 1F1B step's record the stack's call, or give its output)."""

    loss: Callable[[nnx.Module, Batch, jax.Array | None, Means, pipeline.StackRunner], tuple[jax.Array, Metrics]]
    fields: Callable[[int], dict[str, Field]]  # seq_len -> the batch's fields
    # seq_len -> the fields of packed rows (``megajax.data.documents``), which the loss reads where they are in the
    # batch; None: the objective takes no packed rows
    packed_fields: Callable[[int], dict[str, Field]] | None = None
    # batch -> what the loss's mean over it counts (packed rows' weighted targets, preference pairs), so the step
    # weighs each micro-batch by its share; None: every row counts alike
    counted: Callable[[Batch], jax.Array | None] = lambda batch: batch["loss_weights"].sum() \
        if "loss_weights" in batch else None
    # what the model moves outside the gradient after each step (None: nothing)
    update: StateUpdate | None = None

    def logged(self, metrics: Metrics) -> Metrics:
        """``metrics`` without the sums the state update reads (arrays, not figures to log)."""
        held = self.update.sums if self.update else ()
        return {k: v for k, v in metrics.items() if k not in held}

    def batch_fields(self, seq_len: int, packed: bool) -> dict[str, Field]:
        """The fields of a batch of ``seq_len`` tokens per row, packed (``data.document_masking``) or not;
        ValueError where the objective takes no packed rows."""
        if not packed:
            return self.fields(seq_len)
        if self.packed_fields is None:
            raise ValueError("data.document_masking packs documents into a decoder's windows; this model's "
                             "objective reads no packed rows: set data.document_masking=False")
        return self.packed_fields(seq_len)


def _token_rows(length: int) -> Field:
    return Field((length,), np.dtype(np.int32), ("batch", "seq"))


def documents(batch: Batch) -> dict[str, jax.Array]:
    """A packed batch's ``segments`` and ``positions`` (B, S) as a decoder's keyword arguments (none for windows
    attended whole)."""
    return {k: batch[k] for k in ("segments", "positions") if k in batch}


# (B, S) fields aligned with a decoder's inputs and targets: packed rows' (``megajax.data.documents``) and each
# target's completion under preference tuning (``models.preference``)
TARGET_FIELDS = ("segments", "positions", "loss_weights", "completion_slots")


def next_tokens(batch: Batch, extra: Batch | None = None) -> Batch:
    """A decoder's batch as the model reads it: ``inputs`` and ``targets`` (B, S) from ``tokens`` (B, S + 1), with
    the packed fields and ``extra`` (token-aligned (B, S, ...) fields an objective derives, in the rows' own order);
    under context parallelism each row in its balanced order, with every token's position and the ``order``
    (``megajax.parallel.context.balanced``), which the caller traces the model under (``sharding.positions_of``)."""
    tokens = batch["tokens"]
    rows = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], **{k: batch[k] for k in TARGET_FIELDS if k in batch},
            **(extra or {})}
    return balanced(rows)


def _lm(model: nnx.Module, batch: Batch, key: jax.Array | None, means: Means = OWN,
        stack: pipeline.StackRunner = pipeline.run_stack) -> tuple[jax.Array, Metrics]:
    """Mean next-token cross-entropy; over packed rows a mean weighted by ``loss_weights``."""
    rows = next_tokens(batch)
    with positions_of(rows.pop("order", None)):  # context parallelism's order keys dropout by true position
        return lm_loss(model, rows["inputs"], rows["targets"], dropout_key=key, loss_mask=rows.get("loss_weights"),
                       means=means, stack=stack, **documents(rows)), {}


def _lm_fields(seq_len: int) -> dict[str, Field]:
    # S + 1 ids, inputs and targets overlapping: whole on every device of a row (the model splits the inputs)
    return {"tokens": Field((seq_len + 1,), np.dtype(np.int32), ("batch", None))}


def packed_lm_fields(seq_len: int) -> dict[str, Field]:
    """Next-token prediction's fields over packed rows: the tokens, each input's document (``segments``) and
    position, and each target's weight in the loss (``megajax.data.documents``)."""
    return {**_lm_fields(seq_len), "segments": _token_rows(seq_len), "positions": _token_rows(seq_len),
            "loss_weights": Field((seq_len,), np.dtype(np.float32), ("batch", "seq"))}


BERT_FIELDS = ("tokens", "token_types", "padding_mask", "mlm_labels", "mlm_weights")


def _mlm_sop(model: nnx.Module, batch: Batch, key: jax.Array | None, means: Means = OWN,
             stack: pipeline.StackRunner = pipeline.run_stack) -> tuple[jax.Array, Metrics]:
    """MLM mean over the masked tokens + SOP cross-entropy (Lan et al. 2019), both logged."""
    mlm_logits, sop_logits = model(batch["tokens"], batch["token_types"], batch["padding_mask"], dropout_key=key,
                                   stack=stack)
    nll, hit = vocab_parallel_nll_and_hit(mlm_logits, batch["mlm_labels"])  # (B, S) each
    weights = batch["mlm_weights"]
    mlm = means.mean(nll, weights)
    sop_logits = sop_logits.astype(jnp.float32)
    sop = means.mean(optax.softmax_cross_entropy_with_integer_labels(sop_logits, batch["sop_labels"]))
    return mlm + sop, {"mlm_loss": mlm, "sop_loss": sop, "mlm_accuracy": means.mean(hit, weights),
                       "sop_accuracy": _accuracy(sop_logits, batch["sop_labels"], means)}


def _mlm_sop_fields(seq_len: int) -> dict[str, Field]:
    return {**{k: _token_rows(seq_len) for k in BERT_FIELDS},
            "sop_labels": Field((), np.dtype(np.int32), ("batch",))}


PAIR_FIELDS = ("tokens", "token_types", "padding_mask")  # the encoder's inputs, as BERT pretraining


def _accuracy(logits: jax.Array, labels: jax.Array, means: Means) -> jax.Array:
    return means.mean(logits.argmax(-1) == labels)


def _choice_loss(model: nnx.Module, batch: Batch, key: jax.Array | None, means: Means = OWN,
                 stack: pipeline.StackRunner = pipeline.run_stack) -> tuple[jax.Array, Metrics]:
    """Cross-entropy over classes (classifier) or options (multiple choice: logits (B, C)) + accuracy."""
    logits = model(*(batch[k] for k in PAIR_FIELDS), dropout_key=key, stack=stack).astype(jnp.float32)
    labels = batch["labels"]
    return means.mean(optax.softmax_cross_entropy_with_integer_labels(logits, labels)), {
        "accuracy": _accuracy(logits, labels, means)}


def _span_loss(model: nnx.Module, batch: Batch, key: jax.Array | None, means: Means = OWN,
               stack: pipeline.StackRunner = pipeline.run_stack) -> tuple[jax.Array, Metrics]:
    """Mean of the start and end cross-entropies over positions; accuracy = both positions exact."""
    start, end = (x.astype(jnp.float32) for x in model(*(batch[k] for k in PAIR_FIELDS), dropout_key=key,
                                                       stack=stack))
    s, e = batch["start_positions"], batch["end_positions"]
    ce = optax.softmax_cross_entropy_with_integer_labels
    exact = (start.argmax(-1) == s) & (end.argmax(-1) == e)
    return (means.mean(ce(start, s)) + means.mean(ce(end, e))) / 2, {"accuracy": means.mean(exact)}


def _label() -> Field:
    return Field((), np.dtype(np.int32), ("batch",))


def _classifier_fields(seq_len: int) -> dict[str, Field]:
    return {**{k: _token_rows(seq_len) for k in PAIR_FIELDS}, "labels": _label()}


def _choice_fields(seq_len: int) -> dict[str, Field]:
    rows = Field((NUM_CHOICES, seq_len), np.dtype(np.int32), ("batch", None, "seq"))  # (B, C, S)
    return {**{k: rows for k in PAIR_FIELDS}, "labels": _label()}


def _span_fields(seq_len: int) -> dict[str, Field]:
    return {**{k: _token_rows(seq_len) for k in PAIR_FIELDS}, "start_positions": _label(),
            "end_positions": _label()}


LM = Objective(_lm, _lm_fields, packed_lm_fields)  # next-token prediction
MLM_SOP = Objective(_mlm_sop, _mlm_sop_fields)  # masked LM + sentence order
CLASSIFY = Objective(_choice_loss, _classifier_fields)  # a label per sentence pair
CHOOSE = Objective(_choice_loss, _choice_fields)  # one of NUM_CHOICES options per question
SPAN = Objective(_span_loss, _span_fields)  # start and end positions of the answer
