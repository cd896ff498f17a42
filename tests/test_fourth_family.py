"""The proof that a model family arrives as one file (issue 34): GPT with a parallel attention/MLP block.

The block is GPT-J's and PaLM's, ``x + attn(LN(x)) + mlp(LN(x))`` with one LayerNorm, and Megatron's tensor
parallelism made to fit it: the QKV and MLP-up GEMMs are one column-parallel GEMM (each head's q, k, v and its
share of the MLP units side by side, so a shard holds whole heads and their units) and attention-out and MLP-down
one row-parallel GEMM, so a layer all-reduces once each way instead of twice. Its config has a field of its own
(``input_bias``). Nothing outside this file knows it: it registers its config type, module and spec, trains, is
planned by the memory planner and the scaling model within 10% of its compiled step, and communicates exactly the
minimum its spec states.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_planned_within_10_percent
from flax import nnx

from megajax.config import base_config, model_config, resolve
from megajax.errors import ConfigError
from megajax.models.gpt import GPT, GPTConfig
from megajax.models.spec import MODELS, LayerKind, decoder_spec, register, transformer_flops, trunk_stack
from megajax.models.transformer import attention_core, attention_core_residual_bytes
from megajax.parallel.hlo_audit import collectives, summary
from megajax.parallel.layers import (
    ACTIVATIONS,
    ColumnParallelLinear,
    LayerNorm,
    RowParallelLinear,
    dropout,
    scaled_init_std,
)
from megajax.parallel.mesh import MeshShape
from megajax.parallel.remat import selective
from megajax.parallel.sharding import RESIDUAL, constrain
from megajax.tools import scaling
from megajax.tools.comm_budget import step_budget
from megajax.tools.memory_planner import compiled_memory
from megajax.tools.memory_terms import traced_layer_residual_bytes
from megajax.training.loop import setup, train

NAME = "parallel_gpt"
HEAD = ("batch", "seq", "heads", "head_dim")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelGPTConfig(GPTConfig):
    """GPT's fields and the fused input GEMM's bias (GPT-NeoX has it, PaLM not)."""

    input_bias: bool = True

    def __post_init__(self):
        super().__post_init__()
        if self.ffn_size % self.num_heads:
            raise ValueError(f"the MLP width {self.ffn_size} is not a multiple of model.num_heads="
                             f"{self.num_heads}: each head's group holds an equal share of the MLP units")


class ParallelBlock(nnx.Module):
    """``x + out([attention(q, k, v), act(up)])`` where ``[q, k, v, up] = in(LN(x))``: one GEMM each way."""

    def __init__(self, cfg: ParallelGPTConfig, *, rngs: nnx.Rngs):
        n, d, h, dt = cfg.num_heads, cfg.head_dim, cfg.hidden_size, cfg.compute_dtype
        self.cfg, self.act, units = cfg, ACTIVATIONS[cfg.activation], cfg.ffn_size // n
        self.ln = LayerNorm(h, eps=cfg.layernorm_eps, dtype=dt, rngs=rngs)
        self.w_in = ColumnParallelLinear(h, (n, 3 * d + units), ("embed", "heads", "head_dim"), std=cfg.init_std,
                                         dtype=dt, rngs=rngs, bias=cfg.input_bias)
        self.w_out = RowParallelLinear((n, d + units), h, ("heads", "head_dim", "embed"),
                                       std=scaled_init_std(cfg.init_std, cfg.num_layers), dtype=dt, rngs=rngs)

    def __call__(self, x, mask, key, cache=None, index=0):
        cfg, d = self.cfg, self.cfg.head_dim
        k_attn, k_out = jax.random.split(key) if key is not None else (None, None)
        y = self.w_in(self.ln(x))  # (B, S, N, 3D + F/N)
        q, k, v = (constrain(y[..., i * d:(i + 1) * d], HEAD) for i in range(3))
        if cache is not None:
            k, v = (constrain(jax.lax.dynamic_update_slice_in_dim(c, new.astype(c.dtype), index, axis=1), HEAD)
                    for c, new in zip(cache, (k, v)))
            cache = (k, v)
        context = selective(attention_core, cfg.remat)(q, k, v, mask, k_attn, cfg.dropout)
        z = jnp.concatenate([context, self.act(y[..., 3 * d:])], axis=-1)
        return constrain(x + dropout(self.w_out(z), cfg.dropout, k_out), RESIDUAL), cache


class ParallelGPT(GPT):
    """GPT-2's embeddings, final LayerNorm and tied output around the parallel blocks."""

    block_class = ParallelBlock


