"""What a model is, in one place: each model file registers a ``ModelSpec`` (its config type, module, objective
and costs), and everything outside ``models/`` (data, the step, the loop, evaluation, the planners) asks the spec of
``config.model.name`` instead of comparing names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from flax import nnx

from megajax.data.formats import WINDOWS, ExampleFormat
from megajax.errors import ConfigError
from megajax.models.block_memory import block_residual_bytes
from megajax.models.objectives import LM, Objective
from megajax.models.transformer import STACK, TransformerConfig


def transformer_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Megatron's model FLOPs of one forward+backward step (Narayanan et al. 2021, without recomputation):
    72 B s L h^2 (1 + s / (6 h) + V / (12 L h)); the last term is the output layer over every position."""
    return 72.0 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (12 * layers * hidden))


def decoder_flops(batch: int, seq: int, layers: int, hidden: int, kv_width: int, mlp_width: int,
                  vocab: int) -> float:
    """The same count for other block shapes: 3 (forward + backward) x 2 FLOPs per multiply-add of the query and
    output projections (h x h each), the key/value projections (h x ``kv_width``: 2h for multi-head attention,
    less with grouped-query heads), the MLP's GEMMs (h x ``mlp_width`` summed over them: 8h for GPT's 4h MLP, 3 ffn
    for SwiGLU), the attention scores and context (2 s h each) and the output layer (h x vocab). With
    ``kv_width=2h, mlp_width=8h`` it is ``transformer_flops``."""
    per_token_layer = 2 * hidden * (2 * hidden + kv_width + mlp_width) + 4 * seq * hidden
    return 3.0 * batch * seq * (layers * per_token_layer + 2 * hidden * vocab)


@dataclasses.dataclass(frozen=True)
class HeadMemory:
    """What the model's output head holds when the backward pass starts (``tools.memory_terms.head_bytes``)."""

    vocab_logit_copies: int  # fp32 (b, s, V/t) tensors: logits, exponentials, gradient (+ biased logits); 0: none
    hidden_tensors: int  # fp32 (b, s, h) tensors of the embeddings, the final LayerNorm and the head
    # cfg -> how many times a step applies the output layer, each application's logits live at once (a DeepSeek
    # decoder's multi-token prediction depths add theirs); None: once
    outputs: Callable[[TransformerConfig], int] | None = None

    @property
    def vocab_output(self) -> bool:
        """Whether the model ends in an output layer over the vocabulary (vocab-parallel logits): the memory
        planner's word-embedding gradient and FSDP's gathered output layer."""
        return self.vocab_logit_copies > 0


# The software a step's element-wise work runs under (``tools.scaling_clusters.Cluster.software``): eager kernels
# (Megatron-LM 2019's PyTorch step), or fused ones (Megatron-LM 2021's operator fusion)
EAGER, FUSED = "eager", "fused"


@dataclasses.dataclass(frozen=True)
class ElementwisePasses:
    """One layer's memory-bound element-wise work per micro-batch, as passes (a pass reads or writes the tensor
    once) of (forward, backward) over each of its three sizes: (b*s*h on every model shard, b*s*h/t, b*(a/t)*s*s
    attention scores), under ``eager`` and under ``fused`` kernels (``EAGER``, ``FUSED``). The scaling model times
    them at HBM bandwidth; recomputation repeats the forward."""

    eager: tuple[tuple[float, float], ...]
    fused: tuple[tuple[float, float], ...]

    def under(self, software: str) -> tuple[tuple[float, float], ...]:
        """The passes under ``software`` (``EAGER`` or ``FUSED``)."""
        return {EAGER: self.eager, FUSED: self.fused}[software]


