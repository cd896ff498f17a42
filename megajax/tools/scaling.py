"""Predicts a decoder language model's step time on a described cluster from its FLOPs, memory traffic and
communication.

``python -m megajax.scaling`` (``scaling_plan.py``) runs it over every (pipe, data, model) mesh of a cluster and
recommends one; ``scaling_papers.py`` checks it against Megatron-LM's published measurements. Per GPU, with t-way
model, d-way data parallelism and p pipeline stages:

* Compute per layer and micro-batch: each GEMM (QKV, attention out, MLP up and down on their 1/t shards; QK^T
  and AV per local head; the block's shape from the model's spec: Llama's smaller key/value projections and
  SwiGLU's gate, up and down) at the roofline ``max(flops / (gemm_efficiency x peak), operand bytes / HBM bandwidth)``,
  3 times (forward, two backward GEMMs) + once more where ``remat`` recomputes it; the memory-bound element-wise
  work as counted passes at HBM bandwidth (below); a fixed ``layer_overhead_s``. Plus the output layer and its
  cross-entropy, and AdamW once per step. The GEMM shapes' FLOPs add up to the model FLOPs
  (``models.spec.decoder_flops``; GPT-2's ``transformer_flops``; a test pins it); a thin shard (h/t small) or the
  s x s GEMMs of narrow heads fall below the ridge and run at HBM speed: that is the model's GEMM efficiency as a
  function of size.
* Tensor-parallel: ``comm_budget.minimum``'s all-reduces (2L + 1 of b x s x h each way, L more with
  ``remat=full``, 3 per-token ones for the loss), each a ring in the node, ``2 (t-1)/t bytes / bandwidth +
  2 (t-1) latency``, not overlapped (Megatron's f and g block the layer).
* Data-parallel: ``comm_budget.minimum``'s gradient elements at ``grad_bytes``, all-reduced hierarchically (ring
  among the group's GPUs in a node, then across nodes on each GPU's share of the node's InfiniBand, 1/members of
  it per GPU); ``dp_overlap`` of it hides behind the backward pass.
* Step = micro-batches x (compute + tensor-parallel) + optimizer + exposed data-parallel. TFLOP/s per GPU are
  model FLOPs (``Decoder.flops``, recomputation not counted) / step / GPUs; the weak-scaling efficiency is
  that over a 1-GPU baseline's.

Pipeline stages (``Pipeline``, ``scaling_pipeline.py``; p = 1 is the step above, term for term). Each layer-stack
batch (a micro-batch's rows) is cut into M microbatches; the schedule runs ``Pipeline.ticks`` stage-ticks, M v + p - 1
(M >= p; v = 1: GPipe / 1F1B, v > 1: circular / interleaved), each L/(p v) layers of one microbatch: compute and
tensor-parallel all-reduces of those layers, and two point-to-point transfers (its activations forward, their
gradient backward; ``p2p_s``: b s h half-precision bytes from every model-parallel GPU in megajax (1/t with
sequence parallelism), 1/t over the link plus an NVLink all-gather with Megatron-LM's scatter/gather), on the
InfiniBand link where a stage boundary crosses nodes (``crosses_nodes``: pipe is the mesh's outermost axis), not
overlapped. Idle ticks cost as much as busy ones: the bubble, (p - 1)/(M v + p - 1) of them. megajax's circular
schedule recomputes each chunk from its input whatever the remat policy (timed as ``full``, with ``selective``'s
attention core once more), and inside a stage ``save_dots`` recomputes what ``full`` does. The ends: megajax runs
the embeddings and head on every stage over the whole layer-stack batch (their parameters replicated over pipe) and
moves the finished microbatches from stage 0 to every stage and their gradient back (one ring all-reduce of the
batch's b s h over pipe); Megatron-LM runs the head on the last stage after each microbatch (M heads on the slowest
stage) and all-reduces the tied embedding's gradient between the first and last stage. Data-parallel all-reduce,
ZeRO-1's gather and AdamW cover one stage's parameters (``stage``: L/p layers and the ends). Memory per GPU
(``stage_memory_bytes``): the stage's state; megajax's activations as the memory planner counts them (every tick's
residuals or chunk input, bubble ticks included, the head on the whole batch, one recomputed layer or chunk) and the
tick loop's fp32 sums of the stage's layer gradients; Megatron-LM's, the residuals of the chunk-microbatches in
flight (``Pipeline.in_flight``: 1F1B at most p, interleaved its warm-up), and the head on one microbatch.

Tests pin ``transformer_flops`` and ``comm_budget.minimum`` equal to the compiled HLO's (ratio 1.00): the counted
work is megajax's; what this module adds is how long it takes.

Counted, not fitted (Megatron-LM 2019's eager PyTorch step; a pass reads or writes the tensor once): b*s*h work
duplicated on every model-parallel GPU (two LayerNorms, bias + dropout + residual twice) 20 passes forward, 40
backward; b*s*h/t split work (head transposes, GeLU) 16 and 32; the b*(a/t)*s*s attention scores (scale, mask,
softmax, dropout) 10 and 20; 40 bytes per local logit (fp32 cross-entropy); 32 bytes per local parameter (AdamW).
Megatron-LM 2021's fused kernels: 12, 10 and 5 forward (``MEGATRON_2021_PASSES``, ``DGX_A100``).

Fitted, per cluster (``scaling_clusters.py``; ``scaling_papers.py`` has the published figures, which were fitted
and which held out, what was assumed where a paper is silent, and the errors): ``DGX2H_V100``'s ``gemm_efficiency``
0.88, ``layer_overhead_s`` 6 ms (the launches and tails of ~300 eager kernels) and ``dp_overlap`` 0.3 to three of
Megatron-LM 2019's figures (every figure within 8 points, speedups within 3%); ``DGX_A100``'s ``gemm_efficiency``
0.685 and ``layer_overhead_s`` 3.95 ms to the odd rows of PTD-P 2021's Table 1 (every row within 1.5 points of peak;
the held-out even rows within 1.1); its ``dp_overlap`` 0 is Megatron-LM 2021's (an all-reduce after the backward
pass). ``DGX_H100``'s calibration is assumed, not fitted: no paper here has an H100.

Beyond the papers: sequence parallelism splits the replicated element-wise work and the LayerNorm / dropout /
residual activations by t (its reduce-scatter / all-gather pairs send the all-reduces' bytes); ZeRO-1 splits the
moments over ``data`` (8 + 8/d bytes per local parameter) and adds an all-gather of the updated fp32 parameters
(half a ring all-reduce, not overlapped); FSDP splits all 16 bytes (16/d), reduce-scatters the gradients (half the
all-reduce, overlapped as it) and all-gathers each layer's fp32 parameters twice, forward and backward (not
overlapped, so the planner turns it on only where less does not fit); megajax's own pipeline (GPipe / circular;
the Megatron-LM schedule is what PTD-P checks). None is calibrated: the papers have none.

Ignored: tensor-parallel communication overlapped with compute, point-to-point overlapped with compute, NCCL's
protocols and topology beyond a ring, kernel efficiency beyond the calibration (the 2019 constants describe eager
PyTorch; a fused XLA step moves fewer bytes and launches fewer kernels), megajax's pipeline drawing each layer's
whole dropout mask on every stage-tick, stragglers, data loading and memory fragmentation.
"""

