"""Activation recomputation: every remat policy megajax applies, and the one helper per place that applies it.

Models and the pipeline call these helpers and build no ``jax.checkpoint`` themselves. The values a policy singles
out are named where they are made (``jax.ad_checkpoint.checkpoint_name``): ``layers.SEQUENCE_GATHERED``, a
column-parallel GEMM's all-gathered input under sequence parallelism, and ``sharding.FSDP_GATHERED``, a parameter
gathered over ``data`` at use.

What a name alone cannot say, and why:

* "Keep everything but the FSDP-gathered parameters" (``_keep_all_but_gathered``). jax asks a policy about every
  equation, and a named value it does not keep is recomputed in the backward pass from the name equation's input,
  which is the same whole parameter and is kept unless the policy also refuses the equation that made it. That
  equation is the gather's ``custom_vjp_call`` (a custom_vjp, so its gradient goes straight onto the shards), and
  jax shows the policy the call, not the name inside it: the policy looks for the name in the call's body (its
  ``call_jaxpr``). jax's ``save_anything_except_these_names`` cannot stand in either: in jax 0.10 it keeps
  everything, names included (``lambda *_, **__: True``). Measured (gpt_tiny, 4x2, ``parallel.fsdp``,
  ``remat=none``): a policy on the name equation alone compiles the temp bytes of keeping everything (30.5 MB:
  every layer's gathered parameters), this one 29.7 MB.
* Policies do not nest: jax partially evaluates a ``jax.checkpoint`` inside another with the outer one's policy,
  so a layer step's policy (``layer_step``: FSDP's) or a circular pipeline's chunk (``pipeline_chunk``) overrides
  an inner checkpoint's. ``selective`` is therefore no checkpoint but a ``custom_vjp`` call that keeps only its
  inputs and reruns the core in the backward pass (``_recomputed``): what a call keeps is its own ``fwd``'s choice,
  which no policy around it changes. (With a ``jax.checkpoint`` there, ``remat=selective`` under ``parallel.fsdp``
  kept the attention core's intermediates: tests/test_training_step.py.) ``assembled_at_use`` is still a
  checkpoint, so under FSDP the layer policy decides inside it too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import jax
from flax import nnx

from megajax.parallel.layers import SEQUENCE_GATHERED
from megajax.parallel.sharding import FSDP_GATHERED, params_split

F = TypeVar("F", bound=Callable[..., Any])

REMAT_POLICIES = ("none", "full", "save_dots", "selective")  # model.remat


def _makes(name: str, prim: jax.extend.core.Primitive, params: dict[str, Any]) -> bool:
    """Whether an equation makes the value named ``name``: the name's own equation, or a call (a ``custom_vjp``)
    that names it inside."""
    if prim.name == "name":
        return params["name"] == name
    body = params.get("call_jaxpr")
    return body is not None and any(e.primitive.name == "name" and e.params["name"] == name for e in body.jaxpr.eqns)


def _keep_all_but_gathered(prim: jax.extend.core.Primitive, *_, **params) -> bool:
    """Keep every value for the backward pass except the parameters ``sharding.param_at_use`` gathered."""
    return not _makes(FSDP_GATHERED, prim, params)


_LAYER_POLICIES = {"full": None, "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


def layer_step(step: F, remat: str, recompute_layers: bool = True) -> F:
    """A scanned layer's step under ``model.remat`` (``nnx.remat``): ``full`` keeps only its input, ``save_dots`` the
    dense GEMMs' outputs too. Otherwise (``none``; ``selective``, which recomputes only the attention core:
    ``selective``) or with ``recompute_layers`` False (a circular pipeline's chunk, recomputed whole:
    ``pipeline_chunk``) the step keeps everything, except that under ``parallel.fsdp`` it re-gathers its parameters
    in the backward pass rather than keep every layer's."""
    if remat in _LAYER_POLICIES and recompute_layers:
        return nnx.remat(step, policy=_LAYER_POLICIES[remat])
    if params_split():
        return nnx.remat(step, policy=_keep_all_but_gathered)
    return step


def selective(core: F, remat: str) -> F:
    """The attention core ``core(q, k, v, mask, key, rate)`` as a block runs it: under ``remat=selective`` recomputed
    in the backward pass, its (B, N, S, S_kv) intermediates not kept (Korthikanti et al. 2022); else ``core``."""
    if remat != "selective":
        return core

    def recomputed_core(q, k, v, mask, key, rate):  # rate: a Python float, not an input
        return _recomputed(lambda *a: core(*a, rate), q, k, v, mask, key)

    return recomputed_core


def _recomputed(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, keeping for the backward pass only ``args`` and the traced values ``fn`` reads from outside
    them (a pipeline stage's microbatch index, from its ``ParallelContext``): the backward pass runs the forward
    again. One ``custom_vjp`` call, so a policy around it (a layer step's, a pipeline chunk's) cannot keep more.
    ``fn`` is traced once, here, under the active context, with a fresh closure (jax caches traces by function, and
    the context is not in the key); the backward pass reruns that trace, never ``fn``, so it reads no context."""
    flat, tree = jax.tree.flatten(args)
    traced, out = jax.make_jaxpr(lambda *a: fn(*tree.unflatten(a)), return_shape=True)(*flat)

    def run(consts: list[Any], flat: list[Any]) -> list[jax.Array]:
        return jax.extend.core.jaxpr_as_fun(jax.extend.core.ClosedJaxpr(traced.jaxpr, consts))(*flat)

    @jax.custom_vjp
    def call(consts: list[Any], flat: list[Any]) -> list[jax.Array]:
        return run(consts, flat)

    def forward(consts: list[Any], flat: list[Any]) -> tuple[list[jax.Array], tuple[list[Any], list[Any]]]:
        return run(consts, flat), (consts, flat)

    def backward(inputs: tuple[list[Any], list[Any]], cotangent: list[jax.Array]) -> tuple[list[Any], list[Any]]:
        # the barrier keeps XLA from merging the rerun with the forward pass's (whose values would then be kept),
        # as jax.checkpoint's recomputation does
        return jax.vjp(run, *jax.lax.optimization_barrier(inputs))[1](cotangent)

    call.defvjp(forward, backward)
    return jax.tree.unflatten(jax.tree.structure(out), call(list(traced.consts), flat))


def pipeline_chunk(chunk: F) -> F:
    """A circular pipeline's chunk, recomputed from its input in the backward pass: each tick's chunk is a slice of
    the stage's parameters that depends on the tick, and without recomputation every tick would keep its slice (T
    copies of a chunk)."""
    return jax.checkpoint(chunk)


def assembled_at_use(product: F) -> F:
    """``product(x, *weights)``, a GEMM whose kernel is assembled from the stored ``weights`` at use, with its
    backward pass recomputing the kernel from them rather than keeping it per layer; it keeps only ``x``'s
    all-gathered sequence under sequence parallelism (``SEQUENCE_GATHERED``, as a plain column-parallel GEMM does),
    and under FSDP gathers the weights again."""
    return jax.checkpoint(product, policy=jax.checkpoint_policies.save_only_these_names(SEQUENCE_GATHERED))
