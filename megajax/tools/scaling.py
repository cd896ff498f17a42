"""Predicts a language model's training step time on a described cluster from its FLOPs, memory traffic and
communication.

``python -m megajax.scaling`` (``scaling_plan.py``) runs it over every (pipe, data, model) mesh of a cluster and
recommends one; ``scaling_papers.py`` checks it against Megatron-LM's published measurements. The model is a
resolved megajax run (``config.RunSpec``; the papers' models are runs too), and what it costs comes from where
megajax already describes it:

* parameters per GPU and per layer, and the layer's GEMM shapes: the abstract model (``nnx.eval_shape`` of the
  spec's module, the memory planner's ``parameters``) through the sharding rules (``layout``, built once per model
  and model-parallel degree, so the mesh search builds each once);
* model FLOPs: the spec's ``flops`` (the metrics' MFU numerator);
* activations: the memory planner (``activations``: the spec's per-layer residuals and head);
* tensor- and data-parallel communication: ``comm_minimum.minimum`` of the spec's all-reduces per layer (each
  stack's ``LayerKind.tensor_all_reduces``, ``recomputed_all_reduces``, summed by ``spec.all_reduces``), the bytes
  the compiled step is audited against;
* which model-parallel degrees fit the model: ``config.validate``'s checks of ``mesh.model``; whether key/value
  heads are replicated: ``TransformerConfig.kv_replicated``.

The formulas take the run (its model's frozen config and spec and its memory choices) and the mesh, batch and
pipeline they are evaluated for as arguments; the run's own mesh, batch and pipeline are read only where a mesh's
memory is planned, by the memory planner on the run placed on that mesh (``_on_mesh``: ``config.replanned``). The
choices a prediction is for are the run's (``choices``; ``with_choices`` resolves it with others, ``choice_flags``
prints them as flags).

Per GPU, with t-way model, d-way data parallelism and p pipeline stages:

* Compute per layer and micro-batch: each GEMM (one per weight kernel of the abstract model's layer on its 1/t
  shard: GPT's QKV, attention out, MLP up and down; Llama's query, key/value, gate, up, out and down, each
  kernel its own GEMM where Llama fuses two at use: the same FLOPs, the input read once more; QK^T and AV per
  local head) at the roofline ``max(flops / (gemm_efficiency x peak), operand bytes / HBM bandwidth)``, 3 times
  (forward, two backward GEMMs) + once more where ``remat`` recomputes it; the memory-bound element-wise work as
  counted passes at HBM bandwidth (the layer kind's, below); a fixed ``layer_overhead_s``. Plus the output layer and its
  cross-entropy, and AdamW once per step. The GEMM shapes' FLOPs add up to the spec's model FLOPs (tests pin it
  for GPT-2's ``transformer_flops`` and Llama's); a thin shard (h/t small) or the s x s GEMMs of narrow heads
  fall below the ridge and run at HBM speed: that is the model's GEMM efficiency as a function of size.
* Tensor-parallel: ``comm_minimum.minimum``'s all-reduces (aL + 1 of b x s x h each way, a the spec's
  ``tensor_all_reduces``, GPT's 2; rL more with ``remat=full``, r its ``recomputed_all_reduces``, GPT's 1; 3
  per-token ones for the loss), each a ring in the node, ``2 (t-1)/t bytes / bandwidth + 2 (t-1) latency``, not
  overlapped (Megatron's f and g block the layer) but for the cluster's ``tp_overlap`` of it (the H100's, fitted).
* Data-parallel: ``comm_minimum.minimum``'s gradient elements at ``grad_bytes``, all-reduced hierarchically (ring
  among the group's GPUs in a node, then across nodes on each GPU's share of the node's InfiniBand, 1/members of
  it per GPU); ``dp_overlap`` of it hides behind the backward pass.
* Step = micro-batches x (compute + tensor-parallel) + optimizer + exposed data-parallel. TFLOP/s per GPU are
  model FLOPs (``flops``, recomputation not counted) / step / GPUs; the weak-scaling efficiency is that over a
  1-GPU baseline's.

Pipeline stages (``Pipeline``, ``scaling_pipeline.py``; p = 1 is the step above, term for term). Each layer-stack
batch (a micro-batch's rows) is cut into M microbatches; the schedule runs ``Pipeline.ticks`` stage-ticks, M v + p - 1
(M >= p; v = 1: GPipe / 1F1B, v > 1: circular / interleaved), each L/(p v) layers of one microbatch: compute and
tensor-parallel all-reduces of those layers, and two point-to-point transfers (its activations forward, their
gradient backward; ``p2p_s``: of b s h half-precision bytes, 1/t over the link plus an NVLink all-gather, Megatron-LM's
scatter/gather, as megajax's schedules send them; with sequence parallelism 1/t, nothing gathered), on the
InfiniBand link where a stage boundary crosses nodes (``crosses_nodes``: pipe is the mesh's outermost axis), not
overlapped. Idle ticks cost as much as busy ones: the bubble, (p - 1)/(M v + p - 1) of them. megajax's circular
schedule recomputes each chunk from its input whatever the remat policy (timed as ``full``, with ``selective``'s
attention core once more), and inside a stage ``save_dots`` recomputes what ``full`` does. The ends: megajax runs
the embeddings and head on every stage over its share of the layer-stack batch (1/p of it; their parameters
replicated over pipe, their gradients all-reduced over data x pipe) and moves the microbatches to stage 0 and the
outputs back to their stage along the io column, one more transfer each way per tick (the communication budget's
pipeline inputs/outputs), timed as the ring's hop and not overlapped; Megatron-LM runs the head on the last stage
after each microbatch (M heads on the slowest stage) and all-reduces the tied embedding's gradient between the first
and last stage (where the abstract model has one (vocabulary, hidden) weight). Data-parallel all-reduce, ZeRO-1's
gather and AdamW cover one stage's parameters (``parameters_per_gpu``: L/p layers and the ends). Memory per GPU
(``stage_memory_bytes``): the stage's state; megajax's activations as the memory planner counts them (every tick's
residuals or chunk input, bubble ticks included, the head on the stage's share, a tick's backward working set) and the
tick loop's fp32 sums of the stage's layer gradients; Megatron-LM's, the residuals of the chunk-microbatches in
flight (``Pipeline.in_flight``: 1F1B at most p, interleaved its warm-up), and the head on one microbatch.
megajax's 1F1B (``Pipeline.one_f_one_b``; interleaved with v chunks per stage): the remat policy's work, the head
on the last stage after each microbatch, the permutes over M v + (v + 1) p - 2 lockstep ticks, its memory the
planner's (min(2 v p - 1, M v) chunk-microbatches' residuals, the tail's gradient sums); with ``stage_recompute``
each chunk-microbatch one forward more (the chunk's forward again in its backward, under the policy) and held chunk
inputs instead of residuals.

Tests pin ``transformer_flops`` and ``comm_minimum.minimum`` equal to the compiled HLO's (ratio 1.00): the counted
work is megajax's; what this module adds is how long it takes.

Counted, not fitted: each layer kind's element-wise passes (``LayerKind.elementwise``, ``models/spec.py``) over
its b*s*h work duplicated on every model-parallel GPU, its b*s*h/t split work and its b*(a/t)*s*s attention scores,
as counted for the cluster's software (``Cluster.software``: Megatron-LM 2019's eager PyTorch step, GPT's block 20,
16 and 10 forward; Megatron-LM 2021's fused kernels, 12, 10 and 5; backward twice; a kind not counted on its own
states GPT's block's), and a routed kind's dispatch (``LayerKind.dispatch_passes``); 40 bytes per local logit (fp32
cross-entropy); 32 bytes per local parameter (AdamW).

Fitted, per cluster (``scaling_clusters.py``; ``scaling_papers.py`` has the published figures, which were fitted
and which held out, what was assumed where a paper is silent, and the errors): ``DGX2H_V100``'s ``gemm_efficiency``
0.88, ``layer_overhead_s`` 6 ms (the launches and tails of ~300 eager kernels) and ``dp_overlap`` 0.3 to three of
Megatron-LM 2019's figures (every figure within 8 points, speedups within 3%); ``DGX_A100``'s ``gemm_efficiency``
0.685 and ``layer_overhead_s`` 3.95 ms to the odd rows of PTD-P 2021's Table 1 (every row within 1.5 points of peak;
the held-out even rows within 1.1); its ``dp_overlap`` 0 is Megatron-LM 2021's (an all-reduce after the backward
pass). ``DGX_H100``'s ``gemm_efficiency`` 0.816, ``layer_overhead_s`` 2.36 ms, ``dp_overlap`` 0.90 and
``tp_overlap`` 0.76 (the share of the tensor-parallel all-reduces hidden: Megatron-LM's ``--tp-comm-overlap``) to
eleven published BF16 H100 runs of Megatron-LM, MaxText and torchtitan (``scaling_h100.py``: every row within 2.2
points of peak, rms 1.4; fused element-wise passes).

Beyond the papers: sequence parallelism splits the replicated element-wise work and the LayerNorm / dropout /
residual activations by t (its reduce-scatter / all-gather pairs send the all-reduces' bytes); ZeRO-1 splits the
moments over ``data`` (8 + 8/d bytes per local parameter) and adds an all-gather of the updated fp32 parameters
(half a ring all-reduce, not overlapped); FSDP splits all 16 bytes (16/d), reduce-scatters the gradients (half the
all-reduce, overlapped as it) and all-gathers each layer's fp32 parameters twice, forward and backward (not
overlapped, so the planner turns it on only where less does not fit), all of it in every accumulation step;
megajax's own pipeline (GPipe / circular; the Megatron-LM schedule is what PTD-P checks); a mixture of experts'
expert shards (``scaling_experts.py``: the experts' GEMMs over balanced rows, the dispatch's passes, the
all-to-alls, the gradients split between data x expert and data; the batch is split over data x expert); context
shards (``scaling_context.py``: a GPU does the work of micro-batch / C sequences, plus the keys' and values'
all-gathers and reduce-scatters, the gradients over data x context); flash attention on clusters whose step runs
cuDNN's (``Cluster.flash_attention``, the H100: no passes over the s x s scores, the memory planner's GPU
activations). None is calibrated: the papers have none.

Ignored (but as ``tp_overlap``, fitted for the H100 only): tensor-parallel communication overlapped with compute,
point-to-point overlapped with compute, NCCL's
protocols and topology beyond a ring, kernel efficiency beyond the calibration (the 2019 constants describe eager
PyTorch; a fused XLA step moves fewer bytes and launches fewer kernels), stragglers, data loading and memory
fragmentation.
"""
from __future__ import annotations

