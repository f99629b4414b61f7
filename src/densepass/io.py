"""Crash-safe files: atomic writes (a temporary sibling renamed over the target), verified directories
(a manifest of sizes and digests written last), an exclusive lock on a working directory, and ownership: densepass
replaces or empties only a directory it wrote (``atomic_directory``'s ``OWNED`` list, a run directory's
``RUN_MARKER``), never one that holds a file it did not write."""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import json
import os
import re
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary sibling renamed over it (never half-written; ``atomic_file``:
    a full disk is a one-line error, and a killed process's temporaries of ``path`` are removed)."""
    with atomic_file(path, "w", needs=len(text)) as handle:
        handle.write(text)


def check_regular_file(path: str | Path, what: str, error: type[Exception] | None = None) -> None:
    """A one-line ``error`` (DataError by default) unless ``path`` is a regular file (a link to one counts):
    ``<what> not found: <path>`` where nothing is there, ``<what> <path> is not a regular file (a named pipe)``
    where something else is, e.g. a FIFO, which reading would wait on, or a folder."""
    if error is None:
        from densepass.errors import DataError as error
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise error(f"{what} not found: {path}") from None
    except OSError as err:  # a name too long, a folder on the way that may not be read
        raise error(f"{what} {path} cannot be read ({err.strerror})") from None
    if not stat.S_ISREG(mode):
        kinds = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe"), (stat.S_ISSOCK, "a socket"))
        kind = next((name for test, name in kinds if test(mode)), "a device")
        raise error(f"{what} {path} is not a regular file ({kind}): give the path of a file")


def check_cache_dir(cache_dir: str | Path | None, what: str = "cache_dir") -> None:
    """``cache_dir``, before any work: a folder (made when missing) where this user may write; a file of that name, or
    a folder out of reach, is one line now rather than an error (or a cache silently unused) after the work."""
    from densepass.errors import ConfigError

    if not cache_dir:
        return
    path = Path(cache_dir)
    try:
        if path.exists() and not path.is_dir():
            raise ConfigError(f"{what} {cache_dir} exists and is not a folder: name a folder for the cache")
        existing = next(p for p in (path, *path.parents) if p.exists())
    except OSError as err:  # a name too long, a part that is a file: what the file system says, in one line
        raise ConfigError(f"{what} {str(cache_dir)[:200]}: {err.strerror or err}") from None
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{what} {cache_dir}: {existing} is not writable, so nothing could be kept there")


MANIFEST = "manifest.json"  # a verified directory's sizes and digests of its files (write_manifest)
OWNED = ".densepass-owned"  # in a directory atomic_directory wrote: the files it wrote there, so it may replace them


def _files_under(directory: Path) -> list[str]:
    """Every file and link under ``directory`` (relative, sorted), folders left out; symlinks are not followed."""
    found = []
    for root, folders, files in os.walk(directory):
        base = Path(root)
        found += [str((base / name).relative_to(directory)) for name in files]
        found += [str((base / name).relative_to(directory)) for name in folders if (base / name).is_symlink()]
    return sorted(found)


def foreign_files(directory: str | Path) -> list[str]:
    """The files under ``directory`` that ``atomic_directory`` did not write there (all of them where it holds no
    ``OWNED`` list); empty for a missing or empty directory. A directory saved before ``OWNED`` existed counts as
    densepass's where its ``manifest.json`` lists every other file in it, each with its size and digest."""
    directory = Path(directory)
    if not directory.is_dir() or directory.is_symlink():
        return [] if not directory.exists() and not directory.is_symlink() else [directory.name]
    listed = _listed(directory)
    return [
        name
        for name in _files_under(directory)
        if name != OWNED and name not in listed and not (name == LOCK and is_densepass_lock(directory / name))
    ]


def check_replaceable(path: str | Path, what: str = "output") -> None:
    """A one-line error unless ``path`` is missing, an empty directory, or a directory densepass wrote whose every
    file it wrote (``foreign_files``): densepass never replaces, and so never deletes, a file it did not write."""
    from densepass.errors import DensepassError

    path = Path(path)
    if path.is_symlink() or path.exists() and not path.is_dir():
        raise DensepassError(f"{what} {path} exists and is not a directory densepass wrote; choose another path")
    foreign = foreign_files(path)
    if foreign:
        shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
        raise DensepassError(
            f"{what} {path} holds files densepass did not write ({shown}); densepass replaces only what it wrote: "
            "choose another path, or move those files away yourself"
        )


def move_aside(path: str | Path) -> Path | None:
    """Rename ``path`` to ``<path>.replaced-<time>`` where it holds what densepass may not replace
    (``check_replaceable``): ``--force`` keeps a user's files instead of deleting them. Returns the new name, or
    None where nothing was in the way."""
    import time

    from densepass.errors import DensepassError

    path = Path(path)
    try:
        check_replaceable(path)
        return None
    except DensepassError:
        pass
    target = path.with_name(f"{path.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}")
    serial = 1
    while target.exists() or target.is_symlink():
        serial += 1
        target = target.with_name(f"{path.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}-{serial}")
    os.rename(path, target)
    return target


@contextlib.contextmanager
def atomic_directory(path: str | Path) -> Iterator[Path]:
    """Yield a temporary directory that replaces ``path`` only when the block finishes without error.

    An interrupted save leaves the previous ``path`` (if any) untouched: the new directory's files are synced to the
    disk, then swapped with the old one in one step where the system can (``_exchange``), so that a crash or a power
    loss leaves the old directory or the whole new one. ``path`` must be missing, empty, or a
    directory this function wrote with nothing added since (``check_replaceable``: checked before the block runs
    and again before the swap); the new directory lists the files it holds in ``OWNED``.
    """
    path = Path(path)
    _restore_replaced(path)
    check_replaceable(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        yield tmp
        atomic_write_text(tmp / OWNED, json.dumps(_files_under(tmp), indent=0))
        check_replaceable(path)
        _sync_tree(tmp)  # on the disk before the swap: after a power loss the new directory is whole or absent
        if path.exists() and _exchange(tmp, path):  # one step: ``path`` is the old or the new directory, never none
            shutil.rmtree(tmp, ignore_errors=True)  # (the old one, now under the temporary name)
        elif path.exists():  # no exchange here (not Linux, or a file system without it): two renames
            old = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".old"))
            os.replace(path, old)  # an empty folder of our own is replaced by the old directory
            os.replace(tmp, path)  # (killed in between: the next save restores the old one, _restore_replaced)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
        _sync_directory(path.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _exchange(first: Path, second: Path) -> bool:
    """Swap two paths in one step (Linux's ``renameat2(RENAME_EXCHANGE)``, from the C library); False where the
    system or the file system has no such call."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_cwd, exchange = -100, 2  # AT_FDCWD, RENAME_EXCHANGE
    if renameat2(at_cwd, os.fsencode(first), at_cwd, os.fsencode(second), exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(second))


def _restore_replaced(path: Path) -> None:
    """Where ``path`` is missing and a save that replaced it by two renames was killed between them, put the old
    directory (``.<name>.<random>.old``) back; a newer complete temporary is left to ``remove_stale_temporaries``."""
    if path.exists() or path.is_symlink() or not path.parent.is_dir():
        return
    pattern = re.compile(rf"\.{re.escape(path.name)}\.[a-z0-9_]{{8}}\.old")
    olds = [p for p in path.parent.iterdir() if pattern.fullmatch(p.name) and p.is_dir() and not p.is_symlink()]
    if len(olds) == 1 and any(olds[0].iterdir()):
        os.replace(olds[0], path)


def _sync_tree(directory: Path) -> None:
    """``fsync`` every file under ``directory`` and the folders themselves (their entries)."""
    for root, _, files in os.walk(directory):
        for name in files:
            if not os.path.islink(os.path.join(root, name)):
                _sync_file(os.path.join(root, name))
        _sync_directory(Path(root))


def _sync_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_directory(directory: Path) -> None:
    """``fsync`` a folder (its entries: a rename into it survives a power loss); nothing where that is refused."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


LOCK = ".lock"  # the file exclusive_lock locks in its directory; it holds "pid <holder's pid>"
_LOCK_TEXT = re.compile(r"(?:pid \d+)?\s*")


def is_densepass_lock(path: str | Path) -> bool:
    """Whether ``path`` is a lock file ``exclusive_lock`` wrote: a regular file (not a link) holding its holder's
    ``pid N``, or nothing (made by a process that has not written it yet). A user's file named ``.lock`` holds
    anything else: densepass neither removes nor rewrites it."""
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > 64:
            return False
        with open(path, "rb") as handle:
            return _LOCK_TEXT.fullmatch(handle.read().decode("ascii")) is not None
    except (OSError, UnicodeDecodeError):
        return False


@contextlib.contextmanager
def exclusive_lock(directory: str | Path, what: str = "run", wait: bool = False) -> Iterator[None]:
    """Hold an exclusive lock on ``directory`` (created if missing) for the block's duration.

    A second densepass process that asks for the same directory gets a one-line error instead of
    interleaving its writes with the first one's (``wait``: it waits for the lock instead, saying so in one line on
    stderr). The lock is
    released when the process ends, however it ends (``fcntl.flock`` on ``<directory>/.lock``). The holder may
    remove ``directory`` before it lets go (a work directory): a process that locked the removed file tries again.
    """
    import fcntl

    from densepass.errors import DensepassError

    directory = Path(directory)
    said = False
    while True:
        directory.mkdir(parents=True, exist_ok=True)
        if os.path.lexists(directory / LOCK) and not is_densepass_lock(directory / LOCK):
            raise DensepassError(
                f"{directory / LOCK} is not a lock file densepass wrote (densepass locks {directory} through it): "
                "move it away, or choose another directory"
            )
        try:
            handle = open(directory / LOCK, "a+")
        except FileNotFoundError:  # removed by its holder between the two lines
            continue
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            if not wait:
                handle.close()
                raise DensepassError(
                    f"{directory} is in use by another densepass {what} ({holder}); "
                    "wait for it to finish or choose another directory"
                ) from None
            if not said:  # once: a run that seems stuck says what it waits for
                print(f"waiting for another densepass {what} in {directory} ({holder}) to finish", file=sys.stderr)
                said = True
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            current = os.stat(directory / ".lock").st_ino
        except FileNotFoundError:
            current = None
        if current == os.fstat(handle.fileno()).st_ino:
            break
        handle.close()  # the holder removed the directory before it let go: this lock is of a file now gone
    try:
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}")
        handle.flush()
        yield
    finally:
        handle.close()


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


