"""The one way a user's text data file is opened (``data.source=sft``'s JSONL, eval.py's ``--data`` files): plain,
gzip (``.gz``) or zstandard (``.zst``, with the ``zstandard`` package) compressed, read line by line as UTF-8. A
path that is not a file, compressed data that is damaged, or a line that is not UTF-8 is a ``DataFileError`` naming
the file (as the user gave it: ``what``) and the line, never a traceback."""

from __future__ import annotations

import gzip
import io
import pathlib
import zlib
from collections.abc import Iterator

from megajax.errors import UserError


class DataFileError(UserError, ValueError):
    """A data file that cannot be read as text; the message names the file, the line and what to do."""


def _open_binary(p: pathlib.Path, what: str) -> io.BufferedIOBase:
    if p.suffix == ".gz":
        return gzip.open(p, "rb")
    if p.suffix == ".zst":
        try:
            import zstandard  # optional: only .zst files need it
        except ImportError:
            raise DataFileError(f"{what} is zstandard-compressed: pip install zstandard, or decompress it "
                                f"(zstd -d {p})") from None
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(p, "rb"), closefd=True))
    return open(p, "rb")


def check_file(path: str | pathlib.Path, what: str) -> pathlib.Path:
    """``path`` as a Path where it is a file to read, else DataFileError saying what it is instead."""
    p = pathlib.Path(path)
    if p.is_dir():
        raise DataFileError(f"{what} is a directory: give the file in it to read (e.g. {p / 'train.jsonl'})")
    if not p.is_file():
        raise DataFileError(f"{what}: no such file ({p.resolve()})")
    return p


def text_lines(path: str | pathlib.Path, what: str, keep_ends: bool = False) -> Iterator[tuple[int, str]]:
    """(line number from 1, text without its line end, or with it where ``keep_ends``) for each line of ``path``
    (decompressed by its suffix). ``what`` names the file as the user gave it (``data.path=train.jsonl``,
    ``--data=held_out.jsonl``)."""
    p = check_file(path, what)
    line = 0
    try:
        with _open_binary(p, what) as f:
            for line, raw in enumerate(f, 1):
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise DataFileError(
                        f"{what}, line {line}: byte {raw[e.start]:#04x} at column {e.start + 1} is not UTF-8; save "
                        "the file as UTF-8 (e.g. iconv -f latin1 -t utf-8), or drop the line") from None
                yield line, text if keep_ends else text.rstrip("\r\n")
    except DataFileError:
        raise
    except (OSError, EOFError, zlib.error) as e:  # gzip.BadGzipFile is an OSError
        if isinstance(e, (FileNotFoundError, PermissionError)):
            raise DataFileError(f"{what} cannot be read ({e.strerror})") from None
        raise DataFileError(_damaged(p, what, line, e)) from None
    except Exception as e:  # noqa: BLE001 - zstandard.ZstdError derives from Exception only
        if type(e).__name__ != "ZstdError":
            raise
        raise DataFileError(_damaged(p, what, line, e)) from None


def _damaged(p: pathlib.Path, what: str, line: int, error: Exception) -> str:
    kind = {".gz": "gzip", ".zst": "zstandard"}.get(p.suffix, "file")
    return (f"{what}{f' after line {line}' if line else ''}: the {kind} data is damaged ({error}); check the file, or "
            "give it decompressed")
