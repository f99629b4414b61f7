"""Where datasets live: ``--data-dir``, else $DENSEPASS_DATA, else ``../shared/data`` beside the project."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from densepass.errors import ConfigError, DataError

ENV_VAR = "DENSEPASS_DATA"


def default_data_dir() -> Path:
    """``$DENSEPASS_DATA``, else the first ``shared/data`` found beside or above the working directory."""
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR])
    here = Path.cwd()
    for parent in [here, *here.parents]:
        candidate = parent / "shared" / "data"
        if candidate.is_dir():
            return candidate
        candidate = parent.parent / "shared" / "data"
        if candidate.is_dir():
            return candidate
    return here / "data"


def dataset_dir(name: str, data_dir: str | Path | None = None) -> Path:
    """The directory of dataset ``name`` (or ``name`` itself when it is a path to a directory)."""
    if _is_dir(Path(name)):
        return Path(name)
    root = Path(data_dir) if data_dir else default_data_dir()
    path = root / name
    if not _is_dir(path) and _is_file(Path(name)):
        raise DataError(
            f"{name} is a file: a dataset with queries and judgements is a folder (BEIR, MS MARCO, ...); give the "
            "folder, or, where the command takes them, the queries with --queries"
        )
    if not _is_dir(path):
        raise DataError(
            f"dataset {name!r} not found in {root} (set --data-dir or ${ENV_VAR}, "
            f"or download it with `densepass download {name}`)"
        )
    return path


def dataset_file(name: str, data_dir: str | Path | None = None) -> Path | None:
    """``name`` as a file (a corpus file given where a dataset is asked for): a path, else a name under the data
    directory; None where neither is a file."""
    root = Path(data_dir) if data_dir else default_data_dir()
    return next((path for path in (Path(name), root / name) if _is_file(path)), None)


def pairs_path(name: str, data_dir: str | Path | None = None) -> Path:
    """The file (or ``save_to_disk`` folder) of training rows ``name``: a path, else a name under the data
    directory (a one-line DataError when neither exists)."""
    path = Path(name)
    if _exists(path) or path.is_absolute():
        return path
    root = Path(data_dir) if data_dir else default_data_dir()
    if _exists(root / name):
        return root / name
    raise DataError(f"training rows {name!r} not found (neither a path nor a name in {root})")


def check_output_apart(
    output: str | Path, dataset: str, data_dir: str | Path | None, models: Sequence[str | Path | None]
) -> None:
    """A one-line ConfigError where ``output`` is, holds or lies inside the folder of ``dataset`` (or is or holds
    its file, where the dataset is one: a corpus file) or of one of ``models`` (those that are local folders): the
    command would replace, or with ``--force`` move aside, what it reads. A dataset that is not found is left to the
    error its loading gives."""
    target = Path(output).resolve()
    inputs = [Path(m) for m in models if m and _is_dir(Path(m))]
    try:
        inputs.append(dataset_dir(dataset, data_dir))
    except DataError:
        file = dataset_file(dataset, data_dir)
        inputs += [file] if file is not None else []
    for path in (p.resolve() for p in inputs):
        if target == path or path in target.parents or target in path.parents:
            raise ConfigError(f"--output {output} is, holds or lies inside {path}, which this command reads")


def _is_dir(path: Path) -> bool:
    """``path.is_dir()``, False where the path cannot be looked up (a name too long for the file system, a folder
    that may not be read), which pathlib raises as an OSError."""
    try:
        return path.is_dir()
    except OSError:
        return False


def _is_file(path: Path) -> bool:
    """``path.is_file()``, False where the path cannot be looked up (as ``_is_dir``)."""
    try:
        return path.is_file()
    except OSError:
        return False


def _exists(path: Path) -> bool:
    """``path.exists()``, False where the path cannot be looked up (as ``_is_dir``)."""
    try:
        return path.exists()
    except OSError:
        return False
