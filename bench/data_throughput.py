"""Data pipeline throughput on this machine: preprocessing MB/s and loader samples/s, against gpt_125m's step.

    python bench/data_throughput.py [--skip_model]

Preprocesses the stdlib corpus (~12 MB) with and without near-duplicate removal, reads batches of 1024-token
samples from the result, and times one fp32 gpt_125m training step (batch 1 x 1024) on the CPU to show the loader
keeps up: it must deliver a sample in well under the time the model spends on it.
"""

import argparse
import json
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from megajax.data.default_corpus import stdlib_documents  # noqa: E402
from megajax.data.gpt_dataset import GPTBatches  # noqa: E402
from megajax.data.indexed import IndexedTokens  # noqa: E402
from megajax.data.preprocess import write_documents  # noqa: E402
from megajax.data.tokenizer import train_tokenizer  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--skip_model", action="store_true")
    args = p.parse_args()
    docs = stdlib_documents()
    mb = sum(len(d.encode()) for d in docs) / 2**20
    tokenizer = train_tokenizer(docs[:200], "bpe", 8192)
    out = {"corpus_mb": round(mb, 2), "documents": len(docs)}
    with tempfile.TemporaryDirectory() as tmp:
        for name, kw in (("preprocess", {}), ("preprocess_dedup", {"dedup": True, "workers": 2})):
            t = time.perf_counter()
            write_documents(docs, tokenizer, pathlib.Path(tmp) / name, min_tokens=128, **kw)
            out[f"{name}_mb_per_s"] = round(mb / (time.perf_counter() - t), 2)
        data = IndexedTokens.open(pathlib.Path(tmp) / "preprocess")
        batches = GPTBatches(data.tokens, 1024, 8, seed=0)
        batches.batch(0)
        t, n = time.perf_counter(), 50
        for step in range(1, n + 1):
            batches.batch(step)
        out["loader_samples_per_s"] = round(n * 8 / (time.perf_counter() - t), 1)
    if not args.skip_model:
        out["gpt_125m_step_s_per_sample"] = round(_gpt_125m_step_seconds(), 2)
        out["loader_headroom"] = round(out["loader_samples_per_s"] * out["gpt_125m_step_s_per_sample"], 1)
    print(json.dumps(out, indent=1))


def _gpt_125m_step_seconds() -> float:
    import jax
    import numpy as np

    from megajax.cli import load_config
    from megajax.training.loop import setup

    config = load_config("gpt_125m")
    config.train.update(global_batch_size=1, precision="fp32", steps=10)
    config.mesh.update(data=1, model=1)
    config.model.remat = "none"
    run = setup(config)
    state = run.init_state()
    batch = {"tokens": jax.device_put(np.zeros((1, 1025), np.int32), run.batch_shardings["tokens"])}
    state, m = run.step_fn(state, batch)
    jax.block_until_ready(m)
    t = time.perf_counter()
    state, m = run.step_fn(state, batch)
    jax.block_until_ready(m)
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
