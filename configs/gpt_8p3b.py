"""Paper Table 2: 8.3B (72 layers, hidden 3072, 24 heads, 128 per head), 8-way model parallel; 512 GPUs as 64x8.

Command:  python train.py --config=configs/gpt_8p3b.py
Expect:   8.32B parameters; WikiText-103 perplexity 10.81 and LAMBADA 66.51% after 300k iterations (paper Table 3).
"""

from megajax.config import base_config


def get_config():
    c = base_config()
    c.model.update(num_layers=72, hidden_size=3072, num_heads=24)
    c.mesh.model = 8
    return c
