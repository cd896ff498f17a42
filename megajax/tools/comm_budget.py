"""A compiled training step's communication beside Megatron's analytic minimum, by category, in bytes.

Megatron's minimum for one step, per device, with b sequences per data shard (all micro-batches), s tokens, h
hidden, L layers, tensor-parallel degree > 1 and data-parallel degree > 1 where they apply. What a layer
communicates is its model's (``ModelSpec``): a = ``tensor_all_reduces`` all-reduces each way per layer (the g of
each row-parallel output forward, the f of each column-parallel input backward; GPT's block 2, a parallel
attention/MLP block with fused GEMMs 1) and r = ``recomputed_all_reduces`` of them redone under ``remat=full``
(GPT's 1, a parallel block's 0). The embedding's lookup, its loss and the gradients are every model's:

| category | minimum |
| --- | --- |
| tensor-parallel forward | aL + 1 all-reduces of b x s x h (the layers' g, + the vocab-parallel lookup) |
| tensor-parallel backward | aL + 1 all-reduces of b x s x h (the layers' f, + the lookup's; + rL with ``remat=full``) |
| loss | 3 all-reduces of b x s (the vocab-parallel cross-entropy: max, sum of exponentials, target logit) |
| data-parallel gradients | one all-reduce of every local gradient element |
| data-parallel parameter gathers | ZeRO-1: one all-gather of each updated shard; FSDP: two (forward, backward) |

With ``remat=full`` each layer's forward runs again in the backward pass, but only the all-reduces whose results
the recomputation reads again are redone (the layer's output is the saved scan carry): GPT's attention output, L
more, where Megatron's checkpointing redoes both (2L). ``save_dots`` keeps the all-reduced outputs and redoes
none.

Sizes are the collective's message (elements x dtype bytes, per execution; an all-gather's is its input shard),
not the wire traffic of an algorithm (a ring all-reduce moves 2 (n-1)/n of it). Scalar collectives (the gradient
norm's sums of squares, logged metrics) are listed with their count: they cost latency, not bandwidth, and are
outside the ratio. Anything else the compiled step does is ``other`` and counts against it.

With sequence parallelism (``parallel.sequence``, Korthikanti et al. 2022) every tensor-parallel all-reduce of
b x s x h becomes a reduce-scatter and an all-gather, whose message is one device's shard, b x s x h / t (the
reduce-scatter's result, the all-gather's input):

* tensor-parallel forward: aL + 1 reduce-scatters and aL + 1 all-gathers of b x s x h / t; for BERT also its
  pooled first token, an all-reduce of b x h (the token lives on one model shard).
* tensor-parallel backward: the same pairs; with ``remat=full`` or ``save_dots`` (a + r) L shards more (the
  recomputed forward all-gathers the inputs of its column-parallel GEMMs and reduce-scatters the outputs it reads
  again: GPT's QKV and MLP-up inputs and attention output, 3L; ``save_dots`` keeps the GEMMs' local outputs, not
  the collectives' results).
* sequence-parallel extra: the gradients of the replicated parameters that see the split sequence, all-reduced over
  ``model`` once per micro-batch (LayerNorms, row-parallel biases, BERT's MLM transform and segment embeddings),
  and the position embeddings' b-summed gradient, whose rows follow the sequence: an all-gather of s x h / t.

Grouped-query attention with more model shards than key/value heads (Llama; ``TransformerConfig.kv_replicated``)
keeps each key/value weight whole on every shard, and each shard uses the head its query heads share. Its own
category, per micro-batch and layer: the gradient of that one head (h x 2 x head_dim) all-reduced over exactly the
t / kv shards that share it, then the kv heads all-gathered (shard: one head) so every shard holds the whole
gradient again, as its stored weight is whole. Megatron stores only the shard's head and needs no gather; the
gather buys a checkpoint whose layout does not depend on the mesh. Over ``data`` each shard reduces its one head,
as Megatron does, so the data-parallel minimum counts the key/value weight as one head per shard.

With pipeline stages (``mesh.pipe`` = p > 1; ``megajax.parallel.pipeline``) the step runs T ticks
(``pipeline.ticks``), each of a chunk of L/(p v) layers on one microbatch of m rows per device (v =
``parallel.pipeline_repeats``; GPipe: v = 1, T = M + p - 1):

* tensor-parallel: per tick and layer the layer's a all-reduces of m x s x h, forward and backward (idle ticks
  included: every stage runs every tick), plus the embedding's lookup once each way on the stage's share of the
  batch (b / p rows: the ends run on each stage's share; so do the loss's all-reduces); recomputed:
  GPipe as without stages, r per layer (``save_dots`` as ``full``: inside the stages' vmap every matmul has a batch
  dimension), the circular schedule's whole chunks, a L/(p v) - 1 per tick (the chunk's last output is not needed
  again; XLA's layer scan cannot drop the last iteration's, so chunks of more than one layer compile one more per
  tick).
  Replicated key/value heads under stages: their two collectives per stage-tick of each of the stage's layers (each
  tick reduces its head's gradient), T L/(p v) per micro-batch. FSDP under stages gathers each parameter once per
  step (a stage's layers outside the tick loop, kept for the backward pass; ``gathered_shard_elements``). Sequence
  parallelism under stages: the all-reduces become pairs of one shard (a circular chunk's recomputed ones too), the
  permutes carry 1/t of the positions, the stage sums its layers' replicated parameters' gradients
  over ``model`` on every tick (``sequence_layer_elements`` per layer and stage-tick), the position embedding's
  gradient is reduced over ``data`` as its sequence shard, and BERT's pooled token's gradient goes back to its shard
  by a permute; with replicated key/value heads too, the layer's replicated parameters less those heads (counted in
  their own category). Not counted yet: context shards under stages (``check_countable``).
* pipeline point-to-point: per tick one collective permute of m x s x h forward round the ring (each stage's
  output to the next) and one backward (its gradient): 2 T; with t > 1 model shards and no sequence parallelism
  Megatron's scatter/gather, each a permute of m x s x h / t and an all-gather over ``model`` of that shard (the
  gathers found by their named scope, ``pipeline.RING_SCOPE``, ``IO_SCOPE``); forward, the microbatch's per-row
  arguments go with it
  (its rows' indices where dropout keys on them, 4 bytes a row; a packed decoder's segments and positions, 8 bytes
  a position; an encoder's padding mask, 1 byte a position), T of them.
* pipeline inputs/outputs: per tick one permute of m x s x h along the stages towards stage 0 (the io column: the
  inputs reach stage 0, the outputs the stage whose share of the batch they are) and one backward: 2 T (scattered
  and gathered as round the ring); forward
  the per-row arguments again. Megatron keeps the embedding on the first stage and the head on the last; here every
  stage runs them on its share, and the tied embedding's gradient is reduced with the other replicated
  parameters' (the ends' gradients over data x pipe, the stage's layers' over data).

Under the 1F1B schedule (``parallel.pipeline_schedule=1f1b``; ``pipeline_1f1b``) the ends run apart: the embeddings
on each stage's share, the tail (final norm, head, loss) on the last stage, microbatch by microbatch. Its devices
differ, so the budget is the last stage's, which communicates what every stage does and the tail's share: a stage
runs each chunk once per microbatch each way (T ticks, idle halves skipped: the audit counts a collective inside
one of the halves' branches on the ticks the schedule runs it, ``_executions``), so per layer of the stage a
all-reduces of m x s x h each way on each of the M microbatches (M L/p runs; ``remat=full`` r more; with
``pipeline_stage_recompute`` a chunk's forward again in the backward of each of the M (v - 1) chunk-microbatches
whose backward is not the tail's); the lookup's all-reduce on the stage's share (b/p rows); the head's input
gradient and the loss's three all-reduces on each of the M microbatches (b rows, p times GPipe's per stage); per
tick the four transfers as above, each microbatch carrying the batch fields the loss reads
(``pipelined.tail_fields``: GPT's tokens, BERT's labels and weights) along the ring and the io column; the tail's
gradients reduced over data x pipe once, and a tied word embedding's (``TransformerConfig.output_tied``) twice, the
lookup's and the head's, as Megatron-LM reduces its embedding group's (under FSDP it is gathered twice too). With
one-layer chunks under ``remat=full`` XLA names some forward all-reduces of the fused tail after the recomputation
it merged with them, so the forward and backward categories trade bytes (measured on (4,1,2), v = 2: 0.76 / 1.14;
their sum exact). Not counted yet: sequence parallelism under 1F1B (``check_countable``).

A mixture of experts (``TransformerConfig.routed_experts``: E experts, k per token; ``models/moe.py``) adds, per
micro-batch and routed layer (``routed_layers``: all of them but Qwen3-MoE's dense ones), with n = b x s x k
assignments on one data (and expert) shard:

* expert all-to-all (``mesh.expert`` = e > 1): the assignments' hidden states to their experts' shards and back,
  e x m x h each (a block of m rows per destination: dropless, m = n, room for every assignment, as an exchange of
  static shape must; with a capacity, what the destination's experts keep at most, ``exchange_rows``: n / e at a
  capacity factor of 1, the routed tokens themselves), and their expert ids there (e x m int32); backward the two
  hidden-state exchanges again; ``remat=full`` redoes the forward's three.
* routing statistics: the assignments and router probability per expert (2 E fp32) summed over the batch's shards
  (data x expert), again under ``remat=full``; with ``mesh.model`` > 1 the top-k weights' gradient (n fp32) summed
  over the model shards, whose partial expert outputs it multiplies (the layer all-reduces its combined output,
  b x s x h, rather than each assignment's, k times as many, as the dense MLP's g).
* data-parallel gradients: the dense parameters' reduced over data x expert (the expert shards are data shards
  outside the routed layers), the experts' over data only.

Per-head norm gradients (Qwen3's query and key RMSNorm scales, ``head_norm_elements``): each model shard holds the
scales whole and computes only its own heads, so with ``mesh.model`` > 1 their gradient is summed over the model
shards, 2 x head_dim fp32 per layer and micro-batch, in the backward pass.

On a ring the pair moves what the all-reduce did: an all-reduce of N sends 2 (t-1)/t N per device, a
reduce-scatter and an all-gather of shard N/t send (t-1) N/t each (``Budget.tensor_ring_bytes``).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from flax import nnx

from megajax.config import RunSpec
from megajax.config.build import abstract_model_of
from megajax.errors import ConfigError
from megajax.models import ModelSpec, TransformerConfig
from megajax.models.transformer import STACK
from megajax.parallel import pipeline, pipeline_1f1b
from megajax.parallel.hlo_audit import Collective, collectives
from megajax.parallel.partition import over_data
from megajax.parallel.sharding import RESIDUAL, activate, logical_to_spec, spec_axes
from megajax.tools.memory_planner import parameters
from megajax.training import pipelined

DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "f64": 8, "s32": 4, "u32": 4, "pred": 1}
CATEGORIES = ("tensor-parallel forward", "tensor-parallel backward", "loss", "data-parallel gradients",
              "data-parallel parameter gathers", "sequence-parallel extra", "replicated key/value heads",
              "pipeline point-to-point", "pipeline inputs/outputs", "expert all-to-all", "routing statistics",
              "per-head norm gradients", "context key/value", "other")


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the minimum depends on: per-device sequences per micro-batch (one data shard's; under pipeline stages
    a stage's share of them, where the ends run), micro-batches, sequence length,
    hidden size, layers, mesh degrees, the activations' dtype bytes, local gradient elements, the model's
    all-reduces per layer (``ModelSpec.tensor_all_reduces``, ``recomputed_all_reduces``) and remat; with sequence
    parallelism the replicated parameters' elements that see the split sequence (the position embeddings counted as
    one shard) and the rows whose first token is pooled."""

    micro_batch: int
    num_micro: int
    seq: int
    hidden: int
    layers: int
    tensor: int
    data: int
    activation_bytes: int
    local_grad_elements: int
    tensor_all_reduces: int  # per layer, each way (ModelSpec.tensor_all_reduces)
    recomputed_all_reduces: int  # per layer, redone under remat=full (ModelSpec.recomputed_all_reduces)
    remat: str = "none"
    sequence: bool = False
    sequence_grad_elements: int = 0
    sequence_layer_elements: int = 0  # of those, one layer's (under pipeline stages, reduced on every stage-tick)
    pooled_rows: int = 0
    gathered_shard_elements: int = 0  # parameter shards all-gathered over data per step (ZeRO-1, FSDP)
    kv_head_elements: int = 0  # replicated key/value heads: one head's weight per layer (h x 2 x head_dim); else 0
    pipe: int = 1  # pipeline stages; with more than one, the schedule's:
    pipe_ticks: int = 0  # ticks per micro-batch (pipeline.ticks)
    pipe_rows: int = 0  # rows of one pipeline microbatch on one device
    pipe_arg_bytes: int = 0  # bytes of the per-row arguments a microbatch carries, per row (forward only)
    stage_grad_elements: int = 0  # of local_grad_elements, the stage's layers' (reduced over data only)
    pipe_layers: int = 0  # layers a stage runs per tick, L/(p v)
    pipe_circular: bool = False  # the circular schedule (recomputes whole chunks)
    pipe_scatter: bool = False  # activations cross stage boundaries 1/t from each model shard, gathered on arrival
    pipe_1f1b: bool = False  # the 1F1B schedule: counted on the last stage's device (it runs the tail)
    pipe_micro: int = 0  # pipeline microbatches, M
    pipe_repeats: int = 1  # chunks per stage, v
    pipe_recompute: bool = False  # 1F1B's stages run a chunk's forward again in its backward
    tied_elements: int = 0  # 1F1B: the word embedding's elements on a device where the output layer is it
    expert: int = 1  # expert shards (mesh.expert): data shards outside the routed layers
    expert_grad_elements: int = 0  # of local_grad_elements, the experts' (split over expert, reduced over data)
    num_experts: int = 0  # a mixture of experts' experts per layer (0: dense)
    routed_rows: int = 0  # assignments one shard routes per micro-batch: b x s x k
    exchange_rows: int = 0  # rows of each destination's block in the exchange (``exchange_rows`` of the config)
    routed_layers: int = 0  # of ``layers``, those with a routed MLP
    head_norm_elements: int = 0  # per-head norm scales of every layer, whole on each model shard (Qwen3's q/k norms)
    head_dim: int = 0
    context: int = 1  # context shards (mesh.context): ``seq`` is then one shard's s / C positions
    context_kv_elements: int = 0  # one device's chunks of one layer's keys (or values): b x s/C x heads/t x head_dim
    # bytes per key position of what the mask reads of every key, gathered once: a decoder's positions (and packed
    # segments), int32; an encoder's padding mask, one byte
    context_key_bytes: int = 4


