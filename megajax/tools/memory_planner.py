"""What one training step holds on a device besides its arguments, by formula and as XLA plans it.

Nothing here knows a model family's block: parameters come from the abstract model (``parameters``,
``params_per_device``: ``nnx.eval_shape`` of the spec's module, laid out by the sharding rules; the scaling model
reads them too), a layer's activations and the head's from the model's spec (``ModelSpec.layer_residuals``,
``ModelSpec.head_memory``). Every function reads a resolved run (``config.RunSpec``: the model, its mesh and its
choices); a plan for another mesh or batch is another run (``config.replanned``, ``with_batch``).

The formula (``MemoryReport.temp_bytes``) counts the step's temporaries term by term:

* gradients: fp32, 4 bytes per parameter held: the accumulator the micro-batch scan carries (zeros first), and with
  accumulation a second buffer, the micro-batch's own gradients. With ``parallel.shard_optimizer`` XLA splits them
  over ``data`` too (the sharded AdamW update is their only consumer, so the backward pass writes the shards):
  ZeRO-1 saves gradient memory as ZeRO-2 would. With ``parallel.fsdp`` the parameters are held split as well, so all
  three are counted per shard (``params_per_device(..., split_over_data=True)``), and what is gathered at use is
  added where it is live (``gathered_bytes``): at the head's backward, the whole word embedding (as the model axis
  splits it) and its gradient before the reduce-scatter; in a recomputed layer, that layer's parameters and gradients.
* activations (``activations``): what JAX's autodiff keeps for the backward pass. ``layer_residual_bytes`` asks
  the model's spec for one layer's residuals by kind (``ModelSpec.layer_residuals``; the same bytes as the traced
  jaxpr, ``traced_layer_residual_bytes``, which the tests compare); the scanned stack keeps L of them. On top of
  those, the larger of the output head at the start of the backward pass (``head_bytes``, the spec's
  ``head_memory``: the fp32 logits, their exponentials and their gradient; the tied word embedding's gradient is
  not written yet then, ``word_embedding_grad_bytes``) and, with full / save_dots recomputation, one layer's
  recomputed residuals.

``compiled_memory`` compiles the real step ahead of time (``training.loop.setup_run``, abstract inputs, nothing
allocated) and reads ``memory_analysis()``: arguments = state (parameters, moments, 32 bytes of scalars) + the
batch; outputs alias the donated state (only the metrics are new); temp = everything else at the peak, after XLA
reuses buffers (the donated moments' too) and packs them in one heap. So only state, temp and peak compare; XLA
reports no gradients or activations apart. How close the formula comes, case by case, is measured by
``bench/memory_planner.py`` and recorded in bench/README.md; the tests hold the compiled cases within 10%.

``gpu=True`` plans the step as it compiles for an NVIDIA GPU (``tools.gpu_target``): cuDNN's flash attention
where the model allows it keeps its log-sum-exp instead of the softmax probabilities, XLA:GPU fuses the head's
exponentials and LayerNorms away (the head holds its logits and their fp32 gradient), and one cuBLAS workspace
is live (``GPU_GEMM_WORKSPACE``). tests/test_gpu_target.py holds the tiny configs within 10% of the compiled H100
step; bench/README.md has the paper's and Llama's configs.
"""

from __future__ import annotations

import dataclasses
import math

import jax
from flax import nnx

from megajax.config import RunSpec, abstract_model_of, replanned
from megajax.models.transformer import STACK, attention_reason
from megajax.parallel import pipeline, pipeline_1f1b
from megajax.parallel.sharding import MESH_AXES, PIPE_AXIS, activate, fsdp_spec, logical_to_spec, spec_axes
from megajax.training import pipelined
from megajax.training.loop import batch_layout, setup_run

FP32 = 4
GiB = 1024**3
MAX_MICRO_BATCH = 1 << 16  # the search for the largest micro-batch stops here
# XLA:GPU's cuBLAS workspace, one GEMM's live at a time: 4 MiB per GEMM custom call as compiled for an H100 without
# the device (no autotuning; the real device may pick larger ones)
GPU_GEMM_WORKSPACE = 4 * 2**20
# 32-bit tensors of attention dropout bits (``dropout_bits_bytes``) drawing a layer's mask holds beside the working
# set at the peak, those a circular stage holds beside all it keeps (measured, XLA's attention on the CPU), and those
# as compiled for an H100 (compiled, not measured; the circular stage's not examined there)
DRAWN_BITS, CIRCULAR_BITS, GPU_DRAWN_BITS = 3, 4, 1


