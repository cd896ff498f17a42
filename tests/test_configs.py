"""Every shipped config builds abstractly, matches the paper's sizes, and bad configs fail early and clearly."""

import json
import pathlib

import jax
import pytest
from conftest import run_on, small_config
from flax import nnx

from megajax.cli import CONFIGS_DIR, check_config_overrides, load_config, resolve_config_path
from megajax.config import (
    ConfigError,
    abstract_model,
    build_mesh,
    create_model,
    padded_vocab_size,
    replanned,
    resolve,
)
from megajax.config.load import run_config
from megajax.config.resolve import FROM_INIT
from megajax.data.blend import parse_blend
from megajax.errors import ShardingConfigError
from megajax.models import model_spec
from megajax.parallel.mesh import MeshShape
from megajax.tools.memory_terms import params_per_device

CONFIGS = sorted(p.stem for p in CONFIGS_DIR.glob("*.py"))

# Paper Tables 1 and 2 (parameter counts in billions).
PAPER_SIZES = {"gpt_355m": 0.355, "gpt_1p2b": 1.2, "gpt_2p5b": 2.5, "gpt_4p2b": 4.2, "gpt_8p3b": 8.3,
               "gpt_8p3b_scaling": 8.3, "gpt_125m": 0.124}


def test_all_table_configs_are_shipped():
    assert set(PAPER_SIZES) | {"gpt_tiny"} <= set(CONFIGS)


@pytest.mark.parametrize("name", CONFIGS)
def test_config_builds_and_has_a_docstring(name):
    config = load_config(name)
    if config.model.name == FROM_INIT:  # sft.py: the model is its init_from checkpoint's (tests/test_sft.py)
        with pytest.raises(ConfigError, match="set --config.init_from=PATH"):
            resolve(config, 1)
        config.model = load_config("llama_tiny").model  # as if read from a llama_tiny checkpoint
    model = abstract_model(config)  # eval_shape: no allocation
    count = sum(x.size for x in jax.tree.leaves(nnx.state(model)))
    assert count > 0
    path = pathlib.Path(resolve_config_path(name))
    doc = path.read_text().split('"""')[1]
    assert "Command:" in doc and "Expect:" in doc


@pytest.mark.parametrize("name,billions", sorted(PAPER_SIZES.items()))
def test_parameter_count_matches_paper(name, billions):
    total, _ = params_per_device(run_on(load_config(name)))
    assert abs(total / 1e9 / billions - 1) < 0.03, total


def test_table_shapes():
    c = load_config("gpt_8p3b")
    assert (c.model.num_layers, c.model.hidden_size, c.model.num_heads) == (72, 3072, 24)
    c = load_config("gpt_8p3b_scaling")
    assert c.model.num_heads == 32


def test_vocab_padding_is_fixed_by_config():
    assert padded_vocab_size(50257, 1024) == 51200
    assert padded_vocab_size(1000, 128) == 1024
    assert padded_vocab_size(1024, 128) == 1024


@pytest.mark.parametrize("change,error,match", [
    (dict(num_heads=2, hidden_size=64), ConfigError, "num_heads=2 is not divisible by mesh.model=4"),
    (dict(hidden_size=60, num_heads=8), ConfigError, "hidden_size=60 is not divisible by model.num_heads=8"),
    (dict(make_vocab_size_divisible_by=2, vocab_size=1002), ConfigError, "padded vocabulary 1002"),
])
def test_bad_model_config_errors(change, error, match):
    config = small_config(model=4)
    config.model.update(change)
    with pytest.raises(error, match=match):
        build_mesh(config)


