"""Mixtral 8x7B (Jiang et al. 2024): 32 layers, hidden 4096, 32 query heads sharing 8 key/value heads, 8 SwiGLU
experts of width 14336 per layer with 2 routed per token, vocabulary 32000, untied output, rope theta 1e6.

Command:  python train.py --config=configs/mixtral_8x7b.py --config.data.source=indexed --config.data.path=PREFIX
Expect:   46,702,792,704 parameters, 12,879,925,248 active per token (the published counts).
Plan:     python -m megajax.scaling --config=mixtral_8x7b --gpus=64 --cluster=dgx_h100 (predicted, not measured; each
          GPU's 60 GiB that JAX's allocator takes by default: pipe 32 x data 2, GPipe over 512 microbatches, full
          recomputation, ZeRO-1, 15.0 s per step; with this config's micro-batch of 1, data 16 x expert 4, save_dots,
          FSDP, 33.6 s; docs/parallelism.md). One 8-GPU H100 host holds no plan (16 bytes per parameter / 8 is 93 GB
          with everything split): mesh.auto says so.
"""

from megajax.config import base_config
from megajax.models import moe


def get_config():
    c = base_config(moe.NAME)  # MoEConfig's defaults are Mixtral 8x7B's
    c.model.update(max_seq_len=4096)
    c.mesh.model = 8
    c.train.update(steps=500_000, global_batch_size=1024, micro_batch_size=1, precision="bf16")
    c.optimizer.update(lr=3e-4, min_lr=3e-5, warmup_steps=2000, b2=0.95, eps=1e-5, weight_decay=0.1)
    return c
