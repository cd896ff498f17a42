"""Paths the conversion CLI receives: made absolute once, inputs checked, outputs built aside and swapped in whole."""

from __future__ import annotations

import contextlib
import os
import pathlib
import shutil
import tempfile
from collections.abc import Iterable, Iterator

from megajax.outputs import Kind, OutputPathError, absolute, claim_directory, make_directory, remove_created


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
def staged_output(output: pathlib.Path, kind: Kind, *, overwrite: bool = False,
                  reads: Iterable[pathlib.Path] = ()) -> Iterator[pathlib.Path]:
    """Yields an empty directory beside ``output`` to write into; once the block succeeds it becomes ``output``.

    Where ``output`` may go is ``megajax.outputs.claim_directory``'s rule (never on, in or above an input in
    ``reads``, a workdir or a checkpoint; an existing ``kind`` replaced only with ``overwrite``). Even then the old
    contents are removed only after the new ones are complete, so a conversion that fails half-way loses nothing;
    and a failure removes every directory this made (the staging one, and parents it created).
    """
    claim_directory(output, kind, inputs=reads, overwrite=overwrite)
    created = []
    try:  # before any input is read: an unwritable place fails now, not after the conversion
        created = make_directory(output.parent)
        staging = pathlib.Path(tempfile.mkdtemp(prefix=f".{output.name}.partial-", dir=output.parent))
    except OSError as e:
        remove_created(created)
        raise OutputPathError(f"--output={output} cannot be written ({e.strerror or e}); pick a writable "
                              "place") from None
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        remove_created(created)
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
