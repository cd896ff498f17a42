"""A compiled training step's communication beside Megatron's analytic minimum, by category, in bytes.

Megatron's minimum for one step, per device, with b sequences per data shard (all micro-batches), s tokens, h
hidden, L layers, tensor-parallel degree > 1 and data-parallel degree > 1 where they apply:

| category | minimum |
| --- | --- |
| tensor-parallel forward | 2L + 1 all-reduces of b x s x h (f and g of every block, + the vocab-parallel lookup) |
| tensor-parallel backward | 2L + 1 all-reduces of b x s x h (+ L with ``remat=full``: see below) |
| loss | 3 all-reduces of b x s (the vocab-parallel cross-entropy: max, sum of exponentials, target logit) |
| data-parallel gradients | one all-reduce of every local gradient element |

With ``remat=full`` each block's forward runs again in the backward pass, but only its attention output needs
the all-reduce again (the block's output is the saved scan carry): L more, where Megatron's checkpointing redoes
both (2L). ``save_dots`` keeps the all-reduced outputs and redoes none.

Sizes are the collective's message (elements x dtype bytes, per execution), not the wire traffic of an
algorithm (a ring all-reduce moves 2 (n-1)/n of it). Scalar collectives (the gradient norm's sums of squares,
logged metrics) are listed with their count: they cost latency, not bandwidth, and are outside the ratio.
Anything else the compiled step does is ``other`` and counts against it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from megajax.hlo_audit import Collective

DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "f64": 8, "s32": 4, "u32": 4, "pred": 1}
CATEGORIES = ("tensor-parallel forward", "tensor-parallel backward", "loss", "data-parallel gradients", "other")


@dataclasses.dataclass(frozen=True)
class Shape:
    """What the minimum depends on: per-data-shard sequences per micro-batch, micro-batches, sequence length,
    hidden size, layers, mesh degrees, the activations' dtype bytes, local gradient elements and remat."""

    micro_batch: int
    num_micro: int
    seq: int
    hidden: int
    layers: int
    tensor: int
    data: int
    activation_bytes: int
    local_grad_elements: int
    remat: str = "none"


def minimum(shape: Shape) -> dict[str, int]:
    """Megatron's analytic bytes per category (module docstring)."""
    b, s, h, n = shape.micro_batch, shape.seq, shape.hidden, shape.num_micro
    out = dict.fromkeys(CATEGORIES, 0)
    if shape.tensor > 1:
        act = b * s * h * shape.activation_bytes * n
        out["tensor-parallel forward"] = (2 * shape.layers + 1) * act
        recompute = shape.layers if shape.remat == "full" else 0
        out["tensor-parallel backward"] = (2 * shape.layers + 1 + recompute) * act
        out["loss"] = 3 * b * s * 4 * n  # the cross-entropy runs in fp32
    if shape.data > 1:
        out["data-parallel gradients"] = shape.local_grad_elements * 4
    return out


def categorize(colls: list[Collective], shape: Shape) -> tuple[dict[str, int], int]:
    """(compiled bytes per category, number of scalar collective executions)."""
    tokens = shape.micro_batch * shape.seq
    out, scalars = dict.fromkeys(CATEGORIES, 0), 0
    for c in colls:
        if c.elements == 1:
            scalars += c.executions
            continue
        size = c.elements * DTYPE_BYTES.get(c.dtype, 4) * c.executions
        if c.op == "all-reduce" and c.axes == {"model"} and c.elements == tokens * shape.hidden:
            out[f"tensor-parallel {c.phase}"] += size
        elif c.op == "all-reduce" and c.axes == {"model"} and c.elements == tokens:
            out["loss"] += size
        elif c.op == "all-reduce" and c.axes == {"data"}:
            out["data-parallel gradients"] += size
        else:
            out["other"] += size
    return out, scalars


@dataclasses.dataclass(frozen=True)
class Budget:
    """Compiled and minimum bytes per category, and the scalar collectives."""

    compiled: dict[str, int]
    minimum: dict[str, int]
    scalars: int

    @property
    def ratio(self) -> float:
        """Compiled / minimum over all categories (1.0 when both are zero, e.g. a 1x1 mesh)."""
        want = sum(self.minimum.values())
        got = sum(self.compiled.values())
        return got / want if want else (1.0 if not got else float("inf"))

    def table(self) -> str:
        lines = [f"{'category':<26}{'compiled bytes':>16}{'Megatron minimum':>18}{'ratio':>9}"]
        for k in CATEGORIES:
            got, want = self.compiled[k], self.minimum[k]
            if got or want:
                ratio = f"{got / want:.4f}" if want else "extra"
                lines.append(f"{k:<26}{got:>16,}{want:>18,}{ratio:>9}")
        lines.append(f"{'total':<26}{sum(self.compiled.values()):>16,}{sum(self.minimum.values()):>18,}"
                     f"{self.ratio:>9.4f}")
        lines.append(f"scalar collectives per step (gradient norm, metrics; not in the ratio): {self.scalars}")
        return "\n".join(lines)


def step_budget(run) -> Budget:
    """The budget of a compiled training run (``megajax.training.loop.setup``): its step's collectives read from
    the optimized HLO beside the minimum for its model, mesh and batch."""
    import jax

    from megajax.hlo_audit import collectives

    spec = run.spec
    local = sum(int(np.prod(s.shard_shape(a.shape))) for a, s in zip(
        jax.tree.leaves(run.abstract_state.params), jax.tree.leaves(
            jax.tree.map(lambda a: a.sharding, run.abstract_state.params))))
    shape = Shape(micro_batch=spec.micro_batch, num_micro=spec.num_micro, seq=spec.model.max_seq_len,
                  hidden=spec.model.hidden_size, layers=spec.model.num_layers, tensor=spec.tensor, data=spec.data,
                  activation_bytes=np.dtype(spec.model.compute_dtype).itemsize, local_grad_elements=local,
                  remat=spec.model.remat)
    compiled, scalars = categorize(collectives(run.step_fn.as_text(), run.mesh), shape)
    return Budget(compiled, minimum(shape), scalars)