@pytest.mark.parametrize("section, change, match", [
    ("model", dict(num_layers=0), r"model.num_layers=0 makes no model: it must be a whole number >= 1"),
    ("model", dict(num_heads=0), r"model.num_heads=0 makes no model"),
    ("model", dict(hidden_size=-128), r"model.hidden_size=-128 makes no model"),
    ("model", dict(mlp_ratio=0), r"model.mlp_ratio=0 makes no model"),
    ("model", dict(max_seq_len=0), r"model.max_seq_len=0 makes no model"),
    ("model", dict(vocab_size=0), r"model.vocab_size=0 makes no model"),
    ("model", dict(dropout=1.0), r"model.dropout=1.0 must be in \[0, 1\)"),
    ("optimizer", dict(lr=-1.0), r"optimizer.lr must be >= 0 and optimizer.min_lr in \[0, lr\]"),
    ("optimizer", dict(lr=1e-4, min_lr=1e-3), r"got lr=0.0001, min_lr=0.001"),
    ("optimizer", dict(warmup_steps=-5), r"optimizer.warmup_steps and optimizer.decay_steps must be >= 0"),
    ("optimizer", dict(decay_steps=-1), r"optimizer.warmup_steps and optimizer.decay_steps must be >= 0"),
    ("optimizer", dict(decay="step"), r"optimizer.decay='step'; choose 'cosine' or 'linear'"),
    ("optimizer", dict(b2=1.0), r"optimizer.b1 and optimizer.b2 must be in \[0, 1\)"),
    ("optimizer", dict(eps=0.0), r"optimizer.eps > 0"),
    ("optimizer", dict(clip_norm=-1.0), r"optimizer.weight_decay must be >= 0 and optimizer.clip_norm > 0"),
    ("optimizer", dict(weight_decay=-0.1), r"optimizer.weight_decay must be >= 0"),
    ("loss_scale", dict(hysteresis=0), r"loss_scale needs initial > 0"),
])
def test_sizes_and_optimizer_settings_that_make_no_run_are_refused(section, change, match):
    """Each of these used to train (the loss climbing) or end in a traceback (ZeroDivisionError, a failed save)."""
    config = small_config()
    config[section].update(change)
    with pytest.raises(ConfigError, match=match):
        resolve(config, 8)


def test_mesh_larger_than_devices():
    with pytest.raises(ConfigError, match="needs 16 devices but 8 are present"):
        build_mesh(small_config(data=4, model=4))


def test_unknown_logical_axis_fails_before_allocation():
    config = small_config()
    config.sharding.rules = tuple(r for r in config.sharding.rules if r[0] != "mlp")
    before = len(jax.live_arrays())
    with pytest.raises(ShardingConfigError, match="unknown logical axis name 'mlp'"):
        create_model(config, build_mesh(config))
    assert len(jax.live_arrays()) == before


def test_rule_to_unknown_mesh_axis():
    config = small_config()
    config.sharding.rules = config.sharding.rules + (("extra", "tensor"),)
    with pytest.raises(ShardingConfigError, match="names no mesh axis"):
        abstract_model(config)


def test_bare_config_names_resolve():
    assert resolve_config_path("gpt_2p5b.py").endswith("configs/gpt_2p5b.py")
    assert resolve_config_path("gpt_2p5b").endswith("configs/gpt_2p5b.py")


def test_config_paths_resolve_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert pathlib.Path(resolve_config_path("configs/gpt_tiny.py")).is_file()
    assert pathlib.Path(resolve_config_path("gpt_tiny.py")).is_file()
    with pytest.raises(FileNotFoundError, match="available: "):
        resolve_config_path("gpt_nope")


def test_train_py_stores_absolute_paths(tmp_path, monkeypatch):
    """train.py resolves the config's paths at the boundary: the config stored with each checkpoint works from
    any directory (eval.py, a resume started elsewhere)."""
    import pathlib

    from megajax.cli import absolute_paths
    from megajax.config import base_config

    monkeypatch.chdir(tmp_path)
    c = base_config()
    c.data.update(task_dir="glue/MNLI", tokenizer="~/vocab.txt", path="", blend='0.3 data/a 0.7 /abs/b 0.5 "my data/c"')
    c.init_from = "runs/bert"
    absolute_paths(c)
    assert c.data.task_dir == str(tmp_path / "glue" / "MNLI") and c.init_from == str(tmp_path / "runs" / "bert")
    assert c.data.tokenizer == str(pathlib.Path.home() / "vocab.txt") and c.data.path == ""
    assert parse_blend(c.data.blend).paths == (str(tmp_path / "data" / "a"), "/abs/b", str(tmp_path / "my data" / "c"))


# (batch, lr, epochs, training questions)
TABLE6_ROWS = {("mnli", "336m"): (128, 1e-5, 10, 392_702), ("squad1", "1p3b"): (48, 3e-5, 2, 87_599),
               ("race", "3p9b"): (32, 2e-5, 3, 87_866)}
FINETUNE = [(task, size) for task in ("mnli", "qqp", "squad1", "squad2", "race") for size in ("336m", "1p3b", "3p9b")]