def minimum(shape: Shape) -> dict[str, int]:
    """Megatron's analytic bytes per category (module docstring)."""
    b, s, h, n = shape.micro_batch, shape.seq, shape.hidden, shape.num_micro
    a, r = shape.tensor_all_reduces, shape.recomputed_all_reduces
    out = dict.fromkeys(CATEGORIES, 0)
    split = shape.tensor if shape.sequence else 1  # sequence parallelism: each model shard's positions only
    if shape.pipe > 1:
        tick = shape.pipe_rows * s * h * shape.activation_bytes * n  # one microbatch, every micro-batch
        args = shape.pipe_ticks * shape.pipe_rows * shape.pipe_arg_bytes * n
        # scattered: each permute carries 1/t, and an all-gather over model of 1/t shards follows it
        sent = 2 * shape.pipe_ticks * tick // (shape.tensor if shape.pipe_scatter else split)
        sent *= 2 if shape.pipe_scatter else 1
        out["pipeline point-to-point"] = sent + args
        out["pipeline inputs/outputs"] = sent + args
    # 1F1B's last stage runs the tail (head, loss) on every microbatch of its data shard, p times a stage's share
    tail = shape.pipe if shape.pipe_1f1b else 1
    # a stage's layer runs each way: under 1F1B each chunk once per microbatch (its idle halves skipped), else on
    # every tick; without stages each layer once
    if shape.pipe_1f1b:
        runs = shape.pipe_micro * shape.pipe_repeats * shape.pipe_layers
    else:
        runs = shape.pipe_ticks * shape.pipe_layers if shape.pipe > 1 else shape.layers
    if shape.tensor > 1 and shape.pipe > 1:
        act = b * s * h * shape.activation_bytes * n
        if shape.pipe_circular:  # per tick: the chunk's all-reduces but its last
            recompute = shape.pipe_ticks * (a * shape.pipe_layers - 1)
        else:
            recompute = r * runs if shape.remat in ("full", "save_dots") else 0
        if shape.pipe_recompute:  # the chunks whose backward is not the tail's: their forward again
            recompute += a * shape.pipe_micro * (shape.pipe_repeats - 1) * shape.pipe_layers
        if shape.sequence:  # each all-reduce -> a reduce-scatter + an all-gather of one shard
            pairs = 2 * (a * runs * tick + act) // split
            if shape.pipe_circular:  # the recomputed chunk's all-reduces are pairs too
                redone = 2 * recompute
            else:  # as without stages: the recomputed forward's collectives, one shard each
                redone = (a + r) * runs if shape.remat in ("full", "save_dots") else 0
            pooled = shape.pooled_rows * h * shape.activation_bytes * n  # the pooled first token, whole, and back
            out["tensor-parallel forward"] = pairs + pooled
            out["tensor-parallel backward"] = pairs + redone * tick // split + pooled
            # a stage sums its layers' replicated parameters' gradients over model on every tick
            per_tick = shape.sequence_grad_elements + (runs - shape.layers) * shape.sequence_layer_elements
            out["sequence-parallel extra"] = per_tick * 4 * n
        else:
            out["tensor-parallel forward"] = a * runs * tick + act
            out["tensor-parallel backward"] = (a * runs + recompute) * tick + tail * act
        out["loss"] = 3 * tail * b * s * 4 * n
    elif shape.tensor > 1:
        act = b * s * h * shape.activation_bytes * n
        if shape.sequence:  # each all-reduce -> a reduce-scatter + an all-gather of one shard
            pairs = 2 * (a * shape.layers + 1) * act // shape.tensor
            recompute = (a + r) * shape.layers if shape.remat in ("full", "save_dots") else 0
            out["tensor-parallel forward"] = pairs + shape.pooled_rows * h * shape.activation_bytes * n
            out["tensor-parallel backward"] = pairs + recompute * act // shape.tensor
            out["sequence-parallel extra"] = shape.sequence_grad_elements * 4 * n
        else:
            recompute = r * shape.layers if shape.remat == "full" else 0
            out["tensor-parallel forward"] = (a * shape.layers + 1) * act
            out["tensor-parallel backward"] = (a * shape.layers + 1 + recompute) * act
        out["loss"] = 3 * b * s * 4 * n  # the cross-entropy runs in fp32
    if shape.tensor > 1:
        # per layer: the grouped all-reduce of the shard's head, the all-gather of one head per group (fp32); under
        # stages, per stage-tick of each of its layers (the stage reduces its head's gradient on every tick)
        out["replicated key/value heads"] = 2 * runs * shape.kv_head_elements * 4 * n
    # the dense parameters' gradients reduced over the batch's shards (data x expert x pipe), the experts' over
    # data, the stage's layers' over data (x context)
    # (1F1B: a tied word embedding's again, the head's gradient reduced apart from the lookup's)
    dense = shape.local_grad_elements - shape.expert_grad_elements - shape.stage_grad_elements + shape.tied_elements
    out["data-parallel gradients"] = 4 * ((dense if shape.data * shape.expert * shape.context * shape.pipe > 1 else 0)
                                          + (shape.expert_grad_elements if shape.data > 1 else 0)
                                          + (shape.stage_grad_elements if shape.data * shape.context > 1 else 0))
    if shape.data > 1:
        out["data-parallel parameter gathers"] = shape.gathered_shard_elements * 4  # fp32 masters
    if shape.num_experts:
        redo = 2 if shape.remat == "full" else 1  # the recomputed forward exchanges and sums again
        exchange = shape.expert * shape.exchange_rows * n * shape.routed_layers  # rows of one exchange, every layer
        if shape.expert > 1:  # forward: the hidden states there and back, their expert ids; backward: 2 transposes
            out["expert all-to-all"] = (2 * redo + 2) * exchange * h * shape.activation_bytes + redo * exchange * 4
        stats = 0
        if shape.data * shape.expert > 1:  # per layer: assignments and probability mass per expert, summed
            stats += redo * 2 * shape.num_experts * 4 * n * shape.routed_layers
        if shape.tensor > 1:  # per layer backward: the top-k weights' gradient (fp32), summed over the model shards
            stats += shape.routed_rows * 4 * n * shape.routed_layers
        out["routing statistics"] = stats
    if shape.tensor > 1:  # each model shard's heads give part of each per-head norm scale's gradient: summed
        out["per-head norm gradients"] = shape.head_norm_elements * 4 * n
    if shape.context > 1:  # keys and values gathered each layer (again where recomputed), their gradients scattered
        redo = 2 if shape.remat in ("full", "save_dots") else 1
        kv = 2 * shape.layers * shape.context_kv_elements * shape.activation_bytes * n
        out["context key/value"] = (redo + 1) * kv + shape.context_key_bytes * b * s * n
    return out


