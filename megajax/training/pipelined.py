"""A training micro-batch's gradients under the 1F1B pipeline schedule (``parallel.pipeline_schedule='1f1b'``).

Under ``jax.grad`` a pipelined model's loss is computed after its whole stack (GPipe, circular: the backward
pipeline starts once every microbatch's forward has ended). 1F1B starts each microbatch's backward as soon as its
forward leaves the last stage, so the loss of each microbatch is computed there, inside the tick loop, and the step
takes its gradients from the schedule instead of from ``jax.grad``. The model is cut where it runs its pipelined
layer stack: the objective is given the ``pipeline.StackRunner`` the model runs its stack with (``stack=``), so
no family says where its layers start or end:

* the ends before the stack (the embeddings) are traced with a runner that records the stack's call and returns
  zeros (``_Recorder``): ``jax.vjp`` of that gives the stack's input and state and, after the loop, their
  gradients' path back to the parameters;
* the tail after it (final norm, head, loss) is the objective traced with a runner that returns the stack's output
  given, and what its layers return beside it (a mixture's routing statistics, which travel with the microbatch
  through the stages: ``pipeline.run_stack_1f1b``) (``_given``): on the last
  stage, on one microbatch's rows, each mean divided by the whole batch's count (the objective given
  ``losses.Given`` those the first trace ``Counted``), so the microbatches' losses sum to the plain step's loss
  (a term that is not a mean over tokens, a mixture's balancing loss, is the microbatch's own, weighted by its
  share of the batch: ``Means.share``);
* the stack's and the tail's gradients, and the stack input's through the first trace, are summed per parameter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax._src.interpreters import partial_eval as pe  # dce_jaxpr: no public equivalent (jax 0.10)

from megajax.models.objectives import Batch, Metrics, Objective
from megajax.parallel import pipeline
from megajax.parallel.losses import Counted, Given

Params = Any


class _Recorder:
    """A ``pipeline.StackRunner`` that records the model's stack call (``call``) and returns zeros in place of the
    stack's output: what the 1F1B step reads of the model before its layers."""

    def __init__(self) -> None:
        self.call: pipeline.StackCall | None = None

    def __call__(self, blocks: nnx.Module, scan_layers: pipeline.ScanLayers, x: jax.Array, mask: Any,
                 layer_keys: jax.Array | None) -> tuple[jax.Array, Any]:
        if self.call is not None:
            raise ValueError("the 1F1B pipeline schedule runs one layer stack per model; this model ran two")
        graphdef, state = nnx.split(blocks)
        # what the layers return beside their output (a mixture's statistics), as shapes: zeros stand for it
        beside = jax.eval_shape(lambda state, x, mask, keys: scan_layers(nnx.merge(graphdef, state), x, mask, keys,
                                                                         True)[1], state, x, mask, layer_keys)
        self.call = pipeline.StackCall(graphdef, state, scan_layers, x, mask, layer_keys, beside)
        return jnp.zeros_like(x), _zeros(beside)

    def recorded(self) -> pipeline.StackCall:
        """The call, or ValueError where the model ran no pipelined stack."""
        if self.call is None:
            raise ValueError("the 1F1B pipeline schedule needs a model whose layers run as a pipelined stack")
        return self.call


def _given(output: jax.Array, beside: Any) -> pipeline.StackRunner:
    """A ``pipeline.StackRunner`` that returns ``output`` and ``beside`` as the stack's: the model after its layers
    (the loss's tail) as a function of the stack's output and what its layers return beside it."""
    return lambda blocks, scan_layers, x, mask, layer_keys: (output, beside)


def _zeros(shapes: Any) -> Any:
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)


# (loss, metrics) -> (the value differentiated, (loss, metrics) as the step sums them): the step's weighting
Weigh = Callable[[jax.Array, Metrics], tuple[jax.Array, tuple[jax.Array, Metrics]]]


