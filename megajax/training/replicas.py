"""Each data replica's gradients kept apart through gradient accumulation, reduced over ``data`` once per step.

Under ``jax.jit`` alone a micro-batch's gradient, a sum over rows split over ``data``, is reduced over ``data`` as it
is formed, so a step of M accumulation steps reduces its gradients M times (in the compute dtype). Megatron-LM adds
each micro-batch's gradients into a local fp32 buffer and reduces that once, after the last. Here likewise: each
micro-batch's loss is differentiated with respect to one copy of the parameters per data replica (a broadcast laid
out over ``data``: each device's copy is its own parameters, nothing moves), the model ``jax.vmap``-ed over the
replicas with ``spmd_axis_name`` 'data' (so inside it ``batch`` maps to the batch's other axes, as a pipeline
stage's replicas do, ``parallel.pipeline``). The copies' gradients are carried through the accumulation loop and
summed over the replicas after it: one fp32 all-reduce over ``data`` (a reduce-scatter under ZeRO-1).

Each replica's loss is its rows' mean weighted by its share of what the objective counts, as each micro-batch's is
(``step.make_train_step``), so the step's loss and gradients are the plain step's; only a loss that is not a mean
over rows moves: a mixture's balancing loss is each replica's micro-batch's own (f_e and P_e over its rows), as
Megatron-LM computes it per rank.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from megajax.parallel.pipeline import stages
from megajax.parallel.sharding import axis_of, entry_axes, logical_to_spec, parallel_context, params_split

DATA_AXIS = "data"


def kept_apart(num_micro: int, data: int, fsdp: bool, pipe: int) -> bool:
    """Whether a step of ``num_micro`` accumulation steps on ``data`` replicas keeps each replica's gradients apart
    until its one reduction: where it accumulates (``num_micro`` > 1) over data replicas whose parameters are
    stored whole (not ``parallel.fsdp``, whose shards hold no whole gradient: it reduce-scatters each micro-batch's,
    as FSDP does) and without pipeline stages (whose stacks keep their own per-replica copies, reduced once per
    accumulation step, ``parallel.pipeline``). ZeRO-1 too: its gradients are reduce-scattered once, after the loop,
    as Megatron-LM's distributed optimizer does."""
    return num_micro > 1 and data > 1 and not fsdp and pipe == 1


def replica_count(num_micro: int) -> int:
    """The data replicas whose gradients the step being traced keeps apart (``kept_apart``), or 1: the plain step."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or DATA_AXIS not in entry_axes(axis_of("batch")):
        return 1
    return mesh.shape[DATA_AXIS] if kept_apart(num_micro, mesh.shape[DATA_AXIS], params_split(), stages()) else 1


def layouts(graphdef: nnx.GraphDef, params: Any) -> Any:
    """Each parameter's PartitionSpec under the active rules, a tree like ``params``."""
    rules = parallel_context().rules
    state = nnx.state(nnx.merge(graphdef, params))
    specs = jax.tree.map(lambda v: logical_to_spec(v.get_metadata().get("out_sharding") or (None,) * v.ndim, rules),
                         state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    return nnx.to_pure_dict(specs)


def copies(params: Any, specs: Any, d: int) -> Any:
    """One copy of ``params`` per data replica, (d, ...) laid out over ``data``: each device's is its own."""
    return jax.tree.map(lambda a, s: jax.lax.with_sharding_constraint(
        jnp.broadcast_to(a, (d, *a.shape)), P(DATA_AXIS, *s)), params, specs, is_leaf=lambda x: isinstance(x, P))


def by_replica(x: jax.Array, d: int) -> jax.Array:
    """(rows, ...) -> (d, rows / d, ...): the rows each data replica holds."""
    return x.reshape(d, x.shape[0] // d, *x.shape[1:])


def inner_batch_axes() -> Any:
    """What ``batch`` maps to inside the vmap over ``data``: the batch's other axes (``expert``), or None."""
    rest = tuple(a for a in entry_axes(axis_of("batch")) if a != DATA_AXIS)
    return rest[0] if len(rest) == 1 else rest or None
