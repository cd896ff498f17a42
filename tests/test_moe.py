"""Mixture-of-experts decoders (``megajax.models.moe``): the routed layer against a float64 numpy reference (dropless
and with a capacity), the balancing loss against transformers', one step's loss and every gradient on data,
tensor and expert meshes against the 1x1 step (and a whole training step with sequence parallelism, ZeRO-1 / FSDP
and recomputation on expert shards), the all-to-alls and the communication budget against the compiled step, the
published parameter counts, and the refusals."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_same_step, place
from flax import nnx

from megajax.cli import load_config
from megajax.config import abstract_model_of, base_config, build_mesh, create_model, resolve, rules_of
from megajax.errors import ConfigError
from megajax.models import moe
from megajax.parallel.sharding import ParallelContext, activate

RTOL = 1e-5  # fp32; the sharded sums reorder additions


def moe_config(data: int = 1, model: int = 1, expert: int = 1, **fields):
    """2 layers, hidden 64, 8 query heads sharing 4 key/value heads, 8 experts of width 48, top-2; ``fields``
    override (``QWEN``: Qwen3-MoE's options)."""
    c = base_config(moe.NAME)
    c.model.update(**{**dict(
        vocab_size=1000, num_layers=2, hidden_size=64, num_heads=8, num_kv_heads=4, ffn_hidden_size=96,
        moe_ffn_hidden_size=48, num_experts=8, experts_per_token=2, max_seq_len=16, remat="none",
        make_vocab_size_divisible_by=128, router_z_loss_coef=0.01), **fields})
    c.mesh.data, c.mesh.model, c.mesh.expert = data, model, expert
    return c


# Qwen3-MoE's options, and a capacity of ceil(16 x 3 / 8) = 6 assignments per expert and sequence
QWEN = dict(qk_norm=True, kv_channels=16, norm_topk_prob=False, experts_per_token=3,
            router_aux_loss_coef=0.001, capacity_factor=1.0)
# Qwen3-MoE's dense layers among the routed ones: of 4 layers only layer 1 is routed (decoder_sparse_step=2 makes 0
# and 2 dense, mlp_only_layers the last), dropless
DENSE = dict(QWEN, capacity_factor=0.0, num_layers=4, decoder_sparse_step=2, mlp_only_layers=(3,))


def _layer(cfg: moe.MoEConfig, std: float = 0.3):
    """A routed layer whose weights are large enough that routing and outputs are far from zero."""
    layer = moe.MixtureOfExperts(cfg, rngs=nnx.Rngs(0))
    for i, name in enumerate(("router", "gate", "up", "down")):
        p = getattr(layer, name)
        p[...] = std * jax.random.normal(jax.random.key(i), p.shape)
    return layer


@pytest.mark.parametrize("fields", [{}, dict(norm_topk_prob=False, experts_per_token=3)],
                         ids=["mixtral", "qwen3"])
@pytest.mark.parametrize("capacity_factor", [0.0, 0.5])
def test_layer_matches_float64_reference(fields, capacity_factor):
    """Dropless: the output within 1e-5 of numpy's token-by-token routing in float64; with a capacity of
    ceil(0.5 x 16 x k / 4) per expert and sequence the same assignments are dropped as the reference drops, and
    counted."""
    cfg = moe.MoEConfig(**{**dict(vocab_size=256, num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2,
                                  max_seq_len=16, moe_ffn_hidden_size=24, num_experts=4, experts_per_token=2,
                                  capacity_factor=capacity_factor, make_vocab_size_divisible_by=128), **fields})
    layer = _layer(cfg)
    x = jax.random.normal(jax.random.key(7), (3, 16, 32))
    y, stats = layer(x)
    ref, kept = moe.reference_moe(np.asarray(x), *(np.asarray(getattr(layer, n)[...], np.float64)
                                                   for n in ("router", "gate", "up", "down")),
                                  cfg.experts_per_token, cfg.norm_topk_prob, cfg.capacity)
    np.testing.assert_allclose(np.asarray(y), ref, rtol=RTOL, atol=RTOL * np.abs(ref).max())
    assert float(stats["dropped"]) == (~kept).sum()
    assert ((~kept).sum() > 0) == bool(capacity_factor)  # the capacity case does drop some
    assert float(stats["load"].sum()) == x.shape[0] * x.shape[1] * cfg.experts_per_token


def test_balancing_loss_matches_transformers():
    """``router_losses``' balance term equals transformers' ``load_balancing_loss_func`` on the same router logits
    of two layers (it pools every layer's tokens before multiplying)."""
    torch = pytest.importorskip("torch")
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    cfg = moe.MoEConfig(hidden_size=32, num_heads=4, num_kv_heads=2, num_layers=2, num_experts=4,
                        experts_per_token=2, vocab_size=256, make_vocab_size_divisible_by=128, max_seq_len=16)
    logits = jax.random.normal(jax.random.key(3), (2, 24, 4))  # (layers, tokens, experts)
    stats = []
    for layer_logits in logits:
        probs, _, experts = moe.route(layer_logits, 2, True)
        stats.append({"load": jax.nn.one_hot(experts, 4).sum((0, 1)), "probs": probs.sum(0),
                      "z": jnp.square(jax.nn.logsumexp(layer_logits, -1)).sum(), "dropped": jnp.zeros(())})
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *stats)
    ours = float(moe.router_losses(stacked, 24, cfg)["balance_loss"])
    theirs = float(mixtral.load_balancing_loss_func(tuple(torch.tensor(np.asarray(g)) for g in logits), 4, 2))
    np.testing.assert_allclose(ours, theirs, rtol=1e-6)


