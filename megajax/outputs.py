"""Where a command may write: the one rule every megajax command that writes applies before it starts.

A command writes only paths it owns:
- never on, inside or above one of its own inputs;
- never on or inside a training workdir or a training checkpoint, never on a dataset's files (but for
  ``preprocess --overwrite``, whose output is a dataset), and never inside a model directory (megajax, Hugging
  Face or Megatron-LM), even with ``--overwrite``;
- an output that already exists is replaced only with ``--overwrite``, and only when it is output of the same kind
  (an export replaces an earlier export, a results file a results file, a dataset a dataset); ``--overwrite``
  never replaces what megajax does not recognise as its own kind of output.

This module also holds the on-disk names those kinds are recognised by (a workdir's entries, a dataset's
suffixes, a Megatron-LM tracker file); the modules that write them import the names from here, so what is written
and what is recognised cannot drift apart. It imports only ``errors``.
"""

from __future__ import annotations

import enum
import json
import os
import pathlib
import re
import tempfile
from collections.abc import Iterable

from megajax.errors import UserError

# A training workdir: train.py's lock and metrics, and orbax's checkpoints/<step>/ directories.
LOCK_NAME, METRICS_NAME, CHECKPOINTS_NAME = "train.lock", "metrics.jsonl", "checkpoints"
# A checkpoint step directory holds config/ and either state/ (training: with the optimizer) or params/ (a model).
STEP_CONFIG, STEP_STATE, STEP_PARAMS = "config", "state", "params"
# A preprocessed dataset PREFIX: PREFIX.bin (token ids), PREFIX.idx.npy (document offsets), PREFIX.json (the
# sidecar, written last: it marks a complete dataset), and optionally sentence and tokenizer files.
TOKENS, INDEX, META = ".bin", ".idx.npy", ".json"
SENTENCES, DOC_SENTENCES, TOKENIZER = ".sentences.npy", ".doc_sentences.npy", ".tokenizer.json"
DATASET_SUFFIXES = (TOKENS, INDEX, SENTENCES, DOC_SENTENCES, TOKENIZER, META)  # META last: it marks completion
# A Megatron-LM checkpoint directory names its latest iteration in this file.
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
# A Hugging Face model directory: config.json beside one of these weight files (or their .index.json).
HF_WEIGHTS = ("model.safetensors", "pytorch_model.bin")
# ... and the tokenizer files megajax-to-hf writes beside them (transformers' names; the named chat templates' folder)
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                      "chat_template.json", "processor_config.json")
HF_TEMPLATE_DIR = "additional_chat_templates"
# ``megajax.info --hlo``'s first line: an HLO comment (XLA's parser skips it), by which a later run knows its file.
HLO_HEADER = "// megajax.info --hlo: "


class OutputPathError(UserError, ValueError):
    """An output path a command must not write (an input, a checkpoint, a dataset, an existing file) or cannot."""


class Kind(enum.Enum):
    """What megajax recognises at a path; the value is how messages name it."""

    WORKDIR = "a training workdir"
    CHECKPOINTS = "a training run's checkpoints directory"
    CHECKPOINT = "a training checkpoint"
    MODEL = "a megajax model checkpoint"
    HF_MODEL = "a Hugging Face model directory"
    MEGATRON = "a Megatron-LM checkpoint"
    DATASET = "part of a preprocessed dataset"
    RESULTS = "a JSON results file"
    PREDICTIONS = "a JSON predictions file"
    HLO = "a compiled step's HLO text"


# Never replaced nor written into, whatever the flags: what training made and what it reads.
PROTECTED = (Kind.WORKDIR, Kind.CHECKPOINTS, Kind.CHECKPOINT, Kind.DATASET)
# Directories nothing else is written into (a file inside would pass for part of them, or be lost with them).
DIRECTORY_KINDS = (Kind.WORKDIR, Kind.CHECKPOINTS, Kind.CHECKPOINT, Kind.MODEL, Kind.HF_MODEL, Kind.MEGATRON)


def _is_step(path: pathlib.Path, item: str) -> bool:
    return (path / STEP_CONFIG).is_dir() and (path / item).is_dir()


def _steps_holding(path: pathlib.Path, item: str) -> bool:
    """Whether a directory holds numbered step directories with ``item`` (state/ or params/)."""
    try:
        return any(p.name.isdigit() and _is_step(p, item) for p in path.iterdir())
    except OSError:
        return False


def dataset_prefix(path: str | pathlib.Path) -> pathlib.Path | None:
    """The dataset prefix a file belongs to (``d/small`` for ``d/small.json``), if its token or index file is
    there; else None."""
    name = str(path)
    for suffix in sorted(DATASET_SUFFIXES, key=len, reverse=True):
        if name.endswith(suffix) and is_dataset(name[: -len(suffix)]):
            return pathlib.Path(name[: -len(suffix)])
    return None


