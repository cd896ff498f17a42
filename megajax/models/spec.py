"""What a model is, in one place: each model file registers a ``ModelSpec`` (its config type, module, objective
and costs), and everything outside ``models/`` (data, the step, the loop, evaluation, the planners) asks the spec of
``config.model.name`` instead of comparing names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from flax import nnx

from megajax.data.formats import ExampleFormat
from megajax.errors import ConfigError
from megajax.models.block_memory import block_residual_bytes
from megajax.models.objectives import Objective
from megajax.models.transformer import TransformerConfig


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
    """What the model's output head holds when the backward pass starts (``tools.memory_planner.head_bytes``)."""

    vocab_logit_copies: int  # fp32 (b, s, V/t) tensors: logits, exponentials, gradient (+ biased logits); 0: none
    hidden_tensors: int  # fp32 (b, s, h) tensors of the embeddings, the final LayerNorm and the head


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model family's facts: its module, how it trains, what it costs, what it is evaluated on."""

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
    gated_mlp: bool = False  # the MLP's first GEMM is two (gate and up: SwiGLU), so 3 GEMMs of h x ffn
    biases: bool = True  # the linear layers and norms have biases (LayerNorm; Llama's RMSNorm and GEMMs have none)
    # (cfg, sequences, tp, sequence split, remat, compute-dtype bytes, attention implementation) -> bytes one layer
    # keeps for its backward pass on a device (tools.memory_planner); the trunk's Block's by default
    layer_residuals: Callable[[TransformerConfig, int, int, int, str, int, str], int] = block_residual_bytes

    @property
    def vocab_output(self) -> bool:
        """Whether the model ends in the (tied, vocab-parallel) output layer over the vocabulary."""
        return self.head_memory.vocab_logit_copies > 0


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
