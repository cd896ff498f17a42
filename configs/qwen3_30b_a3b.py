"""Qwen3-30B-A3B (Qwen3-MoE): 48 layers, hidden 2048, 32 query heads of 128 sharing 4 key/value heads, each head's
queries and keys RMS-normalised, 128 SwiGLU experts of width 768 per layer with 8 routed per token (top-k
probabilities renormalised), vocabulary 151936, untied output, rope theta 1e6.

Command:  python train.py --config=configs/qwen3_30b_a3b.py --config.data.source=indexed --config.data.path=PREFIX
Expect:   30,532,122,624 parameters (the published count), about 3.3B active per token.
Plan:     one 8-GPU H100 host holds no plan in the 60 GiB per GPU JAX's allocator takes by default (16 bytes per
          parameter / 8 is 57 GiB with everything split); with XLA_PYTHON_CLIENT_MEM_FRACTION=.95
          --config.mesh.auto=True plans data 4 x model 2, 2 per micro-batch (128 steps), full recomputation, sequence
          parallelism, FSDP: 114 s/step, 13.0% MFU (predicted, not measured; the fitted dgx_h100). On 16 H100s at the
          default share: data 16, 4 per micro-batch (16 steps), full recomputation, FSDP: 42.0 s/step, 17.6% MFU (python
          -m megajax.scaling --config=qwen3_30b_a3b --gpus=16 --cluster=dgx_h100)
"""

from megajax.config import base_config
from megajax.models import moe


def get_config():
    c = base_config(moe.NAME)
    c.model.update(vocab_size=151936, num_layers=48, hidden_size=2048, num_heads=32, num_kv_heads=4,
                   kv_channels=128, qk_norm=True, num_experts=128, experts_per_token=8, moe_ffn_hidden_size=768,
                   ffn_hidden_size=6144, norm_topk_prob=True, router_aux_loss_coef=0.001, layernorm_eps=1e-6,
                   rope_theta=1e6, max_seq_len=4096)
    c.mesh.model = 4
    c.train.update(steps=500_000, global_batch_size=1024, micro_batch_size=1, precision="bf16")
    c.optimizer.update(lr=3e-4, min_lr=3e-5, warmup_steps=2000, b2=0.95, eps=1e-5, weight_decay=0.1)
    return c