RUN_MARKER = ".densepass-run"  # in a run directory densepass made: it may write there and --restart empty it
# the temporaries densepass makes beside what it writes (atomic_file / atomic_directory: ``tempfile`` adds 8 random
# characters of [a-z0-9_] to the prefix ".<name>."; ".old" is a replaced directory on its way out); no other name
_TEMPORARY = re.compile(r"\.(?P<name>.+)\.[a-z0-9_]{8}\.(?:tmp|old)")


def run_entry(name: str, entries: tuple[str, ...]) -> bool:
    """Whether ``name``, in a run directory, is one of the ``entries`` a run writes there (glob patterns of names;
    ``"runs/*.trec"`` names ``runs`` and what it may hold), or a temporary sibling densepass makes of one
    (``.<entry>.<random>.tmp`` while it is written, ...)."""
    return _entry_pattern(name, entries) is not None


def _entry_pattern(name: str, entries: tuple[str, ...]) -> str | None:
    """The first of ``entries`` that names ``name`` (or the entry ``name`` is a temporary sibling of), or None."""
    temporary = _TEMPORARY.fullmatch(name)
    name = temporary["name"] if temporary else name
    return next((e for e in entries if fnmatch.fnmatchcase(name, e.split("/", 1)[0])), None)


def written_by_densepass(path: Path) -> bool:
    """Whether a file named as one of a run's outputs also reads as one, where a user's file could bear the name:
    a TREC run a run writes (every line ``qid Q0 pid rank score TAG``, TAG the file's stem: a run tags each of its
    runs with its system's name; a copy of ``densepass search``'s output, tagged ``densepass``, is a user's file), a
    config it saves (YAML with no comment: a file with comments holds a user's notes), a report (its title line).
    Other names: True (the name is densepass's)."""
    try:
        if path.suffix == ".trec":
            with open(path, encoding="utf-8") as handle:
                return all(len(f := line.split()) == 6 and f[5] == path.stem for line in handle if line.strip())
        if path.name == "config.yaml":
            with open(path, encoding="utf-8") as handle:
                return not any(line.lstrip().startswith("#") for line in handle)
        if path.name == "report.md":  # densepass's reports open with their title line
            with open(path, encoding="utf-8") as handle:
                return re.match(r"# (densepass \w+: |Phrase retrieval run `)", handle.readline()) is not None
    except (OSError, UnicodeDecodeError):
        return False
    return True


