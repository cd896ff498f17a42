"""Every parameter has one known logical name per dimension, lands where Megatron puts it, and really is split."""

import json
import os
import pathlib

import jax
import pytest
from conftest import place
from flax import nnx

from megajax.config import rules_of
from megajax.errors import ShardingConfigError
from megajax.parallel.partition import logical_names, spec_table
from megajax.parallel.sharding import MEGATRON_RULES, logical_to_spec

GOLDEN = pathlib.Path(__file__).parent / "golden" / "gpt_partition_specs.json"


def test_golden_partition_specs(reference_model):
    """Set UPDATE_GOLDEN=1 to rewrite after a deliberate layout change (and review the diff)."""
    config, model = reference_model
    table = spec_table(nnx.state(model), rules_of(config))
    if os.environ.get("UPDATE_GOLDEN"):
        rows = [f" {json.dumps(k)}: {json.dumps(v)}" for k, v in sorted(table.items())]
        GOLDEN.write_text("{\n" + ",\n".join(rows) + "\n}\n")
    assert table == json.loads(GOLDEN.read_text())


def test_every_dimension_has_one_known_name(reference_model):
    _, model = reference_model
    known = dict(MEGATRON_RULES)
    names = logical_names(nnx.state(model))
    assert len(names) == 16
    for path, axes in names.items():
        assert all(a in known for a in axes), (path, axes)


def test_missing_annotation_is_an_error():
    bare = nnx.Param(jax.numpy.zeros((3, 4)))
    with pytest.raises(ShardingConfigError, match="one logical name per dimension"):
        logical_names(nnx.State({"w": bare}))


def test_unknown_logical_name_is_an_error():
    with pytest.raises(ShardingConfigError, match="unknown logical axis name 'mlpp'"):
        logical_to_spec(("embed", "mlpp"), MEGATRON_RULES)


# Which dimension `model` must split, by parameter: the Megatron layout.
SPLIT = {
    "blocks/attn/qkv/kernel": 2, "blocks/attn/qkv/bias": 1,  # column-parallel: heads
    "blocks/attn/out/kernel": 1,  # row-parallel: heads (the input rows)
    "blocks/mlp/up/kernel": 2, "blocks/mlp/up/bias": 1,  # column-parallel: 4H
    "blocks/mlp/down/kernel": 1,  # row-parallel: 4H
    "wte/embedding": 0,  # vocab-parallel
}


@pytest.mark.parametrize("data,model_axis", [(1, 4), (2, 4), (1, 8)])
def test_each_shard_holds_its_fraction(reference_model, data, model_axis):
    config, model = reference_model
    _, _, state = place(model, config, data, model_axis)
    flat = {"/".join(str(getattr(k, "key", k)) for k in path): v
            for path, v in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(state))}
    for name, arr in flat.items():
        expected = list(arr.shape)
        if name in SPLIT:
            expected[SPLIT[name]] //= model_axis
        shard_shapes = {s.data.shape for s in arr.addressable_shards}
        assert shard_shapes == {tuple(expected)}, (name, shard_shapes, expected)
        assert len(arr.addressable_shards) == data * model_axis
