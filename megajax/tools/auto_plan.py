"""``mesh.auto``: train.py plans the run for the devices it finds with the scaling model (``scaling_plan``), checks
the plan by compiling its step (XLA's peak against the device's memory, before the first step; over it, the next
plan) and trains it.

The plan is what ``python -m megajax.scaling --config=... --gpus=N --cluster=C`` recommends for the job's devices:
the mesh (pipe x data x expert x model), the micro-batch (unless ``train.micro_batch_size`` is set), the remat
policy, sequence parallelism, the state split over data and the pipeline schedule. The cluster is the devices':
H100 / H200 -> ``dgx_h100`` (an H200's memory), A100 -> ``dgx_a100``, V100 -> ``dgx2h``, with the memory the
device's allocator holds (JAX's share, ``scaling_clusters.jax_memory``); any other device (the CPU) is planned as if
it were an H100 with JAX's share of its memory (said in the plan), without a memory check (XLA:CPU has no device
memory to exceed).
"""

from __future__ import annotations

import dataclasses

import jax
import ml_collections

from megajax.cli import apply_config_overrides
from megajax.config import NO_SCHEDULE, ConfigError, resolve
from megajax.tools.memory_planner import compiled_memory
from megajax.tools.scaling import CLUSTERS, Cluster, GiB, Prediction, jax_memory
from megajax.tools.scaling_plan import flags, recommend_mesh

# a device kind's words -> the cluster its plan is timed on
KINDS = (("H100", "dgx_h100"), ("H200", "dgx_h100"), ("A100", "dgx_a100"), ("V100", "dgx2h"))


@dataclasses.dataclass(frozen=True)
class AutoPlan:
    """The plan ``plan_for_devices`` applied to the config, and what it was planned and checked against."""

    prediction: Prediction
    cluster: Cluster
    device_kind: str
    compiled_peak_bytes: int | None  # XLA's plan of the step per device (None: not compiled yet)
    device_bytes: int | None  # the device's memory (None: it reports none, as the CPU)

    def describe(self) -> str:
        """The lines train.py prints before training."""
        p, pl = self.prediction, self.prediction.pipeline
        like = "" if any(word in self.device_kind for word, _ in KINDS) else \
            f" (no cluster model for {self.device_kind!r}: planned as if on {self.cluster.name})"
        schedule = f", {pl.schedule} schedule v={pl.repeats} over {pl.microbatches} microbatches" \
            if pl.stages > 1 else ""
        split = "FSDP" if p.run.fsdp else "ZeRO-1" if p.run.shard_optimizer else "none"
        memory = (f"; compiled peak {_size(self.compiled_peak_bytes)} per device"
                  + (f" of {_size(self.device_bytes)}" if self.device_bytes else "")) \
            if self.compiled_peak_bytes is not None else ""
        steps = f"{p.num_micro} accumulation steps" if p.num_micro > 1 else "no accumulation"
        return (f"mesh.auto: {p.mesh.devices} x {self.device_kind} on {self.cluster.name}{like}: --mesh={p.mesh.flag}"
                f", micro-batch {p.micro_batch} ({steps}){schedule}, remat={p.run.model.remat}, sequence "
                f"parallelism {'on' if p.run.sequence else 'off'}, state split {split}; predicted {p.step_s:.3g} "
                f"s/step, {p.mfu:.1%} MFU, {_size(p.memory_bytes)} planned{memory}\n  {flags(p)}")


def _size(nbytes: int) -> str:
    return f"{nbytes / GiB:.1f} GiB" if nbytes >= GiB / 10 else f"{nbytes / 2**20:.1f} MiB"


def cluster_for(device: jax.Device) -> Cluster:
    """The cluster a device's plan is timed on (``KINDS``; the device's own memory where it reports it)."""
    name = next((cluster for word, cluster in KINDS if word in device.device_kind), "dgx_h100")
    cluster = CLUSTERS[name]
    limit = device_bytes(device)  # the allocator's limit: JAX's share of the memory
    return dataclasses.replace(cluster, hbm_bytes=limit) if limit else jax_memory(cluster)


