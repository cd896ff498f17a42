"""Context parallelism (``mesh.context``, ``megajax.parallel.context``): every sequence split over the `context` axis
for the whole layer stack, attention's keys and values all-gathered, each device holding chunks i and 2C-1-i. One
training step on context 2, 4, 8 and data 2 x context 2 x model 2 (with sequence parallelism, packed rows,
grouped-query heads, FSDP, dropout under every recomputation), and on pipe 2 x context 2 x model 2 under 1F1B with
packed rows, equals the one-device step (loss 1e-6, every parameter's change 1e-5) for GPT, Llama and BERT; the
visible (query, key) pairs per device are balanced; the compiled step's key/value traffic is the analytic count."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_same_step, choice_config

from megajax.parallel.context import balanced_order

S = 32  # 2 x 8 chunks of 2 at context 8


def _config(name: str, data: int = 1, model: int = 1, context: int = 1, flags: str | None = None,
            dropout: float = 0.0, remat: str = "none"):
    c = choice_config(flags, data, model, name=name, gradient_step=True, remat=remat)
    c.model.dropout = dropout
    c.mesh.context = context
    c.train.global_batch_size = 4
    return c


def _batch(name: str, shardings: dict, packed: bool) -> dict:
    rng = np.random.default_rng(0)
    b = 4
    if name == "bert":
        valid = (np.arange(S)[None] < rng.integers(S // 2, S + 1, (b, 1))).astype(np.int32)
        rows = {"tokens": rng.integers(5, 1000, (b, S)) * valid, "token_types": (np.arange(S) >= S // 2)[None] * valid,
                "padding_mask": valid, "mlm_labels": rng.integers(5, 1000, (b, S)),
                "mlm_weights": (rng.random((b, S)) < 0.15) * valid, "sop_labels": rng.integers(0, 2, b)}
    else:
        rows = {"tokens": rng.integers(0, 1000, (b, S + 1))}
        if packed:  # documents of 1 to 9 tokens, positions restarting, the crossing targets dropped
            from megajax.data.documents import packed_row
            fields = [packed_row(np.cumsum(rng.random(S + 1) < 0.2), True, True) for _ in range(b)]
            rows.update({k: np.stack([f[k] for f in fields]) for k in fields[0]})
    return {k: jax.device_put(np.asarray(v, np.float32 if k == "loss_weights" else np.int32), shardings[k])
            for k, v in rows.items()}


def _step_key(name: str, data: int = 1, model: int = 1, context: int = 1, flags: str | None = None,
              packed: bool = False, dropout: float = 0.0, remat: str = "none", pipe: int = 1,
              schedule: str = "gpipe") -> tuple:
    return name, data, model, context, flags, packed, dropout, remat, pipe, schedule


@pytest.fixture(scope="module")
def steps():
    """(name, data, model, context, flags, packed, ..., pipe, schedule: ``_step_key``'s arguments) -> (loss,
    parameter change after one step, in the model's layer order) from one initial state per model;
    ``steps.run(...)``: the compiled run of that step."""
    from megajax.models.transformer import reorder_layers
    from megajax.training.loop import setup

    cache, initial, runs = {}, {}, {}

    def get(*args, **kwargs):
        key = _step_key(*args, **kwargs)
        name, data, model, context, flags, packed, dropout, remat, pipe, schedule = key
        if key not in cache:
            config = _config(name, data, model, context, flags, dropout, remat)
            config.data.document_masking = packed
            config.mesh.pipe = pipe
            config.parallel.pipeline_schedule = schedule
            run = runs[key] = setup(config)
            if name not in initial:
                assert (data, model, context, pipe) == (1, 1, 1, 1), "the reference first"
                initial[name] = jax.tree.map(np.array, run.init_state())
            laid = reorder_layers(initial[name], (1, 1), run.spec.layer_layout)
            state = jax.tree.map(lambda x, a: jax.device_put(x, a.sharding), laid, run.abstract_state)
            new, metrics = run.step_fn(state, _batch(name, run.batch_shardings, packed))
            params = reorder_layers(jax.tree.map(np.asarray, new.params), run.spec.layer_layout, (1, 1))
            cache[key] = float(metrics["loss"]), jax.tree.map(lambda a, b: a - b, params, initial[name].params)
        return cache[key]

    def run(*args, **kwargs):
        get(args[0])  # the model's reference first: it sets the initial state
        get(*args, **kwargs)
        return runs[_step_key(*args, **kwargs)]

    get.run = run
    return get


@pytest.mark.parametrize("name", ["gpt", "llama", "bert"])
@pytest.mark.parametrize("mesh", [dict(context=8), dict(data=2, model=2, context=2)],  # (the balanced order at 2
                         ids=lambda m: "x".join(map(str, m.values())))  # and 4: the key-pair and FLOPs tests)
def test_one_step_equals_the_plain_step(steps, name, mesh):
    want = steps(name)
    assert_same_step(*steps(name, **mesh), *want)


@pytest.mark.parametrize("name,flags,packed,mesh", [
    ("gpt", "sequence", False, {}), ("llama", "sequence+fsdp", True, {}), ("gpt", None, True, {}),
    # 1F1B: its tail, on the last stage inside the stages' shard_map, puts the packed loss weights in the balanced
    # order (with model shards XLA's partitioner aborted on that gather while they were split over context)
    ("gpt", None, True, dict(pipe=2, data=1, schedule="1f1b")),
], ids=["sequence", "sequence+fsdp+packed", "packed", "1f1b+packed"])
def test_composes_with_sequence_parallelism_fsdp_and_packed_rows(steps, name, flags, packed, mesh):
    """data 2 x context 2 x model 2 with sequence parallelism (the residual's sequence over context x model), FSDP,
    and document masking over packed rows (segments and restarting positions permuted with the tokens); pipe 2 x
    context 2 x model 2 under 1F1B with packed rows."""
    want = steps(name, packed=packed)
    assert_same_step(*steps(name, **{"data": 2, "model": 2, "context": 2, "flags": flags, "packed": packed, **mesh}),
                     *want)


@pytest.mark.parametrize("name,mesh,remat", [("gpt", (1, 1, 2), "selective"), ("llama", (2, 2, 2), "full"),
                                             ("llama", (1, 1, 4), "none")])
def test_dropout_is_the_plain_steps(steps, name, mesh, remat):
    """With dropout 0.1 the step on context shards equals the one-device step: every mask is keyed by row and
    true position (``layers.dropout``), the attention probabilities' by row, head and query position over the keys
    in position order, whatever order the device holds them in (``context.AttentionDropout``), under every
    recomputation (selective replays the core's trace inside the ``shard_map``)."""
    want = steps(name, dropout=0.1)
    assert_same_step(*steps(name, *mesh, dropout=0.1, remat=remat), *want)


@pytest.mark.parametrize("context", [2, 4, 8])
def test_each_device_sees_the_same_number_of_key_pairs(context):
    """Causal attention in the balanced order: every device's queries see the same count of keys (the work a
    kernel that skips masked blocks does), where the natural order gives the last device 2C-1 times the first's."""
    seq = 64 * context
    order = balanced_order(seq, context).reshape(context, -1)
    visible = (order + 1).sum(axis=1)  # query at position p sees p + 1 keys
    assert visible.max() == visible.min()
    natural = (np.arange(seq).reshape(context, -1) + 1).sum(axis=1)
    assert natural.max() / natural.min() > 2 * context - 2
    assert sorted(balanced_order(seq, context)) == list(range(seq))


@pytest.mark.parametrize("name,mesh,dropout,remat", [
    ("gpt", (1, 1, 2), 0.1, "selective"), ("gpt", (2, 2, 2), 0.0, "none"), ("llama", (2, 2, 2), 0.1, "full"),
    ("bert", (2, 2, 2), 0.0, "none"), ("bert", (1, 1, 8), 0.0, "none")])
def test_key_value_traffic_is_the_analytic_count(steps, name, mesh, dropout, remat):
    """The compiled step's collectives over `context` that move keys and values: per layer an all-gather of each
    device's chunks of the keys and of the values (again where remat recomputes the layer) and a reduce-scatter of
    their gradients, plus what the mask reads of the keys gathered once (a decoder's positions, BERT's padding
    mask): the budget's category at exactly its minimum. The tensor-parallel and loss categories stay at theirs
    with the sequence split. (The steps the equality tests take, with and without dropout.)"""
    from megajax.tools.comm_budget import step_budget

    budget = step_budget(steps.run(name, *mesh, dropout=dropout, remat=remat))
    want = budget.minimum["context key/value"]
    assert want > 0 and budget.compiled["context key/value"] == want, budget.table()
    for category in ("tensor-parallel forward", "tensor-parallel backward", "loss"):
        assert budget.compiled[category] == budget.minimum[category], budget.table()


def _memory(name: str, data: int, model: int, context: int, remat: str, seq: int, layers: int | None = None):
    """(the memory planner's report, the compiled step's memory) at 2 sequences per data shard."""
    from conftest import run_on

    from megajax.cli import load_config
    from megajax.tools.memory_planner import compiled_memory, memory_report

    config = load_config(name)
    config.model.update(remat=remat, max_seq_len=seq, dropout=0.0, **({"num_layers": layers} if layers else {}))
    run = run_on(config, data, model, context=context)
    rows = 1 if layers else 2
    return memory_report(run, rows, num_micro=1), compiled_memory(run, rows, 1)


@pytest.mark.memory_plan
def test_compiled_temp_falls_as_one_over_context_at_4096():
    """gpt_tiny (one layer, remat=selective) at s=4096: the compiled step's temp per device falls with the context
    shards as 1/C (the attention core's s/C x s scores dominate), and the planner follows it within 10%."""
    temp = {}
    for context in (1, 2, 4, 8):
        report, compiled = _memory("gpt_tiny", 1, 1, context, "selective", 4096, layers=1)
        temp[context] = compiled.temp
        assert compiled.temp == pytest.approx(report.temp_bytes, rel=0.10), context
    for context in (2, 4, 8):
        assert temp[context] / temp[1] < 1.1 / context, temp


@pytest.mark.memory_plan
@pytest.mark.parametrize("case", ["gpt_tiny,2,1,2,selective", "gpt_tiny,1,2,4,full", "llama_tiny,1,1,4,none"])
def test_memory_planner_counts_the_context_shards(case):
    """At s=256 the planner's temp is within 10% of the compiled step's: each device's s/C positions, its queries
    against every key, the keys and values gathered whole."""
    name, data, model, context, remat = case.split(",")
    report, compiled = _memory(name, int(data), int(model), int(context), remat, 256)
    assert compiled.temp == pytest.approx(report.temp_bytes, rel=0.10)


def test_moe_on_context_and_expert_shards():
    """A Qwen3-MoE (dropless) step on context 2 and on expert 2 x context 2 equals the one-device step: the
    routing statistics are summed over the context shards' tokens too."""
    from conftest import assert_same_step
    from test_moe import QWEN, moe_config

    from megajax.training.loop import setup

    def step(expert: int, context: int, initial=None):
        config = moe_config(**{**QWEN, "capacity_factor": 0.0, "max_seq_len": S}, expert=expert)
        config.mesh.context = context
        config.data.source = "random"
        config.train.update(global_batch_size=4, precision="fp32")
        config.optimizer.update(lr=1e6, eps=1e3, weight_decay=0.0, clip_norm=1e9, warmup_steps=0)
        run = setup(config)
        initial = jax.tree.map(np.array, run.init_state()) if initial is None else initial
        state = jax.tree.map(lambda x, a: jax.device_put(x, a.sharding), initial, run.abstract_state)
        tokens = np.random.default_rng(0).integers(0, 1000, (4, S + 1)).astype(np.int32)
        new, metrics = run.step_fn(state, {"tokens": jax.device_put(tokens, run.batch_shardings["tokens"])})
        change = jax.tree.map(lambda a, b: np.asarray(a) - b, new.params, initial.params)
        return (float(metrics["loss"]), change), initial

    want, initial = step(1, 1)
    for expert, context in ((1, 2), (2, 2)):
        assert_same_step(*step(expert, context, initial)[0], *want)


def test_mesh_flags_and_info_at_128k(capsys):
    """``--mesh=DxM,context=C`` sets mesh.context (train.py, megajax.info); evaluation refuses it; megajax.info takes
    ``--config.FIELD=V`` and says whether Llama 3 8B at 128K fits an H100 on a mesh with context shards (the
    planner's cuDNN attention: s/C positions of activations per GPU)."""
    from megajax.cli import apply_mesh, inference_mesh, load_config
    from megajax.errors import ConfigError
    from megajax.tools.info import main

    config = load_config("gpt_tiny")
    apply_mesh(config, "2x2,context=2")
    assert (config.mesh.data, config.mesh.model, config.mesh.context) == (2, 2, 2)
    with pytest.raises(ConfigError, match="evaluation and generation run without it"):
        inference_mesh("2x2,context=2")
    with pytest.raises(ConfigError, match="give ',expert=E' and/or ',context=C'"):
        apply_mesh(config, "2x2,contxt=2")
    main(["--config=llama3_8b", "--config.model.max_seq_len=131072", "--mesh=1x8,context=16", "--target=h100",
          "--hosts=16", "--micro_batch=1"])
    out = capsys.readouterr().out
    assert "data=1 x context=16 x model=8 (128 devices)" in out and "fits a 79.11 GiB device: yes" in out
    with pytest.raises(ConfigError, match="config.model has no field 'max_seq_length'"):
        main(["--config=llama3_8b", "--config.model.max_seq_length=131072"])


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_context_under_pipeline_stages(steps, name):
    """pipe 2 x context 2 (GPipe, 2 microbatches; with data 2 under remat=full, with model 2 under selective), dropout
    0.1: the step equals the one-device step (the attention's shard_map inside the stages' vmaps)."""
    want = steps(name, dropout=0.1)  # (the dropout test's reference)
    for data, model, remat in ((2, 1, "full"), (1, 2, "selective")):
        assert_same_step(*steps(name, data, model, 2, dropout=0.1, remat=remat, pipe=2), *want)


@pytest.mark.parametrize("context", [2, 4, 8])
def test_per_device_causal_attention_flops_from_cost_analysis(context):
    """Each device's attention as a kernel that skips the keys its queries cannot see (flash attention's causal
    skipping, at chunk granularity): every chunk of queries against the keys up to its end, compiled for one device
    and counted by XLA's ``cost_analysis``. In the balanced order (chunks i and 2C-1-i) the devices' FLOPs are within
    5% of each other; in the natural order the last device does about 2C-1 times the first's."""
    seq, heads, dim = 64 * 2 * context, 2, 16
    chunk = seq // (2 * context)

    def device_flops(chunks: list[int]) -> float:
        def attend(q, k):  # q: this device's chunks; k: the whole sequence
            out = []
            for i, c in enumerate(chunks):
                end = (c + 1) * chunk  # the last key these queries can see
                scores = jnp.einsum("qnd,knd->nqk", q[i * chunk:(i + 1) * chunk], k[:end])
                out.append(jnp.einsum("nqk,knd->qnd", jax.nn.softmax(scores, -1), k[:end]))
            return jnp.concatenate(out)

        q = jax.ShapeDtypeStruct((len(chunks) * chunk, heads, dim), jnp.float32)
        k = jax.ShapeDtypeStruct((seq, heads, dim), jnp.float32)
        cost = jax.jit(attend).lower(q, k).compile().cost_analysis()
        return (cost[0] if isinstance(cost, list) else cost)["flops"]

    order = balanced_order(seq, context).reshape(context, -1)[:, ::chunk] // chunk  # each device's chunk indices
    balanced = [device_flops(list(chunks)) for chunks in order]
    assert max(balanced) / min(balanced) < 1.05, balanced
    natural = [device_flops([2 * d, 2 * d + 1]) for d in range(context)]
    assert max(natural) / min(natural) > context, natural
