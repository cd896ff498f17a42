"""Llama 3 8B (Dubey et al. 2024): 32 layers, hidden 4096, 32 query heads sharing 8 key/value heads, SwiGLU
14336, vocabulary 128256, untied output, rope theta 500000, 8192 positions.

Command:  python train.py --config=configs/llama3_8b.py --config.data.source=indexed --config.data.path=PREFIX
Expect:   8,030,261,248 parameters (the published count); on mesh.model=8 each GPU holds one key/value head.
Plan:     one 8-GPU H100 host: --config.mesh.auto=True plans it there (predicted, not measured; the fitted dgx_h100,
          each GPU's 60 GiB that JAX's allocator takes by default: data 2 x model 4, 4 per micro-batch (64 steps),
          save_dots, sequence parallelism, FSDP: 63.2 s/step, 48.6% MFU; python -m megajax.scaling --config=llama3_8b
          --gpus=8 --cluster=dgx_h100). With --config.train.precision=fp8: data 8, 4 per micro-batch (16 steps), full
          recomputation, FSDP: 53.1 s/step, 572 TFLOP/s per GPU, 57.9% of the bf16 peak. The Llama 3 paper states its
          cluster for the 405B model only.
"""

from megajax.config import base_config
from megajax.models import llama


def get_config():
    c = base_config(llama.NAME)
    c.model.update(vocab_size=128256, num_kv_heads=8, ffn_hidden_size=14336, rope_theta=500000.0,
                   max_seq_len=8192)
    c.mesh.model = 8
    c.train.update(steps=500_000, global_batch_size=512, precision="bf16")  # 4M tokens per step
    c.optimizer.update(lr=3e-4, min_lr=3e-5, warmup_steps=2000, b2=0.95, eps=1e-5, weight_decay=0.1)
    return c
