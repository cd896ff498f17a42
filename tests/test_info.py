"""The memory tool reproduces the paper's accounting without allocating anything."""

from conftest import run_on

from megajax.cli import load_config
from megajax.tools.info import main
from megajax.tools.memory_planner import memory_report


def test_8p3b_on_64x8():
    r = memory_report(run_on(load_config("gpt_8p3b"), 64, 8), 1)
    state = r.param_bytes + r.grad_bytes + r.optimizer_bytes
    assert abs(state / r.num_params - 16 / 8) < 0.02  # ~16 bytes per parameter, divided by TP
    # Per device: 1/8 of every model-parallel weight plus the replicated ones.
    assert r.num_params / 8 < r.params_per_device < r.num_params / 8 * 1.01


def test_cli_says_whether_it_fits(capsys):
    main(["--config=gpt_8p3b", "--mesh=64x8", "--device_memory_gb=32"])
    out = capsys.readouterr().out
    assert "8,317,040,640" in out and "fits a 32 GiB device: yes" in out
    main(["--config=gpt_8p3b", "--mesh=64x1", "--device_memory_gb=32"])
    assert "fits a 32 GiB device: NO" in capsys.readouterr().out
