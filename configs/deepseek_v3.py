"""DeepSeek-V3 (DeepSeek-AI 2024): 61 layers (the first 3 dense), hidden 7168, 128 heads of multi-head latent
attention (query latent 1536, key/value latent 512, heads of 128 + a shared rotary 64, values 128), 256 routed
experts of width 2048 in 8 groups (a token's 8 from its best 4 groups) beside one shared expert, sigmoid routing with
auxiliary-loss-free balancing (bias update 0.001) and the sequence-wise balance loss (alpha 0.0001), YaRN (factor
40 over 4096), vocabulary 129280, untied output. Multi-token prediction is off here; DeepSeek-V3 trained with one
depth (--config.model.mtp_depth=1, its loss weighted 0.3 for the first 10T tokens, then 0.1: model.mtp_loss_weight).

Command:  python train.py --config=configs/deepseek_v3.py --config.data.source=indexed --config.data.path=PREFIX
Expect:   671,026,404,352 parameters without the MTP layer, as transformers counts DeepseekV3ForCausalLM (megajax
          holds 14,848 more: the 58 routed layers' 256 correction biases, buffers there), 37,552,297,472 active per
          token (37B in the technical report); with mtp_depth=1, 682,636,472,320 (+ the depth's 256 biases), which
          with the published layer 61's copies of the embedding and output layer (2 x 129280 x 7168) is the
          report's 685B. On DeepSeek's cluster (python -m megajax.scaling --config=deepseek_v3 --gpus=2048
          --cluster=h800): data 64 x expert 16 x model 2, FSDP, full recomputation, 210 s/step, 41 TFLOP/s per GPU,
          1.90M GPU-hours per trillion tokens (predicted; the report's figure is 180K: megajax's dispatch passes over
          the exchange's worst-case room and has no expert shards inside pipeline stages).
"""

from megajax.config import base_config
from megajax.models import deepseek


def get_config():
    c = base_config(deepseek.NAME)  # DeepSeekConfig's defaults are DeepSeek-V3's
    c.mesh.model = 8
    c.train.update(steps=500_000, global_batch_size=15360, micro_batch_size=1, precision="bf16")
    c.optimizer.update(lr=2.2e-4, min_lr=2.2e-5, warmup_steps=2000, b2=0.95, eps=1e-8, weight_decay=0.1)
    return c
