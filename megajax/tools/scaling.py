"""Predicts a decoder language model's step time on a described cluster from its FLOPs, memory traffic and
communication.

    python -m megajax.scaling --config=gpt_8p3b --gpus=512 --cluster=dgx2h [--global_batch=512]

prints every (data, model) mesh of the GPUs with its predicted step time, model TFLOP/s per GPU, MFU and memory,
and recommends the fastest one that fits, choosing per mesh the remat policy, sequence parallelism and how much
state to split over data: none, ZeRO-1 or FSDP (``--keep_choices``: the config's). Per GPU, with t-way model and
d-way data parallelism:

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

Tests pin ``transformer_flops`` and ``comm_budget.minimum`` equal to the compiled HLO's (ratio 1.00): the counted
work is megajax's; what this module adds is how long it takes.

Counted, not fitted (Megatron-LM 2019's eager PyTorch step; a pass reads or writes the tensor once): b*s*h work
duplicated on every model-parallel GPU (two LayerNorms, bias + dropout + residual twice) 20 passes forward, 40
backward; b*s*h/t split work (head transposes, GeLU) 16 and 32; the b*(a/t)*s*s attention scores (scale, mask,
softmax, dropout) 10 and 20; 40 bytes per local logit (fp32 cross-entropy); 32 bytes per local parameter (AdamW).

Fitted to the paper (``PAPER_PUBLISHED``; ``bench/scaling_plot.py`` prints each figure beside its prediction),
three constants of ``DGX2H_V100``: ``gemm_efficiency`` 0.88 (a large fp16 GEMM on a V100; sets the 1-GPU baseline,
39 TFLOP/s = 30% of peak, read as transformer_flops / step); ``layer_overhead_s`` 6 ms per layer and micro-batch
that does not shrink with t (the launches and tails of ~300 eager kernels: Table 8's strong scaling);
``dp_overlap`` 0.3 (Figure 5's model + data curve; the paper all-reduced fp16 gradients: ``grad_bytes=2``).
Every published figure is predicted within 8 percentage points (speedups within 3%). The worst are Figure 5's
128 GPUs (+7.7: its 12-point drop from data parallelism is 3x the other sizes' and exceeds even an unoverlapped
all-reduce) and 512 GPUs (-7.6): one overlap fraction splits the difference.

Beyond the paper: sequence parallelism splits the replicated element-wise work and the LayerNorm / dropout /
residual activations by t (its reduce-scatter / all-gather pairs send the all-reduces' bytes); ZeRO-1 splits the
moments over ``data`` (8 + 8/d bytes per local parameter) and adds an all-gather of the updated fp32 parameters
(half a ring all-reduce, not overlapped); FSDP splits all 16 bytes (16/d), reduce-scatters the gradients (half the
all-reduce, overlapped as it) and all-gathers each layer's fp32 parameters twice, forward and backward (not
overlapped, so the planner turns it on only where less does not fit). None is calibrated: the paper has none.

Ignored: pipeline parallelism (``mesh.pipe``: a config that sets it is refused), tensor-parallel communication
overlapped with compute, NCCL's protocols and topology beyond a ring, kernel efficiency beyond the calibration (the 2019
constants describe eager PyTorch; a fused XLA step moves fewer bytes and launches fewer kernels), stragglers,
data loading and memory fragmentation. ``DGX_H100``'s calibration is assumed, not fitted: the paper has no H100.
"""

from __future__ import annotations

import dataclasses
import math

from megajax.cli import ArgumentParser, load_config
from megajax.config import ConfigError, base_config, model_config, sequence_parallel, state_split
from megajax.models import gpt, model_spec
from megajax.models.spec import decoder_flops
from megajax.tools.comm_budget import Shape, minimum
from megajax.tools.memory_planner import activation_bytes