def categorize(colls: list[Collective], shape: Shape) -> tuple[dict[str, int], int]:
    """(compiled bytes per category, number of scalar collective executions)."""
    tokens = shape.micro_batch * shape.seq
    out, scalars = dict.fromkeys(CATEGORIES, 0), 0
    for c in colls:
        c = dataclasses.replace(c, executions=_executions(c, shape))
        if c.elements == 1:
            scalars += c.executions
            continue
        size = c.shard_elements * DTYPE_BYTES.get(c.dtype, 4) * c.executions
        over_model = c.axes == {"model"}
        if shape.pipe_1f1b and c.axes == {"pipe"} and c.op == "collective-permute":  # ring or io, by its scope
            out["pipeline point-to-point" if pipeline.RING_SCOPE in c.op_name else "pipeline inputs/outputs"] += size
        elif shape.pipe_1f1b and over_model and c.op == "all-reduce" and pipeline_1f1b.TAIL_SCOPE in c.op_name \
                and c.elements == shape.pipe_rows * shape.seq:
            out["loss"] += size  # a microbatch's (m, s) on the last stage
        elif shape.pipe_scatter and c.op == "all-gather" and over_model and (pipeline.RING_SCOPE in c.op_name or
                                                                           pipeline.IO_SCOPE in c.op_name):
            # a scattered activation gathered after its stage boundary
            out["pipeline point-to-point" if pipeline.RING_SCOPE in c.op_name else "pipeline inputs/outputs"] += size
        elif over_model and shape.kv_head_elements and c.phase == "backward" and c.shape[-2:] == (2, shape.head_dim) \
                and ((c.op == "all-reduce" and c.elements == shape.kv_head_elements) or
                     (c.op == "all-gather" and c.shard_elements == shape.kv_head_elements)):
            out["replicated key/value heads"] += size  # the one head's (h, 2, head_dim) weight gradient
        elif shape.sequence and over_model and c.op in ("reduce-scatter", "all-gather") and (
                c.shard_elements * shape.tensor == tokens * shape.hidden or  # or a stage's microbatch (rows, s, h)
                (len(c.shape) > 2 and c.shard_elements * shape.tensor == shape.pipe_rows * shape.seq * shape.hidden)):
            out[f"tensor-parallel {c.phase}"] += size
        elif not shape.sequence and c.op == "all-reduce" and over_model and c.elements in (
                tokens * shape.hidden, shape.pipe_rows * shape.seq * shape.hidden):
            out[f"tensor-parallel {c.phase}"] += size
        elif c.op == "collective-permute" and c.axes == {"pipe"}:  # the ring, or the io column's shift
            out["pipeline point-to-point" if c.cyclic else "pipeline inputs/outputs"] += size
        elif c.op == "all-reduce" and over_model and c.shape[:2] == (shape.micro_batch, shape.seq):
            out["loss"] += size  # (b, s) or (b, s, 1): one value per token
        elif shape.sequence and c.op == "all-reduce" and over_model and c.phase == "forward" and \
                c.elements == shape.pooled_rows * shape.hidden:
            out["tensor-parallel forward"] += size
        elif shape.sequence and shape.pipe > 1 and c.op == "collective-permute" and over_model and \
                c.phase == "backward" and c.elements == shape.pooled_rows * shape.hidden:
            out["tensor-parallel backward"] += size  # the pooled token's gradient back to the shard holding it
        elif shape.sequence and c.op in ("all-reduce", "all-gather") and over_model and c.phase == "backward":
            out["sequence-parallel extra"] += size
        elif c.op == "all-to-all" and c.axes == {"expert"}:
            out["expert all-to-all"] += size
        elif shape.num_experts and c.op == "all-reduce" and (
                (c.phase == "forward" and c.elements == shape.num_experts and c.axes <= {"data", "expert"}) or
                (c.phase == "backward" and c.elements == shape.routed_rows and over_model)):
            out["routing statistics"] += size
        elif shape.head_norm_elements and c.op == "all-reduce" and over_model and c.phase == "backward" and \
                c.shape[-1:] == (shape.head_dim,) and c.elements <= shape.head_norm_elements:
            out["per-head norm gradients"] += size
        elif shape.context > 1 and c.axes == {"context"} and (
                (c.op in ("all-gather", "reduce-scatter") and c.shard_elements == shape.context_kv_elements) or
                (c.op == "all-gather" and c.phase == "forward" and c.shard_elements == tokens)):
            out["context key/value"] += size
        elif c.op == "all-reduce" and c.axes and c.axes <= {"data", "expert", "context", "pipe"}:
            out["data-parallel gradients"] += size
        elif shape.pipe > 1 and c.op == "collective-permute" and c.phase == "backward" and "data" in c.axes and \
                c.axes <= {"data", "pipe", "model"}:  # part of a gradient's reduction over data, which XLA wrote as
            # permutes (BERT's small head gradients under FSDP: between devices of another model shard too)
            out["data-parallel gradients"] += size
        elif c.op == "all-gather" and c.axes == {"data"}:
            out["data-parallel parameter gathers"] += size
        else:
            out["other"] += size
    return out, scalars


