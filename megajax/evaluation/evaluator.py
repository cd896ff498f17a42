"""The one sharded batch loop of megajax: a function of the model, jitted once, run over fixed-shape batches on the
model's mesh under its sharding rules.

Training's validation, eval.py's scoring and MLM metrics, lm-eval's log-likelihoods and the fine-tuned tasks'
predictions all run through ``Evaluator``; they differ only in the function and in what they do with its outputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

from megajax.models.objectives import Batch, Metrics, Objective
from megajax.parallel.sharding import ParallelContext, Rules, activate, batch_shards
from megajax.parallel.xla_options import compiler_options


@dataclasses.dataclass
class Evaluator:
    """``fn(model, batch)`` as ``evaluator(state, batch)``: jitted on first use (with ``in_shardings`` /
    ``out_shardings`` where given) and run under ``activate(mesh, context)``. ``state`` is the model's
    ``nnx.split`` state (or training's params), so one compiled function serves every parameter update."""

    fn: Callable[[nnx.Module, Batch], Any]
    graphdef: nnx.GraphDef
    mesh: jax.sharding.Mesh
    context: ParallelContext  # training's RunSpec.parallel_context, or the rules alone (Evaluator.of)
    in_shardings: Any = None
    out_shardings: Any = None

    def __post_init__(self):
        fn, graphdef = self.fn, self.graphdef
        shardings = {k: v for k, v in (("in_shardings", self.in_shardings), ("out_shardings", self.out_shardings))
                     if v is not None}
        self._step = jax.jit(lambda state, batch: fn(nnx.merge(graphdef, state), batch), **shardings,
                             compiler_options=compiler_options(self.mesh.devices.flat))

    @classmethod
    def of(cls, model: nnx.Module, fn: Callable[[nnx.Module, Batch], Any], mesh: jax.sharding.Mesh,
           rules: Rules) -> tuple[Evaluator, nnx.State]:
        """(evaluator, state) for a fixed ``model``."""
        graphdef, state = nnx.split(model)
        return cls(fn, graphdef, mesh, ParallelContext(rules)), state

    @property
    def batch_multiple(self) -> int:
        """Batches are split over the mesh axes ``batch`` maps to (``sharding.batch_shards``), so their rows are a
        multiple of their size."""
        return batch_shards(self.mesh, self.context.rules)

    def __call__(self, state: Any, batch: Batch) -> Any:
        with activate(self.mesh, self.context):
            return self._step(state, batch)

    def map_rows(self, state: Any, rows: Mapping[str, np.ndarray], batch_size: int) -> Any:
        """``fn`` on every row of ``rows`` (arrays with a common leading dimension N), as host arrays with leading
        dimension N. ``batch_size`` is rounded up to a multiple of the data axis; the last batch is padded by
        repeating the last row, and the padding dropped."""
        n = len(next(iter(rows.values())))
        b = -(-batch_size // self.batch_multiple) * self.batch_multiple
        index = np.minimum(np.arange(-(-n // b) * b), n - 1)
        outs = [jax.device_get(self(state, {k: v[index[i:i + b]] for k, v in rows.items()}))
                for i in range(0, len(index), b)]
        return jax.tree.map(lambda *x: np.concatenate(x)[:n], *outs)


def objective_metrics(objective: Objective) -> Callable[[nnx.Module, Batch], Metrics]:
    """``(model, batch) -> {'loss', **metrics}`` of ``objective`` without dropout: what validation reports."""

    def metrics(model: nnx.Module, batch: Batch) -> Metrics:
        loss, out = objective.loss(model, batch, None)
        return {"loss": loss, **objective.logged(out)}

    return metrics