import dataclasses
import functools

from megajax.config import RunSpec, replanned
from megajax.models.transformer import attention_reason
from megajax.parallel.mesh import MeshShape
from megajax.parallel.sharding import PipelineSettings
from megajax.tools.comm_minimum import minimum
from megajax.tools.memory_planner import activations, gradient_bytes
from megajax.tools.memory_stages import tick_loop_gradient_bytes
from megajax.tools.scaling_clusters import (  # noqa: F401 (the clusters are this module's API too)
    CLUSTERS,
    DGX2H_V100,
    DGX_A100,
    DGX_H100,
    HALF,
    MEMORY_FRACTION_VARIABLE,
    Cluster,
    GiB,
    fp8_scaling_s,
    gemm_s,
    group_allreduce_s,
    jax_memory,
    ring_allreduce_s,
)
from megajax.tools.scaling_context import context_comm_s
from megajax.tools.scaling_experts import expert_comm_s, routed_layer_s
from megajax.tools.scaling_layout import comm_shape, layout, parameters_per_gpu, with_choices
from megajax.tools.scaling_pipeline import Pipeline, crosses_nodes, megatron_activation_bytes, p2p_s
from megajax.training.replicas import kept_apart

STATE_BYTES_PER_PARAM = 16  # fp32 parameters, gradients and AdamW's two moments (megajax.info)
LOGIT_BYTES = 40  # per local logit, fp32 cross-entropy forward + backward
OPTIMIZER_BYTES_PER_PARAM = 32  # AdamW's step: fp32 master, m, v read and written, half grads and params


