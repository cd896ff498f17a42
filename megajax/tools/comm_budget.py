"""A compiled training step's communication beside Megatron's analytic minimum (``comm_minimum``), by category, in
bytes: ``step_budget`` reads the step's collectives from its optimized HLO (``hlo_audit``), puts each in a category
(``categorize``; anything else is ``other`` and counts against the ratio) and the minimum's ``Shape`` from the run
(``step_shape``). Under the 1F1B schedule it is the last stage's device's (``_executions``).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np
from flax import nnx

from megajax.config import RunSpec
from megajax.config.build import abstract_model_of
from megajax.errors import ConfigError
from megajax.models import ModelSpec
from megajax.models.spec import pipelined_stacks
from megajax.parallel import pipeline, pipeline_1f1b
from megajax.parallel.hlo_audit import Collective, collectives
from megajax.parallel.partition import over_data
from megajax.parallel.sharding import RESIDUAL, activate, logical_to_spec, spec_axes
from megajax.tools.comm_minimum import CATEGORIES, Shape, data_gradient_elements, kv_head_elements, minimum, shape_of
from megajax.tools.memory_terms import parameters
from megajax.training import pipelined

DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "f64": 8, "s32": 4, "u32": 4, "pred": 1}


def categorize(colls: list[Collective], shape: Shape) -> tuple[dict[str, int], int]:
    """(compiled bytes per category, number of scalar collective executions)."""
    tokens = shape.micro_batch * shape.seq
    out, scalars = dict.fromkeys(CATEGORIES, 0), 0
    for c in colls:
        c = dataclasses.replace(c, executions=_executions(c, shape))
        if c.elements == 1:
            scalars += c.executions
            continue
        size = c.shard_elements * DTYPE_BYTES.get(c.dtype, 4) * c.executions
        over_model = c.axes == {"model"}
        if shape.pipe > 1 and pipeline.BESIDE_SCOPE in c.op_name and (
                c.op == "collective-permute" or (c.op == "all-reduce" and (shape.pipe_1f1b or c.phase == "forward"))):
            out["routing statistics"] += size  # the stages' statistics: summed after the loop, or 1F1B's moved
            # round the ring with their microbatch and summed over its replicas in the tail (a backward all-reduce
            # named so outside 1F1B is the gradients' reduction XLA merged with it)
        elif shape.pipe_1f1b and c.axes == {"pipe"} and c.op == "collective-permute":  # ring or io, by its scope
            out["pipeline point-to-point" if pipeline.RING_SCOPE in c.op_name else "pipeline inputs/outputs"] += size
        elif shape.pipe_1f1b and over_model and c.op == "all-reduce" and pipeline_1f1b.TAIL_SCOPE in c.op_name \
                and c.elements == shape.pipe_rows * shape.seq and c.shape[-2:] == (shape.pipe_rows, shape.seq):
            out["loss"] += size  # a microbatch's (m, s) on the last stage
        elif shape.pipe_scatter and c.op == "all-gather" and over_model and (pipeline.RING_SCOPE in c.op_name or
                                                                           pipeline.IO_SCOPE in c.op_name):
            # a scattered activation gathered after its stage boundary
            out["pipeline point-to-point" if pipeline.RING_SCOPE in c.op_name else "pipeline inputs/outputs"] += size
        elif over_model and shape.kv_head_elements and c.phase == "backward" and c.shape[-2:] == (2, shape.head_dim) \
                and ((c.op == "all-reduce" and c.elements == shape.kv_head_elements) or
                     (c.op == "all-gather" and c.shard_elements == shape.kv_head_elements)):
            out["replicated key/value heads"] += size  # the one head's (h, 2, head_dim) weight gradient
        elif shape.sequence and over_model and c.op in ("reduce-scatter", "all-gather") and (
                c.shard_elements * shape.tensor == tokens * shape.hidden or  # or a stage's microbatch (rows, s, h)
                (len(c.shape) > 2 and c.shard_elements * shape.tensor == shape.pipe_rows * shape.seq * shape.hidden)):
            out[f"tensor-parallel {c.phase}"] += size
        elif not shape.sequence and c.op == "all-reduce" and over_model and c.elements in (
                tokens * shape.hidden, shape.pipe_rows * shape.seq * shape.hidden):
            out[f"tensor-parallel {c.phase}"] += size
        elif c.op == "collective-permute" and c.axes == {"pipe"}:  # the ring, or the io column's shift
            out["pipeline point-to-point" if c.cyclic else "pipeline inputs/outputs"] += size
        elif not shape.sequence and c.op == "all-reduce" and over_model and c.phase == "backward" and \
                c.shape[:2] == (shape.micro_batch, shape.seq) and c.shape[2:] in ((w,) for w in shape.backward_widths):
            out["tensor-parallel backward"] += size  # a layer's own backward width (latent attention's latents)
        elif c.op == "all-reduce" and over_model and c.shape[:2] == (shape.micro_batch, shape.seq):
            out["loss"] += size  # (b, s) or (b, s, 1): one value per token
        elif shape.sequence and c.op == "all-reduce" and over_model and c.phase == "forward" and \
                c.elements == shape.pooled_rows * shape.hidden:
            out["tensor-parallel forward"] += size
        elif shape.sequence and shape.pipe_1f1b and c.op == "all-reduce" and over_model and \
                pipeline_1f1b.TAIL_SCOPE in c.op_name and c.shape[-3:] == (shape.pipe_rows, 1, shape.hidden):
            out[f"tensor-parallel {c.phase}"] += size  # a microbatch's pooled first tokens, and their gradient
        elif shape.sequence and shape.pipe > 1 and c.op == "collective-permute" and over_model and \
                c.phase == "backward" and c.elements == shape.pooled_rows * shape.hidden:
            out["tensor-parallel backward"] += size  # the pooled token's gradient back to the shard holding it
        elif shape.sequence and c.op in ("all-reduce", "all-gather") and over_model and c.phase == "backward":
            out["sequence-parallel extra"] += size
        elif c.op == "all-to-all" and c.axes == {"expert"}:
            out["expert all-to-all"] += size
        elif shape.num_experts and c.op == "all-reduce" and (
                (c.phase == "forward" and c.elements == shape.num_experts and c.axes <= {"data", "expert"}) or
                (c.phase == "backward" and c.elements == shape.routed_rows and over_model) or
                (shape.pipe > 1 and c.phase == "backward" and over_model and  # the router's gradient (stages)
                 c.shape[-2:] == (shape.hidden, shape.num_experts))):
            out["routing statistics"] += size
        elif shape.head_norm_elements and c.op == "all-reduce" and over_model and c.phase == "backward" and \
                c.shape[-1:] == (shape.head_dim,) and c.elements <= shape.head_norm_elements:
            out["per-head norm gradients"] += size
        elif shape.context > 1 and c.axes == {"context"} and (
                (c.op in ("all-gather", "reduce-scatter") and c.shard_elements == shape.context_kv_elements
                 and c.shape[-1:] == (shape.head_dim,)) or  # keys or values: (.., heads, head_dim), not a
                # parameter's gradient of as many elements (BERT's position table on data 2 x model 2 x context 2)
                (c.op == "all-gather" and c.phase == "forward" and c.shard_elements == tokens)):
            out["context key/value"] += size
        elif c.op == "all-reduce" and c.axes and c.axes <= {"data", "expert", "context", "pipe"}:
            out["data-parallel gradients"] += size
        elif shape.pipe > 1 and c.op == "collective-permute" and c.phase == "backward" and "data" in c.axes and \
                c.axes <= {"data", "pipe", "model"}:  # part of a gradient's reduction over data, which XLA wrote as
            # permutes (BERT's small head gradients under FSDP: between devices of another model shard too)
            out["data-parallel gradients"] += size
        elif c.op == "all-gather" and c.axes == {"data"}:
            out["data-parallel parameter gathers"] += size
        else:
            out["other"] += size
    return out, scalars


def _executions(c: Collective, shape: Shape) -> int:
    """How often ``c`` runs on the device the budget counts. The audit counts a collective inside a conditional on
    every pass of its loop; 1F1B's halves run on some ticks only: on the last stage, of its T ticks, M (v - 1) run a
    chunk's forward and as many a chunk's backward, M the last chunk's forward, tail and backward."""
    if not shape.pipe_1f1b:
        return c.executions
    m, v = shape.pipe_micro, shape.pipe_repeats
    for scope, runs in ((pipeline_1f1b.TAIL_SCOPE, m), (pipeline_1f1b.FORWARD_SCOPE, m * (v - 1)),
                        (pipeline_1f1b.BACKWARD_SCOPE, m * (v - 1))):
        if scope in c.op_name:
            assert c.executions % shape.pipe_ticks == 0, c
            return c.executions // shape.pipe_ticks * runs
    return c.executions