def _listed(directory: Path) -> set[str]:
    """The files (relative) ``atomic_directory`` wrote in ``directory`` (its ``OWNED`` list, or a verified
    manifest of an older version's save); empty where it wrote none."""
    try:
        owned = json.loads((directory / OWNED).read_text(encoding="utf-8"))
        if isinstance(owned, list):
            return {str(name) for name in owned} | {OWNED}
    except (OSError, ValueError):
        pass
    if (directory / MANIFEST).is_file() and manifest_problem(directory) is None:
        return set(json.loads((directory / MANIFEST).read_text())["files"]) | {MANIFEST}
    return set()


def _names(name: str, pattern: str) -> bool:
    """Whether ``pattern`` (``"miner-*/train_log.jsonl"``) names the file ``name``, folder by folder: a ``*`` never
    reaches into a folder, so a pattern names a file, never what a user put inside a folder it matches."""
    parts, wanted = Path(name).parts, pattern.split("/")
    return len(parts) == len(wanted) and all(map(fnmatch.fnmatchcase, parts, wanted))


def _foreign_in(root: Path, inner: str | None) -> list[str]:
    """The files under the run entry ``root`` densepass did not write: those no directory on their way lists
    (``_listed``) and the entry's pattern ``inner`` (``"*.trec"`` of ``"runs/*.trec"``) does not name (``_names``)."""
    listed: dict[Path, set[str]] = {}
    foreign = []
    for name in _files_under(root):
        path = root / name
        if path.name == LOCK and is_densepass_lock(path) or any(_TEMPORARY.fullmatch(p) for p in Path(name).parts):
            continue  # a lock densepass took (a token cache's), or in a temporary it makes while it writes
        if inner is not None and any(_names(name, pattern) for pattern in inner.split("|")):
            if not path.is_symlink() and written_by_densepass(path):  # densepass never writes a link
                continue
        ancestors = [path.parents[i] for i in range(len(Path(name).parts))]  # its folder ... up to root
        for folder in ancestors:
            if folder not in listed:
                listed[folder] = _listed(folder)
            if str(path.relative_to(folder)) in listed[folder]:
                break
        else:
            foreign.append(f"{root.name}/{name}")
    return foreign


