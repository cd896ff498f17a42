"""Paper Table 6: fine-tunes BERT 1.3B (configs/bert_1p3b.py) on SQuAD 2.0: batch 64, lr 3e-05, 2 epochs.

Table 6's layout is garbled in the reference copy; how it was read is stated beside ``TABLE6`` in
megajax/finetune.py (the one helper behind every finetune_<task>_<size>.py).

Command:  python train.py --config=configs/finetune_squad2_1p3b.py --workdir=WORKDIR --config.init_from=PRETRAINED \\
              --config.data.task_dir=DIR --config.data.tokenizer=vocab.txt
          (PRETRAINED: the configs/bert_1p3b.py run's workdir; DIR holds train-v2.0.json, dev-v2.0.json)
Expect:   the trainer logs validation loss and accuracy on the dev split (exact start and end for SQuAD windows);
          the paper reports SQuAD 2.0 F1/EM 90.2/87.1 (Table 5, median of 5 seeds);
          measure it: python eval.py --checkpoint=WORKDIR --task=squad2
"""

from megajax.finetune import table6_config


def get_config():
    return table6_config("squad2", "1p3b")
