"""Paper Table 1 (scaling set): 8.3B with 32 heads (96 per head), 8-way model parallel.

Command:  python train.py --config=configs/gpt_8p3b_scaling.py
Expect:   8.32B parameters; the paper measured 77% weak-scaling efficiency at 8-way model parallelism.
"""

from megajax.config import base_config


def get_config():
    c = base_config()
    c.model.update(num_layers=72, hidden_size=3072, num_heads=32)
    c.mesh.model = 8
    return c