def is_dataset(prefix: str | pathlib.Path) -> bool:
    """Whether a preprocessed dataset (complete or not) lies at ``prefix``: its token or index file exists."""
    return any(os.path.isfile(f"{prefix}{suffix}") for suffix in (TOKENS, INDEX))


def kind_of(path: str | pathlib.Path) -> Kind | None:
    """What megajax recognises at ``path`` (None: nothing it knows, or nothing there). Results files are not
    recognised here (``json_kind``): any JSON could be one."""
    p = pathlib.Path(path)
    if p.is_file():
        return Kind.DATASET if dataset_prefix(p) else None
    if not p.is_dir():
        return None
    if _is_step(p, STEP_STATE):
        return Kind.CHECKPOINT
    if _is_step(p, STEP_PARAMS) or _steps_holding(p, STEP_PARAMS):
        return Kind.MODEL
    if _steps_holding(p, STEP_STATE):
        return Kind.CHECKPOINTS
    if (p / LOCK_NAME).is_file() or (p / METRICS_NAME).is_file() or kind_of(p / CHECKPOINTS_NAME) is Kind.CHECKPOINTS:
        return Kind.WORKDIR
    if (p / MEGATRON_TRACKER).is_file() or (p / "release").is_dir() or any(p.glob("iter_*/mp_rank_*")):
        return Kind.MEGATRON
    if (p / "config.json").is_file() and any((p / w).is_file() or (p / f"{w}.index.json").is_file()
                                             for w in HF_WEIGHTS):
        return Kind.HF_MODEL
    return None


def hlo_kind(path: pathlib.Path) -> Kind | None:
    """``Kind.HLO`` where the file begins with ``HLO_HEADER`` (what ``megajax.info --hlo`` writes), else None."""
    try:
        with open(path, "rb") as f:
            return Kind.HLO if f.read(len(HLO_HEADER)) == HLO_HEADER.encode() else None
    except OSError:
        return None


def json_kind(path: pathlib.Path) -> Kind | None:
    """What a megajax command wrote at ``path``, judged by its content: results (one JSON object with a "task": eval.py,
    the seeds' median), predictions (one JSON object of answers or scores, flat (SQuAD's official files) or per
    split), or None."""
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(value, dict):
        return None
    if "task" in value:
        return Kind.RESULTS
    scalar = (str, int, float, bool, type(None))
    flat = lambda d: all(isinstance(v, scalar) for v in d.values())  # noqa: E731
    if flat(value) or all(isinstance(v, dict) and flat(v) for v in value.values()):
        return Kind.PREDICTIONS
    return None


# What a command writes into each kind of directory: ``--overwrite`` never deletes anything else that is in one.
WRITTEN = {Kind.MODEL: re.compile(r"\d+"),
           Kind.HF_MODEL: re.compile("|".join(map(re.escape, ("config.json", "model.safetensors", *HF_TOKENIZER_FILES,
                                                              HF_TEMPLATE_DIR)))),
           Kind.MEGATRON: re.compile(rf"{re.escape(MEGATRON_TRACKER)}|iter_\d+|release")}


def absolute(path: str | pathlib.Path) -> pathlib.Path:
    """``path`` with ``~`` expanded, absolute and normalised (``a/../b`` -> ``b``), symbolic links kept."""
    return pathlib.Path(os.path.abspath(os.path.expanduser(str(path))))


def checked_name(path: str | pathlib.Path, flag: str, what: str) -> str:
    """``path`` as given, refused when empty or blank (it would name the current directory, or a file ' ')."""
    text = str(path)
    if not text.strip() or text != text.strip():
        problem = "has leading or trailing spaces" if text.strip() else "is empty"
        raise OutputPathError(f"--{flag}={text!r} {problem}; give {what}")
    return text


def _real(path: pathlib.Path) -> pathlib.Path:
    return pathlib.Path(os.path.realpath(path))


def _inside(path: pathlib.Path, other: pathlib.Path) -> bool:
    return path != other and path.is_relative_to(other)


def _check_inputs(output: pathlib.Path, label: str, inputs: Iterable[str | pathlib.Path | None]) -> None:
    """Refuses an output that is, is inside or holds one of the ``inputs`` (symbolic links followed)."""
    real = _real(output)
    for given in inputs:
        if not given:
            continue
        source = _real(pathlib.Path(given).expanduser())
        where = ("is" if real == source else "is inside" if _inside(real, source)
                 else "holds" if _inside(source, real) else None)
        if where:
            raise OutputPathError(f"{label} {where} the input {given}: a command never writes on, inside or above "
                                  "what it reads; write the output elsewhere")


