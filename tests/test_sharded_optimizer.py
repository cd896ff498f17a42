"""State split over `data` by a rule on the parameters' layout: parallel.shard_optimizer (ZeRO-1: AdamW's moments)
and parallel.fsdp (ZeRO-3: the parameters, so their gradients and moments, too). The same losses and parameters as
the replicated step, 1/data of the split bytes, the collectives pinned, and checkpoints that restore across the
choices. With the plain runs it shares, ``MATRIX`` completes the equivalence of every choice (sequence parallelism,
ZeRO-1, FSDP, selective recomputation) on every mesh for GPT and BERT, and each choice for Llama.

Compiled here (each once, shared by the tests): the small GPT and the same-sized BERT plain on 2x4 and 4x2, with
ZeRO-1 and with FSDP on 2x4 (and GPT on 4x2), and the ``MATRIX`` runs. With `data` of size 1 (1x1, 1x4) neither
ZeRO-1 nor FSDP changes the layout, so the compiled step is the plain one (checked on the shardings).
"""

import functools

import jax
import numpy as np
import pytest
from conftest import SCALAR_STATE_BYTES, assert_same_step, choice_config, one_step_run
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from megajax.config import resolve
from megajax.parallel.hlo_audit import collectives
from megajax.parallel.mesh import MeshShape
from megajax.parallel.partition import over_data, shardings
from megajax.parallel.sharding import MEGATRON_RULES, entry_axes, spec_axes
from megajax.tools.comm_budget import model_shard_elements, step_budget
from megajax.training.data import make_loader
from megajax.training.loop import batch_layout, train


def test_over_data_splits_the_first_free_divisible_dimension():
    mesh = MeshShape(4, 2).make()
    s = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731
    assert over_data(s(None, "model"), (64, 128)).spec == P("data", "model")
    assert over_data(s("model", None), (2, 3, 8)).spec == P("model", None, "data")  # 3 is not divisible by 4
    assert over_data(s(None, "model"), (2, 256)).spec == P(None, ("model", "data"))  # 2 does not divide by 4
    assert over_data(s(), (6,)).spec == P()  # nothing fits: stays replicated over data
    assert over_data(s("data"), (8,)).spec == P("data")
    assert over_data(NamedSharding(MeshShape(1, 8).make(), P(None)), (8,)).spec == P(None)  # data axis of size 1


def _moment_bytes(run) -> int:
    leaves = [x for x in jax.tree.leaves(run.abstract_state.opt_state) if x.ndim]
    return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize for x in leaves)


