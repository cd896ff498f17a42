"""Paper Table 6: fine-tunes BERT 336M (configs/bert_336m.py) on SQuAD 2.0: batch 64, lr 3e-05, 2 epochs.

Table 6's layout is garbled in the reference copy; how it was read is stated beside ``TABLE6`` in
megajax/finetune.py (the one helper behind every finetune_<task>_<size>.py).

Command:  python train.py --config=configs/finetune_squad2_336m.py --workdir=WORKDIR --config.init_from=PRETRAINED \\
              --config.data.task_dir=DIR --config.data.tokenizer=vocab.txt
          (PRETRAINED: the configs/bert_336m.py run's workdir; DIR holds train-v2.0.json, dev-v2.0.json)
Expect:   the trainer logs validation loss and accuracy on the dev split (exact start and end for SQuAD windows);
          the paper reports SQuAD 2.0 F1/EM 88.1/84.8 (Table 5, median of 5 seeds);
          measure it: python eval.py --checkpoint=WORKDIR --task=squad2
"""

from megajax.finetune import table6_config


def get_config():
    return table6_config("squad2", "336m")