def compute_bytes(run: RunSpec) -> int:
    """Bytes of one activation value in the compute dtype: 4 (fp32) or 2 (bf16 / fp16)."""
    return FP32 if run.precision == "fp32" else 2


def attention_for(run: RunSpec, gpu: bool) -> str:
    """The attention core's implementation in the compiled step: 'cudnn' on an NVIDIA GPU where the model allows
    it (``transformer.attention_reason``), else 'xla'."""
    return "cudnn" if gpu and not attention_reason(run.model) else "xla"


def _rows(run: RunSpec, micro_batch: int) -> int:
    """Sequences the trunk runs per micro-batch (the model's rows per example: multiple choice, one per option)."""
    return micro_batch * run.model_spec.rows_per_example


def layer_residual_bytes(run: RunSpec, micro_batch: int, remat: str | None = None, gpu: bool = False) -> int:
    """Bytes one transformer layer keeps for its backward pass on one device of ``run``'s mesh (``remat`` defaults
    to the model's; ``gpu``: as compiled for an NVIDIA GPU, where cuDNN's attention keeps less, ``attention_for``):
    the model's own inventory (``ModelSpec.layer_residuals``; the trunk's block: ``models.block_memory``)."""
    split = run.tensor if run.sequence else 1  # the residual stream's share on one device
    # the expert shards only where there are any: only a mixture of experts accepts them (``check_mesh``)
    experts = {"expert": run.expert} if run.expert > 1 else {}
    remat, rows, attention = remat or run.model.remat, _rows(run, micro_batch), attention_for(run, gpu)
    local = dataclasses.replace(run.model, max_seq_len=run.model.max_seq_len // run.context)
    kept = run.model_spec.layer_residuals(local, rows, run.tensor, split, remat, compute_bytes(run), attention,
                                          **experts)
    return kept + context_attention_bytes(run, rows, remat, attention)


def context_attention_bytes(run: RunSpec, rows: int, remat: str, attention: str) -> int:
    """What a layer keeps under context parallelism beyond its inventory at one device's s / C positions: the
    attention core's queries against every key, not only the device's (its (b, a, s/C, s) residuals, C times those
    at s / C), and the keys and values all-gathered whole, which the core keeps as its inputs (the local chunks are
    in the inventory). Nothing with ``full`` (the layer's input only) or ``save_dots`` (the gathered keys and
    values are recomputed); 0 without context shards."""
    c, cfg = run.context, run.model
    if c == 1 or remat in ("full", "save_dots"):
        return 0
    s = cfg.max_seq_len // c  # one device's queries
    core = 0
    if remat != "selective" and attention == "xla":  # the (s/C x s) probabilities' copies and dropout mask
        per_score = 4 + compute_bytes(run) + (1 if cfg.dropout > 0 else 0)
        core = (c - 1) * cfg.num_heads * s * s * rows * per_score // run.tensor
    heads = 1 if cfg.kv_replicated(run.tensor) else cfg.kv_heads // run.tensor
    gathered = 2 * rows * (cfg.max_seq_len - s) * heads * cfg.head_dim * compute_bytes(run)
    return core + gathered


def head_bytes(run: RunSpec, micro_batch: int, gpu: bool = False) -> int:
    """Bytes of the output head live when the backward pass starts, on one device: what the model's spec says its
    head holds (``ModelSpec.head_memory``).

    ``vocab_logit_copies`` fp32 (b, s, V/t) tensors (GPT's and Llama's 3: the logits, their exponentials and their
    gradient; BERT's MLM head 4, its biased logits too; 0 for a head without vocabulary logits, the task models'),
    with 16-bit compute the compute-dtype logits too, plus ``hidden_tensors`` (b, s, h) fp32 tensors of the
    embeddings, the final norm and the head (GPT's 8; BERT's 16, with the MLM transform's dense, GeLU and
    LayerNorm). With ``parallel.sequence`` those run on the split sequence (1/t of them) and the output layer keeps
    its all-gathered input, one whole (b, s, h) tensor in the compute dtype.

    ``gpu``: XLA:GPU fuses the exponentials, the normalisation and the LayerNorms into the reductions and GEMMs
    that read them; what the head holds at the peak is the logits as the output GEMM writes them (compute dtype)
    and their fp32 gradient (compared with steps compiled for an H100 in tests/test_gpu_target.py and
    bench/README.md).
    """
    m, tp = run.model, run.tensor
    cd, s, b, h = compute_bytes(run), m.max_seq_len // run.context, _rows(run, micro_batch), m.hidden_size
    head = run.model_spec.head_memory
    vocab = head.vocab_logit_copies  # fp32 (b, s, V/t) copies
    logits = s * b * m.padded_vocab_size // tp
    if gpu:
        return logits * (FP32 + cd) if vocab else 0
    extra_cd = cd if vocab and cd < FP32 else 0
    hidden = head.hidden_tensors * s * b * h * FP32
    if run.sequence:
        hidden = hidden // tp + s * b * h * cd
    return logits * (vocab * FP32 + extra_cd) + hidden


def word_embedding_grad_bytes(run: RunSpec) -> int:
    """The tied word embedding's fp32 gradient on one device as the step holds it (split over ``data`` with ZeRO-1
    or FSDP), when it is not live at the step's peak (``MemoryReport.temp_bytes``), else 0. The output layer's
    backward writes it first, after the head's logits, their exponentials and their gradient are freed: without
    recomputation or with ``selective`` the head is the peak, and this gradient is not part of it (gpt_tiny at
    micro-batch 1: temp 0.87 -> 0.99 of the compiled). With ``full`` / ``save_dots`` the compiled peak comes later,
    in the layers' backward, after it is written (leaving it out there undercounts by 8-12%). Under context
    parallelism the compiled step writes it before the head's peak (gpt_tiny and llama_tiny at s=256, context 4:
    the 2 MiB gradient was the whole gap, 1.12x). Under GPipe stages with any policy (the head's backward, on the
    stage's share, ends before the tick loop's: an 8-layer GPT on (4,1,2) under ``full`` at s = 128 with 4x the
    vocabulary, compiled temp +1.50 MB for the head's +1.57 MB, this gradient the difference). 0 for the task
    models, which have no output layer over the vocabulary."""
    gpipe = run.pipe > 1 and run.pipeline_schedule == pipeline.GPIPE
    if not run.model_spec.head_memory.vocab_output or run.context > 1 or \
            (run.model.remat in ("full", "save_dots") and not gpipe):
        return 0
    rows = run.model.padded_vocab_size // run.tensor
    return FP32 * rows * run.model.hidden_size // (run.data if run.shard_optimizer else 1)


@dataclasses.dataclass(frozen=True)
class Activations:
    """Activation bytes on one device for one micro-batch."""

    layers: int  # L layers' residuals, kept from the forward pass to their backward
    head: int  # the output head at the start of the backward pass
    # one layer's residuals recomputed in the backward pass (full / save_dots), and the attention core's backward
    # working set (attention_backward_bytes); under pipeline stages a tick's backward working set (``activations``)
    recompute: int

    @property
    def total(self) -> int:
        return self.layers + max(self.head, self.recompute)  # the head is gone before the first layer's backward


def activations(run: RunSpec, micro_batch: int, gpu: bool = False) -> Activations:
    """The activation estimate for the model's remat policy on one device of ``run``'s mesh (``gpu``: as compiled
    for an NVIDIA GPU).

    With pipeline stages (``mesh.pipe`` = p > 1, M microbatches of the micro-batch's rows, v =
    ``parallel.pipeline_repeats`` chunks per stage): each of the schedule's ticks (``pipeline.ticks``: M + p - 1
    for GPipe) keeps its chunk's L/(p v) layers' residuals for one microbatch until the backward pass (idle ticks
    included), the head runs on the stage's share of the micro-batch (1/p of it), and a tick's backward pass works on
    a copy of its layers' residuals beside one layer's working set, for one microbatch.
    The circular schedule (v > 1) recomputes each chunk from its input (``pipeline.run``): each tick keeps that
    input, and a tick's backward pass holds its chunk's residuals (no recomputation inside it) for one microbatch and
    the attention core's backward working set; with attention dropout the masks' bits (``dropout_bits_bytes``).
    The 1F1B schedule: ``_one_f_one_b``.
    Inside a stage every matmul carries the stages' vmapped dimension, so ``save_dots`` (dots without batch
    dimensions) keeps what ``full`` keeps.
    """
    m, p = run.model, run.pipe
    if p > 1:
        micro = pipeline.microbatches_for(micro_batch, run.pipeline_microbatches, p)
        rows, remat = micro_batch // micro, "full" if m.remat == "save_dots" else m.remat
        recompute = layer_residual_bytes(run, rows, "none", gpu=gpu) if m.remat in ("full", "save_dots") else 0
        v, ticks = run.pipeline_repeats, pipeline.ticks(micro, p, run.pipeline_repeats)
        if run.pipeline_schedule == pipeline.ONE_F_ONE_B:
            return _one_f_one_b(run, micro_batch, micro, layer_residual_bytes(run, rows, remat, gpu=gpu), recompute,
                                gpu)
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
    recompute = attention_backward_bytes(run, micro_batch, gpu) + dropout_bits_bytes(run, micro_batch, gpu)
    if m.remat in ("full", "save_dots"):
        recompute += layer_residual_bytes(run, micro_batch, "none", gpu=gpu)
    layers = m.num_layers * layer_residual_bytes(run, micro_batch, gpu=gpu)
    return Activations(layers, head_bytes(run, micro_batch, gpu), recompute)


def _one_f_one_b(run: RunSpec, micro_batch: int, micro: int, kept: int, recompute: int, gpu: bool) -> Activations:
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
    8-layer GPTs on pipe 2 x data 2 x model 2 at s = 32 to 256."""
    m, p = run.model, run.pipe
    rows = micro_batch // micro
    split = run.tensor if run.sequence else 1
    one_input = _rows(run, rows) * m.max_seq_len * m.hidden_size * compute_bytes(run) // split
    per_chunk = m.num_layers // (p * run.pipeline_repeats)
    stage = per_chunk * kept  # a chunk's
    held = pipeline_1f1b.held(micro, p, run.pipeline_repeats)
    if run.pipeline_stage_recompute:
        layers = (held + 2 + 2 * micro // p) * one_input + stage
    else:  # a chunk of one layer runs without a layer scan, and XLA keeps one stack beyond the ring
        layers = (held + (3 if per_chunk > 1 else 1)) * stage + (2 + 2 * micro // p) * one_input
    working = (recompute or kept) + attention_backward_bytes(run, rows, gpu) // 2
    working += dropout_bits_bytes(run, rows, gpu)
    return Activations(layers, head_bytes(run, rows, gpu), working)


def dropout_bits_bytes(run: RunSpec, rows: int, gpu: bool = False, circular: bool = False) -> int:
    """What drawing attention dropout masks holds on one device (``rows`` sequences), in 32-bit tensors of the
    probabilities' shape (b x a/t x s/C x s, whatever the compute dtype): drawing a layer's mask about three (the
    bits and threefry's intermediates, ``DRAWN_BITS``) beside the working set where the peak is (a layer's
    backward; under 1F1B a forward half beside a backward); with ``circular``, four the stage holds beside all it
    keeps (``CIRCULAR_BITS``). Measured as compiled temp less the formula without them, in such tensors, at s = 256
    (8 heads, h = 64, where they dominate): the plain step 3.4 under `none` and `selective`; GPipe under `full` /
    `selective` 2.3 to 2.5; 1F1B 3.5 (4.7 under `selective`), the circular schedule 2.9 to 4.3, whatever the layers
    per stage (4 to 16 layers; counting the stage's 2 L/p masks had made 1F1B and circular 0.53 to 0.78 at 8 and 16
    layers; GPipe under `full` without them 1.27 to 1.34). As compiled for an H100 (``gpu``) one tensor
    (``GPU_DRAWN_BITS``; gpt_tiny on 2 x 4 at s = 1024 and 2048 under `none`: compiled / formula 1.08 and 1.02 with
    one, 0.89 and 0.82 with three, 1.20 and 1.17 with none). 0 without dropout or with cuDNN's attention (which has
    none)."""
    m = run.model
    if m.dropout == 0 or attention_for(run, gpu) != "xla":
        return 0
    tensors = GPU_DRAWN_BITS if gpu else CIRCULAR_BITS if circular else DRAWN_BITS
    return tensors * m.num_heads * (m.max_seq_len // run.context) * m.max_seq_len * _rows(run, rows) * 4 // run.tensor


def attention_backward_bytes(run: RunSpec, micro_batch: int, gpu: bool = False) -> int:
    """The attention core's working set in a layer's backward pass beyond what the layer kept, on one device: with
    XLA's attention the gradients of the probabilities and of the scores (fp32, b x a/t x s/C x s each), and under
    ``remat=selective`` the recomputed scores and probabilities too (two more); nothing with cuDNN's flash
    attention (it never makes them). What dominates at long sequences (s=4096: 4 of them, 1.08 GB of gpt_tiny's
    compiled 1.08 GB at one layer)."""
    if attention_for(run, gpu) != "xla":
        return 0
    m = run.model
    copies = 4 if m.remat == "selective" else 2
    scores = m.num_heads * (m.max_seq_len // run.context) * m.max_seq_len * _rows(run, micro_batch) // run.tensor
    return copies * scores * FP32


def traced_layer_residual_bytes(run: RunSpec, micro_batch: int) -> int:
    """One layer's residuals on a single device, read from the traced gradient (abstract values only).

    Sums the per-layer slices of the forward layer scan's stacked outputs in ``jax.make_jaxpr(jax.grad(loss))``,
    leaving out the stacked weights that full / save_dots recomputation passes through (those are the
    parameters, not activations). The check behind ``layer_residual_bytes``.
    """
    graphdef, state = nnx.split(abstract_model_of(run))
    params = nnx.to_pure_dict(state)
    objective = run.model_spec.objective
    batch = {k: jax.ShapeDtypeStruct((micro_batch, *f.row_shape), f.dtype)
             for k, f in run.batch_fields.items()}
    key = jax.random.key(0) if run.model.dropout > 0 else None
    jaxpr = jax.make_jaxpr(jax.grad(lambda p, x: objective.loss(nnx.merge(graphdef, p), x, key)[0]))(params, batch)
    forward = next(e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan")  # the layer stack's forward pass
    layer_weights = {v.shape[1:] for v in jax.tree.leaves(params[STACK])}
    total = 0
    for v in forward.outvars[forward.params["num_carry"]:]:
        shape, dtype = v.aval.shape[1:], v.aval.dtype
        if jax.numpy.issubdtype(dtype, jax.dtypes.prng_key) or (shape in layer_weights and dtype == jax.numpy.float32):
            continue  # dropout keys; fp32 weights passed through the scan
        total += math.prod(shape) * dtype.itemsize
    return total


def gradient_bytes(params_per_device: int, data: int, shard_optimizer: bool, num_micro: int = 1) -> int:
    """fp32 gradients as the step holds them, split over ``data`` with ZeRO-1: one buffer, and with accumulation
    (``num_micro`` > 1) a second, the micro-batch's own gradients beside the accumulator the scan carries."""
    return (2 if num_micro > 1 else 1) * FP32 * params_per_device // (data if shard_optimizer else 1)


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """``memory_analysis()`` of the compiled training step, per device, in bytes."""

    arguments: int  # the state (parameters, moments, scalars) and the batch
    outputs: int  # the new state (aliased to the donated one) and the metrics
    aliased: int  # outputs written into donated argument buffers
    temp: int  # everything else at the peak: gradients, activations, copies, workspace
    batch: int  # the batch's share of ``arguments``

    @property
    def state(self) -> int:
        return self.arguments - self.batch

    @property
    def peak(self) -> int:
        return self.arguments + self.temp + self.outputs - self.aliased


