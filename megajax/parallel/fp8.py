"""FP8 GEMMs with per-tensor current scaling (``train.precision=fp8``).

Each operand of a block's GEMM is scaled by its own amax just before the product (Transformer Engine's "current
scaling", torchao's "tensorwise" recipe): ``scale`` is the largest power of two with ``amax(|x|) * scale <= fmax``
(``scale_for``; both libraries offer power-of-two scales), ``q = x * scale`` in the FP8 type, and the product of
the dequantised operands is accumulated in fp32. Forward operands (activations, weights) are E4M3 (more mantissa);
the output gradient is E5M2 (more range). (The experts' grouped GEMM kernel, ``parallel/grouped_gemm``, takes
E4M3 for all three: Triton's FP8 dot wants one type.) The backward pass reuses the forward's FP8 operands, so the
residuals kept for it are one byte per value, not two.

The product is written as dequantise-then-dot (``_product``): compiled for Hopper GPUs, XLA's GEMM rewriter turns
it into one cuBLASLt FP8 GEMM (``__cublas$lt$matmul$f8``, the scales passed to it, the result rounded once to
bf16); XLA:CPU runs the same program, exact where the GPU is (power-of-two scales), so the CPU tests hold its
numerics. Where a layer runs per device (under sequence parallelism, ``sharding.on_shards``) the amax is each
device's block's; elsewhere it is the whole tensor's (XLA reduces a scalar over the shards).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from megajax.errors import ConfigError

FORWARD = jnp.float8_e4m3fn  # activations and weights
BACKWARD = jnp.float8_e5m2  # output gradients


def fp8_max(dtype: jnp.dtype) -> float:
    """The largest finite value of the FP8 type ``dtype`` (448 for E4M3, 57344 for E5M2)."""
    return float(jnp.finfo(dtype).max)


def scale_for(amax: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """The power of two that maps ``amax`` to within ``dtype``'s largest value and at least half of it (fp32): the
    largest ``2^k <= fmax / amax``. A power of two multiplies exactly in every float type, so the dequantised
    operands are exact in bf16 and rescaling adds no rounding. 1 for an all-zero tensor; 2^126 at most."""
    ratio = fp8_max(dtype) / jnp.maximum(amax.astype(jnp.float32), jnp.finfo(jnp.float32).tiny)
    _, exponent = jnp.frexp(ratio)  # ratio = m 2^e with m in [0.5, 1): the largest 2^k <= ratio is 2^(e - 1)
    return jnp.where(amax > 0, jnp.ldexp(jnp.float32(1), jnp.minimum(exponent - 1, 126)), jnp.float32(1))


def quantize(x: jax.Array, dtype: jnp.dtype, each: bool = False) -> tuple[jax.Array, jax.Array]:
    """``x`` scaled by its amax (``scale_for``) onto ``dtype``'s range and cast there, and the fp32 inverse scale
    that turns it back: ``x ~= q * inverse``. ``each``: one scale per ``x[i]`` (the inverse is ``(x.shape[0],)``:
    each expert's weights their own, as Transformer Engine's grouped GEMMs scale them)."""
    amax = jnp.max(jnp.abs(x), axis=tuple(range(1, x.ndim))) if each else jnp.max(jnp.abs(x))
    scale = scale_for(amax, dtype)
    top = fp8_max(dtype)  # the saturation never acts (amax x scale <= fmax); it keeps a NaN-free cast regardless
    wide = scale.reshape(scale.shape + (1,) * (x.ndim - scale.ndim))
    q = jnp.clip(x.astype(jnp.float32) * wide, -top, top).astype(dtype)
    return q, 1.0 / scale


def _product(a: jax.Array, a_inverse: jax.Array, b: jax.Array, b_inverse: jax.Array, dims, out: jnp.dtype) \
        -> jax.Array:
    """``a . b`` over ``dims`` (``dot_general``'s dimension numbers) of FP8 operands dequantised in ``out``: exact
    there (power-of-two scales), accumulated in fp32 and rounded once to ``out``. This dequantise-then-dot is the
    pattern XLA's GPU GEMM rewriter turns into one cuBLASLt FP8 call with the scales as its operands' (on Hopper)."""
    return jax.lax.dot_general(a.astype(out) * a_inverse.astype(out), b.astype(out) * b_inverse.astype(out), dims,
                               preferred_element_type=out)


def fp8_tensordot(x: jax.Array, kernel: jax.Array, n: int, out: jnp.dtype) -> jax.Array:
    """``x`` contracted on its last ``n`` dims with ``kernel``'s first ``n``, both operands in E4M3, the result in
    ``out``; the gradients' GEMMs take the output gradient in E5M2 and the forward's E4M3 operands, and come back
    in ``x``'s and ``kernel``'s dtypes."""
    x, kernel = varying_alike(x, kernel)
    return _tensordot(x, kernel, (n, jnp.dtype(out), x.dtype, kernel.dtype))


def varying_alike(*arrays: jax.Array) -> list[jax.Array]:
    """Inside ``shard_map`` each array marked varying over every mesh axis any of them varies over: the gradients
    of the custom rule then vary alike, and JAX's own transpose of the mark sums a replicated operand's gradient
    over the axes it was broadcast on (the kernel's over ``data``), as it does for a plain ``dot_general``."""
    varying = [jax.typeof(a).manual_axis_type.varying for a in arrays]
    union = frozenset().union(*varying)
    return [jax.lax.pcast(a, tuple(sorted(union - v)), to="varying") if union - v else a
            for a, v in zip(arrays, varying)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _tensordot(x, kernel, static):
    return _forward(x, kernel, static)[0]


def _forward(x, kernel, static):
    n, out, _, _ = static
    xq, x_inv = quantize(x, FORWARD)
    wq, w_inv = quantize(kernel, FORWARD)
    y = _product(xq, x_inv, wq, w_inv, ((tuple(range(x.ndim - n, x.ndim)), tuple(range(n))), ((), ())), out)
    return y, (xq, x_inv, wq, w_inv)


def gradient_dims(x_ndim: int, kernel_ndim: int, n: int) -> tuple[tuple, tuple]:
    """``dot_general``'s dimension numbers for the two gradients of ``x`` (its last ``n`` dims) contracted with
    ``kernel`` (its first ``n``), given the output gradient g: dx = g's output dims against the kernel's ->
    (x's leading dims, kernel's input dims); dkernel = x's leading dims against g's -> (kernel's input dims, its
    output dims)."""
    lead = tuple(range(x_ndim - n))  # x's leading dims, also g's
    g_ndim = len(lead) + kernel_ndim - n
    return ((tuple(range(len(lead), g_ndim)), tuple(range(n, kernel_ndim))), ((), ())), ((lead, lead), ((), ()))


def _backward(static, residuals, g):
    n, out, x_dtype, w_dtype = static
    xq, x_inv, wq, w_inv = residuals
    gq, g_inv = quantize(g, BACKWARD)
    dx_dims, dw_dims = gradient_dims(xq.ndim, wq.ndim, n)
    dx = _product(gq, g_inv, wq, w_inv, dx_dims, out)
    dw = _product(xq, x_inv, gq, g_inv, dw_dims, jnp.float32)  # accumulated in fp32
    return dx.astype(x_dtype), dw.astype(w_dtype)


_tensordot.defvjp(_forward, _backward)


# the first NVIDIA GPUs with FP8 tensor cores: Ada (8.9), then Hopper (9.0) and later
FP8_COMPUTE_CAPABILITY = (8, 9)


def fp8_refusal(kind: str, compute_capability: tuple[int, int]) -> str:
    """Why an NVIDIA GPU ``kind`` of ``compute_capability`` cannot run FP8 GEMMs ('' where it can)."""
    if compute_capability >= FP8_COMPUTE_CAPABILITY:
        return ""
    major, minor = compute_capability
    return (f"train.precision=fp8: the {kind} (compute capability {major}.{minor}) has no FP8 tensor cores (they "
            f"need 8.9 or newer: Ada, Hopper); use train.precision=bf16")


def nvidia_capability(device) -> tuple[int, int] | None:
    """An NVIDIA GPU's compute capability (major, minor); None for other devices (and compile-only ones, which
    report none: ``tools.gpu_target`` checks its target's)."""
    capability = getattr(device, "compute_capability", None)
    if device.platform != "gpu" or not capability:
        return None
    major, minor = (int(v) for v in str(capability).split(".")[:2])
    return major, minor


def check_fp8_devices(devices) -> None:
    """ConfigError where FP8 GEMMs were asked for NVIDIA GPUs without FP8 tensor cores (before anything compiles).
    Other platforms run them as XLA lowers them (XLA:CPU emulates FP8)."""
    capability = nvidia_capability(devices[0]) if devices else None
    if capability and (refusal := fp8_refusal(devices[0].device_kind, capability)):
        raise ConfigError(refusal)
