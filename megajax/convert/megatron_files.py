"""Where a Megatron-LM checkpoint's files lie: ``DIR/latest_checkpointed_iteration.txt`` names an iteration directory
``DIR/iter_XXXXXXX`` (or ``DIR/release``) holding ``mp_rank_NN/model_optim_rng.pt`` for every tensor-parallel rank."""

from __future__ import annotations

import argparse
import pathlib
import re
from collections.abc import Iterable

from megajax.convert import torch_io
from megajax.convert.paths import require_empty
from megajax.outputs import MEGATRON_TRACKER

TRACKER = MEGATRON_TRACKER
RANK_FILE = "model_optim_rng.pt"


def iteration_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def _iterations(directory: pathlib.Path) -> str:
    names = sorted(p.name for p in directory.iterdir()
                   if p.is_dir() and (re.fullmatch(r"iter_\d+", p.name) or p.name == "release"))
    return ", ".join(names) or "none"


def iteration_dir(directory: pathlib.Path, iteration: int | None) -> pathlib.Path:
    """The iteration directory to read: ``iteration``'s, else the one the tracker file names."""
    if not directory.is_dir():
        raise FileNotFoundError(f"{directory} is not a directory: give a Megatron-LM checkpoint directory")
    if iteration is None:
        tracker = directory / TRACKER
        if not tracker.is_file():
            raise FileNotFoundError(f"{tracker} not found: give --iteration=N (iterations here: "
                                    f"{_iterations(directory)}) or a Megatron checkpoint directory")
        text = tracker.read_text().strip()
        if text != "release" and not text.isdigit():
            raise ValueError(f"{tracker} says {text!r}, neither an iteration number nor 'release'")
        name, source = ("release" if text == "release" else iteration_name(int(text))), f"named by {tracker.name}"
    else:
        name, source = iteration_name(iteration), f"--iteration={iteration}"
    it_dir = directory / name
    if not it_dir.is_dir():
        raise FileNotFoundError(f"{it_dir} ({source}) does not exist; iterations here: {_iterations(directory)}")
    return it_dir


def rank_files(it_dir: pathlib.Path) -> list[pathlib.Path]:
    """``mp_rank_NN/model_optim_rng.pt`` for ranks 0..N-1, in order; errors name missing, doubled or odd ranks."""
    entries = sorted(p.name for p in it_dir.iterdir() if p.name.startswith("mp_rank_"))
    if not entries:
        hint = (": it looks like a torch_dist checkpoint; save it with Megatron's --ckpt-format=torch first"
                if any(it_dir.glob("*.distcp")) else "")
        raise FileNotFoundError(f"no mp_rank_NN directories in {it_dir}{hint}")
    if any(re.fullmatch(r"mp_rank_\d+_\d+", name) for name in entries):
        raise ValueError(f"{it_dir} is pipeline-parallel (mp_rank_TT_PPP); convert it with pipeline size 1 first")
    ranks: dict[int, pathlib.Path] = {}
    for name in entries:
        match = re.fullmatch(r"mp_rank_(\d+)", name)
        if match is None or not (it_dir / name).is_dir():
            raise ValueError(f"{it_dir / name} is not a tensor-parallel rank directory (mp_rank_NN)")
        rank = int(match[1])
        if rank in ranks:
            raise ValueError(f"{it_dir} holds both {ranks[rank].name} and {name} for rank {rank}")
        ranks[rank] = it_dir / name
    missing = [f"mp_rank_{r:02d}" for r in range(max(ranks) + 1) if r not in ranks]
    if missing:
        raise ValueError(f"{it_dir} lacks {', '.join(missing)} (it holds {', '.join(entries)}): a tensor-parallel "
                         f"checkpoint needs every rank from mp_rank_00 to {ranks[max(ranks)].name}")
    files = [ranks[r] / RANK_FILE for r in range(len(ranks))]
    absent = [str(f) for f in files if not f.is_file()]
    if absent:
        raise FileNotFoundError(f"rank file(s) missing: {', '.join(absent)}")
    return files


def check_rank_count(it_dir: pathlib.Path, found: int, saved_tp: int | None) -> None:
    """Raises ValueError naming the rank directories missing (or extra) when the checkpoint's own args say another
    tensor-parallel size than the ``found`` mp_rank_NN directories."""
    if saved_tp is None or saved_tp == found:
        return
    if saved_tp > found:
        missing = ", ".join(f"mp_rank_{r:02d}" for r in range(found, saved_tp))
        there = "mp_rank_00" + (f"..mp_rank_{found - 1:02d} are" if found > 1 else " is")
        raise ValueError(f"{it_dir} lacks {missing}: its args say tensor_model_parallel_size={saved_tp} but only "
                         f"{there} there; copy the missing rank(s) from the save")
    raise ValueError(f"{it_dir} holds {found} rank directories but its args say tensor_model_parallel_size="
                     f"{saved_tp}: mp_rank_{saved_tp:02d} and above come from another save; remove them")


def write_ranks(directory: pathlib.Path, models: Iterable[dict], args: argparse.Namespace,
                iteration: int) -> pathlib.Path:
    """Saves rank r's ``model`` dict (the r-th of ``models``) with ``args`` and ``checkpoint_version`` 3.0, then the
    tracker naming ``iteration``; returns the iteration directory.

    ``directory`` must be new or empty, so no ranks or iterations of another save mix in. ``models`` may be a
    generator: each rank is built only when the one before is on disk, so one rank's tensors are in memory at a time.
    """
    require_empty(directory, "the Megatron output directory")
    it_dir = directory / iteration_name(iteration)
    for r, model in enumerate(models):
        (it_dir / f"mp_rank_{r:02d}").mkdir(parents=True)
        torch_io.save({"model": model, "checkpoint_version": 3.0, "iteration": iteration, "args": args},
                      it_dir / f"mp_rank_{r:02d}" / RANK_FILE)
    (directory / TRACKER).write_text(str(iteration))
    return it_dir
