"""The clusters the scaling model (``megajax.tools.scaling``) knows: each GPU's peak, memory and links, the
software it runs (whose element-wise passes each ``LayerKind`` states), and the model's calibration constants, with
where each number comes from and what was fitted to which published measurements (``scaling_papers.py`` holds those
and the errors); and what the primitives cost on them: a GEMM at the roofline, a ring all-reduce, an all-to-all.
"""

from __future__ import annotations

import dataclasses
import math
import os

from megajax.models.spec import EAGER, FUSED

GiB = 1024**3
HALF = 2  # bytes per activation value: fp16 / bf16 training


@dataclasses.dataclass(frozen=True)
class Cluster:
    """A GPU cluster: per-GPU peak and memory, the node's links, and the model's calibration constants (and
    the software its element-wise work runs under, whose passes each layer kind states: ``models.spec.EAGER``,
    Megatron-LM 2019's kernels, unless given).

    Bandwidths are per GPU and per direction (what a ring's every step moves); latencies are per ring step."""

    name: str
    peak_flops: float  # dense, at the training dtype (bf16 / fp16); MFU is read against it at every precision
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
    tp_overlap: float = 0.0  # fraction of the tensor-parallel all-reduces hidden behind the layers' GEMMs
    software: str = EAGER  # the layers' element-wise passes as counted for it (``LayerKind.elementwise``)
    # megajax's step on these GPUs runs cuDNN's flash attention where the model allows it (H100: the memory planner's
    # ``gpu=True``, no s x s scores kept); the papers' V100 and A100 runs had none
    flash_attention: bool = False
    # dense FP8 tensor-core peak (0: the GPU has none); ``train.precision=fp8``'s block GEMMs run at it, assumed to
    # sustain the same fraction (``gemm_efficiency``) as BF16's: no FP8 run was fitted
    fp8_peak_flops: float = 0.0


# The paper's Section 5: DGX-2H, 16 V100 SXM3 32GB per node; 39 TFLOP/s = 30% of peak gives 130 TFLOP/s fp16
# (the DGX-2H's 450 W parts; 125 is the 300 W V100's). "300 GB/sec between GPUs ... via NVSwitch" counts both
# directions (6 NVLink2 links x 25 GB/s each way); "100 GB/sec ... using 8 InfiniBand adapters per server" is
# 8 x 100 Gb/s EDR one way, shared by 16 GPUs.
DGX2H_V100 = Cluster(name="dgx2h", peak_flops=130e12, hbm_bytes=32 * GiB, hbm_bandwidth=900e9, gpus_per_node=16,
                     intra_bandwidth=150e9, intra_latency=2e-6, inter_bandwidth=100e9 / 16, inter_latency=5e-6,
                     gemm_efficiency=0.88, layer_overhead_s=6e-3, dp_overlap=0.3)
# DGX H100: 8 H100 SXM 80GB, 989 TFLOP/s bf16 dense, NVLink4 900 GB/s both ways, 8 x 400 Gb/s NDR (one per GPU).
# Fused element-wise kernels (XLA's fusions; Megatron-LM's Transformer Engine). gemm_efficiency, layer_overhead_s,
# dp_overlap and tp_overlap FITTED to eleven published BF16 H100 runs (``scaling_h100.H100_ROWS``: Megatron-LM's
# weak-scaling table, MaxText's Llama 2 7B on one host, torchtitan's Llama 3.1 8B on 8 GPUs; least squares in points
# of peak, bench/h100_fit.py): every row within 2.2 points, rms 1.4. Assumed before (0.75, 0.6 ms, 0.3, no TP
# overlap, eager passes): +2.0 to -9.9 points. Every row runs 4,096 to 16,384 tokens per micro-batch, so the fixed
# 2.36 ms per layer and micro-batch stands for whatever those rows spend per layer beyond the counted work; below
# that size it is an extrapolation that weighs on small micro-batches (1,024 tokens: more than the layer's GEMMs).
DGX_H100 = Cluster(name="dgx_h100", peak_flops=989e12, hbm_bytes=80 * GiB, hbm_bandwidth=3.35e12, gpus_per_node=8,
                   intra_bandwidth=450e9, intra_latency=2e-6, inter_bandwidth=50e9, inter_latency=5e-6,
                   gemm_efficiency=0.816, layer_overhead_s=2.36e-3, dp_overlap=0.90, tp_overlap=0.76,
                   software=FUSED, flash_attention=True, fp8_peak_flops=1979e12)