def flops(run: RunSpec, batch: int) -> float:
    """Model FLOPs of ``batch`` sequences forward + backward: the model's spec's (``ModelSpec.flops``, the
    metrics' MFU numerator; recomputation not counted)."""
    return run.model_spec.flops(run.model, batch, run.model.max_seq_len)


@dataclasses.dataclass(frozen=True)
class Prediction:
    """One mesh's predicted step (seconds per step; memory per GPU)."""

    run: RunSpec  # the model with the remat / sequence / state-split choices it is for
    mesh: MeshShape  # its pipe degree is ``pipeline.stages``
    global_batch: int
    micro_batch: int
    num_micro: int
    compute_s: float
    tensor_comm_s: float
    data_comm_s: float  # exposed part
    step_s: float
    tflops_per_gpu: float  # model FLOPs (``flops``) / step / GPUs
    mfu: float
    efficiency: float  # tflops_per_gpu / the 1-GPU baseline's
    memory_bytes: int
    fits: bool
    pipeline: Pipeline = Pipeline()  # the stages, schedule and microbatches (1 stage: none)
    pipe_comm_s: float = 0.0  # point-to-point between stages, and the ends' transfers over pipe
    expert_comm_s: float = 0.0  # the routed layers' all-to-alls and routing statistics
    context_comm_s: float = 0.0  # the keys' and values' all-gathers and their gradients' reduce-scatters

    @property
    def gpus(self) -> int:
        return self.mesh.devices

    @property
    def bubble(self) -> float:
        """The idle share of the pipeline's stage-ticks (0 without stages)."""
        return self.pipeline.bubble()

    @property
    def gpu_hours_per_trillion_tokens(self) -> float:
        """GPU-hours to train on 10^12 tokens at this step (how technical reports state a run's cost)."""
        return self.step_s * self.gpus / 3600 * 1e12 / (self.global_batch * self.run.model.max_seq_len)


def gemms(run: RunSpec, tensor: int, micro_batch: int, stack: int = 0) -> tuple[list[tuple], list[tuple], tuple]:
    """One GPU's forward GEMMs per micro-batch as (batch, m, k, n): a layer's dense ones (one per kernel of the
    abstract model's layer on its ``stack``-th stack, ``layout``), its attention core's (QK^T and AV per local
    head), and the output layer's over the padded vocabulary."""
    cfg = run.model
    s, tokens, local_heads = cfg.max_seq_len, micro_batch * cfg.max_seq_len, micro_batch * cfg.num_heads / tensor
    dense = [(1, tokens, k, n) for k, n in layout(run, tensor).stacks[stack].gemms]
    attention = [(local_heads, s, cfg.head_dim, s), (local_heads, s, s, cfg.head_dim)]
    return dense, attention, (1, tokens, cfg.hidden_size, cfg.padded_vocab_size / tensor)


