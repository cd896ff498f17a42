"""FP8 training (``train.precision=fp8``, megajax.parallel.fp8) on the CPU, where XLA emulates FP8: the per-tensor
quantisation and the GEMM with its two gradients against float64 numpy, one step's loss and gradients against
bf16's on sharded meshes, and a tiny model learning as bf16 does across a bf16 <-> fp8 resume. That the GEMMs
compile to cuBLASLt's FP8 calls for H100s: tests/test_gpu_target.py."""

import functools
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import choice_config

from megajax.cli import load_config
from megajax.config import model_config
from megajax.config.load import load_model
from megajax.errors import ConfigError
from megajax.parallel import fp8
from megajax.training.data import make_loader
from megajax.training.loop import setup, train


def _quantized64(x: np.ndarray, dtype) -> tuple[np.ndarray, np.float32]:
    """numpy's per-tensor scaling: the FP8 values (as float64) and the scale, the largest power of two with
    amax x scale <= fmax."""
    top = float(ml_dtypes.finfo(dtype).max)
    amax = float(np.abs(x).max())
    scale = np.float32(2.0 ** np.floor(np.log2(top / amax))) if amax > 0 else np.float32(1.0)
    assert top / 2 < amax * scale <= top or amax == 0
    return np.clip(x.astype(np.float32) * scale, -top, top).astype(dtype).astype(np.float64), scale


def _bf16(x: np.ndarray) -> np.ndarray:
    return x.astype(ml_dtypes.bfloat16).astype(np.float32)