@dataclasses.dataclass(frozen=True)
class Budget:
    """Compiled and minimum bytes per category, and the scalar collectives."""

    compiled: dict[str, int]
    minimum: dict[str, int]
    scalars: int
    tensor: int = 1
    sequence: bool = False

    @property
    def tensor_ring_bytes(self) -> float:
        """Bytes one device sends for the tensor-parallel categories on a ring: 2 (t-1)/t of each all-reduce's
        message, (t-1) times each reduce-scatter's or all-gather's shard (the same for both layouts; BERT's
        pooled first token aside, an all-reduce under sequence parallelism)."""
        t = self.tensor
        got = self.compiled["tensor-parallel forward"] + self.compiled["tensor-parallel backward"]
        return got * ((t - 1) if self.sequence else 2 * (t - 1) / t)

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
        if self.tensor > 1:
            how = "reduce-scatter + all-gather shards x (t-1)" if self.sequence else "all-reduces x 2(t-1)/t"
            lines.append(f"tensor-parallel bytes each device sends on a ring ({how}): {self.tensor_ring_bytes:,.0f}")
        lines.append(f"scalar collectives per step (gradient norm, metrics; not in the ratio): {self.scalars}")
        return "\n".join(lines)


def step_budget(run) -> Budget:
    """The budget of a compiled training run (``megajax.training.loop.setup_run``): its step's collectives read from
    the optimized HLO beside the minimum for its model, mesh and batch."""
    check_countable(run.spec)
    shape = step_shape(run)
    compiled, scalars = categorize(collectives(run.step_fn.as_text(), run.mesh), shape)
    return Budget(compiled, minimum(shape), scalars, shape.tensor, shape.sequence)


