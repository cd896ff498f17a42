"""What a pipelined step holds on one device beyond the plain step's terms (``memory_terms``): each schedule's
activations (GPipe's ticks, the circular schedule's chunk inputs, 1F1B's ring of held microbatches) and the
gradient sums its tick loop carries. ``memory_planner`` adds them to the step's other terms."""

from __future__ import annotations

import jax
from flax import nnx

from megajax.config import RunSpec, abstract_model_of
from megajax.models.spec import pipelined_stacks
from megajax.parallel import pipeline, pipeline_1f1b
from megajax.parallel.sharding import PIPE_AXIS, activate
from megajax.tools.memory_terms import (
    FP32,
    Activations,
    attention_backward_bytes,
    compute_bytes,
    dropout_bits_bytes,
    head_bytes,
    kinds_kept,
    largest_layer_residual_bytes,
    layer_residual_bytes,
    parameters,
    trunk_rows,
)
from megajax.training import pipelined


def stage_activations(run: RunSpec, micro_batch: int, gpu: bool = False) -> Activations:
    """The activation estimate on one device of ``run``'s mesh with pipeline stages (``mesh.pipe`` = p > 1, M
    microbatches of the micro-batch's rows, v = ``parallel.pipeline_repeats`` chunks per stage; ``gpu``: as compiled
    for an NVIDIA GPU): each of the schedule's ticks (``pipeline.ticks``: M + p - 1 for GPipe) keeps its chunk's
    L/(p v) layers' residuals for one microbatch until the backward pass (idle ticks included), the head runs on the
    stage's share of the micro-batch (1/p of it), and a tick's backward pass works on a copy of its layers' residuals
    beside one layer's working set, for one microbatch.
    The circular schedule (v > 1) recomputes each chunk from its input (``pipeline.run``): each tick keeps that
    input, and a tick's backward pass holds its chunk's residuals (no recomputation inside it) for one microbatch and
    the attention core's backward working set; with attention dropout the masks' bits (``dropout_bits_bytes``).
    The 1F1B schedule: ``_one_f_one_b``.
    Inside a stage every matmul carries the stages' vmapped dimension, so ``save_dots`` (dots without batch
    dimensions) keeps what ``full`` keeps.
    """
    m, p = run.model, run.mesh.pipe
    micro = pipeline.microbatches_for(micro_batch, run.pipeline.microbatches, p)
    rows, remat = micro_batch // micro, "full" if m.remat == "save_dots" else m.remat
    recompute = largest_layer_residual_bytes(run, rows, "none", gpu=gpu) if m.remat in ("full", "save_dots") else 0
    v, ticks = run.pipeline.repeats, pipeline.ticks(micro, p, run.pipeline.repeats)
    if run.pipeline.schedule == pipeline.ONE_F_ONE_B:
        return _one_f_one_b(run, micro_batch, micro, remat, recompute, gpu)
    if v > 1:
        inner = "selective" if m.remat == "selective" else "none"
        # the recomputed chunk's residuals; a chunk of more than one layer also one layer's backward working
        # set beside them (measured on the compiled steps of tests/test_pipeline.py)
        per_chunk = m.num_layers // (p * v)
        recompute = (per_chunk + (per_chunk > 1)) * layer_residual_bytes(run, rows, inner, gpu=gpu)
        recompute += attention_backward_bytes(run, rows, gpu)
        return Activations(ticks * layer_residual_bytes(run, rows, "full", gpu=gpu)
                           + dropout_bits_bytes(run, rows, gpu, circular=True),
                           head_bytes(run, micro_batch // p, gpu), recompute)
    kept = layer_residual_bytes(run, rows, remat, gpu=gpu)
    layers = ticks * m.num_layers // p * kept
    # a tick's backward works on a copy of its layers' residuals, sliced out of the ticks' stack, beside one
    # layer's backward working set (its residuals again, or the recomputed layer's, and the attention core's);
    # a stage of one layer runs without a layer scan and makes no copy (GPT on 8 stages: compiled / formula 0.90
    # with the copy, 0.95 without). With attention dropout under `none` the ticks' stacks hold the inventory
    # (probabilities, dropped probabilities, masks) and nothing more: 13 GPipe steps of 4- and 8-layer GPTs on
    # (2,1,1), (8,1,1), (2,2,2) and (4,1,2) at s = 32 to 256, 0.99 to 1.05 (a third probability-sized term per
    # layer, counted until 2026-11-28, made them 0.84 to 1.09)
    per_stage = m.num_layers // p
    tick = (per_stage * kept if per_stage > 1 else 0) + (recompute or kept)
    tick += attention_backward_bytes(run, rows, gpu) + dropout_bits_bytes(run, rows, gpu)
    return Activations(layers, head_bytes(run, micro_batch // p, gpu), tick)


def _one_f_one_b(run: RunSpec, micro_batch: int, micro: int, remat: str, recompute: int, gpu: bool) -> Activations:
    """The 1F1B schedule's activations (``pipeline_1f1b``; interleaved with v = ``pipeline_repeats`` chunks): the
    chunk-microbatches it holds between their forward and their backward (a ring of min(2 v p - 1, M v),
    ``pipeline_1f1b.held``), the two in flight, its share of the batch's inputs and their gradients (the io columns,
    M/p microbatches each), and one layer's backward working set (``recompute``, or its residuals again, and half
    the attention core's backward working set, ``attention_backward_bytes``), or on the last stage the head on the
    microbatch beside it; with attention dropout a mask's bits (``dropout_bits_bytes``). A held chunk-microbatch is
    its chunk's L/(p v) layers' residuals (``kept`` under the model's remat policy), and three more such stacks are
    live: a forward's before it goes into the ring, a backward's copy out of it, the last stage's
    forward-and-backward (XLA's plan: the compiled temp grows by one stack per ring slot, and the rest is three
    stacks beyond the planner's other terms); a chunk of one layer runs without a layer scan, and one stack is (GPT
    on pipe 2, s = 128: 1.04 to 1.06 of the formula with one, 0.81 to 0.86 with three). With
    ``parallel.pipeline_stage_recompute`` a held chunk-microbatch is its chunk's input, and the chunk's residuals
    exist one microbatch at a time, in its backward. The terms beyond the inventories were measured on 4- and
    8-layer GPTs on pipe 2 x data 2 x model 2 at s = 32 to 256. A stack every stage runs whole (``Stack.pipelined``
    False) before the pipelined ones runs with the embeddings, before the loop, on the stage's share of the
    micro-batch, and keeps its residuals through it (a DeepSeek decoder's dense layers); one after them runs in the
    tail, one microbatch at a time, beside the head (its multi-token prediction depths): deepseek_tiny with a depth
    on pipe 2 x data 2 x model 2 compiled for H100s at 0.97 of the planner's peak (1.23 when both counted as the
    mean layer)."""
    m, p, v = run.model, run.mesh.pipe, run.pipeline.repeats
    rows = micro_batch // micro
    split = run.mesh.model if run.sequence else 1
    one_input = trunk_rows(run, rows) * m.max_seq_len * m.hidden_size * compute_bytes(run) // split
    own = kinds_kept(run, rows, remat, gpu)
    first = next(i for i, (stack, _) in enumerate(own) if stack.pipelined)
    per_chunk = sum(stack.count for stack, _ in own if stack.pipelined) // (p * v)
    kept = max(k for stack, k in own if stack.pipelined and stack.count)  # a pipelined layer's
    stage = per_chunk * kept  # a chunk's
    # the stacks every stage runs whole: those before the pipelined ones with the embeddings, on the stage's share
    # of the micro-batch, their residuals kept through the loop; those after in the tail, one microbatch at a time
    ends = sum(stack.count * k for stack, k in kinds_kept(run, micro_batch // p, remat, gpu)[:first]
               if not stack.pipelined)
    tail = sum(stack.count * k for stack, k in own[first:] if not stack.pipelined)
    held = pipeline_1f1b.held(micro, p, run.pipeline.repeats)
    if run.pipeline.stage_recompute:
        layers = (held + 2 + 2 * micro // p) * one_input + stage
    else:  # a chunk of one layer runs without a layer scan, and XLA keeps one stack beyond the ring
        layers = (held + (3 if per_chunk > 1 else 1)) * stage + (2 + 2 * micro // p) * one_input
    working = (recompute or kept) + attention_backward_bytes(run, rows, gpu) // 2
    working += dropout_bits_bytes(run, rows, gpu)
    return Activations(layers + ends, head_bytes(run, rows, gpu) + tail, working)


_TAILS: dict[tuple, frozenset[str]] = {}


def tail_parameters(run: RunSpec) -> int:
    """Parameters one device holds of what the loss's tail reads after the layer stack (the 1F1B schedule sums
    their gradients in its tick loop): the top-level modules ``pipelined.reads`` finds in the tail's traced jaxpr
    (a tied word embedding, not an untied input one), traced once per model."""
    key = (run.model_spec.module, run.objective, run.model)
    if key not in _TAILS:
        graphdef, state = nnx.split(abstract_model_of(run))
        params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), nnx.to_pure_dict(state))
        batch = {k: jax.ShapeDtypeStruct((2, *f.row_shape), f.dtype) for k, f in run.batch_fields.items()}
        # traced on two stages of one device each, with every axis the run's rules name (expert, context): what the
        # tail reads does not depend on the mesh's sizes
        names = run.mesh.replace(pipe=2).axes
        stages = jax.sharding.AbstractMesh(tuple(2 if n == PIPE_AXIS else 1 for n in names), names)
        with activate(stages, run.parallel_context):
            _TAILS[key] = pipelined.reads(run.objective, graphdef, params, batch).tail
    return sum(p.per_device for p in parameters(run) if p.module in _TAILS[key]
               and p.module not in pipelined_stacks(run.stacks))


def tick_loop_gradient_bytes(run: RunSpec, stack: int) -> int:
    """The fp32 gradient sums a pipelined step's tick loop holds beside the step's gradients, for a stage of
    ``stack`` parameters per device: ``stage_gradient_sums`` copies of them; under 1F1B two copies of the stage's
    sums (what the backward branch reads and what it writes; interleaved too, where each chunk's sums are added to
    elementwise: a dynamic update of one chunk's held one more, 1.11 -> 1.22 of this at s = 32 under `full`, half a
    stage's gradients in the layout measured), and two of what the loss's tail reads (``tail_parameters``: an
    accumulator and each tick's contribution)."""
    if run.mesh.pipe > 1 and run.pipeline.schedule == pipeline.ONE_F_ONE_B:
        return FP32 * (2 * stack + 2 * tail_parameters(run))
    return FP32 * stage_gradient_sums(run) * stack


def stage_gradient_sums(run: RunSpec) -> int:
    """Copies of a stage's layer gradients the tick loop holds (0 without stages): an accumulator and each tick's
    contribution (its layer scan's stacked gradients); under the circular schedule a chunk of one layer adds its
    gradient into the accumulator. Measured on the compiled steps of tests/test_pipeline.py and at h = 256, 8 layers
    on 2 stages (compiled temp 45.0, 45.6, 32.4 MB for GPipe, V = 2, V = 4; a copy 12.6 MB)."""
    if run.mesh.pipe == 1:
        return 0
    per_chunk = run.model.num_layers // (run.mesh.pipe * run.pipeline.repeats)
    return 2 if run.pipeline.repeats == 1 or per_chunk > 1 else 1
