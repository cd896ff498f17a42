"""parallel.shard_optimizer (ZeRO-1): AdamW's moments split over `data` by a rule on the parameters' layout. The
same losses and parameters as the replicated step, 1/data of the optimizer-state bytes, and checkpoints that
restore across the choice."""

import jax
import numpy as np
import pytest
from conftest import small_config
from jax.sharding import NamedSharding, PartitionSpec as P

from megajax.comm_budget import step_budget
from megajax.data.sources import make_loader
from megajax.hlo_audit import collectives
from megajax.partition import over_data
from megajax.sharding import make_mesh
from megajax.training.loop import setup, train


def _config(shard: bool, data: int, model: int, steps: int = 3):
    c = small_config(data=data, model=model)
    c.parallel.shard_optimizer = shard
    c.data.source = "random"
    c.train.update(global_batch_size=8, precision="fp32", steps=steps, log_every=1, eval_batches=0)
    c.optimizer.update(lr=1e-3, warmup_steps=0, decay_steps=10)
    c.checkpoint.enabled = False
    return c


def test_over_data_splits_the_first_free_divisible_dimension():
    mesh = make_mesh(4, 2)
    s = lambda *spec: NamedSharding(mesh, P(*spec))  # noqa: E731
    assert over_data(s(None, "model"), (64, 128)).spec == P("data", "model")
    assert over_data(s("model", None), (2, 3, 8)).spec == P("model", None, "data")  # 3 is not divisible by 4
    assert over_data(s(None, "model"), (2, 256)).spec == P(None, ("model", "data"))  # 2 does not divide by 4
    assert over_data(s(), (6,)).spec == P()  # nothing fits: stays replicated over data
    assert over_data(s("data"), (8,)).spec == P("data")
    assert over_data(NamedSharding(make_mesh(1, 8), P(None)), (8,)).spec == P(None)  # data axis of size 1


def _moment_bytes(run) -> int:
    leaves = [x for x in jax.tree.leaves(run.abstract_state.opt_state) if x.ndim]
    return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize for x in leaves)


def _steps(shard: bool, data: int, model: int):
    c = _config(shard, data, model)
    run = setup(c)
    state, loader, losses = run.init_state(), make_loader(c), []
    for _ in range(3):
        state, metrics = run.step_fn(state, loader.next_global(run.batch_shardings))
        losses.append(float(metrics["loss"]))
    return run, losses, jax.tree.map(np.array, state.params)  # writable copies


@pytest.mark.parametrize("data, model", [(2, 4), (4, 2)])
def test_same_training_and_a_data_th_of_the_moments(data, model):
    plain, plain_losses, plain_params = _steps(False, data, model)
    zero, zero_losses, zero_params = _steps(True, data, model)
    np.testing.assert_allclose(zero_losses, plain_losses, rtol=1e-6)
    # The key bias's gradient is 0 in exact arithmetic (softmax ignores a per-query constant), so both runs move it
    # by Adam-amplified rounding noise: compare it apart, as noise of size <= lr x steps.
    zero_k, plain_k = (p["blocks"]["attn"]["qkv"]["bias"][:, :, 1] for p in (zero_params, plain_params))
    assert np.abs(zero_k).max() < 3e-3 and np.abs(plain_k).max() < 3e-3
    for p in (zero_params, plain_params):
        p["blocks"]["attn"]["qkv"]["bias"][:, :, 1] = 0
    for a, b in zip(jax.tree.leaves(zero_params), jax.tree.leaves(plain_params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())
    assert _moment_bytes(zero) * data == _moment_bytes(plain)  # every moment of this model divides by `data`
    # The collectives over `data`: the gradients are reduced as in the plain step's minimum (XLA:CPU all-reduces
    # and slices; GPU XLA makes that a reduce-scatter), and the updated parameter shards are all-gathered once:
    # the gathers' results add up to exactly one device's parameters.
    colls = collectives(zero.step_fn.as_text(), zero.mesh)
    gathered = sum(c.elements * c.executions for c in colls
                   if c.op == "all-gather" and c.axes == {"data"} and c.phase == "forward")
    params = sum(int(np.prod(x.sharding.shard_shape(x.shape))) for x in jax.tree.leaves(zero.abstract_state.params))
    assert gathered == params
    budget = step_budget(zero)
    assert budget.compiled["data-parallel gradients"] == budget.minimum["data-parallel gradients"]


def test_checkpoints_restore_across_the_choice(tmp_path):
    """Two steps with ZeRO-1, then two more without it (and the reverse) equal four steps of either."""
    def run(shard, steps, workdir):
        c = _config(shard, 2, 4, steps)
        c.checkpoint.update(enabled=True, every_steps=2, async_save=False)
        return [r["loss"] for r in train(c, workdir) if "loss" in r]

    straight = run(False, 4, tmp_path / "straight")
    for first in (True, False):
        workdir = tmp_path / f"switch_{first}"
        head = run(first, 2, workdir)
        tail = run(not first, 4, workdir)
        np.testing.assert_allclose(head + tail, straight, rtol=1e-6)
