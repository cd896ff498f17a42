"""BERT task models: the shared ``BERTEncoder`` plus one small replicated head each (fine-tuning, paper Table 5).

Each subclasses the encoder, so a pretrained BERT's trunk parameters (wte, wpe, tte, ln_emb / ln_f, blocks,
pooler) sit at the same paths and load by name (``megajax.training.finetune.load_trunk``). Heads read the replicated
hidden state and write a small replicated output: no communication, as in Megatron. They are initialised as the
paper's BERT heads: normal(init_std = 0.02) kernels, zero biases (``Dense``).
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from megajax.data.tasks.race import NUM_OPTIONS
from megajax.models import objectives
from megajax.models.bert import BertConfig, BERTEncoder
from megajax.models.spec import HeadMemory, ModelSpec, register, transformer_flops
from megajax.parallel import pipeline
from megajax.parallel.layers import Dense, dropout
from megajax.parallel.sharding import constrain

NUM_SPAN_LOGITS = 2  # start, end


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClassifierConfig(BertConfig):
    """The classifier's config: BERT's and the number of classes (MNLI 3, QQP 2)."""

    num_classes: int = 2

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.num_classes, bool) or not isinstance(self.num_classes, int) or self.num_classes < 2:
            raise ValueError(f"model.num_classes={self.num_classes!r}: a classifier needs >= 2 classes")


def _keys(key: jax.Array | None) -> tuple[jax.Array | None, jax.Array | None]:
    """(trunk key, head key), or (None, None) without dropout."""
    return tuple(jax.random.split(key)) if key is not None else (None, None)


class BERTClassifier(BERTEncoder):
    """``(tokens, token_types, padding_mask) (B, S) -> logits (B, num_classes)``: dropout then a dense layer on
    the pooled first token (MNLI: 3 classes, QQP: 2)."""

    def __init__(self, cfg: ClassifierConfig, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        self.classifier = Dense(cfg.hidden_size, (cfg.num_classes,), ("embed", "classes"), std=cfg.init_std,
                                dtype=cfg.compute_dtype, rngs=rngs)

    def __call__(self, tokens: jax.Array, token_types: jax.Array | None = None, valid: jax.Array | None = None,
                 *, dropout_key: jax.Array | None = None,
                 stack: pipeline.StackRunner = pipeline.run_stack) -> jax.Array:
        k_trunk, k_head = _keys(dropout_key)
        pooled = self.pool(self.encode(tokens, token_types, valid, dropout_key=k_trunk, stack=stack))  # (B, H)
        logits = self.classifier(dropout(pooled, self.cfg.dropout, k_head))
        return constrain(logits, ("batch", "classes"))


class BERTMultipleChoice(BERTEncoder):
    """``(tokens, token_types, padding_mask) (B, C, S) -> logits (B, C)``: each option is its own row through the
    encoder, and one shared head scores its pooled vector (RACE: C = 4)."""

    def __init__(self, cfg: BertConfig, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        self.scorer = Dense(cfg.hidden_size, (1,), ("embed", "classes"), std=cfg.init_std, dtype=cfg.compute_dtype,
                            rngs=rngs)

    def __call__(self, tokens: jax.Array, token_types: jax.Array | None = None, valid: jax.Array | None = None,
                 *, dropout_key: jax.Array | None = None,
                 stack: pipeline.StackRunner = pipeline.run_stack) -> jax.Array:
        b, c, s = tokens.shape
        flat = lambda x: None if x is None else x.reshape(b * c, s)  # noqa: E731 - (B, C, S) -> (B*C, S)
        k_trunk, k_head = _keys(dropout_key)
        pooled = self.pool(self.encode(flat(tokens), flat(token_types), flat(valid), dropout_key=k_trunk,
                                           stack=stack))
        scores = self.scorer(dropout(pooled, self.cfg.dropout, k_head))  # (B*C, 1)
        return constrain(scores.reshape(b, c), ("batch", "classes"))


class BERTSpan(BERTEncoder):
    """``(tokens, token_types, padding_mask) (B, S) -> (start logits, end logits)``, each (B, S): a dense h -> 2 on
    every position of the sequence output (SQuAD; no dropout before it, as BERT's run_squad)."""

    def __init__(self, cfg: BertConfig, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        self.span = Dense(cfg.hidden_size, (NUM_SPAN_LOGITS,), ("embed", "classes"), std=cfg.init_std,
                          dtype=cfg.compute_dtype, rngs=rngs)

    def __call__(self, tokens: jax.Array, token_types: jax.Array | None = None, valid: jax.Array | None = None,
                 *, dropout_key: jax.Array | None = None,
                 stack: pipeline.StackRunner = pipeline.run_stack) -> tuple[jax.Array, jax.Array]:
        x = self.encode(tokens, token_types, valid, dropout_key=dropout_key, stack=stack)  # (B, S, H)
        logits = constrain(self.span(x), ("batch", "seq", "classes"))  # (B, S, 2)
        return logits[..., 0], logits[..., 1]


def _trunk_flops(cfg: BertConfig, rows: int, seq: int) -> float:
    """The trunk only: the task heads are negligible beside it and there is no output layer over the vocabulary."""
    return transformer_flops(rows, seq, cfg.num_layers, cfg.hidden_size, 0)


def _task_model(name: str, module: type[BERTEncoder], objective: objectives.Objective, tasks: tuple[str, ...],
                eval_tasks: tuple[str, ...], head: str, pooled_rows: int, rows: int = 1,
                config: type[BertConfig] = BertConfig) -> ModelSpec:
    """A fine-tuning model: the BERT trunk (loaded from a pretraining checkpoint by ``init_from``) and ``head``."""
    return register(ModelSpec(
        name=name, config=config, module=module, objective=objective, flops=_trunk_flops,
        head_memory=HeadMemory(vocab_logit_copies=0, hidden_tensors=8), tasks=tasks, eval_tasks=eval_tasks,
        rows_per_example=rows, pooled_heads=("pooler", head) if pooled_rows else ("pooler",), pooled_rows=pooled_rows,
        sequence_rows=("wpe",), pretrained_trunk=BERTEncoder))


_task_model("bert_classifier", BERTClassifier, objectives.CLASSIFY, ("mnli", "qqp", "synthetic_pair"),
            ("mnli", "qqp"), head="classifier", pooled_rows=1, config=ClassifierConfig)
_task_model("bert_multiple_choice", BERTMultipleChoice, objectives.CHOOSE, ("race", "synthetic_choice"), ("race",),
            head="scorer", pooled_rows=NUM_OPTIONS, rows=NUM_OPTIONS)
_task_model("bert_span", BERTSpan, objectives.SPAN, ("squad1", "squad2", "synthetic_span"), ("squad1", "squad2"),
            head="span", pooled_rows=0)  # every position's hidden state, no pooled token
