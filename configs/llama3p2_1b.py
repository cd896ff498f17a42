"""Llama 3.2 1B: 16 layers, hidden 2048, 32 query heads sharing 8 key/value heads, SwiGLU 8192, vocabulary 128256,
output tied to the embedding, rope theta 500000 with Llama 3's frequency scaling (factor 32, original 8192).

Command:  python train.py --config=configs/llama3p2_1b.py --config.data.source=indexed --config.data.path=PREFIX
Expect:   1,235,814,400 parameters (the published count). Windows of 8192 tokens; the released model reads up to
          131072 (--config.model.max_seq_len=131072 changes no parameter, positions are rotary).
Plan:     one 8-GPU H100 host: --config.mesh.auto=True plans it there (predicted, not measured; the fitted dgx_h100,
          each GPU's 60 GiB that JAX's allocator takes by default: data 4 x model 2, 4 per micro-batch (32 steps), no
          recomputation, sequence parallelism, FSDP: 15.9 s/step, 35.4% MFU; python -m megajax.scaling
          --config=llama3p2_1b --gpus=8 --cluster=dgx_h100). With --config.train.precision=fp8 the same plan: 14.8
          s/step, 38.2% of the bf16 peak. Its model card states no training cluster.
"""

from megajax.config import base_config
from megajax.models import llama


def get_config():
    c = base_config(llama.NAME)
    c.model.update(vocab_size=128256, num_layers=16, hidden_size=2048, num_heads=32,
                   num_kv_heads=8, ffn_hidden_size=8192, max_seq_len=8192, tie_embeddings=True,
                   rope_theta=500000.0, rope_scaling="llama3", rope_factor=32.0,
                   rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                   rope_original_max_len=8192)
    c.mesh.model = 8
    c.train.update(steps=500_000, global_batch_size=512, precision="bf16")
    c.optimizer.update(lr=3e-4, min_lr=3e-5, warmup_steps=2000, b2=0.95, eps=1e-5, weight_decay=0.1)
    return c