def _run(model, config, tokens, data, model_axis, expert=1, exchange="auto"):
    config = config.copy_and_resolve_references()
    config.mesh.update(data=data, model=model_axis, expert=expert)
    if exchange != "auto":  # the ragged exchange and the Pallas grouped GEMMs (in interpret mode here)
        config.model.update(expert_exchange=exchange, expert_gemm="pallas")
        # the same parameters in layers that read them from their config
        model = nnx.merge(nnx.split(abstract_model_of(resolve(config, 8)))[0], nnx.split(model)[1])
    mesh, graphdef, state = place(model, config, data, model_axis)

    def loss(state):
        return moe.MOE_LM.loss(nnx.merge(graphdef, state), {"tokens": tokens}, None)

    rules = rules_of(config)
    with activate(mesh, ParallelContext(rules)):
        (value, metrics), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
    return float(value), jax.tree.map(float, metrics), jax.tree.map(np.asarray, nnx.to_pure_dict(grads))


def _reference(fields: dict):
    config = moe_config(**fields)
    model = create_model(config, build_mesh(config), seed=0)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 1000, size=(8, 17), dtype=np.int32))
    return config, model, tokens, _run(model, config, tokens, 1, 1)


@pytest.fixture(scope="module", params=["mixtral", "qwen3"])
def reference(request):
    return _reference({"mixtral": {}, "qwen3": QWEN}[request.param])


@pytest.fixture(scope="module")
def dense_reference():
    return _reference(DENSE)


def _assert_matches(reference, data: int, model_axis: int, expert: int, exchange: str = "auto",
                    dropping: bool = False) -> None:
    config, model, tokens, (ref_loss, ref_metrics, ref_grads) = reference
    assert (ref_metrics["dropped_fraction"] > 0) == (dropping or config.model.capacity_factor > 0)  # drops bite
    loss, metrics, grads = _run(model, config, tokens, data, model_axis, expert, exchange)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)
    for name, value in ref_metrics.items():
        np.testing.assert_allclose(metrics[name], value, rtol=1e-6, atol=1e-7, err_msg=name)
    flat, ref_flat = jax.tree_util.tree_leaves_with_path(grads), jax.tree_util.tree_leaves(ref_grads)
    assert len(flat) == len(ref_flat)
    for (path, g), r in zip(flat, ref_flat):
        scale = np.abs(r).max()
        assert scale > 0, jax.tree_util.keystr(path)
        np.testing.assert_allclose(g, r, rtol=RTOL, atol=RTOL * scale, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("data,model_axis,expert,exchange", [(2, 2, 1, "auto"), (2, 1, 4, "auto"), (1, 1, 8, "auto"),
                                                             (2, 2, 2, "auto"), (2, 2, 2, "ragged")])
def test_mesh_matches_single_device(reference, data, model_axis, expert, exchange):
    """The loss (LM + balancing + z-loss), each logged router metric and every gradient on data, tensor, expert
    and mixed meshes against the 1x1 step, dropless (Mixtral) and with a capacity (the Qwen3 case): each data (and
    expert) shard routes its own rows, each expert shard computes its experts on the rows all-to-all'd to it, each
    model shard its slice of every expert, and the statistics are summed over the data and expert shards. The
    ragged exchange with the Pallas grouped GEMMs too (on the CPU the collective emulated,
    ``expert_exchange.emulated_ragged_all_to_all``, and the kernels in Pallas's interpret mode)."""
    _assert_matches(reference, data, model_axis, expert, exchange)


def test_expert_room_drops_the_same_in_both_exchanges():
    """``model.expert_room`` 0.5 on data 2 x expert 4 (each shard's receive buffer half its own routed rows, under
    what balanced routing sends it): some assignments are dropped and counted, and the blocks and the ragged exchange
    (with the Pallas kernels) drop the same ones: the loss (1e-6), every metric and gradient (1e-5) agree."""
    config = moe_config(expert_room=0.5)
    model = create_model(config, build_mesh(config), seed=0)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 1000, size=(8, 17), dtype=np.int32))
    loss, metrics, grads = _run(model, config, tokens, 2, 1, 4)
    assert metrics["dropped_fraction"] > 0.1
    _assert_matches((config, model, tokens, (loss, metrics, grads)), 2, 1, 4, "ragged", dropping=True)


