"""Megatron's analytic minimum of a training step's communication, by category, in bytes per device (what
``comm_budget`` holds a compiled step's against).

Megatron's minimum for one step, per device, with b sequences per data shard (all micro-batches), s tokens, h
hidden, L layers, tensor-parallel degree > 1 and data-parallel degree > 1 where they apply. What a layer
communicates is its kind's (``models.spec.LayerKind``): a = ``tensor_all_reduces`` all-reduces each way per layer
(the g of each row-parallel output forward, the f of each column-parallel input backward; GPT's block 2, a parallel
attention/MLP block with fused GEMMs 1) and r = ``recomputed_all_reduces`` of them redone under ``remat=full``
(GPT's 1, a parallel block's 0); aL and rL below are the sums over a model's layers of their kinds' (``Shape``).
The embedding's lookup, its loss and the gradients are every model's:

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
(``pipelined.reads``: GPT's tokens, BERT's labels and weights) along the ring and the io column; the tail's
gradients reduced over data x pipe once, and those of what the tail and the ends both read (a tied word embedding)
twice, the lookup's and the head's, as Megatron-LM reduces its embedding group's (under FSDP gathered twice too).
With sequence parallelism the layers' pairs as above per run, the lookup's reduce-scatter on the stage's share and
the head's all-gather on the tail's rows (and their transposes), and the tail's replicated parameters' gradients
summed over model on every microbatch. With one-layer chunks under ``remat=full`` XLA names some forward
all-reduces of the fused tail after the recomputation it merged with them, so the forward and backward categories
trade bytes (measured on (4,1,2), v = 2: 0.76 / 1.14; their sum exact).

A mixture of experts (its routed ``LayerKind``'s ``experts``: E experts, k per token; ``models/moe.py``) adds, per
micro-batch and routed layer (``routed_layers``: the routed kind's stacks, all but Qwen3-MoE's dense layers), with
n = b x s x k assignments on one data (and expert) shard:

* expert all-to-all (``mesh.expert`` = e > 1): the assignments' hidden states to their experts' shards and back,
  e x m x h each (a block of m rows per destination, ``exchange_rows``: dropless m = n min(k, E / e) / k, room for
  every assignment a shard can send one destination (a token's k experts are distinct), as an exchange of static
  shape must; with ``model.expert_room``, no more than the destination's room; with a capacity, what the
  destination's experts keep at most: n / e at a capacity factor of 1, the routed tokens themselves), and their
  expert ids there (e x m int32); backward the two hidden-state exchanges again; ``remat=full`` redoes the
  forward's three.
* routing statistics: the assignments and router probability per expert (2 E fp32) summed over the batch's shards
  (data x expert), again under ``remat=full``; with ``mesh.model`` > 1 the top-k weights' gradient (n fp32) summed
  over the model shards, whose partial expert outputs it multiplies (the layer all-reduces its combined output,
  b x s x h, rather than each assignment's, k times as many, as the dense MLP's g).
* data-parallel gradients: the dense parameters' reduced over data x expert (the expert shards are data shards
  outside the routed layers), the experts' over data only.

In GPipe and circular pipeline stages (the experts split over ``model``, not over expert shards) the layers'
statistics (per layer: 2 E fp32 and the z-loss and drops, 2 fp32) are not summed inside each layer: they leave the
stack per stage and are summed over the data replicas and gathered over the stages in one all-reduce of the whole
model's, (2 E + 2) L fp32 per micro-batch, after the tick loop. Under 1F1B each microbatch's statistics of the
whole model, (2 E + 2) L fp32 per device, travel with it round the ring on each of the T ticks, and their gradient
back, the probability mass's and the z-loss's ((E + 1) L: counts have no derivative); with data replicas the tail
sums them over the replicas on each of the M microbatches, each way (one all-reduce of the leaves side by side).
With model shards in stages the layer runs without jax's varying-axes check, and sums its router's gradient,
h x E fp32, over ``model`` on each layer run (a stage-tick of each of its layers; 1F1B: M v per chunk layer),
where a checked one sums the top-k weights' (n fp32).

Per-head norm gradients (Qwen3's query and key RMSNorm scales, ``head_norm_elements``): each model shard holds the
scales whole and computes only its own heads, so with ``mesh.model`` > 1 their gradient is summed over the model
shards, 2 x head_dim fp32 per layer and micro-batch, in the backward pass.

On a ring the pair moves what the all-reduce did: an all-reduce of N sends 2 (t-1)/t N per device, a
reduce-scatter and an all-gather of shard N/t send (t-1) N/t each (``Budget.tensor_ring_bytes``).
"""
from __future__ import annotations

