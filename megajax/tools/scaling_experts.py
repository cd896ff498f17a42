"""The scaling model's expert dimension: what a mixture of experts' routed layers cost one GPU of a (data, expert,
model) mesh beyond the dense layer's work (``megajax.tools.scaling`` adds it to each layer and step).

A routed layer (``models/moe.py``) on e expert shards, t model shards, b sequences of s tokens per batch shard (the
batch is split over data x expert), k of E experts per token, n = b s k assignments per GPU:

* Expert GEMMs (``routed_gemms``): each GPU holds E/e experts; with balanced routing each expert takes n e / E rows
  (the assignments of the e shards of its group), and its three GEMMs (``layout``'s ``expert_gemms``: gate and up
  (h, F/t), down (F/t, h)) run at the roofline per expert: a grouped GEMM timed as E/e GEMMs, so an expert with few
  rows is bound by reading its weights. 3 times (forward, two backward) + once more under ``remat=full`` and
  ``save_dots`` (``jax.lax.ragged_dot`` is not a dot the policy saves). The router is a dense GEMM of the layer
  (``layout``'s ``gemms``). A capacity factor of 1 or more drops nothing under balanced routing, so capacity mode
  is timed as dropless. Under ``train.precision=fp8`` the grouped GEMM kernel's operands are FP8 (at the FP8 peak,
  with their amax and cast passes, as the dense GEMMs'; XLA's ``ragged_dot``, ``model.expert_gemm=xla``, stays
  bf16).
* Dispatch (the routed kind's ``LayerKind.dispatch_passes``, counted in ``models/moe.py`` for the blocks exchange,
  and kept for the ragged one over its receive buffer and grouped outputs): each GPU's buffers hold R rows, the
  blocks exchange's a block of m rows per shard of its group (``exchange_rows``: dropless m = n min(k, E / e) / k,
  room for every assignment a shard can send one destination; with a capacity what the destination's experts keep
  at most, n / e at a capacity factor of 1), R = e m, the ragged one's its receive room (``receive_rows``: e m, or
  with ``model.expert_room`` r, min(e m, r n)); its passes over the R x h buffers, the n x h assignments and the
  R x 2F/t gate and up outputs forward, backward twice, recomputation once more (as the dense layer's). At HBM
  bandwidth.
* All-to-all (``expert_comm_s``): on GPUs the exchange is ragged by default (``parallel/expert_exchange``): each
  GPU sends its n routed rows there and receives their outputs back, forward and backward (``remat=full`` the
  forward's again), and a few integers (counts and offsets, latency alone); with ``model.expert_exchange=blocks``,
  ``comm_minimum.minimum``'s ``expert all-to-all`` bytes (the e m x h blocks there and back, forward and backward,
  and their expert ids; ``remat=full`` the forward's again); where ``model.expert_room`` bounds the room, two more
  of integers a layer (``within_room``'s counts, latency alone). Each an all-to-all
  over the e GPUs of an expert group (t apart on the mesh: NVLink among those in a node, InfiniBand for the rest),
  not overlapped: the experts wait for their rows and the layer for their outputs. The routing statistics as ring
  all-reduces: 2E fp32 over data x expert per layer (again under ``remat=full``), and with t > 1 the top-k weights'
  gradient, n fp32 over the model shards.
* Data parallel (``megajax.tools.scaling.data_comm_s``): the dense parameters' gradients all-reduced over data x
  expert (e t apart: the expert shards are data shards outside the routed layers), the experts' over data alone
  (e t apart).

Assumed: balanced routing (the balancing loss's aim; ``mixtral_tiny`` ends at a max / mean expert load of 1.46, and
the slowest expert shard sets the pace of the exchange, so an imbalance lengthens both the expert GEMMs and the
all-to-all by about its ratio); no overlap of the exchange with other work; the dispatch's element-wise passes as
counted on XLA:CPU's unfused program (XLA:GPU fuses some). Pipeline stages: a mixture runs in them with
``expert=1``, its experts split over ``model`` (``MoEConfig.check_mesh`` refuses expert shards, and dense layers
among the routed ones, in stages), so the planner gives it (pipe, data, model) meshes besides its (data, expert,
model) ones.
"""

from __future__ import annotations

from megajax.config import RunSpec
from megajax.tools.comm_minimum import minimum
from megajax.tools.scaling_clusters import (
    HALF,
    Cluster,
    all_to_all_s,
    fp8_scaling_s,
    gemm_s,
    group_allreduce_s,
    ring_allreduce_s,
)
from megajax.tools.scaling_layout import comm_shape, layout


