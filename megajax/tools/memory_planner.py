"""What one training step holds on a device besides its arguments, by formula and as XLA plans it.

Nothing here knows a model family's block: the terms (``memory_terms``) take parameters from the abstract model
(``parameters``, ``params_per_device``: ``nnx.eval_shape`` of the spec's module, laid out by the sharding rules;
the scaling model reads them too), a layer's activations and the head's from the model's spec
(``LayerKind.residuals`` of each of ``ModelSpec.stacks``, ``ModelSpec.head_memory``); a pipelined step's schedules
add theirs
(``memory_stages``). Every function reads a resolved run (``config.RunSpec``: the model, its mesh and its
choices); a plan for another mesh or batch is another run (``config.replanned``, ``with_batch``).

The formula (``MemoryReport.temp_bytes``) counts the step's temporaries term by term:

* gradients: fp32, 4 bytes per parameter held: the accumulator the micro-batch scan carries (zeros first), and with
  accumulation a second buffer, the micro-batch's own gradients. With ``parallel.shard_optimizer`` XLA splits them
  over ``data`` too (the sharded AdamW update is their only consumer, so the backward pass writes the shards):
  ZeRO-1 saves gradient memory as ZeRO-2 would, except where the step accumulates with each data replica's
  gradients kept apart (``training.replicas``: both buffers whole, reduce-scattered once after the loop). With
  ``parallel.fsdp`` the parameters are held split as well, so all
  three are counted per shard (``params_per_device(..., split_over_data=True)``), and what is gathered at use is
  added where it is live (``gathered_bytes``): at the head's backward, the whole word embedding (as the model axis
  splits it) and its gradient before the reduce-scatter; in a recomputed layer, that layer's parameters and gradients.
* activations (``activations``): what JAX's autodiff keeps for the backward pass. ``stack_residual_bytes`` asks
  each of the model's stacks' layer kind for one layer's residuals (``LayerKind.residuals``; the same bytes as the
  traced jaxpr, ``traced_layer_residual_bytes``, which the tests compare); each scanned stack keeps its count of
  them. On top of
  those, the larger of the output head at the start of the backward pass (``head_bytes``, the spec's
  ``head_memory``: the fp32 logits, their exponentials and their gradient; the tied word embedding's gradient is
  not written yet then, ``word_embedding_grad_bytes``; each run of the output layer's logits where it runs more
  than once, ``HeadMemory.outputs``) and, with full / save_dots recomputation, one layer's recomputed residuals (the
  largest kind's, ``largest_layer_residual_bytes``).

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

from megajax.config import RunSpec, replanned
from megajax.models.spec import pipelined_stacks
from megajax.parallel import pipeline
from megajax.parallel.mesh import MeshShape
from megajax.tools.memory_stages import stage_activations, tick_loop_gradient_bytes
from megajax.tools.memory_terms import (
    FP32,
    Activations,
    attention_backward_bytes,
    dropout_bits_bytes,
    head_bytes,
    largest_layer_residual_bytes,
    params_per_device,
    stack_residual_bytes,
)
from megajax.training.loop import batch_layout, setup_run
from megajax.training.replicas import kept_apart

GiB = 1024**3
MAX_MICRO_BATCH = 1 << 16  # the search for the largest micro-batch stops here
# XLA:GPU's cuBLAS workspace, one GEMM's live at a time: 4 MiB per GEMM custom call as compiled for an H100 without
# the device (no autotuning; the real device may pick larger ones)
GPU_GEMM_WORKSPACE = 4 * 2**20


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
    gpipe = run.mesh.pipe > 1 and run.pipeline.schedule == pipeline.GPIPE
    if not run.model_spec.head_memory.vocab_output or run.mesh.context > 1 or \
            (run.model.remat in ("full", "save_dots") and not gpipe):
        return 0
    rows = run.model.padded_vocab_size // run.mesh.model
    return FP32 * rows * run.model.hidden_size // (run.mesh.data if run.shard_optimizer else 1)


def activations(run: RunSpec, micro_batch: int, gpu: bool = False) -> Activations:
    """The activation estimate for the model's remat policy on one device of ``run``'s mesh (``gpu``: as compiled
    for an NVIDIA GPU): the layers' residuals, the head and one layer's backward working set; with pipeline stages,
    the schedule's (``memory_stages.stage_activations``)."""
    m = run.model
    if run.mesh.pipe > 1:
        return stage_activations(run, micro_batch, gpu)
    recompute = attention_backward_bytes(run, micro_batch, gpu) + dropout_bits_bytes(run, micro_batch, gpu)
    if m.remat in ("full", "save_dots"):
        recompute += largest_layer_residual_bytes(run, micro_batch, "none", gpu=gpu)
    layers = stack_residual_bytes(run, micro_batch, gpu=gpu)
    return Activations(layers, head_bytes(run, micro_batch, gpu), recompute)