def check_countable(spec) -> None:
    """Raises ConfigError for a run (its ``RunSpec``) whose communication the budget does not count yet: context
    shards under pipeline stages, layers of a kind whose ``uncounted`` says what is not counted, latent attention's
    backward under sequence parallelism or stages with model shards."""
    if spec.mesh.pipe > 1 and spec.mesh.context > 1:
        raise ConfigError("the communication budget does not count context shards under pipeline stages yet (each "
                          "stage-tick's key/value all-gathers on a microbatch); drop mesh.pipe or mesh.context to "
                          "read a budget")
    for stack in spec.stacks:
        if stack.kind.uncounted:
            raise ConfigError(f"the communication budget does not count {stack.kind.name} layers yet: "
                              f"{stack.kind.uncounted}")
    own = [s.kind.name for s in spec.stacks if s.kind.backward_widths]
    if own and spec.mesh.model > 1 and (spec.sequence or spec.mesh.pipe > 1):
        raise ConfigError(f"the communication budget counts the backward all-reduces of {own[0]} layers (latent "
                          "attention's) only without sequence parallelism or pipeline stages yet; drop "
                          "parallel.sequence or mesh.pipe to read a budget")


def step_shape(run) -> Shape:
    """What the minimum of a compiled training run depends on: its RunSpec (the model's spec for its layers'
    all-reduces) and its parameters' layout."""
    spec, model = run.spec, run.spec.model_spec
    params = run.abstract_state.params
    reads = one_f_one_b_reads(run)
    # 1F1B: the tail's replicated parameters' gradients are summed over model on every microbatch
    staged = pipelined_stacks(spec.stacks) if spec.mesh.pipe > 1 else ()
    tail = {name: params[name] for name in reads.tail if name not in staged} if reads is not None else {}
    cfg = spec.model
    kv_head = kv_head_elements(cfg, spec.mesh.model)
    kv_weight = cfg.num_layers * kv_head * cfg.kv_heads  # replicated over model, reduced in its own category
    layers = cfg.num_layers // spec.mesh.pipe  # a stage's
    local = data_gradient_elements(cfg, sum(model_shard_elements(a) for a in jax.tree.leaves(params)), layers,
                                   kv_head)
    stage = data_gradient_elements(cfg, sum(model_shard_elements(a) for a in jax.tree.leaves(params)
                                            if "pipe" in spec_axes(a.sharding.spec)), layers, kv_head)
    rows = spec.micro_batch // spec.mesh.pipe  # a device's share of the batch at the ends
    if spec.sequence and spec.mesh.pipe > 1:  # under stages the positions' gradient is reduced over data as its shard
        local -= sum(a.size - a.size // spec.mesh.model for name, a in params.items() if name in model.sequence_rows
                     for a in jax.tree.leaves(a))
    moved = moved_elements(spec, params)  # parameters no gradient reaches: nothing to reduce
    local -= moved
    stage -= moved if spec.mesh.pipe > 1 else 0
    expert_grad = sum(model_shard_elements(a) for a in jax.tree.leaves(params)
                      if "expert" in spec_axes(a.sharding.spec))
    m = spec.mesh
    return shape_of(
        spec, micro_batch=rows, num_micro=spec.num_micro, tensor=m.model, data=m.data, expert=m.expert,
        context=m.context, layers=cfg.num_layers, activation_bytes=np.dtype(cfg.compute_dtype).itemsize,
        local_grad_elements=local, sequence=spec.sequence,
        sequence_grad_elements=sequence_grad_elements(params, m.model, model) - kv_weight if spec.sequence else 0,
        pooled_rows=model.pooled_rows * rows,
        sequence_layer_elements=(sequence_grad_elements({n: params[n] for n in staged}, m.model, model)
                                 - kv_weight) // cfg.num_layers if spec.sequence and staged else 0,
        gathered_shard_elements=gathered_shard_elements(run, reads), expert_grad_elements=expert_grad,
        head_norm_elements=head_norm_elements(spec),
        context_key_bytes=(8 if spec.data.packed else 4) if model.causal_lm else 1,
        stage_grad_elements=stage if m.pipe > 1 else 0, tied_elements=tied_elements(params, reads),
        sequence_tail_elements=sequence_grad_elements(tail, m.model, model) if spec.sequence else 0,
        **_pipeline_shape(spec, reads))


