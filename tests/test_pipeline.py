"""Pipeline parallelism (``mesh.pipe``; GPipe and the circular schedule, ``parallel.pipeline_repeats``): one
training step on (pipe, data, model) meshes computes the plain 1x1 step's loss (within 1e-6) and every parameter's
gradient (within 1e-5), for GPT, BERT and Llama, with p and 2p microbatches (a multiple of p: each stage holds whole
microbatches of its share of the batch, where its embedding and head run), with dropout, accumulation, ZeRO-1,
sequence parallelism and fp16 loss scaling; the compiled step moves activations between stages with exactly the
schedule's collective permutes and every communication category equals the budget; the circular schedule idles
1/v of GPipe's layer time; the memory planner's per-stage estimate is within 10% of XLA's plan; a circular run
checkpointed on pipe=2 resumes exactly, on pipe=4 with the plain run's losses, and restores on pipe=1 unchanged;
what the pipeline does not compute yet is refused before anything is built."""

import functools
import gc
import math
import re

import jax
import numpy as np
import pytest
from conftest import assert_same_step, choice_config, compiled_as_train_py, memory_plans
from flax import nnx
from jax.sharding import PartitionSpec as P

import megajax
from megajax.checkpoint import restore_params
from megajax.config import ConfigError, abstract_model, resolve, rules_of
from megajax.config.load import in_layout, read_stored_run
from megajax.models.transformer import STACK, reorder_layers
from megajax.parallel import pipeline
from megajax.parallel.hlo_audit import collectives
from megajax.parallel.mesh import MeshShape
from megajax.parallel.partition import shardings
from megajax.tools.comm_budget import step_budget, step_shape
from megajax.tools.comm_report import main as comm_report_main
from megajax.tools.memory_planner import memory_report, run_memory
from megajax.tools.memory_terms import params_per_device
from megajax.training.data import make_loader
from megajax.training.loop import setup, train

LAYERS = 8  # so that 8 stages hold one layer each
_INITIAL = {}


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_steps():
    """Frees this module's ~40 compiled steps when it ends (memory: with them alive, jaxlib segfaulted serializing a
    later module's step into the compilation cache, which the test processes no longer use: tests/conftest.py)."""
    yield
    _cached_run.cache_clear()
    _fp16_run.cache_clear()
    _INITIAL.clear()
    jax.clear_caches()
    gc.collect()


def _config(name: str, pipe: int, data: int, model: int, micro: int = 0, choice: str | None = None,
            repeats: int = 1, schedule: str = "", **kwargs):
    """``schedule`` '' : gpipe, or circular with ``repeats`` > 1."""
    c = choice_config(choice, data, model, name=name, **kwargs)
    c.model.num_layers = LAYERS
    c.mesh.pipe = pipe
    c.parallel.update(pipeline_microbatches=micro, pipeline_repeats=repeats,
                      pipeline_schedule=schedule or ("circular" if repeats > 1 else "gpipe"))
    return c


def _run(name: str, pipe: int, data: int, model: int, micro: int = 0, accumulate: int = 0,
         choice: str | None = None, dropout: float = 0.0, remat: str = "none", repeats: int = 1, schedule: str = ""):
    """The run of these settings, compiled once (for a test that reads a memory plan, once more: conftest; but the
    runs ``test_memory_planner_counts_the_stages`` reads, compiled once for it and every other test)."""
    key = (name, pipe, data, model, micro, accumulate, choice, dropout, remat, repeats, schedule)
    return _cached_run(*key, memory_plans() or key in _PLANNED)


@functools.cache
def _cached_run(name: str, pipe: int, data: int, model: int, micro: int, accumulate: int, choice: str | None,
                dropout: float, remat: str, repeats: int, schedule: str, _plans: bool):
    c = _config(name, pipe, data, model, micro, choice, repeats, schedule, gradient_step=True, remat=remat)
    c.model.dropout = dropout
    c.train.micro_batch_size = accumulate  # sequences per data shard per accumulation step (0: the whole batch)
    if _plans:
        with compiled_as_train_py():
            return setup(c)
    return setup(c)


def _natural(tree, layout):
    """A tree of the run with ``layout`` = (stages, repeats), its stacked layers in the model's order."""
    return jax.tree.map(np.asarray, reorder_layers(tree, layout, (1, 1)))