def _executions(c: Collective, shape: Shape) -> int:
    """How often ``c`` runs on the device the budget counts. The audit counts a collective inside a conditional on
    every pass of its loop; 1F1B's halves run on some ticks only: on the last stage, of its T ticks, M (v - 1) run a
    chunk's forward and as many a chunk's backward, M the last chunk's forward, tail and backward."""
    if not shape.pipe_1f1b:
        return c.executions
    m, v = shape.pipe_micro, shape.pipe_repeats
    for scope, runs in ((pipeline_1f1b.TAIL_SCOPE, m), (pipeline_1f1b.FORWARD_SCOPE, m * (v - 1)),
                        (pipeline_1f1b.BACKWARD_SCOPE, m * (v - 1))):
        if scope in c.op_name:
            assert c.executions % shape.pipe_ticks == 0, c
            return c.executions // shape.pipe_ticks * runs
    return c.executions


@dataclasses.dataclass(frozen=True)
class Budget:
    """Compiled and minimum bytes per category, and the scalar collectives."""

    compiled: dict[str, int]
    minimum: dict[str, int]
    scalars: int
    tensor: int = 1
    sequence: bool = False

    @property
    def tensor_ring_bytes(self) -> float:
        """Bytes one device sends for the tensor-parallel categories on a ring: 2 (t-1)/t of each all-reduce's
        message, (t-1) times each reduce-scatter's or all-gather's shard (the same for both layouts; BERT's
        pooled first token aside, an all-reduce under sequence parallelism)."""
        t = self.tensor
        got = self.compiled["tensor-parallel forward"] + self.compiled["tensor-parallel backward"]
        return got * ((t - 1) if self.sequence else 2 * (t - 1) / t)

    @property
    def ratio(self) -> float:
        """Compiled / minimum over all categories (1.0 when both are zero, e.g. a 1x1 mesh)."""
        want = sum(self.minimum.values())
        got = sum(self.compiled.values())
        return got / want if want else (1.0 if not got else float("inf"))

    def table(self) -> str:
        lines = [f"{'category':<26}{'compiled bytes':>16}{'Megatron minimum':>18}{'ratio':>9}"]
        for k in CATEGORIES:
            got, want = self.compiled[k], self.minimum[k]
            if got or want:
                ratio = f"{got / want:.4f}" if want else "extra"
                lines.append(f"{k:<26}{got:>16,}{want:>18,}{ratio:>9}")
        lines.append(f"{'total':<26}{sum(self.compiled.values()):>16,}{sum(self.minimum.values()):>18,}"
                     f"{self.ratio:>9.4f}")
        if self.tensor > 1:
            how = "reduce-scatter + all-gather shards x (t-1)" if self.sequence else "all-reduces x 2(t-1)/t"
            lines.append(f"tensor-parallel bytes each device sends on a ring ({how}): {self.tensor_ring_bytes:,.0f}")
        lines.append(f"scalar collectives per step (gradient norm, metrics; not in the ratio): {self.scalars}")
        return "\n".join(lines)


