"""The memory planner's terms on one device of a run's mesh: one layer's residuals and the output head's (asked of
the model's spec), the attention core's backward working set, what drawing dropout masks holds and what context
shards add (asked of ``models.attention_memory``), and the parameters as the sharding rules lay them out.
``memory_planner`` adds them up for a step, ``memory_stages`` for a pipelined one; every function reads a resolved
run (``config.RunSpec``) and holds no layer's formula."""

from __future__ import annotations

import dataclasses
import math

import jax
from flax import nnx

from megajax.config import RunSpec, abstract_model_of
from megajax.models import attention_memory
from megajax.models.spec import Stack
from megajax.models.transformer import attention_reason
from megajax.parallel.sharding import fsdp_spec, logical_to_spec, spec_axes

FP32 = 4


def compute_bytes(run: RunSpec) -> int:
    """Bytes of one activation value in the compute dtype: 4 (fp32) or 2 (bf16 / fp16)."""
    return FP32 if run.precision == "fp32" else 2


def attention_for(run: RunSpec, gpu: bool) -> str:
    """The attention core's implementation in the compiled step: 'cudnn' on an NVIDIA GPU where the model allows
    it (``transformer.attention_reason``), else 'xla'."""
    return "cudnn" if gpu and not attention_reason(run.model) else "xla"


def exchange_for(run: RunSpec, gpu: bool) -> str:
    """The expert exchange in the compiled step: 'ragged' with expert shards on an NVIDIA GPU unless
    ``model.expert_exchange`` says blocks (``parallel.expert_exchange.exchange_of``), else 'blocks' (the CPU's, the
    ragged one's emulation aside; without expert shards the dispatch is the blocks path's, nothing exchanged)."""
    return "ragged" if gpu and run.mesh.expert > 1 and run.model.expert_exchange != "blocks" else "blocks"


def trunk_rows(run: RunSpec, micro_batch: int) -> int:
    """Sequences the trunk runs per micro-batch (the model's rows per example: multiple choice, one per option)."""
    return micro_batch * run.model_spec.rows_per_example


def stack_residual_bytes(run: RunSpec, micro_batch: int, remat: str | None = None, gpu: bool = False) -> int:
    """Bytes the model's layers keep for their backward pass on one device of ``run``'s mesh (``remat`` defaults
    to the model's; ``gpu``: as compiled for an NVIDIA GPU, where cuDNN's attention keeps less, ``attention_for``):
    each of its stacks' count of its layer kind's own inventory (``LayerKind.residuals``; the trunk's block:
    ``models.block_memory``), and what context parallelism adds to each layer."""
    return sum(stack.count * kept for stack, kept in kinds_kept(run, micro_batch, remat, gpu))


