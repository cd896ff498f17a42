"""GPT-2: word + position embeddings, the shared trunk under a causal mask, a final LN and a tied output layer.

Parameter paths (``wte``, ``wpe``, ``blocks``, ``ln_f``) are those of every megajax GPT checkpoint. Registered as
``model.name=gpt``: next-token prediction on windows of a corpus.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from megajax.models.spec import decoder_spec, register, transformer_flops
from megajax.models.transformer import (
    Block,
    CausalDecoder,
    TransformerConfig,
    causal_mask,
    check_activation,
    make_blocks,
    run_blocks,
)
from megajax.parallel import pipeline
from megajax.parallel.layers import LayerNorm, VocabParallelEmbedding, dropout, make_param
from megajax.parallel.losses import mask_padded_vocab
from megajax.parallel.sharding import RESIDUAL, constrain, param_at_use


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig(TransformerConfig):
    """GPT's config: the trunk's fields (GPT-2 small's defaults) and its MLP's activation."""

    activation: str = "gelu_tanh"  # gelu_tanh (GPT-2, Megatron's fused bias-GeLU) | gelu (erf)

    def __post_init__(self):
        super().__post_init__()
        check_activation(self.activation)


class GPT(CausalDecoder):
    """GPT-2 language model: ``tokens (B, S) -> logits (B, S, padded_vocab)`` with padded ids masked. A variant
    with another layer subclasses it and names the layer's class (``block_class``); one with other stacks defines
    ``_make_layers`` and ``_run_layers``, as Llama's variants do."""

    block_class: type[nnx.Module] = Block

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        dt = cfg.compute_dtype
        self.wte = VocabParallelEmbedding(cfg.padded_vocab_size, cfg.hidden_size, std=cfg.init_std, dtype=dt,
                                          rngs=rngs)
        self.wpe = make_param(rngs, nnx.initializers.normal(cfg.init_std), (cfg.max_seq_len, cfg.hidden_size),
                              ("position", "embed"))
        self._make_layers(cfg, rngs)
        self.ln_f = LayerNorm(cfg.hidden_size, eps=cfg.layernorm_eps, dtype=dt, rngs=rngs)

    def _make_layers(self, cfg: GPTConfig, rngs: nnx.Rngs) -> None:
        """The layer stack: ``cfg.num_layers`` of ``block_class`` (``make_blocks``)."""
        self.blocks = make_blocks(cfg, rngs, self.block_class)

    def _run_layers(self, x: jax.Array, mask: jax.Array, dropout_key: jax.Array | None, cache, index,
                    stack: pipeline.StackRunner = pipeline.run_stack):
        """The layers over ``x``: their output and key/value cache (``run_blocks``)."""
        return run_blocks(self.blocks, self.cfg, x, mask, dropout_key, cache, index, stack=stack)

    def _forward(self, tokens, dropout_key, cache, index, documents=None, stack=pipeline.run_stack):
        cfg = self.cfg
        b, s = tokens.shape
        tokens = self._tokens(tokens)
        k_emb, k_layers = jax.random.split(dropout_key) if dropout_key is not None else (None, None)
        # Replicated rows: under sequence parallelism their gradient (rows follow the split sequence) is gathered
        # here, once, rather than left split for AdamW to update apart and gather three arrays.
        wpe = param_at_use(self.wpe[...], ("position", "embed"))
        if documents is None:
            positions = constrain(jax.lax.dynamic_slice_in_dim(wpe, index, s, axis=0), ("position", "embed"))
        else:  # each token's row of the table, at its position in its document: (B, S, H)
            positions = jnp.take(wpe, documents.positions, axis=0)
        # (B, S, H); under sequence parallelism the lookup's partial rows are reduce-scattered to (B, S/t, H)
        rows = self.wte.replica_rows(b)
        x = constrain(self.wte(tokens, rows) + positions.astype(cfg.compute_dtype), RESIDUAL)
        x = constrain(dropout(x, cfg.dropout, k_emb), RESIDUAL)
        kv_len = s if cache is None else cache[0].shape[2]
        # (1, 1, S, S_kv); packed rows: (B, 1, S, S), within each document
        mask = causal_mask(index + jnp.arange(s), kv_len) if documents is None else documents.mask()
        x, cache = self._run_layers(x, mask, k_layers, cache, index, stack)
        logits = self.wte.attend(self.ln_f(x), rows)  # (B, S, V_padded)
        return mask_padded_vocab(logits, cfg.vocab_size), cache


NAME = "gpt"  # config.model.name

# init_from: a converted GPT-2 (or another run's GPT) fine-tuned (SFT)
register(decoder_spec(NAME, GPTConfig, GPT, lambda cfg, rows, seq: transformer_flops(
    rows, seq, cfg.num_layers, cfg.hidden_size, cfg.padded_vocab_size), sequence_rows=("wpe",)))
