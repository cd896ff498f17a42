"""python -m megajax.convert SUBCOMMAND ...  (GPT, BERT and Llama checkpoints)

  hf-to-megajax        --hf=DIR --output=OUT [--make_vocab_size_divisible_by=N]
  megajax-to-hf        --checkpoint=CK --output=DIR
  megatron-to-megajax  --megatron=DIR --output=OUT --vocab_size=N [--iteration=N] [--config=NAME]
  megajax-to-megatron  --checkpoint=CK --output=DIR --tp=N [--names=legacy|core] [--dtype=float16]
  export               --checkpoint=CK --output=OUT [--dtype=bfloat16]

CK is any megajax checkpoint: a training workdir, its checkpoints/ directory, one step, or an export.
The model is found from the input: an HF config.json's model_type (gpt2, bert, megatron-bert, llama), a Megatron-LM
checkpoint's tensors (BERT holds an lm_head and binary_head), a megajax checkpoint's model.name.
--make_vocab_size_divisible_by pads the vocabulary to a multiple of N: by default GPT-2's and BERT's to a multiple of
1024 (the paper's), Llama's not at all (its vocabularies already split over 8 shards). The Megatron verbs convert
GPT and BERT only.
megajax outputs are params-only checkpoints that ``megajax.load_model`` and training both read.
Every verb refuses an --output on, inside or above its input, on or inside a training workdir or checkpoint, or
inside a model directory. An --output that already holds something is refused unless --overwrite is given and it
holds an earlier output of the same kind (a megajax model, a Hugging Face or a Megatron-LM directory); the output
is written beside it and renamed into place, so a conversion that fails leaves what was there untouched.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import jax
import ml_collections
import numpy as np
from flax import nnx

from megajax.checkpoint import save_params
from megajax.cli import ArgumentParser, fail, load_config, start_backend
from megajax.config import RunSpec, model_config
from megajax.config.load import inference_config, restore_model
from megajax.convert import hf_io, megatron_bert, megatron_gpt
from megajax.convert.config_json import ConfigJsonError
from megajax.convert.paths import existing_input, staged_output
from megajax.data.sources import CONVERTED, trained_tokenizer
from megajax.data.tokenizer import load_tokenizer
from megajax.data.tokenizer_folder import write_folder
from megajax.outputs import Kind, absolute, checked_name

INPUT_FLAGS = {"hf-to-megajax": "hf", "megatron-to-megajax": "megatron", "megajax-to-hf": "checkpoint",
               "megajax-to-megatron": "checkpoint", "export": "checkpoint"}
# what each verb writes: --overwrite replaces only an earlier output of the same kind
OUTPUT_KINDS = {"hf-to-megajax": Kind.MODEL, "megatron-to-megajax": Kind.MODEL, "megajax-to-hf": Kind.HF_MODEL,
                "megajax-to-megatron": Kind.MEGATRON, "export": Kind.MODEL}


def host_params(checkpoint: str | pathlib.Path) -> tuple[dict, ml_collections.ConfigDict, RunSpec]:
    """(parameters as host numpy arrays, the config stored with them, its resolved run) of any megajax checkpoint,
    read on one device: the config is what an export stores again, the run's model what the converters read."""
    config = inference_config(checkpoint, data=1, model=1)
    loaded = restore_model(checkpoint, config)
    return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(loaded.model))), config, loaded.spec


