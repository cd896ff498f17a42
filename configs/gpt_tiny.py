"""A 2-layer GPT that trains on a laptop CPU in about a minute on the embedded default corpus (stdlib source).

Command:  python train.py --config=configs/gpt_tiny.py --workdir=/tmp/tiny
Expect:   0.94M parameters, ~10k tokens/s on a 2-core CPU; the loss falls from ~8.3 (log 4096) and the held-out
          valid_loss after 300 steps is ~5.5 nats, well below the corpus's unigram entropy (~6.6 nats, logged at start).
"""

from megajax.config import base_config


def get_config():
    c = base_config()
    c.model.update(vocab_size=4096, make_vocab_size_divisible_by=128, num_layers=2, hidden_size=128, num_heads=4,
                   max_seq_len=128, remat="none")
    c.train.update(steps=300, global_batch_size=16, log_every=20)
    c.optimizer.update(lr=3e-3, min_lr=3e-4, warmup_steps=30)
    return c
