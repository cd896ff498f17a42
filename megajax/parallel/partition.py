"""Parameter partition specs from logical names, and sharded initialisation without a host copy.

The pattern: build the model abstractly (``nnx.eval_shape``, nothing allocated), read each parameter's logical
names, map them through the rules to PartitionSpecs, then run the initialiser under ``jax.jit`` with those
``out_shardings`` so every device materialises only its own shard.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from megajax.errors import ShardingConfigError
from megajax.parallel.sharding import Rules, fsdp_spec, logical_to_spec, spec_over_data

M = TypeVar("M", bound=nnx.Module)


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def logical_names(state: nnx.State) -> dict[str, tuple[str, ...]]:
    """``{'blocks/attn/qkv/kernel': ('layers', 'embed', ...)}`` for every variable; errors on a missing or
    wrong-length annotation, so no parameter silently stays replicated."""
    out = {}
    for path, var in jax.tree_util.tree_leaves_with_path(state, is_leaf=_is_var):
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        names = var.get_metadata().get("out_sharding")
        if names is None or len(names) != len(var.shape):
            raise ShardingConfigError(f"parameter {name} of shape {var.shape} has axis names {names}: "
                                      "give it exactly one logical name per dimension")
        out[name] = tuple(names)
    return out


def partition_specs(state: nnx.State, rules: Rules) -> nnx.State:
    """The state's tree with each variable's value replaced by its PartitionSpec."""
    logical_names(state)  # validates annotations
    return jax.tree.map(lambda v: v.replace(logical_to_spec(v.get_metadata()["out_sharding"], rules)), state,
                        is_leaf=_is_var)


def shardings(state: nnx.State, mesh: Mesh, rules: Rules, split_over_data: bool = False) -> nnx.State:
    """The state's tree with each variable's value replaced by its NamedSharding on ``mesh``; ``split_over_data``:
    ``parallel.fsdp``'s layout, each parameter split over ``data`` as well (``sharding.fsdp_spec``)."""
    if not split_over_data:
        return jax.tree.map(lambda v: v.replace(NamedSharding(mesh, v.get_value())), partition_specs(state, rules),
                            is_leaf=_is_var)
    logical_names(state)  # validates annotations
    return jax.tree.map(lambda v: v.replace(NamedSharding(mesh, fsdp_spec(v.get_metadata()["out_sharding"], v.shape,
                                                                          rules, dict(mesh.shape)))),
                        state, is_leaf=_is_var)


def spec_table(state: nnx.State, rules: Rules) -> dict[str, dict[str, object]]:
    """``{param path: {'names': [...], 'spec': 'P(...)'}}``: the golden-file view of a model's layout."""
    return {path: {"names": list(names), "spec": str(logical_to_spec(names, rules))}
            for path, names in logical_names(state).items()}


def over_data(sharding: NamedSharding, shape: tuple[int, ...], axis: str = "data",
              keep_whole: Sequence[int] = ()) -> NamedSharding:
    """``sharding`` additionally split over ``axis`` (ZeRO-1: AdamW's moments of a parameter held 1/data per
    device; FSDP: the parameter itself), as ``spec_over_data`` chooses the dimension."""
    spec = spec_over_data(sharding.spec, shape, dict(sharding.mesh.shape), axis, keep_whole)
    return sharding if spec == sharding.spec else NamedSharding(sharding.mesh, spec)


def init_sharded(build: Callable[[], M], mesh: Mesh, rules: Rules) -> M:
    """Runs ``build()`` under jit so each parameter is created directly in its sharded layout."""
    abstract = nnx.eval_shape(build)
    graphdef, abstract_state = nnx.split(abstract)
    out_shardings = shardings(abstract_state, mesh, rules)

    @jax.jit
    def init():
        state = nnx.state(build())
        return jax.lax.with_sharding_constraint(state, out_shardings)

    with jax.set_mesh(mesh):
        state = init()
    return nnx.merge(graphdef, state)


__all__ = ["init_sharded", "logical_names", "over_data", "partition_specs", "shardings", "spec_table"]