def _positive(text: str) -> int:
    """An argparse type: a whole number >= 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give a whole number >= 1")
    return value


def _parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m megajax.convert", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    verbs = {name: sub.add_parser(name) for name in INPUT_FLAGS}
    for name, parser in verbs.items():
        parser.add_argument(f"--{INPUT_FLAGS[name]}", required=True)
        parser.add_argument("--output", required=True)
        parser.add_argument("--overwrite", action="store_true",
                            help="replace what --output holds (only once the new output is complete)")
    verbs["hf-to-megajax"].add_argument("--make_vocab_size_divisible_by", type=int, default=None,
                                        help="pad the vocabulary to a multiple of this (default: the converter's, "
                                             "1024 for GPT-2 and BERT, 1 for Llama)")
    c = verbs["megatron-to-megajax"]
    c.add_argument("--iteration", type=int, default=None)
    c.add_argument("--vocab_size", type=int, default=None,
                   help="the tokenizer's true vocabulary (Megatron stores only the padded size), e.g. 50257 for "
                        "GPT-2's BPE, 30522 for BERT's uncased WordPiece; overrides --config's")
    c.add_argument("--config", default=None, help="megajax config, if the checkpoint stores no args")
    d = verbs["megajax-to-megatron"]
    d.add_argument("--tp", type=_positive, required=True, help="tensor-parallel ranks to write (>= 1)")
    d.add_argument("--names", choices=["legacy", "core"], default="legacy")
    d.add_argument("--iteration", type=int, default=0)
    d.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    verbs["export"].add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    for name in ("hf-to-megajax", "megatron-to-megajax"):
        verbs[name].add_argument("--allow_pickle", action="store_true",
                                 help="trust pickled code in .bin/.pt files")
    return p


def _hf_to_megajax(args, source: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    hf = hf_io.read_config(source)
    converter = hf_io.converter_for(hf, source)  # before reading weights, which may be large
    pad = args.make_vocab_size_divisible_by
    try:
        config = converter.config_from_hf(hf) if pad is None else converter.config_from_hf(hf, pad)
    except ConfigJsonError as e:  # the field, and which config.json
        raise e.at(source / "config.json") from None
    model = model_config(config)  # its checks, too, before the weights are read
    sd = hf_io.read_weights(source, args.allow_pickle)
    if hasattr(converter, "as_held"):  # config.json as the weights hold it (DeepSeek's MTP layers)
        config = converter.config_from_hf(converter.as_held(hf, sd), *([] if pad is None else [pad]))
        model = model_config(config)
    params = converter.params_from_hf(sd, model)
    fingerprint = _tokenizer_fingerprint(source, model.vocab_size)
    # no training data to name; the tokenizer that came with the weights (evaluation reads it)
    config.data.update(source=CONVERTED, tokenizer=str(source) if fingerprint else "",
                       tokenizer_fingerprint=fingerprint)
    return save_params(out, params, config.to_json())


def _tokenizer_fingerprint(source: pathlib.Path, vocab_size: int) -> str:
    """The vocabulary fingerprint of the tokenizer saved beside the weights (tokenizer.json, vocab.json + merges.txt
    or vocab.txt), recorded so that fine-tuning, evaluation and training on data of another vocabulary of the same
    size are refused; "" (nothing to compare) where the directory holds none, or none megajax reads or that fits."""
    try:
        tokenizer = load_tokenizer(source)
    except ValueError:  # no tokenizer files, or no end-of-document token in them
        return ""
    except Exception as e:  # a damaged file: the weights still convert
        print(f"note: the tokenizer in {source} could not be read ({e}); no vocabulary fingerprint recorded",
              file=sys.stderr)
        return ""
    return tokenizer.fingerprint if tokenizer.vocab_size <= vocab_size else ""


def _megajax_to_hf(args, source: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    params, _, run = host_params(source)
    converter = hf_io.writer_for(run.model_name)
    hf = converter.hf_config(run.model)
    hf_io.write(out, converter.params_to_hf(params, run.model), hf)
    try:  # the run's tokenizer beside the weights, so AutoTokenizer.from_pretrained(out) reads it
        tokenizer = trained_tokenizer(run.dataset, run.model_spec.examples)
        ids = write_folder(tokenizer, out) if tokenizer else None
    except (OSError, ValueError, KeyError) as e:
        tokenizer, ids = f"{tokenizer} ({e})", None
    if ids is None:
        print(f"note: {source} names no tokenizer megajax can read{f': {tokenizer}' if tokenizer else ''}; copy the "
              f"model's tokenizer files into {args.output} by hand", file=sys.stderr)
    elif run.model_spec.causal_lm:  # generation stops at the tokenizer's end id
        hf_io.write_config(out, {**hf, **ids})
    return out


def _megatron_to_megajax(args, source: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    given = load_config(args.config) if args.config else None
    reader = megatron_bert if megatron_bert.holds_bert(source, args.iteration, args.allow_pickle) else megatron_gpt
    params, config = reader.read_megatron(source, None if given is None else model_config(given),
                                          iteration=args.iteration, vocab_size=args.vocab_size,
                                          allow_pickle=args.allow_pickle)
    if given is not None:  # stored with --config's other settings (its mesh, its precision), as it says
        given.model = config.model
        config = given
    config.data.update(source=CONVERTED, path="", tokenizer="")  # Megatron saves no tokenizer or data path
    return save_params(out, params, config.to_json())


def _megajax_to_megatron(args, source: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    params, _, run = host_params(source)
    if run.model_name not in ("gpt", "bert"):
        raise ValueError(f"{source} holds a model.name={run.model_name!r} model: megajax-to-megatron writes GPT "
                         "and BERT only")
    writer = megatron_bert if run.model_name == "bert" else megatron_gpt
    return writer.write_megatron(out, params, run.model, args.tp, iteration=args.iteration, names=args.names,
                                 dtype=args.dtype)


def _export(args, source: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    params, config, _ = host_params(source)
    return save_params(out, params, config.to_json(), dtype=args.dtype)


VERBS = {"hf-to-megajax": _hf_to_megajax, "megajax-to-hf": _megajax_to_hf,
         "megatron-to-megajax": _megatron_to_megajax, "megajax-to-megatron": _megajax_to_megatron, "export": _export}


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    start_backend()
    flag = INPUT_FLAGS[args.command]
    # Paths are made absolute here, once, so every verb and library below sees the same file whatever the cwd.
    source = existing_input(getattr(args, flag), flag)
    output = absolute(checked_name(args.output, "output", "a new directory"))
    with staged_output(output, OUTPUT_KINDS[args.command], overwrite=args.overwrite, reads=[source]) as staging:
        written = pathlib.Path(VERBS[args.command](args, source, staging)).absolute()
    print(f"wrote {output / written.relative_to(staging)}", file=sys.stderr)


# What a user can fix from the message alone (wrong paths, sizes, flags, a missing extra): no traceback.
USER_ERRORS = (ValueError, KeyError, FileNotFoundError, FileExistsError, ImportError)

if __name__ == "__main__":
    from megajax.checkpoint import CheckpointError
    from megajax.cli import BackendError

    try:
        main()
    except (*USER_ERRORS, CheckpointError, BackendError) as e:
        fail(e, e.args[0] if isinstance(e, KeyError) and e.args else None)
