"""Paper Tables 1 and 2: 2.5B (54 layers, hidden 1920, 20 heads, 96 per head), 2-way model parallel.

Command:  python train.py --config=configs/gpt_2p5b.py
Expect:   2.49B parameters; WikiText-103 perplexity 12.76 and LAMBADA 61.73% after 300k iterations (paper Table 3).
Plan:     one 8-GPU H100 host: --config.mesh.auto=True plans it there (predicted, not measured; the fitted
          dgx_h100: data 8, 64 sequences per micro-batch (no accumulation), full recomputation, FSDP: 3.47 s/step,
          31.0% MFU; python -m megajax.scaling --config=gpt_2p5b --gpus=8 --cluster=dgx_h100). With
          --config.train.precision=fp8 the same plan: 2.93 s/step, 36.6% of the bf16 peak. The paper's cluster
          (2 DGX-2H V100s, its 2-way run): data 2, 8 per micro-batch (32 steps), full recomputation, FSDP: 42.6
          TFLOP/s per GPU (--gpus=2 --cluster=dgx2h).
"""

from megajax.config import base_config


def get_config():
    c = base_config()
    c.model.update(num_layers=54, hidden_size=1920, num_heads=20)
    c.mesh.model = 2
    return c