def test_quantize_is_numpys_per_tensor_scaling():
    """Bit for bit numpy's: the largest power-of-two scale with amax x scale <= fmax, round-to-nearest-even into
    E4M3 / E5M2; values in the normal range come back within half an ulp (2^-4 relative for E4M3's 3 mantissa
    bits, 2^-3 for E5M2's 2); an all-zero tensor has scale 1."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((64, 96)) * np.exp(rng.uniform(-4, 4, (64, 96)))).astype(np.float32)
    for dtype, mantissa in ((fp8.FORWARD, 3), (fp8.BACKWARD, 2)):
        q, inverse = jax.jit(fp8.quantize, static_argnums=1)(jnp.asarray(x), dtype)
        want, scale = _quantized64(x, dtype)
        assert q.dtype == dtype
        np.testing.assert_array_equal(np.asarray(q).astype(np.float64), want)
        assert float(inverse) == 1 / float(scale)
        back = np.asarray(q).astype(np.float64) * float(inverse)
        normal = np.abs(x) * scale >= float(ml_dtypes.finfo(dtype).smallest_normal)
        assert normal.mean() > 0.9
        relative = np.abs(back - x)[normal] / np.abs(x)[normal]
        assert relative.max() <= 2.0 ** -(mantissa + 1) * (1 + 1e-6), relative.max()
    q, inverse = fp8.quantize(jnp.zeros((4, 4)), fp8.FORWARD)
    assert float(inverse) == 1.0 and not np.asarray(q.astype(jnp.float32)).any()


def test_fp8_gemm_and_its_gradients_are_numpys():
    """(B, S, H) x (H, heads, D): the output and the input's gradient in bf16 equal numpy's products of the FP8
    operands (float64) to one bf16 rounding (2^-8 relative, where the GPU's cuBLASLt call rounds once too); the
    kernel's gradient, accumulated in fp32, to 1e-6. Against the exact float64 product the output is within the
    FP8 error bound (2 x 2^-4 relative per term: 0.13 x |x| @ |w|)."""
    rng = np.random.default_rng(1)
    x = _bf16(rng.standard_normal((3, 5, 64)).astype(np.float32))
    w = (rng.standard_normal((64, 4, 8)) * 0.02).astype(np.float32)
    g = _bf16(rng.standard_normal((3, 5, 4, 8)).astype(np.float32))

    def loss(x, w):
        return jnp.sum(fp8.fp8_tensordot(x, w, 1, jnp.bfloat16).astype(jnp.float32) * g)

    y = fp8.fp8_tensordot(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w), 1, jnp.bfloat16)
    dx, dw = jax.jit(jax.grad(loss, (0, 1)))(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w))
    assert (y.dtype, dx.dtype, dw.dtype) == (jnp.bfloat16, jnp.bfloat16, jnp.float32)
    (xq, sx), (wq, sw), (gq, sg) = (_quantized64(x, fp8.FORWARD), _quantized64(w, fp8.FORWARD),
                                    _quantized64(g, fp8.BACKWARD))
    want_y = np.tensordot(xq, wq, 1) / (float(sx) * float(sw))
    want_dx = np.tensordot(gq, wq, ((2, 3), (1, 2))) / (float(sg) * float(sw))
    want_dw = np.tensordot(xq, gq, ((0, 1), (0, 1))) / (float(sx) * float(sg))
    for got, want, rtol in ((y, want_y, 2.0 ** -8), (dx, want_dx, 2.0 ** -8), (dw, want_dw, 1e-6)):
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=rtol, atol=1e-30)
    exact = np.tensordot(x.astype(np.float64), w.astype(np.float64), 1)
    bound = 0.13 * np.tensordot(np.abs(x), np.abs(w), 1) + 2.0 ** -8 * np.abs(exact)
    assert (np.abs(np.asarray(y, np.float64) - exact) <= bound).all()


def test_fp8_grouped_gemm_and_its_gradients_are_numpys():
    """The experts' grouped GEMM kernel (``parallel/grouped_gemm``, Pallas interpret mode) in FP8: 300 bf16 rows of
    which 5 groups hold 228 (one empty, one of a single row) times fp32 weights (72 x 40 each). Every operand E4M3,
    the rows and the output gradient per tensor, each group's weights by their own amax: the output and the rows'
    gradient (bf16) equal numpy's float64 products of the FP8 operands to one bf16 rounding (2^-8 relative), the
    weights' gradient (fp32, summed over up to 130 rows) to 1e-6 of its largest; rows past the groups and the empty
    group's gradient are zeros. Against the exact product the output is within the FP8 bound (0.13 x |x| @ |w|)."""
    from megajax.parallel.grouped_gemm import grouped_gemm

    rng = np.random.default_rng(2)
    sizes = np.array([37, 0, 130, 1, 60])
    group = np.repeat(np.arange(5), sizes)
    held = len(group)
    x = _bf16(rng.standard_normal((300, 72)).astype(np.float32))
    x[held:] = 0  # the buffer's rows past the groups, zeros as the exchange leaves them
    w = (rng.standard_normal((5, 72, 40)) * np.exp(rng.uniform(-3, 3, (5, 1, 1))) * 0.02).astype(np.float32)
    g = _bf16(rng.standard_normal((300, 40)).astype(np.float32))
    run = functools.partial(grouped_gemm, sizes=jnp.asarray(sizes, jnp.int32), how="interpret", fp8=True)
    xb = jnp.asarray(x, jnp.bfloat16)
    y = jax.jit(run)(xb, jnp.asarray(w))
    dx, dw = jax.jit(jax.grad(lambda a, b: jnp.sum(run(a, b).astype(jnp.float32) * g), (0, 1)))(xb, jnp.asarray(w))
    assert (y.dtype, dx.dtype, dw.dtype) == (jnp.bfloat16, jnp.bfloat16, jnp.float32)
    (xq, sx), (gq, sg) = _quantized64(x, fp8.FORWARD), _quantized64(g, fp8.FORWARD)
    wq, sw = zip(*(_quantized64(w[e], fp8.FORWARD) for e in range(5)))
    wq, sw = np.stack(wq), np.array(sw, np.float64)
    want_y, want_dx = np.zeros((300, 40)), np.zeros((300, 72))
    want_y[:held] = np.einsum("rk,rkn->rn", xq[:held], wq[group]) / (float(sx) * sw[group, None])
    want_dx[:held] = np.einsum("rn,rkn->rk", gq[:held], wq[group]) / (float(sg) * sw[group, None])
    want_dw = np.zeros((5, 72, 40))
    np.add.at(want_dw, group, np.einsum("rk,rn->rkn", xq[:held], gq[:held]))
    want_dw /= float(sx) * float(sg)
    for got, want, rtol in ((y, want_y, 2.0 ** -8), (dx, want_dx, 2.0 ** -8), (dw, want_dw, 1e-6)):
        atol = 1e-6 * np.abs(want).max() if got is dw else 1e-30  # fp32 sums of up to 130 terms that cancel
        np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=rtol, atol=atol)
    assert not np.asarray(dw)[1].any() and not np.asarray(y, np.float32)[held:].any()
    exact = np.einsum("rk,rkn->rn", x[:held].astype(np.float64), w[group].astype(np.float64))
    bound = 0.13 * np.einsum("rk,rkn->rn", np.abs(x[:held]), np.abs(w[group])) + 2.0 ** -8 * np.abs(exact)
    assert (np.abs(np.asarray(y, np.float64)[:held] - exact) <= bound).all()


def _one_step(name: str, precision: str, mesh: tuple[int, int], choice: str | None) -> tuple[float, dict]:
    """One step's loss and each parameter's change (AdamW with eps >> |g|: lr / eps x its gradient)."""
    config = choice_config(choice, *mesh, name=name, gradient_step=True)
    config.train.precision = precision
    run = setup(config)
    state = run.init_state()
    before = jax.tree.map(np.asarray, state.params)
    state, metrics = run.step_fn(state, make_loader(run.spec).next_global(run.batch_shardings))
    change = jax.tree.map(lambda a, b: np.asarray(a, np.float64) - b, state.params, before)
    return float(metrics["loss"]), change