def test_inference_keeps_every_assignment(monkeypatch):
    """A run trained with ``model.expert_room`` (drops that depend on the rest of the batch and on the mesh)
    evaluates, generates and converts with the room off (``inference_config``), its other fields as trained."""
    from megajax.config import load

    trained = moe_config(expert=2, expert_room=0.5, capacity_factor=1.5)
    monkeypatch.setattr(load, "read_run_config", lambda path: trained.copy_and_resolve_references())
    config = load.inference_config("stored", data=1, model=1, expert=2)
    assert config.model.expert_room == 0 and config.model.capacity_factor == 1.5 and config.mesh.expert == 2


def test_emulated_ragged_all_to_all_is_the_documented_one():
    """``jax.lax.ragged_all_to_all``'s documented example (an axis of 2; each caller's operand, output, offsets and
    sizes) gives the documented results through the emulation, and a second run with two slices per destination
    lands each where its ``output_offsets`` say."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from megajax.parallel.expert_exchange import emulated_ragged_all_to_all

    mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
    run = jax.jit(jax.shard_map(functools.partial(emulated_ragged_all_to_all, axis_name="x"), mesh=mesh,
                                in_specs=(P("x"),) * 6, out_specs=P("x")))
    i32 = functools.partial(jnp.asarray, dtype=jnp.int32)
    got = run(i32([1, 2, 2, 3, 4, 0]), i32([0] * 8), i32([0, 1, 0, 1]), i32([1, 2, 1, 1]), i32([0, 0, 1, 2]),
              i32([1, 1, 2, 1]))
    np.testing.assert_array_equal(got, [1, 3, 0, 0, 2, 2, 4, 0])
    # two slices per destination: caller 0 sends [5] and [6, 7] to caller 1, at 3 and 0 there; caller 1 sends
    # [8] to caller 0, at 2; the rest of each output keeps its -1
    got = run(i32([5, 6, 7, 8, 0, 0]), i32([-1] * 8), i32([0, 0, 0, 1, 0, 0, 0, 0]), i32([0, 0, 1, 2, 1, 0, 0, 0]),
              i32([0, 0, 3, 0, 2, 0, 0, 0]), i32([0, 0, 1, 0, 1, 2, 0, 0]))
    np.testing.assert_array_equal(got, [-1, -1, 8, -1, 6, 7, -1, 5])


@pytest.mark.parametrize("data,model_axis,expert", [(2, 2, 2)])
def test_dense_layers_among_routed_ones_match_single_device(dense_reference, data, model_axis, expert):
    """Qwen3-MoE's dense layers among the routed ones (dense, routed, dense, dense: each run of one kind from its
    stack's slice), the same way, on data x expert x model shards (the mixed mesh: each axis at once)."""
    _assert_matches(dense_reference, data, model_axis, expert)


def _step_config(data: int, model_axis: int, expert: int, **parallel):
    """The tiny Mixtral on random data with AdamW at eps >> |g| (one step changes each parameter by lr / eps x its
    gradient); ``parallel``: ``parallel.*`` switches, ``remat`` the model's policy."""
    config = moe_config(data, model_axis, expert=expert, remat=parallel.pop("remat", "none"))
    config.parallel.update(**parallel)
    config.data.source = "random"
    config.train.update(global_batch_size=8, precision="fp32", eval_batches=0)
    config.optimizer.update(lr=1e6, eps=1e3, weight_decay=0.0, clip_norm=1e9, warmup_steps=0)
    config.checkpoint.enabled = False
    return config


