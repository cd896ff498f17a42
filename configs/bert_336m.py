"""Paper Table 4: BERT 336M (24 layers, hidden 1024, 16 heads, 64 per head); the paper trained it on 128 GPUs.

Command:  python train.py --config=configs/bert_336m.py --config.data.source=indexed --config.data.path=PREFIX
          (PREFIX from ``python -m megajax.data.preprocess --split_sentences --tokenizer=bert-vocab.txt ...``)
Expect:   336M parameters; batch 1024 (set train.micro_batch_size for accumulation on fewer devices), lr 1e-4 with
          10k warmup and linear decay over 2M iterations; the paper reports a held-out perplexity of 1.58 and, after
          fine-tuning, MNLI 89.7/90.0, QQP 92.3, SQuAD 1.1 94.2/88.0, SQuAD 2.0 88.1/84.8, RACE 83.0 (Table 5).
"""

from megajax.config import bert_base_config


def get_config():
    c = bert_base_config()
    c.model.update(num_layers=24, hidden_size=1024, num_heads=16)
    return c
