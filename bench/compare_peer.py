"""megajax against PyTorch + Hugging Face ``transformers``, the same training on one machine (GPT-2 by default; any
causal family megajax converts: Llama, Mixtral-style mixtures of experts).

    python bench/compare_peer.py                                   # gpt_125m, batch 4 x 512, 3 rounds of 3 steps
    python bench/compare_peer.py --config=gpt_tiny --steps=3 --rounds=2 --batch=2 --seq=64 --output=/tmp/peer.json
    python bench/compare_peer.py --config=mixtral_tiny --batch=16 --seq=128 --output=/tmp/peer_moe.json

Both sides train the same model (megajax's vocabulary padding aside) from the same initial weights (megajax's,
copied into the HF model by the family's converter, ``megajax.convert.hf_io.writer_for``) on the same random token
batches (a mixture of experts: transformers' MixtralForCausalLM with its balancing loss, as megajax's): fp32, no
dropout, no activation checkpointing, AdamW with megajax's hyper-parameters and schedule (decay on matrices and
embeddings only), gradient clipping to norm 1.0. After ``--warmup`` untimed steps each (megajax's step is compiled
ahead of time), it times ``--rounds`` rounds of ``--steps`` steps, alternating the two (the order swaps every round)
so both see the same machine state. It prints a table and writes a JSON (``--output``): every round's step times,
the median tokens/s of each, the ratio megajax/torch, the jax fp32 GEMM rate at the model's shapes and megajax's
model FLOP/s (the model spec's ``flops``) as a fraction of it. Expect the two first-step losses to agree within 1e-4
(asserted) and to be near ln(vocab). On a shared CPU timings swing by tens of percent: only the side-by-side ratio
is meaningful.
Needs the optional extras: ``pip install -e '.[test]'`` (or ``pip install torch transformers``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import platform
import statistics
import sys
import time
from typing import Any, Callable

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

GEMM_VOCAB_COLUMNS = 8192  # a slice of the output layer: the full (B*S, h) @ (h, 51200) GEMM adds nothing but time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="gpt_125m")
    p.add_argument("--batch", type=int, default=4, help="sequences per step (global batch)")
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=3, help="timed steps per round")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds of each framework")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each before the rounds (>= 1)")
    p.add_argument("--layers", type=int, default=0, help="override model.num_layers (smoke runs); 0 = the config's")
    p.add_argument("--output", default="bench/compare_peer.json")
    return p.parse_args(argv)


def require_peer() -> tuple[Any, Any]:
    """(torch, transformers), or exit 1 naming the extra to install: the peer is optional, megajax needs neither."""
    try:
        import torch
        import transformers
    except ImportError as e:
        print(f"error: bench/compare_peer.py needs torch and transformers ({e.name} is missing); install them with "
              "pip install -e '.[test]' or pip install torch transformers", file=sys.stderr)
        sys.exit(1)
    return torch, transformers


def build_config(args: argparse.Namespace, total_steps: int):
    """The megajax config: the named model at --seq, one device, fp32, no dropout, no remat (HF has neither)."""
    from megajax.cli import load_config

    config = load_config(args.config)
    config.model.update(max_seq_len=args.seq, dropout=0.0, remat="none")
    if args.layers:
        config.model.num_layers = args.layers
    config.mesh.update(data=1, model=1)
    config.train.update(global_batch_size=args.batch, micro_batch_size=0, precision="fp32", steps=total_steps)
    return config


def build_torch(torch, transformers, config, params: dict) -> tuple[Any, Callable]:
    """The Hugging Face model of ``config``'s family (its converter's ``hf_config`` and ``params_to_hf``, written
    and read back with ``from_pretrained``, which lays a mixture of experts' per-expert tensors out as it keeps them)
    holding megajax's ``params``, and ``step(tokens, lr) -> loss`` (AdamW + clip; a mixture of experts adds its
    balancing loss, ``router_aux_loss_coef`` x transformers' ``aux_loss``, as megajax does)."""
    import tempfile

    from megajax.config import model_config
    from megajax.convert import hf_io

    cfg = model_config(config)
    writer = hf_io.writer_for(config.model.name)
    with tempfile.TemporaryDirectory() as directory:
        hf_io.write(directory, writer.params_to_hf(params, cfg), writer.hf_config(cfg))
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)
    model.train()  # dropout is 0 in the config; train mode keeps autograd's usual path
    routed = hasattr(cfg, "num_experts")  # a mixture of experts' config (models/moe.py)
    aux_coef = cfg.router_aux_loss_coef if routed else 0.0
    o = config.optimizer
    decay = [p for p in model.parameters() if p.ndim >= 2]  # megajax's mask: matrices and embeddings decay
    no_decay = [p for p in model.parameters() if p.ndim < 2]  # biases and norm parameters
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=0.0, betas=(o.b1, o.b2), eps=o.eps)
    params_list = decay + no_decay

    def step(tokens, lr: float):
        for group in opt.param_groups:
            group["lr"] = lr  # megajax's schedule value for this step (precomputed outside the timed loop)
        opt.zero_grad(set_to_none=True)
        out = model(input_ids=tokens[:, :-1], **({"output_router_logits": True} if routed else {}))
        logits = out.logits  # our own shift: S targets per row, as megajax
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        if routed:
            loss = loss + aux_coef * out.aux_loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params_list, o.clip_norm)
        opt.step()
        return loss.detach()

    return model, step