def _bert_batches(rng: np.random.Generator):
    """Random BERT batches (8 pairs of 32 positions, padded, 15% of positions scored) as the loader's
    ``next_global``."""
    def next_global(shardings: dict) -> dict:
        b, s = 8, 32
        valid = (np.arange(s)[None] < rng.integers(s // 2, s + 1, (b, 1))).astype(np.int32)
        rows = {"tokens": rng.integers(5, 1000, (b, s)) * valid, "token_types": (np.arange(s) >= s // 2)[None] * valid,
                "padding_mask": valid, "mlm_labels": rng.integers(5, 1000, (b, s)),
                "mlm_weights": (rng.random((b, s)) < 0.15) * valid, "sop_labels": rng.integers(0, 2, b)}
        return {k: jax.device_put(np.asarray(v, np.int32), shardings[k]) for k, v in rows.items()}
    return next_global


# One step of AdamW with eps >> |g| (lr g / eps = 1000 g): the parameters' change is the gradient's, so runs on
# different meshes compare at 1e-5 (three ordinary steps would compare Adam-amplified rounding noise on the
# parameters whose gradient is ~0). Every run of a model starts from one initial state, laid out per run.
_INITIAL: dict = {}


@functools.cache
def _gradient_step(choice: str | None, data: int, model: int, name: str = "gpt", remat: str = "none"):
    """(run, loss, parameter change) of one step; each compiled once for the module."""
    c = choice_config(choice, data, model, name=name, remat=remat, gradient_step=True)
    run = one_step_run(choice, data, model, name, remat)
    if name not in _INITIAL:
        _INITIAL[name] = jax.tree.map(np.array, run.init_state())
    state = jax.tree.map(lambda x, a: jax.device_put(x, a.sharding), _INITIAL[name], run.abstract_state)
    batches = make_loader(resolve(c, jax.device_count())).next_global if name != "bert" else \
        _bert_batches(np.random.default_rng(0))
    batch = batches(run.batch_shardings)
    new, metrics = run.step_fn(state, batch)
    return run, float(metrics["loss"]), jax.tree.map(lambda a, b: np.asarray(a) - b, new.params,
                                                     _INITIAL[name].params)


def _assert_plain_gradients(name: str, got) -> None:
    """Against the plain step on 2x4 (the plain step does not depend on the mesh:
    test_tensor_parallel_equivalence.py): loss within 1e-6, gradients within 1e-5."""
    _, want_loss, want = _gradient_step(None, 2, 4, name)
    assert_same_step(*got[1:], want_loss, want)


def _plain_param_bytes(run) -> int:
    """One device's fp32 parameters as the rules alone lay them out on the run's mesh (no split over data)."""
    return 4 * sum(model_shard_elements(a) for a in jax.tree.leaves(run.abstract_state.params))


@pytest.mark.parametrize("name, data, model", [("gpt", 2, 4), ("gpt", 4, 2), ("bert", 2, 4)])
def test_same_gradients_and_a_data_th_of_the_moments(name, data, model):
    got = _gradient_step("shard_optimizer", data, model, name)
    _assert_plain_gradients(name, got)
    zero = got[0]
    assert _moment_bytes(zero) * data == 2 * _plain_param_bytes(zero)  # every moment here divides by `data`
    # The collectives over `data`: the gradients are reduced as in the plain step's minimum (XLA:CPU all-reduces
    # and slices; GPU XLA makes that a reduce-scatter; BERT's pooler and MLM-transform kernels, whole on every
    # model shard, go by collective-permutes), and the updated parameter shards are all-gathered once: the
    # gathers' results add up to exactly one device's parameters.
    colls = collectives(zero.step_fn.as_text(), zero.mesh)
    gathered = sum(c.elements * c.executions for c in colls
                   if c.op == "all-gather" and c.axes == {"data"} and c.phase == "forward")
    params = sum(int(np.prod(x.sharding.shard_shape(x.shape))) for x in jax.tree.leaves(zero.abstract_state.params))
    assert gathered == params
    budget = step_budget(zero)
    permuted = sum(c.shard_elements * c.executions * 4 for c in colls
                   if c.op == "collective-permute" and "data" in c.axes and c.phase == "backward")
    minimum = budget.minimum["data-parallel gradients"]
    assert minimum <= budget.compiled["data-parallel gradients"] + permuted <= minimum + 256  # GPT 4x2: one 64-vector
    # Beside ZeRO-1's expectation in the report (each updated shard gathered once): 1.0058 on 2x4, 1.0030 on 4x2
    # (a few small replicated parameters' shards gathered as well).
    gathers = "data-parallel parameter gathers"
    assert budget.minimum[gathers] <= budget.compiled[gathers] <= 1.01 * budget.minimum[gathers]


def test_checkpoints_restore_across_the_choice(tmp_path):
    """Two steps with each layout of the state in turn, each resumed from the last one's checkpoint, equal eight
    plain steps: each choice is left and entered once (ZeRO-1 -> plain -> FSDP -> ZeRO-1)."""
    def run(choice, steps, workdir):
        c = choice_config(choice, 2, 4, steps)
        c.checkpoint.update(enabled=True, every_steps=2, async_save=False)
        return [r["loss"] for r in train(c, workdir) if "loss" in r]

    straight = run(None, 8, tmp_path / "straight")
    chain = []
    for choice, steps in [("shard_optimizer", 2), (None, 4), ("fsdp", 6), ("shard_optimizer", 8)]:
        chain += run(choice, steps, tmp_path / "chain")
    np.testing.assert_allclose(chain, straight, rtol=1e-6)


def _state_bytes(run, part: str) -> int:
    return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
               for x in jax.tree.leaves(getattr(run.abstract_state, part)) if x.ndim)


def test_fsdp_splits_no_parameter_on_its_layers_dimension():
    """The scan slices one layer out of a stacked parameter: split on ``layers`` the whole stack would be gathered
    before the loop. ``data`` goes on the first other dimension it divides, as ZeRO-1's rule chooses."""
    from flax import nnx

    from megajax.config import abstract_model

    config = choice_config("fsdp", 2, 4)
    state = nnx.state(abstract_model(config))
    mesh = MeshShape(2, 4).make()
    split, whole = (nnx.to_pure_dict(shardings(state, mesh, MEGATRON_RULES, split_over_data=f)) for f in (True, False))
    blocks = split["blocks"]
    assert blocks["mlp"]["up"]["kernel"].spec == P(None, "data", "model")  # (layers, embed, mlp)
    assert blocks["mlp"]["down"]["kernel"].spec == P(None, "model", "data")  # (layers, mlp, embed)
    assert split["wte"]["embedding"].spec == P("model", "data")  # (vocab, embed)
    for s in jax.tree.leaves(blocks):
        assert s.spec[0] is None
    def without_data(spec: P) -> list:
        kept = [tuple(a for a in entry_axes(entry) if a != "data") for entry in spec]
        return [None if not k else k[0] if len(k) == 1 else k for k in kept]

    for s, w in zip(jax.tree.leaves(split), jax.tree.leaves(whole)):  # the rules' layout, plus data once
        assert "data" in spec_axes(s.spec)
        assert without_data(s.spec) == list(w.spec) + [None] * (len(s.spec) - len(w.spec))
    # data of size 1 (1x1, 1x4): the layout, and so the compiled step, is the plain one
    one = nnx.to_pure_dict(shardings(state, MeshShape(1, 4).make(), MEGATRON_RULES, split_over_data=True))
    assert jax.tree.leaves(one) == jax.tree.leaves(nnx.to_pure_dict(shardings(state, MeshShape(1, 4).make(),
                                                                              MEGATRON_RULES)))


@pytest.mark.parametrize("name, data, model", [("gpt", 2, 4), ("gpt", 4, 2), ("bert", 2, 4)])
def test_fsdp_same_gradients_with_a_data_th_of_the_state(name, data, model):
    got = _gradient_step("fsdp", data, model, name)
    _assert_plain_gradients(name, got)
    fsdp = got[0]
    # Parameters and moments (so gradients: they take the parameters' layout) 1/data per device: every parameter
    # of these models has a dimension `data` divides besides `layers`.
    assert _state_bytes(fsdp, "params") * data == _plain_param_bytes(fsdp)
    assert _state_bytes(fsdp, "opt_state") * data == 2 * _plain_param_bytes(fsdp)
    # The compiled step's arguments per device (memory_analysis()): the split state, the batch and the scalars;
    # its outputs alias the donated state.
    fields, batch_shardings = batch_layout(fsdp.spec, fsdp.mesh)
    batch = sum(int(np.prod(batch_shardings[k].shard_shape((8, *f.row_shape)))) * f.dtype.itemsize
                for k, f in fields.items())
    analysis = fsdp.step_fn.memory_analysis()
    state = _state_bytes(fsdp, "params") + _state_bytes(fsdp, "opt_state")
    assert analysis.argument_size_in_bytes == state + batch + SCALAR_STATE_BYTES
    assert analysis.alias_size_in_bytes == state + SCALAR_STATE_BYTES

    colls = collectives(fsdp.step_fn.as_text(), fsdp.mesh)
    layers = fsdp.spec.model.num_layers
    per_device = {path: model_shard_elements(x)  # gathered: the model axis's shard, all layers
                  for path, x in jax.tree_util.tree_leaves_with_path(fsdp.abstract_state.params)}
    block = sum(n for p, n in per_device.items() if "blocks" in jax.tree_util.keystr(p))
    block_kernels = sum(n for p, n in per_device.items()
                        if "blocks" in jax.tree_util.keystr(p) and p[-1].key == "kernel")
    gathers = [c for c in colls if c.op == "all-gather" and c.axes == {"data"}]
    # Forward: every parameter gathered once where it is used, the blocks' one layer at a time inside the scan
    # (no gather of a whole stack); the tied word embedding once for both its uses (lookup and output layer).
    forward = sum(c.elements * c.executions for c in gathers if c.phase == "forward")
    assert forward == sum(per_device.values())
    assert all(c.executions % layers == 0 and c.elements * layers <= block
               for c in gathers if c.phase == "forward" and c.elements * c.executions <= block and c.executions > 1)
    # Backward: no layer's gathered kernels are kept for it; each is gathered again, one layer at a time.
    backward = [c for c in gathers if c.phase == "backward" and c.executions == layers]
    assert sum(c.elements * c.executions for c in backward) == block_kernels
    # The gradients' reduction over data: XLA:CPU all-reduces each layer's gradients inside the backward loop and
    # each device keeps its slice (the GPU pipeline makes the pair a reduce-scatter); a few small replicated
    # kernels go by collective-permutes. Exactly the plain step's minimum.
    reduced = [c for c in colls if "data" in c.axes and c.phase == "backward" and c.op != "all-gather"
               and c.elements > 1]
    assert {c.op for c in reduced} <= {"all-reduce", "collective-permute"}
    budget = step_budget(fsdp)
    assert sum(c.shard_elements * c.executions * 4 for c in reduced) == budget.minimum["data-parallel gradients"]
    # The report's expectation for the gathers is ZeRO-3's, every split parameter twice: the compiled step gathers
    # less (0.778 GPT 2x4, 0.788 GPT 4x2, 0.731 BERT 2x4), as the word embedding (gathered once for its two uses)
    # and the head's and the blocks' small vectors are kept for the backward pass.
    gathers = "data-parallel parameter gathers"
    assert 0.7 * budget.minimum[gathers] <= budget.compiled[gathers] <= budget.minimum[gathers]


# Every choice on every mesh where it changes the layout (data > 1 for ZeRO-1 and FSDP, model > 1 for sequence
# parallelism; elsewhere the layout, so the compiled step, is the plain one) and selective recomputation on every
# mesh, for both models: the runs above plus these, two choices in one run where that saves a compile.
MATRIX = [("gpt", 1, 4, "sequence", "selective"), ("gpt", 2, 4, None, "selective"),
          ("gpt", 4, 2, None, "selective"), ("bert", 1, 1, "sequence", "selective"),
          ("bert", 1, 4, None, "selective"), ("bert", 2, 4, None, "selective"),
          ("bert", 4, 2, "shard_optimizer", "none"), ("bert", 4, 2, "fsdp", "selective"),
          # Llama's 2 key/value heads replicated (1x4, 2x4) and split (4x2) under each choice
          ("llama", 1, 4, "sequence", "selective"), ("llama", 2, 4, "fsdp", "selective"),
          ("llama", 4, 2, "shard_optimizer+sequence", "none")]


@pytest.mark.parametrize("name, data, model, choice, remat", MATRIX)
def test_each_choice_on_each_mesh_computes_the_plain_gradients(name, data, model, choice, remat):
    _assert_plain_gradients(name, _gradient_step(choice, data, model, name, remat))


@pytest.mark.parametrize("name", ["gpt", "bert"])
def test_selective_recomputation_communicates_as_the_plain_step(name):
    """Recomputing the attention core redoes no collective: every category's bytes equal the plain step's (2x4)."""
    plain, selective = (_gradient_step(None, 2, 4, name, remat)[0] for remat in ("none", "selective"))
    assert step_budget(selective).compiled == step_budget(plain).compiled
    assert step_budget(selective).scalars == step_budget(plain).scalars
