"""The compiled step communicates what Megatron prescribes and no more, read from the optimized HLO."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import one_step_run, small_config
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from megajax.config import build_mesh, create_model, rules_of
from megajax.parallel.hlo_audit import _parse_groups, collectives, loops, summary
from megajax.parallel.losses import lm_loss
from megajax.parallel.mesh import MeshShape
from megajax.parallel.sharding import ParallelContext, activate
from megajax.tools.comm_budget import step_budget

L, B, S, H = 3, 4, 16, 64


def _compiled_step(data, model_axis):
    config = small_config(num_layers=L, data=data, model=model_axis)
    mesh = build_mesh(config)
    graphdef, state = nnx.split(create_model(config, mesh))
    tokens = jnp.zeros((B, S), jnp.int32)

    def loss(state, tokens):
        return lm_loss(nnx.merge(graphdef, state), tokens, tokens)

    with activate(mesh, ParallelContext(rules_of(config))):
        text = jax.jit(jax.value_and_grad(loss)).lower(state, tokens).compile().as_text()
    local_params = sum(int(np.prod(x.addressable_shards[0].data.shape)) for x in jax.tree.leaves(state))
    return mesh, collectives(text, mesh), local_params


@pytest.fixture(scope="module")
def audit_1x4():
    return _compiled_step(1, 4)


@pytest.fixture(scope="module")
def audit_2x4():
    return _compiled_step(2, 4)


def _model_axis_expectation(b):
    """2L + 1 all-reduces of b x s x h each way (the +1: embedding lookup forward, tied output layer's input
    gradient backward) and the fused cross-entropy's three per-token reductions (max, sum-exp, target logit)."""
    return {
        ("all-reduce", ("model",), "forward", b * S * H): 2 * L + 1,
        ("all-reduce", ("model",), "backward", b * S * H): 2 * L + 1,
        ("all-reduce", ("model",), "forward", b * S): 3,
    }


def test_model_axis_is_megatron_1x4(audit_1x4):
    _, colls, _ = audit_1x4
    assert summary(colls) == _model_axis_expectation(B)


def test_no_logits_sized_or_gathering_collectives(audit_1x4, audit_2x4):
    vocab = 1024
    for _, colls, _ in (audit_1x4, audit_2x4):
        assert {c.op for c in colls} == {"all-reduce"}  # no all-gather / all-to-all / reduce-scatter at all
        for c in colls:
            if "model" in c.axes:
                assert c.elements < B * S * vocab // 4, c


