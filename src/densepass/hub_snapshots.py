"""Which Hugging Face cache snapshots densepass downloaded in full, so that a partial one is never read as whole.

``huggingface_hub``'s cache lookup (``snapshot_download(local_files_only=True)``) returns a snapshot folder
whatever it holds: after a first download stopped half-way (Ctrl-C, a lost connection) it holds some of a
dataset's shards or a model's files, and reading it as the whole would train on part of a dataset without a word.
So after each download densepass completes (``models.hub``, ``data.hub``) it records the snapshot and the file
patterns it asked for in a marker, ``<HF_HUB_CACHE>/.densepass-complete/<key>.json``, listing the files the
snapshot then held. A cached snapshot is read without the network only when a marker says it was downloaded in
full for those patterns and its files are all still there; otherwise, with the Hub online, the download runs
again (``huggingface_hub`` fetches only what is missing), and its result is checked against the repo's own file
list (``download_in_full``): where the Hub cannot be reached, ``snapshot_download`` returns the cached snapshot
whatever it holds, which would otherwise be marked whole. Offline (``HF_HUB_OFFLINE=1``) the cache is all there is,
and a snapshot another tool downloaded (``huggingface-cli download``) is read as it is. A cache densepass may not
write to (a shared, read-only one) gets no marker: each online run then asks the Hub what is missing.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from densepass.io import atomic_write_text

MARKERS = ".densepass-complete"


def _marker(snapshot: Path, patterns: Sequence[str]) -> Path:
    from huggingface_hub import constants

    key = json.dumps([str(Path(snapshot).resolve()), sorted(patterns)])
    return Path(constants.HF_HUB_CACHE) / MARKERS / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def mark_complete(snapshot: str | Path, patterns: Sequence[str]) -> None:
    """Record that ``snapshot`` was downloaded in full for ``patterns`` (a cache that may not be written: nothing)."""
    snapshot = Path(snapshot)
    files = sorted(p.relative_to(snapshot).as_posix() for p in snapshot.rglob("*") if p.is_file())
    marker = _marker(snapshot, patterns)
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(marker, json.dumps({"snapshot": str(snapshot), "patterns": sorted(patterns), "files": files}))
    except OSError:
        pass


def is_complete(snapshot: str | Path, patterns: Sequence[str]) -> bool:
    """Whether a marker says ``snapshot`` was downloaded in full for ``patterns`` and its files are all there."""
    snapshot = Path(snapshot)
    try:
        record = json.loads(_marker(snapshot, patterns).read_text(encoding="utf-8"))
        files = record["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return isinstance(files, list) and all(isinstance(f, str) and (snapshot / f).is_file() for f in files)


def download_in_full(repo: str, patterns: Sequence[str], **kwargs: Any) -> str:
    """``snapshot_download`` of ``repo``'s files matching ``patterns`` (``kwargs``: its ``revision``,
    ``repo_type``), checked against the Hub's list of the repo's files: an OSError (one line) where the Hub cannot
    be reached or the snapshot lacks one of them. ``snapshot_download`` alone cannot tell: without a connection it
    returns the cached snapshot, complete or not."""
    from huggingface_hub import list_repo_files, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.utils import filter_repo_objects

    options = {k: kwargs[k] for k in ("revision", "repo_type") if k in kwargs}
    try:
        listed = list_repo_files(repo, **options)
    except HfHubHTTPError:  # an HTTP status (not found, gated, ...): the caller's one line (it is a client error too)
        raise
    except http_client_errors() as err:  # no connection
        raise OSError(f"the Hugging Face Hub could not be reached ({type(err).__name__}: {err})") from None
    folder = snapshot_download(repo, allow_patterns=list(patterns), **kwargs)
    wanted = list(filter_repo_objects(listed, allow_patterns=list(patterns)))
    missing = [name for name in wanted if not (Path(folder) / name).is_file()]
    if missing:
        raise OSError(
            f"the download holds {len(wanted) - len(missing)} of the repo's {len(wanted)} files (missing: "
            f"{missing[0]}{' ...' if len(missing) > 1 else ''}); run again"
        )
    return folder


# the HTTP clients huggingface_hub has talked through (2.x: httpx2, 1.x: httpx, earlier: requests), and the base of
# their errors: a connection that fails reaches the caller as one of these, not wrapped in huggingface_hub's own
HTTP_CLIENT_ERRORS = (("httpx2", "HTTPError"), ("httpx", "HTTPError"), ("requests", "RequestException"))


def http_client_errors() -> tuple[type[BaseException], ...]:
    """The base error classes of the HTTP clients in ``HTTP_CLIENT_ERRORS`` that are installed (huggingface_hub's
    ``HfHubHTTPError``, an HTTP status, derives from its client's: catch it first where it means something else)."""
    found = []
    for module, name in HTTP_CLIENT_ERRORS:
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return tuple(found)


def network_errors() -> tuple[type[BaseException], ...]:
    """The errors of a Hub call that fails on the network or at the Hub (no connection, a name that does not resolve,
    a timeout, an HTTP error): huggingface_hub's ``HfHubHTTPError`` and ``LocalEntryNotFoundError``, ``OSError``,
    and the HTTP client's own, so that each becomes the caller's one-line error (``except network_errors()``, after
    the errors it tells apart: not found, gated, no such revision)."""
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    return (HfHubHTTPError, LocalEntryNotFoundError, OSError, *http_client_errors())