def with_batch(run: RunSpec, micro_batch: int, num_micro: int = 1) -> RunSpec:
    """``run`` training ``micro_batch`` sequences per data shard in each of ``num_micro`` accumulation steps (its
    global batch micro_batch x data x num_micro), resolved again (``config.replanned``)."""
    return replanned(run, {"train.global_batch_size": micro_batch * run.data * run.expert * num_micro,
                           "train.micro_batch_size": micro_batch if num_micro > 1 else 0})


def compiled_memory(run: RunSpec, micro_batch: int, num_micro: int = 1) -> CompiledMemory:
    """Compiles ``run``'s training step on its mesh (``with_batch``: ``micro_batch`` sequences per data shard,
    ``num_micro`` accumulation steps) ahead of time and reads XLA's memory plan; allocates nothing. Needs the mesh's
    devices."""
    return run_memory(setup_run(with_batch(run, micro_batch, num_micro)))


def run_memory(run) -> CompiledMemory:
    """XLA's memory plan of a compiled training run (``training.loop.setup_run``)."""
    analysis = run.step_fn.memory_analysis()
    if analysis is None:
        raise RuntimeError("this backend's compiled step reports no memory_analysis()")
    fields, _ = batch_layout(run.spec, run.mesh)
    rows = run.spec.micro_batch * run.spec.num_micro // run.spec.pipe  # this device's sequences per step (a data
    # shard's, split over the stages too)
    batch = rows * sum(math.prod(f.row_shape) * f.dtype.itemsize for f in fields.values())
    return CompiledMemory(analysis.argument_size_in_bytes, analysis.output_size_in_bytes,
                          analysis.alias_size_in_bytes, analysis.temp_size_in_bytes, batch)


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Per-device memory in bytes for one (data, model) mesh and micro-batch."""

    num_params: int
    params_per_device: int
    param_bytes: int  # fp32 master
    grad_bytes: int  # fp32, one per parameter held (the paper's accounting)
    optimizer_bytes: int  # AdamW m and v, fp32 (split over data with parallel.shard_optimizer or fsdp)
    activation_bytes: int  # one micro-batch: activations.total
    data: int
    model: int
    activations: Activations  # the activation estimate's parts
    step_grad_bytes: int  # gradients as the compiled step holds them (split over data with ZeRO-1, FSDP)
    batch_bytes: int  # the step's input batch on this device
    sequence: bool = False  # parallel.sequence: the residual stream's activations split over model
    fsdp: bool = False  # parallel.fsdp: params_per_device counts each device's data shard of them
    late_grad_bytes: int = 0  # gradients not yet written at the head's peak (the tied word embedding's)
    gathered_head_bytes: int = 0  # FSDP: the gathered word embedding and its unreduced gradient (``gathered_bytes``)
    gathered_layer_bytes: int = 0  # FSDP: one gathered layer's parameters and unreduced gradients
    # pipeline stages: the backward loop over ticks sums its stage's layer gradients beside the gradients themselves
    stage_grad_bytes: int = 0
    pipe: int = 1  # pipeline stages: the parameters and activations above are one stage's
    workspace_bytes: int = 0  # the GPU's GEMM workspace (GPU_GEMM_WORKSPACE); 0 on the CPU
    active_params: int = 0  # the parameters one token uses (``ModelSpec.active_parameters``: a mixture of experts')
    expert: int = 1  # expert shards: data shards outside a mixture of experts' routed layers
    context: int = 1  # context shards: each device holds s / C positions of every sequence
    rough: str = ""  # where the estimate is known to miss the compiled step by more than 10%: by how much, measured
    tick_loop_after_head: bool = False  # GPipe: the stage's sums are not live yet at the head's peak (it is first)

    @property
    def total_bytes(self) -> int:
        """The paper's accounting: 16 bytes per parameter held plus the activations."""
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes

    @property
    def state_bytes(self) -> int:
        """The step's donated state: parameters and moments (the compiled arguments less the batch)."""
        return self.param_bytes + self.optimizer_bytes

    @property
    def temp_bytes(self) -> int:
        """What the step allocates besides its arguments (compare ``CompiledMemory.temp``): the gradients and the
        layers' activations, then the larger of the head at the start of the backward pass (before the tied word
        embedding's gradient is written) and one recomputed layer, each with what FSDP gathers for it; with
        pipeline stages, the tick loop's sums of the stage's layer gradients (two under GPipe, one circular) beside a
        tick's backward, and beside the head but under GPipe (whose head's backward ends before the tick loop's
        starts: an 8-layer GPT on (2,2,2) and (4,1,2) under ``full`` at s = 64, compiled / formula 0.85 and 0.80
        with them there, 0.97 without)."""
        a = self.activations
        head = a.head - self.late_grad_bytes + self.gathered_head_bytes
        head += 0 if self.tick_loop_after_head else self.stage_grad_bytes
        recompute = a.recompute + self.gathered_layer_bytes + self.stage_grad_bytes if a.recompute else 0
        return self.step_grad_bytes + a.layers + max(head, recompute) + self.workspace_bytes

    @property
    def peak_bytes(self) -> int:
        """The step's peak on one device (compare ``CompiledMemory.peak``); what ``fits`` checks."""
        return self.state_bytes + self.batch_bytes + self.temp_bytes

    def fits(self, device_bytes: float) -> bool:
        return self.peak_bytes <= device_bytes


