"""``mesh.auto`` (megajax.tools.auto_plan): the plan train.py applies is the scaling CLI's for the same devices and
compiles; a device's kind picks the cluster; no plan that fits, or a compiled step over the device's memory, is a
ConfigError before training (train.py's refusals as processes: tests/test_bad_input.py)."""

import dataclasses
import json

import jax
import pytest
from conftest import SCALAR_STATE_BYTES  # noqa: F401 - conftest first: the 8 simulated devices

from megajax.cli import load_config
from megajax.config import ConfigError, resolve
from megajax.tools import auto_plan, scaling_plan
from megajax.tools.memory_planner import CompiledMemory
from megajax.tools.scaling import MEMORY_FRACTION_VARIABLE, GiB


@dataclasses.dataclass
class _Device:
    """A stand-in for a GPU: its kind and its allocator's limit."""

    device_kind: str
    limit: int

    def memory_stats(self) -> dict:
        return {"bytes_limit": self.limit}


def test_the_plan_is_the_scaling_clis_and_its_step_compiles(capsys):
    config = load_config("llama_tiny")
    plan = auto_plan.plan_for_devices(config, jax.devices())
    scaling_plan.main(["--config=llama_tiny", "--gpus=8", "--cluster=dgx_h100", "--json"])
    cli = json.loads(capsys.readouterr().out.splitlines()[-1])
    p = plan.prediction
    assert (p.mesh.flag, p.micro_batch, p.run.model.remat) == (cli["mesh"], cli["micro_batch"], cli["remat"])
    spec = resolve(config, 8)
    assert spec.mesh == p.mesh and spec.model.remat == cli["remat"] and spec.sequence == cli["sequence_parallel"]
    assert spec.micro_batch * spec.num_micro * spec.mesh.batch_shards == config.train.global_batch_size
    assert not config.mesh.auto and plan.device_bytes is None and plan.compiled_peak_bytes > 0
    said = plan.describe()
    assert f"--mesh={cli['mesh']}" in said and "planned as if on dgx_h100" in said and cli["flags"] in said


def test_device_kinds_and_what_does_not_fit(monkeypatch):
    kinds = {"NVIDIA H100 80GB HBM3": "dgx_h100", "NVIDIA H200": "dgx_h100", "NVIDIA A100-SXM4-80GB": "dgx_a100",
             "Tesla V100-SXM3-32GB": "dgx2h", "cpu": "dgx_h100"}
    for kind, name in kinds.items():
        cluster = auto_plan.cluster_for(_Device(kind, 141 * GiB))
        assert (cluster.name, cluster.hbm_bytes) == (name, 141 * GiB), kind
    # a device without an allocator's limit (the CPU): JAX's default share of the H100's 80 GiB, or the one asked for
    monkeypatch.delenv(MEMORY_FRACTION_VARIABLE, raising=False)
    assert auto_plan.cluster_for(jax.devices()[0]).hbm_bytes == 60 * GiB
    monkeypatch.setenv(MEMORY_FRACTION_VARIABLE, ".9")
    assert auto_plan.cluster_for(jax.devices()[0]).hbm_bytes == int(72 * GiB)
    with pytest.raises(ConfigError, match=r"no plan of the 8 devices fits \(the least memory: .* of 0\.0\)"):
        auto_plan.plan_for_devices(load_config("llama_tiny"), [_Device("NVIDIA H100 80GB HBM3", 2**20)] * 8)


def test_a_compiled_step_over_the_devices_memory_is_refused(monkeypatch):
    big = CompiledMemory(arguments=100 * GiB, outputs=0, aliased=0, temp=0, batch=0)
    monkeypatch.setattr(auto_plan, "compiled_memory", lambda *args: big)
    with pytest.raises(ConfigError, match=r"the plans compiled over the device's 80\.0 GiB: --mesh=\S+ at micro-batch "
                                          r"\d+: 100\.0 \(planned [\d.]+\)"):
        auto_plan.plan_for_devices(load_config("llama_tiny"), [_Device("NVIDIA H100 80GB HBM3", 80 * GiB)] * 8)


def test_a_plan_that_compiles_too_big_gives_way_to_the_next(monkeypatch):
    """The fastest plan's compiled step over the device's memory: the next one that fits is taken."""
    devices = [_Device("NVIDIA H100 80GB HBM3", 80 * GiB)] * 8
    plans = auto_plan.choose_plans(load_config("llama_tiny"), 8, auto_plan.cluster_for(devices[0]))
    assert len(plans) >= 2 and plans[0].step_s <= plans[1].step_s
    sizes = iter([100 * GiB, 1 * GiB])
    monkeypatch.setattr(auto_plan, "compiled_memory", lambda *args: CompiledMemory(next(sizes), 0, 0, 0, 0))
    config = load_config("llama_tiny")
    plan = auto_plan.plan_for_devices(config, devices)
    assert plan.prediction == plans[1] and plan.compiled_peak_bytes == GiB
    assert resolve(config, 8).mesh == plans[1].mesh