def _step(name: str, pipe: int, data: int, model: int, micro: int = 0, accumulate: int = 0,
          choice: str | None = None, dropout: float = 0.0, remat: str = "none", repeats: int = 1, run=None,
          schedule: str = ""):
    """(loss, parameter change in the model's layer order) of one step from the same initial parameters and
    batch."""
    run = run or _run(name, pipe, data, model, micro, accumulate, choice, dropout, remat, repeats, schedule)
    if name not in _INITIAL:
        _INITIAL[name] = jax.tree.map(np.array, _run(name, 1, 1, 1).init_state())
    initial = reorder_layers(_INITIAL[name], (1, 1), run.spec.layer_layout)
    state = jax.tree.map(lambda x, a: jax.device_put(x, a.sharding), initial, run.abstract_state)
    if name == "bert":
        from test_sharded_optimizer import _bert_batches

        batch = _bert_batches(np.random.default_rng(0))(run.batch_shardings)
    else:
        batch = make_loader(resolve(_config(name, pipe, data, model), jax.device_count())).next_global(
            run.batch_shardings)
    new, metrics = run.step_fn(state, batch)
    params = _natural(jax.tree.map(np.asarray, new.params), run.spec.layer_layout)
    return float(metrics["loss"]), jax.tree.map(lambda a, b: a - b, params, _INITIAL[name].params)


# the GPipe steps: (name, pipe, data, model, micro); p and 2p microbatches, one-layer stages (8), each family,
# data and model shards (4 stages of 2 layers: test_pipelined_dropout_drops_what_the_plain_step_drops)
CASES = [("gpt", 2, 2, 2, 4), ("gpt", 8, 1, 1, 8),
         ("bert", 2, 2, 2, 2),  # each microbatch with its rows' padding mask
         ("llama", 2, 1, 4, 4)]  # its 2 key/value heads replicated over model=4 inside each stage
# the circular schedule: (name, pipe, data, model, micro, repeats); p and 2p microbatches, one-layer chunks on 4
# stages
CIRCULAR = [("gpt", 2, 1, 1, 2, 4), ("gpt", 2, 2, 2, 4, 2), ("bert", 2, 1, 4, 2, 2), ("gpt", 4, 1, 2, 4, 2)]
# the steps test_memory_planner_counts_the_stages reads XLA's memory plan of: (name, pipe, data, model, micro,
# repeats, choice); every one of them is also run or counted by a test below
MEMORY_CASES = [(*CASES[0], 1, None), (*CASES[1], 1, None), (*CASES[2], 1, None), (*CASES[3], 1, None),
                *[(*c, None) for c in CIRCULAR],
                ("gpt", 2, 2, 2, 4, 1, "fsdp"), ("gpt", 2, 2, 2, 4, 2, "fsdp"),
                (*CASES[0], 1, "sequence"), (*CASES[2], 1, "sequence"), (*CASES[3], 1, "sequence"),
                ("gpt", 2, 2, 2, 4, 2, "sequence")]
# their _run keys: compiled as train.py compiles (with XLA:CPU's fusion emitters) for every test that runs them, so
# that each compiles once in this module, not once for its step or budget test and again for its memory plan
_PLANNED = {(name, pipe, data, model, micro, 0, choice, 0.0, "none", repeats, "")
            for name, pipe, data, model, micro, repeats, choice in MEMORY_CASES}


@pytest.mark.parametrize("name, pipe, data, model, micro", CASES)
def test_pipelined_step_equals_the_plain_step(name, pipe, data, model, micro):
    run = _run(name, pipe, data, model, micro)
    assert dict(run.mesh.shape) == {"pipe": pipe, "data": data, "model": model}
    assert_same_step(*_step(name, pipe, data, model, micro), *_step(name, 1, 1, 1))


@pytest.mark.parametrize("name, pipe, data, model, micro, repeats", CIRCULAR)
def test_circular_step_equals_the_plain_step(name, pipe, data, model, micro, repeats):
    """Each stage holds ``repeats`` chunks of layers (the stack kept in ``pipeline.layer_order``); each
    microbatch goes round the ring ``repeats`` times."""
    run = _run(name, pipe, data, model, micro, repeats=repeats)
    assert run.spec.layer_layout == (pipe, repeats)
    assert_same_step(*_step(name, pipe, data, model, micro, repeats=repeats), *_step(name, 1, 1, 1))