# GPT's block, counted from Megatron-LM 2019's eager step: per b*s*h on every model shard (two LayerNorms, bias +
# dropout + residual twice) 20 forward; per b*s*h/t (the heads' transposes, GeLU) 16; per score (scale, mask,
# softmax, dropout) 10. Under Megatron-LM 2021's fused kernels (Narayanan et al. 2021: bias + GeLU, bias + dropout
# + add and scale + mask + softmax fused; the [s, b, a, h] layout feeds the batched GEMMs without transposes): per
# b*s*h, LayerNorm 2 + bias-dropout-add 4 (the GEMM output and the residual read, the sum and the mask written),
# twice; per b*s*h/t, bias + GeLU on 4h/t 8, the attention context's copy back to [s, b, h] 2; per score,
# scale-mask-softmax 2 + dropout 3. Backward twice the forward in both.
BLOCK_PASSES = ElementwisePasses(eager=((20, 40), (16, 32), (10, 20)), fused=((12, 24), (10, 20), (5, 10)))


@dataclasses.dataclass(frozen=True)
class LayerKind:
    """One kind of layer a model stacks (a dense block, a routed block, ...) and what one such layer costs, stated
    next to its code: the tools (``tools.memory_planner``, ``tools.comm_budget``, ``tools.scaling``) sum these over
    a model's ``Stack``s instead of knowing any family's layer."""

    name: str
    # (cfg, sequences, tp, sequence split, remat, compute-dtype bytes, attention implementation) -> bytes one such
    # layer keeps for its backward pass on a device (tools.memory_planner); tests hold each against its traced
    # jaxpr. A routed kind's also takes ``expert=E``, the expert shards (``routed``)
    residuals: Callable[..., int] = block_residual_bytes
    # Per layer and micro-batch, each way: the b x s x h all-reduces over ``model`` of its forward pass (Megatron's
    # g, one per row-parallel output) and as many of its backward pass (f, one per column-parallel input's
    # gradient). GPT's block: 2 (attention, MLP); a parallel attention/MLP block whose two input GEMMs and two
    # output GEMMs are each one GEMM: 1. Under sequence parallelism each is a reduce-scatter + all-gather pair.
    tensor_all_reduces: int = 2
    # Per layer under ``remat=full``: the forward all-reduces whose results the recomputed forward pass needs again
    # (the layer's output is the saved scan carry, so its last all-reduce is not redone). GPT's block: 1 (the
    # attention output, the MLP's input); a parallel block: 0. Under sequence parallelism the recomputation redoes
    # the ``tensor_all_reduces`` all-gathers of the GEMMs' inputs besides these reduce-scatters.
    recomputed_all_reduces: int = 1
    # cfg -> the elements per token of each of its backward pass's all-reduces over ``model``, where they are not
    # ``tensor_all_reduces`` of the hidden size (latent attention reduces its latents' gradients, not its input's);
    # None: ``tensor_all_reduces`` of the hidden size. The communication budget counts them without sequence
    # parallelism or pipeline stages (``tools.comm_budget.check_countable``)
    backward_widths: Callable[[TransformerConfig], tuple[int, ...]] | None = None
    # Its element-wise work (the scaling model's HBM passes); a kind not counted on its own states GPT's block's
    elementwise: ElementwisePasses = BLOCK_PASSES
    # A routed kind (its MLP a mixture of experts, ``models.moe``), whose assignments cross the ``expert`` axis and
    # whose routing statistics are summed (the communication budget, the scaling model's expert dimension): cfg ->
    # (experts per layer, experts each token is routed to), and (cfg, sequences, expert shards) -> rows of each
    # destination's block when a shard sends its tokens to their experts, and the rows a destination receives at
    # most. None: a dense MLP
    experts: Callable[[TransformerConfig], tuple[int, int]] | None = None
    exchange_rows: Callable[[TransformerConfig, int, int], int] | None = None
    receive_rows: Callable[[TransformerConfig, int, int], int] | None = None
    # A routed kind's dispatch, beyond ``elementwise``: forward passes per element of (its e m x h exchange blocks,
    # its n x h routed assignments, its e m x 2F/t gate and up outputs), backward twice (``tools.scaling_experts``)
    dispatch_passes: tuple[float, float, float] = (0, 0, 0)
    # What the communication budget does not count of this kind yet and what to change to read one, said when it
    # refuses a run with such layers (``tools.comm_budget.check_countable``); "": it counts all of it
    uncounted: str = ""

    @property
    def routed(self) -> bool:
        """Whether its MLP is a mixture of experts."""
        return self.experts is not None