def _legacy_run(directory: Path, present: list[str], entries: tuple[str, ...]) -> bool:
    """Whether ``directory`` (no ``RUN_MARKER``) is a run directory of an older version: its ``config.yaml`` is
    a config naming this directory (``name``, ``output_dir``), and the rest is what such a run writes."""
    import yaml

    try:
        saved = yaml.safe_load((directory / "config.yaml").read_text(encoding="utf-8"))
    except Exception:  # unreadable, not YAML: not a config densepass wrote
        return False
    return (
        isinstance(saved, dict)
        and saved.get("name") == directory.name
        and "output_dir" in saved
        and all(run_entry(name, entries) for name in present)
    )


def run_directory_problem(directory: str | Path, what: str, entries: tuple[str, ...]) -> str | None:
    """Why densepass may not write a ``what`` into ``directory``, or None: it may where the directory is missing,
    empty, marked as a run directory (``RUN_MARKER``), or, without a marker, a run directory of an older version
    (``_legacy_run``)."""
    directory = Path(directory)
    if directory.is_symlink() and not directory.is_dir() or directory.exists() and not directory.is_dir():
        return f"{directory} exists and is not a directory"
    if not directory.is_dir():
        return None
    if (directory / RUN_MARKER).is_file():
        try:
            kind = json.loads((directory / RUN_MARKER).read_text(encoding="utf-8")).get("densepass")
        except (OSError, ValueError, AttributeError):
            kind = None
        if kind != what:
            return f"{directory} is a densepass {kind or 'unknown'} directory, not a {what}'s: choose another name"
        links = sorted(c.name for c in directory.iterdir() if c.is_symlink() and run_entry(c.name, entries))
        if links:
            shown = ", ".join(links)
            return f"{directory} holds links where a {what} writes ({shown}): densepass never writes through them"
        return _users_file_in_the_way(directory, what, entries)
    present = sorted(c.name for c in directory.iterdir() if c.name != ".lock")
    if not present or _legacy_run(directory, present, entries):
        return _users_file_in_the_way(directory, what, entries)
    shown = ", ".join(present[:3]) + (f" and {len(present) - 3} more" if len(present) > 3 else "")
    return (
        f"{directory} is not a densepass {what} directory (it holds {shown}); densepass writes a run only into a "
        "new or empty directory or one of its own runs: choose another name or output_dir"
    )