def routed_gemms(run: RunSpec, tensor: int, micro_batch: int, expert: int) -> list[tuple]:
    """One GPU's expert GEMMs per micro-batch of ``micro_batch`` sequences per batch shard as (batch, m, k, n): its
    E / e experts' three GEMMs, each over the n e / E rows balanced routing gives an expert; none for a dense
    model."""
    lay, cfg = layout(run, tensor), run.model
    routed = next((st for st in lay.stacks if st.routed), None)
    if routed is None:
        return []
    experts, per_token = run.routed_experts
    rows = micro_batch * cfg.max_seq_len * per_token * expert / experts
    return [(experts // expert, rows, k, n) for k, n in routed.expert_gemms]


def routed_layer_s(run: RunSpec, tensor: int, micro_batch: int, expert: int, cluster: Cluster) -> float:
    """One layer's routed work for one micro-batch on one GPU beyond its dense GEMMs and the trunk's element-wise
    passes: the expert GEMMs at the roofline and the dispatch's passes at HBM bandwidth (module docstring); 0 for a
    dense model."""
    grouped = routed_gemms(run, tensor, micro_batch, expert)
    if not grouped:
        return 0.0
    cfg = run.model
    again = 1 if cfg.remat in ("full", "save_dots") else 0
    n, h = micro_batch * cfg.max_seq_len * run.routed_experts[1], cfg.hidden_size
    # the rows a GPU's buffers hold: e blocks of m (the blocks exchange), the receive room (the ragged one's)
    block = (expert * run.exchange_rows(micro_batch, expert) if cfg.expert_exchange == "blocks"
             else run.receive_rows(micro_batch, expert))
    routed = next(st for st in layout(run, tensor).stacks if st.routed)
    widened = sum(width for k, width in routed.expert_gemms if k == h)  # gate and up: 2F/t
    kind = next(stack.kind for stack in run.stacks if stack.kind.routed)
    forward = sum(p * size for p, size in zip(kind.dispatch_passes, (block * h, n * h, block * widened)))
    fp8 = cfg.fp8 and cfg.expert_gemm != "xla"  # the kernel (on NVIDIA GPUs) takes FP8 operands; ragged_dot does not
    gemms = sum(gemm_s(*g, cluster, fp8=fp8) for g in grouped)
    scaling = sum(g[0] * fp8_scaling_s(*g[1:], cluster, forwards=1 + again) for g in grouped) if fp8 else 0.0
    return (3 + again) * gemms + scaling + (3 + again) * HALF * forward / cluster.hbm_bandwidth


def expert_comm_s(run: RunSpec, mesh: tuple[int, int], micro_batch: int, expert: int, cluster: Cluster) -> float:
    """The routed layers' communication for one micro-batch on a (data, model) ``mesh`` with ``expert`` shards: the
    budget's all-to-all bytes as all-to-alls over the expert group, the routing statistics as ring all-reduces
    (module docstring); 0 for a dense model."""
    data, tensor = mesh
    cfg = run.model
    experts, per_token = run.routed_experts
    if not experts:
        return 0.0
    layers, redo = run.routed_layers, 2 if cfg.remat == "full" else 1
    if cfg.expert_exchange == "blocks":
        moved = minimum(comm_shape(run, mesh, micro_batch, 1, cfg.num_layers, expert))["expert all-to-all"]
        exchanges = (3 * redo + 2) * layers  # forward: rows there, their ids, outputs back; backward: the two rows'
    else:  # ragged (auto on GPUs): each exchange the routed rows alone; the counts and offsets' latency
        assignments = micro_batch * cfg.max_seq_len * per_token
        moved = (2 * redo + 2) * layers * assignments * cfg.hidden_size * HALF
        exchanges = (2 * redo + 2 + 3 * redo + 4) * layers
    if run.receive_rows(micro_batch, expert) < expert * run.exchange_rows(micro_batch, expert):
        exchanges += 2 * redo * layers  # the room's counts there and what each destination takes back (latency)
    out = all_to_all_s(moved, expert, tensor, cluster, exchanges)
    if data * expert > 1:
        out += redo * layers * group_allreduce_s(2 * experts * 4, data * expert, tensor, cluster)
    if tensor > 1:
        assignments = micro_batch * cfg.max_seq_len * per_token
        out += layers * ring_allreduce_s(4 * assignments, tensor, cluster.intra_bandwidth, cluster.intra_latency)
    return out
