"""The Llama family: rotary positions, RMSNorm, SwiGLU and grouped-query attention, sharded like Megatron's GPT.

Tensor-parallel equivalence (loss, logits and every gradient on each mesh against the 1x1 step) for a multi-head
config and a grouped-query one whose 2 key/value heads are split on 1x2 and replicated on 1x4 / 1x8 / 2x4, the
golden partition specs, the published parameter counts and the refusals. Parity with Hugging Face's model is in
``test_convert_llama.py``; the compiled collectives in ``test_communication_audit.py``.
"""

import json
import os
import pathlib

import jax
import numpy as np
import pytest
from conftest import choice_config, place
from flax import nnx

import megajax
from megajax.cli import load_config
from megajax.config import abstract_model, base_config, build_mesh, create_model, model_config, rules_of, validate
from megajax.errors import ConfigError
from megajax.models import llama, model_spec
from megajax.parallel.losses import lm_loss
from megajax.parallel.partition import spec_table
from megajax.parallel.sharding import ParallelContext, activate
from megajax.training.loop import train

RTOL = 1e-5  # fp32; the sharded sums reorder additions


def llama_config(data: int = 1, model: int = 1, **fields):
    """2 layers, hidden 64, 8 query heads, ffn 96, vocab 1000 (padded to 1024), untied; ``fields`` override."""
    c = base_config(llama.NAME)
    c.model.update(**{**dict(
        vocab_size=1000, num_layers=2, hidden_size=64, num_heads=8, ffn_hidden_size=96, max_seq_len=32,
        remat="none", make_vocab_size_divisible_by=128), **fields})
    c.mesh.data, c.mesh.model = data, model
    return c


CONFIGS = {"mha": {}, "gqa": dict(num_kv_heads=2, rope_scaling="llama3", rope_original_max_len=8, rope_theta=500.0)}


def _run(model, config, batch, data, model_axis):
    mesh, graphdef, state = place(model, config, data, model_axis)
    tokens, labels = batch

    def loss_and_logits(state):
        m = nnx.merge(graphdef, state)
        return lm_loss(m, tokens, labels), m(tokens)

    config = config.copy_and_resolve_references()
    config.mesh.update(data=data, model=model_axis)
    rules = rules_of(config)
    with activate(mesh, ParallelContext(rules)):
        (loss, logits), grads = jax.jit(jax.value_and_grad(loss_and_logits, has_aux=True))(state)
    return float(loss), np.asarray(logits), jax.tree.map(np.asarray, nnx.to_pure_dict(grads))


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def reference(request, batch):
    config = llama_config(**CONFIGS[request.param])
    model = create_model(config, build_mesh(config), seed=0)
    return config, model, _run(model, config, batch, 1, 1)


@pytest.mark.parametrize("data,model_axis", [(2, 4), (4, 2)])
def test_mesh_matches_single_device(reference, batch, data, model_axis):
    """Loss, logits and all 11 gradients on 2x4 and 4x2 (data and model shards); the GQA config's key/value heads
    are split on 4x2 and replicated (each shard slicing its copy) on 2x4."""
    config, model, (ref_loss, ref_logits, ref_grads) = reference
    loss, logits, grads = _run(model, config, batch, data, model_axis)
    np.testing.assert_allclose(loss, ref_loss, rtol=RTOL)
    v = config.model.vocab_size
    np.testing.assert_allclose(logits[..., :v], ref_logits[..., :v], rtol=RTOL,
                               atol=RTOL * np.abs(ref_logits[..., :v]).max())
    flat, ref_flat = jax.tree_util.tree_leaves_with_path(grads), jax.tree_util.tree_leaves(ref_grads)
    assert len(flat) == len(ref_flat) == 11  # wte, 8 per block, ln_f, lm_head
    for (path, g), r in zip(flat, ref_flat):
        scale = np.abs(r).max()
        assert scale > 0, jax.tree_util.keystr(path)
        np.testing.assert_allclose(g, r, rtol=RTOL, atol=RTOL * scale, err_msg=jax.tree_util.keystr(path))


