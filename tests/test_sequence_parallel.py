"""parallel.sequence (Korthikanti et al. 2022): the residual stream split on the sequence over `model` by one rule
(`seq_sp`). The compiled step computes what the plain step does (dropout on: the masks are drawn for the global
array), communicates by reduce-scatters and all-gathers of the same ring bytes instead of all-reduces, holds less
activation memory, and leaves the parameters' layout (so checkpoints) alone.

Compiled here (7 steps): GPT (hidden 64, 2 layers, seq 32) on 2x4 and BERT (the same sizes) on 1x4 with and
without sequence parallelism (BERT's as train.py compiles them: their memory plans are read), with it GPT and BERT
on 4x2, and gpt_tiny on 1x4 (the communication report).
"""

import contextlib

import jax
import numpy as np
import pytest
from conftest import assert_same_step, compiled_as_train_py, memory_plans, small_config
from flax import nnx

from megajax.config import abstract_model, bert_base_config, rules_of, validate
from megajax.config.migrate import migrate_config
from megajax.errors import ConfigError
from megajax.parallel.hlo_audit import collectives, summary
from megajax.parallel.partition import partition_specs
from megajax.parallel.sharding import MEGATRON_RULES
from megajax.tools.comm_budget import step_budget

L, B, S, H = 2, 8, 32, 64  # global batch B
# AdamW's first step with eps >> |g| moves each parameter by lr g / (|g| + eps) ~ 1000 g: the updated parameters
# give the gradients of the compiled step itself, with digits to spare beside the parameters' own size.
LR, EPS = 1e6, 1e3


def _config(name: str, data: int, model: int, sequence: bool):
    if name == "gpt":
        c = small_config(num_layers=L, data=data, model=model)
    else:
        c = bert_base_config()
        c.model.update(vocab_size=1000, make_vocab_size_divisible_by=128, num_layers=L, hidden_size=H, num_heads=8,
                       max_seq_len=S, remat="none")
        c.mesh.data, c.mesh.model = data, model
    c.model.dropout = 0.1
    c.parallel.sequence = sequence
    c.train.update(global_batch_size=B, precision="fp32")
    c.optimizer.update(lr=LR, eps=EPS, warmup_steps=0, weight_decay=0.0, clip_norm=1e9)
    return c