def grads(objective: Objective, graphdef: nnx.GraphDef, params: Params, batch: Batch, key: jax.Array | None,
          weigh: Weigh) -> tuple[Params, tuple[jax.Array, Metrics]]:
    """``jax.grad(lambda p: weigh(*objective.loss(model(p), batch, key)), has_aux=True)(params)``, computed by the
    1F1B schedule (the model traced on the active mesh, whose ``pipe`` axis holds its stages)."""
    leaves, treedef = jax.tree.flatten(params)
    is_stack: list[bool] = []
    static: dict[str, pipeline.StackCall] = {}

    def ends(leaves: list[jax.Array]):
        counts, recorder = Counted(), _Recorder()
        objective.loss(nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves)), batch, key, counts, recorder)
        call = recorder.recorded()
        stack = {id(a) for a in jax.tree.leaves(call.state)}
        is_stack.extend(id(a) in stack for a in leaves)
        if sum(is_stack) != len(jax.tree.leaves(call.state)):
            raise ValueError("the 1F1B pipeline schedule needs the stacked layers' parameters as the model holds them")
        static["call"] = call  # its graph and scan; the traced values leave as outputs
        return (call.x, call.state), (call.mask, call.layer_keys, counts.counts)

    (x, state), pull_ends, (mask, layer_keys, counts) = jax.vjp(ends, leaves, has_aux=True)
    call = dataclasses.replace(static["call"], x=x, state=state, mask=mask, layer_keys=layer_keys)
    in_tail = [not stacked for stacked in is_stack]

    def tail(own: list[jax.Array], counts: list[jax.Array], out: tuple[jax.Array, Any], rows: Batch):
        # the parameters the tail does not read (the stack's, whose output is given; an untied embedding's): zeros
        given = iter(own)
        full = [next(given) if read else jnp.zeros(a.shape, a.dtype) for a, read in zip(leaves, in_tail)]
        loss, metrics = objective.loss(nnx.merge(graphdef, jax.tree.unflatten(treedef, full)), rows, key,
                                       Given(counts), _given(*out))
        return weigh(loss, metrics)

    # only what the tail reads gets a gradient accumulator in the tick loop (an untied embedding's would stay zero)
    read = _read(lambda own: tail(own, counts, (x, _zeros(call.beside)), batch)[0],
                 [a for a, r in zip(leaves, in_tail) if r])
    in_tail = [r and next(read) for r in in_tail]
    own = [a for a, r in zip(leaves, in_tail, strict=True) if r]
    (loss, metrics), d_state, d_own, dx = pipeline.run_stack_1f1b(call, tail, own, counts, batch)
    (d_leaves,) = pull_ends((dx, d_state))
    d_own = iter(d_own)
    total = [g + next(d_own) if r else g for g, r in zip(d_leaves, in_tail, strict=True)]
    return jax.tree.unflatten(treedef, total), (loss, metrics)


@dataclasses.dataclass(frozen=True)
class Reads:
    """What the 1F1B schedule's two ends read, by top-level parameter name and batch field."""

    fields: tuple[str, ...]  # the batch fields the tail reads: sent with each microbatch to the last stage
    tail: frozenset[str]  # the parameters the tail reads (their gradients: the last stage's, every microbatch)
    ends: frozenset[str]  # the parameters the stack's input is computed from (the embeddings)


def reads(objective: Objective, graphdef: nnx.GraphDef, params: dict, batch: Batch) -> Reads:
    """What ``grads``' tail (the loss with the stack's output given) and its ends (the stack's input) read of
    ``params`` (a pure dict) and ``batch``; the rest of the fields, read by the ends alone, XLA drops from the tick
    loop. Traced abstractly; call it on the run's mesh (``sharding.activate``)."""
    names = sorted(batch)
    leaves, treedef = jax.tree.flatten(params)
    tops = [jax.tree_util.keystr(path[:1], simple=True) for path, _ in jax.tree_util.tree_leaves_with_path(params)]
    out = {}

    def trace(leaves: list[jax.Array], batch: Batch) -> None:
        model = lambda own: nnx.merge(graphdef, jax.tree.unflatten(treedef, own))  # noqa: E731
        counts, recorder = Counted(), _Recorder()
        objective.loss(model(leaves), batch, None, counts, recorder)
        recorded = recorder.recorded()
        x, beside = recorded.x, _zeros(recorded.beside)

        def tail(own: list[jax.Array], rows: Batch) -> jax.Array:
            return objective.loss(model(own), rows, None, Given(counts.counts), _given(x, beside))[0]

        def stack_input(own: list[jax.Array]) -> jax.Array:
            given = _Recorder()
            objective.loss(model(own), batch, None, stack=given)
            return given.recorded().x

        by_field = _read(lambda own: tail(leaves, dict(zip(names, own, strict=True))), [batch[n] for n in names])
        out["fields"] = tuple(n for n, read in zip(names, by_field, strict=True) if read)
        out["tail"] = frozenset(t for t, read in zip(tops, _read(lambda own: tail(own, batch), leaves), strict=True)
                                if read)
        out["ends"] = frozenset(t for t, read in zip(tops, _read(stack_input, leaves), strict=True) if read)

    jax.eval_shape(trace, leaves, batch)
    return Reads(**out)


def _read(fn: Callable[[list[jax.Array]], jax.Array], leaves: list[jax.Array]) -> Iterator[bool]:
    """Whether ``fn``'s output depends on each of ``leaves`` (its jaxpr with the dead code removed: the model's
    embeddings run in the tail too, on values nothing reads)."""
    closed = jax.make_jaxpr(fn)(leaves)
    return iter(pe.dce_jaxpr(closed.jaxpr, [True])[1])
