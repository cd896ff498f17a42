"""The real training step compiled for NVIDIA GPUs on a host without one.

JAX compiles for devices it only describes (``jax.experimental.topologies``): with the CUDA plugin installed
(``pip install 'megajax[gpu-compile]'``: jax-cuda12-plugin and jax-cuda12-pjrt, no CUDA wheels) and ``ptxas`` on the
PATH, a CPU process gets compile-only GPUs from a ``GpuTargetConfigProto`` (``target_config``: the device's facts)
and compiles ``training.loop.setup_run``'s step for a mesh of them: the optimized GPU HLO, XLA's memory plan and the
collectives as the GPU would run them.

What is not known without the device: autotuning (cuBLAS / Triton picks may differ on the real GPU), the cuDNN
workspace (its temp is a little low), and ``cost_analysis()`` of the GPU executable, which XLA does not implement
(the CPU client's HLO cost analysis of the module counts one pass of each layer loop and no custom call, so it is
not used: the model's FLOPs come from its spec).

``jax.nn.dot_product_attention(implementation="cudnn")`` probes the local GPU's cuDNN version and compute capability
while it traces; ``compile_step`` answers those probes for the target, only while it compiles.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import re
import shutil
from collections.abc import Iterator
from unittest import mock

import jax

from megajax.config import RunSpec
from megajax.errors import UserError
from megajax.parallel import hlo_audit
from megajax.parallel.fp8 import fp8_refusal
from megajax.platform import quiet_cuda_notices
from megajax.tools.memory_planner import CompiledMemory, MemoryReport, memory_report, run_memory, with_batch
from megajax.training.loop import Run, setup_run, step_options

EXTRA = "gpu-compile"  # pyproject.toml's extra with the CUDA plugin


class GpuTargetError(UserError):
    """A GPU target that cannot be compiled for here (unknown, plugin or ptxas missing, mesh too large)."""


@dataclasses.dataclass(frozen=True)
class GpuTarget:
    """An NVIDIA GPU's facts as XLA's GPU compiler reads them (from NVIDIA's datasheets)."""

    kind: str  # the device kind the driver reports (what megajax.training.metrics reads the peak FLOP/s by)
    compute_capability: tuple[int, int]
    cores: int  # streaming multiprocessors
    fpus_per_core: int
    memory_bytes: int  # device memory the driver reports
    memory_bandwidth: float  # bytes/s
    l2_bytes: int
    clock_ghz: float
    shared_memory_per_core: int
    shared_memory_per_block_optin: int
    cudnn: tuple[int, int, int]  # the cuDNN version compiled against
    # the CUDA runtime the host runs (what the plugin's with-cuda extra installs); XLA lowers FP8 GEMMs to cuBLASLt
    # only where it knows one (12.x)
    cuda_runtime: tuple[int, int, int] = (12, 8, 0)

    @property
    def cudnn_version(self) -> int:
        """As cuDNN reports it (9.10.0 -> 91000)."""
        major, minor, patch = self.cudnn
        return major * 10000 + minor * 100 + patch


TARGETS = {
    "h100": GpuTarget("NVIDIA H100 80GB HBM3", (9, 0), 132, 128, 84_942_979_072, 3.35232e12, 50 * 2**20, 1.98,
                      233_472, 232_448, (9, 10, 0)),
    "h200": GpuTarget("NVIDIA H200 141GB HBM3e", (9, 0), 132, 128, 151_397_597_184, 4.8e12, 50 * 2**20, 1.98,
                      233_472, 232_448, (9, 10, 0)),
    "a100": GpuTarget("NVIDIA A100-SXM4-80GB", (8, 0), 108, 64, 85_100_068_864, 2.03904e12, 40 * 2**20, 1.41,
                      167_936, 166_912, (9, 10, 0)),
}


def target_config(target: GpuTarget) -> str:
    """The ``GpuTargetConfigProto`` text of ``target`` (what XLA's GPU compiler reads instead of a device)."""
    major, minor = target.compute_capability
    cudnn_major, cudnn_minor, cudnn_patch = target.cudnn
    return f"""gpu_device_info {{
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: {target.shared_memory_per_core}
  threads_per_core_limit: 2048
  core_count: {target.cores}
  fpus_per_core: {target.fpus_per_core}
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: {int(target.memory_bandwidth)}
  l2_cache_size: {target.l2_bytes}
  clock_rate_ghz: {target.clock_ghz}
  device_memory_size: {target.memory_bytes}
  shared_memory_per_block_optin: {target.shared_memory_per_block_optin}
  cuda_compute_capability {{ major: {major} minor: {minor} }}
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
  runtime_version: "{'.'.join(map(str, target.cuda_runtime))}"
}}
platform_name: "CUDA"
dnn_version_info {{ major: {cudnn_major} minor: {cudnn_minor} patch: {cudnn_patch} }}
device_description_str: "{target.kind}"
"""


def target_of(name: str) -> GpuTarget:
    """The target named ``name`` (``h100``, ``h200``, ``a100``); GpuTargetError naming the choices otherwise."""
    if name not in TARGETS:
        raise GpuTargetError(f"--target={name}: megajax compiles for {', '.join(sorted(TARGETS))}")
    return TARGETS[name]


def check_target(run: RunSpec, target: str, hosts: int = 1, gpus_per_host: int = 8) -> None:
    """GpuTargetError unless ``hosts`` x ``gpus_per_host`` GPUs ``target`` (both counts >= 1) hold ``run``'s mesh
    and run its precision (FP8 GEMMs need FP8 tensor cores): checked before anything is planned or compiled."""
    gpu = target_of(target)
    if run.model.fp8 and (refusal := fp8_refusal(gpu.kind, gpu.compute_capability)):
        raise GpuTargetError(refusal)
    if hosts < 1 or gpus_per_host < 1:
        raise GpuTargetError(f"--hosts={hosts} and {gpus_per_host} GPUs per host: both must be >= 1")
    used = run.mesh.devices
    if used > hosts * gpus_per_host:
        raise GpuTargetError(f"mesh {run.mesh.spelling} needs {used} GPUs; --hosts={hosts} x {gpus_per_host} has "
                             f"{hosts * gpus_per_host}: raise --hosts or shrink the mesh")


def gpu_devices(name: str, hosts: int = 1, gpus_per_host: int = 8) -> list[jax.Device]:
    """Compile-only devices of ``hosts`` x ``gpus_per_host`` GPUs ``name``; GpuTargetError saying what to install
    where the CUDA plugin or ptxas is missing."""
    target = target_of(name)
    if hosts < 1 or gpus_per_host < 1:
        raise GpuTargetError(f"--hosts={hosts} and {gpus_per_host} GPUs per host: both must be >= 1")
    if importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
        raise GpuTargetError(f"compiling for an NVIDIA GPU needs JAX's CUDA plugin: pip install 'megajax[{EXTRA}]'")
    if shutil.which("ptxas") is None:
        raise GpuTargetError("compiling for an NVIDIA GPU needs ptxas (CUDA's assembler) on the PATH: install the "
                             "CUDA toolkit, or pip install nvidia-cuda-nvcc-cu12 and put its bin/ on the PATH")
    from jax.experimental import topologies

    try:
        with quiet_cuda_notices():
            topology = topologies.get_topology_desc(platform="cuda", topology=f"1x{hosts}x{gpus_per_host}",
                                                target_config=target_config(target))
    except Exception as e:  # noqa: BLE001 - the plugin's own error, as one line
        hint = ""
        if "not implemented for cuda" in str(e):  # the plugin failed its CUDA check when jax's backends started
            asked = jax.config.jax_platforms or "unset"
            hint = (f"; JAX's CUDA plugin did not start: without a GPU it starts only under JAX_PLATFORMS=cpu (jax "
                    f"started with {asked}; megajax sets cpu when imported before jax): set JAX_PLATFORMS=cpu")
        raise GpuTargetError(f"JAX's CUDA plugin cannot describe {hosts} x {gpus_per_host} {target.kind}: {e}{hint}") \
            from None
    return list(topology.devices)


def _at_least(have: tuple[int, ...], want: str) -> bool:
    return have >= tuple(int(x) for x in want.split("."))


@contextlib.contextmanager
def cudnn_probes_answered(target: GpuTarget) -> Iterator[None]:
    """While compiling for ``target``: jax's cuDNN attention asks the local GPU for its cuDNN version and compute
    capability; these answers are the target's."""
    from jax._src.cudnn import fused_attention_stablehlo as probes

    cc = target.compute_capability
    with mock.patch.object(probes, "check_cudnn_version", lambda: target.cudnn_version), \
            mock.patch.object(probes, "check_compute_capability", lambda want: _at_least(cc, want)), \
            mock.patch.object(probes, "is_cuda_compute_capability_equal",
                              lambda want: cc == tuple(int(x) for x in want.split("."))):
        yield


@dataclasses.dataclass
class GpuStep:
    """The training step compiled for GPUs, and what was read from it."""

    target: GpuTarget
    run: Run
    hlo: str  # the optimized, scheduled HLO module
    compiled: CompiledMemory  # XLA's memory plan, per device
    planned: MemoryReport  # megajax's memory planner for the same step
    collectives: list[hlo_audit.Collective]
    options: dict  # the XLA compiler options it was compiled with

    @property
    def gemms(self) -> int:
        """cuBLAS GEMM calls in the HLO (each once, whatever the loops around it)."""
        return len(re.findall(r'custom_call_target="__cublas\$(?:lt\$)?(?:matmul|gemm)', self.hlo))

    @property
    def fp8_gemms(self) -> int:
        """Of ``gemms``, cuBLASLt's FP8 calls (``train.precision=fp8``'s block GEMMs)."""
        return self.hlo.count('custom_call_target="__cublas$lt$matmul$f8"')

    @property
    def attention(self) -> str:
        """'cudnn' (flash attention, forward and backward) or 'xla' (megajax's einsum softmax)."""
        return "cudnn" if "__cudnn$fmha" in self.hlo else "xla"


def compile_step(run: RunSpec, target: str = "h100", hosts: int = 1, gpus_per_host: int = 8,
                 micro_batch: int | None = None, options: dict | None = None, num_micro: int = 1) -> GpuStep:
    """``run``'s training step (its mesh, at most ``hosts`` x ``gpus_per_host`` devices) compiled for GPUs ``target``
    with ``micro_batch`` sequences per data shard and ``num_micro`` accumulation steps (default: the run's global
    batch over its data shards, at once), under megajax's XLA options for the platform (``options``: others, ``{}``
    for none). Nothing is allocated."""
    gpu = target_of(target)
    check_target(run, target, hosts, gpus_per_host)
    devices = gpu_devices(target, hosts, gpus_per_host)
    used = run.mesh.devices
    micro_batch = micro_batch or max(run.global_batch // run.mesh.batch_shards, 1)
    planned = with_batch(run, micro_batch, num_micro)
    options = step_options(planned, devices[:used]) if options is None else options
    with cudnn_probes_answered(gpu), quiet_cuda_notices():
        compiled = setup_run(planned, devices[:used], options)
    text = compiled.step_fn.as_text()
    return GpuStep(gpu, compiled, text, run_memory(compiled), memory_report(planned, micro_batch, num_micro, gpu=True),
                   hlo_audit.collectives(text, compiled.mesh), options)


_ASYNC_START = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?\s([a-z\-]+)-start\(")


def overlap(hlo: str) -> dict[str, tuple[str, int]]:
    """For each asynchronous collective (``*-start``) of the scheduled HLO: (its op, how many compute instructions
    (fusions, GEMMs, custom calls) XLA scheduled between its start and its done). 0: it runs exposed."""
    out = {}
    for block in re.split(r"\n(?=\S)", hlo):  # one computation per block, instructions in schedule order
        lines = block.splitlines()
        for i, line in enumerate(lines):
            start = _ASYNC_START.match(line)
            if not start or start.group(2) not in hlo_audit.COLLECTIVE_OPS:
                continue
            name, between = start.group(1), 0
            for later in lines[i + 1:]:
                if f"-done(%{name})" in later or f"-done({name})" in later:
                    break
                if re.search(r"\s(fusion|custom-call|convolution|dot)\(", later):
                    between += 1
            out[name] = (start.group(2), between)
    return out