RECOMPUTED = {"none": (0, 0, 0), "full": (1, 1, 1), "save_dots": (0, 1, 1), "selective": (0, 0, 1)}
"""remat -> how often the backward pass reruns (dense GEMMs, element-wise work, attention core: its batched
GEMMs and scores). save_dots keeps the dense GEMMs' outputs but not the batched attention ones."""


def compute_s(run: RunSpec, tensor: int, micro_batch: int, cluster: Cluster, expert: int = 1) -> float:
    """One GPU's compute time for one micro-batch, forward + backward (+ recomputation), without communication:
    each stack's layers (``layer_s``) and the output layer (``head_s``)."""
    layers = sum(st.count * layer_s(run, tensor, micro_batch, cluster, expert, i)
                 for i, st in enumerate(layout(run, tensor).stacks))
    return layers + head_s(run, tensor, micro_batch, cluster)


def layer_s(run: RunSpec, tensor: int, micro_batch: int, cluster: Cluster, expert: int = 1, stack: int = 0) -> float:
    """One layer's compute time (of the ``stack``-th stack) for one micro-batch on one GPU: its GEMMs at the roofline,
    its element-wise passes at HBM bandwidth, the fixed overhead; a routed layer's work on ``expert`` shards
    (``scaling_experts.routed_layer_s``)."""
    m = run.model
    dense, attention, _ = gemms(run, tensor, micro_batch, stack)
    dots, elementwise, core = RECOMPUTED[m.remat]
    layer = (3 + dots) * sum(gemm_s(*g, cluster, fp8=m.fp8) for g in dense)
    if m.fp8:  # current scaling's amax and cast passes over each block GEMM's operands
        layer += sum(fp8_scaling_s(*g[1:], cluster, forwards=1 + dots) for g in dense)
    layer += (3 + core) * sum(gemm_s(*g, cluster) for g in attention)
    tokens = micro_batch * m.max_seq_len
    replicated = tokens * m.hidden_size / (tensor if run.sequence else 1)  # SP: each GPU's positions only
    # cuDNN's flash attention (where the cluster's step runs it) keeps the scores on chip: no passes over them
    scores = 0 if flash_attention(run, cluster) else micro_batch * m.num_heads / tensor * m.max_seq_len**2
    sizes = (replicated, tokens * m.hidden_size / tensor, scores)
    repeats = (elementwise, elementwise, core)
    kind = run.stacks[stack].kind
    passes = sum(n * ((1 + r) * fwd + bwd)
                 for n, r, (fwd, bwd) in zip(sizes, repeats, kind.elementwise.under(cluster.software)))
    routed = routed_layer_s(run, tensor, micro_batch, expert, cluster) if kind.routed else 0.0
    return layer + routed + (HALF * passes / cluster.hbm_bandwidth + cluster.layer_overhead_s)


def flash_attention(run: RunSpec, cluster: Cluster) -> bool:
    """Whether megajax's step on ``cluster`` runs the model's attention as cuDNN's flash attention (in half
    precision: ``transformer.attention_reason``), so its s x s scores are neither kept nor passed over in HBM."""
    return cluster.flash_attention and not attention_reason(dataclasses.replace(run.model, dtype="bfloat16"))


def head_s(run: RunSpec, tensor: int, micro_batch: int, cluster: Cluster) -> float:
    """The output layer's GEMM and its cross-entropy for one micro-batch on one GPU."""
    logits = gemms(run, tensor, micro_batch)[2]
    local_logits = micro_batch * run.model.max_seq_len * logits[3]
    return 3 * gemm_s(*logits, cluster) + LOGIT_BYTES * local_logits / cluster.hbm_bandwidth


def tensor_comm_s(run: RunSpec, tensor: int, micro_batch: int, cluster: Cluster, layers: int | None = None) -> float:
    """Tensor-parallel all-reduces of one micro-batch (comm_minimum.minimum's bytes, the model's spec's all-reduces
    per layer), each a ring over ``tensor``; ``layers``: of that many layers (default the model's; 0: the ends')."""
    if tensor == 1:
        return 0.0
    layers = run.model.num_layers if layers is None else layers
    need = minimum(comm_shape(run, (1, tensor), micro_batch, 1, layers))
    activation = micro_batch * run.model.max_seq_len * run.model.hidden_size * HALF  # one all-reduce's message
    count = (need["tensor-parallel forward"] + need["tensor-parallel backward"]) / activation
    per_token = micro_batch * run.model.max_seq_len * 4
    within = tensor <= cluster.gpus_per_node
    link = (cluster.intra_bandwidth, cluster.intra_latency) if within else (cluster.inter_bandwidth,
                                                                             cluster.inter_latency)
    return count * ring_allreduce_s(activation, tensor, *link) + \
        need["loss"] / per_token * ring_allreduce_s(per_token, tensor, *link)