def kinds_kept(run: RunSpec, micro_batch: int, remat: str | None, gpu: bool) -> list[tuple[Stack, int]]:
    """Each stack with what one of its layers keeps (``stack_residual_bytes``), in the model's order of stacks."""
    split = run.mesh.model if run.sequence else 1  # the residual stream's share on one device
    remat, rows, attention = remat or run.model.remat, trunk_rows(run, micro_batch), attention_for(run, gpu)
    local = dataclasses.replace(run.model, max_seq_len=run.model.max_seq_len // run.mesh.context)
    context = context_attention_bytes(run, rows, remat, attention)
    kept = []
    for stack in run.stacks:
        # only a routed layer has expert shards; the ragged exchange where a GPU's step runs it
        experts = {"expert": run.mesh.expert, "exchange": exchange_for(run, gpu)} if stack.kind.routed else {}
        own = stack.kind.residuals(local, rows, run.mesh.model, split, remat, compute_bytes(run), attention, **experts)
        kept.append((stack, own + context))
    return kept


def layer_residual_bytes(run: RunSpec, micro_batch: int, remat: str | None = None, gpu: bool = False) -> int:
    """Bytes one layer keeps (``stack_residual_bytes``): a model of one layer kind, its layer's; of several, the mean
    over its layers, rounded up (what GPipe's and the circular schedule's stages are planned with; there the stacks
    every stage runs whole, a DeepSeek decoder's dense layers and MTP depths, are planned as that mean too; 1F1B
    plans them where they run, ``memory_stages``)."""
    return -(-stack_residual_bytes(run, micro_batch, remat, gpu) // sum(stack.count for stack in run.stacks))


def largest_layer_residual_bytes(run: RunSpec, micro_batch: int, remat: str | None = None, gpu: bool = False) -> int:
    """Bytes the largest of the model's layer kinds keeps (``stack_residual_bytes``): a recomputed layer's working
    set, planned at the layer whose backward pass holds the most (a DeepSeek decoder's routed layer, not the mean of
    it and its dense first layers)."""
    return max(kept for stack, kept in kinds_kept(run, micro_batch, remat, gpu) if stack.count)


def context_attention_bytes(run: RunSpec, rows: int, remat: str, attention: str) -> int:
    """What a layer keeps under context parallelism beyond its inventory, on one device of ``run``'s mesh
    (``models.attention_memory.context_attention_bytes``); 0 without context shards."""
    return attention_memory.context_attention_bytes(run.model, rows, run.mesh.model, run.mesh.context, remat,
                                                    attention, compute_bytes(run))


def head_bytes(run: RunSpec, micro_batch: int, gpu: bool = False) -> int:
    """Bytes of the output head live when the backward pass starts, on one device: what the model's spec says its
    head holds (``ModelSpec.head_memory``).

    ``vocab_logit_copies`` fp32 (b, s, V/t) tensors (GPT's and Llama's 3: the logits, their exponentials and their
    gradient; BERT's MLM head 4, its biased logits too; 0 for a head without vocabulary logits, the task models'),
    with 16-bit compute the compute-dtype logits too, plus ``hidden_tensors`` (b, s, h) fp32 tensors of the
    embeddings, the final norm and the head (GPT's 8; BERT's 16, with the MLM transform's dense, GeLU and
    LayerNorm); where the output layer runs more than once (``HeadMemory.outputs``) each run keeps its fp32 logits,
    the other copies live for one run's backward at a time. With
    ``parallel.sequence`` those run on the split sequence (1/t of them) and the output layer keeps its all-gathered
    input, one whole (b, s, h) tensor in the compute dtype.

    ``gpu``: XLA:GPU fuses the exponentials, the normalisation and the LayerNorms into the reductions and GEMMs
    that read them; what the head holds at the peak is the logits as the output GEMM writes them (compute dtype,
    each run's) and their fp32 gradient (compared with steps compiled for an H100 in tests/test_gpu_target.py and
    bench/README.md).
    """
    m, tp = run.model, run.mesh.model
    cd, s, b, h = compute_bytes(run), m.max_seq_len // run.mesh.context, trunk_rows(run, micro_batch), m.hidden_size
    head = run.model_spec.head_memory
    vocab = head.vocab_logit_copies  # fp32 (b, s, V/t) copies
    logits, outputs = s * b * m.padded_vocab_size // tp, head.outputs(m) if head.outputs else 1
    if gpu:
        return logits * (outputs * cd + FP32) if vocab else 0
    extra_cd = cd if vocab and cd < FP32 else 0
    hidden = head.hidden_tensors * s * b * h * FP32
    if run.sequence:
        hidden = hidden // tp + s * b * h * cd
    if not vocab:
        return hidden
    # each run keeps its fp32 logits (and in 16-bit their compute-dtype copy) for its backward; the other copies (the
    # exponentials, the gradient, a biased copy) live while one run's backward works
    return logits * (outputs * (FP32 + extra_cd) + (vocab - 1) * FP32) + hidden


@dataclasses.dataclass(frozen=True)
class Activations:
    """Activation bytes on one device for one micro-batch."""

    layers: int  # L layers' residuals, kept from the forward pass to their backward
    head: int  # the output head at the start of the backward pass
    # one layer's residuals recomputed in the backward pass (full / save_dots), and the attention core's backward
    # working set (attention_backward_bytes); under pipeline stages a tick's backward working set
    recompute: int

    @property
    def total(self) -> int:
        return self.layers + max(self.head, self.recompute)  # the head is gone before the first layer's backward


def dropout_bits_bytes(run: RunSpec, rows: int, gpu: bool = False, circular: bool = False) -> int:
    """What drawing attention dropout masks holds on one device of ``run``'s mesh for ``rows`` sequences
    (``models.attention_memory.dropout_bits_bytes``; ``circular``: what a circular stage holds beside all it
    keeps)."""
    return attention_memory.dropout_bits_bytes(run.model, trunk_rows(run, rows), run.mesh.model, run.mesh.context,
                                               attention_for(run, gpu), gpu, circular)


def attention_backward_bytes(run: RunSpec, micro_batch: int, gpu: bool = False) -> int:
    """The attention core's backward working set beyond what the layer kept, on one device of ``run``'s mesh
    (``models.attention_memory.attention_backward_bytes``)."""
    return attention_memory.attention_backward_bytes(run.model, trunk_rows(run, micro_batch), run.mesh.model,
                                                     run.mesh.context, attention_for(run, gpu))


def traced_layer_residual_bytes(run: RunSpec, micro_batch: int, scan: int = 0) -> int:
    """One layer's residuals on a single device, read from the traced gradient (abstract values only).

    Sums the per-layer slices of a forward layer scan's stacked outputs in ``jax.make_jaxpr(jax.grad(loss))`` (the
    ``scan``-th scan of the gradient's jaxpr: the forward ones come first, in the order the model runs its
    stacks), leaving out the per-layer inputs the layer's body returns as it received them (its fp32 weights, which
    its backward pass reads: those are the parameters, not activations). The check behind each ``LayerKind.residuals``.
    """
    graphdef, state = nnx.split(abstract_model_of(run))
    params = nnx.to_pure_dict(state)
    objective = run.objective
    batch = {k: jax.ShapeDtypeStruct((micro_batch, *f.row_shape), f.dtype)
             for k, f in run.batch_fields.items()}
    key = jax.random.key(0) if run.model.dropout > 0 else None
    jaxpr = jax.make_jaxpr(jax.grad(lambda p, x: objective.loss(nnx.merge(graphdef, p), x, key)[0]))(params, batch)
    forward = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"][scan]  # a layer stack's forward pass
    body = forward.params["jaxpr"].jaxpr
    scanned = forward.params["num_consts"] + forward.params["num_carry"]  # the body's per-layer inputs after these
    passed = set(map(id, body.invars[scanned:]))  # per-layer inputs the body returns as it got them: its weights
    total = 0
    for v, inner in zip(forward.outvars[forward.params["num_carry"]:], body.outvars[forward.params["num_carry"]:]):
        shape, dtype = v.aval.shape[1:], v.aval.dtype
        if jax.numpy.issubdtype(dtype, jax.dtypes.prng_key) or id(inner) in passed:
            continue  # dropout keys; weights passed through the scan
        total += math.prod(shape) * dtype.itemsize
    return total


@dataclasses.dataclass(frozen=True)
class Parameter:
    """One parameter of the abstract model as a mesh holds it."""

    module: str  # its top-level module (a ``Stack``'s ``attr``: stacked layers)
    names: tuple[str | None, ...]  # its logical axis names (the stacked layers' lead with ``layers``)
    shape: tuple[int, ...]
    per_device: int  # elements one device holds


def parameters(run: RunSpec, split_over_data: bool = False) -> list[Parameter]:
    """Every parameter of ``run``'s abstract model (``nnx.eval_shape``: no memory) as its rules lay it out on its
    mesh (a stage's layers with pipeline stages), or with ``split_over_data`` as ``parallel.fsdp`` stores it
    (``sharding.fsdp_spec``)."""
    mesh_shape = run.mesh.sizes
    out = []
    for module, names, shape in _inventory(run):
        spec = (fsdp_spec(names, shape, run.rules, mesh_shape) if split_over_data
                else logical_to_spec(names, run.rules))
        local = math.prod(shape) // math.prod(mesh_shape[a] for a in spec_axes(spec))
        out.append(Parameter(module, names, shape, local))
    return out


_INVENTORIES: dict[tuple, tuple[tuple[str, tuple, tuple], ...]] = {}


def _inventory(run: RunSpec) -> tuple[tuple[str, tuple, tuple], ...]:
    """(top-level module, logical names, shape) of each parameter of ``run``'s abstract model, traced once per model
    and rules (the mesh planners ask for it on thousands of candidate runs of one model)."""
    key = (run.model_spec.module, run.model, run.rules)
    if key not in _INVENTORIES:
        state = nnx.state(abstract_model_of(run))
        _INVENTORIES[key] = tuple(
            (jax.tree_util.keystr(path[:1], simple=True), tuple(var.get_metadata()["out_sharding"]), tuple(var.shape))
            for path, var in jax.tree_util.tree_leaves_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable)))
    return _INVENTORIES[key]


def params_per_device(run: RunSpec, split_over_data: bool = False,
                      only: tuple[str, ...] | None = None) -> tuple[int, int]:
    """(total parameters, parameters held by one device of ``run``'s mesh) as its rules lay them out, or with
    ``split_over_data`` as ``parallel.fsdp`` stores them (``parameters``); ``only``: those of these top-level
    modules (stacks' ``attr``s)."""
    held = [p for p in parameters(run, split_over_data) if only is None or p.module in only]
    return sum(math.prod(p.shape) for p in held), sum(p.per_device for p in held)