def moved_elements(spec: RunSpec, params: dict) -> int:
    """Elements on a device of the parameters the objective moves outside the gradient (``StateUpdate.moved``:
    DeepSeek's correction biases): their gradient is a constant zero, which XLA does not reduce."""
    update = spec.objective.update
    if update is None:
        return 0
    return sum(model_shard_elements(a) for path, a in jax.tree_util.tree_leaves_with_path(params)
               if getattr(path[-1], "key", None) in update.moved)


def tied_elements(params: dict, reads: pipelined.Reads | None) -> int:
    """Under the 1F1B schedule, the elements on a device of the parameters both its tail and its ends read (a tied
    word embedding): their gradient is reduced twice, the lookup's (every stage's share of the batch) and the
    head's (the last stage's tail, inside the tick loop), as Megatron-LM reduces its embedding group's; 0
    otherwise."""
    if reads is None:
        return 0
    return sum(model_shard_elements(a) for name in reads.tail & reads.ends for a in jax.tree.leaves(params[name]))


def head_norm_elements(run: RunSpec) -> int:
    """Elements of the layers' per-head norm scales (logical axes ``layers, head_dim``: Qwen3's query and key
    norms), which every model shard holds whole while it computes only its own heads: with ``mesh.model`` > 1 each
    shard's gradient of them is partial, and the shards sum it (one all-reduce per layer in the backward pass)."""
    return sum(math.prod(p.shape) for p in parameters(run) if p.names == ("layers", "head_dim"))


def _pipeline_shape(spec: RunSpec, reads: pipelined.Reads | None) -> dict[str, int | bool]:
    """The pipeline schedule's part of ``Shape`` (nothing without stages); ``reads``: a 1F1B run's
    (``one_f_one_b_reads``)."""
    p, v = spec.mesh.pipe, spec.pipeline.repeats
    if p == 1:
        return {}
    micro = pipeline.microbatches_for(spec.micro_batch, spec.pipeline.microbatches, p)
    rows = spec.micro_batch // micro
    # per row: its index where dropout keys on it (one row on a device: a scalar, outside the ratio); per position
    # a packed decoder's segments and positions (int32), an encoder's padding mask (a byte)
    packed = spec.data.packed
    per_position = (8 if packed else 0) if spec.model_spec.causal_lm else 1
    arg_bytes = (4 if spec.model.dropout > 0 and rows > 1 else 0) + per_position * spec.model.max_seq_len
    one_f_one_b = reads is not None
    if one_f_one_b:  # the rows' fields the loss reads go with the microbatch too, to the last stage's tail (but
        # a scalar, outside the ratio: one row's label)
        fields = spec.batch_fields
        arg_bytes += sum(math.prod(fields[k].row_shape) * np.dtype(fields[k].dtype).itemsize
                         for k in reads.fields if rows * math.prod(fields[k].row_shape) > 1)
    # Megatron's scatter/gather at the boundary, where the step does it (asked as the step asks)
    mesh_shape = spec.mesh.sizes
    scatter = pipeline_1f1b.scattered(logical_to_spec(RESIDUAL, spec.rules), spec.model.max_seq_len,
                                      mesh_shape) is not None
    ticks = pipeline_1f1b.ticks(micro, p, v) if one_f_one_b else pipeline.ticks(micro, p, v)
    return dict(pipe=p, pipe_ticks=ticks, pipe_rows=rows, pipe_arg_bytes=arg_bytes,
                pipe_layers=spec.model.num_layers // (p * v), pipe_circular=v > 1 and not one_f_one_b,
                pipe_scatter=scatter, pipe_1f1b=one_f_one_b, pipe_micro=micro, pipe_repeats=v,
                pipe_recompute=one_f_one_b and spec.pipeline.stage_recompute)


