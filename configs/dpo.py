"""Direct preference optimisation (Rafailov et al. 2023) of a decoder after SFT (a converted Llama, an SFT run):
prompt / chosen / rejected JSONL pairs, each pair's two completions packed side by side in a row
(``megajax.data.preference``), TRL's losses and metrics (``megajax.models.preference``). The model's fields come from
the ``init_from`` checkpoint (``model.name=init_from``), which is also the frozen reference unless
``dpo.reference`` names another; its log-probabilities of every pair are computed once before the first step
(``megajax.training.preference``: one model on the devices, a forward pass over the file at each start).

Command:  python train.py --config=dpo.py --config.init_from=SFT_RUN --config.data.path=pairs.jsonl \\
              --config.data.tokenizer=CONVERTED_HF/tokenizer.json --workdir=runs/dpo
          (then: python eval.py --task=dpo --checkpoint=runs/dpo --reference=SFT_RUN --data=held_out.jsonl
           --output=dpo.json)
Expect:   the start record's preference_data counts the pairs, rows and what was cut or skipped; at step 0 the loss
          is log 2 = 0.693 and every reward 0 up to rounding (the policy is the reference, but its log-probabilities
          and the reference's come from two programs: in fp32 a reward can be ~1e-8, and rewards/accuracies, which
          counts chosen > rejected as TRL does, can count such a pair); the loss falls and
          rewards/accuracies and rewards/margins rise; valid_loss on the file's last 5% of pairs. dpo.loss=ipo or
          hinge, dpo.beta (0.1), dpo.label_smoothing (sigmoid only) as TRL names them.
"""

import ml_collections

from megajax.config import base_config
from megajax.config.resolve import FROM_INIT
from megajax.models import llama


def get_config():
    c = base_config(llama.NAME)  # the training sections; the model section is the checkpoint's
    c.model = ml_collections.ConfigDict(dict(name=FROM_INIT, max_seq_len=0, dropout=0.0, remat="selective"))
    c.data.update(source="preference", valid_fraction=0.05, pairs_per_row=1)
    c.dpo.update(beta=0.1, loss="sigmoid", label_smoothing=0.0, reference="")
    c.train.update(steps=1000, global_batch_size=32, log_every=10, eval_every=100, eval_batches=4)
    c.optimizer.update(lr=5e-7, min_lr=5e-8, warmup_steps=100, weight_decay=0.0)  # TRL's DPO learning rate
    c.checkpoint.update(every_steps=200)
    return c
