"""Paper Table 6: fine-tunes BERT 336M (configs/bert_336m.py) on MNLI: batch 128, lr 1e-05, 10 epochs.

Table 6's layout is garbled in the reference copy; how it was read is stated beside ``TABLE6`` in
megajax/finetune.py (the one helper behind every finetune_<task>_<size>.py).

Command:  python train.py --config=configs/finetune_mnli_336m.py --workdir=WORKDIR --config.init_from=PRETRAINED \\
              --config.data.task_dir=DIR --config.data.tokenizer=vocab.txt
          (PRETRAINED: the configs/bert_336m.py run's workdir; DIR holds train.tsv, dev_matched.tsv)
Expect:   the trainer logs validation loss and accuracy on the dev split (exact start and end for SQuAD windows);
          the paper reports MNLI m/mm accuracy 89.7/90.0 (Table 5, median of 5 seeds);
          measure it: python eval.py --checkpoint=WORKDIR --task=mnli
"""

from megajax.finetune import table6_config


def get_config():
    return table6_config("mnli", "336m")
