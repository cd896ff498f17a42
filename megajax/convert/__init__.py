"""Checkpoint conversion between megajax and Hugging Face / Megatron-LM, GPT and BERT, and Hugging Face Llama (CLI:
``python -m megajax.convert``).

GPT: HF ``GPT2LMHeadModel`` (``hf_gpt2``), Megatron-LM legacy or Core names (``megatron_gpt``). BERT: HF
``BertForPreTraining`` (post-LN) and ``MegatronBertForPreTraining`` (pre-LN) (``hf_bert``), Megatron-LM legacy BERT
(``megatron_bert``). Llama: HF ``LlamaForCausalLM`` (``hf_llama``; its own parameter names, see
``megajax.models.llama``). ``hf_io`` picks the HF converter by model_type, ``hf_tensors`` reads a state dict for
them; ``megatron_files`` and
``megatron_checks`` serve both Megatron models.

Conversions work on full (unsharded) host numpy arrays of the megajax parameter tree:
``blocks/attn/qkv/kernel`` (L, H, heads, 3, head_dim), ``blocks/attn/out/kernel`` (L, heads, head_dim, H),
``blocks/mlp/up/kernel`` (L, H, 4H), ``blocks/mlp/down/kernel`` (L, 4H, H), LayerNorm ``scale``/``bias`` (L, H),
``wte/embedding`` (padded vocab, H), ``wpe`` (positions, H); BERT adds ``tte`` (token types, H), ``pooler``,
``mlm_dense``, ``mlm_ln``, ``mlm_bias`` (padded vocab) and ``sop`` (H -> 2).
"""
