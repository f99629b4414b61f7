"""``densepass export INDEX --to qdrant PATH_OR_URL``: a dense index's embeddings put into a Qdrant collection.

The vectors are the index's own (``index.vectors``: what its model encoded, the live passages only), so the
collection answers a query vector as the index does: its distance is the index's similarity, ``Cosine`` for a
model that normalises its embeddings (inner product of unit vectors), ``Dot`` for one that does not. Each point's
id is a UUID derived from the passage id (``point_id``: the same passage has the same point id in every export, so
points can be matched with passages without reading their payload), its payload the passage id
(``passage_id``) and, unless left out, its ``title`` and ``text`` (a saved index holds them). Points are upserted
in batches with a progress bar.

``PATH_OR_URL``: an ``http://`` or ``https://`` URL is a Qdrant server (``--api-key``, else ``QDRANT_API_KEY``,
for one that asks for a key); anything else is a folder for Qdrant's embedded mode (``QdrantClient(path=...)``:
no server; a folder Qdrant did not make, or a file, is refused). A collection of that name that exists already
is replaced only with ``force``. Every refusal is one line, and comes before anything is written.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

from densepass.config import DENSE_INDEX_KINDS
from densepass.errors import ConfigError, DataError
from densepass.index.base import load_index, read_index_manifest
from densepass.index.dense import DenseIndex
from densepass.index.vectors import live_embeddings, live_rows

NAMESPACE = uuid.UUID("5d1c6a3e-8f0b-4f4e-9a55-6d656e736570")  # densepass's: point ids are uuid5(NAMESPACE, id)
COLLECTION_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,254}$")


@dataclass
class QdrantExport:
    """What was exported: the collection, where it is, how many points, their distance and dimension."""

    collection: str
    target: str
    points: int
    distance: str
    dim: int


def point_id(passage_id: str) -> str:
    """The Qdrant point id of ``passage_id``: a UUID (version 5) of the id, the same in every export."""
    return str(uuid.uuid5(NAMESPACE, passage_id))


def is_url(target: str) -> bool:
    """Whether ``target`` names a Qdrant server (an http or https URL) rather than an embedded-mode folder."""
    return target.startswith(("http://", "https://"))


def export_to_qdrant(
    index_dir: str | Path,
    target: str,
    collection: str | None = None,
    api_key: str | None = None,
    force: bool = False,
    batch_size: int = 256,
    texts: bool = True,
    show_progress: bool = True,
) -> QdrantExport:
    """Put the dense index at ``index_dir`` into the Qdrant ``collection`` (default: the index folder's name) at
    ``target`` (module docstring); every refusal is a one-line error before anything is written."""
    try:
        from qdrant_client import QdrantClient, models
    except ImportError:
        raise ConfigError("--to qdrant needs qdrant-client: pip install 'densepass[qdrant]'") from None
    index_dir = Path(index_dir)
    name = collection or index_dir.resolve().name
    if not COLLECTION_NAME.match(name):
        raise ConfigError(
            f"collection name {name!r}: use letters, digits, '_', '.' and '-' (at most 255, a letter or digit first)"
        )
    if batch_size < 1:
        raise ConfigError(f"--batch-size must be >= 1, got {batch_size}")
    url = is_url(target)
    if api_key is None and url:
        api_key = os.environ.get("QDRANT_API_KEY") or None
    if api_key is not None and not url:
        raise ConfigError("--api-key is for a Qdrant server (an http:// or https:// URL), not an embedded-mode folder")
    if not url:
        check_storage_folder(Path(target), index_dir)
    if not index_dir.is_dir():
        raise ConfigError(f"{index_dir} is not a saved index directory")
    kind = read_index_manifest(index_dir)["kind"]  # verified; the model is loaded only for a dense index
    if kind not in DENSE_INDEX_KINDS:
        raise DataError(
            f"{index_dir} is a {kind} index: --to qdrant exports dense indexes ({', '.join(DENSE_INDEX_KINDS)}), "
            "one vector per passage"
        )
    client = None
    try:
        if url or Path(target, "meta.json").is_file():  # a collection there may exist: refused before any work
            client = _connect(QdrantClient, target, api_key, url)
            exists = _call(target, lambda: client.collection_exists(name))
            if exists and not force:
                raise ConfigError(
                    f"collection {name!r} exists at {target}: --force replaces it, or choose --collection"
                )
        index = load_index(index_dir)
        normalize = bool(getattr(index.model.config, "normalize", False))
        distance = models.Distance.COSINE if normalize else models.Distance.DOT
        if client is None:  # a new embedded-mode folder: made only now
            client = _connect(QdrantClient, target, api_key, url)
        if _call(target, lambda: client.collection_exists(name)):
            _call(target, lambda: client.delete_collection(name))
        params = models.VectorParams(size=index.dim, distance=distance)
        _call(target, lambda: client.create_collection(name, vectors_config=params))
        count = _upsert(client, models, name, index, batch_size, texts, show_progress, target)
    finally:
        if client is not None:
            client.close()
    return QdrantExport(name, target, count, str(distance.value), index.dim)


def _connect(client_class, target: str, api_key: str | None, url: bool):
    try:
        if url:
            return client_class(url=target, api_key=api_key, check_compatibility=False)
        return client_class(path=target)
    except (RuntimeError, ValueError, OSError) as err:  # embedded: the folder locked by another client
        raise ConfigError(f"cannot open Qdrant at {target}: {_one_line(err)}") from None


def check_storage_folder(path: Path, index_dir: Path) -> None:
    """A one-line error where an embedded-mode folder would be written over something that is not Qdrant's:
    a file, a link, a non-empty folder without Qdrant's ``meta.json``, or a place inside the index."""
    if path.is_symlink() or path.exists() and not path.is_dir():
        raise ConfigError(f"{path} is not a folder: give a folder for Qdrant's embedded mode (or a server's URL)")
    if path.is_dir() and any(path.iterdir()) and not (path / "meta.json").is_file():
        raise ConfigError(f"{path} holds files that are not a Qdrant storage folder: choose another folder")
    if path.is_dir() and (path / "meta.json").is_file() and not _qdrant_meta(path / "meta.json"):
        raise ConfigError(f"{path} holds a meta.json that is not Qdrant's (no collections): choose another folder")
    resolved = path.resolve()
    if resolved == index_dir.resolve() or index_dir.resolve() in resolved.parents:
        raise ConfigError(f"the Qdrant folder {path} would be inside the index it exports: choose another folder")


def _qdrant_meta(path: Path) -> bool:
    """Whether ``path`` reads as the ``meta.json`` of Qdrant's embedded mode: a JSON object whose ``collections``
    maps names to objects (what ``QdrantClient(path=...)`` reads; a user's own meta.json stops it with a KeyError)."""
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    collections = meta.get("collections") if isinstance(meta, dict) else None
    return isinstance(collections, dict) and all(isinstance(config, dict) for config in collections.values())


def _upsert(client, models, name: str, index: DenseIndex, batch_size: int, texts: bool, show_progress: bool, target):
    from tqdm.auto import tqdm

    ids, embeddings = live_embeddings(index)
    rows = live_rows(index)
    passages = index.passages
    with tqdm(total=len(ids), desc=f"qdrant {name}", unit="points", disable=not show_progress) as progress:
        for start in range(0, len(ids), batch_size):
            chunk = ids[start : start + batch_size]
            payloads = [{"passage_id": pid} for pid in chunk]
            if texts:
                for payload, row in zip(payloads, rows[start : start + batch_size].tolist()):
                    payload["title"], payload["text"] = passages.titles[row], passages.texts[row]
            vectors = embeddings[start : start + batch_size].tolist()
            batch = models.Batch(ids=[point_id(pid) for pid in chunk], vectors=vectors, payloads=payloads)
            _call(target, lambda batch=batch: client.upsert(name, points=batch, wait=True))
            progress.update(len(chunk))
    return len(ids)


def _call(target: str, action):
    """``action()``, a Qdrant client's request: an unreachable server, a refused key or a rejected request is one
    line naming ``target``."""
    from qdrant_client.http.exceptions import ApiException, ResponseHandlingException, UnexpectedResponse

    try:
        return action()
    except UnexpectedResponse as err:
        what = "the API key was refused" if err.status_code in (401, 403) else _one_line(err)
        raise ConfigError(f"Qdrant at {target}: {what}") from None
    except (ResponseHandlingException, ApiException, OSError, ValueError) as err:
        raise ConfigError(f"Qdrant at {target}: {_one_line(err)}") from None


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())[:300] or type(err).__name__