@pytest.mark.parametrize("name,choice", [("gpt", "sequence"), ("llama", None)])
def test_one_step_matches_bf16(name, choice):
    """On 2x4 (GPT under sequence parallelism: each device's blocks scaled by their own amax; Llama's fused
    query / key-value and gate / up GEMMs): the loss within 0.5% of bf16's and every parameter's gradient within
    a cosine of 0.99 and 5% in norm of bf16's."""
    loss8, change8 = _one_step(name, "fp8", (2, 4), choice)
    loss16, change16 = _one_step(name, "bf16", (2, 4), choice)
    assert loss8 == pytest.approx(loss16, rel=5e-3)
    flat8, flat16 = jax.tree_util.tree_leaves_with_path(change8), jax.tree.leaves(change16)
    for (path, a), b in zip(flat8, flat16):
        na, nb = np.linalg.norm(a), np.linalg.norm(b)
        if nb == 0:
            continue
        cosine = float((a * b).sum() / (na * nb))
        assert cosine > 0.99 and abs(na / nb - 1) < 0.05, (jax.tree_util.keystr(path), cosine, na / nb)


@pytest.mark.many_steps
def test_tiny_model_learns_as_bf16_does_and_resumes_across_precisions(tmp_path):
    """gpt_tiny on the default corpus on one device, 40 steps of 8 sequences in bf16 and in fp8: the loss falls by
    more than a nat from step 10 in both, every logged loss within 2% of bf16's, the held-out loss within 0.1 nats
    of it. The
    checkpoints hold fp32 parameters and moments whatever the precision: the bf16 run resumes in fp8 and the fp8
    run in bf16, 4 steps more each, their losses there within 2% of each other; an fp8 checkpoint loads for
    evaluation in bf16."""
    def run(precision: str, steps: int, workdir):
        config = load_config("gpt_tiny")
        config.train.update(steps=steps, log_every=4 if steps > 40 else 10, precision=precision,
                            global_batch_size=8, eval_batches=2)
        config.mesh.update(data=1, model=1)
        config.checkpoint.every_steps = 40
        train(config, workdir)
        return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]

    curves = {p: run(p, 40, tmp_path / p) for p in ("bf16", "fp8")}
    want, got = ({r["step"]: r["loss"] for r in curves[p] if "loss" in r} for p in ("bf16", "fp8"))
    assert sorted(got) == sorted(want) == [10, 20, 30, 40]
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=0.02), (step, got[step], want[step])
    assert got[40] < got[10] - 1 and want[40] < want[10] - 1, (got, want)
    assert curves["fp8"][-1]["valid_loss"] == pytest.approx(curves["bf16"][-1]["valid_loss"], abs=0.1)
    resumed = {p: run(p, 44, tmp_path / other) for p, other in (("fp8", "bf16"), ("bf16", "fp8"))}
    for precision, lines in resumed.items():
        begun = [r for r in lines if r.get("event") in ("start", "resume")][-1]
        assert (begun["event"], begun["step"], begun["precision"]) == ("resume", 40, precision), begun
    assert resumed["fp8"][-1]["step"] == resumed["bf16"][-1]["step"] == 44
    loss = {p: [r["loss"] for r in lines if r.get("step") == 44 and "loss" in r][0] for p, lines in resumed.items()}
    assert loss["fp8"] == pytest.approx(loss["bf16"], rel=0.02), loss
    model, spec, _ = load_model(tmp_path / "bf16")  # its last run was fp8: evaluated in bf16
    assert spec.precision == "bf16" and not spec.model.fp8 and model is not None


def test_fp8_is_refused_where_the_gpu_has_no_fp8_tensor_cores():
    """One error line naming the device, before anything compiles; the precision's other spellings are named."""
    assert fp8.fp8_refusal("NVIDIA H100 80GB HBM3", (9, 0)) == ""
    assert "compute capability 8.0" in fp8.fp8_refusal("NVIDIA A100-SXM4-80GB", (8, 0))

    class A100:
        platform, device_kind, compute_capability = "gpu", "NVIDIA A100-SXM4-80GB", "8.0"

    with pytest.raises(ConfigError, match="no FP8 tensor cores.*train.precision=bf16"):
        fp8.check_fp8_devices([A100()])
    fp8.check_fp8_devices(jax.devices())  # the CPU emulates
    config = load_config("gpt_tiny")
    config.train.precision = "fp4"
    with pytest.raises(ConfigError, match="fp8"):
        model_config(config)