def layer_residual_bytes(cfg: ParallelGPTConfig, rows: int, tp: int, split: int, remat: str, cd: int,
                         attention: str = "xla") -> int:
    """Bytes one ParallelBlock keeps for its backward pass on one device, counted as ``block_memory`` counts GPT's
    block: its LayerNorm's input, centred and normalised values in fp32 and output in the compute dtype, with its
    two statistics and broadcast scale; the residual branch's dropout mask; q, k, v; the out GEMM's input (the
    context beside the activated MLP units, s b (h + f)); the activation's other intermediates (GeLU-tanh 5 of
    (b, s, f), erf 3); the attention core's; in 16-bit the compute-dtype copies of the two fused kernels."""
    s, b, h, f = cfg.max_seq_len, rows, cfg.hidden_size, cfg.ffn_size
    sbh = s * b * h
    if remat == "full":
        return sbh * cd // split
    if remat == "save_dots":  # the layer's input and the fused input GEMM's output
        return sbh * cd + (3 * sbh + s * b * f) * cd // tp
    kept = sbh * cd + (sbh * (3 * 4 + (1 if cfg.dropout > 0 else 0)) + 2 * s * b * 4) // split + h * 4
    units = 5 if cfg.activation == "gelu_tanh" else 3
    kept += (3 * sbh + s * b * (h + f) + units * s * b * f) * cd // tp
    if remat != "selective":
        kept += attention_core_residual_bytes(cfg, b, tp, attention)
    if cd < 4:
        kept += (4 * h * h + 2 * h * f) * cd // tp
    return kept


# one all-reduce each way (the fused out GEMM's), none redone under remat=full (nothing after it in the layer)
PARALLEL_BLOCK = LayerKind("parallel block", residuals=layer_residual_bytes, tensor_all_reduces=1,
                           recomputed_all_reduces=0)
SPEC = decoder_spec(NAME, ParallelGPTConfig, ParallelGPT, lambda cfg, rows, seq: transformer_flops(
    rows, seq, cfg.num_layers, cfg.hidden_size, cfg.padded_vocab_size), sequence_rows=("wpe",), eval_tasks=(),
    pretrained_trunk=None, stacks=lambda cfg: trunk_stack(cfg, PARALLEL_BLOCK))


@pytest.fixture(scope="module", autouse=True)
def registered():
    """The family in the registry while this module's tests run (other modules list the registry)."""
    register(SPEC)
    yield
    del MODELS[NAME]


def small(data: int = 1, model: int = 1, **fields):
    """2 layers, hidden 64, 8 heads, MLP 256, vocab 1000 (padded to 1024), 32 tokens, on random data, fp32."""
    config = base_config(NAME)
    config.model.update({**dict(vocab_size=1000, make_vocab_size_divisible_by=128, num_layers=2, hidden_size=64,
                                num_heads=8, max_seq_len=32, dropout=0.0, remat="none"), **fields})
    config.mesh.data, config.mesh.model = data, model
    config.data.source = "random"
    config.train.update(global_batch_size=8, precision="fp32", steps=4, log_every=1, eval_batches=0)
    config.optimizer.update(lr=1e-3, warmup_steps=0, decay_steps=10)
    config.checkpoint.enabled = False
    return config


def test_its_config_is_its_own():
    """Its field is there for it and unknown to GPT; another family's field is unknown to it."""
    assert model_config(small(input_bias=False)) == ParallelGPTConfig(
        vocab_size=1000, make_vocab_size_divisible_by=128, num_layers=2, hidden_size=64, num_heads=8, max_seq_len=32,
        dropout=0.0, remat="none", input_bias=False)
    gpt = base_config()
    gpt.model.input_bias = False
    with pytest.raises(ConfigError, match="model.name=gpt has no field model.input_bias"):
        model_config(gpt)
    with pytest.raises(ConfigError, match=f"model.name={NAME} has no field model.num_kv_heads"):
        model_config(small(num_kv_heads=2))