GOLDEN = pathlib.Path(__file__).parent / "golden" / "llama_partition_specs.json"


def test_golden_partition_specs():
    """The GQA config's layout with its key/value heads split (mesh.model=2) and replicated (4), and what each device
    really holds on 1x4. Set UPDATE_GOLDEN=1 to rewrite after a deliberate layout change (and review the diff)."""
    tables = {}
    for tp in (2, 4):
        config = llama_config(model=tp, **CONFIGS["gqa"])
        tables[f"mesh.model={tp}"] = spec_table(nnx.state(abstract_model(config)), rules_of(config))
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.write_text("{\n" + ",\n".join(f" {json.dumps(mesh)}: {{\n" + ",\n".join(
            f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(table.items())) + "\n }"
            for mesh, table in tables.items()) + "\n}\n")
    assert tables == json.loads(GOLDEN.read_text())
    config = llama_config(model=4, **CONFIGS["gqa"])
    state = nnx.state(create_model(config, build_mesh(config)))
    shards = {jax.tree_util.keystr(p, simple=True, separator="/"): a.addressable_shards[0].data.shape
              for p, a in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(state))}
    assert shards["blocks/attn/q/kernel"] == (2, 64, 2, 8)  # 8 query heads / 4 shards
    assert shards["blocks/attn/kv/kernel"] == (2, 64, 2, 2, 8)  # both key/value heads, whole on every shard
    assert shards["blocks/mlp/gate/kernel"] == shards["blocks/mlp/up/kernel"] == (2, 64, 24)
    assert shards["blocks/mlp/down/kernel"] == (2, 24, 64)
    assert shards["wte/embedding"] == shards["lm_head/embedding"] == (256, 64)


PUBLISHED = {  # config file -> parameters in the model card / paper
    "llama2_7b": 6_738_415_616, "llama3_8b": 8_030_261_248, "llama3p2_1b": 1_235_814_400}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_equal_the_published_ones(name):
    config = load_config(name)
    state = nnx.state(abstract_model(config), nnx.Param)
    assert sum(a.size for a in jax.tree.leaves(state)) == PUBLISHED[name]


def test_flops_count_swiglu_and_grouped_heads():
    """The spec's model FLOPs against a hand count of every GEMM of one forward pass, times 3."""
    cfg = model_config(llama_config(**CONFIGS["gqa"]))
    b, s, h, f, L, v, kv = 3, 16, 64, 96, 2, 1024, 2 * 2 * 8
    gemms = h * h + h * kv + h * h + 3 * h * f  # q, k and v, out, gate / up / down
    forward = 2 * b * s * (L * (gemms + 2 * s * h) + h * v)
    assert model_spec("llama").flops(cfg, b, s) == 3 * forward


def test_rope_scaling_matches_the_llama3_rule():
    """Llama 3's frequency bands, from its definition, in float64: kept above the high-frequency edge, divided by
    the factor below the low one, interpolated in wavelength between."""
    cfg = model_config(llama_config(hidden_size=512, num_heads=4, rope_theta=500000.0, rope_scaling="llama3",
                                    rope_original_max_len=8192, rope_factor=8.0))
    inv = 1.0 / 500000.0 ** (np.arange(0, 128, 2) / 128)
    wavelength = 2 * np.pi / inv
    low, high = 8192 / 1.0, 8192 / 4.0
    want = []
    for f, w in zip(inv, wavelength):
        if w < high:
            want.append(f)
        elif w > low:
            want.append(f / 8.0)
        else:
            t = (8192 / w - 1.0) / (4.0 - 1.0)
            want.append((1 - t) * f / 8.0 + t * f)
    got = np.asarray(llama.rope_frequencies(cfg))
    assert (got < inv * 0.99).any() and (got == np.float32(inv)).any()  # both bands present
    np.testing.assert_allclose(got, want, rtol=1e-6)