def one_f_one_b_reads(run) -> pipelined.Reads | None:
    """What a 1F1B run's tail and ends read (``pipelined.reads``); None for another schedule."""
    spec = run.spec
    if spec.mesh.pipe == 1 or spec.pipeline.schedule != pipeline.ONE_F_ONE_B:
        return None
    graphdef, _ = nnx.split(abstract_model_of(spec))
    rows = spec.global_batch // spec.num_micro  # one accumulation micro-batch, every data shard's
    batch = {k: jax.ShapeDtypeStruct((rows, *f.row_shape), f.dtype) for k, f in spec.batch_fields.items()}
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), run.abstract_state.params)
    with activate(run.mesh, spec.parallel_context):
        return pipelined.reads(spec.objective, graphdef, params, batch)


def gathered_shard_elements(run, reads: pipelined.Reads | None = None) -> int:
    """The parameter shards a step all-gathers over ``data``, as ZeRO and FSDP define it: with
    ``parallel.shard_optimizer`` (ZeRO-1) each updated parameter whose moments are split, once; with
    ``parallel.fsdp`` each split parameter twice, for the forward and again for the backward pass, or under pipeline
    stages once (each stage's layers are gathered once per step, outside the tick loop, and kept; under 1F1B, given
    its ``reads`` (``one_f_one_b_reads``), what both its tail and its ends read twice: a tied word embedding, for the
    lookup and for the head)."""
    spec, total = run.spec, 0
    if spec.mesh.data == 1 or not spec.shard_optimizer:
        return 0
    times = 1 if not spec.fsdp or spec.mesh.pipe > 1 else 2
    for a in jax.tree.leaves(run.abstract_state.params):
        stored = a.sharding if spec.fsdp else over_data(a.sharding, a.shape)
        if "data" in spec_axes(stored.spec):
            total += times * model_shard_elements(a) // spec.mesh.data
    if spec.fsdp:  # 1F1B gathers a tied word embedding for the lookup and again for the head (its tail)
        total += tied_elements(run.abstract_state.params, reads) // spec.mesh.data
    return total


def model_shard_elements(param: jax.ShapeDtypeStruct) -> int:
    """A parameter's elements on one device as the model axis alone splits it: what its gradient all-reduce over
    ``data`` carries, also where ``parallel.fsdp`` stores it split over ``data`` too."""
    sharding = param.sharding
    return int(np.prod(param.shape)) // int(np.prod([sharding.mesh.shape[a] for a in spec_axes(sharding.spec)
                                                     if a != "data"]))


def sequence_grad_elements(params: dict, tensor: int, model: ModelSpec) -> int:
    """Gradient elements summed over ``model`` under sequence parallelism: every parameter replicated over it
    except the heads on the pooled first token (``ModelSpec.pooled_heads``: their input is whole on every shard),
    the parameters whose rows follow the sequence (``ModelSpec.sequence_rows``: the learned positions) as one shard
    of their rows (all-gathered)."""
    total = 0
    for path, a in jax.tree_util.tree_leaves_with_path(params):
        top = jax.tree_util.keystr(path[:1], simple=True)
        if "model" in jax.tree.leaves(tuple(a.sharding.spec)) or top in model.pooled_heads:
            continue
        total += a.size // tensor if top in model.sequence_rows else a.size
    return total
