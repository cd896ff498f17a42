"""Fine-tunes a bert_tiny-shaped classifier on the synthetic pair task (label: does segment A hold more words of
the upper half of the word list than segment B? a comparison across the two segments) on a CPU, through the same
trainer as pretraining.

Command:  python train.py --config=configs/finetune_tiny_pair.py --workdir=/tmp/ft_tiny_pair
          (optionally first pretrain python train.py --config=configs/bert_tiny.py --workdir=/tmp/bert_tiny and add
          --config.init_from=/tmp/bert_tiny: the trunk then starts from it, the classifier head fresh)
Expect:   see docs/results.md, finetune_tiny_pair (valid_accuracy on held-out rows well above the 0.5 of chance).
"""

from megajax.config import bert_base_config


def get_config():
    c = bert_base_config("bert_classifier")
    c.model.update(num_classes=2, vocab_size=8192, make_vocab_size_divisible_by=128,
                   num_layers=2, hidden_size=128, num_heads=4, max_seq_len=64, remat="none")
    c.data.update(source="task", task="synthetic_pair")
    c.train.update(steps=400, global_batch_size=32, log_every=50, eval_every=100, eval_batches=8)
    c.optimizer.update(lr=5e-4, min_lr=0.0, warmup_steps=40, decay="linear")
    c.checkpoint.update(every_steps=200)
    return c
