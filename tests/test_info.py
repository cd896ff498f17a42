"""The memory tool reproduces the paper's accounting without allocating anything."""

import pytest
from conftest import run_on

from megajax.cli import exit_on_user_error, load_config
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


def test_the_report_says_where_it_is_rough(capsys):
    """Interleaved 1F1B with one-layer chunks (measured 0.70 to 1.42 of the compiled temp: docs/parallelism.md) is
    flagged, in the report and in the tool's output; two-layer chunks and plain 1F1B are not."""
    flags = ["--config=gpt_tiny", "--mesh=2x2x2", "--config.parallel.pipeline_schedule=1f1b"]
    main([*flags, "--config.model.num_layers=4", "--config.parallel.pipeline_repeats=2"])
    assert "rough estimate: interleaved 1F1B with one-layer chunks" in capsys.readouterr().out
    for layers, repeats in ((8, 2), (4, 1)):
        main([*flags, f"--config.model.num_layers={layers}", f"--config.parallel.pipeline_repeats={repeats}"])
        assert "rough estimate" not in capsys.readouterr().out
    # with context shards too: the tail's reads are traced with the axes the rules name (a KeyError: 'context' before)
    main(["--config=gpt_tiny", "--mesh=2x1x2,context=2", "--config.parallel.pipeline_schedule=1f1b",
          "--config.model.dropout=0"])
    assert "step peak (est.)" in capsys.readouterr().out


@pytest.mark.parametrize("flags,message", [
    (["--target=h100", "--hosts=0"], "--hosts=0: give 1 or more hosts (of 8 GPUs each)"),
    (["--target=h100", "--hosts=-1"], "--hosts=-1: give 1 or more hosts"),
    (["--hosts=2"], "--hosts=2 counts hosts of 8 GPUs of a --target: give --target=a100/h100/h200 with it"),
    (["--target=h100", "--mesh=4x4"], "mesh 4x4 needs 16 GPUs; --hosts=1 x 8 has 8: raise --hosts or shrink"),
    (["--target=a100", "--hosts=2", "--mesh=2x4x4"], "mesh 2x4x4 (pipe x data x model) needs 32 GPUs; --hosts=2 x 8 "
                                                     "has 16"),
    (["--target=h100", "--mesh=2x4,context=2"], "mesh 2x4,context=2 needs 16 GPUs; --hosts=1 x 8 has 8"),
    (["--micro_batch=-1"], "--micro_batch=-1: give the sequences per device"),
    (["--device_memory_gb=-1"], "--device_memory_gb=-1.0: give a device's memory in GB (> 0)"),
])
def test_bad_flags_and_a_mesh_the_target_cannot_hold_are_one_error_line(flags, message, tmp_path, monkeypatch, capsys):
    """As ``python -m megajax.info`` runs: refused before anything is planned or compiled, nothing written."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        exit_on_user_error(lambda: main(["--config=gpt_tiny", *flags]))
    out, err = capsys.readouterr()
    text = exit_info.value.code if isinstance(exit_info.value.code, str) else err  # sys.exit(message) or argparse's
    assert exit_info.value.code not in (0, None) and out == "" and list(tmp_path.iterdir()) == []
    assert text.strip().count("\n") == 0 and text.startswith("error: ") and message in text, text
