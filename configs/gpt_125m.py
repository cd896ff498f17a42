"""GPT-2 small (12 layers, hidden 768, 12 heads): 125M parameters with the vocabulary padded to 51200.

Command:  python train.py --config=configs/gpt_125m.py --config.mesh.model=1
Expect:   125.2M parameters (python -m megajax.info --config=configs/gpt_125m.py).
"""

from megajax.config import base_config


def get_config():
    c = base_config()
    c.model.update(num_layers=12, hidden_size=768, num_heads=12)
    return c