@pytest.mark.parametrize("fields,mesh_model,message", [
    (dict(num_kv_heads=3, num_heads=6, hidden_size=48), 2,
     "mesh.model=2 neither divides model.num_kv_heads=3 .* multiples of 3"),
    (dict(num_kv_heads=3), 1, "model.num_kv_heads=3 does not divide model.num_heads=8"),
    (dict(rope_scaling="yarn"), 1, r"model.rope_scaling='yarn'; choose one of \('none', 'llama3'\)"),
    (dict(ffn_hidden_size=90), 4, "the MLP width 90 is not divisible by mesh.model=4"),
])
def test_bad_shapes_are_refused_before_building(fields, mesh_model, message):
    with pytest.raises(ConfigError, match=message):
        validate(llama_config(model=mesh_model, **fields), 8)


@pytest.mark.parametrize("fields,message", [
    (dict(activation="gelu"), r"model.name=llama has no field model.activation; its fields \(LlamaConfig\) are "),
    (dict(num_token_types=2), "model.name=llama has no field model.num_token_types"),
    (dict(hidden_size=120, num_kv_heads=2), "model.hidden_size / model.num_heads = 15: rotary embeddings .* even"),
    (dict(post_layernorm=True), "model.name=llama has no field model.post_layernorm"),
])
def test_what_llama_does_not_compute_is_a_config_error(fields, message):
    """Checked on the abstract model (``abstract_model``: before anything is allocated or compiled), so train.py
    prints it as one ``error:`` line."""
    config = llama_config()
    config.model.update(fields)  # fields of GPT's and BERT's configs too, which Llama's does not have
    with pytest.raises(ConfigError, match=message):
        abstract_model(config)


def test_gpt_refuses_llama_options():
    c = base_config()
    c.model.num_kv_heads = 4
    with pytest.raises(ConfigError, match="model.name=gpt has no field model.num_kv_heads"):
        abstract_model(c)


def test_resume_is_exact_and_restores_on_other_meshes(tmp_path):
    """With dropout, 2 steps then a resume to 4 on 2x4 (key/value heads replicated) give the parameters of 4 straight
    steps bit for bit; the checkpoint restores on 4x2 (heads split) and 1x1 unchanged."""
    config = choice_config(None, 2, 4, steps=4, name="llama")
    config.model.dropout = 0.1
    config.checkpoint.update(enabled=True, every_steps=2, async_save=False)
    train(config, tmp_path / "straight")
    config.train.steps = 2
    train(config, tmp_path / "resumed")
    config.train.steps = 4
    train(config, tmp_path / "resumed")
    want = nnx.to_pure_dict(nnx.state(megajax.load_model(tmp_path / "straight", data=2, model=4).model))
    for workdir, mesh in (("resumed", (2, 4)), ("resumed", (4, 2)), ("straight", (1, 1))):
        got = nnx.to_pure_dict(nnx.state(megajax.load_model(tmp_path / workdir, data=mesh[0], model=mesh[1]).model))
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"{workdir} {mesh} {path}")


def test_half_precision_trains_as_fp32(tmp_path):
    """bf16 and fp16 (loss scaling: no step skipped) on 1x4: three steps' losses within 1% of fp32's (RMSNorm, the
    rotary angles, the softmax and the cross-entropy run in fp32)."""
    losses = {}
    for p in ("fp32", "bf16", "fp16"):
        config = choice_config(None, 1, 4, steps=3, name="llama")
        config.train.precision = p
        losses[p] = [r["loss"] for r in train(config, tmp_path / p) if "loss" in r]
    for p in ("bf16", "fp16"):
        assert len(losses[p]) == 3 and np.isfinite(losses[p]).all(), p
        np.testing.assert_allclose(losses[p], losses["fp32"], rtol=0.01, err_msg=p)
