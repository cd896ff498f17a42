"""Checkpoint conversion between megajax and Hugging Face GPT-2 / Megatron-LM (CLI: ``python -m megajax.convert``).

Conversions work on full (unsharded) host numpy arrays of the megajax parameter tree:
``blocks/attn/qkv/kernel`` (L, H, heads, 3, head_dim), ``blocks/attn/out/kernel`` (L, heads, head_dim, H),
``blocks/mlp/up/kernel`` (L, H, 4H), ``blocks/mlp/down/kernel`` (L, 4H, H), LayerNorm ``scale``/``bias`` (L, H),
``wte/embedding`` (padded vocab, H), ``wpe`` (positions, H).
"""