@pytest.fixture(autouse=True, scope="module")
def _release_the_plain_run():
    """Frees the cached 1x1 run and step when the module ends (conftest then drops jax's caches)."""
    yield
    _plain_run.cache_clear()
    _plain_step.cache_clear()
    _staged.cache_clear()
    _four_layers.cache_clear()
    _accumulated.cache_clear()


@functools.cache
def _plain_run():
    """The 1x1 run, compiled once: it gives the initial state and the reference step."""
    from megajax.training.loop import setup

    return setup(_step_config(1, 1, 1))


@functools.cache
def _initial_state():
    return jax.tree.map(np.array, _plain_run().init_state())


@functools.cache
def _plain_step():
    """The 1x1 step every composed step is held against, computed once."""
    return _one_step(1, 1, 1)


def _one_step(data: int, model_axis: int, expert: int, **parallel):
    """(loss, parameter change) of one training step from the same initial state on the same global batch."""
    from megajax.training.data import make_loader
    from megajax.training.loop import setup

    config = _step_config(data, model_axis, expert, **parallel)
    run = _plain_run() if (data, model_axis, expert, parallel) == (1, 1, 1, {}) else setup(config)
    initial = _initial_state()
    state = jax.tree.map(lambda x, a: jax.device_put(x, a.sharding), initial, run.abstract_state)
    batch = make_loader(resolve(config, jax.device_count())).next_global(run.batch_shardings)
    new, metrics = run.step_fn(state, batch)
    return float(metrics["loss"]), jax.tree.map(lambda a, b: np.asarray(a) - b, new.params, initial.params)


@pytest.mark.parametrize("data,model_axis,expert,parallel", [
    (2, 2, 2, dict(sequence=True, shard_optimizer=True, fsdp=True, remat="full")),
    (2, 1, 4, dict(shard_optimizer=True, remat="selective")),
    (1, 2, 4, dict(sequence=True, remat="save_dots"))])
def test_expert_shards_compose_with_sequence_parallelism_zero_and_remat(data, model_axis, expert, parallel):
    """One whole training step (loss 1e-6, every parameter's change 1e-5) on expert shards with sequence
    parallelism, ZeRO-1 or FSDP and each recomputation policy equals the 1x1 step's."""
    assert_same_step(*_one_step(data, model_axis, expert, **parallel), *_plain_step())


@functools.cache
def _staged(pipe: int, data: int, model_axis: int, layers: int, schedule: str = "gpipe", repeats: int = 1):
    """(run, config) of the tiny Mixtral with ``layers`` layers in ``pipe`` stages, compiled once for the step and
    the budget."""
    from megajax.training.loop import setup

    config = _step_config(data, model_axis, 1, pipeline_schedule=schedule, pipeline_repeats=repeats)
    config.model.num_layers = layers
    config.mesh.pipe = pipe
    return setup(config), config


@functools.cache
def _four_layers():
    """(run, config) of the 4-layer model on one device: the circular schedule's reference."""
    return _staged(1, 1, 1, 4)


def _staged_step(run, config, initial):
    """(loss, parameter change in the model's layer order) of one step of ``run`` from ``initial`` (in the model's
    order)."""
    from megajax.models.transformer import reorder_layers
    from megajax.training.data import make_loader

    laid = reorder_layers(initial, (1, 1), run.spec.layer_layout)
    state = jax.tree.map(lambda x, a: jax.device_put(x, a.sharding), laid, run.abstract_state)
    new, metrics = run.step_fn(state, make_loader(resolve(config, jax.device_count())).next_global(
        run.batch_shardings))
    params = reorder_layers(jax.tree.map(np.asarray, new.params), run.spec.layer_layout, (1, 1))
    return float(metrics["loss"]), jax.tree.map(lambda a, b: a - b, params, initial.params)


@pytest.mark.parametrize("pipe,data,model_axis,layers,schedule,repeats", [
    (2, 2, 1, 2, "gpipe", 1), (2, 1, 2, 2, "gpipe", 1), (2, 2, 1, 4, "circular", 2)])
