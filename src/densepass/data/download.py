"""Download a public BEIR dataset (zip) or SQuAD v1.1 into the data directory (needs internet).

Everything is fetched into a temporary directory inside ``data_dir`` and moved into place with one
``os.replace``, so an interrupted download never leaves a half-written dataset behind. An existing
dataset directory is left untouched; a folder of that name holding anything else is refused (densepass writes
only into a new or empty folder: ``io``'s ownership rules), so a user's files there are never mixed with, or
taken for, a download.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import urllib.request
import zipfile
from pathlib import Path
from urllib.error import HTTPError, URLError

from densepass.errors import DataError

BEIR_URL = "https://public.ukp.informatik.tu-darmstadt.de/thakur/BEIR/datasets/{name}.zip"
SQUAD_URLS = {
    "train-v1.1.json": "https://rajpurkar.github.io/SQuAD-explorer/dataset/train-v1.1.json",
    "dev-v1.1.json": "https://rajpurkar.github.io/SQuAD-explorer/dataset/dev-v1.1.json",
}
TIMEOUT_S = 60
CHUNK_BYTES = 1 << 20
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")


def check_name(name: str) -> None:
    """A dataset name is one path component of letters, digits, ``.``, ``_`` and ``-``."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise DataError(f"invalid dataset name {name!r} (expected e.g. 'scifact' or 'squad')")


def fetch(url: str, dest: Path) -> None:
    """Stream ``url`` into ``dest``; network failures become a one-line :class:`DataError`."""
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response, open(dest, "wb") as out:
            shutil.copyfileobj(response, out, CHUNK_BYTES)
    except HTTPError as err:
        raise DataError(f"download failed: {url} answered HTTP {err.code} ({err.reason})") from err
    except URLError as err:
        raise DataError(f"download failed: cannot reach {url} ({err.reason})") from err
    except OSError as err:  # timeouts, connection resets, a full disk
        raise DataError(f"download failed: {url} ({err})") from err


def fetch_squad(workdir: Path) -> Path:
    """SQuAD v1.1 train and dev JSON files in ``workdir/squad``."""
    target = workdir / "squad"
    target.mkdir()
    for filename, url in SQUAD_URLS.items():
        fetch(url, target / filename)
    return target


def extract_zip(archive: Path, workdir: Path, name: str) -> Path:
    """Unpack ``archive`` under ``workdir``; the dataset folder (``name/`` or the only top folder) is returned."""
    if not zipfile.is_zipfile(archive):
        raise DataError(f"download of {name!r} is not a zip archive (is {name!r} a BEIR dataset name?)")
    extracted = workdir / "extracted"
    try:
        with zipfile.ZipFile(archive) as zf:
            zf.extractall(extracted)  # extractall drops absolute and '..' path parts
    except (zipfile.BadZipFile, OSError) as err:
        raise DataError(f"cannot extract the archive of {name!r}: {err}") from err
    if (extracted / name).is_dir():
        return extracted / name
    entries = [p for p in extracted.iterdir() if not p.name.startswith(("__MACOSX", "."))]
    if len(entries) == 1 and entries[0].is_dir():
        return entries[0]
    return extracted


def fetch_beir(name: str, workdir: Path) -> Path:
    """The BEIR zip of ``name``, downloaded and unpacked under ``workdir``; returns the dataset folder."""
    archive = workdir / f"{name}.zip"
    fetch(BEIR_URL.format(name=name), archive)
    return extract_zip(archive, workdir, name)


def holds_dataset(directory: Path, name: str) -> bool:
    """Whether ``directory`` holds what downloading ``name`` gives: SQuAD's two JSON files, or a BEIR dataset's
    corpus, queries and qrels folder (plain or gzipped)."""
    if name == "squad":
        return all((directory / filename).is_file() for filename in SQUAD_URLS)
    present = {p.name for p in directory.iterdir()}
    return (
        bool({"corpus.jsonl", "corpus.jsonl.gz"} & present)
        and bool({"queries.jsonl", "queries.jsonl.gz"} & present)
        and (directory / "qrels").is_dir()
    )


def download_dataset(name: str, data_dir: str | Path) -> Path:
    """Download dataset ``name`` (``squad``, or any BEIR dataset) into ``data_dir/name``; returns that path.

    Does nothing when ``data_dir/name`` already holds the dataset (``holds_dataset``); downloads into an empty
    folder; a folder holding anything else is a one-line DataError before any download."""
    check_name(name)
    data_dir = Path(data_dir)
    target = data_dir / name
    if target.is_dir() and holds_dataset(target, name):
        return target
    if target.is_symlink() or target.exists() and not target.is_dir():
        raise DataError(f"{target} exists and is not a directory (or is a link): densepass never downloads into it")
    if target.is_dir():
        _check_empty(target, name)
    data_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=data_dir, prefix=f".{name}-download-") as tmp:
        workdir = Path(tmp)
        source = fetch_squad(workdir) if name == "squad" else fetch_beir(name, workdir)
        try:
            os.replace(source, target)  # onto an empty folder too; one that files were put into meanwhile: refused
        except OSError as err:
            if target.is_dir():
                _check_empty(target, name)
            raise DataError(f"cannot move the download of {name!r} to {target}: {err.strerror or err}") from err
    return target


def _check_empty(target: Path, name: str) -> None:
    """A one-line DataError where ``target`` holds anything: it is not a download of ``name``."""
    found = sorted(p.name + ("/" if p.is_dir() else "") for p in target.iterdir())
    if found:
        shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise DataError(
            f"{target} exists and holds files that are not a downloaded {name!r} dataset ({shown}); densepass "
            "downloads only into a new or empty folder: move them away or give another --data-dir"
        )