# DeepSeek-V3's cluster (DeepSeek-AI 2024, sections 3.1 and 3.2.2): 2,048 H800 SXM, 8 a node through NVLink and
# NVSwitch, InfiniBand across nodes; the report gives NVLink 160 GB/s and IB 50 GB/s per GPU. The H800's compute and
# HBM are the H100 SXM's (989 / 1,979 TFLOP/s bf16 / FP8 dense, 80 GB at 3.35 TB/s), so the fitted dgx_h100
# constants are kept: ASSUMED, no published H800 BF16 run to fit them on.
H800 = dataclasses.replace(DGX_H100, name="h800", intra_bandwidth=160e9, inter_bandwidth=50e9)
# PTD-P's cluster (Narayanan et al. 2021): DGX A100 80GB nodes: 312 TFLOP/s fp16 / bf16 dense, HBM2e 2.04 TB/s,
# NVLink3 through NVSwitch 600 GB/s per GPU both directions (300 each way), 8 x 200 Gb/s HDR InfiniBand per node
# (one per GPU: 25 GB/s each way); Megatron-LM 2021's fused kernels (``models.spec.FUSED``). gemm_efficiency and
# layer_overhead_s FITTED to PTD-P Table 1's odd rows, 1.7B, 7.5B, 39.1B, 145.6B and 529.6B (least squares in points
# of peak, bench/ptdp_fit.py; the other five rows are held out: scaling_papers.py). dp_overlap 0, not fitted:
# Megatron-LM 2021 all-reduces the gradients after the backward pass (at most 4% of a row's step: 7.5B's).
DGX_A100 = Cluster(name="dgx_a100", peak_flops=312e12, hbm_bytes=80 * GiB, hbm_bandwidth=2.039e12, gpus_per_node=8,
                   intra_bandwidth=300e9, intra_latency=2e-6, inter_bandwidth=25e9, inter_latency=5e-6,
                   gemm_efficiency=0.685, layer_overhead_s=3.95e-3, dp_overlap=0.0, software=FUSED)
CLUSTERS = {"dgx2h": DGX2H_V100, "dgx_h100": DGX_H100, "dgx_a100": DGX_A100, "h800": H800}

# What JAX's GPU allocator takes of each GPU's memory unless XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise (JAX's
# default): all a megajax step can use. It also keeps a plan under XLA:GPU's own budget, 80% of the memory less the
# step's inputs, past which XLA rematerialises on its own (gpt_2p5b in fp32 planned at 73.7 GiB on 8 H100s compiled
# to 65.0: XLA's recomputation, which the scaling model does not time; at 56.5 planned, 56.8 compiled).
JAX_MEMORY_FRACTION = 0.75
MEMORY_FRACTION_VARIABLE = "XLA_PYTHON_CLIENT_MEM_FRACTION"


def jax_memory(cluster: Cluster) -> Cluster:
    """``cluster`` with the memory a JAX process has on each of its GPUs: the allocator's fraction of the HBM
    (``MEMORY_FRACTION_VARIABLE`` where set, else ``JAX_MEMORY_FRACTION``), what megajax's plans must fit. The
    published runs the clusters are fitted and checked on (PyTorch's) are held against the whole HBM."""
    text = os.environ.get(MEMORY_FRACTION_VARIABLE, "")
    try:
        fraction = float(text) if text else JAX_MEMORY_FRACTION
    except ValueError:
        fraction = JAX_MEMORY_FRACTION  # JAX itself refuses it when it starts on a GPU
    return dataclasses.replace(cluster, hbm_bytes=int(cluster.hbm_bytes * min(max(fraction, 0.0), 1.0)))


