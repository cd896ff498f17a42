"""Where training data comes from: ``data.source`` -> tokens + document offsets -> the model's batches.

The model's spec says how its examples are cut (an ``ExampleFormat``, or ``None`` for a fine-tuning model's task
rows); this module never asks which model it is. Every problem with the data (ids the model cannot embed, a split
too small for one batch) is raised here, before anything compiles, with the field to change. The functions read
the run's ``DataSettings`` (``config.data`` resolved, with the model's vocabulary and sequence length and the global
batch). Whether the model and the source fit each other is checked with the config
(``megajax.config.resolve.check_data_source``).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import numpy as np

from megajax.data.blend import BlendedBatches, BlendSpec, parse_blend
from megajax.data.default_corpus import cache_root
from megajax.data.formats import ExampleFormat
from megajax.data.gpt_dataset import split_by_documents
from megajax.data.indexed import META, IndexedTokens
from megajax.data.loader import Batches, Loader
from megajax.data.preference import PreferenceData, load_preference
from megajax.data.settings import PREFERENCE, DataSettings
from megajax.data.sft import SFTBatches, SFTData, load_sft
from megajax.data.tasks.batches import TrainBatches
from megajax.data.tasks.task_data import TaskData, load_task
from megajax.data.tfds_source import tfds_corpus
from megajax.errors import ConfigError

MAX_ID_CHUNK = 1 << 26  # ids per read when scanning a memory-mapped corpus for its largest id


@dataclasses.dataclass(frozen=True)
class BlendedData:
    """``data.blend``'s datasets, opened and checked, with their weights."""

    spec: BlendSpec
    datasets: list[IndexedTokens]


def max_token_id(tokens: np.ndarray) -> int:
    """The largest id in ``tokens`` (read in chunks, so a memory-mapped corpus is never loaded whole)."""
    return max((int(tokens[i:i + MAX_ID_CHUNK].max()) for i in range(0, len(tokens), MAX_ID_CHUNK)), default=-1)


def check_ids_fit(tokens: np.ndarray, meta: dict, vocab_size: int, what: str) -> None:
    """Raises ConfigError when the data's tokenizer or its largest id does not fit ``vocab_size``."""
    if meta.get("vocab_size", 0) > vocab_size:
        raise ConfigError(f"{what}'s tokenizer has {meta['vocab_size']} ids but model.vocab_size={vocab_size}; "
                          f"set --config.model.vocab_size={meta['vocab_size']} (or use data made with the model's "
                          "tokenizer)")
    top = max_token_id(tokens)
    if top >= vocab_size:
        raise ConfigError(f"{what} holds token id {top} but model.vocab_size={vocab_size}: the data was made with "
                          "a bigger tokenizer or the .bin file is damaged; re-run preprocessing with the model's "
                          f"tokenizer or set --config.model.vocab_size to at least {top + 1}")


# data.source of a converted model's stored config: weights from elsewhere, no training data (data.tokenizer: the
# tokenizer that came with them, if any)
CONVERTED = "converted"


Data = IndexedTokens | TaskData | BlendedData | SFTData | PreferenceData


def load_dataset(d: DataSettings, examples: ExampleFormat | None) -> Data:
    """The corpus named by ``d``, checked against the model's vocabulary (a fine-tuning task's rows for
    ``data.source='task'``, a decoder's packed fine-tuning examples for ``data.source='sft'``, several weighted
    corpora for ``data.blend``); ``examples``: the model's format (its default corpus), None for a fine-tuning
    model."""
    vocab = d.vocab_size
    if d.blend:
        if d.source != "indexed" or d.path:
            raise ConfigError(f"data.blend lists preprocessed datasets: set --config.data.source=indexed (not "
                              f"{d.source!r}) and leave data.path empty (got {d.path!r})")
        spec = parse_blend(d.blend)
        datasets = []
        for path in spec.paths:
            try:
                datasets.append(IndexedTokens.open(path))
            except (OSError, ValueError) as e:
                raise ConfigError(f"data.blend: dataset {path}: {e}") from e
            check_ids_fit(datasets[-1].tokens, datasets[-1].meta, vocab, f"data.blend's dataset {path}")
        tokenizers = [_tokenizer_text(ds) for ds in datasets]
        for path, text in zip(spec.paths[1:], tokenizers[1:]):
            if text != tokenizers[0]:
                raise ConfigError(f"data.blend: {path} was preprocessed with another tokenizer than {spec.paths[0]}"
                                  " (their ids mean different tokens); preprocess every dataset with one tokenizer")
        return BlendedData(spec, datasets)
    if d.source == CONVERTED:
        raise ConfigError(f"data.source={CONVERTED} marks a converted model's config, which names no training data; "
                          "train with a config file (and --config.init_from=THE_CONVERTED_MODEL to start from it)")
    if d.source == "task":
        return load_task(d)
    if d.source == "sft":
        return load_sft(d)
    if d.source == PREFERENCE:
        return load_preference(d)
    if d.source == "default":  # the model's offline corpus (formats.WINDOWS, formats.SENTENCE_PAIRS)
        data = examples.default_corpus(vocab)[0]
    elif d.source == "indexed":
        if not d.path:
            raise ConfigError("data.source=indexed needs --config.data.path=PREFIX (from python -m "
                              "megajax.data.preprocess --output_prefix=PREFIX)")
        data = IndexedTokens.open(d.path)
    elif d.source == "tfds":
        data = tfds_corpus(d.tfds_name, d.tfds_split, d.tfds_feature, d.tokenizer, cache_root(), d.tfds_data_dir,
                           d.min_tokens)
    elif d.source == "random":  # labelled: uniform tokens, the loss cannot fall below log(vocab)
        tokens = np.random.default_rng(d.seed).integers(0, vocab, 1 << 20, dtype=np.int32)
        return IndexedTokens(tokens, np.arange(0, len(tokens) + 1, 1024), {"vocab_size": vocab})
    else:
        raise ConfigError(f"data.source={d.source!r}; choose default, indexed, tfds, random, task, sft or preference")
    check_ids_fit(data.tokens, data.meta, vocab, f"the dataset of data.source={d.source}")
    return data


