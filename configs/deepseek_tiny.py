"""A 3-layer DeepSeek-V3-style decoder (the first layer dense; multi-head latent attention with a query latent; 8
routed experts of width 64 in 4 groups, top-2 of the best 2 groups, beside a shared expert) that trains on a laptop
CPU in a few minutes on the embedded default corpus, balanced by the correction biases alone (no balancing loss).

Command:  python train.py --config=configs/deepseek_tiny.py --workdir=/tmp/deepseek_tiny
Expect:   1,221,808 parameters (926,896 active); the loss falls from ~8.3 (log 4096), valid_loss ~4.8 after 300
          steps (unigram entropy 6.57); lm_loss, expert_load (max / mean assignments per expert, 1.0 when even),
          balance_loss and sequence_balance_loss (logged, weighted 0) each log. expert_load falls from ~3.5 to
          ~1.4 by step 300; with --config.model.bias_update_speed=0 it stays ~3.4 (docs/results.md).
"""

from megajax.config import base_config
from megajax.models import deepseek


def get_config():
    c = base_config(deepseek.NAME)
    c.model.update(vocab_size=4096, num_layers=3, hidden_size=128, num_heads=4, ffn_hidden_size=256, q_lora_rank=64,
                   kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, num_experts=8,
                   experts_per_token=2, n_group=4, topk_group=2, moe_ffn_hidden_size=64, n_shared_experts=1,
                   first_k_dense_replace=1, max_seq_len=128, rope_scaling="none", tie_embeddings=True,
                   remat="none", seq_aux_loss_coef=0.0, bias_update_speed=0.001)
    c.train.update(steps=300, global_batch_size=16, log_every=20)
    c.optimizer.update(lr=3e-3, min_lr=3e-4, warmup_steps=30)
    return c