def test_2x4_model_axis_and_data_gradient_reduction(audit_2x4):
    _, colls, local_params = audit_2x4
    model_part = {k: v for k, v in summary(colls).items() if k[1] == ("model",)}
    assert model_part == _model_axis_expectation(B // 2)
    data_colls = [c for c in colls if c.axes == frozenset({"data"})]
    assert all(c.phase == "backward" for c in data_colls)
    reduced = sum(c.elements * c.executions for c in data_colls)
    # Every gradient element is reduced over `data` once (the positions beyond S get a zero gradient and need none;
    # the tied embedding's lookup and output-layer contributions are summed first), plus the scalar loss.
    unused_positions = (32 - S) * H
    assert reduced == local_params - unused_positions + 1
    assert not [c for c in colls if len(c.axes) > 1]


def test_trip_counts_multiply_loop_bodies():
    """A scan of 5 matmuls with a model-sharded contraction: one all-reduce in the body, 5 executions."""
    mesh = MeshShape(1, 4).make()
    w = jax.device_put(jnp.ones((5, 8, 8)), NamedSharding(mesh, P(None, "model", None)))
    x = jax.device_put(jnp.ones((2, 8)), NamedSharding(mesh, P(None, "model")))

    def f(x, w):
        def body(h, wi):
            h = jax.lax.with_sharding_constraint(h, NamedSharding(mesh, P(None, "model")))
            return jnp.tanh(h @ wi), None
        return jax.lax.scan(body, x, w)[0]

    colls = collectives(jax.jit(f).lower(x, w).compile().as_text(), mesh)
    reduces = [c for c in colls if c.op == "all-reduce"]
    assert sum(c.executions for c in reduces) == 5 and all(c.axes == {"model"} for c in reduces)


RAGGED = """HloModule ragged
ENTRY %main (x: bf16[512,128], z: bf16[2048,128], o: s64[4]) -> bf16[2048,128] {
  %x = bf16[512,128]{1,0} parameter(0)
  %z = bf16[2048,128]{1,0} parameter(1)
  %o = s64[4]{0} parameter(2)
  %start = ((bf16[512,128]{1,0}, bf16[2048,128]{1,0}, s64[4]{0}, s64[4]{0}, s64[4]{0}, /*index=5*/s64[4]{0}), \
bf16[2048,128]{1,0}) ragged-all-to-all-start(%x, %z, %o, %o, %o, %o), channel_id=1, replica_groups={{0,1,2,3}}
  %done = bf16[2048,128]{1,0} ragged-all-to-all-done(%start)
  %sync = bf16[2048,128]{1,0} ragged-all-to-all(%x, %z, %o, %o, %o, %o), channel_id=2, replica_groups={{0,1,2,3}}
  %a2a = ((bf16[4,128]{1,0}), bf16[4,128]{1,0}) all-to-all-start(%x), channel_id=3, replica_groups={{0,1,2,3}}
  ROOT %r = bf16[2048,128]{1,0} add(%done, %sync)
}
"""


def test_ragged_and_async_all_to_alls_are_counted_once_by_what_they_send():
    """A ragged all-to-all (async and not) is its operand, the most it sends (512 x 128 here), not its receive
    buffer (2048 x 128) nor its offsets; an async all-to-all's start (operand, result) is one collective."""
    mesh = MeshShape(1, 4).make()
    got = sorted((c.op, c.shape) for c in collectives(RAGGED, mesh))
    assert got == [("all-to-all", (4, 128)), ("ragged-all-to-all", (512, 128)), ("ragged-all-to-all", (512, 128))]


PEELED = """HloModule peeled
%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}
%fused_compare (p: s32[]) -> pred[] {
  %p = s32[] parameter(0)
  %bound = s32[] constant(BOUND)
  ROOT %lt = pred[] compare(%p, %bound), direction=LT
}
%cond (c: (s32[], f32[8])) -> pred[] {
  %c = (s32[], f32[8]) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  ROOT %f = pred[] fusion(%i), kind=kLoop, calls=%fused_compare
}
%body (b: (s32[], f32[8])) -> (s32[], f32[8]) {
  %b = (s32[], f32[8]) parameter(0)
  %i = s32[] get-tuple-element(%b), index=0
  %x = f32[8] get-tuple-element(%b), index=1
  %r = f32[8] all-reduce(%x), replica_groups={{0,1,2,3}}, to_apply=%add
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[8]) tuple(%j, %r)
}
ENTRY %main (x: f32[8]) -> (s32[], f32[8]) {
  %x = f32[8] parameter(0)
  %zero = s32[] constant(0)
  %start = s32[] copy(%zero)
  %init = (s32[], f32[8]) tuple(%start, %x)
  ROOT %w = (s32[], f32[8]) while(%init), condition=%cond, body=%body, backend_config=INDUCTION
}
""".replace("INDUCTION", '{"known_induction_variable":{"tuple_index":"0"}}')


def test_loops_without_a_trip_count_are_counted_from_their_condition():
    """XLA's double buffering leaves loops without a trip count (a peeled first iteration, ``i < 1`` from 0; the rest
    of an accumulation loop, ``i < N``): counted from the condition's bound, the start and a step of 1. A loop whose
    step is not 1 still stops the audit."""
    mesh = MeshShape(1, 4).make()
    for bound in (1, 3):
        found = collectives(PEELED.replace("BOUND", str(bound)), mesh)
        assert [(c.op, c.executions, c.axes) for c in found] == [("all-reduce", bound, {"model"})]
    with pytest.raises(ValueError, match="while loop without a known trip count"):
        collectives(PEELED.replace("BOUND", "3").replace("%one = s32[] constant(1)", "%one = s32[] constant(2)"), mesh)


def test_loops_that_carry_their_bound_are_counted_from_it():
    """The training step hides its accumulation loop's bound from XLA (``training.step``): XLA annotates no trip
    count and the loop carries its bound, its condition ``i < n`` of two of its elements; counted from the
    constants they start at (compiled here for the CPU, which adds the 1 as an operand where XLA:GPU fuses it in;
    tests/test_gpu_target.py reads the GPU's)."""
    mesh = MeshShape(1, 4).make()
    split, whole = NamedSharding(mesh, P("model")), NamedSharding(mesh, P())

    def f(x):
        body = lambda i, c: c + jax.lax.with_sharding_constraint(c.sum(0), whole) + i  # noqa: E731
        return jax.lax.fori_loop(0, jax.lax.optimization_barrier(jnp.int32(5)), body, x)

    text = jax.jit(f, in_shardings=split, out_shardings=split).lower(jnp.ones((8, 16))).compile().as_text()
    assert "known_trip_count" not in text and "known_induction_variable" not in text  # XLA did not read it
    assert [(loop.trips, loop.top) for loop in loops(text)] == [(5, True)]
    assert [(c.op, c.executions, c.axes) for c in collectives(text, mesh)] == [("all-reduce", 5, {"model"})]
    # the same loop by hand, its compare fused with its operands swapped; a bound the body changes, or a step of 2,
    # still stops the audit
    assert [c.executions for c in collectives(CARRIED, mesh)] == [5]
    for wrong in (("tuple(%j, %r, %n)", "tuple(%j, %r, %j)"), ("constant(1)", "constant(2)")):
        with pytest.raises(ValueError, match="while loop without a known trip count"):
            collectives(CARRIED.replace(*wrong), mesh)


CARRIED = """HloModule carried
%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}
%fused_lt (p0: s32[], p1: s32[]) -> pred[] {
  %p0 = s32[] parameter(0)
  %p1 = s32[] parameter(1)
  ROOT %lt = pred[] compare(%p1, %p0), direction=LT
}
%cond (c: (s32[], f32[8], s32[])) -> pred[] {
  %c = (s32[], f32[8], s32[]) parameter(0)
  %i = s32[] get-tuple-element(%c), index=0
  %n = s32[] get-tuple-element(%c), index=2
  ROOT %f = pred[] fusion(%n, %i), kind=kLoop, calls=%fused_lt
}
%body (b: (s32[], f32[8], s32[])) -> (s32[], f32[8], s32[]) {
  %b = (s32[], f32[8], s32[]) parameter(0)
  %i = s32[] get-tuple-element(%b), index=0
  %x = f32[8] get-tuple-element(%b), index=1
  %n = s32[] get-tuple-element(%b), index=2
  %r = f32[8] all-reduce(%x), replica_groups={{0,1,2,3}}, to_apply=%add
  %one = s32[] constant(1)
  %j = s32[] add(%i, %one)
  ROOT %t = (s32[], f32[8], s32[]) tuple(%j, %r, %n)
}
ENTRY %main (x: f32[8]) -> (s32[], f32[8], s32[]) {
  %x = f32[8] parameter(0)
  %zero = s32[] constant(0)
  %five = s32[] constant(5)
  %start = s32[] copy(%zero)
  %init = (s32[], f32[8], s32[]) tuple(%start, %x, %five)
  ROOT %w = (s32[], f32[8], s32[]) while(%init), condition=%cond, body=%body
}
"""


@pytest.mark.parametrize("text,groups", [
    ("{{0,1},{2,3}}, use_global", [[0, 1], [2, 3]]),
    ("[2,4]<=[8], use_global", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("[4,2]<=[2,4]T(1,0), use_global", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("mesh['axis_0'=2,'axis_1'=4] {'axis_1'}, use", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("mesh['axis_0'=2,'axis_1'=4] {'axis_0'}, use", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_0'}, use", [[0, 1, 2, 3], [4, 5, 6, 7]]),
])
def test_replica_group_syntaxes(text, groups):
    assert sorted(map(sorted, _parse_groups(text, 8))) == groups


def test_comm_report_cli(capsys):
    from megajax.tools.comm_report import main

    table = main(["--config=gpt_tiny", "--mesh=2x4", "--batch=8"])
    collectives_table, budget_table = table.split("\n\n")
    rows = [line.split() for line in collectives_table.splitlines()[1:]]
    assert {r[0] for r in rows} == {"all-reduce"}
    # gpt_tiny: 2 layers, per-data-shard batch 4 x seq 128 x hidden 128 = 65536: (2L + 1) each way over model.
    assert ["all-reduce", "model", "forward", "65536", "5"] in rows
    assert ["all-reduce", "model", "backward", "65536", "5"] in rows
    assert any(r[1] == "data" for r in rows)
    assert capsys.readouterr().out.strip() == table
    budget = {line[:26].strip(): line[26:].split() for line in budget_table.splitlines()[1:-1]}
    # 5 x 65536 elements x 4 bytes each way; every gradient reduced over data once (the tied embedding's too)
    assert budget["tensor-parallel forward"] == ["1,310,720", "1,310,720", "1.0000"]
    assert budget["tensor-parallel backward"] == ["1,310,720", "1,310,720", "1.0000"]
    assert budget["data-parallel gradients"][2] == "1.0000" and "other" not in budget


@pytest.mark.parametrize("name, data, model_axis", [
    *((name, *mesh) for name in ("gpt", "bert") for mesh in ((2, 4), (4, 2))),
    ("llama", 1, 4), ("llama", 2, 4), ("llama", 4, 2)])
def test_training_step_communicates_exactly_the_minimum(name, data, model_axis):
    """The whole compiled training step (forward, backward, clipping, AdamW) of the small GPT, BERT and Llama (2
    key/value heads: replicated on 1x4 and 2x4, their own category, module docstring of comm_budget; split on 4x2)
    on data and model shards: every
    category's bytes equal Megatron's analytic minimum on each mesh, ratio 1.0000; on `data` every gradient element is
    reduced once (the tied word embedding's lookup and output-layer contributions summed first). Selective
    recomputation communicates exactly as none (test_sharded_optimizer.py); with it these runs are the ones the
    equivalence ``MATRIX`` there compiles."""
    budget = step_budget(one_step_run(None, data, model_axis, name, "selective"))
    assert budget.compiled == budget.minimum and budget.ratio == 1.0, budget.table()


def test_budget_bert_remat_is_megatron_minimum():
    """BERT on 1x4 with remat=full: exactly the analytic bytes (the MLM accuracy reuses the loss's reductions;
    the recomputed forward re-reduces each block's attention output only)."""
    from megajax.config import bert_base_config
    from megajax.training.loop import setup

    c = bert_base_config()
    c.model.update(vocab_size=1000, make_vocab_size_divisible_by=128, num_layers=L, hidden_size=H, num_heads=8,
                   max_seq_len=S, dropout=0.0, remat="full")
    c.mesh.data, c.mesh.model = 1, 4
    c.train.update(global_batch_size=B, precision="fp32")
    budget = step_budget(setup(c))
    assert budget.compiled == budget.minimum and budget.ratio == 1.0, budget.table()
    assert budget.minimum["tensor-parallel backward"] == (3 * L + 1) * B * S * H * 4


def _train_step_collectives(monkeypatch, clip: bool) -> dict:
    """(op, axes, elements) -> executions of the whole compiled training step (loss, gradients, norm, clipping,
    AdamW) on 1x4; without ``clip`` the optimizer's clipping is replaced by the identity (same state layout)."""
    import collections

    import optax

    from megajax.training import loop, optimizer

    if not clip:
        monkeypatch.setattr(loop, "make_optimizer", lambda opt, steps: optax.chain(
            optax.identity(), optax.adamw(optimizer.learning_rate_schedule(opt, steps))))
    config = small_config(num_layers=L, data=1, model=4)
    config.model.max_seq_len = S
    config.train.update(global_batch_size=B, precision="fp32")
    run = loop.setup(config)
    out = collections.Counter()
    for (op, axes, _, elements), n in summary(collectives(run.step_fn.as_text(), run.mesh)).items():
        out[op, axes, elements] += n  # the phase label of the loss's per-token reductions varies between compiles
    return dict(out)


def test_train_step_reduces_the_gradient_norm_once(monkeypatch):
    """The step computes the global gradient norm once (logged, tested for finiteness, fed to the clipping): the
    compiled step with clipping has exactly the collectives of the step without it; beyond Megatron's 2L+1 each
    way and the loss's 3 per-token reductions there are only scalar reductions over ``model`` (the norm's sharded
    sums of squares)."""
    with_clip = _train_step_collectives(monkeypatch, clip=True)
    assert with_clip == _train_step_collectives(monkeypatch, clip=False)
    model = ("model",)
    assert {k: v for k, v in with_clip.items() if k[2] > 1} == {
        ("all-reduce", model, B * S * H): 2 * (2 * L + 1), ("all-reduce", model, B * S): 3}
    assert set(with_clip) - {("all-reduce", model, B * S * H), ("all-reduce", model, B * S)} == {
        ("all-reduce", model, 1)}


def test_llama_layers_communicate_as_gpt_blocks():
    """Llama's step on 1x4 (its 2 key/value heads replicated): per layer the two all-reduces of b x s x h forward
    and two backward (query and key/value fused into one column-parallel GEMM, gate and up too, so each input
    gradient is one all-reduce), the lookup and the untied output layer's input gradient, the three per-token loss
    reductions, and per layer the grouped all-reduce (2 shards share each head) and the gather of the key/value
    heads' gradient; nothing else over `model`, nothing of the logits' size."""
    run = one_step_run(None, 1, 4, "llama", "selective")
    colls = collectives(run.step_fn.as_text(), run.mesh)
    b, s, h, layers, kv_head = 8, 32, 64, 2, 64 * 2 * 8
    over_model = {k: v for k, v in summary(colls).items() if k[1] == ("model",) and k[3] > 1}
    assert over_model == {
        ("all-reduce", ("model",), "forward", b * s * h): 2 * layers + 1,
        ("all-reduce", ("model",), "backward", b * s * h): 2 * layers + 1,
        ("all-reduce", ("model",), "forward", b * s): 3,
        ("all-reduce", ("model",), "backward", kv_head): layers,
        ("all-gather", ("model",), "backward", 2 * kv_head): layers,
    }
    assert {c.group_size for c in colls if c.elements in (kv_head, 2 * kv_head)} == {2}
    assert max(c.elements for c in colls) < b * s * 1024 // 4


@pytest.mark.parametrize("choice, remat", [("sequence", "none"), ("shard_optimizer+sequence", "full")])
def test_llama_with_sequence_parallelism_communicates_the_minimum(choice, remat):
    """Llama under sequence parallelism on 2x4 (replicated key/value heads): its fused GEMMs keep their
    all-gathered input as GPT's column-parallel GEMMs do, so each category equals the minimum (the key/value
    weight's reduction in its own category, not the sequence-parallel one)."""
    budget = step_budget(one_step_run(choice, 2, 4, "llama", remat))
    assert budget.compiled == budget.minimum and budget.ratio == 1.0, budget.table()