def gathered_bytes(run: RunSpec) -> tuple[int, int]:
    """(head, layer): what ``parallel.fsdp`` holds whole over ``data`` at its peaks, fp32 on one device of the run's
    ``model``-way split. At the head's peak the gathered output layer over the vocabulary (the tied word embedding
    or its own, vocab-parallel: padded vocabulary / ``model`` x hidden; needed for the input's gradient); without
    stages its gradient, written after the logits' gradient is consumed, is not live there, as the tied embedding's
    is not (``late_grad_bytes``; gpt_125m on 8x1, remat=full: the formula's temp 0.83 of the compiled with it
    counted, 0.97 without), under pipeline stages it is (the stages' peak comes after it is written: gpt_tiny on
    2x2x2, circular, 1.14 without it); in a recomputed layer's backward, its parameters and gradients alike (one
    layer of the abstract model's stacked layers, as the rules split it). A model whose head reads no vocabulary
    (``HeadMemory.vocab_output``: the task models) has no head part."""
    m = run.model
    embedding = m.padded_vocab_size // run.tensor * m.hidden_size
    layer = params_per_device(run, only=STACK)[1] // (m.num_layers // run.pipe)  # a stage holds L / pipe layers
    copies = 2 if run.pipe > 1 else 1  # the gathered layer, and under stages its gradient
    head = copies * FP32 * embedding if run.model_spec.head_memory.vocab_output else 0
    return head, 2 * FP32 * layer


