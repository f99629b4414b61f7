"""A living index: a saved index updated in place (deletions, upserts, compaction) so that a crash at any moment
leaves either the old or the new index, each loadable and verified by its manifest.

An update never rewrites a file that the current version uses. ``save_version`` writes the whole new version
into a version folder of the index directory (``v000001``, ``v000002``, ...; written under a temporary name and
renamed into place, with its own manifest: ``Index.save``'s format), then swaps the directory's
``manifest.json`` last (a temporary file renamed over it): the new manifest names the version folder and holds
the size and digest of that folder's manifest, whose own list verifies every file there. Until that rename
``load_index`` reads the old version, after it the new one; there is no moment without a complete manifest.
The version before the current one stays on disk (a service may still be reading it), older ones are removed
after the swap, only what densepass wrote (the files each folder's ``.densepass-owned`` lists).

Deleted passages are tombstones (``Index.delete``: their rows are left out of every search, over-fetching so
that k results still come back) until ``compact`` rewrites the index without them; an upsert tombstones the old
rows of its ids and adds the new passages. Updates of one directory take its lock (``io.exclusive_lock``): a
second updater gets a one-line error.

>>> from densepass.index import BM25Index, load_index
>>> import tempfile, pathlib
>>> folder = pathlib.Path(tempfile.mkdtemp()) / "index"
>>> _ = BM25Index.build(["the tar archiver", "a kernel driver", "an audio editor"]).save(folder)
>>> index = update_index(folder, delete=["1"], upsert=[{"id": "3", "text": "a kernel module loader"}])
>>> load_index(folder).search(["kernel"], k=2).ids(0), load_index(folder).version
(['3'], 1)
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Sequence
from pathlib import Path, PurePosixPath

from densepass.data.beir import read_corpus
from densepass.data.files import reading
from densepass.errors import ConfigError
from densepass.fingerprints import fingerprint_file
from densepass.index.base import (
    KINDS,
    Index,
    Passages,
    check_ids,
    check_not_a_part,
    current_version,
    load_index,
    read_index_manifest,
    records_corpus,
)
from densepass.io import (
    MANIFEST,
    OWNED,
    atomic_directory,
    atomic_write_text,
    check_regular_file,
    disk_errors,
    exclusive_lock,
    foreign_files,
    hold_temporaries,
    remove_stale_temporaries,
)

VERSION = re.compile(r"v\d{6}")


def version_name(version: int) -> str:
    """The folder of version ``version`` of an updated index."""
    return f"v{version:06d}"


def index_version(directory: str | Path) -> int:
    """The version of the saved index ``directory`` (0: as built, never updated), from its verified manifest."""
    return int(read_index_manifest(Path(directory)).get("version", 0))


def update_index(
    directory: str | Path,
    delete: Sequence[str] | None = None,
    upsert: Passages | None = None,
    compact: bool = False,
    **load_options,
) -> Index:
    """Load the saved index ``directory`` (``load_options`` as ``load_index`` takes them), delete the passages
    ``delete``, upsert the passages ``upsert`` (records with ids; encoded by the index's model where it has one),
    compact if asked, and save the result as the directory's next version (``save_version``); returns the updated
    index. Every check comes before any work: ids to delete that the index does not hold, ids repeated, or named
    both to delete and to upsert, are a one-line error and nothing changes. Compaction alone of an index without
    tombstones writes nothing (a new version would be a copy of the current one). A version folder of an updated
    index (``DIR/v000002``) is refused: update ``DIR`` itself (``base.check_not_a_part``)."""
    directory = Path(directory)
    check_not_a_part(directory, "the index")
    delete_ids = check_ids(delete, "delete") if delete is not None else []
    corpus = records_corpus(upsert) if upsert is not None else None
    if not delete_ids and corpus is None and not compact:
        raise ConfigError("nothing to update: give passages to delete or to upsert, or compact")
    both = sorted(set(delete_ids) & set(corpus.ids)) if corpus is not None else []
    if both:
        raise ConfigError(f"{len(both)} ids are both deleted and upserted (the first: {both[0]!r}): choose one")
    kind = read_index_manifest(directory)["kind"]
    if not KINDS[kind].updatable:
        raise ConfigError(f"a {kind} index cannot delete or upsert passages: build it again")
    with exclusive_lock(directory, "index update"):
        index = load_index(directory, **load_options)
        if delete_ids:
            index.delete(delete_ids)
        if corpus is not None:
            index.upsert(corpus)
        if compact and not delete_ids and corpus is None and not index.deleted.any():
            return index  # nothing to compact: no new version
        if compact:
            index.compact()
        save_version(index, directory)
    return index


def nothing_to_compact(directory: str | Path) -> bool:
    """Whether the saved index ``directory`` holds no deleted passages, by its verified manifest's count of them
    (a manifest without that count: False, the index must be loaded to know)."""
    return read_index_manifest(Path(directory)).get("deleted") == 0


def read_ids_file(path: str | Path) -> list[str]:
    """Passage ids, one a line (blank lines and surrounding whitespace left out), from a text file: what
    ``densepass index-update --delete`` reads. A repeated id is a one-line error (``check_ids``)."""
    path = Path(path)
    check_regular_file(path, "--delete")
    with reading(path):
        ids = [line.strip() for line in path.read_text(encoding="utf-8-sig").splitlines() if line.strip()]
    return check_ids(ids, f"delete (in {path})")


def update_saved_index(
    directory: str | Path, delete_file: str | Path | None, upsert_file: str | Path | None, compact: bool, **options
) -> Index | None:
    """``densepass index-update``: the ids of ``delete_file`` (``read_ids_file``) and the passages of
    ``upsert_file`` (a BEIR ``corpus.jsonl``) read and checked first, then ``update_index``; of ``options``
    (batch_size, device, precision; ``model``: the index's model where it moved since indexing, a path or a loaded
    model, refused for a kind without one) the index's kind gets those it takes. None: ``compact`` alone over an index
    without deleted passages, nothing to do (nothing loaded, no version written; a killed update's leftovers
    removed)."""
    directory = Path(directory)
    check_not_a_part(directory, "the index")  # before its lock or a killed update's leftovers are touched
    kind = read_index_manifest(directory)["kind"]  # not an index: one line before any file is read
    takes = KINDS[kind].load_options
    if options.get("model") is not None and takes is not None and "model" not in takes:
        raise ConfigError(f"--model is the model of a model index; {directory} is a {kind} index")
    precision = options.get("precision")
    if precision not in (None, "auto", "fp32") and takes is not None and "precision" not in takes:
        raise ConfigError(f"--precision {precision} applies to model indexes; {directory} is a {kind} index")
    if compact and delete_file is None and upsert_file is None and nothing_to_compact(directory):
        with exclusive_lock(directory, "index update"):  # what a killed update left still goes
            clear_killed_update(directory, version_name(index_version(directory) + 1))
        return None
    ids = read_ids_file(delete_file) if delete_file is not None else None
    passages = None
    if upsert_file is not None:
        check_regular_file(upsert_file, "--upsert")
        passages = read_corpus(Path(upsert_file))
    model = options.pop("model", None)
    if model is not None:  # the index's model moved since indexing: the one given (checked as search checks it)
        from densepass.models.load import load_model

        options["model"] = load_model(str(model)) if isinstance(model, str | Path) else model
    options = {name: value for name, value in options.items() if takes is None or name in takes}
    return update_index(directory, ids, passages, compact, **options)


def save_version(index: Index, directory: str | Path) -> int:
    """Save ``index`` as the next version of the saved index ``directory`` (see the module docstring) and return
    that version's number. The caller holds the directory's lock (``update_index`` does). A version folder of an
    updated index is refused (``base.check_not_a_part``)."""
    directory = Path(directory)
    check_not_a_part(directory, "the index")
    top = read_index_manifest(directory)  # the current version: verified, and left untouched
    if top.get("kind") != index.kind:
        raise ConfigError(f"{directory} holds a {top.get('kind')} index, not a {index.kind} index")
    loaded = index.loaded_version
    if loaded is not None and int(top.get("version", 0)) != loaded:  # saved since it was loaded: it would undo that
        raise ConfigError(
            f"{directory} was saved again (version {top.get('version')}) since this index was loaded at version "
            f"{loaded}: load it again and apply the update to that"
        )
    previous = top.get("current")
    version = int(top.get("version", 0)) + 1
    name = version_name(version)
    clear_killed_update(directory, name)
    with disk_errors(directory / name), hold_temporaries() as hold, atomic_directory(directory / name) as tmp:
        hold(tmp)
        index.write_into(tmp)
    inner = read_index_manifest(directory / name)
    owned = _owned(directory, top) | {f"{name}/{file}" for file in _owned(directory / name, inner)}
    atomic_write_text(directory / OWNED, json.dumps(sorted(owned), indent=0))  # before the swap: a superset
    entry = directory / name / MANIFEST
    pointer = {key: value for key, value in inner.items() if key != "files"}
    pointer.update(
        version=version,
        current=name,
        files={f"{name}/{MANIFEST}": {"bytes": entry.stat().st_size, "blake2b": fingerprint_file(entry)}},
    )
    atomic_write_text(directory / MANIFEST, json.dumps(pointer, indent=1))  # the swap
    index.version = index.loaded_version = version
    reopen = getattr(index, "reopen", None)  # a kind that searches files of its directory reads the new version's
    if reopen is not None:
        reopen(directory / name)
    _remove_old_versions(directory, keep={name, previous})
    return version


def clear_killed_update(directory: Path, name: str) -> None:
    """Remove what a killed update of ``directory`` left: its half-written version (densepass's temporaries) and
    a complete version ``name`` (the next one) that the manifest never named. The caller holds the lock."""
    remove_stale_temporaries(directory, r"v\d{6}", owned=True)
    _remove_version(directory / name)


def _owned(directory: Path, manifest: dict) -> set[str]:
    """The files densepass wrote in ``directory``: its ``OWNED`` list, else (an older save) its manifest's files;
    only names of files inside ``directory`` (``_inside``): neither list is covered by a digest, and an index copied
    from someone else must not name a file of this user's for an update to delete."""
    try:
        listed = json.loads((directory / OWNED).read_text(encoding="utf-8"))
        if isinstance(listed, list):
            return {name for name in listed if _inside(name)} | {OWNED, MANIFEST}
    except (OSError, ValueError):
        pass
    return {name for name in manifest.get("files", {}) if _inside(name)} | {MANIFEST}


def _inside(name: object) -> bool:
    """Whether ``name`` is a relative path that stays inside its directory: no ``..``, no root, no backslash."""
    if not isinstance(name, str) or not name or "\\" in name or "\x00" in name:
        return False
    path = PurePosixPath(name)
    return not path.is_absolute() and all(part not in ("..", ".") for part in path.parts) and "//" not in name


def _remove_version(folder: Path) -> None:
    """Remove the version folder ``folder`` when densepass wrote everything in it (its own ``OWNED`` list)."""
    if folder.is_dir() and not folder.is_symlink() and (folder / OWNED).is_file() and not foreign_files(folder):
        shutil.rmtree(folder, ignore_errors=True)


def _remove_old_versions(directory: Path, keep: set[str | None]) -> None:
    """After the swap: remove every version folder but ``keep`` (the current one and the previous), and the files
    of the version the index was first saved as (at the top of ``directory``) unless it is the previous one; then
    list in ``OWNED`` what is left."""
    owned = _owned(directory, {})
    for folder in sorted(directory.iterdir()):
        if VERSION.fullmatch(folder.name) and folder.name not in keep:
            _remove_version(folder)
    if None not in keep:  # version 0 is neither current nor previous: its files go
        for name in sorted(owned):
            first = name.split("/", 1)[0]
            if name in (OWNED, MANIFEST) or VERSION.fullmatch(first):
                continue
            path = directory / name
            if path.is_file() and not path.is_symlink() and path.resolve().is_relative_to(directory.resolve()):
                path.unlink()  # (resolved: not through a folder linked elsewhere)
        folders = {(directory / name).parent for name in owned if not VERSION.fullmatch(name.split("/", 1)[0])}
        for folder in sorted(folders - {directory}, key=lambda f: -len(f.parts)):  # a hybrid's parts: deepest first
            if folder.is_dir() and not folder.is_symlink() and not any(folder.iterdir()):
                folder.rmdir()
    left = sorted(name for name in owned if (directory / name).is_file() or name in (OWNED, MANIFEST))
    atomic_write_text(directory / OWNED, json.dumps(left, indent=0))


__all__ = [
    "current_version",
    "index_version",
    "read_ids_file",
    "save_version",
    "update_index",
    "nothing_to_compact",
    "update_saved_index",
    "version_name",
]
