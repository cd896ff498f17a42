"""Tensor-parallel building blocks: every parameter is created with one logical axis name per dimension.

Parameters are fp32 masters; each layer casts them to the compute ``dtype`` at use. With ``fp8`` the blocks' GEMMs
(column- and row-parallel) scale and cast both operands to FP8 instead (``megajax.parallel.fp8``); ``Dense`` heads
and the embedding stay in the compute dtype. Where the mesh axis lands is
decided by the rules table (``megajax.parallel.sharding``), not here. Each parameter is read through
``sharding.param_at_use``: with ``parallel.fsdp`` that is where its data-split copy is gathered.

Sequence parallelism (Korthikanti et al. 2022; the rules split the residual stream's sequence, ``seq_sp``) changes
what happens at the four tensor-parallel boundaries, and only there: a column-parallel GEMM all-gathers its input's
sequence, a row-parallel GEMM and the vocab-parallel lookup reduce-scatter their partial sums onto it, and the
output layer gathers it. Each is written once, per device (``sharding.on_shards``), because a reduce-scatter needs
the partial sums in hand; without the split the layers are plain jnp and XLA's partitioner adds Megatron's
all-reduces.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from megajax.parallel.fp8 import fp8_tensordot, gradient_dims, varying_alike
from megajax.parallel.sharding import (
    RESIDUAL,
    SEQUENCE_DIM,
    axis_of,
    batch_rows,
    constrain,
    mesh_size,
    on_shards,
    param_at_use,
    replicas,
    sequence_axis,
    sequence_positions,
)

Shape = tuple[int, ...]
# checkpoint name of a column-parallel GEMM's all-gathered input under sequence parallelism: a remat policy that
# keeps it spares the backward pass a second all-gather
SEQUENCE_GATHERED = "sequence_gathered"


def make_param(rngs: nnx.Rngs, init, shape: Shape, names: Sequence[str]) -> nnx.Param:
    """An fp32 parameter tagged with logical axis names (sharding is applied by the caller's jit, not eagerly)."""
    if len(names) != len(shape):
        raise ValueError(f"parameter of shape {shape} needs {len(shape)} axis names, got {tuple(names)}")
    return nnx.Param(init(rngs.params(), shape, jnp.float32), out_sharding=tuple(names), eager_sharding=False)


def _tensordot_last(x: jax.Array, kernel: jax.Array, n: int) -> jax.Array:
    """Contracts the last ``n`` dims of x with the first ``n`` dims of kernel."""
    return jax.lax.dot_general(
        x, kernel, ((tuple(range(x.ndim - n, x.ndim)), tuple(range(n))), ((), ()))
    )


def half_product(x: jax.Array, kernel: jax.Array, n: int, dtype: jnp.dtype) -> jax.Array:
    """``_tensordot_last`` of both operands cast to the 16-bit ``dtype``, whose kernel gradient is the GEMM's fp32
    output: where the rows are split over ``data`` its partial sums are reduced there in fp32 (as Megatron-LM
    reduces gradients), not in ``dtype`` as the plain product's transpose would have XLA do; the input's gradient
    (and its all-reduce over ``model``) stays in ``dtype``. The gradients come back in ``x``'s and ``kernel``'s
    dtypes."""
    x, kernel = varying_alike(x, kernel)
    return _half_product(x, kernel, (n, jnp.dtype(dtype), x.dtype, kernel.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _half_product(x: jax.Array, kernel: jax.Array, static: tuple) -> jax.Array:
    return _half_forward(x, kernel, static)[0]


def _half_forward(x, kernel, static):
    n, dtype, _, _ = static
    xc, kc = x.astype(dtype), kernel.astype(dtype)
    return _tensordot_last(xc, kc, n), (xc, kc)


def _half_backward(static, residuals, g):
    n, _, x_dtype, kernel_dtype = static
    xc, kc = residuals
    dx_dims, dk_dims = gradient_dims(xc.ndim, kc.ndim, n)
    dx = jax.lax.dot_general(g, kc, dx_dims)
    dk = jax.lax.dot_general(xc, g, dk_dims, preferred_element_type=jnp.float32)
    return dx.astype(x_dtype), dk.astype(kernel_dtype)


_half_product.defvjp(_half_forward, _half_backward)


class ColumnParallelLinear(nnx.Module):
    """``y = x @ W + b`` with W's output dimensions sharded (the first GEMM of a Megatron block).

    ``out_shape`` may have several dims, e.g. (heads, 3, head_dim) for QKV so each shard owns whole heads.
    The bias is sharded like the output, so no communication happens in the forward pass. Under sequence
    parallelism the input (B, S/t, H) is all-gathered to (B, S, H) first (its gradient is reduce-scattered back).
    """

    def __init__(self, in_features: int, out_shape: Shape, names: Sequence[str], *, std: float,
                 dtype: jnp.dtype, rngs: nnx.Rngs, bias: bool = True, fp8: bool = False):
        self.dtype, self.fp8 = dtype, fp8
        self.names = tuple(names)
        self.kernel = make_param(rngs, nnx.initializers.normal(std), (in_features, *out_shape), names)
        self.bias = make_param(rngs, nnx.initializers.zeros, tuple(out_shape), names[1:]) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:  # (..., in) -> (..., *out_shape)
        return column_parallel(x, self.kernel_at_use(), self.bias_at_use(), self.names, self.dtype, self.fp8)

    def kernel_at_use(self) -> jax.Array:
        """The kernel as the rules lay it out (gathered over ``data`` under ``parallel.fsdp``, in the compute dtype)."""
        return param_at_use(self.kernel[...], self.names, self.dtype)

    def bias_at_use(self) -> jax.Array | None:
        """The bias as the rules lay it out (gathered over ``data`` under ``parallel.fsdp``); None without one."""
        return None if self.bias is None else param_at_use(self.bias[...], self.names[1:])

    def apply(self, x: jax.Array, kernel: jax.Array, bias: jax.Array | None = None) -> jax.Array:
        """``x @ kernel (+ bias)`` in the compute dtype (the GEMM in FP8 with ``fp8``)."""
        return _affine(x, kernel, bias, self.dtype, self.fp8)


def _product(x: jax.Array, kernel: jax.Array, n: int, dtype: jnp.dtype, fp8: bool) -> jax.Array:
    """x's last ``n`` dims contracted with kernel's first ``n``, in ``dtype``: the operands cast to it, or with
    ``fp8`` scaled and cast to FP8 (the result in ``dtype``)."""
    if fp8:
        return fp8_tensordot(x.astype(dtype), kernel, n, dtype)
    if jnp.dtype(dtype).itemsize == 2:
        return half_product(x, kernel, n, dtype)
    return _tensordot_last(x.astype(dtype), kernel.astype(dtype), n)


def _affine(x: jax.Array, kernel: jax.Array, bias: jax.Array | None, dtype: jnp.dtype, fp8: bool) -> jax.Array:
    y = _product(x, kernel, 1, dtype, fp8)
    return y if bias is None else y + bias.astype(dtype)


def column_parallel(x: jax.Array, kernel: jax.Array, bias: jax.Array | None, names: Sequence[str | None],
                    dtype: jnp.dtype, fp8: bool = False) -> jax.Array:
    """``x @ kernel (+ bias)`` for a kernel laid out by its logical ``names`` (the first: its input dimension), the
    output split like the kernel's columns: ``ColumnParallelLinear``'s product, also for kernels a model assembles
    at use (several projections of one input fused into one GEMM, so its input gradient is one all-reduce). Under
    sequence parallelism the input (B, S/t, H) is all-gathered to (B, S, H) first. ``fp8``: the GEMM in FP8."""
    axis = sequence_axis()
    if axis is None:
        return _affine(x, kernel, bias, dtype, fp8)

    def gathered(x, kernel, *bias):  # per device: (B, S/t, H) -> (B, S, *out_shape / t)
        whole = checkpoint_name(jax.lax.all_gather(x, axis, axis=SEQUENCE_DIM, tiled=True), SEQUENCE_GATHERED)
        return _affine(whole, kernel, bias[0] if bias else None, dtype, fp8)

    args, arg_names = (x, kernel), (RESIDUAL, tuple(names))
    if bias is not None:
        args, arg_names = (*args, bias), (*arg_names, tuple(names[1:]))
    return on_shards(gathered, args, arg_names, ("batch", "seq", *names[1:]))


class Dense(ColumnParallelLinear):
    """A dense layer for small heads (pooler, MLM transform, classifiers): its names map to no mesh axis, so it
    is replicated on every shard and its replicated input needs no communication, as in Megatron. It runs on any
    layout of its input (under sequence parallelism, on each device's positions), so it never gathers."""

    def __call__(self, x: jax.Array) -> jax.Array:  # (..., in) -> (..., *out_shape)
        return self.apply(x, self.kernel_at_use(), self.bias_at_use())


class RowParallelLinear(nnx.Module):
    """``y = x @ W + b`` with W's input dimensions sharded (the second GEMM of a Megatron block).

    The local products are partial sums; XLA all-reduces them over ``model`` (Megatron's g operator) and the
    replicated bias is added once, after the reduction. Under sequence parallelism they are reduce-scattered onto
    the residual stream's split sequence instead, (B, S, H) partial -> (B, S/t, H).
    """

    def __init__(self, in_shape: Shape, out_features: int, names: Sequence[str], *, std: float,
                 dtype: jnp.dtype, rngs: nnx.Rngs, bias: bool = True, fp8: bool = False):
        self.dtype, self.fp8 = dtype, fp8
        self.n_in = len(in_shape)
        self.names = tuple(names)
        self.kernel = make_param(rngs, nnx.initializers.normal(std), (*in_shape, out_features), names)
        self.bias = make_param(rngs, nnx.initializers.zeros, (out_features,), names[-1:]) if bias else None

    def __call__(self, x: jax.Array) -> jax.Array:  # (..., *in_shape) -> (..., out)
        axis, kernel = sequence_axis(), param_at_use(self.kernel[...], self.names, self.dtype)
        if axis is None:
            y = self.partial(x, kernel)
        else:
            def scattered(x, kernel):  # per device: (B, S, *in_shape / t) -> (B, S/t, H)
                return jax.lax.psum_scatter(self.partial(x, kernel), axis, scatter_dimension=SEQUENCE_DIM,
                                            tiled=True)

            y = on_shards(scattered, (x, kernel), (("batch", "seq", *self.names[:-1]), self.names), RESIDUAL)
        if self.bias is None:
            return y
        return y + param_at_use(self.bias[...], self.names[-1:]).astype(self.dtype)

    def partial(self, x: jax.Array, kernel: jax.Array) -> jax.Array:
        """``x @ kernel`` in the compute dtype, the GEMM in FP8 with ``fp8`` (on one device's blocks: its partial
        sums)."""
        return _product(x, kernel, self.n_in, self.dtype, self.fp8)


class VocabParallelEmbedding(nnx.Module):
    """Word embedding sharded on the vocabulary, tied to the output layer.

    Lookup: each shard gathers the rows it owns and the partial rows are all-reduced (b x s x h). ``attend``
    computes vocab-sharded logits with no forward communication; its input gradient is all-reduced (f operator).
    Under sequence parallelism the lookup's partial rows are reduce-scattered onto the split sequence and
    ``attend`` all-gathers its input (as Megatron-Core). A model reads ``replica_rows`` once per step and passes
    them to both uses, so the tied gradient is reduced over ``data`` (and ``context``) once.
    """

    NAMES = ("vocab", "embed")

    def __init__(self, num_embeddings: int, features: int, *, std: float, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.dtype = dtype
        self.embedding = make_param(rngs, nnx.initializers.normal(std), (num_embeddings, features), self.NAMES)

    def rows_at_use(self) -> jax.Array:
        """This layer's rows (V, H) as the rules lay them out (gathered over ``data`` under ``parallel.fsdp``)."""
        return param_at_use(self.embedding[...], self.NAMES)

    def replica_rows(self, batch: int) -> jax.Array:
        """The rows as one copy per data-parallel replica and context shard, (D, C, V, H) split over ``batch``'s
        and ``seq``'s mesh axes: each device's copy is its own rows, so nothing moves. The gradient of a replicated
        parameter used twice (lookup, output layer) is otherwise reduced over ``data`` (and ``context``) once per
        use; on these copies both contributions are local and are summed before the one reduction, the transpose of
        this broadcast. D = 1 where it does not divide; C = 1 without context parallelism."""
        rows = self.rows_at_use()
        d, c = replicas(batch), mesh_size("seq")
        return constrain(jnp.broadcast_to(rows[None, None], (d, c, *rows.shape)),
                         (self.replica_name(d), "seq" if c > 1 else None, *self.NAMES))

    @staticmethod
    def replica_name(d: int) -> str | None:
        """The logical name of the replica dimension: split like the batch, or whole where there is one copy."""
        return "batch" if d > 1 else None

    def replica_names(self, rows: jax.Array) -> tuple[str | None, ...]:
        """The logical names of ``replica_rows``' (D, C, V, H)."""
        return self.replica_name(rows.shape[0]), "seq" if rows.shape[1] > 1 else None, *self.NAMES

    def by_replica(self, x: jax.Array, rows: jax.Array, names: Sequence[str]) -> jax.Array:
        """(B, S, ...) -> (D, C, B/D, S/C, ...): a batch-major array grouped like ``rows``' copies (``names``: the
        names after the sequence's)."""
        d, c = rows.shape[:2]
        (b, s), rest = x.shape[:2], x.shape[2:]
        grouped = jnp.swapaxes(x.reshape(d, b // d, c, s // c, *rest), 1, 2)
        return constrain(grouped, (*self.replica_names(rows)[:2], None, None, *names))

    @staticmethod
    def ungrouped(x: jax.Array) -> jax.Array:
        """``by_replica``'s (D, C, B/D, S/C, ...) back to (B, S, ...)."""
        d, c, b, s = x.shape[:4]
        return jnp.swapaxes(x, 1, 2).reshape(d * b, c * s, *x.shape[4:])

    def __call__(self, ids: jax.Array, rows: jax.Array | None = None) -> jax.Array:  # (B, S) -> (B, S, H)
        """The ids' rows; ``rows``: the step's ``replica_rows`` (read here when not given)."""
        axis, vocab, rows = sequence_axis(), axis_of("vocab"), self.replica_rows(ids.shape[0]) if rows is None else rows
        if vocab is None:  # one device, or the vocabulary not split
            take = jax.vmap(jax.vmap(lambda r, i: jnp.take(r, i, axis=0)))
            found = take(rows, self.by_replica(ids, rows, ()))  # (D, C, B/D, S/C, H)
            return self.ungrouped(found).astype(self.dtype)

        def looked_up(ids, rows):  # per device: ids (B/D, S/C), its rows (1, 1, V/t, H) -> (B/D, S/C[/t], H)
            rows = rows[0, 0]
            local = ids - jax.lax.axis_index(vocab) * rows.shape[0]
            owned = (local >= 0) & (local < rows.shape[0])
            found = jnp.where(owned[..., None], jnp.take(rows, jnp.where(owned, local, 0), axis=0), 0.0)
            # One shard owns each row, the others add zeros: summing in the compute dtype is exact, and moves half
            # the bytes of an fp32 sum in 16-bit runs (the partitioner, left to itself, reduces the fp32 rows). The
            # gradient is cast back before the rows' scatter-add, which stays fp32.
            found = found.astype(self.dtype)
            if axis is None:
                return jax.lax.psum(found, vocab)
            return jax.lax.psum_scatter(found, axis, scatter_dimension=SEQUENCE_DIM, tiled=True)

        return on_shards(looked_up, (ids, rows), (("batch", "seq"), self.replica_names(rows)), RESIDUAL)

    def attend(self, x: jax.Array, rows: jax.Array | None = None) -> jax.Array:  # (B, S, H) -> (B, S, V)
        """Vocab-sharded logits ``x @ E^T``; ``rows``: the step's ``replica_rows`` (read here when not given)."""
        axis, rows = sequence_axis(), self.replica_rows(x.shape[0]) if rows is None else rows
        if axis is None:
            logits = jax.vmap(jax.vmap(self.logits))(self.by_replica(x, rows, ("embed",)), rows)  # (D, C, .., V)
            return constrain(self.ungrouped(logits), ("batch", "seq", "vocab"))

        def gathered(x, rows):  # per device: (B/D, S/(C t), H), (1, 1, V/t, H) -> (B/D, S/C, V/t)
            return self.logits(jax.lax.all_gather(x, axis, axis=SEQUENCE_DIM, tiled=True), rows[0, 0])

        return on_shards(gathered, (x, rows), (RESIDUAL, self.replica_names(rows)), ("batch", "seq", "vocab"))

    def logits(self, x: jax.Array, rows: jax.Array) -> jax.Array:
        """``x @ rows^T`` in the compute dtype."""
        return x.astype(self.dtype) @ rows.astype(self.dtype).T


class LayerNorm(nnx.Module):
    """LayerNorm with replicated scale and bias; statistics in fp32 whatever the compute dtype."""

    def __init__(self, features: int, *, eps: float = 1e-5, dtype: jnp.dtype, rngs: nnx.Rngs):
        self.eps = eps
        self.dtype = dtype
        self.scale = make_param(rngs, nnx.initializers.ones, (features,), ("embed",))
        self.bias = make_param(rngs, nnx.initializers.zeros, (features,), ("embed",))

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(-1, keepdims=True)
        scale, bias = (param_at_use(p[...], ("embed",)) for p in (self.scale, self.bias))
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps) * scale + bias
        return y.astype(self.dtype)


def dropout(x: jax.Array, rate: float, key: jax.Array | None, indices: Sequence[jax.Array] | None = None,
            block_order: jax.Array | None = None) -> jax.Array:
    """Inverted dropout of ``x`` (rows first); identity when ``key`` is None or rate is 0.

    Keyed by row and position: the mask of row r's element (i_1, .., i_k) of its first k axes after the rows is
    drawn from ``fold_in(.. fold_in(fold_in(key, g), j_1) .., j_k)`` for the block of the remaining axes
    (partitionable threefry), where g is the row's index in the step's global batch (``sharding.batch_rows``: the
    training step's micro-batch and a pipeline stage's rows set it) and j_a = ``indices[a][i_a]``: by default, for
    an activation (B, S, ...), its tokens' positions (``sharding.sequence_positions``: context parallelism's
    balanced order sets them), and nothing for (B, H). So a mask element depends on the key (seed, step, layer),
    the row, its position and place only, whatever the mesh, the accumulation split, the microbatches, the stage or
    the order the sequence is held in: replicated activations get identical masks on every model shard, split ones
    their slices, and each device draws only its own rows. ``block_order``: the positions the block's last axis
    holds, in its order (attention's keys under context parallelism), where the mask is drawn in position order.
    """
    if key is None or rate == 0.0:
        return x
    if indices is None:
        indices = (sequence_positions(x.shape[1]),) if x.ndim >= 3 else ()
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, batch_rows(x.shape[0]))  # (B,)
    for index in indices:  # (B, n_1, .., n_a)
        keys = _fold_each(keys, index)
    block = x.shape[1 + len(indices):]
    draw = lambda k: jax.random.bernoulli(k, 1.0 - rate, block)  # noqa: E731
    for _ in range(1 + len(indices)):
        draw = jax.vmap(draw)
    keep = draw(keys)
    if block_order is not None:
        keep = jnp.take(keep, block_order, axis=-1)
    return jnp.where(keep, x / (1.0 - rate), jnp.zeros_like(x))


def _fold_each(keys: jax.Array, index: jax.Array) -> jax.Array:
    """(..., ) keys -> (..., n): each key folded with each of ``index``'s n values."""
    fold = jax.vmap(jax.random.fold_in, in_axes=(None, 0))
    for _ in range(keys.ndim):
        fold = jax.vmap(fold, in_axes=(0, None))
    return fold(keys, index)


def gelu(x: jax.Array) -> jax.Array:
    """GeLU, tanh approximation (GPT-2; Megatron's fused bias-GeLU)."""
    return jax.nn.gelu(x, approximate=True)


def gelu_erf(x: jax.Array) -> jax.Array:
    """GeLU with the exact erf (BERT, Hugging Face's ``gelu``)."""
    return jax.nn.gelu(x, approximate=False)


ACTIVATIONS = {"gelu_tanh": gelu, "gelu": gelu_erf}


def scaled_init_std(std: float, num_layers: int) -> float:
    """Std of the weights that feed a residual add: std / sqrt(2 N) (paper Section 4.2)."""
    return std / math.sqrt(2.0 * num_layers)
