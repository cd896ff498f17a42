"""The XLA options megajax compiles its steps with, per platform.

On NVIDIA GPUs these are the options MaxText and NVIDIA's JAX-Toolbox recommend for H100 training, applied to
every program megajax compiles (``compile(compiler_options=...)``, so they hold whatever ``XLA_FLAGS`` says and can
be compared with and without in one process, as ``bench/gpu_benchmark.py`` does). What each does in the compiled
step, read from its HLO (tests/test_gpu_target.py, bench/README.md):

* the latency-hiding scheduler makes every collective asynchronous and schedules compute between its start and
  its done: inside the data-parallel gradient reduction (the backward pass) and inside most tensor-parallel
  all-reduces (llama3_8b on 1x8 H100s at micro-batch 16: 2-6 compute ops in the forward ones, 0-11 in the backward
  ones; ``megajax.info --target ... --compiled`` prints each). Counted in the schedule, not timed;
* combine thresholds of 128 MiB let XLA fuse the many small gradient reductions into few large ones;
* pipelined all-gather / reduce-scatter / all-reduce and while-loop double buffering move a scanned layer's
  collectives into the previous iteration, so the layer loop (``nnx.scan``) overlaps them too;
* cuBLAS, not Triton, for the GEMMs (Triton's autotuning needs the device; without it cuBLAS's heuristics are
  the better default).

Other platforms get no options (XLA's defaults).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

COMBINE_BYTES = 128 * 2**20

NVIDIA_GPU: dict[str, bool | int] = {
    "xla_gpu_enable_latency_hiding_scheduler": True,
    "xla_gpu_enable_triton_gemm": False,
    "xla_gpu_all_reduce_combine_threshold_bytes": COMBINE_BYTES,
    "xla_gpu_all_gather_combine_threshold_bytes": COMBINE_BYTES,
    "xla_gpu_reduce_scatter_combine_threshold_bytes": COMBINE_BYTES,
    "xla_gpu_enable_pipelined_all_gather": True,
    "xla_gpu_enable_pipelined_reduce_scatter": True,
    "xla_gpu_enable_pipelined_all_reduce": True,
    "xla_gpu_enable_while_loop_double_buffering": True,
    "xla_gpu_enable_highest_priority_async_stream": True,
}


def is_nvidia_gpu(device) -> bool:
    """A CUDA device (a ``jax.Device`` or an abstract mesh's ``AbstractDevice``), real or compile-only
    (``jax.experimental.topologies``: its client reports no CUDA version, its kind names the vendor)."""
    if device.platform != "gpu":
        return False
    version = str(getattr(getattr(device, "client", None), "platform_version", "")).lower()
    return "cuda" in version or "nvidia" in str(getattr(device, "device_kind", "")).lower()


def traced_device():
    """The device of the mesh the program is traced under (a compile-only one too, ``megajax.tools.gpu_target``),
    else this host's first."""
    mesh = jax.sharding.get_abstract_mesh()
    return (None if mesh.empty else getattr(mesh, "abstract_device", None)) or jax.devices()[0]


def traced_for_nvidia_gpu() -> bool:
    """Whether the program being traced will run on an NVIDIA GPU (``traced_device``). For the choices whose best
    lowering differs by platform (the attention kernel, how a bad update is skipped)."""
    return is_nvidia_gpu(traced_device())


def platform_choice(setting: str, field: str, gpu: str, elsewhere: str, emulated: str) -> str:
    """What a step traced now runs for ``field`` = ``setting`` (``auto``, ``gpu``, ``elsewhere``: the config checked
    which): ``auto`` is ``gpu`` where the trace targets NVIDIA GPUs and ``elsewhere`` otherwise; ``gpu`` asked for
    on a CPU is ``emulated`` (the same program with the GPU-only part stood in for, for tests), on another platform
    an error."""
    device = traced_device()
    on_gpu = is_nvidia_gpu(device)
    if setting == "auto":
        return gpu if on_gpu else elsewhere
    if setting != gpu or on_gpu:
        return setting
    if device.platform != "cpu":
        raise ValueError(f"{field}={gpu} runs on NVIDIA GPUs (and, emulated for tests, on CPUs), not on "
                         f"{device.platform}: set {field}=auto")
    return emulated


def compiler_options(devices: Sequence[jax.Device], pipelined_all_gather: bool = True) -> dict[str, bool | int]:
    """The options for a program that runs on ``devices`` (the mesh's). ``pipelined_all_gather=False`` leaves XLA's
    all-gather pipelining off: a step that accumulates micro-batches under sequence parallelism. It was where XLA
    held a second micro-batch's sequence-gathered work across the accumulation loop (llama3_8b's plan for 8 H100s,
    4x2, 2 x 64 micro-batches: 127.6 GiB peak with it, 61.5 without); since the step hides that loop's bound from
    XLA (``training.step``) it no longer pipelines across it, and the switch moves the planned steps both ways
    (compiled for 8 H100s: gpt_2p5b's bf16 plan 54.3 GiB with it, 52.6 without; llama3_8b's 54.7 and 59.5): kept
    off there, the planner's rows all within 10% as they are."""
    if not devices or not is_nvidia_gpu(devices[0]):
        return {}
    return {**NVIDIA_GPU, "xla_gpu_enable_pipelined_all_gather": pipelined_all_gather}
