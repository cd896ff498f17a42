"""Llama 2 7B (Touvron et al. 2023): 32 layers, hidden 4096, 32 heads (multi-head attention), SwiGLU 11008,
vocabulary 32000, untied output, 4096 positions; the paper's optimizer settings.

Command:  python train.py --config=configs/llama2_7b.py --config.data.source=indexed --config.data.path=PREFIX
Expect:   6,738,415,616 parameters (the published count); mesh.model=8 puts 4 heads on each GPU of a node.
          From Hugging Face weights: python -m megajax.convert hf-to-megajax --hf=DIR --output=OUT, then
          --config.init_from=OUT (README.md, "Llama").
Plan:     one 8-GPU H100 host: --config.mesh.auto=True plans it there (predicted, not measured; the fitted dgx_h100,
          each GPU's 60 GiB that JAX's allocator takes by default: data 2 x model 4, 8 per micro-batch (64 steps),
          save_dots, sequence parallelism, ZeRO-1: 48.0 s/step, 50.9% MFU; python -m megajax.scaling --config=llama2_7b
          --gpus=8 --cluster=dgx_h100)
"""

from megajax.config import base_config
from megajax.models import llama


def get_config():
    c = base_config(llama.NAME)
    c.mesh.model = 8
    c.train.update(steps=500_000, global_batch_size=1024, precision="bf16")  # 4M tokens per step
    c.optimizer.update(lr=3e-4, min_lr=3e-5, warmup_steps=2000, b2=0.95, eps=1e-5, weight_decay=0.1)
    return c