def _batch(name: str, shardings: dict) -> dict:
    rng = np.random.default_rng(0)
    if name == "gpt":
        rows = {"tokens": rng.integers(0, 1000, (B, S + 1))}
    else:
        valid = (np.arange(S)[None] < rng.integers(S // 2, S + 1, (B, 1))).astype(np.int32)
        rows = {"tokens": rng.integers(5, 1000, (B, S)) * valid, "token_types": (np.arange(S) >= S // 2)[None] * valid,
                "padding_mask": valid, "mlm_labels": rng.integers(5, 1000, (B, S)),
                "mlm_weights": (rng.random((B, S)) < 0.15) * valid, "sop_labels": rng.integers(0, 2, B)}
    return {k: jax.device_put(np.asarray(v, np.int32), shardings[k]) for k, v in rows.items()}


@pytest.fixture(scope="module")
def steps():
    """(name, data, model, sequence) -> (run, loss, parameter change after one step), each compiled once; every
    run of a model starts from the same initial state (initialised once, laid out per run)."""
    from megajax.training.loop import setup

    cache, initial = {}, {}

    def get(name: str, data: int, model: int, sequence: bool):
        key = (name, data, model, sequence)
        planned = key in PLANNED or memory_plans()
        slot = (*key, planned)  # a memory plan is read of a run compiled for it (conftest)
        if slot not in cache:
            with compiled_as_train_py() if planned else contextlib.nullcontext():
                run = setup(_config(*key))
            if name not in initial:
                initial[name] = jax.tree.map(np.array, run.init_state())
            state = jax.tree.map(lambda x, a: jax.device_put(x, a.sharding), initial[name], run.abstract_state)
            new, metrics = run.step_fn(state, _batch(name, run.batch_shardings))
            change = jax.tree.map(lambda a, b: np.asarray(a) - b, new.params, initial[name].params)
            cache[slot] = run, float(metrics["loss"]), change
        return cache[slot]

    return get


MESHES = {"gpt": (2, 4), "bert": (1, 4)}
# the runs test_activation_memory_falls reads XLA's memory plan of, compiled as train.py compiles for every test
# that runs them: once in this module
PLANNED = {("bert", 1, 4, False), ("bert", 1, 4, True)}


@pytest.mark.parametrize("name, mesh", [("gpt", (2, 4)), ("gpt", (4, 2)), ("bert", (1, 4)), ("bert", (4, 2))],
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else v)
def test_same_loss_and_gradients_as_the_plain_step(steps, name, mesh):
    """Against the plain step on one mesh (the plain step is the same on every mesh: test_dropout_rows)."""
    _, plain_loss, plain = steps(name, *MESHES[name], False)
    _, loss, change = steps(name, *mesh, True)
    assert_same_step(loss, change, plain_loss, plain)  # dropout on: identical masks on both layouts


def _model_axis(run) -> dict:
    """(op, phase, elements) -> executions of the step's non-scalar collectives over `model` alone."""
    return {(op, phase, el): n for (op, axes, phase, el), n in summary(collectives(run.step_fn.as_text(), run.mesh))
            .items() if axes == ("model",) and el > 1}


def test_gpt_reduce_scatters_and_all_gathers_the_same_ring_bytes(steps):
    """Per data shard (b sequences): 2L + 1 reduce-scatters of b x s x h / 4 (each row-parallel GEMM and the
    lookup) and 2L + 1 all-gathers of b x s x h (each column-parallel GEMM and the output layer) each way, no
    all-reduce of activations; the loss's 3 per-token reductions; the replicated parameters' gradients summed over
    the split sequence (6L + 2 LayerNorm and bias vectors, the position embeddings gathered). On a ring the pairs
    send what the plain step's all-reduces send."""
    run, _, _ = steps("gpt", 2, 4, True)
    tokens = B // 2 * S
    want = {(op, phase, tokens * H // (4 if op == "reduce-scatter" else 1)): 2 * L + 1
            for op in ("reduce-scatter", "all-gather") for phase in ("forward", "backward")}
    want[("all-reduce", "backward", H)] = 6 * L + 2
    want[("all-gather", "backward", S * H)] = 1
    got = _model_axis(run)
    loss = {k: n for k, n in got.items() if k[0] == "all-reduce" and k[2] == tokens}
    assert sum(loss.values()) == 3  # max, sum of exponentials, target logit (phase labels vary between compiles)
    assert {k: n for k, n in got.items() if k not in loss} == want
    budget, plain = step_budget(run), step_budget(steps("gpt", 2, 4, False)[0])
    assert budget.tensor_ring_bytes == plain.tensor_ring_bytes > 0
    assert budget.compiled["sequence-parallel extra"] == budget.minimum["sequence-parallel extra"]


def test_bert_budget_is_the_analytic_minimum(steps):
    """BERT on 1x4: every category at the minimum; besides GPT's it sums its MLM transform's and segment
    embeddings' gradients and all-reduces the pooled first token (b x h, on one model shard) in the forward."""
    run, _, _ = steps("bert", 1, 4, True)
    budget = step_budget(run)
    assert budget.compiled == budget.minimum and budget.ratio == 1.0, budget.table()
    assert budget.compiled["tensor-parallel backward"] == 2 * (2 * L + 1) * B * S * H // 4 * 4
    assert {k[0] for k in _model_axis(run)} == {"reduce-scatter", "all-gather", "all-reduce"}
    assert not [k for k in _model_axis(run) if k[0] == "all-reduce" and k[2] == B * S * H]


@pytest.mark.memory_plan
def test_activation_memory_falls(steps):
    """XLA's temp bytes (gradients and activations) of the BERT step on 1x4 fall with sequence parallelism, as
    the memory planner's formula says (within 10%)."""
    from megajax.tools.memory_planner import memory_report

    temp = {}
    for sequence in (False, True):
        run, _, _ = steps("bert", 1, 4, sequence)
        temp[sequence] = run.step_fn.memory_analysis().temp_size_in_bytes
        report = memory_report(run.spec, B, num_micro=1)
        assert temp[sequence] == pytest.approx(report.temp_bytes, rel=0.10)
    assert temp[True] < 0.8 * temp[False]


def test_comm_report_shows_the_pairs_at_ratio_one(capsys):
    """gpt_tiny on 1x4: per step 16 sequences x 128 tokens x 128 hidden / 4 = 65536 elements per shard."""
    from megajax.tools.comm_report import main

    table = main(["--config=gpt_tiny", "--mesh=1x4", "--sequence"])
    collectives_table, budget_table = table.split("\n\n")
    rows = [line.split() for line in collectives_table.splitlines()[1:]]
    for op, elements in (("reduce-scatter", "65536"), ("all-gather", "262144")):
        for phase in ("forward", "backward"):
            assert [op, "model", phase, elements, "5"] in rows
    assert not [r for r in rows if r[0] == "all-reduce" and r[3] == "262144"]
    budget = {line[:26].strip(): line[26:].split() for line in budget_table.splitlines()[1:]}
    assert budget["tensor-parallel forward"] == ["2,621,440", "2,621,440", "1.0000"]  # 10 shards x 262,144 bytes
    assert budget["sequence-parallel extra"][2] == "1.0000" and budget["total"][2] == "1.0000"
    assert "other" not in budget
    assert capsys.readouterr().out.strip() == table


def test_rule_is_derived_from_the_config_and_checked_before_compiling():
    c = small_config(model=4)
    assert dict(rules_of(c))["seq_sp"] is None and ("seq_sp", None) in MEGATRON_RULES
    c.parallel.sequence = True
    assert dict(rules_of(c))["seq_sp"] == "model"
    c.sharding.rules = tuple(r for r in MEGATRON_RULES if r[0] != "seq_sp")  # a config stored before the name
    c = migrate_config(c.to_dict())  # as a stored config is read
    assert dict(rules_of(c))["seq_sp"] == "model"
    c.model.max_seq_len = 30
    with pytest.raises(ConfigError, match=r"mesh\.model=4, but model\.max_seq_len=30 is not divisible"):
        validate(c, 8)


@pytest.mark.parametrize("name", ["gpt", "bert"])
def test_parameters_are_laid_out_the_same(name):
    """No parameter carries `seq_sp`: a checkpoint saved with sequence parallelism restores without it and back."""
    specs = [jax.tree.leaves(partition_specs(nnx.state(abstract_model(c)), rules_of(c)))
             for c in (_config(name, 2, 4, False), _config(name, 2, 4, True))]
    assert specs[0] == specs[1]
