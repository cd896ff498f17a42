"""A 2-layer BERT (paper's pre-LN blocks, MLM + SOP) that trains on a CPU in minutes on the embedded default corpus
(the English prose shipped with Python: help topics and module docstrings, sentence-split, WordPiece 8192).

Command:  python train.py --config=configs/bert_tiny.py --workdir=/tmp/bert_tiny
Expect:   see the numbers measured in the README's BERT section (MLM loss falling from ~9 = log 8192, SOP accuracy
          on held-out pairs above chance).
"""

from megajax.config import bert_base_config


def get_config():
    c = bert_base_config()
    c.model.update(vocab_size=8192, make_vocab_size_divisible_by=128, num_layers=2, hidden_size=128, num_heads=4,
                   max_seq_len=128, remat="none")
    c.train.update(steps=300, global_batch_size=32, log_every=20, eval_every=100, eval_batches=4)
    c.optimizer.update(lr=1e-3, min_lr=1e-4, warmup_steps=30)
    return c
