"""Paper Table 1 (scaling set): 4.2B (64 layers, hidden 2304, 24 heads, 96 per head), 4-way model parallel.

Command:  python train.py --config=configs/gpt_4p2b.py
Expect:   4.20B parameters.
Plan:     one 8-GPU H100 host: --config.mesh.auto=True plans it there (predicted, not measured; the fitted dgx_h100,
          each GPU's 60 GiB that JAX's allocator takes by default: data 4 x model 2, 64 per micro-batch (2 steps), full
          recomputation, sequence parallelism, ZeRO-1: 5.53 s/step, 32.3% MFU; python -m megajax.scaling
          --config=gpt_4p2b --gpus=8 --cluster=dgx_h100)
"""

from megajax.config import base_config


def get_config():
    c = base_config()
    c.model.update(num_layers=64, hidden_size=2304, num_heads=24)
    c.mesh.model = 4
    return c
