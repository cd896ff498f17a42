"""Where a megajax training step's time goes on this machine: the whole step beside its parts, each jitted alone.

    python bench/profile_step.py                       # gpt_125m, batch 4 x 512, fp32, one device (as compare_peer)
    python bench/profile_step.py --config=gpt_tiny --batch=2 --seq=64 --reps=2 --output=/tmp/profile.json

Parts, each forward + backward unless named otherwise, on the step's shapes:
  blocks       the L transformer blocks (attention, MLP, LayerNorms, residuals)
  attention    the attention core alone (q k^T, mask, softmax, x v) for L layers, inside ``blocks``
  gemms        the dense GEMMs (per layer QKV, attention-out, MLP up and down; the output layer), each timed as a
               jitted (m, k) @ (k, n) at its shape, x3 for the forward and the two backward products: what the
               step cannot go below in fp32 without faster GEMMs (attention's own products are not in it)
  head         final LayerNorm, tied output layer (x @ E^T over the padded vocabulary) and the cross-entropy
  optimizer    clipping to norm 1.0 and AdamW on all parameters (no forward, no backward)
The parts overlap (attention is inside blocks, gemms inside both), so they do not sum to the step; ``rest`` is the
step minus blocks, head and optimizer (embedding lookup and its gradient, the step's own bookkeeping). Prints a
table (milliseconds and share of the step) and writes a JSON (``--output``). Timings are medians of ``--reps``
calls after one untimed call; on a shared CPU they swing by tens of percent.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time
from collections.abc import Callable

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="gpt_125m")
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--reps", type=int, default=3, help="timed calls per part (median)")
    p.add_argument("--output", default="bench/profile_step.json")
    return p.parse_args(argv)


def median_seconds(fn: Callable[[], object], reps: int) -> float:
    """Median wall time of ``fn()`` (its outputs blocked on) over ``reps`` calls after one untimed call."""
    import jax

    jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict[str, float]:
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from compare_peer import gemm_rates  # bench/ is this script's directory
    from flax import nnx

    from megajax.cli import load_config
    from megajax.config import build_mesh, create_model
    from megajax.models.transformer import attention_core, causal_mask, run_blocks
    from megajax.parallel.losses import mask_padded_vocab, vocab_parallel_cross_entropy
    from megajax.training.loop import batch_layout, setup
    from megajax.training.optimizer import make_optimizer

    config = load_config(args.config)
    config.model.update(max_seq_len=args.seq, dropout=0.0, remat="none")
    config.mesh.update(data=1, model=1)
    config.train.update(global_batch_size=args.batch, micro_batch_size=0, precision="fp32")
    b, s = args.batch, args.seq
    rng = np.random.default_rng(0)
    ms: dict[str, float] = {}

    run = setup(config)  # the step exactly as train.py compiles it
    cfg = run.spec.model
    h, n, d, v, layers = cfg.hidden_size, cfg.num_heads, cfg.head_dim, cfg.padded_vocab_size, cfg.num_layers
    state = run.init_state()
    fields, _ = batch_layout(run.spec, run.mesh)
    batch = {k: jax.device_put(rng.integers(0, cfg.vocab_size, (b, *f.row_shape)).astype(f.dtype),
                               run.batch_shardings[k]) for k, f in fields.items()}
    holder = {"state": state}

    def one_step():
        holder["state"], metrics = run.step_fn(holder["state"], batch)
        return metrics

    ms["step"] = median_seconds(one_step, args.reps)
    state = holder["state"]  # the first one was donated to the step

    model = create_model(config, build_mesh(config), seed=0)
    graphdef, params = nnx.split(model)
    x = jnp.asarray(rng.standard_normal((b, s, h)), jnp.float32)
    mask = causal_mask(jnp.arange(s), s)

    @jax.jit
    def blocks_grad(params, x):
        def f(params, x):
            m = nnx.merge(graphdef, params)
            return run_blocks(m.blocks, cfg, x, mask, None)[0].sum()
        return jax.grad(f, argnums=(0, 1))(params, x)

    ms["blocks"] = median_seconds(lambda: blocks_grad(params, x), args.reps)

    q, k, vv = (jnp.asarray(rng.standard_normal((b, s, n, d)), jnp.float32) for _ in range(3))
    attn_grad = jax.jit(jax.grad(lambda q, k, v: attention_core(q, k, v, mask, None, 0.0).sum(), argnums=(0, 1, 2)))
    ms["attention"] = layers * median_seconds(lambda: attn_grad(q, k, vv), args.reps)

    labels = jnp.asarray(rng.integers(0, cfg.vocab_size, (b, s)), jnp.int32)

    @jax.jit
    def head_grad(params, x):
        def f(params, x):
            m = nnx.merge(graphdef, params)
            logits = mask_padded_vocab(m.wte.attend(m.ln_f(x)), cfg.vocab_size)
            return vocab_parallel_cross_entropy(logits, labels).mean()
        return jax.grad(f, argnums=(0, 1))(params, x)

    ms["head"] = median_seconds(lambda: head_grad(params, x), args.reps)

    optimizer = make_optimizer(run.spec.optimizer, run.spec.train.steps)
    grads = jax.tree.map(jnp.ones_like, state.params)
    opt_state = optimizer.init(state.params)
    update = jax.jit(lambda g, o, p: optimizer.update(g, o, p))
    ms["optimizer"] = median_seconds(lambda: update(grads, opt_state, state.params), args.reps)

    # GEMM floor: per layer QKV, attention-out, MLP up and down (forward + 2 backward products each), and the
    # output layer; at the rate a jitted (m, k) @ (k, n) reaches on this machine for each shape.
    m_rows = b * s
    shapes = {"qkv": (h, 3 * h), "out": (h, h), "up": (h, 4 * h), "down": (4 * h, h), "logits": (h, v)}
    rates = gemm_rates(m_rows, shapes, args.reps)
    ms["gemms"] = sum(3 * 2.0 * m_rows * kk * nn_ / rates[name] * (1 if name == "logits" else layers)
                      for name, (kk, nn_) in shapes.items())
    ms["rest"] = ms["step"] - ms["blocks"] - ms["head"] - ms["optimizer"]
    ms = {key: 1000 * t for key, t in ms.items()}

    print(f"{args.config}, batch {b} x {s}, fp32, one {jax.devices()[0].device_kind} device, {jax.device_count()} "
          f"device(s) visible")
    print(f"{'part':<12}{'ms':>10}{'of step':>10}")
    for key, t in ms.items():
        print(f"{key:<12}{t:>10.1f}{t / ms['step']:>10.2f}")
    out = {"config": args.config, "batch": b, "seq": s, "ms": ms}
    pathlib.Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.output).write_text(json.dumps(out, indent=1))
    return ms


if __name__ == "__main__":
    from megajax.cli import exit_on_user_error

    exit_on_user_error(main)  # a mistyped config: "error: ..." and exit 1, not a traceback