def data_comm_s(run: RunSpec, mesh: tuple[int, int], cluster: Cluster, grad_bytes: int = 4,
                stages: int = 1, expert: int = 1) -> float:
    """The gradient all-reduce over ``data`` (of one of ``stages`` pipeline stages) before overlap, hierarchical
    (``scaling_clusters.group_allreduce_s``): ring among the group's members in a node, then a ring across nodes of
    1/members of the gradient per GPU, then the all-gather back within the node. With ``expert`` shards the dense
    parameters' gradients over data x expert, the experts' over data alone."""
    data, tensor = mesh
    if data * expert == 1:
        return 0.0
    layers = run.model.num_layers // stages
    shape = comm_shape(run, mesh, 1, 1, layers, expert)
    grads = minimum(shape)["data-parallel gradients"] / 4 * grad_bytes
    experts = shape.expert_grad_elements * grad_bytes if data > 1 else 0
    out = group_allreduce_s(grads - experts, data * expert, tensor, cluster)
    return out + (group_allreduce_s(experts, data, expert * tensor, cluster) if experts else 0.0)


def state_bytes(run: RunSpec, tensor: int, data: int = 1, stages: int = 1, expert: int = 1) -> int:
    """Per-GPU training state (of one of ``stages`` pipeline stages, its experts split over ``expert`` shards): 16
    bytes per local parameter (fp32 parameters, gradients, AdamW's two moments); with ``parallel.shard_optimizer``
    the moments split over ``data`` (8 + 8/d), with ``parallel.fsdp`` all of it (16/d)."""
    local = parameters_per_gpu(run, tensor, stages, expert)[1]
    if run.fsdp:
        return STATE_BYTES_PER_PARAM * (local // data)
    return STATE_BYTES_PER_PARAM * local if not run.shard_optimizer else 8 * local + 8 * local // data


@functools.lru_cache(maxsize=4096)
def _on_mesh(run: RunSpec, mesh: MeshShape, pipeline: Pipeline) -> RunSpec:
    """``run`` on ``mesh`` with ``pipeline``'s schedule, in half precision (what the memory planner reads of them),
    resolved again (``config.replanned``)."""
    return replanned(run, training=False, mesh=mesh, model=dataclasses.replace(run.model, dtype="bfloat16"),
                     pipeline=PipelineSettings(pipeline.config_schedule,
                                               pipeline.microbatches if pipeline.stages > 1 else 0, pipeline.repeats,
                                               pipeline.stage_recompute))


def memory_bytes(run: RunSpec, mesh: MeshShape, micro_batch: int, pipeline: Pipeline | None = None,
                 gpu: bool = False, num_micro: int = 1, apart: bool = True) -> int:
    """Per-GPU training memory as ``megajax.info``'s total: ``state_bytes`` plus the memory planner's activations
    (``memory_planner.activations`` of the run on the mesh in half precision, ``_on_mesh``: the spec's per-layer
    residuals and head) for one micro-batch, and with ``num_micro`` > 1 accumulation steps the micro-batch's own
    gradients beside the accumulator (``memory_planner.gradient_bytes``). Not counted: FSDP's one gathered layer at
    a time. With pipeline stages, one stage's (``stage_memory_bytes``)."""
    pipeline = _pipeline_of(mesh, pipeline)
    stages = pipeline.stages
    second = 0
    if num_micro > 1:  # the second fp32 gradient buffer: the planner's count, less the one state_bytes holds
        local = parameters_per_gpu(run, mesh.model, stages, mesh.expert)[1]
        shards = mesh.data if run.shard_optimizer else 1
        apart = apart and kept_apart(num_micro, mesh.data, run.fsdp, stages)  # False: the published runs' as fitted
        second = gradient_bytes(local, shards, True, num_micro, apart) - gradient_bytes(local, shards, True)
    if stages > 1:
        return stage_memory_bytes(run, mesh, micro_batch, pipeline, gpu) + second
    placed = _on_mesh(run, mesh, pipeline)
    return state_bytes(run, mesh.model, mesh.data, 1, mesh.expert) + activations(placed, micro_batch, gpu).total + \
        second


def _pipeline_of(mesh: MeshShape, pipeline: Pipeline | None) -> Pipeline:
    """``pipeline``, or none on a mesh without stages; ValueError where its stages are not the mesh's."""
    pipeline = pipeline or Pipeline()
    if pipeline.stages != mesh.pipe:
        raise ValueError(f"the pipeline's {pipeline.stages} stages are not the mesh's pipe={mesh.pipe}")
    return pipeline


def stage_memory_bytes(run: RunSpec, mesh: MeshShape, rows: int, pipeline: Pipeline, gpu: bool = False) -> int:
    """One stage's memory: its state (``state_bytes``) and activations. megajax's are the memory planner's
    (``megajax.info``'s: ``activations`` of the run on the mesh with the stages, microbatches and repeats), plus the
    tick loop's fp32 gradient sums (the planner's ``tick_loop_gradient_bytes``); Megatron-LM's are
    ``megatron_activation_bytes``."""
    tensor = mesh.model
    state = state_bytes(run, tensor, mesh.data, pipeline.stages)
    placed = _on_mesh(run, mesh, pipeline)
    if pipeline.megatron:
        return state + megatron_activation_bytes(placed, rows, pipeline)
    blocks = run.model.num_layers // pipeline.stages * layout(run, tensor).layer
    return state + activations(placed, rows, gpu).total + tick_loop_gradient_bytes(placed, blocks)


def gather_params_s(run: RunSpec, mesh: tuple[int, int], cluster: Cluster, stages: int = 1,
                    expert: int = 1) -> float:
    """The all-gathers of fp32 parameter shards (of one of ``stages`` pipeline stages) over ``data`` (each half a
    ring all-reduce; ``expert`` shards apart), hierarchical as ``data_comm_s``, not overlapped: ZeRO-1's one of the
    updated parameters; FSDP's two, each layer's when the forward pass reaches it and again in the backward pass. 0
    with neither. FSDP's are counted at fp32's 4 bytes, as ``dgx_h100`` was fitted (torchtitan's and MaxText's
    rows among them): megajax gathers the layers' kernels in the compute dtype (``sharding.param_at_use``), so
    this over-counts them by up to 2x, on the safe side, until the constants are fitted again."""
    data, tensor = mesh
    if data == 1 or not run.shard_optimizer:
        return 0.0
    local = parameters_per_gpu(run, tensor, stages, expert)[1]
    return (2 if run.fsdp else 1) * group_allreduce_s(4 * local, data, expert * tensor, cluster) / 2


def _rows(mesh: MeshShape, global_batch: int, micro_batch: int | None) -> tuple[int, int]:
    """(sequences per batch shard (data x expert) per accumulation step, accumulation steps)."""
    data = mesh.batch_shards
    if global_batch % data:
        raise ValueError(f"global batch {global_batch} is not divisible by the {data} batch shards (data x expert)")
    per_replica = global_batch // data
    micro = micro_batch or per_replica
    if per_replica % micro:
        raise ValueError(f"micro-batch {micro} does not divide the {per_replica} sequences per data shard")
    return micro, per_replica // micro


def _step(r: RunSpec, mesh: MeshShape, global_batch, cluster, micro_batch, grad_bytes, reduce_once: bool = False
          ) -> tuple[float, float, float, float, float, int]:
    """(compute, tensor-parallel, exposed data-parallel, expert or context, step, rows) without stages (module
    docstring; ``scaling_context``: a GPU of ``context`` shards does the work of micro-batch / context sequences)."""
    data, tensor, expert, context = mesh.data, mesh.model, mesh.expert, mesh.context
    micro, num_micro = _rows(mesh, global_batch, micro_batch)
    share = micro / context  # the sequences' worth one GPU computes
    compute = num_micro * compute_s(r, tensor, share, cluster, expert)
    compute += OPTIMIZER_BYTES_PER_PARAM * parameters_per_gpu(r, tensor, 1, expert)[1] / cluster.hbm_bandwidth
    tensor_comm = (1 - cluster.tp_overlap) * num_micro * tensor_comm_s(r, tensor, share, cluster)
    group = (data, tensor)  # the (data, model) shape the collectives' models take
    other = num_micro * (expert_comm_s(r, group, micro, expert, cluster) + context_comm_s(r, group, micro, context,
                                                                                           cluster))
    # FSDP reduces the gradients onto their shards: a reduce-scatter, half the all-reduce; with context shards the
    # gradients are reduced over data x context (the group's members `model` apart)
    grads = data_comm_s(r, (data * context, tensor), cluster, grad_bytes, 1, expert) / (2 if r.fsdp else 1)
    times, hidden = _per_step(r, mesh, num_micro, reduce_once, cluster)
    data_comm = times * ((1 - hidden) * grads + gather_params_s(r, group, cluster, 1, expert))
    return compute, tensor_comm, data_comm, other, compute + tensor_comm + data_comm + other, micro


def _tensor_parts(r: RunSpec, tensor: int, micro_batch: int, cluster: Cluster) -> tuple[float, float]:
    """(one layer's tensor-parallel time, the ends': the embedding's and output layer's all-reduces and the loss's)
    for one micro-batch, from ``tensor_comm_s``."""
    ends = tensor_comm_s(r, tensor, micro_batch, cluster, layers=0)
    return (tensor_comm_s(r, tensor, micro_batch, cluster) - ends) / r.model.num_layers, ends


def _pipeline_step(r: RunSpec, mesh: MeshShape, global_batch, cluster, micro_batch, grad_bytes, pipeline: Pipeline,
                   reduce_once: bool = False):
    """(compute, tensor-parallel, exposed data-parallel, pipe, step, rows) with pipeline stages (module docstring)."""
    data, tensor = mesh.data, mesh.model
    p, m, v = pipeline.stages, pipeline.microbatches, pipeline.repeats
    layers, seq, hidden = r.model.num_layers, r.model.max_seq_len, r.model.hidden_size
    rows, num_micro = _rows(mesh, global_batch, micro_batch)
    if rows % m:
        raise ValueError(f"{m} pipeline microbatches do not divide the {rows} sequences of a layer-stack batch")
    if m % p and not pipeline.megatron:
        raise ValueError(f"{m} pipeline microbatches are not a multiple of the {p} stages (megajax's stages each hold "
                         "whole microbatches of their share of the batch)")
    if layers % (p * v):
        raise ValueError(f"{p} stages x {v} repeats do not divide the {layers} layers")
    micro, chunk, ticks = rows // m, layers // (p * v), pipeline.ticks()
    extra = 0.0  # per layer, beyond the timed policy's recomputation
    if pipeline.one_f_one_b and pipeline.stage_recompute:  # the stage's backward runs its forward again from the
        # held input (and under the model's remat policy its layers again inside it: timed as the policy)
        extra = layer_s(with_choices(r, remat="full"), tensor, micro, cluster) - layer_s(
            with_choices(r, remat="none"), tensor, micro, cluster)
    elif not pipeline.megatron and ((v > 1 and not pipeline.one_f_one_b) or r.model.remat == "save_dots"):
        # in the vmapped stage every dot is batched, so save_dots recomputes what full does; the circular schedule
        # recomputes each chunk from its input whatever the policy, and under selective the attention core again
        if v > 1 and r.model.remat == "selective":
            extra = layer_s(r, tensor, micro, cluster) - layer_s(with_choices(r, remat="none"), tensor, micro,
                                                                 cluster)
        r = with_choices(r, remat="full")
    inter = crosses_nodes(p, data, tensor, cluster.gpus_per_node)
    link = (cluster.inter_bandwidth, cluster.inter_latency) if inter else (cluster.intra_bandwidth,
                                                                           cluster.intra_latency)
    tensor_layer, tensor_ends = _tensor_parts(r, tensor, micro, cluster)
    message = micro * seq * hidden * HALF / (tensor if r.sequence else 1)  # SP: 1/t of the positions
    # forward, backward (SP: split already, nothing scattered or gathered)
    hop = 2 * p2p_s(message, 1 if r.sequence else tensor, pipeline, inter, cluster)
    if pipeline.megatron:  # the last stage's head after each microbatch: the slowest stage sets the pace
        ends, ends_comm, ends_moves = m * head_s(r, tensor, micro, cluster), m * tensor_ends, 0.0
    elif pipeline.one_f_one_b:  # the head on the last stage after each microbatch, the inputs and their gradients
        # along the io columns each tick (the input column towards stage 0, the gradients' round the ring)
        ends, ends_comm = m * head_s(r, tensor, micro, cluster), m * tensor_ends
        ends_moves = pipeline.lockstep_ticks() * hop
    else:  # every stage runs the ends on its share of the batch; each tick the io column moves one microbatch
        # towards stage 0 and its gradient back (comm_budget's pipeline inputs/outputs), as large as the ring's hop
        ends = head_s(r, tensor, rows // p, cluster)
        ends_comm = _tensor_parts(r, tensor, rows // p, cluster)[1]
        ends_moves = ticks * hop
    compute = num_micro * (ticks * chunk * (layer_s(r, tensor, micro, cluster) + extra) + ends)
    compute += OPTIMIZER_BYTES_PER_PARAM * parameters_per_gpu(r, tensor, p)[1] / cluster.hbm_bandwidth
    tensor_comm = (1 - cluster.tp_overlap) * num_micro * (ticks * chunk * tensor_layer + ends_comm)
    pipe_comm = num_micro * (pipeline.lockstep_ticks() * hop + ends_moves)
    if pipeline.megatron and layout(r, tensor).tied:  # the tied embedding's gradient: first and last stage
        pipe_comm += ring_allreduce_s(grad_bytes * r.model.padded_vocab_size * hidden / tensor, 2, *link)
    grads = data_comm_s(r, (data, tensor), cluster, grad_bytes, p) / (2 if r.fsdp else 1)
    if not pipeline.megatron:  # the ends' gradients (every stage computes part of them) over data x pipe, not data
        ends_bytes = grad_bytes * (parameters_per_gpu(r, tensor, p)[1] - layers // p * layout(r, tensor).layer)
        grads += group_allreduce_s(ends_bytes, data * p, tensor, cluster) - (
            group_allreduce_s(ends_bytes, data, tensor, cluster) if data > 1 else 0.0)
    times, hidden = _per_step(r, mesh, num_micro, reduce_once, cluster)
    data_comm = times * ((1 - hidden) * grads + gather_params_s(r, (data, tensor), cluster, p))
    return compute, tensor_comm, data_comm, pipe_comm, compute + tensor_comm + data_comm + pipe_comm, rows


def _per_step(run: RunSpec, mesh: MeshShape, num_micro: int, reduce_once: bool, cluster: Cluster
              ) -> tuple[int, float]:
    """How often a step moves its data-parallel traffic, and the fraction of it hidden behind compute. FSDP
    gathers each layer's parameters and reduce-scatters its gradients in every accumulation step (its shards hold no
    whole gradient to add them up in), as the backward pass runs. Otherwise Megatron-LM reduces the gradients once,
    after the last one, overlapped with its backward pass (``reduce_once``: the published runs); megajax's step
    reduces them once where it keeps each data replica's apart through the accumulation (``training.replicas``),
    after the loop, where nothing hides it; with pipeline stages, once per accumulation step in its backward."""
    if not run.fsdp and (reduce_once or num_micro == 1):
        return 1, cluster.dp_overlap
    if kept_apart(num_micro, mesh.data, run.fsdp, mesh.pipe):
        return 1, 0.0
    return num_micro, cluster.dp_overlap


def predict(run: RunSpec, mesh: MeshShape, global_batch: int, cluster: Cluster,
            micro_batch: int | None = None, grad_bytes: int = 4, baseline_tflops: float | None = None,
            memory: bool = True, pipeline: Pipeline | None = None, reduce_once: bool = False) -> Prediction:
    """The predicted step of ``run``'s model with its choices (``choices``: remat, sequence parallelism, the state
    split over data) on ``mesh`` with ``global_batch`` sequences per step; the run's own mesh, batch and pipeline
    are not read. ``pipeline``: the schedule of ``mesh.pipe`` > 1 stages (its ``stages`` are the mesh's).

    ``micro_batch``: sequences per batch shard (data x expert) per accumulation step (None: the whole shard at
    once); with stages, each is the layer stack's batch, cut into ``pipeline.microbatches``.
    ``grad_bytes``: bytes per gradient element all-reduced over ``data`` (megajax: 4; Megatron-LM 2019: 2).
    ``baseline_tflops``: the efficiency's reference (default: this model on 1 GPU with one shard's batch).
    ``memory=False`` skips the memory estimate (the memory planner's): memory_bytes 0, fits True.
    ``reduce_once``: the gradients reduced once per step whatever the accumulation, as Megatron-LM does (the
    published runs); by default as megajax's step reduces them (``_per_step``).
    Expert shards (``scaling_experts``) are timed without stages, context shards (``scaling_context``) without
    stages or expert shards."""
    pipeline = _pipeline_of(mesh, pipeline)
    if run.model.fp8 and not cluster.fp8_peak_flops:
        raise ValueError(f"train.precision=fp8: {cluster.name}'s GPUs have no FP8 tensor cores")
    if mesh.expert > 1 and mesh.pipe > 1:
        raise ValueError("the scaling model times expert shards without pipeline stages only (a mixture of experts "
                         "runs in stages with its experts split over model, not over expert shards)")
    if mesh.context > 1 and (mesh.pipe > 1 or mesh.expert > 1):
        raise ValueError("the scaling model times context shards without pipeline stages or expert shards only")
    context_comm = 0.0
    if mesh.pipe == 1:
        compute, tensor_comm, data_comm, expert_comm, step, micro = _step(run, mesh, global_batch, cluster,
                                                                          micro_batch, grad_bytes, reduce_once)
        pipe_comm = 0.0
        if mesh.context > 1:
            expert_comm, context_comm = 0.0, expert_comm
    else:
        compute, tensor_comm, data_comm, pipe_comm, step, micro = _pipeline_step(
            run, mesh, global_batch, cluster, micro_batch, grad_bytes, pipeline, reduce_once)
        expert_comm = 0.0
    shards = mesh.batch_shards
    work = flops(run, global_batch)
    tflops = work / step / mesh.devices / 1e12
    if baseline_tflops is None:
        base = _step(run, MeshShape(), global_batch // shards, cluster, micro_batch, grad_bytes, reduce_once)[4]
        baseline_tflops = work / shards / base / 1e12
    flash = flash_attention(run, cluster)
    num_micro = global_batch // mesh.batch_shards // micro
    need = memory_bytes(run, mesh, micro, pipeline, flash, num_micro) if memory else 0
    return Prediction(run=run, mesh=mesh, global_batch=global_batch, micro_batch=micro,
                      num_micro=global_batch // shards // micro, compute_s=compute, tensor_comm_s=tensor_comm,
                      data_comm_s=data_comm, step_s=step, tflops_per_gpu=tflops,
                      mfu=tflops * 1e12 / cluster.peak_flops, efficiency=tflops / baseline_tflops,
                      memory_bytes=need, fits=need <= cluster.hbm_bytes, pipeline=pipeline, pipe_comm_s=pipe_comm,
                      expert_comm_s=expert_comm, context_comm_s=context_comm)
