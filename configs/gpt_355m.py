"""Paper Table 2: 355M (24 layers, hidden 1024, 16 heads, 64 per head); the paper trained it on 64 GPUs.

Command:  python train.py --config=configs/gpt_355m.py --config.mesh.model=1
Expect:   356M parameters; WikiText-103 perplexity 19.31 and LAMBADA 45.18% after the paper's 300k iterations.
"""

from megajax.config import base_config


def get_config():
    c = base_config()
    c.model.update(num_layers=24, hidden_size=1024, num_heads=16)
    return c
