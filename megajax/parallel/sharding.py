"""Logical axis names -> mesh axes, the device mesh, and activation constraints.

Every parameter and pinned activation carries one logical name per dimension. A rules table (from the config) maps
each name to a mesh axis or to ``None`` (replicated). The default table is Megatron's intra-layer model parallelism:
columns of the first GEMM of each block, rows of the second, and the vocabulary on ``model``; the batch on ``data``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from megajax.errors import ShardingConfigError

Rules = tuple[tuple[str, str | None], ...]

MODEL_AXIS = "model"  # tensor parallelism: Megatron's intra-layer split
PIPE_AXIS = "pipe"  # pipeline stages (mesh.pipe > 1): outermost, so a stage may span hosts while `model` stays in one
# expert parallelism (mesh.expert > 1): a mixture-of-experts layer's experts split over it, every other layer's
# batch split over `data` and it together; between them, so `model` stays the innermost (fastest) axis
EXPERT_AXIS = "expert"
# context parallelism (mesh.context > 1): every sequence split over it for the whole layer stack (the `seq` rule),
# attention's keys and values gathered whole; just outside `model`, so both stay within a node where they fit
CONTEXT_AXIS = "context"
SEQUENCE_PARALLEL_NAME = "seq_sp"  # the residual stream's sequence axis

# Megatron-LM (Shoeybi et al. 2019, Section 3) as a rules table.
WHOLE_LAYERS = "whole_layers"  # the stacked-layer axis of a stack not split over pipeline stages
MEGATRON_RULES: Rules = (
    ("batch", "data"),  # activations' batch dimension
    ("seq", None),  # the sequence where a tensor-parallel GEMM or attention needs all of it
    # The residual stream's sequence (embeddings' output, LayerNorms, dropout, residual adds): None as Megatron;
    # `model` with parallel.sequence (Korthikanti et al. 2022), set by config.run.rules_for.
    (SEQUENCE_PARALLEL_NAME, None),
    ("embed", None),  # hidden size: replicated, Megatron keeps the residual stream whole on every model shard
    ("vocab", "model"),  # word embedding and logits: vocab-parallel
    ("position", None),  # learned position embeddings: replicated
    ("token_type", None),  # BERT's segment embeddings: replicated
    ("heads", "model"),  # QKV columns / attention-out rows: whole heads per shard
    # grouped-query attention's key/value heads (Llama): split like the query heads where mesh.model divides
    # them; a model whose KV heads are fewer replicates them (LlamaConfig.rule_overrides)
    ("kv_heads", "model"),
    ("qkv", None),
    ("head_dim", None),
    ("mlp", "model"),  # MLP-up columns / MLP-down rows
    ("experts", None),  # a mixture-of-experts layer's stacked experts: each shard holds every expert's `mlp` slice
    ("layers", None),  # the stacked-layer axis of scanned blocks (over `pipe` with pipeline stages)
    (WHOLE_LAYERS, None),  # that of a stack every pipeline stage runs whole (``models.spec.Stack.pipelined``)
    ("embed_out", None),  # output side of the small replicated h -> h heads (pooler, MLM transform)
    ("classes", None),  # classifier outputs (SOP, task heads)
)


# The residual stream's layout (B, S, H). Under sequence parallelism its sequence is split over `model`: each
# row-parallel GEMM's partial sums are reduce-scattered onto it, each column-parallel GEMM's input all-gathered
# from it (megajax.parallel.layers).
RESIDUAL = ("batch", SEQUENCE_PARALLEL_NAME, "embed")
SEQUENCE_DIM = RESIDUAL.index(SEQUENCE_PARALLEL_NAME)


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


def entry_axes(entry: str | Sequence[str] | None) -> tuple[str, ...]:
    """The mesh axes one PartitionSpec entry splits a dimension over: None -> (), 'a' -> ('a',), ('a', 'b') as is."""
    return (entry,) if isinstance(entry, str) else tuple(entry or ())


def spec_axes(spec: P) -> list[str]:
    """Every mesh axis a PartitionSpec splits over, in order."""
    return [a for entry in spec for a in entry_axes(entry)]


def spec_over_data(spec: P, shape: tuple[int, ...], mesh_shape: Mapping[str, int], axis: str = "data",
                   keep_whole: Sequence[int] = ()) -> P:
    """``spec`` additionally split over ``axis``: on the first dimension it leaves whole that the axis divides, else
    on the first already split one whose shards it divides (e.g. ('model', 'data')); dimensions in ``keep_whole``
    are never chosen. Unchanged when nothing fits or the axis has size 1."""
    size = mesh_shape.get(axis, 1)
    entries = list(spec) + [None] * (len(shape) - len(spec))
    if size == 1 or axis in spec_axes(spec):
        return spec
    for whole_only in (True, False):
        for i, (dim, names) in enumerate(zip(shape, entries)):
            if i in keep_whole or (names is None) != whole_only:
                continue
            if dim % (size * math.prod(mesh_shape[n] for n in entry_axes(names))) == 0:
                entries[i] = axis if names is None else (*entry_axes(names), axis)
                return P(*entries)
    return spec


@dataclasses.dataclass(frozen=True)
class PipelineSettings:
    """How a pipelined layer stack runs (``megajax.parallel.pipeline``), one value for the run (``RunSpec.pipeline``)
    and the traced model (``ParallelContext.pipeline``): ``schedule`` 'gpipe', 'circular' or '1f1b' (1F1B: the step
    computes each microbatch's loss inside the schedule, ``megajax.training.pipelined``); ``microbatches``: how many
    microbatches a pipelined batch is cut into (0: one per stage); ``repeats``: chunks of layers per stage (1: GPipe
    and 1F1B; more: circular or interleaved 1F1B); ``stage_recompute``: 1F1B holds each microbatch's stage input, not
    its residuals, and runs the stage's forward again in its backward (``pipeline_1f1b.run``'s ``recompute``)."""

    schedule: str = "gpipe"
    microbatches: int = 0
    repeats: int = 1
    stage_recompute: bool = False


@dataclasses.dataclass(frozen=True)
class ParallelContext:
    """The run's settings that a traced model reads while ``activate`` holds them (built by
    ``config.run.RunSpec.parallel_context``). Frozen and hashable, so it can also key a jit cache.

    ``rules``: logical name -> mesh axis (None: outside ``activate``, nothing pinned); ``params_split``: the
    parameters are stored split over ``data`` as well (``parallel.fsdp``), so ``param_at_use`` gathers them;
    ``pipeline``: how a pipelined layer stack runs (``PipelineSettings``); ``rows``: which rows
    of the step's global batch the traced batch's rows are (``rows_of``: a training step's micro-batch, a pipeline
    stage's share of its microbatch), whose indices key ``layers.dropout``'s masks (None: rows 0, 1, ..);
    ``positions``: the traced sequence's tokens' positions in the order the activations hold them (context
    parallelism's balanced order: ``positions_of``), which key the masks too (None: 0, 1, ..). Traced values, so a
    context holding one keys no cache.
    """

    rules: Rules | None
    params_split: bool = False
    pipeline: PipelineSettings = PipelineSettings()
    rows: jax.Array | None = None
    positions: jax.Array | None = None


_CONTEXT: contextvars.ContextVar[ParallelContext] = contextvars.ContextVar(
    "megajax_parallel_context", default=ParallelContext(None))


def parallel_context() -> ParallelContext:
    """The settings ``activate`` holds for the model being traced; outside it ``ParallelContext(None)`` (no rules:
    single-device use, nothing pinned)."""
    return _CONTEXT.get()


@contextlib.contextmanager
def _holding(context: ParallelContext) -> Iterator[ParallelContext]:
    """``context`` held while the block runs (what a traced model reads of its run and of its caller)."""
    token = _CONTEXT.set(context)
    try:
        yield context
    finally:
        _CONTEXT.reset(token)


@contextlib.contextmanager
def activate(mesh: Mesh | jax.sharding.AbstractMesh, context: ParallelContext) -> Iterator[None]:
    """Sets the mesh and the settings (``ParallelContext``) that ``constrain`` and the layers read while a model is
    traced (an ``AbstractMesh``: for tracing only, without devices)."""
    use = jax.sharding.use_abstract_mesh if isinstance(mesh, jax.sharding.AbstractMesh) else jax.set_mesh
    with _holding(context), use(mesh):
        yield


@contextlib.contextmanager
def rules_remapped(**names: str | None) -> Iterator[None]:
    """The active rules with the given logical names mapped elsewhere (e.g. ``batch=None`` inside a vmap that owns
    the `data` axis through its ``spmd_axis_name``: a constraint inside it may not name that axis)."""
    context = parallel_context()
    with _holding(dataclasses.replace(context, rules=tuple((k, names.get(k, v)) for k, v in context.rules))):
        yield


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """Pins an activation's layout by logical names; a no-op outside ``activate`` (single-device use)."""
    rules = parallel_context().rules
    if rules is None or jax.sharding.get_abstract_mesh().empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(names, rules))


FSDP_GATHERED = "fsdp_gathered"  # checkpoint name of a parameter gathered at use: recomputed, never kept


def fsdp_spec(names: Sequence[str], shape: tuple[int, ...], rules: Rules, mesh_shape: Mapping[str, int]) -> P:
    """Where ``parallel.fsdp`` stores a parameter: its rules layout, split over ``data`` as well (never on the stacked
    ``layers`` dimension: the scan slices one layer out of it, and a split there would gather the whole stack)."""
    keep = [i for i, n in enumerate(names) if n in ("layers", WHOLE_LAYERS)]
    return spec_over_data(logical_to_spec(names, rules), shape, mesh_shape, keep_whole=keep)


def param_at_use(value: jax.Array, names: Sequence[str], dtype: jnp.dtype | None = None) -> jax.Array:
    """A parameter's value in the layout its logical names give under the active rules: where a layer reads it.

    With ``parallel.fsdp`` the parameter is stored split over ``data`` too (``fsdp_spec``) and this is where it is
    all-gathered, one layer at a time inside the scan. Its gradient is laid out split again right here, so the
    per-layer gradients never exist whole outside the layer; the gathered copy is named ``FSDP_GATHERED`` so the
    blocks' remat policy (``megajax.parallel.remat``) recomputes (re-gathers) it in the backward pass instead of
    keeping every layer's. ``dtype``: the dtype the layer computes with it in (it casts the value there itself):
    the shard is cast before the gather, so the gather moves 2 bytes a value, not the fp32 master's 4 (as
    Megatron-LM's distributed optimizer and PyTorch FSDP's mixed precision gather bf16), and the gradient comes
    back in the stored dtype (reduce-scattered in fp32: the blocks' GEMMs give their weight gradients as fp32
    outputs, ``layers.half_product``).
    Otherwise the value is already in that layout: unchanged.
    """
    if not params_split():
        return value
    rules = parallel_context().rules
    whole = logical_to_spec(names, rules)
    split = fsdp_spec(names, value.shape, rules, dict(jax.sharding.get_abstract_mesh().shape))
    if split == whole:  # nothing divisible by the data degree: stored whole
        return value
    return _gather_parameter(value, whole, split, (jnp.dtype(dtype or value.dtype), value.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def _gather_parameter(value: jax.Array, whole: P, split: P, dtypes: tuple[jnp.dtype, jnp.dtype]) -> jax.Array:
    # named inside the custom_vjp, so that the call carries the name: a remat policy must refuse the call that makes
    # the whole parameter, not only a name on its result (megajax.parallel.remat). dtypes: (gathered, stored)
    shard = jax.lax.with_sharding_constraint(value, split).astype(dtypes[0])
    gathered = jax.lax.with_sharding_constraint(shard, whole)
    return checkpoint_name(gathered, FSDP_GATHERED)


def _gather_fwd(value: jax.Array, whole: P, split: P, dtypes: tuple[jnp.dtype, jnp.dtype]) -> tuple[jax.Array, None]:
    return _gather_parameter(value, whole, split, dtypes), None


def _gather_bwd(whole: P, split: P, dtypes: tuple[jnp.dtype, jnp.dtype], _: None,
                cotangent: jax.Array) -> tuple[jax.Array]:
    # Straight from the layer's partial sums onto the shards: the whole gradient is never a value of the program
    # (XLA:CPU all-reduces and slices; XLA:GPU's ReduceScatterCreator pass makes that pair one reduce-scatter).
    return (jax.lax.with_sharding_constraint(cotangent.astype(dtypes[1]), split),)


_gather_parameter.defvjp(_gather_fwd, _gather_bwd)


@contextlib.contextmanager
def params_whole() -> Iterator[None]:
    """Traces as though the parameters were stored whole over ``data`` (``param_at_use`` a no-op): inside a region
    whose parameters were gathered already (a pipeline stage's, once per step)."""
    with _holding(dataclasses.replace(parallel_context(), params_split=False)):
        yield


@contextlib.contextmanager
def rows_of(rows: jax.Array) -> Iterator[None]:
    """Traces the model on the rows ``rows`` (int, one per row of its batch) of the step's global batch
    (``ParallelContext.rows``, read by ``layers.dropout``)."""
    with _holding(dataclasses.replace(parallel_context(), rows=rows)):
        yield


@contextlib.contextmanager
def positions_of(positions: jax.Array | None) -> Iterator[None]:
    """Traces the model on a sequence whose tokens are at ``positions`` (int, one per position of its activations;
    None: 0, 1, ..) (``ParallelContext.positions``, read by ``layers.dropout``)."""
    with _holding(dataclasses.replace(parallel_context(), positions=positions)):
        yield


def sequence_positions(count: int) -> jax.Array:
    """The active context's token positions, or 0 .. ``count`` - 1."""
    positions = parallel_context().positions
    return jnp.arange(count) if positions is None else positions


def partly_manual() -> bool:
    """Whether the trace is inside a ``shard_map`` manual over some of the mesh's axes and automatic over the others
    (the 1F1B stages', manual over ``pipe``), where two of XLA's and JAX's partitioning rules fail (jax 0.10)."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and 0 < len(mesh.manual_axes) < len(mesh.axis_names)


def batch_rows(count: int) -> jax.Array:
    """The active context's row indices, or rows 0 .. ``count`` - 1 outside a training step."""
    rows = parallel_context().rows
    return jnp.arange(count) if rows is None else rows


def params_split() -> bool:
    """Whether the model being traced reads ``parallel.fsdp``'s split parameters (``param_at_use`` gathers them)."""
    context = parallel_context()
    return context.params_split and context.rules is not None


def replicas(batch: int) -> int:
    """How many data-parallel replicas a batch of ``batch`` rows is split over under the active rules (the size of
    the mesh axes ``batch`` maps to); 1 outside ``activate`` or where that does not divide ``batch``."""
    rules = parallel_context().rules
    mesh = jax.sharding.get_abstract_mesh()
    if rules is None or mesh.empty:
        return 1
    d = math.prod(mesh.shape[a] for a in entry_axes(dict(rules).get("batch")))
    return d if batch % d == 0 else 1


def batch_shards(mesh: Mesh, rules: Rules) -> int:
    """How many ways ``rules`` split a batch's rows on ``mesh``: the size of the axes ``batch`` maps to (``data``;
    with expert shards ``data`` and ``expert``; with pipeline stages also ``pipe``)."""
    return math.prod(mesh.shape[a] for a in entry_axes(dict(rules).get("batch")))


def spec_of(names: Sequence[str | None]) -> P:
    """The PartitionSpec of logical ``names`` under the active rules (replicated outside ``activate``)."""
    rules = parallel_context().rules
    return P() if rules is None else logical_to_spec(names, rules)


def mesh_size(name: str) -> int:
    """The size of the mesh axes the logical ``name`` maps to under the active rules; 1 outside ``activate``."""
    rules = parallel_context().rules
    mesh = jax.sharding.get_abstract_mesh()
    if rules is None or mesh.empty:
        return 1
    return math.prod(mesh.shape[a] for a in entry_axes(dict(rules).get(name)))


def sequence_axis() -> str | None:
    """The mesh axis the active rules split the residual stream's sequence over beyond the one every sequence is
    split over (``parallel.sequence``: 'model'; under context parallelism the residual's sequence is split over
    ('context', 'model'), and 'model' is this one), or None: Megatron's layout, or outside ``activate``."""
    rules = parallel_context().rules
    if rules is None or jax.sharding.get_abstract_mesh().empty:
        return None
    table = dict(rules)
    extra = [a for a in entry_axes(table.get(SEQUENCE_PARALLEL_NAME)) if a not in entry_axes(table.get("seq"))]
    return extra[0] if extra else None


def axis_of(name: str) -> str | None:
    """The mesh axis the active rules put logical ``name`` on (None: unsplit, or outside ``activate``)."""
    rules = parallel_context().rules
    if rules is None or jax.sharding.get_abstract_mesh().empty:
        return None
    return dict(rules).get(name)


def _names_leaf(x: object) -> bool:
    return isinstance(x, tuple) and all(isinstance(n, str | None) for n in x)


def on_shards(fn: Callable[..., Any], args: Sequence[jax.Array], names: Sequence[Sequence[str | None]],
              out_names: Any, check_vma: bool = True) -> Any:
    """``fn`` run on each device's blocks of ``args`` (laid out by their logical ``names`` under the active rules),
    its per-device result assembled by ``out_names`` (a tuple of names, or a pytree of them for a pytree result;
    ``()``: a replicated scalar): a ``shard_map`` over the whole mesh.

    For the collectives XLA's partitioner does not choose by itself: given a partial sum to lay out split (a
    reduce-scatter), the SPMD partitioner all-reduces and slices; XLA's GPU pipeline rewrites that pair into a
    reduce-scatter (its ReduceScatterCreator pass), the CPU pipeline does not. Inside ``fn`` the partial sums are
    visible, so ``jax.lax.psum_scatter`` says it, and autodiff transposes it to an all-gather. ``check_vma=False``:
    the result's layout is not checked against the collectives inside (``jax.shard_map``'s option).
    """
    rules = parallel_context().rules
    out_specs = jax.tree.map(lambda n: logical_to_spec(n, rules), out_names, is_leaf=_names_leaf)
    return jax.shard_map(fn, in_specs=tuple(logical_to_spec(n, rules) for n in names), out_specs=out_specs,
                         check_vma=check_vma)(*args)
