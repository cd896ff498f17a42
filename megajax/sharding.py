"""Logical axis names -> mesh axes, the device mesh, and activation constraints.

Every parameter and pinned activation carries one logical name per dimension. A rules table (from the config) maps
each name to a mesh axis or to ``None`` (replicated). The default table is Megatron's intra-layer model parallelism:
columns of the first GEMM of each block, rows of the second, and the vocabulary on ``model``; the batch on ``data``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, PartitionSpec as P

Rules = tuple[tuple[str, str | None], ...]

MESH_AXES = ("data", "model")
SEQUENCE_PARALLEL_NAME = "seq_sp"  # the residual stream's sequence axis

# Megatron-LM (Shoeybi et al. 2019, Section 3) as a rules table.
MEGATRON_RULES: Rules = (
    ("batch", "data"),  # activations' batch dimension
    ("seq", None),  # the sequence where a tensor-parallel GEMM or attention needs all of it
    # The residual stream's sequence (embeddings' output, LayerNorms, dropout, residual adds): None as Megatron;
    # `model` with parallel.sequence (Korthikanti et al. 2022), set by config.rules_of.
    (SEQUENCE_PARALLEL_NAME, None),
    ("embed", None),  # hidden size: replicated, Megatron keeps the residual stream whole on every model shard
    ("vocab", "model"),  # word embedding and logits: vocab-parallel
    ("position", None),  # learned position embeddings: replicated
    ("token_type", None),  # BERT's segment embeddings: replicated
    ("heads", "model"),  # QKV columns / attention-out rows: whole heads per shard
    ("qkv", None),
    ("head_dim", None),
    ("mlp", "model"),  # MLP-up columns / MLP-down rows
    ("layers", None),  # the stacked-layer axis of scanned blocks
    ("embed_out", None),  # output side of the small replicated h -> h heads (pooler, MLM transform)
    ("classes", None),  # classifier outputs (SOP, task heads)
)


# The residual stream's layout (B, S, H). Under sequence parallelism its sequence is split over `model`: each
# row-parallel GEMM's partial sums are reduce-scattered onto it, each column-parallel GEMM's input all-gathered
# from it (megajax.layers).
RESIDUAL = ("batch", SEQUENCE_PARALLEL_NAME, "embed")
SEQUENCE_DIM = RESIDUAL.index(SEQUENCE_PARALLEL_NAME)


class ConfigError(ValueError):
    """A config that cannot run; the message names the field to change."""


class ShardingConfigError(ConfigError):
    """A sharding rule or mesh that cannot work; the message says what to change."""


def logical_to_spec(names: Sequence[str | None], rules: Rules) -> P:
    """Maps logical axis names to a PartitionSpec; an unknown name is an error, not a silent replication."""
    table = dict(rules)
    axes = []
    for name in names:
        if name is None:
            axes.append(None)
            continue
        if name not in table:
            raise ShardingConfigError(
                f"unknown logical axis name {name!r}: add it to the sharding rules "
                f"(known: {sorted(table)})"
            )
        axes.append(table[name])
    used = [a for a in axes if a is not None]
    if len(used) != len(set(used)):
        raise ShardingConfigError(f"logical axes {tuple(names)} map two dimensions onto one mesh axis: {axes}")
    return P(*axes)


def resolve_mesh_shape(data: int, model: int, num_devices: int) -> tuple[int, int]:
    """(data, model) with ``data=-1`` resolved to all devices left after ``model``; checked against the devices."""
    if model < 1:
        raise ShardingConfigError(f"mesh.model must be >= 1, got {model}")
    if data == -1:
        if num_devices % model:
            raise ShardingConfigError(f"mesh.model={model} does not divide the {num_devices} devices present")
        data = num_devices // model
    if data < 1:
        raise ShardingConfigError(f"mesh.data must be >= 1 or -1, got {data}")
    if data * model > num_devices:
        raise ShardingConfigError(f"mesh {data}x{model} needs {data * model} devices but {num_devices} are present; "
                                  "lower mesh.data or mesh.model (on a CPU host, --cpu_devices simulates more)")
    return data, model


def make_mesh(data: int, model: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ``Mesh(('data', 'model'))``; ``data=-1`` takes all devices left after ``model``.

    Axes are ``Auto``: XLA's SPMD partitioner propagates shardings from the parameters and the few activations we
    pin, which is how Megatron's f/g all-reduces appear without hand-written collectives.
    """
    devices = list(jax.devices() if devices is None else devices)
    data, model = resolve_mesh_shape(data, model, len(devices))
    grid = np.asarray(devices[: data * model]).reshape(data, model)
    return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * 2)


_ACTIVE_RULES: contextvars.ContextVar[Rules | None] = contextvars.ContextVar("megajax_rules", default=None)


@contextlib.contextmanager
def activate(mesh: Mesh, rules: Rules) -> Iterator[None]:
    """Sets the mesh and rules that ``constrain`` uses while a model is traced."""
    token = _ACTIVE_RULES.set(rules)
    try:
        with jax.set_mesh(mesh):
            yield
    finally:
        _ACTIVE_RULES.reset(token)


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Pins an activation's layout by logical names; a no-op outside ``activate`` (single-device use)."""
    rules = _ACTIVE_RULES.get()
    if rules is None or jax.sharding.get_abstract_mesh().empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(names, rules))


def sequence_axis() -> str | None:
    """The mesh axis the active rules split the residual stream's sequence over (``parallel.sequence``: 'model'),
    or None: Megatron's layout, or outside ``activate``."""
    rules = _ACTIVE_RULES.get()
    if rules is None or jax.sharding.get_abstract_mesh().empty:
        return None
    return dict(rules).get(SEQUENCE_PARALLEL_NAME)


def on_shards(fn: Callable[..., jax.Array], args: Sequence[jax.Array], names: Sequence[Sequence[str | None]],
              out_names: Sequence[str | None]) -> jax.Array:
    """``fn`` run on each device's blocks of ``args`` (laid out by their logical ``names`` under the active rules),
    its per-device result assembled by ``out_names``: a ``shard_map`` over the whole mesh.

    For the collectives XLA's partitioner does not choose by itself: given a partial sum to lay out split (a
    reduce-scatter), the SPMD partitioner all-reduces and slices; XLA's GPU pipeline rewrites that pair into a
    reduce-scatter (its ReduceScatterCreator pass), the CPU pipeline does not. Inside ``fn`` the partial sums are
    visible, so ``jax.lax.psum_scatter`` says it, and autodiff transposes it to an all-gather.
    """
    rules = _ACTIVE_RULES.get()
    return jax.shard_map(fn, in_specs=tuple(logical_to_spec(n, rules) for n in names),
                         out_specs=logical_to_spec(out_names, rules))(*args)