def step_budget(run) -> Budget:
    """The budget of a compiled training run (``megajax.training.loop.setup_run``): its step's collectives read from
    the optimized HLO beside the minimum for its model, mesh and batch."""
    check_countable(run.spec)
    shape = step_shape(run)
    compiled, scalars = categorize(collectives(run.step_fn.as_text(), run.mesh), shape)
    return Budget(compiled, minimum(shape), scalars, shape.tensor, shape.sequence)


def check_countable(spec) -> None:
    """Raises ConfigError for a run (its ``RunSpec``) whose communication the budget does not count yet: context
    shards under pipeline stages, sequence parallelism under the 1F1B schedule (the step itself is right: its
    permutes and single gradient reductions are checked by tests/test_pipeline_1f1b.py)."""
    if spec.pipe > 1 and spec.pipeline_schedule == pipeline.ONE_F_ONE_B and spec.sequence:
        raise ConfigError("the communication budget does not count sequence parallelism under the 1F1B schedule "
                          "yet; read the budget of the same mesh with parallel.sequence=False, or with "
                          "parallel.pipeline_schedule=gpipe")
    if spec.pipe > 1 and spec.context > 1:
        raise ConfigError("the communication budget does not count context shards under pipeline stages yet (each "
                          "stage-tick's key/value all-gathers on a microbatch); drop mesh.pipe or mesh.context to "
                          "read a budget")