@dataclasses.dataclass(frozen=True)
class Parameter:
    """One parameter of the abstract model as a mesh holds it."""

    module: str  # its top-level module (``transformer.STACK``: the stacked layers)
    names: tuple[str | None, ...]  # its logical axis names (the stacked layers' lead with ``layers``)
    shape: tuple[int, ...]
    per_device: int  # elements one device holds


def parameters(run: RunSpec, split_over_data: bool = False) -> list[Parameter]:
    """Every parameter of ``run``'s abstract model (``nnx.eval_shape``: no memory) as its rules lay it out on its
    mesh (a stage's layers with pipeline stages), or with ``split_over_data`` as ``parallel.fsdp`` stores it
    (``sharding.fsdp_spec``)."""
    mesh_shape = {"data": run.data, "model": run.tensor, **({"pipe": run.pipe} if run.pipe > 1 else {}),
                  **({"expert": run.expert} if run.expert > 1 else {})}
    out = []
    for module, names, shape in _inventory(run):
        spec = (fsdp_spec(names, shape, run.rules, mesh_shape) if split_over_data
                else logical_to_spec(names, run.rules))
        local = math.prod(shape) // math.prod(mesh_shape[a] for a in spec_axes(spec))
        out.append(Parameter(module, names, shape, local))
    return out