import dataclasses

from megajax.config import RunSpec
from megajax.models import TransformerConfig
from megajax.models.spec import all_reduces, backward_widths

CATEGORIES = ("tensor-parallel forward", "tensor-parallel backward", "loss", "data-parallel gradients",
              "data-parallel parameter gathers", "sequence-parallel extra", "replicated key/value heads",
              "pipeline point-to-point", "pipeline inputs/outputs", "expert all-to-all", "routing statistics",
              "per-head norm gradients", "context key/value", "other")


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the minimum depends on: per-device sequences per micro-batch (one data shard's; under pipeline stages
    a stage's share of them, where the ends run), micro-batches, sequence length,
    hidden size, layers, mesh degrees, the activations' dtype bytes, local gradient elements, the model's
    all-reduces summed over its layers (each ``LayerKind``'s, ``models.spec.all_reduces``) and remat; with sequence
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
    # each way, summed over the ``layers`` (aL: each layer's kind's ``tensor_all_reduces``; under pipeline stages
    # a stage-tick runs the mean layer's, aL / L, times its layers)
    tensor_all_reduces: int
    recomputed_all_reduces: int  # of those, redone under remat=full (rL: the kinds' ``recomputed_all_reduces``)
    # per token, the layers' backward all-reduces' elements where a kind states its own (``LayerKind.backward_width``:
    # latent attention's latents); 0: aL x hidden
    backward_elements: int = 0
    backward_widths: tuple[int, ...] = ()  # the widths of those all-reduces that are not the hidden size
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
    tied_elements: int = 0  # 1F1B: elements on a device of what the tail and the ends both read (a tied embedding)
    sequence_tail_elements: int = 0  # 1F1B: of sequence_grad_elements, the tail's (reduced on every microbatch)
    expert: int = 1  # expert shards (mesh.expert): data shards outside the routed layers
    expert_grad_elements: int = 0  # of local_grad_elements, the experts' (split over expert, reduced over data)
    num_experts: int = 0  # a mixture of experts' experts per layer (0: dense)
    routed_rows: int = 0  # assignments one shard routes per micro-batch: b x s x k
    exchange_rows: int = 0  # rows of each destination's block in the exchange (``RunSpec.exchange_rows``)
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
    a_l, r_l, layers = shape.tensor_all_reduces, shape.recomputed_all_reduces, shape.layers
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
        a_runs, r_runs = a_l * runs // layers, r_l * runs // layers  # the all-reduces of every layer run
        if shape.pipe_circular:  # per tick: the chunk's all-reduces but its last
            recompute = shape.pipe_ticks * (a_l * shape.pipe_layers // layers - 1)
        else:
            recompute = r_runs if shape.remat in ("full", "save_dots") else 0
        if shape.pipe_recompute:  # the chunks whose backward is not the tail's: their forward again
            recompute += a_l * shape.pipe_micro * (shape.pipe_repeats - 1) * shape.pipe_layers // layers
        if shape.sequence:  # each all-reduce -> a reduce-scatter + an all-gather of one shard (the lookup's
            # reduce-scatter and the head's input all-gather, on the tail's rows, and their transposes)
            pairs = (2 * a_runs * tick + (1 + tail) * act) // split
            if shape.pipe_circular:  # the recomputed chunk's all-reduces are pairs too
                redone = 2 * recompute
            else:  # as without stages: the recomputed forward's collectives, one shard each
                redone = a_runs + r_runs if shape.remat in ("full", "save_dots") else 0
            # the pooled first token, whole, and back (1F1B: on the tail's rows)
            pooled = tail * shape.pooled_rows * h * shape.activation_bytes * n
            out["tensor-parallel forward"] = pairs + pooled
            out["tensor-parallel backward"] = pairs + redone * tick // split + pooled
            # a stage sums its layers' replicated parameters' gradients over model on every tick
            per_tick = (shape.sequence_grad_elements + (runs - shape.layers) * shape.sequence_layer_elements
                        + (shape.pipe_micro - 1) * shape.sequence_tail_elements)  # (1F1B: the tail's, per microbatch)
            out["sequence-parallel extra"] = per_tick * 4 * n
        else:
            out["tensor-parallel forward"] = a_runs * tick + act
            out["tensor-parallel backward"] = (a_runs + recompute) * tick + tail * act
        out["loss"] = 3 * tail * b * s * 4 * n
    elif shape.tensor > 1:
        act = b * s * h * shape.activation_bytes * n
        if shape.sequence:  # each all-reduce -> a reduce-scatter + an all-gather of one shard
            pairs = 2 * (a_l + 1) * act // shape.tensor
            recompute = a_l + r_l if shape.remat in ("full", "save_dots") else 0
            out["tensor-parallel forward"] = pairs + shape.pooled_rows * h * shape.activation_bytes * n
            out["tensor-parallel backward"] = pairs + recompute * act // shape.tensor
            out["sequence-parallel extra"] = shape.sequence_grad_elements * 4 * n
        else:
            recompute = r_l if shape.remat == "full" else 0
            out["tensor-parallel forward"] = (a_l + 1) * act
            backward = shape.backward_elements * b * s * shape.activation_bytes * n if shape.backward_elements \
                else a_l * act
            out["tensor-parallel backward"] = backward + (1 + recompute) * act
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
    if shape.num_experts and shape.pipe_1f1b:  # each microbatch's statistics with it round the ring, and back
        # their gradient (the probability mass's and the z-loss's: the counts have none); summed over the data
        # replicas in the tail, each way
        per_layer = 4 * ((2 * shape.num_experts + 2) + (shape.num_experts + 1))
        moves = shape.pipe_ticks + (shape.pipe_micro if shape.data > 1 else 0)
        out["routing statistics"] = moves * per_layer * shape.routed_layers * n
    elif shape.num_experts and shape.pipe > 1:  # in GPipe / circular stages, the experts split over model only
        # the stages' per-layer statistics (assignments and probability mass per expert, z-loss and drops) summed
        # over the data replicas and gathered over the stages once, after the loop
        out["routing statistics"] = 4 * (2 * shape.num_experts + 2) * shape.routed_layers * n
    if shape.num_experts and shape.pipe > 1 and shape.tensor > 1:  # the layer runs unchecked in stages: on each
        # layer run its router's gradient (h x E fp32) is summed over model (where a checked one sums the top-k
        # weights', n: ``models/moe.py``)
        out["routing statistics"] += runs * shape.hidden * shape.num_experts * 4 * n
    elif shape.num_experts and shape.pipe == 1:
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


def shape_of(run: RunSpec, *, micro_batch: int, num_micro: int, tensor: int, data: int, expert: int, context: int,
             layers: int, activation_bytes: int, local_grad_elements: int, **fields) -> Shape:
    """The one builder of a ``Shape``: what ``run``'s model communicates (its layers' all-reduces, a mixture's routed
    rows and exchange, the replicated key/value heads, context parallelism's key/value chunks) for ``layers`` of its
    layers (their kinds' all-reduces as the mean layer's, ``layers`` / L of the model's) with ``micro_batch``
    sequences per device on a ``tensor`` x ``data`` x ``expert`` x ``context`` mesh, beside what the caller read
    of the parameters' layout (``local_grad_elements`` and ``fields``: a compiled run's, ``comm_budget.step_shape``;
    the abstract model's on a planned mesh, ``scaling_layout.comm_shape``)."""
    cfg = run.model
    total = sum(stack.count for stack in run.stacks)
    forward, redone = all_reduces(run.stacks)
    own = any(stack.kind.backward_widths for stack in run.stacks)
    widths = {stack: backward_widths(stack.kind, cfg) for stack in run.stacks}
    seq = cfg.max_seq_len // context
    kv_local = 1 if cfg.kv_replicated(tensor) else cfg.kv_heads // tensor
    return Shape(micro_batch=micro_batch, num_micro=num_micro, seq=seq, hidden=cfg.hidden_size, layers=layers,
                 tensor=tensor, data=data, activation_bytes=activation_bytes, local_grad_elements=local_grad_elements,
                 tensor_all_reduces=forward * layers // total, recomputed_all_reduces=redone * layers // total,
                 backward_elements=sum(st.count * sum(w) for st, w in widths.items()) * layers // total if own else 0,
                 backward_widths=tuple(sorted({x for w in widths.values() for x in w} - {cfg.hidden_size})),
                 remat=cfg.remat, kv_head_elements=kv_head_elements(cfg, tensor), expert=expert,
                 num_experts=run.routed_experts[0], routed_layers=run.routed_layers * layers // total,
                 routed_rows=micro_batch * seq * run.routed_experts[1],
                 exchange_rows=run.exchange_rows(micro_batch, expert), head_dim=cfg.head_dim, context=context,
                 context_kv_elements=micro_batch * seq * kv_local * cfg.head_dim if context > 1 else 0, **fields)


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