def gradient_bytes(params_per_device: int, data: int, shard_optimizer: bool, num_micro: int = 1,
                   apart: bool = False) -> int:
    """fp32 gradients as the step holds them, split over ``data`` with ZeRO-1: one buffer, and with accumulation
    (``num_micro`` > 1) a second, the micro-batch's own gradients beside the accumulator the scan carries.
    ``apart``: each data replica's kept apart through the accumulation (``training.replicas.kept_apart``): both
    whole on every device, ZeRO-1 or not (its split is the one reduce-scatter's, after the loop)."""
    split = data if shard_optimizer and not apart else 1
    return (2 if num_micro > 1 else 1) * FP32 * params_per_device // split


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
    global batch micro_batch x data x num_micro), checked again (``config.replanned``)."""
    return replanned(run, global_batch=micro_batch * run.mesh.batch_shards * num_micro,
                     train=dataclasses.replace(run.train, micro_batch_size=micro_batch if num_micro > 1 else 0))


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
    rows = run.spec.micro_batch * run.spec.num_micro // run.spec.mesh.pipe  # this device's sequences per step (a data
    # shard's, split over the stages too)
    batch = rows * sum(math.prod(f.row_shape) * f.dtype.itemsize for f in fields.values())
    return CompiledMemory(analysis.argument_size_in_bytes, analysis.output_size_in_bytes,
                          analysis.alias_size_in_bytes, analysis.temp_size_in_bytes, batch)


@dataclasses.dataclass(frozen=True)
class MemoryReport:
    """Per-device memory in bytes for one mesh and micro-batch."""

    num_params: int
    params_per_device: int
    param_bytes: int  # fp32 master
    grad_bytes: int  # fp32, one per parameter held (the paper's accounting)
    optimizer_bytes: int  # AdamW m and v, fp32 (split over data with parallel.shard_optimizer or fsdp)
    activation_bytes: int  # one micro-batch: activations.total
    mesh: MeshShape  # with pipeline stages the parameters and activations here are one stage's
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
    workspace_bytes: int = 0  # the GPU's GEMM workspace (GPU_GEMM_WORKSPACE); 0 on the CPU
    active_params: int = 0  # the parameters one token uses (``ModelSpec.active_parameters``: a mixture of experts')
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
    embedding = m.padded_vocab_size // run.mesh.model * m.hidden_size
    stacks = tuple(stack.attr for stack in run.stacks)  # the mean layer's; a stage holds L / pipe layers
    layer = params_per_device(run, only=stacks)[1] // (sum(stack.count for stack in run.stacks) // run.mesh.pipe)
    copies = 2 if run.mesh.pipe > 1 else 1  # the gathered layer, and under stages its gradient
    head = copies * FP32 * embedding if run.model_spec.head_memory.vocab_output else 0
    return head, 2 * FP32 * layer


def _num_micro(run: RunSpec, micro_batch: int) -> int:
    """Accumulation steps the run's global batch implies at this micro-batch (1 if it does not divide)."""
    steps, rest = divmod(run.global_batch, micro_batch * run.mesh.batch_shards)
    return max(steps, 1) if not rest else 1


def memory_report(run: RunSpec, micro_batch: int | None = None, num_micro: int | None = None,
                  gpu: bool = False) -> MemoryReport:
    """Per-device memory of training ``run`` on its mesh, ``micro_batch`` sequences per data shard per
    accumulation step (default: the run's), ``num_micro`` steps (default: what the run's global batch implies at
    that micro-batch); ``gpu``: as the step compiles for an NVIDIA GPU (cuDNN's attention where the model allows it,
    XLA:GPU's fusions, the GEMM workspace), else as on the CPU."""
    data, pipe = run.mesh.data, run.mesh.pipe
    micro_batch = micro_batch or run.micro_batch
    zero = run.shard_optimizer and not run.fsdp  # ZeRO-1: the moments and gradients only
    total, local = params_per_device(run, split_over_data=run.fsdp)  # FSDP: parameters split over data too
    stage = tick_loop_gradient_bytes(run, params_per_device(run, only=pipelined_stacks(run.stacks))[1])
    num_micro = num_micro or _num_micro(run, micro_batch)
    optimizer = 8 * local // (data if zero else 1)
    act = activations(run, micro_batch, gpu)
    fields = run.batch_fields.values()
    # the batch's rows split over the stages too (the ends run on each stage's share)
    batch = micro_batch * num_micro * sum(math.prod(f.row_shape) * f.dtype.itemsize for f in fields) // pipe
    head, layer = gathered_bytes(run) if run.fsdp else (0, 0)
    return MemoryReport(total, local, FP32 * local, FP32 * local, optimizer, act.total, run.mesh, act,
                        gradient_bytes(local, data, zero, num_micro, kept_apart(num_micro, data, run.fsdp, pipe)),
                        batch, run.sequence, run.fsdp,
                        word_embedding_grad_bytes(run), head, layer, stage, GPU_GEMM_WORKSPACE if gpu else 0,
                        run.model_spec.active_parameters(run.model, total), _rough(run),
                        tick_loop_after_head=pipe > 1 and run.pipeline.schedule == pipeline.GPIPE)


def _rough(run: RunSpec) -> str:
    """What ``MemoryReport.rough`` says of ``run``: interleaved 1F1B with chunks of one layer (no layer scan; its
    plan does not follow the remat policy's terms: docs/parallelism.md)."""
    v = run.pipeline.repeats
    if run.mesh.pipe > 1 and run.pipeline.schedule == pipeline.ONE_F_ONE_B and v > 1 and \
            run.model.num_layers == run.mesh.pipe * v:
        return ("interleaved 1F1B with one-layer chunks: the compiled temp measured 0.70 to 1.42 times this estimate "
                "(CPU, 4-layer models on pipe 2, V = 2; 0.91 to 1.25 for 8 layers on pipe 4); read the compiled "
                "step's (--compiled), or use chunks of two layers or more (pipeline_repeats <= num_layers / (2 pipe))")
    return ""


def largest_micro_batch(run: RunSpec, device_bytes: float, gpu: bool = False) -> int:
    """The largest micro-batch whose step peak on ``run``'s mesh (by formula, no accumulation; ``gpu``: as compiled
    for an NVIDIA GPU) fits ``device_bytes``; 0 if none. Under pipeline stages a multiple of them (each stage's share
    of the batch holds whole microbatches)."""
    unit = run.mesh.pipe
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
