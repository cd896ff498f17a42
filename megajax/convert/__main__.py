"""python -m megajax.convert SUBCOMMAND ...

  hf-to-megajax        --hf=DIR --output=OUT [--make_vocab_size_divisible_by=1024]
  megajax-to-hf        --checkpoint=CK --output=DIR
  megatron-to-megajax  --megatron=DIR --output=OUT [--iteration=N] [--vocab_size=N] [--config=NAME]
  megajax-to-megatron  --checkpoint=CK --output=DIR --tp=N [--names=legacy|core] [--dtype=float16]
  export               --checkpoint=CK --output=OUT [--dtype=bfloat16]

CK is any megajax checkpoint: a training workdir, its checkpoints/ directory, one step, or an export.
megajax outputs are params-only checkpoints that ``megajax.checkpoint.load_model`` and training both read.
"""

from __future__ import annotations

import argparse
import sys

import jax
import numpy as np
from flax import nnx


def host_params(checkpoint: str):
    """(parameters as host numpy arrays, config) of any megajax checkpoint, read on one device."""
    from megajax.checkpoint import load_model

    model, config = load_model(checkpoint, data=1, model=1)
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model))), config


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m megajax.convert", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("hf-to-megajax")
    a.add_argument("--hf", required=True)
    a.add_argument("--make_vocab_size_divisible_by", type=int, default=1024)
    b = sub.add_parser("megajax-to-hf")
    c = sub.add_parser("megatron-to-megajax")
    c.add_argument("--megatron", required=True)
    c.add_argument("--iteration", type=int, default=None)
    c.add_argument("--vocab_size", type=int, default=None,
                   help="true vocabulary (Megatron stores only the padded); if omitted: GPT 50257, BERT --config's")
    c.add_argument("--config", default=None, help="megajax config, if the checkpoint stores no args")
    d = sub.add_parser("megajax-to-megatron")
    d.add_argument("--tp", type=int, required=True)
    d.add_argument("--names", choices=["legacy", "core"], default="legacy")
    d.add_argument("--iteration", type=int, default=0)
    e = sub.add_parser("export")
    for parser in (b, d, e):
        parser.add_argument("--checkpoint", required=True)
    for parser in (a, b, c, d, e):
        parser.add_argument("--output", required=True)
    for parser in (a, c):
        parser.add_argument("--allow_pickle", action="store_true", help="trust pickled code in .bin/.pt files")
    d.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    e.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    args = p.parse_args(argv)

    from megajax.checkpoint import save_params
    from megajax.convert import hf_bert, hf_gpt2, megatron_bert, megatron_gpt

    if args.command == "hf-to-megajax":
        hf, sd = hf_gpt2.read_hf(args.hf, args.allow_pickle)
        hf_module = hf_bert if hf.get("model_type") in hf_bert.MODEL_TYPES else hf_gpt2
        config = hf_module.config_from_hf(hf, args.make_vocab_size_divisible_by)
        out = save_params(args.output, hf_module.params_from_hf(sd, config), config)
    elif args.command == "megajax-to-hf":
        params, config = host_params(args.checkpoint)
        hf_module = hf_bert if config.model.name == "bert" else hf_gpt2
        hf_gpt2.write_hf(args.output, hf_module.params_to_hf(params, config), hf_module.hf_config(config))
        out = args.output
    elif args.command == "megatron-to-megajax":
        from megajax.cli import load_config

        config = load_config(args.config) if args.config else None
        reader = megatron_bert if megatron_bert.holds_bert(args.megatron, args.iteration, args.allow_pickle) \
            else megatron_gpt
        vocab = {} if args.vocab_size is None else {"vocab_size": args.vocab_size}  # else the reader's default
        params, config = reader.read_megatron(args.megatron, config, iteration=args.iteration,
                                              allow_pickle=args.allow_pickle, **vocab)
        out = save_params(args.output, params, config)
    elif args.command == "megajax-to-megatron":
        params, config = host_params(args.checkpoint)
        writer = megatron_bert if config.model.name == "bert" else megatron_gpt
        out = writer.write_megatron(args.output, params, config, args.tp, iteration=args.iteration,
                                    names=args.names, dtype=args.dtype)
    else:  # export
        params, config = host_params(args.checkpoint)
        out = save_params(args.output, params, config, dtype=args.dtype)
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