def _users_file_in_the_way(directory: Path, what: str, entries: tuple[str, ...]) -> str | None:
    """A user's file where the run writes one of its own (a commented config.yaml, a TREC file of theirs): the run
    would replace it, so it is refused (``written_by_densepass``)."""
    theirs = sorted(
        c.name
        for c in directory.iterdir()
        if c.is_file() and not c.is_symlink() and run_entry(c.name, entries) and not written_by_densepass(c)
    )
    if not theirs:
        return None
    return (
        f"{directory / theirs[0]} is not a file densepass wrote (a {what} would write its own there): move it "
        "away, or choose another name or output_dir"
    )


def claim_run_directory(directory: str | Path, what: str, entries: tuple[str, ...], restart: bool) -> list[str]:
    """Make ``directory`` a ``what``'s run directory (call it holding the directory's ``exclusive_lock``): a
    one-line error where ``run_directory_problem`` says it is someone else's; marked with ``RUN_MARKER``. With
    ``restart``, what an earlier run wrote there (``entries``) is removed and everything else kept: returns what
    was kept (files densepass did not write: in an entry holding any, densepass's own files go and theirs stay, in
    their folders). A symlink is removed as a link, never followed."""
    from densepass.errors import DensepassError

    directory = Path(directory)
    problem = run_directory_problem(directory, what, entries)
    if problem is not None:
        raise DensepassError(problem)
    directory.mkdir(parents=True, exist_ok=True)
    if not (directory / RUN_MARKER).is_file():
        atomic_write_text(directory / RUN_MARKER, json.dumps({"densepass": what}) + "\n")
    if not restart:
        return []
    found = []  # (entry, its pattern, the user's files under it: None where it is no folder of the run's)
    for child in sorted(directory.iterdir()):
        if child.name in (".lock", RUN_MARKER):
            continue
        pattern = _entry_pattern(child.name, entries)
        folder = pattern is not None and child.is_dir() and not child.is_symlink()
        foreign = _foreign_in(child, pattern.split("/", 1)[1] if "/" in pattern else None) if folder else None
        found.append((child, pattern, foreign))
    check_nothing_foreign_in_saved_folders(directory, [name for *_, foreign in found for name in foreign or ()])
    kept = []
    for child, pattern, foreign in found:
        if pattern is None or child.is_file() and not child.is_symlink() and not written_by_densepass(child):
            kept.append(child.name)
        elif foreign:
            kept += foreign
            _remove_all_but(child, {name.split("/", 1)[1] for name in foreign})
        elif foreign is not None:
            shutil.rmtree(child)
        else:
            child.unlink()
    return kept


def check_nothing_foreign_in_saved_folders(directory: Path, foreign: list[str]) -> None:
    """Refuse ``--restart``, before anything is removed, where a user's file (``foreign``: names relative to
    ``directory``) lies inside a folder densepass saves whole (one with its ``OWNED`` list: a model, a checkpoint):
    the run's own files around it would go, and the run's next save there would then refuse the folder
    (``check_replaceable``), after training."""
    from densepass.errors import DensepassError

    for name in foreign:
        path = directory / name
        inside = path.parents[: len(Path(name).parts) - 1]  # its folders below ``directory``, nearest first
        saved = next((folder for folder in inside if _listed(folder)), None)
        if saved is not None:
            raise DensepassError(
                f"--restart: {path} is not densepass's, inside {saved}, a folder densepass saves whole (the new run "
                "could not save there): move it out first"
            )


def _remove_all_but(root: Path, keep: set[str]) -> None:
    """Remove every file and link under ``root`` but those ``keep`` names (relative), then the folders left empty:
    a restarted run's own files go (its checkpoints too: a kept one would be resumed), a user's stay where they
    were. Links are removed as links, never followed."""
    for name in _files_under(root):
        if name not in keep:
            (root / name).unlink()
    for folder, _, _ in sorted(os.walk(root), key=lambda walked: -len(Path(walked[0]).parts)):  # deepest first
        with contextlib.suppress(OSError):  # not empty: it holds a kept file
            if Path(folder) != root:
                os.rmdir(folder)


@contextlib.contextmanager
def owned_run_directory(
    directory: str | Path, what: str, entries: tuple[str, ...], restart: bool, saved: tuple[str, ...] = ()
) -> Iterator[Path]:
    """``directory`` as a ``what``'s run directory for the block, claimed at once (``locked_run_directory``): for a
    command whose checks have all passed before it gets here."""
    with locked_run_directory(directory, what, entries, restart, saved) as claim:
        yield claim()