def step_shape(run) -> Shape:
    """What the minimum of a compiled training run depends on: its RunSpec (the model's spec for its layers'
    all-reduces) and its parameters' layout."""
    spec, model = run.spec, run.spec.model_spec
    params = run.abstract_state.params
    cfg = spec.model
    kv_head = kv_head_elements(cfg, spec.tensor)
    kv_weight = cfg.num_layers * kv_head * cfg.kv_heads  # replicated over model, reduced in its own category
    layers = cfg.num_layers // spec.pipe  # a stage's
    local = data_gradient_elements(cfg, sum(model_shard_elements(a) for a in jax.tree.leaves(params)), layers,
                                   kv_head)
    stage = data_gradient_elements(cfg, sum(model_shard_elements(a) for a in jax.tree.leaves(params)
                                            if "pipe" in spec_axes(a.sharding.spec)), layers, kv_head)
    rows = spec.micro_batch // spec.pipe  # a device's share of the batch at the ends
    if spec.sequence and spec.pipe > 1:  # under stages the positions' gradient is reduced over data as its shard
        local -= sum(a.size - a.size // spec.tensor for name, a in params.items() if name in model.sequence_rows
                     for a in jax.tree.leaves(a))
    experts, per_token = cfg.routed_experts
    expert_grad = sum(model_shard_elements(a) for a in jax.tree.leaves(params)
                      if "expert" in spec_axes(a.sharding.spec))
    c = spec.context
    kv_local = cfg.kv_heads // spec.tensor if not cfg.kv_replicated(spec.tensor) else 1
    return Shape(micro_batch=rows, num_micro=spec.num_micro, seq=cfg.max_seq_len // c,
                 hidden=cfg.hidden_size, layers=cfg.num_layers, tensor=spec.tensor, data=spec.data,
                 activation_bytes=np.dtype(cfg.compute_dtype).itemsize, local_grad_elements=local,
                 tensor_all_reduces=model.tensor_all_reduces, recomputed_all_reduces=model.recomputed_all_reduces,
                 remat=cfg.remat, sequence=spec.sequence,
                 sequence_grad_elements=sequence_grad_elements(params, spec.tensor, model) - kv_weight
                 if spec.sequence else 0, pooled_rows=model.pooled_rows * rows,
                 sequence_layer_elements=(sequence_grad_elements({STACK: params[STACK]}, spec.tensor, model)
                                          - kv_weight) // cfg.num_layers if spec.sequence and STACK in params else 0,
                 gathered_shard_elements=gathered_shard_elements(run), kv_head_elements=kv_head,
                 expert=spec.expert, expert_grad_elements=expert_grad, num_experts=experts,
                 routed_rows=spec.micro_batch * cfg.max_seq_len // spec.context * per_token,
                 exchange_rows=cfg.exchange_rows(spec.micro_batch, spec.expert),
                 routed_layers=len(cfg.routed_layers), head_norm_elements=head_norm_elements(spec),
                 head_dim=cfg.head_dim, context=c,
                 context_kv_elements=spec.micro_batch * cfg.max_seq_len // c * kv_local * cfg.head_dim
                 if c > 1 else 0, context_key_bytes=(8 if spec.dataset is not None and spec.dataset.packed else 4)
                 if model.causal_lm else 1,
                 stage_grad_elements=stage if spec.pipe > 1 else 0, tied_elements=tied_elements(spec, model),
                 **_pipeline_shape(spec, run.mesh))