BLOCK = LayerKind("block")  # the trunk's transformer.Block: GPT-2's, BERT's and the task models' layers


@dataclasses.dataclass(frozen=True)
class Stack:
    """One of a model's layer stacks: the model's attribute holding ``count`` layers of ``kind`` stacked on a
    leading ``layers`` axis (``transformer.make_blocks``). ``pipelined``: split over pipeline stages (the layers a
    ``pipeline.StackRunner`` runs); a stack that is not runs whole on each stage's share of the rows, as the
    embedding does, before the pipelined stacks where the model lists it before them, after them (the loss's tail,
    under 1F1B) where it lists it after (the memory planner reads that order)."""

    attr: str
    kind: LayerKind
    count: int
    pipelined: bool = True


def trunk_stack(cfg: TransformerConfig, kind: LayerKind = BLOCK) -> tuple[Stack, ...]:
    """A model of ``cfg.num_layers`` layers of one ``kind`` on one pipelined stack, ``transformer.STACK``."""
    return (Stack(STACK, kind, cfg.num_layers),)


def all_reduces(stacks: tuple[Stack, ...]) -> tuple[int, int]:
    """(each way, redone under ``remat=full``): the tensor-parallel all-reduces of one pass over every layer of
    ``stacks``, each layer its kind's (``LayerKind.tensor_all_reduces``, ``recomputed_all_reduces``)."""
    return (sum(s.count * s.kind.tensor_all_reduces for s in stacks),
            sum(s.count * s.kind.recomputed_all_reduces for s in stacks))


def backward_widths(kind: LayerKind, cfg: TransformerConfig) -> tuple[int, ...]:
    """The elements per token of each of a ``kind`` layer's backward all-reduces over ``model``
    (``LayerKind.backward_widths``, or its ``tensor_all_reduces`` of the hidden size)."""
    return kind.backward_widths(cfg) if kind.backward_widths else (cfg.hidden_size,) * kind.tensor_all_reduces


