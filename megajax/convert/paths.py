"""Paths the conversion CLI receives: made absolute once, inputs checked, outputs built aside and swapped in whole."""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import tempfile
from collections.abc import Iterable, Iterator

from megajax.cli import OutputPathError


def absolute(path: str | pathlib.Path) -> pathlib.Path:
    """``path`` with ``~`` expanded, made absolute against the current directory (no symlinks resolved)."""
    return pathlib.Path(path).expanduser().absolute()


def existing_input(path: str, flag: str) -> pathlib.Path:
    """The absolute form of the input given as ``--flag=path``; FileNotFoundError naming the flag if it is absent."""
    resolved = absolute(path)
    if not resolved.exists():
        shown = path if str(resolved) == path else f"{path} ({resolved})"
        raise FileNotFoundError(f"--{flag}={shown} does not exist")
    return resolved


def contents(directory: pathlib.Path, limit: int = 6) -> str:
    """A short listing of a directory's entries (directories end in /), for error messages."""
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in directory.iterdir())
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def require_empty(directory: pathlib.Path, what: str) -> None:
    """FileExistsError if ``directory`` exists and is a file or holds anything (so nothing old mixes in)."""
    if directory.is_file():
        raise FileExistsError(f"{what} {directory} is a file, not a directory")
    if directory.is_dir() and any(directory.iterdir()):
        raise FileExistsError(f"{what} {directory} already holds {contents(directory)}")


@contextlib.contextmanager
def staged_output(output: pathlib.Path, *, overwrite: bool = False,
                  reads: Iterable[pathlib.Path] = ()) -> Iterator[pathlib.Path]:
    """Yields an empty directory beside ``output`` to write into; once the block succeeds it becomes ``output``.

    An ``output`` that already holds something is refused unless ``overwrite``; even then the old contents are
    removed only after the new ones are complete, so a conversion that fails half-way loses nothing. ``reads`` are
    the inputs: replacing one of them (or a directory holding one) is refused.
    """
    if not overwrite:
        try:
            require_empty(output, "--output")
        except FileExistsError as e:
            raise FileExistsError(f"{e}: pass a fresh --output, or --overwrite to replace it (the old contents "
                                  "are removed only once the new ones are complete)") from None
    for source in reads:
        if source == output or output in source.parents:
            raise ValueError(f"--output={output} would replace the input {source} being converted: "
                             "pass another --output")
    try:  # before any input is read: an unwritable place fails now, not after the conversion
        output.parent.mkdir(parents=True, exist_ok=True)
        staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{output.name}.partial-", dir=output.parent))
    except OSError as e:
        raise OutputPathError(f"--output={output} cannot be written ({e.strerror or e}); pick a writable "
                              "place") from None
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _swap_in(staging, output)


def _swap_in(staging: pathlib.Path, output: pathlib.Path) -> None:
    """Renames ``staging`` to ``output``; an existing ``output`` is moved aside first and deleted last."""
    if not (output.exists() or output.is_symlink()):
        staging.rename(output)
        return
    old = output.parent / f".{output.name}.replaced-{os.getpid()}-{staging.name.rsplit('-', 1)[-1]}"
    output.rename(old)
    staging.rename(output)
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old)
    else:
        old.unlink()