def gemm_s(batch: float, m: float, k: float, n: float, cluster: Cluster, fp8: bool = False) -> float:
    """A (batched) half-precision GEMM at the roofline: compute- or HBM-bound, whichever is slower. ``fp8``: its
    operands FP8 (one byte each) at the FP8 peak, its result half precision."""
    peak = cluster.fp8_peak_flops if fp8 else cluster.peak_flops
    compute = 2 * batch * m * k * n / (peak * cluster.gemm_efficiency)
    memory = batch * ((1 if fp8 else HALF) * (m * k + k * n) + HALF * m * n) / cluster.hbm_bandwidth
    return max(compute, memory)


# HBM bytes per value that FP8's current scaling moves besides the GEMM: an activation or output gradient (bf16)
# is read for its amax, then read and written as FP8 (2 + 2 + 1); a weight (the fp32 master) likewise (4 + 4 + 1)
FP8_ACTIVATION_BYTES, FP8_WEIGHT_BYTES = 5, 9


def fp8_scaling_s(m: float, k: float, n: float, cluster: Cluster, forwards: int = 1) -> float:
    """The amax and cast passes of one (m, k) x (k, n) FP8 GEMM's operands at HBM bandwidth: its input and kernel
    ``forwards`` times (a recomputed forward quantises them again), its output gradient once."""
    forward = FP8_ACTIVATION_BYTES * m * k + FP8_WEIGHT_BYTES * k * n
    return (forwards * forward + FP8_ACTIVATION_BYTES * m * n) / cluster.hbm_bandwidth


def ring_allreduce_s(nbytes: float, n: int, bandwidth: float, latency: float) -> float:
    """A ring all-reduce of ``nbytes`` over ``n`` GPUs: reduce-scatter + all-gather, 2 (n-1) steps each moving
    ``nbytes / n`` on every link."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / bandwidth + 2 * (n - 1) * latency


def group_allreduce_s(nbytes: float, n: int, stride: int, cluster: Cluster) -> float:
    """An all-reduce of ``nbytes`` per GPU over ``n`` GPUs ``stride`` apart on the mesh (the data-parallel group:
    stride the model-parallel degree), hierarchical: a ring among the group's members in a node, then a ring across
    nodes of 1/members of it per GPU (all of a node's GPUs reduce at once, each on its share of the node's
    InfiniBand), then the all-gather back within the node."""
    members = max(1, min(n, cluster.gpus_per_node // stride))  # the group's GPUs on one node
    nodes = math.ceil(n / members)
    within = ring_allreduce_s(nbytes, members, cluster.intra_bandwidth, cluster.intra_latency)
    across = ring_allreduce_s(nbytes / members, nodes, cluster.inter_bandwidth, cluster.inter_latency)
    return within + across


def all_to_all_s(nbytes: float, n: int, stride: int, cluster: Cluster, count: int = 1) -> float:
    """``count`` all-to-alls moving ``nbytes`` per GPU in all (each GPU's buffers, a block of 1/n of each for every
    GPU) over ``n`` GPUs ``stride`` apart on the mesh: the blocks for the group's GPUs in the same node over NVLink,
    the others over the GPU's InfiniBand at once (the slower sets the time); n - 1 pairwise steps of latency
    each."""
    if n <= 1:
        return 0.0
    near = max(1, min(n, cluster.gpus_per_node // stride))  # the group's GPUs on one node, this one included
    intra = (near - 1) / n * nbytes / cluster.intra_bandwidth
    inter = (n - near) / n * nbytes / cluster.inter_bandwidth
    latency = cluster.inter_latency if n > near else cluster.intra_latency
    return max(intra, inter) + count * (n - 1) * latency
