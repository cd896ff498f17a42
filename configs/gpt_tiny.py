"""A 2-layer GPT that trains on a laptop CPU in seconds: the smoke test of the whole pipeline.

Command:  python train.py --config=configs/gpt_tiny.py
Expect:   ~0.4M parameters; the loss falls within the default steps on CPU.
"""

from megajax.config import base_config


def get_config():
    c = base_config()
    c.model.update(vocab_size=4096, make_vocab_size_divisible_by=128, num_layers=2, hidden_size=128, num_heads=4,
                   max_seq_len=128, remat="none")
    return c
