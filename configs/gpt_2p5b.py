"""Paper Tables 1 and 2: 2.5B (54 layers, hidden 1920, 20 heads, 96 per head), 2-way model parallel.

Command:  python train.py --config=configs/gpt_2p5b.py
Expect:   2.49B parameters; WikiText-103 perplexity 12.76 and LAMBADA 61.73% after 300k iterations (paper Table 3).
Plan:     one 8-GPU H100 host: --config.mesh.auto=True plans it there (predicted, not measured; the fitted dgx_h100,
          each GPU's 60 GiB that JAX's allocator takes by default: data 4 x model 2, 32 per micro-batch (4 steps),
          save_dots, sequence parallelism, ZeRO-1: 3.51 s/step, 30.6% MFU; its step compiles to 1.21x the memory
          planner's peak, bench/README.md; python -m megajax.scaling --config=gpt_2p5b --gpus=8 --cluster=dgx_h100).
          With --config.train.precision=fp8: data 8, 32 per micro-batch (2 steps), full recomputation, ZeRO-1: 3.08
          s/step, 34.8% of the bf16 peak. The paper's cluster (2 DGX-2H V100s, its 2-way run;
          XLA_PYTHON_CLIENT_MEM_FRACTION=.95): model 2, 8 per micro-batch (64 steps), full recomputation, sequence
          parallelism: 38.3 TFLOP/s per GPU (--gpus=2 --cluster=dgx2h).
"""

from megajax.config import base_config


def get_config():
    c = base_config()
    c.model.update(num_layers=54, hidden_size=1920, num_heads=20)
    c.mesh.model = 2
    return c