@pytest.mark.parametrize("num_micro, repeats", [(2, 1), (4, 1), (4, 2), (2, 2)])
def test_idle_ticks_compute_on_zeros(num_micro, repeats):
    """A stage that is finite on every real input but NaN on a finished microbatch (x + w sqrt(1 - x): real inputs
    stay below 1 until the last chunk, a finished one is above it). Stage 0 runs its idle ticks on what its io
    column holds then: finished microbatches on their way to their stage (``pipeline.run``); were they computed on,
    the NaN there would reach the gradient through the discarded result (NaN x 0). The pipeline's loss and gradient
    equal the chunks applied in order, in float64 numpy, and are finite."""
    p, chunks = 2, 2 * repeats
    w = np.array([0.3] * (chunks - 1) + [1.0])  # one weight per chunk, in the model's order: only the last crosses 1
    xs = np.random.default_rng(0).uniform(0.05, 0.1, (num_micro, 4, 3))
    mesh = MeshShape(pipe=p).make(jax.devices()[:p])
    order = pipeline.layer_order(chunks, p, repeats)  # the stack's position -> model chunk

    def stage_fn(weight, x, args):
        return x + weight * jax.numpy.sqrt(1.0 - x), None

    def loss(weights, xs):
        stacked = weights[order].reshape(p, repeats)
        # stage j holds microbatches j K .. j K + K - 1
        return pipeline.run(stage_fn, stacked, xs.reshape(p, -1, *xs.shape[1:]), None, P(), None)[0].sum()

    with jax.set_mesh(mesh):
        value, grad = jax.jit(jax.value_and_grad(loss))(jax.numpy.asarray(w, np.float32),
                                                        jax.numpy.asarray(xs, np.float32))
    h = xs  # forward in float64, then the gradient by the chain rule
    ins = []
    for c in range(chunks):
        ins.append(h)
        h = h + w[c] * np.sqrt(1.0 - h)
    assert (h > 1).any(), "a finished microbatch must be outside the stage's domain for the test to bite"
    want_grad, upstream = np.zeros(chunks), np.ones_like(xs)
    for c in reversed(range(chunks)):
        want_grad[c] = (upstream * np.sqrt(1.0 - ins[c])).sum()
        upstream = upstream * (1.0 - w[c] / (2 * np.sqrt(1.0 - ins[c])))
    assert np.isfinite(np.asarray(grad)).all()
    np.testing.assert_allclose(float(value), h.sum(), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-5)


@pytest.mark.parametrize("repeats", [1, 2])
def test_the_tick_loop_keeps_no_per_tick_flag_of_an_activations_shape(repeats):
    """The selects on a flag that changes with the tick (an idle tick's input zeroed; the circular schedule's
    returning item kept) keep only the flag for the backward pass (``pipeline._select``): the compiled gradient holds
    no boolean stack of T activations (autodiff of ``jnp.where`` kept the flag broadcast to the activation, a byte per
    element on every tick: 11% of a circular stage's compiled temp on (4,1,2))."""
    p, num_micro = 2, 4
    mesh = MeshShape(pipe=p).make(jax.devices()[:p])
    ticks = pipeline.ticks(num_micro, p, repeats)

    def loss(weights, xs):
        return pipeline.run(lambda w, x, args: (x * w, None), weights.reshape(p, repeats),
                            xs.reshape(p, -1, *xs.shape[1:]), None, P(), None)[0].sum()

    with jax.set_mesh(mesh):
        text = jax.jit(jax.grad(loss)).lower(jax.numpy.ones(p * repeats), jax.numpy.ones((num_micro, 4, 3))) \
            .compile().as_text()
    shapes = [tuple(map(int, s.split(","))) for s in re.findall(r"pred\[([\d,]+)\]", text)]
    stacks = [s for s in shapes if s[0] == ticks and math.prod(s[1:]) > 1]  # a per-stage flag per tick is fine
    assert not stacks, f"per-tick boolean stacks of an activation's shape: {sorted(set(stacks))}"