def _check_not_inside_recognised(output: pathlib.Path, label: str) -> None:
    """Refuses an output inside a workdir, a checkpoint or a model directory: the nearest one is named, and the
    suggestion lies beside the outermost one."""
    real = _real(output)
    found = [(parent, kind_of(parent)) for parent in real.parents]
    found = [(parent, kind) for parent, kind in found if kind in DIRECTORY_KINDS]
    if found:
        (parent, kind), outer = found[0], found[-1][0]
        raise OutputPathError(f"{label} is inside {parent}, which is {kind.value}: megajax writes nothing into "
                              f"it, even with --overwrite; write it outside, e.g. at "
                              f"{outer.parent / f'{outer.name}-{real.name}'}")


def _refuse_existing(label: str, found: Kind | str, want: Kind, overwrite: bool) -> None:
    """Raises unless an existing ``found`` may be replaced by output of kind ``want``."""
    what = found.value if isinstance(found, Kind) else found
    if found in PROTECTED and not (found is want and overwrite):
        keep = "even with --overwrite" if found is not want else "without --overwrite"
        raise OutputPathError(f"{label} is {what}: megajax does not write over it {keep}; write the output "
                              "elsewhere")
    if found is want and not overwrite:
        raise OutputPathError(f"{label} already exists ({what}): pass --overwrite to replace it (the old one is "
                              "removed only once the new one is complete), or write the output elsewhere")
    if found is not want:
        raise OutputPathError(f"{label} already holds {what}, not {want.value}: --overwrite replaces only "
                              f"{want.value}, an earlier output of this kind; write the output elsewhere, or "
                              "remove it yourself")


def _listing(directory: pathlib.Path, limit: int = 4) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in directory.iterdir())
    return ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def claim_directory(path: str | pathlib.Path, kind: Kind, *, flag: str = "output",
                    inputs: Iterable[str | pathlib.Path | None] = (), overwrite: bool = False) -> pathlib.Path:
    """Checks that a command may write ``kind`` (a directory) at ``path``; returns it absolute. An empty or absent
    directory is free; one holding ``kind`` (and nothing else) needs ``overwrite``; anything else is refused.
    Writes nothing."""
    output = absolute(checked_name(path, flag, "a new directory"))
    label = f"--{flag}={path}"
    _check_inputs(output, label, inputs)
    found = kind_of(output)
    if found in PROTECTED:
        _refuse_existing(label, found, kind, overwrite)
    _check_not_inside_recognised(output, label)
    if output.exists() and not output.is_dir():
        raise OutputPathError(f"{label} is a file, not a directory; give a new directory")
    if output.is_dir() and any(output.iterdir()):
        _refuse_existing(label, found or f"other files ({_listing(output)})", kind, overwrite)
        foreign = sorted(p.name for p in output.iterdir() if not WRITTEN[kind].fullmatch(p.name))
        if foreign:
            raise OutputPathError(f"{label} also holds {', '.join(foreign[:4])}{' ...' if len(foreign) > 4 else ''}, "
                                  f"which {kind.value} megajax writes does not: replacing it would delete them; move "
                                  "them out, or write the output elsewhere")
    return output


def claim_folder(path: str | pathlib.Path, *, flag: str, inputs: Iterable[str | pathlib.Path | None] = (),
                 accept: Kind | None = None) -> pathlib.Path:
    """Checks a directory a command adds its own new files to (training's workdir, lm-eval's results folder): new,
    empty, of kind ``accept``, or holding other files beside which it adds its own; never an input, inside or
    above one, or anything else megajax recognises, nor inside a workdir, checkpoint or model directory. Returns it
    absolute. Writes nothing."""
    output = absolute(checked_name(path, flag, f"a directory, e.g. --{flag}=runs/first"))
    label = f"--{flag}={path}"
    if output.is_symlink() and not output.exists():
        raise OutputPathError(f"{label} is a symbolic link to {os.readlink(output)}, which does not exist; give a "
                              "directory, or make the link's target first")
    _check_inputs(output, label, inputs)
    found = kind_of(output)
    if found not in (None, accept):
        raise OutputPathError(f"{label} is {found.value}{f', not {accept.value}' if accept else ''}; give a new "
                              "directory")
    if output.exists() and not output.is_dir():
        raise OutputPathError(f"{label} is a file, not a directory; give a directory")
    _check_not_inside_recognised(output, label)
    return output


def claim_workdir(path: str | pathlib.Path, inputs: Iterable[str | pathlib.Path | None] = ()) -> pathlib.Path:
    """``claim_folder`` for a training workdir: an existing one is resumed; other files in it are left alone."""
    return claim_folder(path, flag="workdir", inputs=inputs, accept=Kind.WORKDIR)


