"""The one way a user's text data file is opened (``data.source=sft``'s JSONL, eval.py's ``--data`` files,
``preprocess``'s inputs): plain, gzip (``.gz``) or zstandard (``.zst``, with the ``zstandard`` package) compressed,
read line by line as UTF-8 (``text_lines``) or whole (``read_bytes``: preprocess counts and skips what is not
UTF-8). A path that is not a file, compressed data that is damaged, or a line that is not UTF-8 is a
``DataFileError`` naming the file (as the user gave it: ``what``) and the line, never a traceback."""

from __future__ import annotations

import gzip
import io
import pathlib
import zlib
from collections.abc import Iterator

from megajax.errors import UserError

COMPRESSED = {".gz": "gzip", ".zst": "zstandard"}  # the suffixes read decompressed


class DataFileError(UserError, ValueError):
    """A data file that cannot be read as text; the message names the file, the line and what to do."""


def _open_binary(p: pathlib.Path, what: str) -> io.BufferedIOBase:
    """``p`` opened for reading bytes, decompressed by its suffix (``COMPRESSED``)."""
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
    except Exception as e:  # noqa: BLE001 - zstandard.ZstdError derives from Exception only
        raise _unreadable(p, what, line, e) from None


def read_bytes(path: str | pathlib.Path, what: str) -> bytes:
    """The bytes of ``path`` (a file or a named pipe), decompressed by its suffix; DataFileError where it cannot be
    read or its compressed data is damaged."""
    p = pathlib.Path(path)
    try:
        with _open_binary(p, what) as f:
            return f.read()
    except Exception as e:  # noqa: BLE001 - zstandard.ZstdError derives from Exception only
        raise _unreadable(p, what, 0, e) from None


def data_suffix(path: str | pathlib.Path) -> str:
    """A file's suffix under its compression suffix (``corpus.jsonl.gz`` -> ``.jsonl``)."""
    p = pathlib.Path(path)
    return pathlib.Path(p.stem).suffix if p.suffix in COMPRESSED else p.suffix


def _unreadable(p: pathlib.Path, what: str, line: int, error: Exception) -> Exception:
    """``error`` met reading ``p`` as the DataFileError a user reads (any other error as it is)."""
    if isinstance(error, DataFileError):
        return error
    if isinstance(error, (FileNotFoundError, PermissionError)):
        return DataFileError(f"{what} cannot be read ({error.strerror})")
    # gzip.BadGzipFile is an OSError, zstandard's ZstdError an Exception only
    if isinstance(error, (OSError, EOFError, zlib.error)) or type(error).__name__ == "ZstdError":
        kind = COMPRESSED.get(p.suffix, "file")
        return DataFileError(f"{what}{f' after line {line}' if line else ''}: the {kind} data is damaged ({error}); "
                             "check the file, or give it decompressed")
    return error