def pipelined_stacks(stacks: tuple[Stack, ...]) -> tuple[str, ...]:
    """The attributes of the stacks split over pipeline stages."""
    return tuple(s.attr for s in stacks if s.pipelined)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model family's facts: its module, how it trains, what it costs, what it is evaluated on.

    The costs the tools read (``tools.memory_planner``, ``tools.comm_budget``, ``tools.scaling``) of a family's
    layers are here or in the abstract model: parameters (per device, per layer, the layer's GEMM shapes) come from
    ``nnx.eval_shape`` of ``module`` and the sharding rules; a layer's own costs are its ``LayerKind``'s, and
    ``stacks`` says how many layers of which kinds the model holds (default: ``cfg.num_layers`` of the trunk's
    ``transformer.Block``, ``BLOCK``: its residuals, all-reduces, element-wise passes and a routed kind's dispatch
    passes); the trunk's attention core's working set, dropout bits and context additions are
    ``models.attention_memory``'s; the rest a family states below. The tools combine these with the mesh and the
    cluster (how many GPUs, how fast); they hold no layer's formula:

    * ``flops``: model FLOPs of a step, the metrics' MFU numerator and the scaling model's TFLOP/s;
    * ``stacks``: the model's layer stacks, each a count of one ``LayerKind`` (its residuals, the memory
      planner's per-layer activations; its tensor-parallel all-reduces, the communication budget's minimum, which
      the compiled step is audited against, and the scaling model's tensor-parallel time);
    * ``head_memory``: what the output head holds when the backward pass starts.
    """

    name: str  # config.model.name
    config: type[TransformerConfig]  # the family's frozen config: config.model's fields are its fields
    module: type[nnx.Module]  # built as module(config, rngs=...)
    objective: Objective  # the loss and the batch fields it reads
    flops: Callable[[TransformerConfig, int, int], float]  # (cfg, sequences, seq_len) -> model FLOPs fwd + bwd
    head_memory: HeadMemory
    examples: ExampleFormat | None = None  # pretraining: how examples are cut from a corpus; None: fine-tuning
    tasks: tuple[str, ...] = ()  # fine-tuning: the data.task values it trains on (data.source=task)
    eval_tasks: tuple[str, ...] = ()  # the eval.py --task values that apply to its checkpoints
    rows_per_example: int = 1  # sequences the trunk runs per example (multiple choice: one per option)
    pooled_heads: tuple[str, ...] = ()  # replicated heads that read only the pooled first token
    pooled_rows: int = 0  # first tokens pooled per example
    sequence_rows: tuple[str, ...] = ()  # parameters whose rows follow the sequence (learned positions)
    perplexity_of: str | None = None  # the validation metric whose exp is the perplexity (None: no perplexity)
    causal_lm: bool = False  # generates text left to right: lm-eval, generation, the scaling model
    pretrained_trunk: type[nnx.Module] | None = None  # init_from: a checkpoint whose module subclasses this
    # (cfg, total parameters) -> those one token uses (a mixture of experts': all but the experts it skips); info
    # prints it, and ``flops`` counts only these
    active_parameters: Callable[[TransformerConfig, int], int] = lambda cfg, total: total
    # cfg -> its layer stacks (``Stack``: attribute, layer kind, count, pipelined), what the tools iterate
    stacks: Callable[[TransformerConfig], tuple[Stack, ...]] = trunk_stack


# the eval.py tasks of a causal language model's checkpoints
DECODER_EVAL_TASKS = ("wikitext103", "lambada", "ppl", "generate", "sft", "dpo")


def decoder_spec(name: str, config: type[TransformerConfig], module: type[nnx.Module],
                 flops: Callable[[TransformerConfig, int, int], float], **fields) -> ModelSpec:
    """A causal language model's spec, what every decoder family shares given once: next-token prediction
    (``objectives.LM``) on a corpus's windows, the output layer's memory over the padded vocabulary at every
    position, the decoders' eval tasks, the perplexity of ``loss``, and ``init_from`` a checkpoint of this module;
    ``fields``: the family's own (its residuals, all-reduces, objective, ...), over these."""
    shared = dict(objective=LM, examples=WINDOWS, head_memory=HeadMemory(vocab_logit_copies=3, hidden_tensors=8),
                  eval_tasks=DECODER_EVAL_TASKS, perplexity_of="loss", causal_lm=True, pretrained_trunk=module)
    return ModelSpec(name=name, config=config, module=module, flops=flops, **{**shared, **fields})


MODELS: dict[str, ModelSpec] = {}


def register(spec: ModelSpec) -> ModelSpec:
    """Adds ``spec`` to the registry under ``spec.name`` (once)."""
    if spec.name in MODELS:
        raise ValueError(f"model {spec.name!r} is registered twice")
    MODELS[spec.name] = spec
    return spec


def model_spec(name: str) -> ModelSpec:
    """The spec registered as ``name`` (``config.model.name``); ConfigError naming the choices otherwise."""
    if name not in MODELS:
        raise ConfigError(f"model.name={name!r}; choose one of {sorted(MODELS)}")
    return MODELS[name]


def task_models() -> dict[str, ModelSpec]:
    """data.task -> the model that fine-tunes on it."""
    return {task: spec for spec in MODELS.values() for task in spec.tasks}


def eval_task_models() -> dict[str, ModelSpec]:
    """eval.py --task -> the model whose checkpoints it evaluates."""
    return {task: spec for spec in MODELS.values() for task in spec.eval_tasks}
