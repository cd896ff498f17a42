"""Grouped GEMMs for the routed experts: ``out[r] = lhs[r] @ rhs[g(r)]`` for rows ``r`` grouped by expert ``g``
(``sizes[g]`` rows each, in order; rows past their sum give zeros), ``jax.lax.ragged_dot``'s contract.

XLA:GPU lowers ``ragged_dot`` as a dense GEMM over every group's weights, each row masked to its own: G times the
FLOPs of the rows it holds, padding included (read from the step compiled for H100s). Here a Pallas kernel
(Triton on NVIDIA GPUs) computes tiles of ``block_m`` rows of one group only, and the tiles past the last group's
rows end at once: the work is the routed rows' (plus at most one partial tile per group), whatever room the
buffer has. Its derivative is two more kernels: the rows' gradient the same kernel over each group's transposed
weights, the weights' a kernel per group summing its rows (``lhs_g^T @ out_g``).

Under ``train.precision=fp8`` the kernels' operands are FP8 (``_fp8_gemm``: all E4M3, each expert's weights scaled
by their own amax); ``ragged_dot`` stays in the compute dtype.

``model.expert_gemm`` chooses: ``xla`` (``jax.lax.ragged_dot``), ``pallas`` (this kernel; on a CPU in Pallas's
interpret mode, for tests: slow), ``auto`` (the kernel where the step is traced for NVIDIA GPUs from Ampere on, else
``xla``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from megajax.parallel.fp8 import FORWARD, nvidia_capability, quantize
from megajax.parallel.xla_options import platform_choice, traced_device

GEMMS = ("auto", "xla", "pallas")
# A tile's rows and columns, and its depth (a dimension smaller than one takes its own power of two, at least 16):
# two 2-byte operands' 128 x 64 blocks are 32 KiB a pipeline stage, 3 stages within an A100's 164 KiB of shared
# memory (4-byte operands: 2 stages)
BLOCK, DEPTH = 128, 64


def gemm_of(setting: str) -> str:
    """The grouped GEMM a step traced now runs for ``model.expert_gemm`` = ``setting``: ``xla``, ``pallas`` (the
    kernel compiled) or ``interpret`` (the kernel in Pallas's interpret mode: not an NVIDIA GPU)."""
    how = platform_choice(setting, "model.expert_gemm", "pallas", "xla", "interpret")
    capability = nvidia_capability(traced_device())
    if setting == "auto" and capability and capability < (8, 0):
        return "xla"  # the kernels are compiled and tested here for Ampere and Hopper targets only
    return how


def grouped_gemm(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array, how: str = "xla", fp8: bool = False) -> jax.Array:
    """(M, K) rows grouped by ``sizes`` (G,) times (G, K, N) -> (M, N), by ``how`` (``gemm_of``). ``fp8``: the
    kernel's operands in FP8 (``_fp8_gemm``; ``xla``'s ``ragged_dot`` stays in ``lhs``'s dtype)."""
    if how == "xla":
        return jax.lax.ragged_dot(lhs, rhs, sizes)
    if fp8:
        return _fp8_gemm(lhs, rhs, sizes.astype(jnp.int32), (how == "interpret", lhs.dtype, rhs.dtype))
    return _kernel_gemm(lhs, rhs, sizes.astype(jnp.int32), how == "interpret")


def _varying(*xs: jax.Array):
    """Inside a ``shard_map``, the mesh axes a result computed from ``xs`` varies over (a ``pallas_call``'s output
    declares them); outside, none."""
    return jax.typeof(sum(x.reshape(-1)[0].astype(jnp.float32) for x in xs)).mat


def _block(dim: int, most: int = BLOCK, least: int = 16) -> int:
    return min(most, max(least, 1 << (dim - 1).bit_length()))


def _least(dtype: jnp.dtype) -> int:
    """A tile dimension's least size for operands of ``dtype``: Hopper's FP8 MMA reads 32 of the depth at once."""
    return 32 if jnp.dtype(dtype).itemsize == 1 else 16


def _compiler_params(dtype: jnp.dtype) -> plgpu.CompilerParams:
    return plgpu.CompilerParams(num_warps=4, num_stages=3 if jnp.dtype(dtype).itemsize <= 2 else 2)


def _padded(x: jax.Array, axis: int, to: int) -> jax.Array:
    extra = -x.shape[axis] % to
    return x if not extra else jnp.pad(x, [(0, extra if a == axis else 0) for a in range(x.ndim)])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _kernel_gemm(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array, interpret: bool) -> jax.Array:
    return _gmm(lhs, rhs, sizes, interpret, transposed=False)


def _kernel_gemm_fwd(lhs, rhs, sizes, interpret):
    return _gmm(lhs, rhs, sizes, interpret, transposed=False), (lhs, rhs, sizes)


def _kernel_gemm_bwd(interpret, residuals, g):
    lhs, rhs, sizes = residuals
    return (_summed_like(_gmm(g.astype(lhs.dtype), rhs, sizes, interpret, transposed=True), lhs),
            _summed_like(_tgmm(lhs, g.astype(lhs.dtype), sizes, rhs.shape, interpret), rhs).astype(rhs.dtype), None)


def _summed_like(grad: jax.Array, primal: jax.Array) -> jax.Array:
    """``grad`` summed over the mesh axes it varies over and ``primal`` does not (inside a ``shard_map``: the
    weights' gradient from each data shard's rows, summed in the kernel's fp32 before the cast to the weights'
    dtype), as the transpose of a dot would."""
    axes = tuple(sorted(jax.typeof(grad).mat.varying - jax.typeof(primal).mat.varying))
    return jax.lax.psum(grad, axes) if axes else grad


_kernel_gemm.defvjp(_kernel_gemm_fwd, _kernel_gemm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _fp8_gemm(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array, static: tuple) -> jax.Array:
    """The kernels on FP8 operands, all E4M3 (Triton's FP8 dot takes two operands of one type, so the output
    gradient is E4M3 too: Transformer Engine's ``E4M3`` format, DeepSeek-V3's choice): the rows per tensor, each
    expert's weights by their own amax (``fp8.quantize``), fp32 accumulation, each group's product scaled back
    once (powers of two: exact) and rounded to ``lhs``'s dtype. The backward pass reuses the forward's FP8
    operands (one byte a value kept). ``static``: (interpret, lhs's dtype, rhs's dtype)."""
    return _fp8_gemm_fwd(lhs, rhs, sizes, static)[0]


def _fp8_gemm_fwd(lhs, rhs, sizes, static):
    interpret, out, _ = static
    xq, x_inv = quantize(lhs, FORWARD)
    wq, w_inv = quantize(rhs, FORWARD, each=True)
    y = _gmm(xq, wq, sizes, interpret, transposed=False, scales=x_inv * w_inv, out=out)
    return y, (xq, x_inv, wq, w_inv, sizes)


def _fp8_gemm_bwd(static, residuals, g):
    interpret, x_dtype, w_dtype = static
    xq, x_inv, wq, w_inv, sizes = residuals
    gq, g_inv = quantize(g, FORWARD)
    dx = _gmm(gq, wq, sizes, interpret, transposed=True, scales=g_inv * w_inv, out=x_dtype)
    dw = _tgmm(xq, gq, sizes, wq.shape, interpret) * (x_inv * g_inv)
    return _summed_like(dx, xq), _summed_like(dw, wq).astype(w_dtype), None


_fp8_gemm.defvjp(_fp8_gemm_fwd, _fp8_gemm_bwd)


def _tiles(sizes: jax.Array, rows: int, bm: int) -> tuple[jax.Array, ...]:
    """Each tile's (group, row block) and the groups' (start, end) rows: a group's tiles cover its row blocks, the
    groups' in order, ``cdiv(rows, bm) + G - 1`` tiles at most; the tiles past the last group's are ``G`` (none)."""
    g = sizes.shape[0]
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    first = starts // bm
    count = jnp.where(sizes > 0, (ends + bm - 1) // bm - first, 0)  # row blocks each group touches
    tile_ends = jnp.cumsum(count)
    t = jnp.arange(pl.cdiv(rows, bm) + g - 1)
    group = jnp.searchsorted(tile_ends, t, side="right").astype(jnp.int32)  # G past the last
    clipped = jnp.minimum(group, g - 1)
    block = first[clipped] + t - (tile_ends - count)[clipped]
    return group, block.astype(jnp.int32), starts.astype(jnp.int32), ends.astype(jnp.int32)


def _gmm(lhs: jax.Array, rhs: jax.Array, sizes: jax.Array, interpret: bool, transposed: bool,
         scales: jax.Array | None = None, out: jnp.dtype | None = None) -> jax.Array:
    """lhs (M, K) x rhs (G, K, N) -> (M, N) grouped (``transposed``: rhs (G, N, K), each group's transposed);
    ``scales`` (G,): each group's product multiplied by its own (fp32) before the result is cast to ``out``
    (default ``lhs``'s dtype)."""
    m, k = lhs.shape
    groups, n = rhs.shape[0], rhs.shape[1] if transposed else rhs.shape[2]
    least = _least(lhs.dtype)
    bm, bk, bn = _block(m, least=least), _block(k, DEPTH, least), _block(n, least=least)
    scales = jnp.ones((groups,), jnp.float32) if scales is None else scales.astype(jnp.float32)
    lhs = _padded(_padded(lhs, 0, bm), 1, bk)
    rhs = _padded(_padded(rhs, 1, bn if transposed else bk), 2, bk if transposed else bn)
    group, block, starts, ends = _tiles(sizes, m, bm)
    depth = lhs.shape[1] // bk

    def kernel(group_ref, block_ref, start_ref, end_ref, scale_ref, lhs_ref, rhs_ref, out_ref):
        t, j = pl.program_id(0), pl.program_id(1)
        g = group_ref[t]

        @pl.when(g < groups)  # tiles past the last group's rows: nothing to do
        def _():
            row0 = block_ref[t] * bm
            rows = row0 + jnp.arange(bm)
            mine = (rows >= start_ref[g]) & (rows < end_ref[g])  # this group's rows of the block

            def step(i, acc):
                a = plgpu.load(lhs_ref.at[pl.ds(row0, bm), pl.ds(i * bk, bk)], mask=mine[:, None], other=0.0)
                if transposed:
                    b = rhs_ref[g, pl.ds(j * bn, bn), pl.ds(i * bk, bk)]
                    return acc + plgpu.dot(a, b, trans_b=True, allow_tf32=False)
                b = rhs_ref[g, pl.ds(i * bk, bk), pl.ds(j * bn, bn)]
                return acc + plgpu.dot(a, b, allow_tf32=False)

            acc = jax.lax.fori_loop(0, depth, step, jnp.zeros((bm, bn), jnp.float32)) * scale_ref[g]
            plgpu.store(out_ref.at[pl.ds(row0, bm), pl.ds(j * bn, bn)], acc.astype(out_ref.dtype),
                        mask=mine[:, None])

    out = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((lhs.shape[0], rhs.shape[1] if transposed else rhs.shape[2]),
                                               out or lhs.dtype, manual_axis_type=_varying(lhs, rhs, sizes)),
        grid=(group.shape[0], pl.cdiv(n, bn)), interpret=interpret,
        compiler_params=_compiler_params(lhs.dtype), name="grouped_gemm",
    )(group, block, starts, ends, scales, lhs, rhs)[:m, :n]
    return jnp.where((jnp.arange(m) < ends[-1])[:, None], out, 0)  # rows past the groups: zeros, not stale


def _tgmm(lhs: jax.Array, grad: jax.Array, sizes: jax.Array, shape: tuple[int, int, int], interpret: bool
          ) -> jax.Array:
    """Each group's lhs_g^T (K, rows) x grad_g (rows, N) -> (G, K, N) (zeros for an empty group)."""
    m = lhs.shape[0]
    groups, k, n = shape
    least = _least(lhs.dtype)
    bm, bk, bn = _block(m, DEPTH, least), _block(k, least=least), _block(n, least=least)  # the rows: the depth
    lhs = _padded(_padded(lhs, 0, bm), 1, bk)
    grad = _padded(_padded(grad, 0, bm), 1, bn)
    ends = jnp.cumsum(sizes).astype(jnp.int32)
    starts = ends - sizes

    def kernel(start_ref, end_ref, lhs_ref, grad_ref, out_ref):
        g, i, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
        start, end = start_ref[g], end_ref[g]

        def step(b, acc):
            rows = b * bm + jnp.arange(bm)
            mine = ((rows >= start) & (rows < end))[:, None]
            a = plgpu.load(lhs_ref.at[pl.ds(b * bm, bm), pl.ds(i * bk, bk)], mask=mine, other=0.0)
            d = plgpu.load(grad_ref.at[pl.ds(b * bm, bm), pl.ds(j * bn, bn)], mask=mine, other=0.0)
            return acc + plgpu.dot(a, d, trans_a=True, allow_tf32=False)

        acc = jax.lax.fori_loop(start // bm, (end + bm - 1) // bm, step, jnp.zeros((bk, bn), jnp.float32))
        out_ref[...] = acc[None].astype(out_ref.dtype)

    out = pl.pallas_call(
        kernel, out_shape=jax.ShapeDtypeStruct((groups, lhs.shape[1], grad.shape[1]), jnp.float32,
                                               manual_axis_type=_varying(lhs, grad, sizes)),
        grid=(groups, lhs.shape[1] // bk, grad.shape[1] // bn),
        out_specs=pl.BlockSpec((1, bk, bn), lambda g, i, j: (g, i, j)), interpret=interpret,
        compiler_params=_compiler_params(lhs.dtype), name="grouped_gemm_weights",
    )(starts, ends, lhs, grad)
    return out[:, :k, :n]