def tied_elements(spec: RunSpec, model: ModelSpec) -> int:
    """Under the 1F1B schedule, where the output layer over the vocabulary is the word embedding
    (``TransformerConfig.output_tied``), that embedding's elements on a device: its gradient is reduced twice, the
    lookup's (every stage's share of the batch) and the head's (the last stage's tail, inside the tick loop), as
    Megatron-LM reduces its embedding group's; 0 otherwise."""
    cfg = spec.model
    if spec.pipe == 1 or spec.pipeline_schedule != pipeline.ONE_F_ONE_B or not cfg.output_tied or \
            not model.head_memory.vocab_logit_copies:
        return 0
    return cfg.padded_vocab_size * cfg.hidden_size // spec.tensor


def head_norm_elements(run: RunSpec) -> int:
    """Elements of the layers' per-head norm scales (logical axes ``layers, head_dim``: Qwen3's query and key
    norms), which every model shard holds whole while it computes only its own heads: with ``mesh.model`` > 1 each
    shard's gradient of them is partial, and the shards sum it (one all-reduce per layer in the backward pass)."""
    return sum(math.prod(p.shape) for p in parameters(run) if p.names == ("layers", "head_dim"))


def kv_head_elements(cfg: TransformerConfig, tensor: int) -> int:
    """One key/value head's weight per layer, h x 2 x head_dim, where ``tensor`` > 1 model shards replicate the
    heads (``TransformerConfig.kv_replicated``: each reduces the gradient of its group's head in its own
    category); 0 otherwise."""
    return cfg.hidden_size * 2 * cfg.head_dim if tensor > 1 and cfg.kv_replicated(tensor) else 0


def data_gradient_elements(cfg: TransformerConfig, local: int, layers: int, kv_head: int) -> int:
    """The gradient elements one device all-reduces over ``data``: its ``local`` parameters (as the model axis
    splits them) of a model (or stage) of ``layers`` layers, less, where the key/value heads are replicated
    (``kv_head`` > 0, ``kv_head_elements``), the heads other than its own: each shard reduces one head."""
    return local - layers * kv_head * (cfg.kv_heads - 1) if kv_head else local