@contextlib.contextmanager
def locked_run_directory(
    directory: str | Path, what: str, entries: tuple[str, ...], restart: bool, saved: tuple[str, ...] = ()
) -> Iterator[Callable[[], Path]]:
    """``directory`` locked for a ``what``'s run, and claimed only when the block calls the ``claim()`` it yields.

    Refused before its lock where it is someone else's (``run_directory_problem``; the lock would leave a ``.lock``
    in their folder); locked; the folders ``saved`` that the run will replace checked as densepass's own
    (``check_replaceable``). The block then runs the command's own checks (its model and data, what the directory
    holds), which only read, and calls ``claim()`` once they have all passed: the directory is marked
    (``claim_run_directory``) and, with ``restart``, what an earlier run wrote is removed, with one warning naming
    what was kept. So a run refused by a check removes nothing and marks nothing: a block that ends before
    ``claim()`` removes the ``.lock`` it added, and the folders the lock made, leaving the directory as it was."""
    import warnings

    from densepass.errors import ConfigError, DataWarning

    directory = Path(directory)
    problem = run_directory_problem(directory, what, entries)
    if problem is not None:
        raise ConfigError(problem)
    made = [d for d in (directory, *directory.parents) if not d.exists() and not d.is_symlink()]  # deepest first
    new_lock = not os.path.lexists(directory / ".lock")
    claimed = False

    def claim() -> Path:
        nonlocal claimed
        if not claimed:
            kept = claim_run_directory(directory, what, entries, restart)
            claimed = True
            if kept:
                shown = ", ".join(kept[:5])
                warnings.warn(
                    f"--restart kept {len(kept)} file(s) in {directory} that densepass did not write: {shown}",
                    DataWarning,
                    stacklevel=2,
                )
        return directory

    with exclusive_lock(directory, what):
        try:
            for name in saved:
                check_replaceable(directory / name, f"the {what}'s")
            yield claim
        finally:
            if not claimed:  # refused (or left) before the claim: undo what the lock wrote, still holding it
                with contextlib.suppress(OSError):
                    if new_lock:
                        (directory / ".lock").unlink()
                    for folder in made:
                        folder.rmdir()  # only while empty: a folder anything was put into stays


# ---- a full disk, a read-only place: one line, before the work where it can be ---------------------------

DISK_ERRORS = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
}
"""The errnos of a write that fails for want of space or permission, and how ``disk_errors`` names them."""
STALE_AFTER_S = 60.0
"""A temporary no process holds is taken for a killed process's once it is this old (``remove_stale_temporaries``)."""
_TEMPORARY_TAIL = r"\.[a-z0-9_]{8}\.tmp"  # what tempfile.mkstemp / mkdtemp add to our prefix ".<name>.": 8 characters


def disk_errno(err: BaseException, wrapped: bool = True) -> int | None:
    """The errno (one of ``DISK_ERRORS``) of a write that failed for want of space or permission: an ``OSError``'s, or
    (``wrapped``) the one safetensors (``SafetensorError: ... (os error 28)``) or FAISS (``RuntimeError: ... (No space
    left on device)``) put in their message; None for any other error."""
    if isinstance(err, OSError):
        return err.errno if err.errno in DISK_ERRORS else None
    if not wrapped or not isinstance(err, RuntimeError) and type(err).__name__ != "SafetensorError":
        return None
    text = str(err)
    coded = re.search(r"os error (\d+)|Os \{ code: (\d+)", text)
    if coded:
        code = int(coded.group(1) or coded.group(2))
        return code if code in DISK_ERRORS else None
    return next((code for code in DISK_ERRORS if os.strerror(code) in text), None)


def free_bytes(path: str | Path) -> int | None:
    """The bytes free (to an unprivileged user) on the file system of ``path``, or of its nearest existing parent."""
    path = Path(path).absolute()
    for place in (path, *path.parents):
        if place.exists():
            try:
                return shutil.disk_usage(place).free
            except OSError:
                return None
    return None


def _megabytes(size: int) -> str:
    return f"{size / 1e6:.1f} MB" if size < 10e6 else f"{size / 1e6:,.0f} MB"