GiB = 1024**3
HALF = 2  # bytes per activation value: fp16 / bf16 training
STATE_BYTES_PER_PARAM = 16  # fp32 parameters, gradients and AdamW's two moments (megajax.info)
# Memory passes per layer and micro-batch: (forward, backward); recomputation repeats the forward (docstring).
REPLICATED_PASSES = (20, 40)  # b*s*h, on every model-parallel GPU
SPLIT_PASSES = (16, 32)  # b*s*h/t
SCORE_PASSES = (10, 20)  # b*(a/t)*s*s
LOGIT_BYTES = 40  # per local logit, fp32 cross-entropy forward + backward
OPTIMIZER_BYTES_PER_PARAM = 32  # AdamW's step: fp32 master, m, v read and written, half grads and params


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A GPU cluster: per-GPU peak and memory, the node's links, and the model's three calibration constants.

    Bandwidths are per GPU and per direction (what a ring's every step moves); latencies are per ring step."""

    name: str
    peak_flops: float  # dense, at the training dtype
    hbm_bytes: int
    hbm_bandwidth: float
    gpus_per_node: int
    intra_bandwidth: float  # NVLink / NVSwitch
    intra_latency: float
    inter_bandwidth: float  # the GPU's share of the node's InfiniBand
    inter_latency: float
    gemm_efficiency: float  # fraction of peak a large GEMM sustains
    layer_overhead_s: float  # per layer per micro-batch, independent of size and t
    dp_overlap: float  # fraction of the data-parallel all-reduce hidden behind the backward pass


# The paper's Section 5: DGX-2H, 16 V100 SXM3 32GB per node; 39 TFLOP/s = 30% of peak gives 130 TFLOP/s fp16
# (the DGX-2H's 450 W parts; 125 is the 300 W V100's). "300 GB/sec between GPUs ... via NVSwitch" counts both
# directions (6 NVLink2 links x 25 GB/s each way); "100 GB/sec ... using 8 InfiniBand adapters per server" is
# 8 x 100 Gb/s EDR one way, shared by 16 GPUs.
DGX2H_V100 = Cluster(name="dgx2h", peak_flops=130e12, hbm_bytes=32 * GiB, hbm_bandwidth=900e9, gpus_per_node=16,
                     intra_bandwidth=150e9, intra_latency=2e-6, inter_bandwidth=100e9 / 16, inter_latency=5e-6,
                     gemm_efficiency=0.88, layer_overhead_s=6e-3, dp_overlap=0.3)
# DGX H100: 8 H100 SXM 80GB, 989 TFLOP/s bf16 dense, NVLink4 900 GB/s both ways, 8 x 400 Gb/s NDR (one per GPU).
# Calibration assumed (no published measurement): GEMMs at 75% of peak, a tenth of the eager per-layer overhead
# (XLA fuses and launches less), the paper's overlap.
DGX_H100 = Cluster(name="dgx_h100", peak_flops=989e12, hbm_bytes=80 * GiB, hbm_bandwidth=3.35e12, gpus_per_node=8,
                   intra_bandwidth=450e9, intra_latency=2e-6, inter_bandwidth=50e9, inter_latency=5e-6,
                   gemm_efficiency=0.75, layer_overhead_s=0.6e-3, dp_overlap=0.3)
CLUSTERS = {"dgx2h": DGX2H_V100, "dgx_h100": DGX_H100}


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
                   sequence_parallel(config), *state_split(config), kv_heads=cfg.num_kv_heads, ffn=cfg.ffn_hidden_size,
                   gated=spec.gated_mlp, biases=spec.biases, positions=bool(spec.sequence_rows),
                   tied=cfg.tie_embeddings, name=spec.name, dropout=m.dropout)

    @property
    def kv_width(self) -> int:
        """The key and value projections' output columns, 2 x kv_heads x head_dim (2 hidden without GQA)."""
        return 2 * (self.kv_heads or self.heads) * (self.hidden // self.heads)

    @property
    def mlp(self) -> int:
        """The MLP's hidden width."""
        return self.ffn or 4 * self.hidden

    def kv_replicated(self, tensor: int) -> bool:
        """Whether ``tensor`` model shards each hold a copy of one key/value head (more shards than heads)."""
        return (self.kv_heads or self.heads) % tensor != 0

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
        kv = self.kv_heads or self.heads
        return all(n % tensor == 0 for n in (self.heads, self.hidden, self.mlp, self.vocab)) and \
            (kv % tensor == 0 or tensor % kv == 0)


@dataclasses.dataclass(frozen=True)
class Prediction:
    """One mesh's predicted step (seconds per step; memory per GPU)."""

    model: Decoder  # with the remat / sequence / shard_optimizer choices this prediction is for
    mesh: tuple[int, int]  # (data, model)
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
    """One GPU's compute time for one micro-batch, forward + backward (+ recomputation), without communication."""
    dense, attention, logits = gemms(model, tensor, micro_batch)
    dots, elementwise, core = RECOMPUTED[model.remat]
    layer = (3 + dots) * sum(_gemm_s(*g, cluster) for g in dense)
    layer += (3 + core) * sum(_gemm_s(*g, cluster) for g in attention)
    tokens = micro_batch * model.seq
    replicated = tokens * model.hidden / (tensor if model.sequence else 1)  # SP: each GPU's positions only
    sizes = (replicated, tokens * model.hidden / tensor, micro_batch * model.heads / tensor * model.seq**2)
    repeats = (elementwise, elementwise, core)
    passes = sum(n * ((1 + r) * fwd + bwd) for n, r, (fwd, bwd) in
                 zip(sizes, repeats, (REPLICATED_PASSES, SPLIT_PASSES, SCORE_PASSES)))
    layer += HALF * passes / cluster.hbm_bandwidth + cluster.layer_overhead_s
    head = 3 * _gemm_s(*logits, cluster) + LOGIT_BYTES * tokens * model.vocab / tensor / cluster.hbm_bandwidth
    return model.layers * layer + head


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


def memory_bytes(model: Decoder, tensor: int, micro_batch: int, data: int = 1) -> int:
    """Per-GPU training memory as ``megajax.info``'s total: ``state_bytes`` plus the memory planner's activations
    (``memory_planner.activation_bytes``, half precision) for one micro-batch. Not counted: FSDP's one gathered
    layer at a time."""
    config = base_config()
    config.model.update(name=model.name, hidden_size=model.hidden, num_layers=model.layers, num_heads=model.heads,
                        max_seq_len=model.seq, vocab_size=model.vocab, make_vocab_size_divisible_by=1,
                        remat=model.remat, num_kv_heads=model.kv_heads, ffn_hidden_size=model.ffn,
                        dropout=model.dropout)
    config.parallel.sequence = model.sequence
    return state_bytes(model, tensor, data) + activation_bytes(config, micro_batch, tensor, HALF)


def gather_params_s(model: Decoder, mesh: tuple[int, int], cluster: Cluster) -> float:
    """The all-gathers of fp32 parameter shards over ``data`` (each half a ring all-reduce), hierarchical as
    ``data_comm_s``, not overlapped: ZeRO-1's one of the updated parameters; FSDP's two, each layer's when the
    forward pass reaches it and again in the backward pass. 0 with neither."""
    if mesh[0] == 1 or not model.shard_optimizer:
        return 0.0
    return (2 if model.fsdp else 1) * _over_data_s(4 * model.params(mesh[1])[1], mesh, cluster) / 2


def _step(model, mesh, global_batch, cluster, micro_batch, grad_bytes) -> tuple[float, float, float, float, int]:
    data, tensor = mesh
    if global_batch % data:
        raise ValueError(f"global batch {global_batch} is not divisible by data={data}")
    per_replica = global_batch // data
    micro = micro_batch or per_replica
    if per_replica % micro:
        raise ValueError(f"micro-batch {micro} does not divide the {per_replica} sequences per data shard")
    num_micro = per_replica // micro
    compute = num_micro * compute_s(model, tensor, micro, cluster)
    compute += OPTIMIZER_BYTES_PER_PARAM * model.params(tensor)[1] / cluster.hbm_bandwidth
    tensor_comm = num_micro * tensor_comm_s(model, tensor, micro, cluster)
    # FSDP reduces the gradients onto their shards: a reduce-scatter, half the all-reduce
    grads = data_comm_s(model, mesh, cluster, grad_bytes) / (2 if model.fsdp else 1)
    data_comm = (1 - cluster.dp_overlap) * grads + gather_params_s(model, mesh, cluster)
    return compute, tensor_comm, data_comm, compute + tensor_comm + data_comm, micro


def predict(model: Decoder, mesh: tuple[int, int], global_batch: int, cluster: Cluster, micro_batch: int | None = None,
            grad_bytes: int = 4, baseline_tflops: float | None = None, memory: bool = True) -> Prediction:
    """The predicted step of ``model`` on a (data, model) ``mesh`` with ``global_batch`` sequences per step.

    ``micro_batch``: sequences per data shard per accumulation step (None: the whole shard at once).
    ``grad_bytes``: bytes per gradient element all-reduced over ``data`` (megajax: 4; Megatron-LM 2019: 2).
    ``baseline_tflops``: the efficiency's reference (default: this model on 1 GPU with one shard's batch).
    ``memory=False`` skips the memory estimate (it builds the abstract model): memory_bytes 0, fits True."""
    data, tensor = mesh
    compute, tensor_comm, data_comm, step, micro = _step(model, mesh, global_batch, cluster, micro_batch,
                                                         grad_bytes)
    flops = model.flops(global_batch)
    tflops = flops / step / (data * tensor) / 1e12
    if baseline_tflops is None:
        base = _step(model, (1, 1), global_batch // data, cluster, micro_batch, grad_bytes)[3]
        baseline_tflops = flops / data / base / 1e12
    need = memory_bytes(model, tensor, micro, data) if memory else 0
    return Prediction(model=model, mesh=mesh, global_batch=global_batch, micro_batch=micro,
                      num_micro=global_batch // data // micro, compute_s=compute, tensor_comm_s=tensor_comm,
                      data_comm_s=data_comm, step_s=step, tflops_per_gpu=tflops,
                      mfu=tflops * 1e12 / cluster.peak_flops, efficiency=tflops / baseline_tflops,
                      memory_bytes=need, fits=need <= cluster.hbm_bytes)


def candidate_meshes(model: Decoder, num_gpus: int, cluster: Cluster, global_batch: int,
                     micro_batch: int | None = None) -> list[tuple[int, int]]:
    """(data, model) factorizations of ``num_gpus`` with model parallelism within a node, whole heads and equal
    hidden / MLP / vocabulary slices per shard, and the batch split evenly over ``data`` (and micro-batches)."""
    out = []
    for tensor in range(1, min(num_gpus, cluster.gpus_per_node) + 1):
        data = num_gpus // tensor
        if num_gpus % tensor or not model.divisible_by(tensor) or global_batch % data:
            continue
        if micro_batch and (global_batch // data) % micro_batch:
            continue
        out.append((data, tensor))
    return out


REMAT_CHOICES = ("none", "selective", "save_dots", "full")  # least recomputation first


SPLIT_CHOICES = ((False, False), (True, False), (True, True))  # (shard_optimizer, fsdp): none, ZeRO-1, FSDP


def variants(model: Decoder, mesh: tuple[int, int], choose: bool) -> list[Decoder]:
    """The model as given, or (``choose``) every remat policy x sequence parallelism (model-parallel meshes whose
    t divides the sequence) x the state split over data (none, ZeRO-1, FSDP: data-parallel meshes) that could run
    on ``mesh``."""
    if not choose:
        return [model]
    data, tensor = mesh
    return [dataclasses.replace(model, remat=r, sequence=sp, shard_optimizer=z, fsdp=f) for r in REMAT_CHOICES
            for sp in ((False, True) if tensor > 1 and model.seq % tensor == 0 else (False,))
            for z, f in (SPLIT_CHOICES if data > 1 else SPLIT_CHOICES[:1])]


def recommend_mesh(model: Decoder, num_gpus: int, cluster: Cluster, global_batch: int, micro_batch: int | None = None,
                   grad_bytes: int = 4, choose: bool = False) -> tuple[Prediction | None, list[Prediction]]:
    """(the fastest mesh that fits in HBM or None, one prediction per candidate mesh, fastest first).

    Meshes that do not divide the model or the batch are not candidates; those over HBM are listed, never
    recommended. ``choose``: besides the mesh, pick the remat policy, sequence parallelism and ZeRO-1 / FSDP (each
    mesh's row is its fastest choice that fits, else its least memory); otherwise the model's own are kept."""
    table = []
    for mesh in candidate_meshes(model, num_gpus, cluster, global_batch, micro_batch):
        options = [predict(m, mesh, global_batch, cluster, micro_batch, grad_bytes)
                   for m in variants(model, mesh, choose)]
        fitting = [p for p in options if p.fits]
        table.append(min(fitting, key=lambda p: p.step_s) if fitting else min(options, key=lambda p: p.memory_bytes))
    table.sort(key=lambda p: p.step_s)
    return next((p for p in table if p.fits), None), table


# The paper's scaling experiments (Section 5.1 and Appendix D): Table 1's models (96 per head), seq 1024, the
# vocabulary padded to 51,200, checkpointing every layer, and fp16 gradients all-reduced (Megatron-LM 2019).
PAPER_MODELS = {"1.2B": Decoder(1536, 40, 16), "2.5B": Decoder(1920, 54, 20), "4.2B": Decoder(2304, 64, 24),
                "8.3B": Decoder(3072, 72, 32)}
PAPER_PUBLISHED = {
    "baseline TFLOP/s": {1: 39.0},  # Section 5.1.1: 1.2B on one GPU, 30% of peak
    "figure 5 model": {1: 100, 2: 95, 4: 82, 8: 77},  # weak scaling %, batch 8, Table 1's model per GPU count
    "figure 5 model+data": {64: 96, 128: 83, 256: 79, 512: 74},  # the same x 64-way data, global batch 512
    "table 7": {16: 82, 24: 80, 32: 77},  # 8.3B at 8-way, by attention heads
    "table 8": {1: 1.0, 2: 1.64, 4: 2.34, 8: 2.98},  # 1.2B, batch 8, speedup by model-parallel GPUs
    "abstract": {512: 76},  # 15.1 PFLOP/s on 512 GPUs: Table 2's 8.3B (24 heads) on 64 x 8, global batch 512
}


def paper_predictions(cluster: Cluster = DGX2H_V100) -> dict[str, dict[int, float]]:
    """The model's values for ``PAPER_PUBLISHED``'s keys (efficiencies in %, relative to the 1.2B 1-GPU run)."""
    def run(model: Decoder, mesh: tuple[int, int], batch: int) -> Prediction:
        return predict(model, mesh, batch, cluster, grad_bytes=2, baseline_tflops=1.0, memory=False)

    base = run(PAPER_MODELS["1.2B"], (1, 1), 8)
    weak = lambda p: 100 * p.tflops_per_gpu / base.tflops_per_gpu  # noqa: E731
    sizes = dict(zip((1, 2, 4, 8), PAPER_MODELS.values()))
    return {
        "baseline TFLOP/s": {1: base.tflops_per_gpu},
        "figure 5 model": {t: weak(run(m, (1, t), 8)) for t, m in sizes.items()},
        "figure 5 model+data": {64 * t: weak(run(m, (64, t), 512)) for t, m in sizes.items()},
        "table 7": {a: weak(run(dataclasses.replace(PAPER_MODELS["8.3B"], heads=a), (1, 8), 8)) for a in (16, 24, 32)},
        "table 8": {t: base.step_s / run(PAPER_MODELS["1.2B"], (1, t), 8).step_s for t in (1, 2, 4, 8)},
        "abstract": {512: weak(run(dataclasses.replace(PAPER_MODELS["8.3B"], heads=24), (64, 8), 512))},
    }


def format_table(table: list[Prediction], best: Prediction | None) -> str:
    """The CLI's table of meshes and its recommendation."""
    lines = [f"{'mesh':>8} {'micro':>5} {'remat':>9} {'SP':>3} {'ZeRO':>4} {'step s':>8} {'compute':>8} "
             f"{'TP comm':>8} {'DP comm':>8} {'TFLOP/s':>8} {'MFU':>6} {'vs 1GPU':>7} {'GiB/GPU':>8} fits"]
    yes = lambda b: "yes" if b else "-"  # noqa: E731
    zero = lambda m: "3" if m.fsdp else "1" if m.shard_optimizer else "-"  # noqa: E731
    for p in table:
        m = p.model
        lines.append(f"{p.mesh[0]:>4}x{p.mesh[1]:<3} {p.micro_batch:>5} {m.remat:>9} {yes(m.sequence):>3} "
                     f"{zero(m):>4} {p.step_s:8.3f} {p.compute_s:8.3f} "
                     f"{p.tensor_comm_s:8.3f} {p.data_comm_s:8.3f} {p.tflops_per_gpu:8.1f} {p.mfu:6.1%} "
                     f"{p.efficiency:7.1%} {p.memory_bytes / GiB:8.1f} {'yes' if p.fits else 'NO'}")
    if best is None:
        lines.append("recommendation: none fits; add GPUs, shrink the micro-batch, or split the state over data "
                     "(parallel.shard_optimizer, parallel.fsdp)")
    else:
        lines.append(f"recommendation: data={best.mesh[0]} x model={best.mesh[1]}, remat={best.model.remat}, "
                     f"sequence parallelism {'on' if best.model.sequence else 'off'}, state split over data: "
                     f"{_split_name(best.model)}: {best.step_s:.3f} s/step, "
                     f"{best.tflops_per_gpu:.1f} TFLOP/s per GPU\n"
                     f"  --config.mesh.data={best.mesh[0]} --config.mesh.model={best.mesh[1]} {best.model.flags()}")
    return "\n".join(lines)


def _split_name(model: Decoder) -> str:
    return "FSDP" if model.fsdp else "ZeRO-1" if model.shard_optimizer else "none"


def main(argv: list[str] | None = None) -> None:
    p = ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="config file, path or bare name (gpt_8p3b)")
    p.add_argument("--gpus", type=int, required=True)
    p.add_argument("--cluster", default="dgx2h", choices=sorted(CLUSTERS))
    p.add_argument("--global_batch", type=int, default=None, help="default: the config's train.global_batch_size")
    p.add_argument("--micro_batch", type=int, default=None, help="default: the config's (0: the whole shard)")
    p.add_argument("--grad_bytes", type=int, default=4, help="bytes per all-reduced gradient (Megatron 2019: 2)")
    p.add_argument("--keep_choices", action="store_true", help="keep the config's remat, parallel.sequence, "
                   "parallel.shard_optimizer and parallel.fsdp instead of choosing them per mesh")
    args = p.parse_args(argv)
    config = load_config(args.config)
    if config.mesh.pipe > 1:
        raise ConfigError(f"{args.config} sets mesh.pipe={config.mesh.pipe}: the scaling model plans data x model "
                          "meshes and has no pipeline stages yet")
    if not model_spec(config.model.name).causal_lm:
        raise SystemExit(f"error: the scaling model covers causal language models (GPT configs); {args.config} is "
                         f"{config.model.name}")
    model, cluster = Decoder.from_config(config), CLUSTERS[args.cluster]
    batch = args.global_batch or config.train.global_batch_size
    micro = args.micro_batch if args.micro_batch is not None else config.train.micro_batch_size
    best, table = recommend_mesh(model, args.gpus, cluster, batch, micro or None, args.grad_bytes,
                                 choose=not args.keep_choices)
    if not table:
        raise SystemExit(f"error: no (data, model) mesh of {args.gpus} GPUs divides the heads and the batch")
    print(f"{args.config}: {model.params()[0]:,} parameters, {args.gpus} GPUs on {cluster.name}, global batch {batch}")
    print(format_table(table, best))
