"""A mixture-of-experts layer's forward + backward beside the dense SwiGLU of the same active parameters.

    python bench/moe_layer.py                                # hidden 512, 8 experts of 512, top-2, 8 x 512 tokens
    python bench/moe_layer.py --experts=4 --top_k=1 --output=/tmp/moe_layer.json

The routed layer (``megajax.models.moe.MixtureOfExperts``: router, sort by expert, three grouped GEMMs
``jax.lax.ragged_dot``, unsort and combine) is timed against one SwiGLU whose width is top_k x the expert width, so
both do the same GEMM FLOPs per token; the ratio is the cost of routing. It also times the pieces: the router and
top-k alone, and one grouped GEMM beside a dense GEMM of the same FLOPs. On one device and no mesh (no all-to-all);
fp32 on the CPU. Prints a table and writes JSON (``--output``). Timings on a shared CPU swing: only the ratios in one
run compare.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import megajax  # noqa: E402,F401 - starts jax quietly first

# isort: split
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from megajax.models import moe  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--width", type=int, default=512, help="each expert's SwiGLU width")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top_k", type=int, default=2)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--output", default="bench/moe_layer.json")
    return p.parse_args(argv)


def timed(fn, *args, repeats: int) -> float:
    """Median seconds of ``fn(*args)`` (compiled and run once first)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    cfg = moe.MoEConfig(vocab_size=128, num_layers=1, hidden_size=a.hidden, num_heads=8, num_kv_heads=8,
                        max_seq_len=a.seq, num_experts=a.experts, experts_per_token=a.top_k,
                        moe_ffn_hidden_size=a.width, make_vocab_size_divisible_by=128)
    layer = moe.MixtureOfExperts(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(layer)
    x = jax.random.normal(jax.random.key(1), (a.batch, a.seq, a.hidden))
    tokens = a.batch * a.seq

    def moe_loss(params, x):
        y, stats = nnx.merge(graphdef, params)(x)
        return jnp.square(y).sum() + stats["probs"].sum()

    dense_width = a.top_k * a.width
    keys = jax.random.split(jax.random.key(2), 3)
    dense = {"gate": 0.02 * jax.random.normal(keys[0], (a.hidden, dense_width)),
             "up": 0.02 * jax.random.normal(keys[1], (a.hidden, dense_width)),
             "down": 0.02 * jax.random.normal(keys[2], (dense_width, a.hidden))}

    def dense_loss(p, x):
        return jnp.square((jax.nn.silu(x @ p["gate"]) * (x @ p["up"])) @ p["down"]).sum()

    def route_only(params, x):
        logits = x.reshape(-1, a.hidden) @ params["router"][...]
        return moe.route(logits, a.top_k, True)[1].sum()

    rows = jnp.ones((tokens * a.top_k, a.hidden))
    sizes = jnp.full((a.experts,), tokens * a.top_k // a.experts, jnp.int32)
    expert_w = jnp.ones((a.experts, a.hidden, a.width))
    results = {
        "moe_fwd_bwd_s": timed(jax.jit(jax.grad(moe_loss)), params, x, repeats=a.repeats),
        "dense_fwd_bwd_s": timed(jax.jit(jax.grad(dense_loss)), dense, x, repeats=a.repeats),
        "router_topk_s": timed(jax.jit(route_only), params, x, repeats=a.repeats),
        # one of the three expert GEMMs beside the dense GEMM of the same FLOPs (T k rows of width F = T rows of k F)
        "grouped_gemm_s": timed(jax.jit(lambda r, w: jax.lax.ragged_dot(r, w, sizes)), rows, expert_w,
                                repeats=a.repeats),
        "dense_gemm_s": timed(jax.jit(lambda r, w: r @ w), jnp.ones((tokens, a.hidden)),
                              jnp.ones((a.hidden, dense_width)), repeats=a.repeats),
    }
    results.update(
        moe_tokens_per_s=tokens / results["moe_fwd_bwd_s"], dense_tokens_per_s=tokens / results["dense_fwd_bwd_s"],
        moe_over_dense_time=results["moe_fwd_bwd_s"] / results["dense_fwd_bwd_s"],
        grouped_over_dense_gemm_time=results["grouped_gemm_s"] / results["dense_gemm_s"])
    record = {"args": vars(a), "device": jax.devices()[0].device_kind, **results}
    for k, v in results.items():
        print(f"{k:32s} {v:12.4f}")
    pathlib.Path(a.output).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(a.output).write_text(json.dumps(record, indent=1))
    return record


if __name__ == "__main__":
    main()