def disk_error_message(code: int, path: str | Path, needs: int | None = None, free: int | None = None) -> str:
    """One line for a write of ``path`` that failed with errno ``code``; for a full disk or quota, with what the write
    needed (``needs`` bytes, where known) and what is free (``free``; looked up when not given)."""
    reason = DISK_ERRORS.get(code) or os.strerror(code).lower()
    if code not in (errno.ENOSPC, errno.EDQUOT):
        return f"{reason}: cannot write {path}"
    free = free_bytes(path) if free is None else free
    sizes = [f"needs ~{_megabytes(needs)}"] if needs else []
    sizes += [f"{_megabytes(free)} free"] if free is not None else []
    return f"{reason} writing {path}" + (f" ({', '.join(sizes)})" if sizes else "")


@contextlib.contextmanager
def disk_errors(path: str | Path, needs: int | None = None) -> Iterator[None]:
    """Turn a write in the block that fails for want of space or permission (``disk_errno``: ``OSError`` ENOSPC,
    EDQUOT, EROFS, EACCES, or safetensors' / FAISS's errors wrapping one) into a one-line ``DiskError`` naming
    ``path``, what the block writes (``needs``: about how many bytes, where known); any other error passes as it is.
    Cleanups inside the block (``atomic_directory``'s, ``atomic_file``'s) run first. Where scopes nest (a model saved
    into a checkpoint's temporary directory), the outermost names the write: what the user asked for."""
    from densepass.errors import DiskError

    try:
        yield
    except DiskError as err:
        needs = needs or err.needs
        raise DiskError(disk_error_message(err.code, path, needs), err.code, needs) from err.__cause__
    except Exception as err:
        code = disk_errno(err)
        if code is None:
            raise
        raise DiskError(disk_error_message(code, path, needs), code, needs) from err


def reserve_space(path: str | Path, size: int | None = None) -> None:
    """Allocate the disk blocks of the file at ``path`` (made where missing; its first ``size`` bytes, all of it by
    default) before it is written through a memory map. A store to a mapped page that the file system cannot back
    kills the process with SIGBUS, with no message; blocks allocated here can be written, so a full disk is a
    one-line ``DensepassError`` here, before the work. Where the file system cannot allocate ahead
    (``posix_fallocate`` unsupported), its free space is checked against what the file still lacks instead."""
    from densepass.errors import DiskError

    path = Path(path)
    free = free_bytes(path)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        stat = os.fstat(fd)
        size = stat.st_size if size is None else size
        if size <= 0:
            return
        allocate = getattr(os, "posix_fallocate", None)
        if allocate is not None:
            try:
                allocate(fd, 0, size)
                return
            except OSError as err:
                if err.errno in DISK_ERRORS:
                    raise DiskError(disk_error_message(err.errno, path, size, free), err.errno, size) from err
                # not supported here (EOPNOTSUPP, EINVAL, ...): check the free space instead
        missing = size - min(size, stat.st_blocks * 512)
        if free is not None and missing > free:
            raise DiskError(disk_error_message(errno.ENOSPC, path, size, free), errno.ENOSPC, size)
    finally:
        os.close(fd)


def _hold(fd: int) -> None:
    """Mark the temporary open as ``fd`` as in use (a shared ``flock``): ``remove_stale_temporaries`` leaves it."""
    import fcntl

    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)


@contextlib.contextmanager
def hold_temporaries() -> Iterator[Callable[[str | Path], None]]:
    """``hold(path)`` marks a temporary file or directory as in use until the block ends, so that
    ``remove_stale_temporaries`` in another process leaves it alone. Enter it before ``atomic_directory``, so that
    the hold lasts until the directory has been renamed into place."""
    fds: list[int] = []

    def hold(path: str | Path) -> None:
        with contextlib.suppress(OSError):
            fds.append(os.open(path, os.O_RDONLY))
            _hold(fds[-1])

    try:
        yield hold
    finally:
        for fd in fds:
            os.close(fd)


