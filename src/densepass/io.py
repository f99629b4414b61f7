"""Crash-safe files: atomic writes (a temporary sibling renamed over the target), verified directories
(a manifest of sizes and digests written last), and an exclusive lock on a working directory."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary sibling renamed over it (never half-written)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Yield a temporary directory that replaces ``path`` only when the block finishes without error.

    An interrupted save leaves the previous ``path`` (if any) untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        yield tmp
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def exclusive_lock(directory: str | Path, what: str = "run", wait: bool = False) -> Iterator[None]:
    """Hold an exclusive lock on ``directory`` (created if missing) for the block's duration.

    A second densepass process that asks for the same directory gets a one-line error instead of
    interleaving its writes with the first one's (``wait``: it waits for the lock instead). The lock is
    released when the process ends, however it ends (``fcntl.flock`` on ``<directory>/.lock``).
    """
    import fcntl

    from densepass.errors import DensepassError

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    handle = open(directory / ".lock", "a+")
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise DensepassError(
                f"{directory} is in use by another densepass {what} ({holder}); "
                "wait for it to finish or choose another directory"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}")
        handle.flush()
        yield
    finally:
        handle.close()


MANIFEST = "manifest.json"


def write_manifest(directory: str | Path, **facts) -> None:
    """Write ``manifest.json`` last into ``directory``: ``facts`` plus the size and digest of every other file."""
    import json

    from densepass.fingerprints import fingerprint_file

    directory = Path(directory)
    files = {
        str(p.relative_to(directory)): {"bytes": p.stat().st_size, "blake2b": fingerprint_file(p)}
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != MANIFEST
    }
    atomic_write_text(directory / MANIFEST, json.dumps({**facts, "files": files}, indent=1))


def manifest_problem(directory: str | Path) -> str | None:
    """None when every file in the manifest is present with its size and digest, else what is wrong."""
    import json

    from densepass.fingerprints import fingerprint_file

    directory = Path(directory)
    try:
        files = json.loads((directory / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return "no readable manifest.json"
    if not isinstance(files, dict) or not all(
        isinstance(entry, dict) and isinstance(entry.get("bytes"), int) and isinstance(entry.get("blake2b"), str)
        for entry in files.values()
    ):
        return "manifest.json does not list its files as {name: {bytes, blake2b}}"
    for name, expected in files.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != expected["bytes"]:
            return f"{name} has {path.stat().st_size} bytes, {expected['bytes']} expected (truncated?)"
        if fingerprint_file(path) != expected["blake2b"]:
            return f"{name} does not match its digest (corrupted?)"
    return None


def read_manifest(directory: str | Path, what: str = "directory") -> dict:
    """The verified manifest of ``directory``; a missing, damaged or incomplete one is a one-line DataError."""
    import json

    from densepass.errors import DataError

    directory = Path(directory)
    if not directory.is_dir():
        raise DataError(f"{what} not found: {directory}")
    problem = manifest_problem(directory)
    if problem is not None:
        raise DataError(f"{directory} is not a usable {what}: {problem}")
    return json.loads((directory / MANIFEST).read_text())
