"""What every task reader shares: one error type that names the file, and file checks made before reading."""

from __future__ import annotations

import json
import pathlib

from megajax.errors import UserError


class TaskDataError(UserError, ValueError):
    """A task data file that cannot be used; the message names the file and what is wrong with it."""


def existing_file(path: str | pathlib.Path, what: str) -> pathlib.Path:
    """``path`` as a Path, or FileNotFoundError saying which file of which task is missing."""
    p = pathlib.Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{what} file {p} does not exist" + (" (it is a directory)" if p.is_dir() else ""))
    return p


def read_json(path: pathlib.Path, what: str):
    """The parsed JSON of ``path``, or TaskDataError naming the file and the parse error."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TaskDataError(f"{what} file {path} is not valid UTF-8 JSON: {e}") from e
