"""Download a public BEIR dataset (zip) or SQuAD v1.1 into the data directory (needs internet).

Everything is fetched into a temporary directory inside ``data_dir`` and moved into place with one
``os.replace``, so an interrupted download never leaves a half-written dataset behind. An existing
dataset directory is left untouched.
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


def download_dataset(name: str, data_dir: str | Path) -> Path:
    """Download dataset ``name`` (``squad``, or any BEIR dataset) into ``data_dir/name``; returns that path.

    Does nothing when ``data_dir/name`` already exists."""
    check_name(name)
    data_dir = Path(data_dir)
    target = data_dir / name
    if target.is_dir():
        return target
    if target.exists():
        raise DataError(f"{target} exists and is not a directory")
    data_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=data_dir, prefix=f".{name}-download-") as tmp:
        workdir = Path(tmp)
        source = fetch_squad(workdir) if name == "squad" else fetch_beir(name, workdir)
        os.replace(source, target)
    return target
