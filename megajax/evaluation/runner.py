"""eval.py's library side: load a checkpoint on a mesh, find its tokenizer, run a task, write JSON."""

from __future__ import annotations

import json
import pathlib
import sys

import ml_collections
import numpy as np

from megajax.data.tokenizer import TextTokenizer, load_tokenizer

TASKS = ("wikitext103", "lambada", "ppl", "generate")


def tokenizer_for(config: ml_collections.ConfigDict, explicit: str | None) -> TextTokenizer:
    """The tokenizer given, else the one the checkpoint's training data used."""
    if explicit:
        return load_tokenizer(explicit)
    d = config.data
    if d.source == "default":
        from megajax.data.default_corpus import default_corpus
        return load_tokenizer(default_corpus(config.model.vocab_size)[1])
    if d.source == "tfds" and d.tokenizer:
        return load_tokenizer(d.tokenizer)
    if d.source == "indexed" and d.path:
        from megajax.data.indexed import IndexedTokens
        return load_tokenizer(IndexedTokens.open(d.path).meta["tokenizer"])
    raise ValueError("this checkpoint does not say which tokenizer it was trained with; pass --tokenizer=PATH")


def run(checkpoint: str, task: str, *, data: str | None = None, prompt: str | None = None,
        tokenizer: str | None = None, mesh_data: int | None = None, mesh_model: int | None = None,
        batch_size: int = 8, stride: int = 32, max_new_tokens: int = 64, sampling=None, seed: int = 0,
        output: str | None = None) -> dict:
    """Runs ``task`` on ``checkpoint``; prints and (with ``output``) writes the JSON results."""
    from megajax.checkpoint import load_model
    from megajax.config import rules_of
    from megajax.evaluation import tasks
    from megajax.evaluation.generate import Sampling, generate
    from megajax.evaluation.scoring import Scorer

    if task not in TASKS:
        raise ValueError(f"--task={task!r}; choose one of {TASKS}")
    if task != "generate" and not data:
        raise ValueError(f"--task={task} needs --data")
    model, config = load_model(checkpoint, data=mesh_data, model=mesh_model)
    mesh = model.wte.embedding[...].sharding.mesh
    rules = rules_of(config)
    if task == "generate":
        tok = tokenizer_for(config, tokenizer)
        ids = np.asarray([tok.encode_batch([prompt or ""])[0] or [tok.eod_id]], np.int32)
        print(prompt or "", end="", flush=True)
        stream = lambda col: print(tok.decode([int(col[0])]), end="", flush=True)  # noqa: E731
        out = generate(model, mesh, rules, ids, max_new_tokens, sampling or Sampling(), seed=seed, on_token=stream)
        print()
        result = {"task": "generate", "prompt": prompt, "text": tok.decode(out[0, ids.shape[1]:].tolist())}
    else:
        scorer = Scorer(model, mesh, rules, batch_size, config.model.max_seq_len)
        if task == "wikitext103":
            result = tasks.wikitext103(scorer, tokenizer_for(config, tokenizer), data, stride)
        elif task == "lambada":
            result = tasks.lambada(scorer, tokenizer_for(config, tokenizer), data)
        else:
            result = tasks.perplexity(scorer, data, stride if stride != 32 else None)
    result.update(checkpoint=str(checkpoint), mesh=f"{mesh.shape['data']}x{mesh.shape['model']}")
    if task != "generate":
        print(json.dumps(result, indent=1))
    if output:
        pathlib.Path(output).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {output}", file=sys.stderr)
    return result
