"""Moonlight-16B-A3B (Moonshot AI 2025, DeepSeek-V3's architecture): 27 layers (the first dense, SwiGLU 11264),
hidden 2048, 16 heads of multi-head latent attention (a full query projection, key/value latent 512, heads of 128
+ a shared rotary 64, values 128), 64 routed experts of width 1408 (6 per token, one group) beside 2 shared ones,
sigmoid routing scaled by 2.446, rope theta 50000, vocabulary 163840, untied output: a size people fine-tune on one
host.

Command:  python train.py --config=configs/moonlight_16b_a3b.py --config.data.source=indexed --config.data.path=PREFIX
Expect:   15,960,108,544 parameters as transformers counts DeepseekV3ForCausalLM (megajax holds 1,664 more: the 26
          routed layers' 64 correction biases, buffers there), 2,914,776,192 active per token (16B / 3B published).
"""

from megajax.config import base_config
from megajax.models import deepseek


def get_config():
    c = base_config(deepseek.NAME)
    c.model.update(vocab_size=163840, num_layers=27, hidden_size=2048, num_heads=16, ffn_hidden_size=11264,
                   q_lora_rank=0, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                   num_experts=64, experts_per_token=6, moe_ffn_hidden_size=1408, n_shared_experts=2, n_group=1,
                   topk_group=1, routed_scaling_factor=2.446, first_k_dense_replace=1, rope_scaling="none",
                   rope_theta=50000.0, layernorm_eps=1e-5, max_seq_len=8192)
    c.mesh.model = 4
    c.train.update(steps=100_000, global_batch_size=1024, micro_batch_size=1, precision="bf16")
    c.optimizer.update(lr=3e-4, min_lr=3e-5, warmup_steps=2000, b2=0.95, eps=1e-8, weight_decay=0.1)
    return c
