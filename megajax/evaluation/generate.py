"""Sampling from a (sharded) GPT with a key/value cache: greedy, temperature, top-k and top-p."""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from megajax.parallel.sharding import ParallelContext, Rules, activate, batch_shards


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How each new token is picked: the argmax when ``greedy`` or ``temperature == 0``; otherwise a sample from
    softmax(logits / temperature) restricted to the ``top_k`` most likely ids (0: all) and to the smallest set
    whose probability reaches ``top_p`` (1.0: all). Checked when built, so bad flags fail before compiling."""

    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self):
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"--temperature={self.temperature}: must be >= 0 (0 means greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"--top_p={self.top_p}: must be in (0, 1] (1 turns top-p off)")
        if self.top_k < 0:
            raise ValueError(f"--top_k={self.top_k}: must be >= 0 (0 turns top-k off)")

    @property
    def is_greedy(self) -> bool:
        return self.greedy or self.temperature == 0


def check_generation(sampling: Sampling, prompt_len: int, max_new_tokens: int, max_seq_len: int,
                     vocab_size: int) -> None:
    """Raises when a request cannot run on a model with this max_seq_len and vocab_size."""
    if max_new_tokens < 0:
        raise ValueError(f"--max_new_tokens={max_new_tokens}: must be >= 0")
    if prompt_len + max_new_tokens > max_seq_len:
        raise ValueError(f"the prompt ({prompt_len} tokens) + --max_new_tokens={max_new_tokens} exceeds the model's "
                         f"max_seq_len={max_seq_len}; shorten one of them")
    if sampling.top_k > vocab_size:
        raise ValueError(f"--top_k={sampling.top_k}: more than the model's vocab_size={vocab_size}")


def sample_logits(logits: jax.Array, key: jax.Array, s: Sampling) -> jax.Array:
    """(B, V) logits -> (B,) token ids."""
    logits = logits.astype(jnp.float32)
    if s.is_greedy:
        return jnp.argmax(logits, axis=-1)
    logits = logits / s.temperature
    if s.top_k:
        kth = jax.lax.top_k(logits, s.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if s.top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        drop_sorted = jnp.cumsum(probs, axis=-1) - probs > s.top_p  # keep the smallest set reaching top_p
        drop = jnp.zeros_like(drop_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(drop_sorted)
        logits = jnp.where(drop, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1)


# Module-level jitted steps (graphdef, parallel context and shapes static) so that repeated calls, one per lm-eval
# batch, reuse the compiled programs instead of tracing new closures each time. The context is static only to key
# the cache: the traced model reads it from ``activate``.
@functools.partial(jax.jit, static_argnums=(0, 1, 4))
def _prefill(graphdef, context, state, tokens, total):
    m = nnx.merge(graphdef, state)
    logits, cache = m.decode(tokens, m.init_cache(tokens.shape[0], total), 0)
    return logits[:, -1], cache


@functools.partial(jax.jit, static_argnums=(0, 1))
def _step(graphdef, context, state, token, cache, index):
    logits, cache = nnx.merge(graphdef, state).decode(token[:, None], cache, index)
    return logits[:, -1], cache


@functools.partial(jax.jit, static_argnums=(0, 1))
def _full(graphdef, context, state, tokens, length):  # no cache: recompute everything, read the logits at length - 1
    logits = nnx.merge(graphdef, state)(tokens)
    return jax.lax.dynamic_index_in_dim(logits, length - 1, axis=1, keepdims=False)


_pick = jax.jit(sample_logits, static_argnums=2)


def generate(model: nnx.Module, mesh: jax.sharding.Mesh, rules: Rules, prompt: np.ndarray, max_new_tokens: int,
             sampling: Sampling = Sampling(), *, seed: int = 0, use_cache: bool = True,
             on_token: Callable[[np.ndarray], None] | None = None,
             stop: Callable[[np.ndarray], bool] | None = None) -> np.ndarray:
    """Extends ``prompt`` (B, P) by ``max_new_tokens`` sampled tokens; returns (B, P + max_new_tokens).

    With the cache each new token costs one single-position forward; without it the whole sequence is recomputed
    (the reference the tests compare against). ``on_token`` receives each new (B,) column as it is sampled.
    ``stop`` receives the (B, P + n) tokens after each new one; when it returns True generation ends there and
    those tokens are returned (lm-eval's stop strings).
    """
    b, p = prompt.shape
    check_generation(sampling, p, max_new_tokens, model.cfg.max_seq_len, model.cfg.vocab_size)
    if short := -b % batch_shards(mesh, rules):  # rows split over the batch's shards: repeat the last, drop after
        padded = np.concatenate([prompt, np.repeat(prompt[-1:], short, axis=0)])
        return generate(model, mesh, rules, padded, max_new_tokens, sampling, seed=seed, use_cache=use_cache,
                        on_token=on_token and (lambda column: on_token(column[:b])),
                        stop=stop and (lambda tokens: stop(tokens[:b])))[:b]
    total = p + max_new_tokens
    graphdef, state = nnx.split(model)
    key = jax.random.key(seed)
    out = np.zeros((b, total), np.int32)
    out[:, :p] = prompt
    context = ParallelContext(rules)  # the rules alone: no FSDP gather, no pipeline settings
    with activate(mesh, context):
        if use_cache:
            logits, cache = _prefill(graphdef, context, state, jnp.asarray(prompt), total)
        for i in range(p, total):
            if not use_cache:
                logits = _full(graphdef, context, state, jnp.asarray(out), i)
            token = _pick(logits, jax.random.fold_in(key, i), sampling)
            out[:, i] = np.asarray(token)
            if on_token:
                on_token(out[:, i])
            if stop and stop(out[:, :i + 1]):
                return out[:, :i + 1]
            if use_cache and i + 1 < total:
                logits, cache = _step(graphdef, context, state, token, cache, i)
    return out