from __future__ import annotations

import dataclasses
import math

import ml_collections

from megajax.config import base_config, model_config, sequence_parallel, state_split
from megajax.models import gpt, model_spec
from megajax.models.spec import decoder_flops
from megajax.models.transformer import kv_replicated
from megajax.tools.comm_budget import Shape, minimum
from megajax.tools.memory_planner import activation_bytes
from megajax.tools.scaling_clusters import (  # noqa: F401 (the clusters are this module's API too)
    CLUSTERS,
    DGX2H_V100,
    DGX_A100,
    DGX_H100,
    MEGATRON_2021_PASSES,
    REPLICATED_PASSES,
    SCORE_PASSES,
    SPLIT_PASSES,
    Cluster,
    GiB,
)
from megajax.tools.scaling_pipeline import Pipeline, crosses_nodes, megatron_activation_bytes, p2p_s

HALF = 2  # bytes per activation value: fp16 / bf16 training
STATE_BYTES_PER_PARAM = 16  # fp32 parameters, gradients and AdamW's two moments (megajax.info)
LOGIT_BYTES = 40  # per local logit, fp32 cross-entropy forward + backward
OPTIMIZER_BYTES_PER_PARAM = 32  # AdamW's step: fp32 master, m, v read and written, half grads and params


@dataclasses.dataclass(frozen=True)
class Decoder:
    """A decoder language model's sizes (vocab = the padded vocabulary), its activation recomputation and the
    memory choices beyond the paper: ``sequence`` (parallel.sequence), ``shard_optimizer``
    (parallel.shard_optimizer, ZeRO-1) and ``fsdp`` (parallel.fsdp, ZeRO-3; it implies shard_optimizer). The block's
    shape is GPT-2's unless its family's spec says otherwise (``from_config``): ``kv_heads`` key/value heads (0:
    ``heads``), an MLP of width ``ffn`` (0: 4 hidden) with a ``gated`` first GEMM (SwiGLU's gate and up), ``biases``
    (linear layers and norms), a learned position table (``positions``), the output layer ``tied`` to the
    embedding; ``name``: the family, for the memory planner."""

    hidden: int
    layers: int
    heads: int
    seq: int = 1024
    vocab: int = 51200
    remat: str = "full"
    sequence: bool = False
    shard_optimizer: bool = False
    fsdp: bool = False
    kv_heads: int = 0
    ffn: int = 0
    gated: bool = False
    biases: bool = True
    positions: bool = True
    tied: bool = True
    name: str = gpt.NAME
    dropout: float = 0.1  # its masks are activations (memory_bytes)

    @classmethod
    def from_config(cls, config) -> Decoder:
        """The decoder of a megajax config (``load_config``), its block's shape from the model's spec."""
        m, cfg, spec = config.model, model_config(config), model_spec(config.model.name)
        return cls(m.hidden_size, m.num_layers, m.num_heads, m.max_seq_len, cfg.padded_vocab_size, m.remat,
                   sequence_parallel(config), *state_split(config), kv_heads=cfg.kv_heads, ffn=cfg.ffn_size,
                   gated=spec.gated_mlp, biases=spec.biases, positions=bool(spec.sequence_rows),
                   tied=getattr(cfg, "tie_embeddings", True), name=spec.name, dropout=m.dropout)

    @property
    def kv_width(self) -> int:
        """The key and value projections' output columns, 2 x kv_heads x head_dim (2 hidden without GQA)."""
        return 2 * (self.kv_heads or self.heads) * (self.hidden // self.heads)

    @property
    def mlp(self) -> int:
        """The MLP's hidden width."""
        return self.ffn or 4 * self.hidden

    def kv_replicated(self, tensor: int) -> bool:
        """Whether ``tensor`` model shards each hold a copy of one key/value head: the model's rule
        (``transformer.kv_replicated``; ValueError where neither divides the other, see ``divisible_by``)."""
        return kv_replicated(self.kv_heads or self.heads, tensor)

    def flops(self, batch: int) -> float:
        """Model FLOPs of ``batch`` sequences forward + backward (``models.spec.decoder_flops``; GPT-2's shape:
        ``transformer_flops``)."""
        up = self.mlp * (2 if self.gated else 1)
        return decoder_flops(batch, self.seq, self.layers, self.hidden, self.kv_width, up + self.mlp, self.vocab)

    def flags(self) -> str:
        """The config flags that give this model's choices."""
        return (f"--config.model.remat={self.remat} --config.parallel.sequence={self.sequence} "
                f"--config.parallel.shard_optimizer={self.shard_optimizer} --config.parallel.fsdp={self.fsdp}")

    def params(self, tensor: int = 1) -> tuple[int, int]:
        """(total parameters, parameters on one of ``tensor`` model-parallel GPUs), as megajax shards them: the
        query / key-value (QKV), MLP-up (gate and up) and their biases, attention-out and MLP-down weights and the
        word embedding (and an untied output layer) split, key/value heads whole where the shards replicate them;
        norms, row-parallel biases and position embeddings replicated (a test pins it to
        ``memory_planner.params_per_device``)."""
        h, L, kv, bias = self.hidden, self.layers, self.kv_width, int(self.biases)
        up = self.mlp * (2 if self.gated else 1)
        kv_part = L * (h * kv + bias * kv)
        split = L * (h * h + h * h + h * up + self.mlp * h + bias * (h + up)) + self.vocab * h * (2 - self.tied)
        norm = (1 + bias) * h  # LayerNorm's scale and bias; RMSNorm's scale
        replicated = L * (2 * norm + bias * 2 * h) + self.positions * self.seq * h + norm
        local_kv = kv_part if self.kv_replicated(tensor) else kv_part // tensor
        return split + kv_part + replicated, split // tensor + local_kv + replicated

    def divisible_by(self, tensor: int) -> bool:
        """Whether each of ``tensor`` shards holds whole heads and equal slices of hidden, MLP and vocabulary, and
        whole key/value heads or a copy of one."""
        try:
            self.kv_replicated(tensor)
        except ValueError:
            return False
        return all(n % tensor == 0 for n in (self.heads, self.hidden, self.mlp, self.vocab))


@dataclasses.dataclass(frozen=True)
class Prediction:
    """One mesh's predicted step (seconds per step; memory per GPU)."""

    model: Decoder  # with the remat / sequence / shard_optimizer choices this prediction is for
    mesh: tuple[int, int]  # (data, model); the pipe axis is ``pipeline.stages``
    global_batch: int
    micro_batch: int
    num_micro: int
    compute_s: float
    tensor_comm_s: float
    data_comm_s: float  # exposed part
    step_s: float
    tflops_per_gpu: float  # model FLOPs (Decoder.flops) / step / GPUs
    mfu: float
    efficiency: float  # tflops_per_gpu / the 1-GPU baseline's
    memory_bytes: int
    fits: bool
    pipeline: Pipeline = Pipeline()  # the stages, schedule and microbatches (1 stage: none)
    pipe_comm_s: float = 0.0  # point-to-point between stages, and the ends' transfers over pipe

    @property
    def gpus(self) -> int:
        return self.pipeline.stages * self.mesh[0] * self.mesh[1]

    @property
    def bubble(self) -> float:
        """The idle share of the pipeline's stage-ticks (0 without stages)."""
        return self.pipeline.bubble()


def ring_allreduce_s(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """A ring all-reduce of ``nbytes`` over ``n`` GPUs: reduce-scatter + all-gather, 2 (n-1) steps each moving
    ``nbytes / n`` on every link."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency


def _gemm_s(batch: float, m: float, k: float, n: float, cluster: Cluster) -> float:
    """A (batched) half-precision GEMM at the roofline: compute- or HBM-bound, whichever is slower."""
    compute = 2 * batch * m * k * n / (cluster.peak_flops * cluster.gemm_efficiency)
    memory = HALF * batch * (m * k + k * n + m * n) / cluster.hbm_bandwidth
    return max(compute, memory)


def gemms(model: Decoder, tensor: int, micro_batch: int) -> tuple[list[tuple], list[tuple], tuple]:
    """One GPU's forward GEMMs per micro-batch as (batch, m, k, n): the layer's dense ones, its attention ones,
    and the output layer's."""
    h, s, t, b = model.hidden, model.seq, tensor, micro_batch
    tokens, local_heads = b * s, b * model.heads / t
    kv = 2 * h / model.heads if model.kv_replicated(t) else model.kv_width / t  # one head's copy, or a 1/t share
    up = model.mlp * (2 if model.gated else 1)
    dense = [(1, tokens, h, h / t + kv), (1, tokens, h / t, h), (1, tokens, h, up / t), (1, tokens, model.mlp / t, h)]
    head = h / model.heads
    attention = [(local_heads, s, head, s), (local_heads, s, s, head)]
    return dense, attention, (1, tokens, h, model.vocab / t)


RECOMPUTED = {"none": (0, 0, 0), "full": (1, 1, 1), "save_dots": (0, 1, 1), "selective": (0, 0, 1)}
"""remat -> how often the backward pass reruns (dense GEMMs, element-wise work, attention core: its batched
GEMMs and scores). save_dots keeps the dense GEMMs' outputs but not the batched attention ones."""


def compute_s(model: Decoder, tensor: int, micro_batch: int, cluster: Cluster) -> float:
    """One GPU's compute time for one micro-batch, forward + backward (+ recomputation), without communication: L
    layers (``layer_s``) and the output layer (``head_s``)."""
    return model.layers * layer_s(model, tensor, micro_batch, cluster) + head_s(model, tensor, micro_batch, cluster)


def layer_s(model: Decoder, tensor: int, micro_batch: int, cluster: Cluster) -> float:
    """One layer's compute time for one micro-batch on one GPU: its GEMMs at the roofline, its element-wise passes at
    HBM bandwidth, the fixed overhead."""
    dense, attention, _ = gemms(model, tensor, micro_batch)
    dots, elementwise, core = RECOMPUTED[model.remat]
    layer = (3 + dots) * sum(_gemm_s(*g, cluster) for g in dense)
    layer += (3 + core) * sum(_gemm_s(*g, cluster) for g in attention)
    tokens = micro_batch * model.seq
    replicated = tokens * model.hidden / (tensor if model.sequence else 1)  # SP: each GPU's positions only
    sizes = (replicated, tokens * model.hidden / tensor, micro_batch * model.heads / tensor * model.seq**2)
    repeats = (elementwise, elementwise, core)
    passes = sum(n * ((1 + r) * fwd + bwd) for n, r, (fwd, bwd) in zip(sizes, repeats, cluster.passes))
    return layer + (HALF * passes / cluster.hbm_bandwidth + cluster.layer_overhead_s)


def head_s(model: Decoder, tensor: int, micro_batch: int, cluster: Cluster) -> float:
    """The output layer's GEMM and its cross-entropy for one micro-batch on one GPU."""
    logits = gemms(model, tensor, micro_batch)[2]
    tokens = micro_batch * model.seq
    return 3 * _gemm_s(*logits, cluster) + LOGIT_BYTES * tokens * model.vocab / tensor / cluster.hbm_bandwidth


def _shape(model: Decoder, mesh: tuple[int, int], micro_batch: int, num_micro: int) -> Shape:
    local, kv_head = model.params(mesh[1])[1], 0
    if mesh[1] > 1 and model.kv_replicated(mesh[1]):  # comm_budget.step_shape: each shard reduces its head
        kv_head = model.kv_width // (model.kv_heads or model.heads) * model.hidden
        local -= model.layers * kv_head * ((model.kv_heads or model.heads) - 1)
    return Shape(micro_batch=micro_batch, num_micro=num_micro, seq=model.seq, hidden=model.hidden,
                 layers=model.layers, tensor=mesh[1], data=mesh[0], activation_bytes=HALF,
                 local_grad_elements=local, remat=model.remat, kv_head_elements=kv_head)


def tensor_comm_s(model: Decoder, tensor: int, micro_batch: int, cluster: Cluster) -> float:
    """Tensor-parallel all-reduces of one micro-batch (comm_budget.minimum's bytes), each a ring over ``tensor``."""
    if tensor == 1:
        return 0.0
    need = minimum(_shape(model, (1, tensor), micro_batch, 1))
    activation = micro_batch * model.seq * model.hidden * HALF  # one all-reduce's message
    count = (need["tensor-parallel forward"] + need["tensor-parallel backward"]) / activation
    per_token = micro_batch * model.seq * 4
    within = tensor <= cluster.gpus_per_node
    link = (cluster.intra_bandwidth, cluster.intra_latency) if within else (cluster.inter_bandwidth,
                                                                             cluster.inter_latency)
    return count * ring_allreduce_s(activation, tensor, *link) + \
        need["loss"] / per_token * ring_allreduce_s(per_token, tensor, *link)


def data_comm_s(model: Decoder, mesh: tuple[int, int], cluster: Cluster, grad_bytes: int = 4) -> float:
    """The gradient all-reduce over ``data`` before overlap, hierarchical: ring among the group's members in a
    node, then a ring across nodes of 1/members of the gradient per GPU (all of a node's GPUs reduce at once,
    each on its share of the node's InfiniBand), then the all-gather back within the node."""
    if mesh[0] == 1:
        return 0.0
    grads = minimum(_shape(model, mesh, 1, 1))["data-parallel gradients"] / 4 * grad_bytes
    return _over_data_s(grads, mesh, cluster)


def _over_data_s(nbytes: float, mesh: tuple[int, int], cluster: Cluster) -> float:
    """A hierarchical ring all-reduce of ``nbytes`` per GPU over ``data`` (``data_comm_s``)."""
    data, tensor = mesh
    members = max(1, min(data, cluster.gpus_per_node // tensor))  # the group's GPUs on one node
    nodes = math.ceil(data / members)
    within = ring_allreduce_s(nbytes, members, cluster.intra_bandwidth, cluster.intra_latency)
    across = ring_allreduce_s(nbytes / members, nodes, cluster.inter_bandwidth, cluster.inter_latency)
    return within + across


def state_bytes(model: Decoder, tensor: int, data: int = 1) -> int:
    """Per-GPU training state: 16 bytes per local parameter (fp32 parameters, gradients, AdamW's two moments); with
    ``shard_optimizer`` the moments split over ``data`` (8 + 8/d), with ``fsdp`` all of it (16/d)."""
    local = model.params(tensor)[1]
    if model.fsdp:
        return STATE_BYTES_PER_PARAM * (local // data)
    return STATE_BYTES_PER_PARAM * local if not model.shard_optimizer else 8 * local + 8 * local // data


def planner_config(model: Decoder):
    """A megajax config of ``model``'s sizes and choices, for the memory planner."""
    config = base_config(model.name)
    config.model.update(hidden_size=model.hidden, num_layers=model.layers, num_heads=model.heads,
                        max_seq_len=model.seq, vocab_size=model.vocab, make_vocab_size_divisible_by=1,
                        remat=model.remat, ffn_hidden_size=model.ffn, dropout=model.dropout)
    if model.kv_heads and model.kv_heads != model.heads:
        config.model.num_kv_heads = model.kv_heads
    config.parallel.sequence = model.sequence
    return config


def memory_bytes(model: Decoder, tensor: int, micro_batch: int, data: int = 1, pipeline: Pipeline | None = None) -> int:
    """Per-GPU training memory as ``megajax.info``'s total: ``state_bytes`` plus the memory planner's activations
    (``memory_planner.activation_bytes``, half precision) for one micro-batch. Not counted: FSDP's one gathered
    layer at a time. With pipeline stages, one stage's (``stage_memory_bytes``)."""
    config = planner_config(model)
    if pipeline is not None and pipeline.stages > 1:
        return stage_memory_bytes(model, config, tensor, micro_batch, data, pipeline)
    return state_bytes(model, tensor, data) + activation_bytes(config, micro_batch, tensor, HALF)


def stage(model: Decoder, pipeline: Pipeline) -> Decoder:
    """One stage's share of ``model`` for parameter counts: its L/p layers and the ends (megajax replicates the
    embeddings, final norm and output layer over pipe; Megatron-LM's first stage holds the embeddings, its last the
    final norm and the tied output layer's copy: about the same)."""
    return dataclasses.replace(model, layers=model.layers // pipeline.stages)


def stage_memory_bytes(model: Decoder, config, tensor: int, rows: int, data: int, pipeline: Pipeline) -> int:
    """One stage's memory: its state (``state_bytes`` of ``stage``) and activations. megajax's are the memory
    planner's (``megajax.info``'s: ``activation_bytes`` of the config with the stages, microbatches and repeats),
    plus the tick loop's fp32 sums of the stage's layer gradients (GPipe: an accumulator and each tick's
    contribution; circular: the accumulator: the planner's ``stage_grad_bytes``); Megatron-LM's are
    ``megatron_activation_bytes``."""
    part = stage(model, pipeline)
    if pipeline.megatron:
        return state_bytes(part, tensor, data) + megatron_activation_bytes(config, rows, tensor, pipeline)
    config = ml_collections.ConfigDict(config)
    config.mesh.pipe, config.parallel.pipeline_microbatches = pipeline.stages, pipeline.microbatches
    config.parallel.pipeline_repeats = pipeline.repeats
    blocks = part.params(tensor)[1] - dataclasses.replace(model, layers=0).params(tensor)[1]
    sums = (2 if pipeline.repeats == 1 else 1) * 4 * blocks
    return state_bytes(part, tensor, data) + activation_bytes(config, rows, tensor, HALF) + sums


def gather_params_s(model: Decoder, mesh: tuple[int, int], cluster: Cluster) -> float:
    """The all-gathers of fp32 parameter shards over ``data`` (each half a ring all-reduce), hierarchical as
    ``data_comm_s``, not overlapped: ZeRO-1's one of the updated parameters; FSDP's two, each layer's when the
    forward pass reaches it and again in the backward pass. 0 with neither."""
    if mesh[0] == 1 or not model.shard_optimizer:
        return 0.0
    return (2 if model.fsdp else 1) * _over_data_s(4 * model.params(mesh[1])[1], mesh, cluster) / 2


def _rows(mesh, global_batch, micro_batch) -> tuple[int, int]:
    """(sequences per data shard per accumulation step, accumulation steps)."""
    data = mesh[0]
    if global_batch % data:
        raise ValueError(f"global batch {global_batch} is not divisible by data={data}")
    per_replica = global_batch // data
    micro = micro_batch or per_replica
    if per_replica % micro:
        raise ValueError(f"micro-batch {micro} does not divide the {per_replica} sequences per data shard")
    return micro, per_replica // micro


def _step(model, mesh, global_batch, cluster, micro_batch, grad_bytes) -> tuple[float, float, float, float, int]:
    data, tensor = mesh
    micro, num_micro = _rows(mesh, global_batch, micro_batch)
    compute = num_micro * compute_s(model, tensor, micro, cluster)
    compute += OPTIMIZER_BYTES_PER_PARAM * model.params(tensor)[1] / cluster.hbm_bandwidth
    tensor_comm = num_micro * tensor_comm_s(model, tensor, micro, cluster)
    # FSDP reduces the gradients onto their shards: a reduce-scatter, half the all-reduce
    grads = data_comm_s(model, mesh, cluster, grad_bytes) / (2 if model.fsdp else 1)
    data_comm = (1 - cluster.dp_overlap) * grads + gather_params_s(model, mesh, cluster)
    return compute, tensor_comm, data_comm, compute + tensor_comm + data_comm, micro


def _tensor_parts(model: Decoder, tensor: int, micro_batch: int, cluster: Cluster) -> tuple[float, float]:
    """(one layer's tensor-parallel time, the ends': the embedding's and output layer's all-reduces and the loss's)
    for one micro-batch, from ``tensor_comm_s``."""
    ends = tensor_comm_s(dataclasses.replace(model, layers=0), tensor, micro_batch, cluster)
    return (tensor_comm_s(model, tensor, micro_batch, cluster) - ends) / model.layers, ends


def _pipeline_step(model, mesh, global_batch, cluster, micro_batch, grad_bytes, pipeline: Pipeline):
    """(compute, tensor-parallel, exposed data-parallel, pipe, step, rows) with pipeline stages (module docstring)."""
    data, tensor = mesh
    p, m, v = pipeline.stages, pipeline.microbatches, pipeline.repeats
    rows, num_micro = _rows(mesh, global_batch, micro_batch)
    if rows % m:
        raise ValueError(f"{m} pipeline microbatches do not divide the {rows} sequences of a layer-stack batch")
    if model.layers % (p * v):
        raise ValueError(f"{p} stages x {v} repeats do not divide the {model.layers} layers")
    micro, chunk, ticks = rows // m, model.layers // (p * v), pipeline.ticks()
    extra = 0.0  # per layer, beyond the timed policy's recomputation
    if not pipeline.megatron and (v > 1 or model.remat == "save_dots"):
        # in the vmapped stage every dot is batched, so save_dots recomputes what full does; the circular schedule
        # recomputes each chunk from its input whatever the policy, and under selective the attention core again
        if v > 1 and model.remat == "selective":
            extra = layer_s(model, tensor, micro, cluster) - layer_s(dataclasses.replace(model, remat="none"),
                                                                     tensor, micro, cluster)
        model = dataclasses.replace(model, remat="full")
    inter = crosses_nodes(p, data, tensor, cluster.gpus_per_node)
    link = (cluster.inter_bandwidth, cluster.inter_latency) if inter else (cluster.intra_bandwidth,
                                                                           cluster.intra_latency)
    tensor_layer, tensor_ends = _tensor_parts(model, tensor, micro, cluster)
    message = micro * model.seq * model.hidden * HALF / (tensor if model.sequence else 1)  # SP: 1/t of the positions
    hop = 2 * p2p_s(message, tensor, pipeline, inter, cluster)  # forward, backward
    if pipeline.megatron:  # the last stage's head after each microbatch: the slowest stage sets the pace
        ends, ends_comm, ends_moves = m * head_s(model, tensor, micro, cluster), m * tensor_ends, 0.0
    else:  # every stage runs the ends on the whole batch; stage 0's outputs reach every stage, their gradient back
        ends = head_s(model, tensor, rows, cluster)
        ends_comm = _tensor_parts(model, tensor, rows, cluster)[1]
        ends_moves = ring_allreduce_s(rows * model.seq * model.hidden * HALF, p, *link)
    part = stage(model, pipeline)
    compute = num_micro * (ticks * chunk * (layer_s(model, tensor, micro, cluster) + extra) + ends)
    compute += OPTIMIZER_BYTES_PER_PARAM * part.params(tensor)[1] / cluster.hbm_bandwidth
    tensor_comm = num_micro * (ticks * chunk * tensor_layer + ends_comm)
    pipe_comm = num_micro * (ticks * hop + ends_moves)
    if pipeline.megatron and model.tied:  # the tied embedding's gradient summed over the first and last stage
        pipe_comm += ring_allreduce_s(grad_bytes * model.vocab * model.hidden / tensor, 2, *link)
    grads = data_comm_s(part, mesh, cluster, grad_bytes) / (2 if model.fsdp else 1)
    data_comm = (1 - cluster.dp_overlap) * grads + gather_params_s(part, mesh, cluster)
    return compute, tensor_comm, data_comm, pipe_comm, compute + tensor_comm + data_comm + pipe_comm, rows


def predict(model: Decoder, mesh: tuple[int, int], global_batch: int, cluster: Cluster, micro_batch: int | None = None,
            grad_bytes: int = 4, baseline_tflops: float | None = None, memory: bool = True,
            pipeline: Pipeline | None = None) -> Prediction:
    """The predicted step of ``model`` on a (data, model) ``mesh`` (times ``pipeline.stages``) with ``global_batch``
    sequences per step.

    ``micro_batch``: sequences per data shard per accumulation step (None: the whole shard at once); with stages,
    each is the layer stack's batch, cut into ``pipeline.microbatches``.
    ``grad_bytes``: bytes per gradient element all-reduced over ``data`` (megajax: 4; Megatron-LM 2019: 2).
    ``baseline_tflops``: the efficiency's reference (default: this model on 1 GPU with one shard's batch).
    ``memory=False`` skips the memory estimate (it builds a config): memory_bytes 0, fits True."""
    data, tensor = mesh
    pipeline = pipeline or Pipeline()
    if pipeline.stages == 1:
        compute, tensor_comm, data_comm, step, micro = _step(model, mesh, global_batch, cluster, micro_batch,
                                                             grad_bytes)
        pipe_comm = 0.0
    else:
        compute, tensor_comm, data_comm, pipe_comm, step, micro = _pipeline_step(
            model, mesh, global_batch, cluster, micro_batch, grad_bytes, pipeline)
    flops = model.flops(global_batch)
    tflops = flops / step / (pipeline.stages * data * tensor) / 1e12
    if baseline_tflops is None:
        base = _step(model, (1, 1), global_batch // data, cluster, micro_batch, grad_bytes)[3]
        baseline_tflops = flops / data / base / 1e12
    need = memory_bytes(model, tensor, micro, data, pipeline) if memory else 0
    return Prediction(model=model, mesh=mesh, global_batch=global_batch, micro_batch=micro,
                      num_micro=global_batch // data // micro, compute_s=compute, tensor_comm_s=tensor_comm,
                      data_comm_s=data_comm, step_s=step, tflops_per_gpu=tflops,
                      mfu=tflops * 1e12 / cluster.peak_flops, efficiency=tflops / baseline_tflops,
                      memory_bytes=need, fits=need <= cluster.hbm_bytes, pipeline=pipeline, pipe_comm_s=pipe_comm)
