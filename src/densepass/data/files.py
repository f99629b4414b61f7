"""Reading dataset and run files: UTF-8 text, optionally gzipped, with every decoding or decompression
failure turned into a one-line :class:`DataError` naming the file (and the line, for bad UTF-8), and
counted :class:`DataWarning` s (one per file and kind of oddity, never one per row). A dataset reader
decorated with :func:`records_files` lists every file it read in the dataset's ``files`` (what a run's
identity fingerprints: ``RetrievalDataset.file_fingerprints``)."""

from __future__ import annotations

import functools
import gzip
import io
import warnings
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import TypeVar

from densepass.errors import DataError, DataWarning

L = TypeVar("L", bound=Callable)
_RECORDERS: ContextVar[tuple[list[Path], ...]] = ContextVar("densepass_files_read", default=())


def is_gzip_name(path: Path) -> bool:
    """Whether ``path``'s name ends in ``.gz``, in any case (``DATA.JSONL.GZ`` too: names are matched so)."""
    return path.suffix.lower() == ".gz"


def open_text(path: Path) -> io.TextIOBase:
    """``path`` opened for reading as UTF-8 text, through gzip when its name ends in ``.gz``; a byte-order mark at
    its start (files saved by Windows editors) is not part of its first line. Only ``\n`` ends a line (a line of a
    CRLF file keeps its ``\r\n``, which the readers strip): a carriage return alone is a character of the line,
    not a line break that would split a record in two (and count lines unlike every other reader of the file)."""
    if is_gzip_name(path):
        return gzip.open(path, "rt", encoding="utf-8-sig", newline="\n")
    return open(path, encoding="utf-8-sig", newline="\n")


LONE_CR = "a carriage return (\\r) inside a line: only \\n (or \\r\\n) ends a line; convert lines ending in \\r"
"""What a reader's error says of a ``\\r`` not followed by ``\\n`` (:func:`open_text` does not end a line there)."""


def _bad_utf8(path: Path) -> DataError:
    """The error for a file that is not UTF-8, naming the first line that does not decode."""
    try:
        with gzip.open(path, "rb") if is_gzip_name(path) else open(path, "rb") as handle:
            for line_no, raw in enumerate(handle, 1):
                try:
                    raw.decode("utf-8")
                except UnicodeDecodeError as err:
                    return DataError(
                        f"{path}:{line_no}: not valid UTF-8 (byte 0x{raw[err.start]:02x} at byte "
                        f"{err.start + 1} of the line); re-save the file as UTF-8"
                    )
    except (OSError, EOFError, zlib.error):
        pass
    return DataError(f"{path}: not valid UTF-8")


@contextmanager
def reading(path: Path) -> Iterator[None]:
    """Turn the errors of reading ``path`` (bad UTF-8, a truncated or corrupt gzip stream, an unreadable
    file) into one-line DataErrors that name it (and note ``path`` as read, inside :func:`recording_reads`)."""
    for files in _RECORDERS.get():
        files.append(Path(path))
    try:
        yield
    except UnicodeDecodeError:
        raise _bad_utf8(path) from None
    except EOFError:
        raise DataError(f"{path}: truncated gzip file (it ends before the end of the compressed data)") from None
    except (gzip.BadGzipFile, zlib.error) as err:
        raise DataError(f"{path}: corrupt gzip file ({err})") from None
    except OSError as err:
        raise DataError(f"cannot read {path}: {err.strerror or err}") from None


@contextmanager
def recording_reads() -> Iterator[list[Path]]:
    """A list that collects every path read through :func:`reading` inside the block (repeats included)."""
    files: list[Path] = []
    token = _RECORDERS.set((*_RECORDERS.get(), files))
    try:
        yield files
    finally:
        _RECORDERS.reset(token)


def records_files(loader: L) -> L:
    """Decorate a dataset reader ``loader(directory, ...)`` (returning a ``RetrievalDataset``, or a tuple whose
    last item is one): the dataset's ``files`` become {name relative to ``directory``: path} of every file it
    read, in the order first read."""

    @functools.wraps(loader)
    def load(directory, *args, **kwargs):
        with recording_reads() as read:
            result = loader(directory, *args, **kwargs)
        dataset = result[-1] if isinstance(result, tuple) else result
        root, files = Path(directory), {}
        for path in read:
            try:
                name = path.relative_to(root).as_posix()
            except ValueError:
                name = str(path)
            files.setdefault(name, path)
        dataset.files = files
        return result

    return load  # type: ignore[return-value]


def read_lines(path: Path) -> Iterator[tuple[int, str]]:
    """``(line number, line)`` for every line of ``path`` (line ends kept), errors as in :func:`reading`."""
    with reading(path), open_text(path) as handle:
        yield from enumerate(handle, 1)


def read_text(path: Path) -> str:
    """The whole (optionally gzipped) UTF-8 text of ``path``, errors as in :func:`reading`."""
    with reading(path), open_text(path) as handle:
        return handle.read()


class Tally:
    """Counts one kind of tolerated oddity in one source and warns once for all of them.

    ``Tally("qrels.tsv", "repeated rows (same grade), ignored").add(7)`` ... ``.warn()`` gives
    ``qrels.tsv: 3 repeated rows (same grade), ignored (first: line 7)``."""

    def __init__(self, source: str | Path, what: str) -> None:
        self.source = source
        self.what = what
        self.count = 0
        self.first: int | str | None = None

    def add(self, where: int | str) -> None:
        """Count one occurrence; ``where`` (a line number, or a description) locates it."""
        self.count += 1
        if self.first is None:
            self.first = where

    def warn(self) -> None:
        """Emit one DataWarning when anything was counted."""
        if self.count:
            first = f"line {self.first}" if isinstance(self.first, int) else self.first
            warnings.warn(f"{self.source}: {self.count} {self.what} (first: {first})", DataWarning, stacklevel=3)
