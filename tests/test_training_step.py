"""The training step: dropout on, accumulation, fp16 loss scaling, remat."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import small_config, train_config
from flax import nnx

from megajax.config import build_mesh, model_config, rules_of
from megajax.models.gpt import GPT
from megajax.parallel.losses import lm_loss
from megajax.parallel.sharding import ParallelContext, activate
from megajax.training import step as step_module
from megajax.training.data import make_loader
from megajax.training.loop import setup, train


def _curves(records):
    return np.array([[r["loss"], r["grad_norm"]] for r in records if "loss" in r])


def test_dropout_changes_the_gradients(tmp_path):
    """Guard against a silently disabled dropout: without it the gradient norms differ by far more than the 1e-5 to
    which the masks make every mesh train alike (Appendix B.2 in JAX terms: tests/test_dropout_rows.py,
    test_bert_training.py) (at initialisation the loss itself barely depends on dropout)."""
    dropout = _curves(train(train_config(1, 1, dropout=0.1, eval_batches=0), tmp_path / "dropout"))
    assert dropout.shape == (5, 2)
    no_dropout = _curves(train(train_config(1, 1, dropout=0.0, eval_batches=0), tmp_path / "none"))
    relative = np.abs(no_dropout[:, 1] / dropout[:, 1] - 1)
    assert relative.min() > 1e-3 and relative.max() > 1e-2, relative


def _one_step(config):
    run = setup(config)
    state = run.init_state()
    state, metrics = run.step_fn(state, make_loader(run.spec).next_global(run.batch_shardings))
    return float(metrics["loss"]), jax.tree.map(np.asarray, state.params)


@pytest.mark.parametrize("data,model,micro", [(1, 1, 2)])  # on 2x4 (and in stages): tests/test_dropout_rows.py
def test_gradient_accumulation_equals_full_batch(data, model, micro):
    full_loss, full_params = _one_step(train_config(data, model, steps=1))
    acc_loss, acc_params = _one_step(train_config(data, model, steps=1, micro_batch_size=micro))
    np.testing.assert_allclose(acc_loss, full_loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(acc_params), jax.tree.leaves(full_params)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("gpu_skip", [False, True], ids=["cond", "select"])
def test_fp16_overflow_skips_then_backs_off_then_grows(gpu_skip, monkeypatch):
    """Initial scale 2^32 overflows fp16 gradients: the first step is skipped with parameters unchanged; the
    second overflow (hysteresis 2) halves the scale; after `growth_interval` clean steps the scale doubles. Both
    ways the step skips an update: cond (the CPU's) and select (an NVIDIA GPU's, traced here on the CPU)."""
    monkeypatch.setattr(step_module, "traced_for_nvidia_gpu", lambda: gpu_skip)
    config = train_config(steps=40, precision="fp16")
    config.loss_scale.update(initial=2.0**32, growth_interval=3, hysteresis=2)
    run = setup(config)
    state = run.init_state()
    loader = make_loader(run.spec)
    before = jax.tree.map(np.asarray, state.params)
    state, m = run.step_fn(state, loader.next_global(run.batch_shardings))
    assert int(m["skipped"]) == 1 and float(state.loss_scale.scale) == 2.0**32
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(before)):
        np.testing.assert_array_equal(np.asarray(a), b)
    state, m = run.step_fn(state, loader.next_global(run.batch_shardings))
    assert int(m["skipped"]) == 1 and float(state.loss_scale.scale) == 2.0**31
    scales, skipped = [], []
    for step in range(2, 40):
        state, m = run.step_fn(state, loader.next_global(run.batch_shardings))
        scales.append(float(state.loss_scale.scale))
        skipped.append(int(m["skipped"]))
    clean = [i for i, s in enumerate(skipped) if not s]
    assert clean, "the scale never came down far enough for a clean fp16 step"
    # Three clean steps in a row double the scale.
    runs = [i for i in range(len(skipped) - 2) if skipped[i:i + 3] == [0, 0, 0]]
    assert runs and scales[runs[0] + 2] == 2 * scales[runs[0] + 1]
    assert np.isfinite(jax.tree.leaves(state.params)[0]).all()


@functools.cache
def _remat_loss_and_grads(remat: str):
    """A small GPT's loss and gradients with dropout 0.1 (recomputation must redraw the same masks) under ``remat``,
    each policy compiled once."""
    config = small_config()
    config.model.update(remat=remat, dropout=0.1)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 1000, (4, 17)))
    graphdef, params = nnx.split(GPT(model_config(config), rngs=nnx.Rngs(0)))
    loss = lambda p: lm_loss(nnx.merge(graphdef, p), tokens[:, :-1], tokens[:, 1:],  # noqa: E731
                             dropout_key=jax.random.key(3))
    return jax.jit(jax.value_and_grad(loss))(params)


@pytest.mark.parametrize("policy", ["full", "save_dots", "selective"])
def test_remat_gives_same_loss_and_gradients(policy):
    loss, grads = _remat_loss_and_grads("none")
    loss_r, grads_r = _remat_loss_and_grads(policy)
    np.testing.assert_allclose(loss_r, loss, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(grads_r), jax.tree.leaves(grads)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)


@pytest.mark.memory_plan
@pytest.mark.parametrize("fsdp", [False, True], ids=["plain", "fsdp"])
def test_selective_recomputation_keeps_no_attention_matrix(fsdp):
    """remat=selective recomputes the attention core: the compiled backward keeps at least one (B, N, S, S) fp32
    tensor per layer less than without recomputation (the scores / probabilities). Under parallel.fsdp too (on 2x1,
    B/2 rows per device), where the layer step's own remat policy (re-gather the parameters) encloses the core:
    with the core a jax.checkpoint, that policy overrode its own and the core kept its intermediates (4.1 MB less
    than remat=none here, not the 8.4 MB below)."""
    b, s, layers, data = 4, 256, 2, 2 if fsdp else 1

    def temp_bytes(remat):
        config = small_config(num_layers=layers, data=data)
        config.model.update(max_seq_len=s, remat=remat, dropout=0.1)
        graphdef, params = nnx.split(GPT(model_config(config), rngs=nnx.Rngs(0)))
        tokens = jnp.zeros((b, s), jnp.int32)
        grad = jax.jit(jax.grad(lambda p: lm_loss(nnx.merge(graphdef, p), tokens, tokens,
                                                  dropout_key=jax.random.key(0))))
        if not fsdp:
            return grad.lower(params).compile().memory_analysis().temp_size_in_bytes
        with activate(build_mesh(config), ParallelContext(rules_of(config), params_split=True)):
            return grad.lower(params).compile().memory_analysis().temp_size_in_bytes

    heads = small_config().model.num_heads
    assert temp_bytes("selective") <= temp_bytes("none") - layers * b // data * heads * s * s * 4


def test_model_flops_per_model_kind():
    """Megatron's 72 B s L h^2 (1 + s/6h + V/12Lh): the vocabulary term only where there is an output layer over
    it (GPT, BERT's MLM, which also adds its h x h transform), four sequences per RACE example."""
    from types import SimpleNamespace

    from megajax.models import model_spec
    from megajax.training.metrics import model_flops_per_step

    b, s, layers, h, v = 8, 128, 2, 64, 1024
    trunk = 72 * b * s * layers * h * h * (1 + s / (6 * h))
    vocab_term = 72 * b * s * layers * h * h * v / (12 * layers * h)  # = 6 B s h V
    model = SimpleNamespace(num_layers=layers, hidden_size=h, padded_vocab_size=v)
    want = {"gpt": trunk + vocab_term, "bert": trunk + vocab_term + 6 * b * s * h * h, "bert_classifier": trunk,
            "bert_span": trunk, "bert_multiple_choice": 4 * trunk}
    for name, flops in want.items():
        spec = SimpleNamespace(model_spec=model_spec(name), model=model, global_batch=b)
        assert model_flops_per_step(spec, s) == pytest.approx(flops, rel=1e-12), name


def test_peak_flops_by_device_kind_and_precision():
    from types import SimpleNamespace

    from megajax.training.metrics import peak_flops

    def peak(kind, precision, override=None):
        return peak_flops(SimpleNamespace(device_kind=kind), precision, override)

    assert peak("NVIDIA H100 80GB HBM3", "bf16") == 989e12 and peak("NVIDIA H100 80GB HBM3", "fp16") == 989e12
    assert peak("NVIDIA H100 PCIe", "bf16") == 756e12  # the specific part before the general name
    assert peak("NVIDIA A100-SXM4-80GB", "fp32") == 156e12  # TF32, XLA's default fp32 matmuls there
    assert peak("Tesla V100-SXM2-32GB", "fp16") == 125e12 and peak("Tesla V100-SXM2-32GB", "fp32") == 15.7e12
    assert peak("TPU v4", "fp32") is None  # no fp32 entry: no half-precision peak for an fp32 run
    assert peak("cpu", "fp32") is None and peak("NVIDIA GeForce RTX 4090", "bf16") is None  # no guess
    assert peak("NVIDIA L40S", "bf16") == 362e12 and peak("NVIDIA L4", "bf16") == 121e12
    assert peak("cpu", "fp32", 1e12) == 1e12