def test_trains_the_same_on_every_mesh(tmp_path):
    """Four AdamW steps on 1x1, 2x4 (two heads and their MLP units per shard) and 4x2: the same losses (fp32, the
    sharded sums reorder additions)."""
    curves = {mesh: [r["loss"] for r in train(small(*mesh), tmp_path / f"{mesh}") if "loss" in r]
              for mesh in [(1, 1), (2, 4), (4, 2)]}
    np.testing.assert_allclose(curves[(2, 4)], curves[(1, 1)], rtol=1e-5)
    np.testing.assert_allclose(curves[(4, 2)], curves[(1, 1)], rtol=1e-5)
    assert len(curves[(1, 1)]) == 4 and np.isfinite(curves[(1, 1)]).all()


@pytest.mark.parametrize("remat", ["none", "selective", "full", "save_dots"])
@pytest.mark.parametrize("precision,dropout,activation", [("fp32", 0.0, "gelu_tanh"), ("bf16", 0.1, "gelu")])
def test_layer_residuals_are_what_autodiff_keeps(remat, precision, dropout, activation):
    config = small(remat=remat, dropout=dropout, activation=activation)
    config.train.precision = precision
    assert layer_residual_bytes(model_config(config), 2, 1, 1, remat, 4 if precision == "fp32" else 2) == \
        traced_layer_residual_bytes(resolve(config, 1, training=False), 2)


@pytest.mark.memory_plan
@pytest.mark.parametrize("mesh,remat", [((4, 2), "none"), ((2, 4), "selective")])
def test_memory_planner_within_10_percent_of_the_compiled_step(mesh, remat):
    assert_planned_within_10_percent(resolve(small(*mesh, remat=remat), math.prod(mesh), training=False), 4)


@pytest.mark.parametrize("mesh,remat", [((1, 4), "none"), ((2, 4), "full"), ((4, 2), "selective")])
def test_communicates_the_minimum_its_spec_states(mesh, remat):
    """The compiled step's collectives by category equal the minimum the budget derives from the spec's terms
    (ratio 1.0000), and, counted here without the budget: over `model`, one all-reduce of b x s x h per layer each
    way plus the embedding's (none redone under remat=full: nothing after the block's one all-reduce needs it)."""
    run = setup(small(*mesh, remat=remat))
    budget = step_budget(run)
    assert budget.compiled == budget.minimum and budget.ratio == 1.0, budget.table()
    b, s, h, layers = 8 // mesh[0], 32, 64, 2
    counts = summary(collectives(run.step_fn.as_text(), run.mesh))
    for phase in ("forward", "backward"):
        assert counts[("all-reduce", ("model",), phase, b * s * h)] == layers + 1


@pytest.mark.memory_plan
@pytest.mark.parametrize("remat", ["none", "selective"])
def test_scaling_model_within_10_percent_of_the_compiled_step(remat):
    """The scaling model's GEMMs (read from the abstract model) add up to the spec's FLOPs, and its memory per GPU
    (bf16, as it plans GPUs) is the compiled step's peak within 10%, on 4x2."""
    config = small(4, 2, remat=remat)
    config.train.precision = "bf16"
    cfg = model_config(config)
    run = resolve(config, 8, training=False)
    dense, attention, logits = scaling.gemms(run, 2, 8)  # one GPU's forward GEMMs, (batch, m, k, n) each
    gemm_flops = 3 * (sum(2 * math.prod(g) for g in dense + attention) * cfg.num_layers + 2 * math.prod(logits))
    assert gemm_flops * 2 == pytest.approx(SPEC.flops(cfg, 8, cfg.max_seq_len), rel=1e-12)
    compiled = compiled_memory(run, micro_batch=4)
    assert scaling.memory_bytes(run, MeshShape(4, 2), 4) == pytest.approx(compiled.peak, rel=0.10)