def test_pipeline_stages_equal_the_plain_step(pipe, data, model_axis, layers, schedule, repeats):
    """The mixture in GPipe and circular stages, over data replicas and model shards: one step (loss 1e-6, every
    parameter's change 1e-5) equals the one-device step's, the balancing loss (coefficient 0.02) and the z-loss
    (0.01) included: the stages return each layer's routing statistics summed over the microbatches and replicas
    (``pipeline.StackRunner``), so the losses are of the whole batch's routing, as without stages."""
    if layers == 2:
        want = _plain_step()
    else:
        run, config = _four_layers()
        want = _staged_step(run, config, jax.tree.map(np.array, run.init_state()))
    initial = _initial_state() if layers == 2 else jax.tree.map(np.array, _four_layers()[0].init_state())
    assert_same_step(*_staged_step(*_staged(pipe, data, model_axis, layers, schedule, repeats), initial), *want)


@functools.cache
def _accumulated(layers: int, num_micro: int):
    """(run, config) of the tiny Mixtral with ``layers`` layers on one device, ``num_micro`` micro-batches of
    gradient accumulation: the reference of the 1F1B schedule, whose balancing loss is each microbatch's."""
    from megajax.training.loop import setup

    config = _step_config(1, 1, 1)
    config.model.num_layers = layers
    config.train.micro_batch_size = config.train.global_batch_size // num_micro
    return setup(config), config