def trained_tokenizer(d: DataSettings, examples: ExampleFormat | None) -> str:
    """The path of the tokenizer a run's data was made with (``d``: a checkpoint's data settings; ``examples``: its
    model's format), or "" where the data names none (random tokens, a converted model without one, Megatron-LM's).
    KeyError / OSError / ValueError where the data's record of it cannot be read."""
    if d.source == "default" and examples is not None:  # the model's own offline corpus
        return str(examples.default_corpus(d.vocab_size)[1])
    if d.source in (CONVERTED, "tfds", "sft", PREFERENCE, "task"):
        return d.tokenizer
    if d.source == "indexed" and d.path:  # the sidecar names the tokenizer; the token files are not needed
        return json.loads(pathlib.Path(f"{d.path}{META}").read_text())["tokenizer"]
    return ""


def tokenizer_fingerprint(data: Data) -> str:
    """The vocabulary fingerprint of the tokenizer that made ``data`` (``tokenizer.vocabulary_fingerprint``; a
    blend's datasets share one), or "" when unknown (random tokens, synthetic tasks, older datasets)."""
    if isinstance(data, BlendedData):
        return data.datasets[0].tokenizer_fingerprint()
    if isinstance(data, TaskData | SFTData | PreferenceData):
        return data.tokenizer_fingerprint
    return data.tokenizer_fingerprint()


def _tokenizer_text(data: IndexedTokens) -> str | None:
    path = data.tokenizer_path()
    return path.read_text(encoding="utf-8") if path is not None and path.is_file() else None


def _split_hint(split: str, d: DataSettings) -> str:
    if split == "valid":
        return (f"the validation split (the documents after the boundary nearest the last data.valid_fraction="
                f"{d.valid_fraction:.4g} of the tokens) is too small: raise --config.data.valid_fraction, or "
                "set --config.train.eval_batches=0 to train without validation")
    return "the training split is too small: use more data, a smaller train.global_batch_size or model.max_seq_len"


def make_loader(d: DataSettings, examples: ExampleFormat | None, split: str = "train",
                data: Data | None = None) -> Loader:
    """The loader of ``split`` ('train' or 'valid') of the model's ``examples`` (None: task rows), positioned at
    step 0."""
    data = load_dataset(d, examples) if data is None else data
    if isinstance(data, TaskData):  # fine-tuning: shuffled rows of the split (validation reads its first batches)
        return Loader(TrainBatches(data.train if split == "train" else data.valid, d.global_batch_size, d.seed))
    if isinstance(data, SFTData | PreferenceData):  # packed rows, shuffled per epoch (validation: its first)
        rows = data.train if split == "train" else data.valid
        if len(rows) < (d.global_batch_size if split == "train" else 1):
            what = "pairs" if isinstance(data, PreferenceData) else "examples"
            if split == "valid":  # validation reads what rows there are: it needs one
                raise ConfigError(f"data.path={d.path}: the validation split (the file's last data.valid_fraction="
                                  f"{d.valid_fraction:.4g} of its {what}) holds no {what}: raise "
                                  "--config.data.valid_fraction, or set --config.train.eval_batches=0 to train "
                                  "without validation")
            raise ConfigError(f"data.path={d.path}: the train split's {rows.examples} {what} pack into "
                              f"{len(rows)} rows of {d.max_seq_len + 1} tokens (model.max_seq_len={d.max_seq_len} "
                              f"+ 1) and one step needs train.global_batch_size={d.global_batch_size}; use more "
                              f"examples or a smaller train.global_batch_size (or, with several {what} a row, a "
                              "smaller model.max_seq_len)")
        return Loader(SFTBatches(rows, d.global_batch_size, d.seed, data.fingerprint))
    if isinstance(data, BlendedData):  # each dataset split alike, then mixed by weight
        parts = [_corpus_batches(d, examples, part, split, f"data.blend's dataset {path}")
                 for path, part in zip(data.spec.paths, data.datasets)]
        return Loader(BlendedBatches(parts, data.spec.weights, d.global_batch_size, data.spec.paths))
    return Loader(_corpus_batches(d, examples, data, split, ""))


def _corpus_batches(d: DataSettings, examples: ExampleFormat, data: IndexedTokens, split: str,
                    which: str) -> Batches:
    """The model's examples of one corpus's ``split``; ConfigError when it cannot fill a batch."""
    train_range, valid_range = split_by_documents(data.offsets, d.valid_fraction)
    token_range = train_range if split == "train" else valid_range
    b, seq = d.global_batch_size, d.max_seq_len
    try:
        batches = examples.batches(d, data, token_range)
    except ValueError as e:
        hint = _split_hint(split, d) + "; " if "two sentences" in str(e) else ""
        raise ConfigError(f"{hint}{e}") from e
    n = examples.count(batches)
    if n == 0 or (split == "train" and n < b and not which):
        tokens = token_range[1] - token_range[0]
        raise ConfigError(f"{which + ': ' if which else ''}{_split_hint(split, d)} ({tokens} tokens make {n} "
                          f"{examples.unit(seq)}; one step needs train.global_batch_size={b})")
    return batches
