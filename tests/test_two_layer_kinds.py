"""The proof that a model with two layer kinds arrives as one file (issue 54): a GPT whose first layer is GPT's block
and whose other layers have a gated MLP.

The first layer is the trunk's ``Block`` on a stack of its own (``stem``), not split over pipeline stages; the
others are blocks whose MLP is GeGLU (``down(act(gate(x)) * up(x))``, the gate and up kernels one column-parallel
GEMM) on the pipelined stack. The spec declares both stacks and both layer kinds (``ModelSpec.stacks``): each kind
states its residual bytes and all-reduces next to its code, and the tools sum them over the stacks. Nothing outside
this file knows the family: it trains the same on every mesh, its residuals are what autodiff keeps, the memory
planner and the scaling model are within 10% of its compiled step, it communicates the minimum, and under
``pipe=2`` with the 1F1B schedule its step equals the plain one.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_planned_within_10_percent, assert_same_step
from flax import nnx

from megajax.config import base_config, model_config, resolve
from megajax.models.block_memory import FP32, block_residual_bytes
from megajax.models.gpt import GPT, GPTConfig
from megajax.models.spec import BLOCK, MODELS, LayerKind, Stack, decoder_flops, decoder_spec, register
from megajax.models.transformer import Block, make_blocks, run_blocks
from megajax.parallel import pipeline
from megajax.parallel.hlo_audit import collectives, summary
from megajax.parallel.layers import ACTIVATIONS, ColumnParallelLinear, RowParallelLinear, scaled_init_std
from megajax.parallel.mesh import MeshShape
from megajax.parallel.sharding import constrain
from megajax.tools import scaling
from megajax.tools.comm_budget import step_budget
from megajax.tools.memory_planner import compiled_memory
from megajax.tools.memory_terms import traced_layer_residual_bytes
from megajax.training.data import make_loader
from megajax.training.loop import setup, train

NAME = "stem_gpt"
STEM = "stem"  # the first layer's stack


@dataclasses.dataclass(frozen=True, kw_only=True)
class StemGPTConfig(GPTConfig):
    """GPT's fields; at least two layers (the stem's and one gated)."""

    def __post_init__(self):
        super().__post_init__()
        if self.num_layers < 2:
            raise ValueError(f"model.num_layers={self.num_layers}: the stem's layer and at least one gated layer")


class GatedMLP(nnx.Module):
    """H -> (F, 2) (one column-parallel GEMM: each shard's gate and up units side by side) -> act(gate) * up -> H
    (row-parallel): one all-reduce each way, as GPT's MLP."""

    def __init__(self, cfg: StemGPTConfig, *, rngs: nnx.Rngs):
        h, f, dt = cfg.hidden_size, cfg.ffn_size, cfg.compute_dtype
        self.act = ACTIVATIONS[cfg.activation]
        self.gate_up = ColumnParallelLinear(h, (f, 2), ("embed", "mlp", None), std=cfg.init_std, dtype=dt, rngs=rngs)
        self.down = RowParallelLinear((f,), h, ("mlp", "embed"), std=scaled_init_std(cfg.init_std, cfg.num_layers),
                                      dtype=dt, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        y = self.gate_up(x)  # (B, S, F, 2)
        return self.down(constrain(self.act(y[..., 0]) * y[..., 1], ("batch", "seq", "mlp")))


class GatedBlock(Block):
    """GPT's block with the gated MLP."""

    mlp_class = GatedMLP


class StemGPT(GPT):
    """GPT-2's embeddings, final LayerNorm and tied output around one ``Block`` (``stem``, run whole on every
    pipeline stage) and ``num_layers - 1`` ``GatedBlock``s (``blocks``, the pipelined stack)."""

    def _make_layers(self, cfg: StemGPTConfig, rngs: nnx.Rngs) -> None:
        self.stem = make_blocks(cfg, rngs, Block, count=1, pipelined=False)
        self.blocks = make_blocks(cfg, rngs, GatedBlock, count=cfg.num_layers - 1)

    def _run_layers(self, x, mask, dropout_key, cache, index, stack=pipeline.run_stack):
        cfg, layers = self.cfg, self.cfg.num_layers
        part = lambda r: None if cache is None else tuple(c[r.start:r.stop] for c in cache)  # noqa: E731
        x, first = run_blocks(self.stem, cfg, x, mask, dropout_key, part(range(1)), index, range(1),
                              stack=pipeline.run_whole)
        x, rest = run_blocks(self.blocks, cfg, x, mask, dropout_key, part(range(1, layers)), index,
                             range(1, layers), stack=stack)
        return x, None if cache is None else tuple(jnp.concatenate(c) for c in zip(first, rest))


def gated_residual_bytes(cfg: StemGPTConfig, rows: int, tp: int, split: int, remat: str, cd: int,
                         attention: str = "xla") -> int:
    """Bytes one GatedBlock keeps for its backward pass on one device: GPT's block's (``block_residual_bytes``)
    with its MLP's (b, s, f) tensors replaced by the gated MLP's: the fused GEMM's output (gate and up, 2), the
    activation's intermediates on the gate (GeLU-tanh 4, erf 2), the activated gate and the product (the down
    GEMM's input); in 16-bit the compute-dtype copy of the fused kernel (h x 2f) in place of MLP-up's."""
    s, b, h, f = cfg.max_seq_len, rows, cfg.hidden_size, cfg.ffn_size
    trunk = block_residual_bytes(cfg, rows, tp, split, remat, cd, attention)
    if remat == "full":
        return trunk
    if remat == "save_dots":  # the fused GEMM's output is twice MLP-up's
        return trunk + s * b * f * cd // tp
    gpt_mlp = {"gelu_tanh": 6, "gelu": 4}[cfg.activation]
    gated = {"gelu_tanh": 8, "gelu": 6}[cfg.activation]
    kept = trunk + (gated - gpt_mlp) * s * b * f * cd // tp
    if cd < FP32:
        kept += h * f * cd // tp  # the fused kernel: h x 2f, not h x f
    return kept


# GPT's block and the gated block: two all-reduces each way, one redone under remat=full
GATED = LayerKind("gated block", residuals=gated_residual_bytes)


def stacks(cfg: StemGPTConfig) -> tuple[Stack, ...]:
    """The stem's one GPT block (not pipelined), then the gated blocks."""
    return Stack(STEM, BLOCK, 1, pipelined=False), Stack("blocks", GATED, cfg.num_layers - 1)


def flops(cfg: StemGPTConfig, rows: int, seq: int) -> float:
    """GPT's block's FLOPs once, the gated blocks' (an MLP of three h x f GEMMs) L - 1 times, the output layer."""
    h = cfg.hidden_size
    return (decoder_flops(rows, seq, 1, h, 2 * h, 2 * cfg.ffn_size, cfg.padded_vocab_size)
            + decoder_flops(rows, seq, cfg.num_layers - 1, h, 2 * h, 3 * cfg.ffn_size, 0))


SPEC = decoder_spec(NAME, StemGPTConfig, StemGPT, flops, sequence_rows=("wpe",), eval_tasks=(), pretrained_trunk=None,
                    stacks=stacks)


@pytest.fixture(scope="module", autouse=True)
def registered():
    """The family in the registry while this module's tests run (other modules list the registry)."""
    register(SPEC)
    yield
    del MODELS[NAME]


def small(data: int = 1, model: int = 1, pipe: int = 1, **fields):
    """3 layers (the stem's, two gated), hidden 64, 8 heads, MLP 256, vocab 1000 (padded to 1024), 32 tokens, on
    random data, fp32."""
    config = base_config(NAME)
    config.model.update({**dict(vocab_size=1000, make_vocab_size_divisible_by=128, num_layers=3, hidden_size=64,
                                num_heads=8, max_seq_len=32, dropout=0.0, remat="none"), **fields})
    config.mesh.update(data=data, model=model, pipe=pipe)
    config.data.source = "random"
    config.train.update(global_batch_size=8, precision="fp32", steps=4, log_every=1, eval_batches=0)
    config.optimizer.update(lr=1e-3, warmup_steps=0, decay_steps=10)
    config.checkpoint.enabled = False
    return config


def test_trains_the_same_on_every_mesh(tmp_path):
    """Four AdamW steps on 1x1 and 2x4: the same losses (fp32, the sharded sums reorder additions)."""
    curves = {mesh: [r["loss"] for r in train(small(*mesh), tmp_path / f"{mesh}") if "loss" in r]
              for mesh in [(1, 1), (2, 4)]}
    np.testing.assert_allclose(curves[(2, 4)], curves[(1, 1)], rtol=1e-5)
    assert len(curves[(1, 1)]) == 4 and np.isfinite(curves[(1, 1)]).all()


@pytest.mark.parametrize("remat", ["none", "selective", "full", "save_dots"])
@pytest.mark.parametrize("precision,dropout,activation", [("fp32", 0.0, "gelu_tanh"), ("bf16", 0.1, "gelu")])
def test_each_kinds_residuals_are_what_autodiff_keeps(remat, precision, dropout, activation):
    """Each stack's layer kind against its own forward scan in the traced gradient: the stem's (the first scan)
    and the gated blocks' (the second)."""
    config = small(remat=remat, dropout=dropout, activation=activation)
    config.train.precision = precision
    cfg, run = model_config(config), resolve(config, 1, training=False)
    cd = 4 if precision == "fp32" else 2
    for scan, kind in enumerate((BLOCK, GATED)):
        assert kind.residuals(cfg, 2, 1, 1, remat, cd) == traced_layer_residual_bytes(run, 2, scan), kind.name


@pytest.mark.memory_plan
@pytest.mark.parametrize("mesh,remat", [((2, 4), "selective")])  # (each policy's bytes per kind: above)
def test_memory_planner_within_10_percent_of_the_compiled_step(mesh, remat):
    """The planner sums each stack's count of its kind's residuals (1 x GPT's block, 2 x the gated block's)."""
    assert_planned_within_10_percent(resolve(small(*mesh, remat=remat), math.prod(mesh), training=False), 4)


@pytest.mark.parametrize("mesh,remat", [((1, 4), "none"), ((2, 4), "full")])
def test_communicates_the_minimum_its_kinds_state(mesh, remat):
    """The compiled step's collectives by category equal the minimum the budget sums over the stacks (ratio
    1.0000), and, counted here without the budget: over `model`, two all-reduces of b x s x h per layer each way
    (the stem's and the gated blocks' alike) plus the embedding's, and under remat=full one more backward per layer
    (the recomputed attention output)."""
    run = setup(small(*mesh, remat=remat))
    budget = step_budget(run)
    assert budget.compiled == budget.minimum and budget.ratio == 1.0, budget.table()
    b, s, h, layers = 8 // mesh[0], 32, 64, 3
    counts = summary(collectives(run.step_fn.as_text(), run.mesh))
    assert counts[("all-reduce", ("model",), "forward", b * s * h)] == 2 * layers + 1
    assert counts[("all-reduce", ("model",), "backward", b * s * h)] == (3 if remat == "full" else 2) * layers + 1


@pytest.mark.memory_plan
def test_scaling_model_within_10_percent_of_the_compiled_step():
    """The scaling model's GEMMs, read stack by stack from the abstract model, add up to the spec's FLOPs, and its
    memory per GPU (bf16, as it plans GPUs) is the compiled step's peak within 10%, on 4x2."""
    config = small(4, 2)
    config.train.precision = "bf16"
    cfg, run = model_config(config), resolve(config, 8, training=False)
    per_gpu = 0.0
    for i, stack in enumerate(run.stacks):  # one GPU's forward GEMMs, (batch, m, k, n) each
        dense, attention, logits = scaling.gemms(run, 2, 8, i)
        per_gpu += 3 * stack.count * sum(2 * math.prod(g) for g in dense + attention)
    per_gpu += 3 * 2 * math.prod(logits)
    assert per_gpu * 2 == pytest.approx(SPEC.flops(cfg, 8, cfg.max_seq_len), rel=1e-12)
    compiled = compiled_memory(run, micro_batch=4)
    assert scaling.memory_bytes(run, MeshShape(4, 2), 4) == pytest.approx(compiled.peak, rel=0.10)


def _gradient_step_run(config):
    """``config``'s compiled run with an optimizer whose change is lr / eps x gradient."""
    config.optimizer.update(lr=1e6, eps=1e3, weight_decay=0.0, clip_norm=1e9)
    return setup(config)


def _one_step(run, initial):
    """(loss, parameter change) of one step of ``run`` from ``initial``'s parameters on the first batch."""
    state = jax.tree.map(lambda x, a: jax.device_put(x, a.sharding), initial, run.abstract_state)
    batch = make_loader(run.spec).next_global(run.batch_shardings)
    new, metrics = run.step_fn(state, batch)
    return float(metrics["loss"]), jax.tree.map(lambda a, b: np.asarray(a) - b, new.params, initial.params)


def test_1f1b_under_two_stages_equals_the_plain_step():
    """pipe 2 x data 2 x model 2, 1F1B with 4 microbatches: the stem runs whole on each stage's rows (its gradient
    summed over the stages' shares), the gated blocks one per stage; the loss within 1e-6 and every parameter's
    change within 1e-5 of the one-device step's. (Three layers do not split over two stages: the pipelined stack's
    count does, ``pipe`` must divide ``num_layers`` - 1 here, so this model has 5 layers.)"""
    plain = _gradient_step_run(small(num_layers=5))
    initial = jax.tree.map(np.array, plain.init_state())
    staged = small(2, 2, 2, num_layers=5)
    staged.parallel.update(pipeline_schedule="1f1b", pipeline_microbatches=4)
    assert_same_step(*_one_step(_gradient_step_run(staged), initial), *_one_step(plain, initial))