def remove_stale_temporaries(directory: str | Path, name: str, owned: bool = False) -> list[Path]:
    """Remove what killed densepass processes left in ``directory`` while writing ``name`` there (a regular expression
    for the target's name: ``re.escape("run.trec")``, ``r"step-\\d+"``): the temporary files and directories that
    ``atomic_file`` / ``atomic_write_text`` / ``atomic_directory`` make, ``.<name>.<8 random characters>.tmp``.
    Nothing of any other name is touched (no link is followed), nor a temporary that a live process holds
    (``hold_temporaries``); unless ``owned`` (the caller holds the lock of whatever writes ``name`` there), nor one
    modified in the last ``STALE_AFTER_S`` seconds (just made, not held yet). Returns what was removed."""
    import fcntl
    import time

    pattern = re.compile(rf"\.(?:{name}){_TEMPORARY_TAIL}")
    removed: list[Path] = []
    try:
        entries = [entry for entry in os.scandir(directory) if pattern.fullmatch(entry.name)]
    except OSError:
        return removed
    for entry in entries:
        path = Path(entry.path)
        try:
            if entry.is_symlink() or not owned and time.time() - entry.stat().st_mtime < STALE_AFTER_S:
                continue
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held (by a live process): OSError, and it stays
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(path)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


@contextlib.contextmanager
def atomic_file(path: str | Path, mode: str = "w", needs: int | None = None) -> Iterator[IO]:
    """A handle (``open``'s ``mode``, "w" or "wb") on a temporary sibling of ``path`` that replaces ``path`` when the
    block ends without error, and is removed when it does not: ``path`` is never half-written. A full disk or a
    read-only place is a one-line ``DensepassError`` (``disk_errors``; ``needs``: about how many bytes are written);
    temporaries of ``path`` that a killed process left are removed first (``remove_stale_temporaries``)."""
    path = Path(path)
    with disk_errors(path, needs):
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(path.parent, re.escape(path.name))
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        try:
            os.fchmod(fd, _file_mode(path))  # mkstemp's is private to its owner; an output is not
            with os.fdopen(fd, mode) as handle:
                _hold(handle.fileno())
                yield handle
                handle.flush()
                os.fsync(handle.fileno())  # the data on the disk before the rename makes it ``path``
            os.replace(tmp, path)
            _sync_directory(path.parent)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise


def _file_mode(path: Path) -> int:
    """The mode a file written at ``path`` gets: the one it replaces keeps its own, a new one what ``open`` gives
    (0666 less the umask)."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return 0o666 & ~_umask()


def _umask() -> int:
    """This process's umask, read without setting it (``os.umask`` would, for every thread, for an instant)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            return next(int(line.split()[1], 8) for line in status if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return 0o022


def check_output_file(path: str | Path, what: str, ours: Callable[[Path], bool]) -> None:
    """A one-line error unless ``path`` is free for a ``what`` densepass writes: missing, empty (0 bytes), or a
    file ``ours`` recognises, read whole, as that format (so densepass overwrites its own output of an earlier
    run, never a user's file that happens to have the name). A directory or a link there is refused too."""
    from densepass.errors import DensepassError

    path = Path(path)
    if path.is_symlink() or path.exists() and not path.is_file():
        raise DensepassError(f"--output {path} exists and is not a file; give the path of the {what} to write")
    check_writable(path)
    if not path.exists() or path.stat().st_size == 0:
        return
    try:
        recognised = ours(path)
    except Exception:  # whatever it fails on (bytes, syntax, depth), it is not densepass's output
        recognised = False
    if not recognised:
        raise DensepassError(
            f"--output {path} exists and is not a {what} densepass wrote; densepass overwrites only its own files: "
            "choose another path, or move that file away yourself"
        )


def check_writable(output: Path) -> None:
    """Fail before any work where the file ``output`` cannot be written: a name longer than the file system takes,
    a file where a folder should be, a place where nothing can be made (``/proc``, a read-only mount). A file is
    made and removed at once in the nearest existing folder; the ``OSError`` names ``output`` (the CLI prints it in
    one line)."""
    try:
        if any(len(os.fsencode(part)) > 255 for part in output.parts):
            raise OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG))
        folder = next(p for p in output.absolute().parents if os.path.lexists(p))
        if not folder.is_dir():
            raise OSError(errno.ENOTDIR, os.strerror(errno.ENOTDIR))
        handle, probe = tempfile.mkstemp(dir=folder, prefix=f".{output.name}.", suffix=".tmp")
    except OSError as err:
        raise OSError(err.errno, err.strerror, str(output)) from None
    os.close(handle)
    os.unlink(probe)


def every_line(test: Callable[[str], bool]) -> Callable[[Path], bool]:
    """A recogniser for ``check_output_file``: every line of the file (UTF-8, read as a stream) passes ``test``."""

    def recognise(path: Path) -> bool:
        with open(path, encoding="utf-8") as handle:
            return all(test(line.rstrip("\n")) for line in handle)

    return recognise
