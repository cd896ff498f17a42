"""The scaling model's context dimension (``mesh.context``: every sequence split over C GPUs,
``megajax.parallel.context``).

A GPU of C context shards holds s/C positions of each of its b sequences, and its queries meet every key: its
dense GEMMs, element-wise passes, attention scores (b a/t s/C s), head and tensor-parallel all-reduces are those of
b/C sequences on one GPU, so ``scaling.predict`` times them at a micro-batch of b/C. Beyond that, per layer and
micro-batch, the keys' and values' all-gathers over the context group (again where ``remat`` recomputes the layer)
and their gradients' reduce-scatters: the communication budget's ``context key/value`` bytes
(``comm_minimum.minimum``, the compiled step's exactly), each collective half a hierarchical ring all-reduce of the C
chunks over the group (``scaling_clusters.group_allreduce_s``; the group's GPUs are ``model`` apart, within a node
where C x t fits one), not overlapped. The gradients are reduced over data x context. Not modelled: context with
pipeline stages or expert shards (refused, as training refuses the first), and the balanced order's effect on a
causal kernel (XLA's dense attention computes the whole s/C x s block: the model times it so).
"""

from __future__ import annotations

from megajax.config import RunSpec
from megajax.tools.comm_minimum import minimum
from megajax.tools.scaling_clusters import HALF, Cluster, group_allreduce_s
from megajax.tools.scaling_layout import comm_shape


def context_comm_s(run: RunSpec, mesh: tuple[int, int], micro_batch: int, context: int, cluster: Cluster) -> float:
    """The keys' and values' all-gathers and their gradients' reduce-scatters over ``context`` shards for one
    micro-batch of ``micro_batch`` sequences on a (data, model) ``mesh`` (module docstring); 0 without context
    shards."""
    if context == 1:
        return 0.0
    shape = comm_shape(run, mesh, micro_batch, 1, run.model.num_layers, context=context)
    chunk = shape.context_kv_elements * HALF  # one device's chunk of one layer's keys (or values)
    keys = shape.context_key_bytes * micro_batch * shape.seq  # the mask's key positions, gathered once
    count = (minimum(shape)["context key/value"] - keys) / chunk
    return count * group_allreduce_s(context * chunk, context, mesh[1], cluster) / 2 + \
        group_allreduce_s(context * keys, context, mesh[1], cluster) / 2