_INVENTORIES: dict[tuple, tuple[tuple[str, tuple, tuple], ...]] = {}


def _inventory(run: RunSpec) -> tuple[tuple[str, tuple, tuple], ...]:
    """(top-level module, logical names, shape) of each parameter of ``run``'s abstract model, traced once per model
    and rules (the mesh planners ask for it on thousands of candidate runs of one model)."""
    key = (run.model_spec.module, run.model, run.rules)
    if key not in _INVENTORIES:
        state = nnx.state(abstract_model_of(run))
        _INVENTORIES[key] = tuple(
            (jax.tree_util.keystr(path[:1], simple=True), tuple(var.get_metadata()["out_sharding"]), tuple(var.shape))
            for path, var in jax.tree_util.tree_leaves_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable)))
    return _INVENTORIES[key]


def params_per_device(run: RunSpec, split_over_data: bool = False, only: str | None = None) -> tuple[int, int]:
    """(total parameters, parameters held by one device of ``run``'s mesh) as its rules lay them out, or with
    ``split_over_data`` as ``parallel.fsdp`` stores them (``parameters``); ``only``: those of one top-level module
    (``blocks``)."""
    held = [p for p in parameters(run, split_over_data) if only is None or p.module == only]
    return sum(math.prod(p.shape) for p in held), sum(p.per_device for p in held)


