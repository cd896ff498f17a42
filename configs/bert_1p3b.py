"""Paper Table 4: BERT 1.3B (24 layers, hidden 2048, 32 heads, 64 per head); the paper trained it on 256 GPUs.

Command:  python train.py --config=configs/bert_1p3b.py --config.data.source=indexed \\
              --config.data.path=PREFIX
Expect:   1.28B parameters; batch 1024, lr 1e-4, 10k warmup, linear decay over 2M iterations; held-out perplexity
          1.30 in the paper; fine-tuned MNLI 90.9/91.0, QQP 92.6, SQuAD 1.1 94.9/89.1, SQuAD 2.0 90.2/87.1, RACE 87.3.
"""

from megajax.config import bert_base_config


def get_config():
    c = bert_base_config()
    c.model.update(num_layers=24, hidden_size=2048, num_heads=32)
    c.mesh.model = 2  # whole heads per shard (the paper does not give it)
    return c