def claim_file(path: str | pathlib.Path | None, *, flag: str = "output",
               inputs: Iterable[str | pathlib.Path | None] = (), overwrite: bool = False,
               label: str | None = None, kind: Kind = Kind.RESULTS) -> pathlib.Path | None:
    """Checks that a command may write a file of ``kind`` at ``path`` (given as ``--flag``; None: not asked for)
    before the work starts: not a directory, in an existing writable directory, not an input, not inside a
    workdir, checkpoint or model directory, not a dataset's file; an existing file of ``kind`` (results or
    predictions, ``json_kind``; HLO text, ``hlo_kind``) needs ``overwrite``, any other is refused. ``label`` names
    the file in messages (default ``--flag=path``). Returns it absolute and normalised. Writes nothing."""
    if path is None:
        return None
    example = "step.hlo" if kind is Kind.HLO else "results.json"
    text = checked_name(path, flag, f"a file name, e.g. --{flag}={example}")
    output = absolute(text)
    label = label or f"--{flag}={path}"
    if text.endswith(os.sep) or output.is_dir():
        raise OutputPathError(f"{label} is a directory; give a file name, e.g. --{flag}={output / example}")
    _check_inputs(output, label, inputs)
    _check_not_inside_recognised(output, label)
    if output.is_file():
        found = kind_of(output) or hlo_kind(output) or json_kind(output) or "a file megajax did not write"
        _refuse_existing(label, found, kind, overwrite)
    if not output.parent.is_dir():
        raise OutputPathError(f"{label}: the directory {output.parent} does not exist; create it first")
    try:
        if output.exists():
            open(output, "a").close()  # opening to append changes neither its bytes nor its time
        else:
            tempfile.TemporaryFile(dir=output.parent).close()
    except OSError as e:
        raise OutputPathError(f"{label} cannot be written ({e.strerror or e}); pick a writable place") from None
    return output


def claim_dataset(prefix: str | pathlib.Path, *, flag: str = "output_prefix",
                  inputs: Iterable[str | pathlib.Path | None] = (), overwrite: bool = False) -> pathlib.Path:
    """Checks that preprocessing may write a dataset at ``prefix`` (``PREFIX.bin``, ``PREFIX.json``, ...): a file
    prefix, not a directory; none of its files an input, inside or above one; an existing dataset there needs
    ``overwrite``, any other file at one of its names is refused. Returns the prefix, absolute. Writes nothing."""
    text = checked_name(prefix, flag, f"a file prefix, e.g. --{flag}=data/corpus")
    output = absolute(text)
    label = f"--{flag}={prefix}"
    if text.endswith(os.sep) or output.is_dir():
        raise OutputPathError(f"{label} is a directory; give a file prefix inside it, e.g. --{flag}="
                              f"{output / 'corpus'} (which writes corpus{TOKENS}, corpus{INDEX}, corpus{META} there)")
    files = [pathlib.Path(f"{output}{suffix}") for suffix in DATASET_SUFFIXES]
    _check_inputs(output, label, inputs)
    for f in files:
        _check_inputs(f, f"{label}: its file {f}", inputs)
    existing = [f for f in files if f.exists()]
    if existing and not is_dataset(output):
        raise OutputPathError(f"{label}: {existing[0]} exists and is not part of a dataset; write the dataset "
                              "elsewhere, or remove it yourself")
    if existing and not overwrite:
        raise OutputPathError(f"{label}: a dataset already lies there ({', '.join(f.name for f in existing)}); pass "
                              "--overwrite to replace it (the old one stays until the new one is complete), or "
                              "write the dataset elsewhere")
    _check_not_inside_recognised(output, label)
    return output


def write_json(path: str | pathlib.Path, value: object) -> pathlib.Path:
    """Writes ``value`` as indented JSON to ``path`` (claimed before the work with ``claim_file``), as
    ``write_text`` does."""
    return write_text(path, json.dumps(value, indent=1) + "\n")


def write_text(path: str | pathlib.Path, text: str) -> pathlib.Path:
    """Writes ``text`` to ``path`` (claimed before the work with ``claim_file``) through a temporary file beside
    it, so a kill mid-write leaves the old file or none, never half of one."""
    path = pathlib.Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.partial-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        pathlib.Path(tmp).unlink(missing_ok=True)
        raise
    return path


def make_directory(path: str | pathlib.Path) -> list[pathlib.Path]:
    """Creates ``path`` and its missing parents; returns those it created, innermost first, for
    ``remove_created`` to take back if the command fails."""
    path = pathlib.Path(path)
    created = [d for d in (path, *path.parents) if not d.exists()]
    path.mkdir(parents=True, exist_ok=True)
    return created


def remove_created(directories: Iterable[pathlib.Path]) -> None:
    """Removes directories a failed command created (innermost first), each only if it is still empty."""
    for d in directories:
        try:
            d.rmdir()
        except OSError:
            return
