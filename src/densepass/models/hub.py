"""Models from the Hugging Face Hub: a hub id (``org/name``, optionally ``org/name@revision``) becomes a local
directory, from the Hub's cache when it holds the model, else downloaded once into it (a download that did not
complete is completed by the next online run: ``hub_snapshots``).

What is fetched is what densepass loads and nothing else: configs, tokenizer files and ``*.safetensors`` weights
(never pickled ``*.bin`` / ``*.pt`` weights, which densepass does not load, nor ONNX / TF / Flax copies). The cache
is ``huggingface_hub``'s (``HF_HOME`` / ``HF_HUB_CACHE``); ``HF_HUB_OFFLINE=1`` is respected (only the cache is
read); the token comes from the environment (``HF_TOKEN``) or ``huggingface-cli login``; the download shows
``huggingface_hub``'s progress bars. A revision (branch, tag or commit) pins what is loaded. Every failure is one
line: offline and not cached, not found, gated, no safetensors weights, a model that needs code of its own (the
caller's ``check_model_files``).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from densepass.errors import ConfigError
from densepass.hub_snapshots import download_in_full, is_complete, mark_complete, network_errors

# what a model directory needs: configs (also the sentence-transformers modules'), tokenizer files, weights
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "tokenizer*", "*.tiktoken", "merges.txt"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")


def hub_id(name: str) -> tuple[str, str | None] | None:
    """(repo id, revision) when ``name`` is written as a hub id (``org/name`` or ``name``, ``@revision``
    optional), else None (a path)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    repo, _, revision = name.partition("@")
    if not _HUB_ID.match(repo) or repo.endswith((".", "-")) or ".." in repo:
        return None
    try:
        validate_repo_id(repo)  # the Hub's own rules ("--", ".git", 96 characters at most)
    except HFValidationError:
        return None
    return repo, revision or None


def _download(repo: str, revision: str | None) -> str:
    """Fetch ``repo`` at ``revision`` into the cache (the network; replaced by a fake in the tests)."""
    return download_in_full(repo, ALLOW_PATTERNS, revision=revision)


def _cached(repo: str, revision: str | None) -> str | None:
    """The cached snapshot of ``repo`` at ``revision``, or None; never the network."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(repo, revision=revision, allow_patterns=ALLOW_PATTERNS, local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError):
        return None


def fetch_model(name: str) -> Path:
    """The local directory of the hub model ``name`` (``org/name[@revision]``): the cached snapshot, else a download
    into the cache. A one-line ConfigError for every failure, with what to do about it."""
    found = hub_id(name)
    if found is None:
        raise ConfigError(f"model not found: {name} is neither a local model directory nor a Hugging Face hub id")
    repo, revision = found
    at = f" at revision {revision}" if revision else ""
    path = _cached(repo, revision)
    from huggingface_hub import constants

    offline = constants.HF_HUB_OFFLINE or _true(os.environ.get("HF_HUB_OFFLINE"))
    if path is not None and not offline and not is_complete(path, ALLOW_PATTERNS):
        path = None  # a snapshot densepass did not see downloaded in full (an interrupted download): completed below
    if path is None:
        from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

        if offline:
            raise ConfigError(
                f"model {repo}{at} is not in the Hugging Face cache and the Hub is offline (HF_HUB_OFFLINE=1): "
                "download it once with the Hub online, or give a local model directory"
            )
        try:
            path = _download(repo, revision)
        except GatedRepoError:
            raise ConfigError(
                f"model {repo} is gated on the Hugging Face Hub: accept its terms on its page, then set HF_TOKEN"
            ) from None
        except RevisionNotFoundError:
            raise ConfigError(f"model {repo} has no revision {revision} on the Hugging Face Hub") from None
        except RepositoryNotFoundError:
            raise ConfigError(
                f"model not found on the Hugging Face Hub: {repo} (a typo? a private model needs HF_TOKEN)"
            ) from None
        except network_errors() as err:  # the Hub could not be reached, or answered with an error
            raise ConfigError(
                f"model {repo}{at} is no local model directory and could not be downloaded: {_first_line(err)}"
            ) from None
        mark_complete(path, ALLOW_PATTERNS)
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ConfigError(f"hub model {repo}{at} has no config.json: it is not a transformers model")
    if not any(path.rglob("*.safetensors")):
        raise ConfigError(
            f"hub model {repo}{at} has no safetensors weights (only pickled ones, which densepass never loads)"
        )
    return path


def _true(value: str | None) -> bool:
    return (value or "").strip().upper() in ("1", "ON", "YES", "TRUE")


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]