def _microbatches_in_order(batch, pipe: int, data: int, num_micro: int):
    """``batch``'s rows reordered so that the plain step's micro-batch i (rows i, i + M, ..: ``step.split_micro``)
    holds the pipeline's microbatch i: stage j's share of data shard q's rows holds microbatches j K .. j K + K - 1,
    r rows each, and a microbatch spans every data shard (``pipeline.run_stack``)."""
    rows = len(next(iter(batch.values())))
    k_cols, r = num_micro // pipe, rows // (data * num_micro)
    micro = [[q * rows // data + m * r + t for q in range(data) for t in range(r)] for m in range(num_micro)]
    order = np.array([micro[m][i] for i in range(rows // num_micro) for m in range(num_micro)])
    assert k_cols >= 1 and sorted(order) == list(range(rows))
    return {k: np.asarray(v)[order] for k, v in batch.items()}


@pytest.mark.parametrize("pipe,data,model_axis,layers,repeats", [(2, 2, 1, 2, 1), (2, 1, 2, 4, 2)])
def test_1f1b_stages_equal_the_plain_step_over_the_same_microbatches(pipe, data, model_axis, layers, repeats):
    """The mixture under the 1F1B schedule, plain (pipe 2 x data 2) and interleaved (2 chunks per stage, pipe 2 x
    model 2): each microbatch's routing statistics travel with it to the last stage, where its loss is computed, so
    its balancing loss is over its own routing (as Megatron-LM's), and the step (loss 1e-6, every parameter's
    change 1e-5) equals the one-device step accumulating the same microbatches' gradients (``train.micro_batch_size``,
    the rows reordered into the pipeline's microbatches), balancing loss (0.02) and z-loss (0.01) included."""
    from megajax.models.transformer import reorder_layers
    from megajax.training.data import make_loader

    run, config = _staged(pipe, data, model_axis, layers, "1f1b", repeats)
    num_micro = pipe  # parallel.pipeline_microbatches 0: one per stage
    reference, ref_config = _accumulated(layers, num_micro)
    initial = _initial_state() if layers == 2 else jax.tree.map(np.array, _four_layers()[0].init_state())
    batch = make_loader(resolve(config, jax.device_count())).next_global(run.batch_shardings)
    host = jax.tree.map(np.asarray, batch)

    def step(run, batch):
        laid = reorder_layers(initial, (1, 1), run.spec.layer_layout)
        state = jax.tree.map(lambda x, a: jax.device_put(x, a.sharding), laid, run.abstract_state)
        new, metrics = run.step_fn(state, jax.tree.map(lambda x, s: jax.device_put(x, s), batch, run.batch_shardings))
        params = reorder_layers(jax.tree.map(np.asarray, new.params), run.spec.layer_layout, (1, 1))
        return float(metrics["loss"]), jax.tree.map(lambda a, b: a - b, params, initial.params)

    want = step(reference, _microbatches_in_order(host, pipe, data, num_micro))
    assert_same_step(*step(run, host), *want)


@pytest.mark.parametrize("data,model_axis,layers,schedule,repeats,moves", [
    (2, 1, 2, "gpipe", 1, 0), (2, 1, 4, "circular", 2, 0), (2, 1, 2, "1f1b", 1, 4 + 2), (2, 1, 4, "1f1b", 2, 8 + 2),
    (1, 2, 2, "gpipe", 1, 0), (1, 2, 4, "1f1b", 2, 8)])
def test_pipeline_stages_communicate_the_minimum(data, model_axis, layers, schedule, repeats, moves):
    """pipe 2 x data 2 and pipe 2 x model 2: the step at 1.0000 of the minimum, nothing in ``other``: the pipeline's
    permutes, the gradients, the tensor-parallel all-reduces (with model shards the layer runs without jax's
    varying-axes check and reduces its output's gradient once, ``moe.summed_unchecked``, and sums its router's
    gradient over ``model`` on each layer run), and the routing statistics: in GPipe and circular stages once per
    step (the stages' (L, E) assignments and probability mass, z-loss and drops summed over the replicas and gathered
    over the stages in one all-reduce after the tick loop); under 1F1B each microbatch's with it round the ring on
    each of the T ticks (4, and 8 interleaved), its gradient back (the probability mass's and the z-loss's), and with
    data replicas both summed over them in the tail on each of the 2 microbatches (``moves``: T + M). Each category
    at 1.0000 on data replicas; with model shards XLA merges some of the statistics' scalars into the gradients'
    all-reduce (16 bytes at most move between the two categories)."""
    from megajax.tools.comm_budget import step_budget

    budget = step_budget(_staged(2, data, model_axis, layers, schedule, repeats)[0])
    assert budget.ratio == 1.0 and budget.compiled["other"] == 0, budget.table()
    for category, want in budget.minimum.items():
        assert abs(budget.compiled[category] - want) <= (0 if model_axis == 1 else 16), budget.table()
    once = 4 * (2 * 8 + 2) * layers
    # the router's (64, 8) gradient on each layer run: a stage's layers on each of the 2 microbatches (1F1B) or
    # on every tick (GPipe: M + p - 1 = 3)
    router = 64 * 8 * 4 * (layers // 2) * (2 if schedule == "1f1b" else 3) if model_axis > 1 else 0
    assert budget.minimum["routing statistics"] == (moves * (once + 4 * (8 + 1) * layers) if moves else once) + router


@pytest.mark.parametrize("name,total,active", [("mixtral_8x7b", 46_702_792_704, 12_879_925_248),
                                               ("qwen3_30b_a3b", 30_532_122_624, 3_353_032_704)])
def test_parameter_counts_equal_the_published_ones(name, total, active):
    run = resolve(load_config(name), 8)
    count = sum(x.size for x in jax.tree.leaves(nnx.state(abstract_model_of(run), nnx.Param)))
    assert count == total
    assert moe.active_parameters(run.model, count) == active


def test_grouped_gemm_kernel_matches_float64():
    """The Pallas grouped GEMM (``parallel/grouped_gemm``, in interpret mode) against float64 numpy: 300 rows of
    which the 5 groups hold 228 (one empty, one of a single row, one across two 128-row tiles), K = 72 and N = 40
    (padded to the tiles inside): the output (zeros past the groups), and the gradients of a weighted sum with
    respect to the rows and to each group's weights (an empty group's: zeros), within 1e-5 relative."""
    from megajax.parallel.grouped_gemm import grouped_gemm

    rng = np.random.default_rng(0)
    sizes = np.array([37, 0, 130, 1, 60])
    lhs, rhs, weight = rng.normal(size=(300, 72)), rng.normal(size=(5, 72, 40)), rng.normal(size=(300, 40))
    group = np.repeat(np.arange(5), sizes)  # each held row's group
    held = len(group)
    want = np.zeros((300, 40))
    want[:held] = np.einsum("rk,rkn->rn", lhs[:held], rhs[group])
    want_lhs = np.zeros_like(lhs)
    want_lhs[:held] = np.einsum("rn,rkn->rk", weight[:held], rhs[group])
    want_rhs = np.zeros_like(rhs)
    np.add.at(want_rhs, group, np.einsum("rk,rn->rkn", lhs[:held], weight[:held]))

    f32 = functools.partial(jnp.asarray, dtype=jnp.float32)
    run = functools.partial(grouped_gemm, sizes=jnp.asarray(sizes, jnp.int32), how="interpret")
    out, grads = jax.jit(jax.value_and_grad(lambda a, b: (run(a, b) * f32(weight)).sum(), argnums=(0, 1)))(
        f32(lhs), f32(rhs))
    for got, ref in ((jax.jit(run)(f32(lhs), f32(rhs)), want), (grads[0], want_lhs), (grads[1], want_rhs)):
        np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    np.testing.assert_allclose(float(out), (want * weight).sum(), rtol=1e-5)
    assert not np.asarray(grads[1])[1].any()


def test_grouped_gemm_derivative_sums_the_weights_gradient_over_the_shards(monkeypatch):
    """The kernel's custom derivative inside a checked ``shard_map`` over 4 data shards (its two kernels stood in for
    by jnp, since interpret mode cannot run under the varying-axes check, which the GPU step runs): each shard's
    rows through the same replicated weights give ragged_dot's gradients, the weights' summed over the shards (in
    the weights' dtype) and each shard's rows' their own, within 1e-5."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P

    from megajax.parallel import grouped_gemm as gg

    def gmm(lhs, rhs, sizes, interpret, transposed):
        return jax.lax.ragged_dot(lhs, rhs.swapaxes(1, 2) if transposed else rhs, sizes)

    def tgmm(lhs, grad, sizes, shape, interpret):
        group = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(lhs.shape[0]), side="right")  # G past the groups
        return jnp.einsum("rk,rn,rg->gkn", lhs, grad, jax.nn.one_hot(group, shape[0], dtype=lhs.dtype))

    monkeypatch.setattr(gg, "_gmm", gmm)
    monkeypatch.setattr(gg, "_tgmm", tgmm)
    rng = np.random.default_rng(1)
    lhs, rhs = jnp.asarray(rng.normal(size=(4 * 24, 16)), jnp.float32), jnp.asarray(rng.normal(size=(3, 16, 8)),
                                                                                   jnp.float32)
    weight = jnp.asarray(rng.normal(size=(4 * 24, 8)), jnp.float32)
    sizes = jnp.asarray([7, 0, 11], jnp.int32)
    mesh = Mesh(np.array(jax.devices()[:4]), ("data",))

    def loss(how):
        def local(a, b, w):
            return jax.lax.psum((gg.grouped_gemm(a, b, sizes, how) * w).sum(), "data")
        return jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P(), P("data")), out_specs=P())

    want = jax.jit(jax.grad(loss("xla"), argnums=(0, 1)))(lhs, rhs, weight)
    got = jax.jit(jax.grad(loss("pallas"), argnums=(0, 1)))(lhs, rhs, weight)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5 * float(jnp.abs(w).max()))


def test_grouped_gemm_kernel_computes_only_the_groups_row_blocks():
    """The kernel's tiles (``grouped_gemm._tiles``, 128-row blocks) for the test above's groups in a 300-row buffer:
    one tile per (group, row block it touches), (0, 0), (2, 0), (2, 1), (3, 1), (4, 1), and the two tiles left of
    the 3 + 5 - 1 marked past the last group (they end at once): 5 x 128 rows of work for the 228 routed, at most
    (ceil(228 / 128) + 5 - 1) x 128 whatever the buffer's room, where XLA:GPU's ragged_dot computes 5 x 300."""
    from megajax.parallel.grouped_gemm import _tiles

    group, block, starts, ends = (np.asarray(a) for a in _tiles(jnp.asarray([37, 0, 130, 1, 60]), 300, 128))
    assert list(zip(group, block))[:5] == [(0, 0), (2, 0), (2, 1), (3, 1), (4, 1)]
    assert list(group[5:]) == [5, 5]
    assert list(starts) == [0, 37, 37, 167, 168] and list(ends) == [37, 37, 167, 168, 228]


@pytest.mark.parametrize("fields,mesh,message", [
    (dict(experts_per_token=9), {}, "model.experts_per_token=9 must be in [1, model.num_experts=8]"),
    ({}, dict(expert=3, data=1), "model.num_experts=8 is not divisible by mesh.expert=3"),
    (dict(capacity_factor=-1.0), {}, "model.capacity_factor=-1.0 must be >= 0"),
    (dict(expert_exchange="nccl"), {}, "model.expert_exchange='nccl' must be one of auto, blocks, ragged"),
    (dict(expert_gemm="cublas"), {}, "model.expert_gemm='cublas' must be one of auto, xla, pallas"),
    ({}, dict(pipe=2, data=1, expert=2), "mesh.expert=2 with mesh.pipe=2: inside pipeline stages a stage's rows"),
    (dict(num_layers=4, decoder_sparse_step=2), dict(pipe=2),
     "mesh.pipe=2: a mixture with dense layers among its routed ones"),
])
def test_bad_input_is_a_config_error(fields, mesh, message):
    config = moe_config(**fields)
    config.parallel.pipeline_schedule = mesh.pop("schedule", "gpipe")
    config.mesh.update(mesh)
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        resolve(config, 8)


def test_expert_mesh_is_refused_for_a_dense_model():
    config = base_config()
    config.mesh.expert = 2
    with pytest.raises(ConfigError, match="mesh.expert=2 splits a mixture-of-experts model's experts, and this "
                                          "model has none: set mesh.expert=1"):
        resolve(config, 8)


@pytest.mark.parametrize("data,model_axis,expert,fields", [(1, 1, 2, {}), (2, 1, 4, {}), (2, 2, 2, {}),
                                                            (2, 1, 4, QWEN)])
def test_all_to_alls_are_the_analytic_count_and_bytes(data, model_axis, expert, fields):
    """The compiled step's all-to-alls over ``expert``, per layer and micro-batch: the routed hidden states to the
    experts' shards and back (2 x shards x m x H values each way, a block of m rows per destination: dropless, sized
    for every one of the T k assignments; with the Qwen3 case's capacity of 6 per expert and sequence, the 2
    experts' 12 of the 48: the routed tokens themselves), the rows' expert ids once forward (shards x m), and the
    transposes of the two hidden-state exchanges backward; nothing else is an all-to-all, and none runs over another
    axis."""
    from megajax.parallel.hlo_audit import collectives
    from megajax.training.loop import setup

    config = moe_config(data, model_axis, expert=expert, **fields)
    config.data.source = "random"
    config.train.update(global_batch_size=16, micro_batch_size=1, eval_batches=0, precision="fp32")
    config.checkpoint.enabled = False
    run = setup(config)
    m, spec = run.spec.model, run.spec
    n = spec.micro_batch * m.max_seq_len * m.experts_per_token  # assignments one shard routes per micro-batch
    if fields:
        assert (m.capacity, m.num_experts // expert, n) == (6, 2, 48)
        n = 12  # the destination's two experts keep at most 6 each: a quarter of the shard's 48 assignments
    per_step = m.num_layers * spec.num_micro
    moved = {}
    for c in collectives(run.step_fn.as_text(), run.mesh):
        if c.op == "all-to-all":
            assert c.axes == {"expert"}, c
            key = (c.phase, c.dtype)
            moved[key] = moved.get(key, 0) + c.elements * c.executions
    assert moved == {("forward", "f32"): per_step * 2 * expert * n * m.hidden_size,
                     ("forward", "s32"): per_step * expert * n,
                     ("backward", "f32"): per_step * 2 * expert * n * m.hidden_size}


@pytest.mark.parametrize("data,model_axis,expert,fields", [(4, 2, 1, {}), (2, 2, 2, {}), (2, 1, 4, {}),
                                                            (2, 1, 4, QWEN), (2, 2, 2, DENSE)])
def test_communication_is_the_minimum_in_every_category(data, model_axis, expert, fields):
    """The communication budget (``tools/comm_budget.py``: the dense model's categories, the expert all-to-alls,
    the routing statistics) at exactly 1.0000 of the compiled step's bytes in every category, nothing in ``other``,
    on data x model, data x expert x model and data x expert meshes, dropless, with a capacity and with dense layers
    among the routed ones."""
    from megajax.tools.comm_budget import step_budget
    from megajax.training.loop import setup

    config = moe_config(data, model_axis, expert=expert, **fields)
    config.data.source = "random"
    config.train.update(global_batch_size=16, eval_batches=0, precision="fp32")
    config.checkpoint.enabled = False
    budget = step_budget(setup(config))
    assert budget.compiled["other"] == 0, budget.table()
    assert budget.minimum["routing statistics"] > 0 and (budget.minimum["expert all-to-all"] > 0) == (expert > 1)
    assert (budget.minimum["per-head norm gradients"] > 0) == (model_axis > 1 and "qk_norm" in fields)
    for category, want in budget.minimum.items():
        assert budget.compiled[category] == want, (category, budget.table())