def _num_micro(run: RunSpec, micro_batch: int) -> int:
    """Accumulation steps the run's global batch implies at this micro-batch (1 if it does not divide)."""
    steps, rest = divmod(run.global_batch, micro_batch * run.data * run.expert)
    return max(steps, 1) if not rest else 1


_TAILS: dict[tuple, frozenset[str]] = {}


def tail_parameters(run: RunSpec) -> int:
    """Parameters one device holds of what the loss's tail reads after the layer stack (the 1F1B schedule sums
    their gradients in its tick loop): the top-level modules ``pipelined.reads`` finds in the tail's traced jaxpr
    (a tied word embedding, not an untied input one), traced once per model."""
    key = (run.model_spec.module, run.model_spec.objective, run.model)
    if key not in _TAILS:
        graphdef, state = nnx.split(abstract_model_of(run))
        params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), nnx.to_pure_dict(state))
        batch = {k: jax.ShapeDtypeStruct((2, *f.row_shape), f.dtype) for k, f in run.batch_fields.items()}
        # traced on two stages of one device each: what the tail reads does not depend on the mesh
        stages = jax.sharding.AbstractMesh((2, 1, 1), (PIPE_AXIS, *MESH_AXES))
        with activate(stages, run.parallel_context):
            _TAILS[key] = pipelined.reads(run.model_spec.objective, graphdef, params, batch).tail
    return sum(p.per_device for p in parameters(run) if p.module in _TAILS[key] and p.module != STACK)


def tick_loop_gradient_bytes(run: RunSpec, stack: int) -> int:
    """The fp32 gradient sums a pipelined step's tick loop holds beside the step's gradients, for a stage of
    ``stack`` parameters per device: ``stage_gradient_sums`` copies of them; under 1F1B two copies of the stage's
    sums (what the backward branch reads and what it writes; interleaved too, where each chunk's sums are added to
    elementwise: a dynamic update of one chunk's held one more, 1.11 -> 1.22 of this at s = 32 under `full`, half a
    stage's gradients in the layout measured), and two of what the loss's tail reads (``tail_parameters``: an
    accumulator and each tick's contribution)."""
    if run.pipe > 1 and run.pipeline_schedule == pipeline.ONE_F_ONE_B:
        return FP32 * (2 * stack + 2 * tail_parameters(run))
    return FP32 * stage_gradient_sums(run) * stack


