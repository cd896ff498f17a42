"""Paper Table 4: BERT 3.9B (48 layers, hidden 2560, 40 heads, 64 per head); the paper trained it on 512 GPUs.

Command:  python train.py --config=configs/bert_3p9b.py --config.data.source=indexed \\
              --config.data.path=PREFIX
Expect:   3.87B parameters; batch 1024, lr 1e-4, 10k warmup, linear decay over 1.5M iterations (as the paper);
          held-out perplexity 1.16; fine-tuned MNLI 91.4/91.4, QQP 92.7, SQuAD 1.1 95.5/90.0, SQuAD 2.0 91.2/88.5,
          RACE 89.5 (Table 5).
"""

from megajax.config import bert_base_config


def get_config():
    c = bert_base_config()
    c.model.update(num_layers=48, hidden_size=2560, num_heads=40)
    c.mesh.model = 8  # whole heads per shard on an 8-GPU node (the paper does not give it)
    c.train.steps = 1_500_000
    return c
