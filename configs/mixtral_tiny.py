"""A 2-layer Mixtral-style mixture of experts (4 experts of width 128, top-2, 4 query heads sharing 2 key/value
heads, tied output) that trains on a laptop CPU in a few minutes on the embedded default corpus.

Command:  python train.py --config=configs/mixtral_tiny.py --workdir=/tmp/mixtral_tiny
Expect:   the loss falls from ~8.3 (log 4096); lm_loss, balance_loss (2.0 when the load is even: top-2), z_loss,
          expert_load (max / mean assignments per expert, 1.0 when even) and dropped_fraction are logged each step.
"""

from megajax.config import base_config
from megajax.models import moe


def get_config():
    c = base_config(moe.NAME)
    c.model.update(vocab_size=4096, num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2, max_seq_len=128,
                   num_experts=4, experts_per_token=2, moe_ffn_hidden_size=128, ffn_hidden_size=128,
                   tie_embeddings=True, remat="none", rope_theta=10000.0)
    c.train.update(steps=300, global_batch_size=16, log_every=20)
    c.optimizer.update(lr=3e-3, min_lr=3e-4, warmup_steps=30)
    return c