@pytest.mark.parametrize("task,size", FINETUNE)
def test_finetune_config_is_table_6_on_the_pretraining_model(task, size):
    """``--config=finetune.py:TASK,SIZE``: the model of configs/bert_SIZE.py with the task's head and Table 6's
    batch, learning rate and epochs; it builds abstractly and its data and model fit each other."""
    from megajax.config import check_data_source

    c, pretrain = load_config(f"finetune.py:{task},{size}"), load_config(f"bert_{size}")
    assert c.data.task == task and c.model.name == model_spec(c.model.name).name
    assert task in model_spec(c.model.name).tasks
    for field in ("num_layers", "hidden_size", "num_heads", "vocab_size", "max_seq_len"):
        assert c.model[field] == pretrain.model[field]
    if (task, size) in TABLE6_ROWS:  # rows read off the paper's Table 6 apart from the config file
        batch, lr, epochs, questions = TABLE6_ROWS[task, size]
        assert (c.train.global_batch_size, c.optimizer.lr) == (batch, lr)
        assert c.train.steps == -(-epochs * questions // batch)
    check_data_source(c)
    assert sum(x.size for x in jax.tree.leaves(nnx.state(abstract_model(c)))) > 0


def test_finetune_config_refuses_an_unknown_task_or_size():
    with pytest.raises(ConfigError, match="give TASK,SIZE"):  # an error: line, not a traceback
        load_config("finetune.py:cola,336m")
    with pytest.raises(ConfigError, match="give TASK,SIZE"):
        load_config("finetune.py:mnli,7b")


def test_every_package_folder_ships():
    """pyproject.toml lists the packages (configs/ is mapped to megajax.configs): a folder missing from the list
    would be missing from a non-editable install."""
    import tomllib

    root = pathlib.Path(__file__).resolve().parent.parent
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {".".join(p.parent.relative_to(root).parts) for p in (root / "megajax").rglob("__init__.py")}
    assert listed == folders | {"megajax.configs"}


@pytest.mark.parametrize("arg, message", [
    ("--config.train.stpes=3", "config.train has no field 'stpes'; did you mean --config.train.steps?"),
    ("--config.trian.steps=3", "config has no field 'trian'; did you mean --config.train?"),
    ("--config.train.steps.x=3", "config.train.steps is a value, not a section"),
])
def test_a_misspelled_config_field_is_named_before_flags_are_parsed(arg, message):
    with pytest.raises(ConfigError) as e:
        check_config_overrides(["train.py", "--config=gpt_tiny", arg], "bert_tiny")
    assert message in str(e.value)
    with pytest.raises(ConfigError, match="did you mean --config.model.hidden_size"):  # the default config's fields
        check_config_overrides(["train.py", "--config.model.hiden_size=3"], "gpt_tiny")
    check_config_overrides(["train.py", "--config=gpt_tiny", "--config.train.steps=3", "--config.mesh.model=2"], "x")



@pytest.mark.parametrize("name", ["gpt_tiny", "llama_tiny", "mixtral_tiny", "bert_tiny"])
def test_a_run_is_its_stored_config_and_replans_as_the_config_would(name):
    """Each fact is held once (``config.run``): the config a checkpoint stores resolves back to the same run, and a
    tool's changed run (``replanned``: its facts replaced, checked again) is the run of the config changed alike,
    rules and micro-batches included; a change no config could make is refused as ``resolve`` refuses it."""
    config = load_config(name)
    config.train.update(global_batch_size=16, micro_batch_size=2)
    run = resolve(config, 8)
    assert resolve(run_config(json.loads(run.config_json)), 8) == run
    for pipe, data, model in ((2, 2, 2), (1, 4, 2), (1, 8, 1)):
        config.mesh.update(pipe=pipe, data=data, model=model)
        config.parallel.update(pipeline_microbatches=0, pipeline_repeats=1)
        expected = resolve(config, 8)
        changed = replanned(run, mesh=MeshShape(data, model, pipe=pipe, expert=run.mesh.expert))
        assert changed == expected and changed.rules == expected.rules
        assert changed.num_micro == expected.num_micro == 16 // (2 * data * run.mesh.expert)
    with pytest.raises(ConfigError, match="mesh.model=3"):
        replanned(run, mesh=MeshShape(1, 3))
    with pytest.raises(ConfigError, match="train.global_batch_size=12 is not"):
        replanned(run, global_batch=12)
