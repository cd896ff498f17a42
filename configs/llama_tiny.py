"""A 2-layer Llama (RMSNorm, rotary positions, SwiGLU, 4 query heads sharing 2 key/value heads, tied output) that
trains on a laptop CPU in a few minutes on the embedded default corpus (stdlib source).

Command:  python train.py --config=configs/llama_tiny.py --workdir=/tmp/llama_tiny
Expect:   0.89M parameters, ~5k tokens/s on a 2-core CPU (3 minutes); the loss falls from ~8.3 (log 4096) and the
          held-out valid_loss after 300 steps is ~4.8 nats, well below the corpus's unigram entropy (~6.6 nats,
          logged at start).
"""

from megajax.config import base_config
from megajax.models import llama


def get_config():
    c = base_config(llama.NAME)
    c.model.update(vocab_size=4096, num_layers=2, hidden_size=128, num_heads=4, num_kv_heads=2,
                   ffn_hidden_size=344, max_seq_len=128, tie_embeddings=True, remat="none")
    c.train.update(steps=300, global_batch_size=16, log_every=20)
    c.optimizer.update(lr=3e-3, min_lr=3e-4, warmup_steps=30)
    return c
