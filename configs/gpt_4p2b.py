"""Paper Table 1 (scaling set): 4.2B (64 layers, hidden 2304, 24 heads, 96 per head), 4-way model parallel.

Command:  python train.py --config=configs/gpt_4p2b.py
Expect:   4.20B parameters.
"""

from megajax.config import base_config


def get_config():
    c = base_config()
    c.model.update(num_layers=64, hidden_size=2304, num_heads=24)
    c.mesh.model = 4
    return c