def test_layer_order_puts_each_stages_chunks_on_its_devices():
    """An independent count: chunk c of the model's p v chunks runs on stage c mod p, as its round c div p; the
    stack's positions of stage s (a contiguous block of L/p, what the ``pipe`` split gives it) hold exactly those
    chunks, round by round. Reordering between two layouts composes."""
    for layers, p, v in [(8, 2, 2), (8, 4, 2), (12, 2, 3), (8, 2, 1), (8, 1, 4)]:
        order, per = pipeline.layer_order(layers, p, v), layers // (p * v)
        for s in range(p):
            want = [layer for c in range(p * v) if c % p == s for layer in range(c * per, (c + 1) * per)]
            assert order[s * layers // p:(s + 1) * layers // p].tolist() == want
    weights = np.arange(24 * 3).reshape(24, 3)
    for saved, wanted in [((2, 2), (4, 2)), ((4, 3), (1, 1)), ((1, 1), (2, 4)), ((3, 2), (2, 3)), ((6, 2), (2, 6))]:
        moved = pipeline.relayout(jax.numpy.asarray(weights[pipeline.layer_order(24, *saved)]), saved, wanted)
        np.testing.assert_array_equal(moved, weights[pipeline.layer_order(24, *wanted)])
    assert pipeline.same_order((4, 1), (1, 1), 8) and pipeline.same_order((1, 3), (2, 1), 6)
    assert not pipeline.same_order((2, 2), (4, 2), 8)


@pytest.mark.parametrize("name, pipe, data, model, micro", [("gpt", 4, 2, 1, 4), ("bert", 2, 1, 4, 2)])
def test_pipelined_dropout_drops_what_the_plain_step_drops(name, pipe, data, model, micro):
    """With dropout 0.1 (attention probabilities and residuals): each stage draws its layers' masks for the whole
    batch and keeps its microbatch's rows, so the step is the plain step's."""
    assert_same_step(*_step(name, pipe, data, model, micro, dropout=0.1), *_step(name, 1, 1, 1, dropout=0.1))


def test_recomputation_with_dropout_equals_the_plain_step_each_time_it_compiles():
    """remat=full (the default) and selective, with dropout 0.1: each stage recomputes with its microbatch's masks;
    the selective step compiled a second time in the same process (a fresh trace of the checkpointed attention
    core, whose masks depend on the microbatch) still equals the plain step."""
    want = _step("gpt", 1, 1, 1, dropout=0.1)
    assert_same_step(*_step("gpt", 2, 2, 1, 2, dropout=0.1, remat="full"), *want)
    assert_same_step(*_step("gpt", 2, 2, 1, 2, dropout=0.1, remat="selective"), *want)
    again = _config("gpt", 2, 2, 1, 2, gradient_step=True, remat="selective")
    again.model.dropout = 0.1
    assert_same_step(*_step("gpt", 2, 2, 1, 2, run=setup(again)), *want)


@pytest.mark.parametrize("name, pipe, data, model, micro, repeats", [(*CASES[3], 1), CIRCULAR[1]])
def test_sequence_parallel_stages_equal_the_plain_step(name, pipe, data, model, micro, repeats):
    """parallel.sequence inside every stage (GPipe for Llama on (2,1,4), circular for GPT on (2,2,2)): the residual
    stream's sequence split over ``model``, so the schedule's permutes carry 1/model of a microbatch (the
    scatter/gather of PTD-P, without its all-gather) and the step is still the plain one."""
    run = _run(name, pipe, data, model, micro, choice="sequence", repeats=repeats)
    permutes = {c.shape for c in collectives(run.step_fn.as_text(), run.mesh) if c.op == "collective-permute"}
    assert permutes == {(1, 8 // micro // data, 32 // model, 64)}
    assert_same_step(*_step(name, pipe, data, model, micro, choice="sequence", repeats=repeats),
                     *_step(name, 1, 1, 1))


@pytest.mark.parametrize("repeats", [1, 2])
def test_fsdp_stages_equal_the_plain_step(repeats):
    """parallel.fsdp on (2,2,2), GPipe and circular: the layers stored split over ``data`` too, each stage's
    gathered once per step outside the tick loop (one all-gather per parameter, none inside it), and the step is
    the plain one."""
    run = _run("gpt", 2, 2, 2, 4, choice="fsdp", repeats=repeats)
    gathers = [c for c in collectives(run.step_fn.as_text(), run.mesh) if c.op == "all-gather" and "data" in c.axes]
    assert gathers and all(c.executions == 1 for c in gathers)
    kernels = [a for a in jax.tree.leaves(run.abstract_state.params["blocks"]) if a.ndim >= 3]
    assert kernels and all("data" in jax.tree.leaves(tuple(a.sharding.spec)) for a in kernels)  # stored split
    assert_same_step(*_step("gpt", 2, 2, 2, 4, choice="fsdp", repeats=repeats), *_step("gpt", 1, 1, 1))


@functools.cache
def _fp16_run(layout):
    c = _config("gpt", *layout[:4], repeats=layout[4], gradient_step=True)
    c.train.precision = "fp16"
    return setup(c)


@pytest.mark.parametrize("initial, finite", [(2.0**4, True), (2.0**40, False)])
def test_fp16_loss_scaling_decides_once_for_every_stage(initial, finite):
    """fp16 with dynamic loss scaling, circular on (2,2,2) beside the plain fp16 step from the same parameters: with a
    small scale both steps are finite, update and count a good step (losses within 2e-3, updates within 2e-2 of the
    largest: fp16 sums the microbatches in another order); with 2^40 the scaled gradients overflow and both skip the
    update on every stage and use up one hysteresis step: one finite check over all stages' gradients."""
    results = []
    for layout in ((1, 1, 1, 0, 1), (2, 2, 2, 4, 2)):
        run = _fp16_run(layout)
        if "fp16" not in _INITIAL:
            _INITIAL["fp16"] = jax.tree.map(np.array, run.init_state())
        initial_state = reorder_layers(_INITIAL["fp16"], (1, 1), run.spec.layer_layout)
        state = jax.tree.map(lambda x, a: jax.device_put(x, a.sharding), initial_state, run.abstract_state)
        state = state.replace(loss_scale=state.loss_scale.replace(scale=jax.numpy.float32(initial)))
        batch = make_loader(resolve(_config("gpt", *layout[:3]), jax.device_count())).next_global(run.batch_shardings)
        new, metrics = run.step_fn(state, batch)
        params = _natural(jax.tree.map(np.asarray, new.params), run.spec.layer_layout)
        change = jax.tree.map(lambda a, b: a - b, params, _INITIAL["fp16"].params)
        results.append((float(metrics["loss"]), change, jax.tree.map(np.asarray, new.loss_scale)))
    (plain_loss, plain_change, plain_scale), (loss, change, scale) = results
    assert jax.tree.leaves(scale) == jax.tree.leaves(plain_scale)
    assert int(scale.good_steps) == (1 if finite else 0) and int(scale.hysteresis_left) == (2 if finite else 1)
    if finite:
        np.testing.assert_allclose(loss, plain_loss, rtol=2e-3)
        for a, b in zip(jax.tree.leaves(change), jax.tree.leaves(plain_change), strict=True):
            np.testing.assert_allclose(a, b, atol=2e-2 * np.abs(b).max() + 1e-12)
        assert max(np.abs(b).max() for b in jax.tree.leaves(plain_change)) > 0
    else:
        assert all(not np.any(a) for a in jax.tree.leaves(change) + jax.tree.leaves(plain_change))


def _vocab_run(pipe: int, data: int, vocab_multiple: int):
    c = _config("gpt", pipe, data, 2, 4 if pipe > 1 else 0, gradient_step=True, remat="none")
    c.model.make_vocab_size_divisible_by = vocab_multiple
    return setup(c)


def test_the_ends_run_on_each_stages_share_of_the_batch():
    """On pipe 2 x data 2 x model 2 the embedding, head and loss run on each device's B/(d p) rows: the compiled
    logits GEMM is (B/(d p) s, V/t) per device (no (B/d s, V/t) one), and the head's FLOPs per device (the compiled
    step's ``cost_analysis`` at two vocabulary sizes, differenced) equal those of the plain step on data 4 x model 2,
    whose devices hold as many rows: 1/p of a head on each data shard's whole batch (data 2 x model 2, 2x)."""
    rows, seq = 8 // 4, 32
    head_flops = {}
    for pipe, data in ((2, 2), (1, 4), (1, 2)):
        small, large = _vocab_run(pipe, data, 1024), _vocab_run(pipe, data, 4096)
        head_flops[pipe, data] = large.step_fn.cost_analysis()["flops"] - small.step_fn.cost_analysis()["flops"]
        if pipe > 1:
            vocab = small.spec.model.padded_vocab_size // 2
            dots = set(re.findall(r"f32\[([\d,]+)\]\{[^}]*\} dot\(", small.step_fn.as_text()))
            assert f"{rows * seq},{vocab}" in dots and f"{2 * rows * seq},{vocab}" not in dots
    assert head_flops[2, 2] == pytest.approx(head_flops[1, 4], rel=1e-4)
    # 1.95x: the vocabulary rows' AdamW update is not split over the batch
    assert head_flops[1, 2] == pytest.approx(2 * head_flops[2, 2], rel=0.05)


@pytest.mark.parametrize("name, pipe, data, model, micro, repeats", [(*CASES[1], 1), (*CASES[0], 1), CIRCULAR[1]])
def test_stages_exchange_exactly_the_schedules_activations(name, pipe, data, model, micro, repeats):
    """Over ``pipe``: T = ``pipeline.ticks`` collective permutes round the ring forward (M + p - 1 for GPipe; each
    stage's output to the next, one microbatch of this device's rows; with t model shards each sends 1/t of the
    sequence and the next stage all-gathers it over ``model``, Megatron's scatter/gather) and as many backward (the
    ring reversed), so
    the idle share of the stage-ticks is ``bubble_fraction``, 1 - M v / T; and T along the io column each way (not
    a ring: towards stage 0), which bring each stage's share of the batch to stage 0 and the outputs back. No
    whole-batch transfer: the ends run on each stage's share. Besides them only the ends' gradients, reduced over
    data x pipe once (the tied embedding's lookup and output layer in one reduction), and scalars. Forming and
    unforming the microbatches moves nothing: no forward collective over ``data``. Each data replica runs its own
    copy of the stage's layers, so their gradients are reduced over ``data`` once per step, every element of this
    device's once (not on each tick)."""
    run = _run(name, pipe, data, model, micro, repeats=repeats)
    every = collectives(run.step_fn.as_text(), run.mesh)
    assert not [c for c in every if "data" in c.axes and c.phase == "forward" and c.elements > 1]
    local = params_per_device(run.spec)
    ends = [c for c in every if c.op == "all-reduce" and c.axes == ({"data", "pipe"} if data > 1 else {"pipe"})
            and c.elements > 1]
    stacked = sum(4 * c.elements for c in every if c.op == "all-reduce" and c.axes == {"data"} and c.elements > 1)
    assert all(c.phase == "backward" and c.executions == 1 for c in ends)
    layers = params_per_device(run.spec, only=STACK)[1]  # the stage's, reduced over data only
    assert sum(4 * c.elements for c in ends) == 4 * (local[1] - layers)  # every local gradient element once
    assert stacked == (4 * layers if data > 1 else 0)
    colls = [c for c in every if "pipe" in c.axes]
    ticks = pipeline.ticks(micro, pipe, repeats)
    rows = 8 // micro // data  # the global batch of 8 rows, a microbatch of them, this device's share
    # (stage, rows, seq, hidden) per device; with model shards each sends 1/t of the sequence, gathered on arrival
    activation = (1, rows, 32 // model, 64)
    permutes = [c for c in colls if c.op == "collective-permute"]
    assert sorted((c.phase, c.cyclic, c.shape, c.executions) for c in permutes) == [
        ("backward", False, activation, ticks), ("backward", True, activation, ticks),
        ("forward", False, activation, ticks), ("forward", True, activation, ticks)]
    gathers = [c for c in every if c.op == "all-gather" and c.axes == {"model"} and c.shape[1:] == (rows, 32, 64)]
    assert sorted((c.shard_elements, c.executions) for c in gathers) == [(math.prod(activation), ticks)] * (
        4 if model > 1 else 0)
    assert pipeline.bubble_fraction(micro, pipe, repeats) == pytest.approx(
        1 - micro * repeats / permutes[0].executions)  # idle share
    assert not [c for c in colls if c not in permutes and c not in ends and c.elements > 1]


@pytest.mark.parametrize("name, pipe, data, model, micro, repeats, choice", [
    (*CASES[0], 1, None), (*CASES[2], 1, None), (*CASES[3], 1, None), (*CIRCULAR[1], None), (*CIRCULAR[3], None),
    (*CASES[0], 1, "fsdp"), (*CASES[2], 1, "fsdp"), (*CIRCULAR[1], "fsdp"),
    (*CASES[0], 1, "sequence"), (*CASES[2], 1, "sequence"), (*CASES[3], 1, "sequence"), (*CIRCULAR[1], "sequence")])
def test_the_budget_counts_the_pipeline_exactly(name, pipe, data, model, micro, repeats, choice):
    """``comm_budget`` beside the compiled step, every category: the schedule's permutes (one microbatch each way per
    tick round the ring and one along the io column), the stages' tensor-parallel all-reduces per tick and layer, the
    loss's, the data-parallel gradients, Llama's 2 key/value heads replicated over model=4 (their head's gradient
    reduced and gathered per stage-tick and layer), FSDP (each stage's parameters gathered once per step; BERT's
    small head gradients partly reduced by permutes), sequence parallelism (pairs of one shard, 1/t permutes, the
    replicated parameters' gradients summed over model on every stage-tick; with Llama's replicated key/value heads
    too, their head's gradient in its own category). Nothing is ``other``. A
    circular chunk of more than one layer recomputes one all-reduce more per tick than its need (XLA's layer scan
    keeps the last iteration's): exactly T of a microbatch above the minimum (under sequence parallelism a pair of
    1/t each, the same bytes)."""
    run = _run(name, pipe, data, model, micro, choice=choice, repeats=repeats)
    budget, shape = step_budget(run), step_shape(run)
    assert budget.compiled["other"] == 0 and budget.compiled["pipeline point-to-point"] > 0
    extra = dict.fromkeys(budget.compiled, 0)
    if repeats > 1 and shape.pipe_layers > 1:
        extra["tensor-parallel backward"] = shape.pipe_ticks * shape.pipe_rows * shape.seq * shape.hidden * 4
    assert {k: budget.minimum[k] + extra[k] for k in budget.minimum} == budget.compiled


def test_the_budget_refuses_what_it_does_not_count():
    """Context shards under stages: an error before anything compiles. Sequence parallelism with Llama's 2
    key/value heads replicated over model=4 under stages is counted (``test_the_budget_counts_the_pipeline_exactly``),
    and so is 1F1B, with sequence parallelism too (tests/test_pipeline_1f1b.py)."""
    from megajax.tools.comm_budget import check_countable

    c = _config("gpt", 2, 1, 2, 4)
    c.mesh.context = 2
    with pytest.raises(ConfigError, match="context shards under pipeline stages"):
        check_countable(resolve(c, 8))
    check_countable(resolve(_config("llama", 2, 1, 4, 4, choice="sequence"), 8))
    check_countable(resolve(_config("gpt", 2, 1, 2, 4, choice="sequence", schedule="1f1b"), 8))


def test_comm_report_prints_the_pipeline_categories(capsys):
    table = comm_report_main(["--config=gpt_tiny", "--mesh=2x2x2", "--pipeline_microbatches=4"])
    rows = {line.split("  ")[0]: line.split()[-1] for line in table.splitlines() if line.startswith("pipeline")}
    assert rows == {"pipeline point-to-point": "1.0000", "pipeline inputs/outputs": "1.0000"}


def test_the_circular_schedule_idles_one_repeat_th_of_gpipes_layer_time():
    """The bubble, read from the compiled steps: on (4,1,2) with 4 microbatches, each stage's loop runs ``ticks``
    times and each tick runs its chunk's layers (counted by their two forward all-reduces over ``model`` per
    layer, Megatron's minimum, one microbatch of rows each). Layer-runs beyond the M L/p each stage must do are
    idle: circular (v=2) idles 1/2 of GPipe's, the predicted (p - 1) L/(p v) over (p - 1) L/p."""
    idle, useful = {}, 4 * LAYERS // 4
    for repeats in (1, 2):
        run = _run("gpt", 4, 1, 2, 4, repeats=repeats)
        every = collectives(run.step_fn.as_text(), run.mesh)
        ticks = next(c.executions for c in every if c.op == "collective-permute" and c.phase == "forward")
        assert ticks == pipeline.ticks(4, 4, repeats)
        per_layer = [c for c in every if c.axes == {"model"} and c.op == "all-reduce" and c.phase == "forward"
                     and c.shape == (1, 1, 2, 32, 64)]  # (stage, data replica, a microbatch's 2 rows, seq, hidden)
        layer_runs = sum(c.executions for c in per_layer) // 2
        assert layer_runs == ticks * LAYERS // (4 * repeats)
        idle[repeats] = layer_runs - useful
    assert idle[2] / idle[1] == pytest.approx(1 / 2)
    assert idle[1] == 3 * LAYERS // 4  # (p - 1) ticks of L/p layers


@pytest.mark.memory_plan
@pytest.mark.parametrize("name, pipe, data, model, micro, repeats, choice", MEMORY_CASES)
def test_memory_planner_counts_the_stages(name, pipe, data, model, micro, repeats, choice):
    """The planner's per-device memory for a pipelined step (a stage's layers and their moments; every tick's
    residuals of its layers for one microbatch under GPipe, every tick's chunk input and one chunk's residuals under
    the circular schedule; the head on the stage's share of the batch) against XLA's plan of the same compiled steps
    (GPipe, all six circular ones, FSDP under both, sequence parallelism under GPipe for GPT, BERT and Llama and under
    the circular schedule): state exact (but the step's scalars), temp and peak within 10%. (The circular case of
    one-layer chunks on 4 stages x 2 model shards was 1.11 until the tick loop stopped keeping each tick's select
    flag broadcast to an activation, ``pipeline._select``: 1.07; GPipe on 8 one-layer stages 0.90 until the planner
    dropped the residuals' copy a layer scan makes: 0.95.)"""
    run = _run(name, pipe, data, model, micro, choice=choice, repeats=repeats)
    rows = 8 // data
    report = memory_report(run.spec, rows, num_micro=1)
    compiled = run_memory(run)
    assert compiled.state - report.state_bytes == 32  # step, the optimizer's counts, the loss scale, the key
    assert compiled.temp == pytest.approx(report.temp_bytes, rel=0.10)
    assert compiled.peak == pytest.approx(report.peak_bytes, rel=0.10)


def test_a_circular_pipe_2_run_resumes_exactly_and_on_pipe_4_and_restores_on_pipe_1(tmp_path):
    """Three steps on pipe=2 with the circular schedule (2 chunks per stage), checkpointed: the losses of three
    plain steps (within 1e-5: the microbatches sum the gradients in another order). Its third step again from the
    step-2 checkpoint on the same mesh: the same bits. The step-2 checkpoint (its layers in the (2, 2) order)
    restores onto pipe=4's circular order (4, 2) and for inference on pipe=1 (the model's order) with the same bits;
    the third step resumed on pipe=4 gives the plain step's loss and validation loss."""
    plain = _config("gpt", 1, 1, 1)
    plain.train.eval_batches = 2  # validation after the last step, on the pipe mesh too
    records = train(plain, tmp_path / "plain")
    want, want_valid = [r["loss"] for r in records if "loss" in r], records[-1]["valid_loss"]
    c = _config("gpt", 2, 1, 1, repeats=2)
    c.checkpoint.update(enabled=True, every_steps=1, async_save=False)
    c.train.update(steps=3, eval_batches=0)
    piped = [r["loss"] for r in train(c, tmp_path / "piped") if "loss" in r]
    np.testing.assert_allclose(piped, want, rtol=1e-5)
    c.checkpoint.restore_step = 2  # step 3 again, on the same mesh (the first step 3 is set aside)
    again = [r["loss"] for r in train(c, tmp_path / "piped") if "loss" in r]
    assert again == piped[2:]
    c.mesh.pipe, c.train.eval_batches = 4, 2  # circular on 4 stages: another order than the checkpoint's
    graphdef, abstract = nnx.split(abstract_model(c))
    mesh = MeshShape(pipe=4).make()
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), nnx.to_pure_dict(abstract),
                          nnx.to_pure_dict(shardings(abstract, mesh, rules_of(c))))
    saved = read_stored_run(tmp_path / "piped" / "checkpoints" / "2")
    assert saved.layer_layout == (2, 2)
    on_4 = in_layout(restore_params(tmp_path / "piped" / "checkpoints" / "2", target), saved, (4, 2))
    on_1 = nnx.to_pure_dict(nnx.state(megajax.load_model(tmp_path / "piped" / "checkpoints" / "2").model))
    assert all(a.sharding.spec[0] == "pipe" for a in jax.tree.leaves(on_4["blocks"]))  # the stages' layers
    for a, b in zip(jax.tree.leaves(_natural(jax.tree.map(np.asarray, on_4), (4, 2))), jax.tree.leaves(on_1),
                    strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))
    records = train(c, tmp_path / "piped")
    rest = [r["loss"] for r in records if "loss" in r]
    assert len(want) == 3 and len(rest) == 1
    np.testing.assert_allclose(rest, want[2:], rtol=1e-5)
    np.testing.assert_allclose(records[-1]["valid_loss"], want_valid, rtol=1e-5)


@pytest.mark.parametrize("change, message", [
    (dict(pipe=3), "mesh.pipe=3 splits model.num_layers=8 into equal stages"),
    (dict(pipeline_repeats=3, pipeline_schedule="circular"),
     "mesh.pipe=2 x parallel.pipeline_repeats=3 splits model.num_layers=8 into equal"),
    (dict(pipe=1, pipeline_repeats=2, pipeline_schedule="circular"), "needs pipeline stages: set mesh.pipe > 1"),
    (dict(pipeline_repeats=0), "parallel.pipeline_repeats must be >= 1"),
    (dict(pipeline_schedule="zb"), "parallel.pipeline_schedule='zb' is not one of gpipe, circular, 1f1b"),
    (dict(pipeline_repeats=2), "parallel.pipeline_repeats=2 chunks of layers per stage is the circular or the "
                               "interleaved 1F1B schedule; parallel.pipeline_schedule=gpipe holds one: set "
                               "pipeline_schedule=circular or 1f1b"),
    (dict(pipeline_schedule="circular"), "parallel.pipeline_schedule=circular holds parallel.pipeline_repeats >= 2 "
                                         "chunks of layers per stage, got pipeline_repeats=1"),
    (dict(pipeline_repeats=3, pipeline_schedule="1f1b"),
     "mesh.pipe=2 x parallel.pipeline_repeats=3 splits model.num_layers=8 into equal"),
    (dict(pipe=1, pipeline_schedule="1f1b"), "parallel.pipeline_schedule=1f1b needs pipeline stages"),
    (dict(pipeline_stage_recompute=True), "parallel.pipeline_schedule=gpipe has none to recompute: set "
                                          "pipeline_schedule=1f1b"),
])
def test_what_the_pipeline_does_not_compute_is_refused(change, message):
    c = _config("gpt", change.get("pipe", 2), 1, 1)
    c.parallel.update({k: v for k, v in change.items() if k != "pipe"})
    with pytest.raises(ConfigError, match=message):
        resolve(c, 8)


@pytest.mark.memory_plan
@pytest.mark.parametrize("pipe,layers,seq,repeats,dropout,remat", [
    (4, 8, 256, 1, 0.1, "none"), (2, 4, 256, 1, 0.0, "none"), (2, 8, 256, 2, 0.1, "none"), (2, 4, 256, 1, 0.1, "full"),
    (2, 4, 128, 1, 0.1, "selective")])
def test_memory_planner_at_longer_sequences(pipe, layers, seq, repeats, dropout, remat):
    """A 4-layer GPT on pipe 2 x data 2 x model 2, 4 microbatches (an 8-layer one on pipe 4 x model 2, 8
    microbatches, for GPipe with dropout at s = 256), at s = 128 and 256, with and without dropout, GPipe and
    circular, and GPipe under remat=full and selective: the planner's temp within 10% of the compiled step's (a
    GPipe tick's backward works on a copy of its residuals beside a layer's residuals or a recomputed layer's and
    the attention core's working set; the head's phase holds no gradient sums of the tick loop; a circular tick's
    backward the attention core's working set; with dropout, beside the working set, a mask's bits,
    ``dropout_bits_bytes``;
    8 layers at s = 256 without dropout: 1.00). Before the circular terms: compiled / formula 1.38 at s = 128 and
    2.10 at s = 256 with dropout, 1.27 at s = 256 without; after 1.01, 0.97, 0.98. Before GPipe's tick counted the
    attention core and the head's phase left the sums out (8 layers, (2,2,2) and (4,1,2)): full 0.80 to 0.88 at
    s = 64 and 128, 1.14 at 256; after 0.91 to 1.07; selective 1.01 to 1.09, after 0.98 to 1.04. With dropout under
    none, counting a third probability-sized tensor per layer and tick (the inventory has the probabilities, the
    dropped ones and the mask): 0.84 to 1.09; without it 0.99 to 1.05 (13 steps; the (4,1,2) case here 0.89 ->
    1.03). Here: full 0.97 and 0.91, selective with dropout 1.04."""
    data, micro = (1, 8) if pipe == 4 else (2, 4)
    c = _config("gpt", pipe, data, 2, micro, repeats=repeats, gradient_step=True, remat=remat)
    c.model.update(max_seq_len=seq, dropout=dropout, num_layers=layers)
    run = setup(c)
    report = memory_report(run.spec, 8 // data, num_micro=1)
    assert run_memory(run).temp == pytest.approx(report.temp_bytes, rel=0.10)