def stage_gradient_sums(run: RunSpec) -> int:
    """Copies of a stage's layer gradients the tick loop holds (0 without stages): an accumulator and each tick's
    contribution (its layer scan's stacked gradients); under the circular schedule a chunk of one layer adds its
    gradient into the accumulator. Measured on the compiled steps of tests/test_pipeline.py and at h = 256, 8 layers
    on 2 stages (compiled temp 45.0, 45.6, 32.4 MB for GPipe, V = 2, V = 4; a copy 12.6 MB)."""
    if run.pipe == 1:
        return 0
    per_chunk = run.model.num_layers // (run.pipe * run.pipeline_repeats)
    return 2 if run.pipeline_repeats == 1 or per_chunk > 1 else 1


def memory_report(run: RunSpec, micro_batch: int | None = None, num_micro: int | None = None,
                  gpu: bool = False) -> MemoryReport:
    """Per-device memory of training ``run`` on its mesh, ``micro_batch`` sequences per data shard per
    accumulation step (default: the run's), ``num_micro`` steps (default: what the run's global batch implies at
    that micro-batch); ``gpu``: as the step compiles for an NVIDIA GPU (cuDNN's attention where the model allows it,
    XLA:GPU's fusions, the GEMM workspace), else as on the CPU."""
    data, model, pipe = run.data, run.tensor, run.pipe
    micro_batch = micro_batch or run.micro_batch
    zero = run.shard_optimizer and not run.fsdp  # ZeRO-1: the moments and gradients only
    total, local = params_per_device(run, split_over_data=run.fsdp)  # FSDP: parameters split over data too
    stage = tick_loop_gradient_bytes(run, params_per_device(run, only=STACK)[1])
    num_micro = num_micro or _num_micro(run, micro_batch)
    optimizer = 8 * local // (data if zero else 1)
    act = activations(run, micro_batch, gpu)
    fields = run.batch_fields.values()
    # the batch's rows split over the stages too (the ends run on each stage's share)
    batch = micro_batch * num_micro * sum(math.prod(f.row_shape) * f.dtype.itemsize for f in fields) // pipe
    head, layer = gathered_bytes(run) if run.fsdp else (0, 0)
    return MemoryReport(total, local, FP32 * local, FP32 * local, optimizer, act.total, data, model, act,
                        gradient_bytes(local, data, zero, num_micro), batch, run.sequence, run.fsdp,
                        word_embedding_grad_bytes(run), head, layer, stage, pipe, GPU_GEMM_WORKSPACE if gpu else 0,
                        run.model_spec.active_parameters(run.model, total), run.expert, run.context, _rough(run),
                        tick_loop_after_head=pipe > 1 and run.pipeline_schedule == pipeline.GPIPE)


def _rough(run: RunSpec) -> str:
    """What ``MemoryReport.rough`` says of ``run``: interleaved 1F1B with chunks of one layer (no layer scan; its
    plan does not follow the remat policy's terms: docs/parallelism.md)."""
    v = run.pipeline_repeats
    if run.pipe > 1 and run.pipeline_schedule == pipeline.ONE_F_ONE_B and v > 1 and \
            run.model.num_layers == run.pipe * v:
        return ("interleaved 1F1B with one-layer chunks: the compiled temp measured 0.70 to 1.42 times this estimate "
                "(CPU, 4-layer models on pipe 2, V = 2; 0.91 to 1.25 for 8 layers on pipe 4); read the compiled "
                "step's (--compiled), or use chunks of two layers or more (pipeline_repeats <= num_layers / (2 pipe))")
    return ""


def largest_micro_batch(run: RunSpec, device_bytes: float, gpu: bool = False) -> int:
    """The largest micro-batch whose step peak on ``run``'s mesh (by formula, no accumulation; ``gpu``: as compiled
    for an NVIDIA GPU) fits ``device_bytes``; 0 if none. Under pipeline stages a multiple of them (each stage's share
    of the batch holds whole microbatches)."""
    unit = run.pipe
    one = memory_report(run, unit, num_micro=1, gpu=gpu)  # only the activations and the batch grow

    def fits(units: int) -> bool:
        act = activations(run, units * unit, gpu)
        return dataclasses.replace(one, activation_bytes=act.total, activations=act,
                                   batch_bytes=one.batch_bytes * units).fits(device_bytes)

    if not fits(1):
        return 0
    low, high = 1, 2  # fits(low); double high until it does not fit, then bisect
    while high * unit <= MAX_MICRO_BATCH and fits(high):
        low, high = high, 2 * high
    if high * unit > MAX_MICRO_BATCH:
        return low * unit
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low * unit