def device_bytes(device: jax.Device) -> int | None:
    """The device's memory as its allocator reports it (None where it reports none: the CPU)."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - a backend without memory statistics
        return None
    return (stats or {}).get("bytes_limit")


def choose_plans(config: ml_collections.ConfigDict, num_devices: int, cluster: Cluster) -> list[Prediction]:
    """The scaling model's plans for ``config`` on ``num_devices`` GPUs of ``cluster`` that fit, fastest first (one
    per mesh, its micro-batch chosen unless ``train.micro_batch_size`` is set); ConfigError where the model is not
    one it plans, or where none fits."""
    planning = config.copy_and_resolve_references()
    planning.mesh.update(pipe=1, data=1, model=1, expert=1, context=1)
    planning.parallel.update(NO_SCHEDULE)
    run = resolve(planning, 1, training=False)
    if not run.model_spec.causal_lm:
        raise ConfigError(f"mesh.auto plans causal language models (the scaling model's); {run.model_name} is not "
                          "one: set the mesh (--mesh=DATAxMODEL) and leave mesh.auto=False")
    n, micro = num_devices, config.train.micro_batch_size or None
    best, table = recommend_mesh(run, n, cluster, config.train.global_batch_size, micro, choose=True,
                                 search_micro=micro is None)
    if best is None:
        least = min(table, key=lambda p: p.memory_bytes) if table else None
        need = f" (the least memory: {least.memory_bytes / GiB:.1f} GiB per device on --mesh={least.mesh.flag}, of " \
               f"{cluster.hbm_bytes / GiB:.1f})" if least else ""
        raise ConfigError(f"mesh.auto: no plan of the {n} device{'s' * (n > 1)} fits{need}: add devices, lower "
                          "train.global_batch_size or model.max_seq_len, or set the mesh yourself")
    return [p for p in table if p.fits]


def choose_plan(config: ml_collections.ConfigDict, num_devices: int, cluster: Cluster) -> Prediction:
    """The fastest of ``choose_plans``."""
    return choose_plans(config, num_devices, cluster)[0]


def apply_plan(config: ml_collections.ConfigDict, plan: Prediction) -> None:
    """Sets ``config``'s mesh, micro-batch, remat, sequence parallelism, state split and schedule to ``plan``'s, and
    ``mesh.auto`` off (what a checkpoint stores is the plan)."""
    config.mesh.update(expert=1, context=1)  # the plan's flags name these only where it splits them
    apply_config_overrides(config, flags(plan).split())
    config.train.micro_batch_size = plan.micro_batch if plan.num_micro > 1 else 0
    config.mesh.auto = False


COMPILED_TRIES = 3  # plans compiled before mesh.auto gives up: a compile is seconds to minutes


def plan_for_devices(config: ml_collections.ConfigDict, devices: list[jax.Device]) -> AutoPlan:
    """Sets ``config`` to the fastest plan of ``choose_plans`` for ``devices`` whose compiled step fits the device's
    memory (XLA's peak; the next plan where it does not, up to ``COMPILED_TRIES`` compiles; ConfigError then, before
    anything is written); returns the plan."""
    cluster, n, limit = cluster_for(devices[0]), len(devices), device_bytes(devices[0])
    refused = []
    for best in choose_plans(config, n, cluster)[:COMPILED_TRIES]:
        trial = config.copy_and_resolve_references()
        apply_plan(trial, best)
        spec = resolve(trial, n)
        peak = compiled_memory(spec, spec.micro_batch, spec.num_micro).peak
        if not limit or peak <= limit:
            apply_plan(config, best)
            return AutoPlan(best, cluster, devices[0].device_kind, peak, limit)
        refused.append(f"--mesh={best.mesh.flag} at micro-batch {best.micro_batch}: {peak / GiB:.1f} (planned "
                       f"{best.memory_bytes / GiB:.1f})")
    raise ConfigError(f"mesh.auto: the plans compiled over the device's {limit / GiB:.1f} GiB: {'; '.join(refused)} "
                      "GiB per device; lower train.micro_batch_size, or set the mesh yourself (python -m "
                      "megajax.scaling lists the plans)")
