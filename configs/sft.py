"""Supervised fine-tuning of a decoder (a converted Llama, Mixtral or GPT-2, or a megajax pretraining run) on
prompt / completion or chat JSONL rows, packed with document masking, the loss on the completions only
(``megajax.data.sft``). The model's fields come from the ``init_from`` checkpoint (``model.name=init_from``):
only ``model.max_seq_len``, ``model.dropout`` and ``model.remat`` are set here. ``max_seq_len=0``: a row holds the
longest example, rounded up to a multiple of 128 (at most the checkpoint's length; a converted Llama 3.2 would
otherwise pack 131K-token rows).

Command:  python train.py --config=sft.py --config.init_from=CONVERTED --config.data.path=train.jsonl \\
              --config.data.tokenizer=CONVERTED_HF/ --workdir=runs/sft
          (then: python eval.py --checkpoint=runs/sft --task=sft --data=held_out.jsonl)
Expect:   the start record's sft_data counts the examples, packed rows, and rows cut or skipped, and gives
          max_seq_len beside longest_example and the chat template's file; the loss (a mean over the completions'
          tokens) falls; valid_loss on the file's last 5% of rows. A chat row is rendered with the chat template of
          data.tokenizer's folder (chat_template.jinja, else tokenizer_config.json's; else "role: content" lines).
          Rows longer than model.max_seq_len + 1 tokens are refused (data.sft_truncate=True cuts them).
"""

import ml_collections

from megajax.config import base_config
from megajax.config.resolve import FROM_INIT
from megajax.models import llama


def get_config():
    c = base_config(llama.NAME)  # the training sections; the model section is the checkpoint's
    c.model = ml_collections.ConfigDict(dict(name=FROM_INIT, max_seq_len=0, dropout=0.0, remat="selective"))
    c.data.update(source="sft", valid_fraction=0.05)
    c.train.update(steps=1000, global_batch_size=32, log_every=10, eval_every=100, eval_batches=4)
    c.optimizer.update(lr=2e-5, min_lr=2e-6, warmup_steps=30, weight_decay=0.0)
    c.checkpoint.update(every_steps=200)
    return c
