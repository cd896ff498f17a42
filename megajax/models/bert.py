"""BERT: word + position + token-type embeddings, the shared trunk under a padding mask, MLM and SOP heads.

``cfg.post_layernorm`` picks the architecture: False is Megatron's BERT (the paper's rearranged pre-LN blocks,
Figure 7b, with a final LayerNorm and no embedding LayerNorm; Hugging Face's ``MegatronBertForPreTraining``), True
the original BERT (post-LN blocks, an embedding LayerNorm, no final one; ``BertForPreTraining``).

The MLM output is tied to the vocab-parallel word embedding, plus a vocab-parallel bias, so the logits stay
sharded on the vocabulary and the loss reduces per-token scalars only. The pooler and the sentence-order head are
small replicated layers on the first token, as in Megatron.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from megajax.data import formats
from megajax.models import objectives
from megajax.models.spec import HeadMemory, ModelSpec, register, transformer_flops
from megajax.models.transformer import (
    Block,
    TransformerConfig,
    check_activation,
    make_blocks,
    padding_mask,
    run_blocks,
)
from megajax.parallel import pipeline
from megajax.parallel.layers import ACTIVATIONS, Dense, LayerNorm, VocabParallelEmbedding, dropout, make_param
from megajax.parallel.losses import mask_padded_vocab
from megajax.parallel.sharding import RESIDUAL, constrain, param_at_use

NUM_SOP_CLASSES = 2  # 0: A then B as in the document, 1: swapped


@dataclasses.dataclass(frozen=True, kw_only=True)
class BertConfig(TransformerConfig):
    """BERT's config: the trunk's fields with BERT-base's defaults (paper Section 4.2, following Devlin et al.),
    its LayerNorm order and its segment embeddings."""

    vocab_size: int = 30522
    max_seq_len: int = 512
    activation: str = "gelu"  # the exact erf (BERT, Hugging Face's gelu)
    layernorm_eps: float = 1e-12
    post_layernorm: bool = False  # False: the paper's rearranged pre-LN (Fig. 7b); True: the original BERT (Fig. 7a)
    num_token_types: int = 2  # sentence A / B

    def __post_init__(self):
        super().__post_init__()
        check_activation(self.activation)
        if isinstance(self.num_token_types, bool) or not isinstance(self.num_token_types, int) or \
                self.num_token_types < 1:
            raise ValueError(f"model.num_token_types={self.num_token_types!r}: BERT needs >= 1 (2 for sentence "
                             "pairs)")


class BERTEncoder(nnx.Module):
    """The part every BERT model shares: embeddings, the trunk under a padding mask, the final or embedding LN, and
    the pooler. Pretraining (``BERT``) and the task models (``megajax.models.heads``) add their heads to it, so a
    pretrained encoder's parameter paths are the same in every one of them. ``block_class``: its layer."""

    block_class: type[nnx.Module] = Block

    def __init__(self, cfg: BertConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        dt, h, std = cfg.compute_dtype, cfg.hidden_size, cfg.init_std
        self.wte = VocabParallelEmbedding(cfg.padded_vocab_size, h, std=std, dtype=dt, rngs=rngs)
        self.wpe = make_param(rngs, nnx.initializers.normal(std), (cfg.max_seq_len, h), ("position", "embed"))
        self.tte = make_param(rngs, nnx.initializers.normal(std), (cfg.num_token_types, h), ("token_type", "embed"))
        self.ln_emb = LayerNorm(h, eps=cfg.layernorm_eps, dtype=dt, rngs=rngs) if cfg.post_layernorm else None
        self.blocks = make_blocks(cfg, rngs, self.block_class)
        self.ln_f = None if cfg.post_layernorm else LayerNorm(h, eps=cfg.layernorm_eps, dtype=dt, rngs=rngs)
        self.pooler = Dense(h, (h,), ("embed", "embed_out"), std=std, dtype=dt, rngs=rngs)

    def encode(self, tokens: jax.Array, token_types: jax.Array | None = None, valid: jax.Array | None = None,
               *, dropout_key: jax.Array | None = None, word_rows: jax.Array | None = None,
               stack: pipeline.StackRunner = pipeline.run_stack) -> jax.Array:
        """The trunk's final hidden states (B, S, H); ``valid`` is the (B, S) 1/0 padding mask; ``word_rows``: the
        word embedding's ``replica_rows``, when the caller uses them again (the tied MLM output layer); ``stack``: how
        the pipelined layer stack runs (``transformer.run_blocks``)."""
        cfg = self.cfg
        b, s = tokens.shape
        if s > cfg.max_seq_len:
            raise ValueError(f"sequence length {s} exceeds model.max_seq_len={cfg.max_seq_len}")
        token_types = jnp.zeros_like(tokens) if token_types is None else token_types
        valid = jnp.ones_like(tokens) if valid is None else valid
        tokens = constrain(tokens, ("batch", "seq"))
        k_emb, k_layers = jax.random.split(dropout_key) if dropout_key is not None else (None, None)
        positions = constrain(param_at_use(self.wpe[...], ("position", "embed"))[:s], ("position", "embed"))
        # (B, S, H); under sequence parallelism the lookup's partial rows are reduce-scattered to (B, S/t, H)
        types = jnp.take(param_at_use(self.tte[...], ("token_type", "embed")), token_types, axis=0)
        x = self.wte(tokens, word_rows) + (positions + types).astype(cfg.compute_dtype)
        x = constrain(x, RESIDUAL)
        if self.ln_emb is not None:
            x = self.ln_emb(x)
        x = constrain(dropout(x, cfg.dropout, k_emb), RESIDUAL)
        x, _ = run_blocks(self.blocks, cfg, x, padding_mask(valid), k_layers, stack=stack)
        return x if self.ln_f is None else self.ln_f(x)

    def pool(self, x: jax.Array) -> jax.Array:
        """(B, S, H) -> (B, H): dense + tanh on the first ([CLS]) token (no dropout, as Megatron and HF)."""
        return jnp.tanh(self.pooler(x[:, 0]))


class BERT(BERTEncoder):
    """``(tokens, token_types, padding_mask) (B, S) -> (MLM logits (B, S, padded_vocab), SOP logits (B, 2))``."""

    def __init__(self, cfg: BertConfig, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        dt, h, std = cfg.compute_dtype, cfg.hidden_size, cfg.init_std
        self.act = ACTIVATIONS[cfg.activation]
        self.mlm_dense = Dense(h, (h,), ("embed", "embed_out"), std=std, dtype=dt, rngs=rngs)
        self.mlm_ln = LayerNorm(h, eps=cfg.layernorm_eps, dtype=dt, rngs=rngs)
        self.mlm_bias = make_param(rngs, nnx.initializers.zeros, (cfg.padded_vocab_size,), ("vocab",))
        self.sop = Dense(h, (NUM_SOP_CLASSES,), ("embed", "classes"), std=std, dtype=dt, rngs=rngs)

    def __call__(self, tokens: jax.Array, token_types: jax.Array | None = None, valid: jax.Array | None = None,
                 *, dropout_key: jax.Array | None = None, stack: pipeline.StackRunner = pipeline.run_stack
                 ) -> tuple[jax.Array, jax.Array]:
        """MLM logits (padded ids masked) and SOP logits; ``stack`` as ``encode``."""
        rows = self.wte.replica_rows(tokens.shape[0])  # one read for both uses: one gradient reduction
        x = self.encode(tokens, token_types, valid, dropout_key=dropout_key, word_rows=rows, stack=stack)
        return self.mlm_logits(x, rows), self.sop(self.pool(x))

    def mlm_logits(self, x: jax.Array, word_rows: jax.Array | None = None) -> jax.Array:
        """(B, S, H) -> (B, S, padded_vocab): dense, GeLU, LN, tied output + vocab-parallel bias."""
        y = self.mlm_ln(self.act(self.mlm_dense(x)))
        logits = self.wte.attend(y, word_rows) + param_at_use(self.mlm_bias[...], ("vocab",)).astype(y.dtype)
        return mask_padded_vocab(constrain(logits, ("batch", "seq", "vocab")), self.cfg.vocab_size)


def _bert_flops(cfg: BertConfig, rows: int, seq: int) -> float:
    """GPT's formula plus the MLM transform (an h x h dense at every position, 6 B s h^2 forward + backward; the
    pooler is negligible)."""
    return transformer_flops(rows, seq, cfg.num_layers, cfg.hidden_size, cfg.padded_vocab_size) + \
        6.0 * rows * seq * cfg.hidden_size**2


NAME = "bert"  # config.model.name

register(ModelSpec(
    name=NAME, config=BertConfig, module=BERT, objective=objectives.MLM_SOP, examples=formats.SENTENCE_PAIRS,
    flops=_bert_flops,
    # the MLM logits, their exponentials, their gradient and the biased logits; the MLM transform's dense, GeLU
    # and LayerNorm double the hidden tensors
    head_memory=HeadMemory(vocab_logit_copies=4, hidden_tensors=16),
    eval_tasks=("mlm",), pooled_heads=("pooler", "sop"), pooled_rows=1, sequence_rows=("wpe",),
    perplexity_of="mlm_loss"))
