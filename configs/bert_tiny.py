"""A 2-layer BERT (paper's pre-LN blocks, MLM + SOP) that trains on a CPU on the embedded default corpus (the
English prose shipped with Python: help topics and module docstrings, sentence-split, WordPiece 8192; 10% of the
documents held out).

Command:  python train.py --config=configs/bert_tiny.py --workdir=/tmp/bert_tiny
Expect:   about 1 s per step on an idle 2-core CPU (35 minutes for the 2000 steps). MLM loss from 9.0 (log 8192)
          to about 5.1-5.4 on the training batches (40% lower from about step 1000); held-out every 250 steps
          (640 sentence pairs): MLM about 5.8, SOP accuracy 0.54-0.59 from step 750 (chance 0.5). docs/results.md has
          the measured curve.
"""

from megajax.config import bert_base_config


def get_config():
    c = bert_base_config()
    # 64-token pairs, batch 64: BERT's loss sits at the unigram entropy (~6.0) until attention learns positions,
    # which takes ~1000 steps at this size; shorter rows make those steps cheap.
    c.model.update(vocab_size=8192, make_vocab_size_divisible_by=128, num_layers=2, hidden_size=128, num_heads=4,
                   max_seq_len=64, remat="none")
    c.train.update(steps=2000, global_batch_size=64, log_every=50, eval_every=250, eval_batches=10)
    c.optimizer.update(lr=2e-3, min_lr=1e-4, warmup_steps=100)
    c.data.valid_fraction = 0.1  # more held-out pairs than the paper's 1/30: SOP accuracy to about +-2%
    return c