def gemm_rates(m: int, shapes: dict[str, tuple[int, int]], reps: int = 5) -> dict[str, float]:
    """FLOP/s of a jitted fp32 (m, k) @ (k, n) per shape: 2mnk over the median of ``reps`` timed calls."""
    import jax
    import jax.numpy as jnp

    matmul = jax.jit(jnp.matmul)
    out = {}
    for name, (k, n) in shapes.items():
        ka, kb = jax.random.split(jax.random.key(0))
        a, b = jax.random.normal(ka, (m, k), jnp.float32), jax.random.normal(kb, (k, n), jnp.float32)
        matmul(a, b).block_until_ready()  # compile
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            matmul(a, b).block_until_ready()
            times.append(time.perf_counter() - t)
        out[name] = 2.0 * m * n * k / statistics.median(times)
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if min(args.batch, args.seq, args.steps, args.rounds, args.warmup) < 1 or args.layers < 0:
        sys.exit("error: --batch, --seq, --steps, --rounds and --warmup must be >= 1 (and --layers >= 0)")
    torch, transformers = require_peer()
    import jax
    import numpy as np

    from megajax.training.loop import setup
    from megajax.training.metrics import model_flops_per_step
    from megajax.training.optimizer import learning_rate_schedule, weight_decay_mask

    torch.set_num_threads(os.cpu_count())  # torch's default can be fewer; XLA's CPU pool uses every core
    total = args.warmup + args.rounds * args.steps
    config = build_config(args, total)
    run = setup(config)
    spec, m = run.spec, run.spec.model
    state = run.init_state()
    params = jax.tree.map(lambda x: np.array(x, copy=True), jax.device_get(state.params))  # the step donates state
    model, torch_step = build_torch(torch, transformers, config, params)

    # Same architecture: megajax holds (padded - vocab) extra rows of each vocabulary table (zero-probability ids).
    tables = 1 if getattr(m, "tie_embeddings", True) else 2  # GPT's embedding is always the output layer
    pad_rows = (m.padded_vocab_size - m.vocab_size) * m.hidden_size * tables
    hf_params = sum(p.numel() for p in model.parameters())  # the tied lm_head is counted once
    assert run.num_params - pad_rows == hf_params, (run.num_params, pad_rows, hf_params)
    mask = weight_decay_mask(params)
    mj_decay = sum(x.size for x, d in zip(jax.tree.leaves(params), jax.tree.leaves(mask)) if d) - pad_rows
    assert mj_decay == sum(p.numel() for p in model.parameters() if p.ndim >= 2), "weight-decay sets differ"

    rng = np.random.default_rng(0)
    host = rng.integers(0, m.vocab_size, (args.steps, args.batch, args.seq + 1), dtype=np.int32)
    mj_batches = [jax.device_put({"tokens": b}, run.batch_shardings) for b in host]  # on device before timing
    pt_batches = [torch.from_numpy(b.astype(np.int64)) for b in host]
    schedule = learning_rate_schedule(run.spec.optimizer, total)
    lrs = [float(schedule(i)) for i in range(total)]  # optax uses schedule(count) for update `count`
    counters = {"megajax": 0, "torch": 0}
    last_loss: dict[str, Any] = {}  # a jax or torch scalar, read once at the end

    def mj_one() -> jax.Array:
        nonlocal state
        i = counters["megajax"]
        state, metrics = run.step_fn(state, mj_batches[i % len(mj_batches)])
        jax.block_until_ready(metrics["loss"])  # no async dispatch hiding the step's time
        counters["megajax"] += 1
        return metrics["loss"]

    def pt_one() -> Any:  # a torch scalar tensor
        i = counters["torch"]
        loss = torch_step(pt_batches[i % len(pt_batches)], lrs[i])
        counters["torch"] += 1
        return loss

    def timed(name: str, one: Callable, n: int) -> list[float]:
        times = []
        for _ in range(n):
            t = time.perf_counter()
            loss = one()
            times.append(time.perf_counter() - t)
            last_loss[name] = loss
        return times

    # Warm-up, untimed; the first step of each sees the same weights and batch, so their losses must agree.
    first = {"megajax": float(mj_one()), "torch": float(pt_one())}
    assert abs(first["megajax"] - first["torch"]) < 1e-4, f"first-step losses differ: {first}"
    assert abs(first["megajax"] - math.log(m.vocab_size)) < 1.0, f"initial loss {first} is far from ln(vocab)"
    timed("megajax", mj_one, args.warmup - 1)
    timed("torch", pt_one, args.warmup - 1)

    m_rows, h, ffn = args.batch * args.seq, m.hidden_size, m.ffn_size
    vc = min(GEMM_VOCAB_COLUMNS, m.padded_vocab_size)
    gemm = gemm_rates(m_rows, {"qkv (h, 3h)": (h, 3 * h), f"mlp up (h, {ffn})": (h, ffn),
                               f"mlp down ({ffn}, h)": (ffn, h), f"logits (h, {vc})": (h, vc)})
    gemm_best = max(gemm.values())

    rounds = []
    for r in range(args.rounds):
        order = [("megajax", mj_one), ("torch", pt_one)]
        for name, one in order if r % 2 == 0 else order[::-1]:  # swap who goes first: no systematic advantage
            times = timed(name, one, args.steps)
            rounds.append({"round": r, "framework": name, "step_s": times, "seconds": sum(times)})

    tokens = args.batch * args.seq
    med = {f: statistics.median(tokens * args.steps / x["seconds"] for x in rounds if x["framework"] == f)
           for f in ("megajax", "torch")}
    flops = {"megajax": model_flops_per_step(spec, args.seq),  # padded vocabulary, as megajax logs it
             "torch": spec.model_spec.flops(dataclasses.replace(m, make_vocab_size_divisible_by=1), args.batch,
                                            args.seq)}  # the same model's, over the true vocabulary
    model_fps = {f: flops[f] * med[f] / tokens for f in med}
    last = {f: float(v) for f, v in last_loss.items()}
    result = {
        "machine": {"cpu_count": os.cpu_count(), "cpu_affinity": len(os.sched_getaffinity(0)),
                    "platform": platform.platform(), "processor": platform.processor(),
                    "python": platform.python_version(), "jax": jax.__version__,
                    "jax_device": jax.devices()[0].device_kind, "torch": torch.__version__,
                    "transformers": transformers.__version__, "torch_threads": torch.get_num_threads(),
                    "torch_interop_threads": torch.get_num_interop_threads(),
                    "jax_threads": "XLA CPU default (its pool sizes itself to the cores)",
                    "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")},
        "config": {"name": args.config, "layers": m.num_layers, "hidden": h, "heads": m.num_heads,
                   "vocab": m.vocab_size, "padded_vocab": m.padded_vocab_size, "seq": args.seq, "batch": args.batch,
                   "steps_per_round": args.steps, "rounds": args.rounds, "warmup_steps": args.warmup,
                   "precision": "fp32", "dropout": 0.0, "remat": "none", "optimizer": config.optimizer.to_dict(),
                   "hf_attn_implementation": model.config._attn_implementation,
                   "params_megajax": run.num_params, "params_torch": hf_params, "padding_params": pad_rows},
        "first_step_loss": first, "last_loss": last, "rounds": rounds,
        "median_tokens_per_s": med, "ratio_megajax_over_torch": med["megajax"] / med["torch"],
        "model_flops_per_step": flops, "model_flops_per_s": model_fps,
        "gemm_flops_per_s": gemm, "gemm_best_flops_per_s": gemm_best,
        "model_flops_fraction_of_gemm": {f: model_fps[f] / gemm_best for f in model_fps},
    }
    out = pathlib.Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")

    print(f"{args.config}: {m.num_layers} layers, hidden {h}, vocab {m.vocab_size} (megajax pads to "
          f"{m.padded_vocab_size}), batch {args.batch} x {args.seq}, fp32; {args.rounds} rounds x {args.steps} steps")
    print(f"params: megajax {run.num_params:,} = torch {hf_params:,} + {pad_rows:,} padding rows; "
          f"first-step loss megajax {first['megajax']:.6f} torch {first['torch']:.6f} (ln V = "
          f"{math.log(m.vocab_size):.4f})")
    print(f"{'framework':<10} {'threads':<28} {'tokens/s':>10} {'step s':>8} {'GFLOP/s':>8} {'of GEMM':>8}  "
          "rounds s/step")
    threads = {"megajax": "XLA CPU pool (all cores)", "torch": f"{torch.get_num_threads()} intra-op"}
    for f in ("megajax", "torch"):
        per = " ".join(f"{x['seconds'] / args.steps:.3f}" for x in rounds if x["framework"] == f)
        print(f"{f:<10} {threads[f]:<28} {med[f]:>10.1f} {tokens / med[f]:>8.3f} {model_fps[f] / 1e9:>8.2f} "
              f"{model_fps[f] / gemm_best:>8.1%}  {per}")
    print(f"ratio megajax/torch (median tokens/s): {result['ratio_megajax_over_torch']:.3f}   "
          f"cpu_count {os.cpu_count()}")
    print("jax fp32 GEMM, m = batch x seq = " + f"{m_rows}: "
          + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in gemm.items()) + " GFLOP/s (best is the denominator)")
    print(f"last loss megajax {last['megajax']:.5f} torch {last['torch']:.5f} (same weights, batches, AdamW); "
          f"wrote {out}")


if __name__ == "__main__":
    from megajax.cli import exit_on_user_error

    exit_on_user_error(main)  # a mistyped config: "error: ..." and exit 1, not a traceback