def _pipeline_shape(spec: RunSpec, mesh: jax.sharding.Mesh) -> dict[str, int | bool]:
    """The pipeline schedule's part of ``Shape`` (nothing without stages)."""
    p, v = spec.pipe, spec.pipeline_repeats
    if p == 1:
        return {}
    micro = pipeline.microbatches_for(spec.micro_batch, spec.pipeline_microbatches, p)
    rows = spec.micro_batch // micro
    # per row: its index where dropout keys on it (one row on a device: a scalar, outside the ratio); per position
    # a packed decoder's segments and positions (int32), an encoder's padding mask (a byte)
    packed = spec.dataset is not None and spec.dataset.packed
    per_position = (8 if packed else 0) if spec.model_spec.causal_lm else 1
    arg_bytes = (4 if spec.model.dropout > 0 and rows > 1 else 0) + per_position * spec.model.max_seq_len
    one_f_one_b = spec.pipeline_schedule == pipeline.ONE_F_ONE_B
    if one_f_one_b:  # the rows' fields the loss reads go with the microbatch too, to the last stage's tail (but
        # a scalar, outside the ratio: one row's label)
        fields = spec.batch_fields
        arg_bytes += sum(math.prod(fields[k].row_shape) * np.dtype(fields[k].dtype).itemsize
                         for k in _tail_fields(spec, fields, mesh) if rows * math.prod(fields[k].row_shape) > 1)
    # Megatron's scatter/gather at the boundary, where the step does it (asked as the step asks)
    mesh_shape = dict(data=spec.data, model=spec.tensor, pipe=p, expert=spec.expert, context=spec.context)
    scatter = pipeline_1f1b.scattered(logical_to_spec(RESIDUAL, spec.rules), spec.model.max_seq_len,
                                      mesh_shape) is not None
    ticks = pipeline_1f1b.ticks(micro, p, v) if one_f_one_b else pipeline.ticks(micro, p, v)
    return dict(pipe=p, pipe_ticks=ticks, pipe_rows=rows, pipe_arg_bytes=arg_bytes,
                pipe_layers=spec.model.num_layers // (p * v), pipe_circular=v > 1 and not one_f_one_b,
                pipe_scatter=scatter, pipe_1f1b=one_f_one_b, pipe_micro=micro, pipe_repeats=v,
                pipe_recompute=one_f_one_b and spec.pipeline_stage_recompute)


def _tail_fields(spec: RunSpec, fields: dict, mesh: jax.sharding.Mesh) -> list[str]:
    """The batch fields the model's loss reads besides its stack's output (``pipelined.tail_fields``)."""
    graphdef, params = nnx.split(abstract_model_of(spec))
    rows = spec.global_batch // spec.num_micro  # one accumulation micro-batch, every data shard's
    batch = {k: jax.ShapeDtypeStruct((rows, *f.row_shape), f.dtype) for k, f in fields.items()}
    with activate(mesh, spec.parallel_context):
        return pipelined.tail_fields(spec.model_spec.objective, graphdef, params, batch)


def gathered_shard_elements(run) -> int:
    """The parameter shards a step all-gathers over ``data``, as ZeRO and FSDP define it: with
    ``parallel.shard_optimizer`` (ZeRO-1) each updated parameter whose moments are split, once; with
    ``parallel.fsdp`` each split parameter twice, for the forward and again for the backward pass, or under pipeline
    stages once (each stage's layers are gathered once per step, outside the tick loop, and kept; under 1F1B a tied
    word embedding twice, for the lookup and for the head)."""
    spec, total = run.spec, 0
    if spec.data == 1 or not spec.shard_optimizer:
        return 0
    times = 1 if not spec.fsdp or spec.pipe > 1 else 2
    for a in jax.tree.leaves(run.abstract_state.params):
        stored = a.sharding if spec.fsdp else over_data(a.sharding, a.shape)
        if "data" in spec_axes(stored.spec):
            total += times * model_shard_elements(a) // spec.data
    if spec.fsdp:  # 1F1B gathers a tied word embedding for the lookup and again for the head (its tail)
        total += tied_elements(spec, spec.model_spec) // spec.data
    return total


def model_shard_elements(param: jax.ShapeDtypeStruct) -> int:
    """A parameter's elements on one device as the model axis alone splits it: what its gradient all-reduce over
    ``data`` carries, also where ``parallel.fsdp`` stores it split over ``data`` too."""
    sharding = param.sharding
    return int(np.prod(param.shape)) // int(np.prod([sharding.mesh.shape[a] for a in spec_axes(sharding.spec)
                                                     if a != "data"]))


def sequence_grad_elements(params: dict, tensor: int, model: ModelSpec) -> int:
    """Gradient elements summed over ``model`` under sequence parallelism: every parameter replicated over it
    except the heads on the pooled first token (``ModelSpec.pooled_heads``: their input is whole on every shard),
    the parameters whose rows follow the sequence (``ModelSpec.sequence_rows``: the learned positions) as one shard
    of their rows (all-gathered)."""
    total = 0
    for path, a in jax.tree_util.tree_leaves_with_path(params):
        top = jax.tree_util.keystr(path[:1], simple=True)
        if "model" in jax.tree.leaves(tuple(a.sharding.spec)) or top in model.pooled_heads:
            continue
        total += a.size // tensor if top in model.sequence_rows else a.size
    return total
