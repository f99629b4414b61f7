"""Models from the Hugging Face Hub (``models.hub``), without the network: a hub id is read from the hub cache
(laid out as the Hub lays it out, through huggingface_hub's own cache lookup), or downloaded once by a fake of the
download; every failure is one line; only configs, tokenizer files and safetensors weights are fetched."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from conftest import http_client_connection_errors, hub_cache_without_network
from densepass.errors import ConfigError
from densepass.models import hub
from densepass.models.biencoder import BiEncoder, resolve_model_path


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty hub cache, the Hub online as far as densepass can tell, and no connection possible."""
    return hub_cache_without_network(tmp_path, monkeypatch)


def lay_out(cache: Path, repo: str, source: Path, revision: str = "main", commit: str = "0123abcd") -> Path:
    """``source`` stored in ``cache`` as the Hub stores a snapshot of ``repo`` at ``revision``."""
    folder = cache / f"models--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / commit
    shutil.copytree(source, snapshot)
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / revision).write_text(commit)
    return snapshot


@pytest.fixture
def fake_hub(cache, tiny_model_dir, monkeypatch):
    """A download that stores the tiny model in the cache as the Hub would, recording what was asked."""
    calls = []

    def download(repo, revision):
        calls.append((repo, revision))
        return str(lay_out(cache, repo, tiny_model_dir, revision or "main", commit=f"c{len(calls)}"))

    monkeypatch.setattr(hub, "_download", download)
    return calls


def test_a_hub_model_is_downloaded_once_then_read_from_the_cache_and_loads(fake_hub, cache):
    path = resolve_model_path("some-org/tiny")
    assert fake_hub == [("some-org/tiny", None)] and Path(path).is_relative_to(cache)
    assert resolve_model_path("some-org/tiny") == path and len(fake_hub) == 1  # the cache, not a second download
    model = BiEncoder.from_pretrained("some-org/tiny")
    assert model.encode_queries(["audio editor"]).shape[0] == 1


def test_a_snapshot_not_downloaded_in_full_is_completed_online_and_read_as_it_is_offline(
    cache, tiny_model_dir, tmp_path, monkeypatch
):
    """An interrupted first download leaves part of the files: online, the next run downloads again (the Hub
    fetches what is missing) instead of reading the part; offline the cache is all there is."""
    partial = tmp_path / "partial"
    shutil.copytree(tiny_model_dir, partial)
    (partial / "model.safetensors").unlink()
    snapshot = lay_out(cache, "some-org/tiny", partial, commit="c0")
    calls = []

    def download(repo, revision):  # the Hub completes the snapshot it already has
        calls.append(repo)
        shutil.copy(tiny_model_dir / "model.safetensors", snapshot / "model.safetensors")
        return str(snapshot)

    monkeypatch.setattr(hub, "_download", download)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ConfigError, match="has no safetensors weights"):  # offline: the part is what there is
        resolve_model_path("some-org/tiny")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert resolve_model_path("some-org/tiny") == str(snapshot) and calls == ["some-org/tiny"]
    assert resolve_model_path("some-org/tiny") == str(snapshot) and len(calls) == 1  # now complete: the cache


def test_a_revision_pins_what_is_fetched_and_read(fake_hub):
    pinned = resolve_model_path("some-org/tiny@v1.0")
    assert fake_hub == [("some-org/tiny", "v1.0")]
    assert resolve_model_path("some-org/tiny@v1.0") == pinned and len(fake_hub) == 1
    resolve_model_path("some-org/tiny")  # main is another snapshot: fetched
    assert fake_hub[-1] == ("some-org/tiny", None)


def test_offline_and_not_cached_is_one_line_naming_the_model(cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "_download", lambda *a: pytest.fail("downloaded while offline"))
    with pytest.raises(ConfigError, match=r"some-org/not-cached is not in the Hugging Face cache and the Hub is off"):
        resolve_model_path("some-org/not-cached")


def _http_error(kind, status):
    response = httpx.Response(status, request=httpx.Request("GET", "https://huggingface.co/api/models/x"))
    return kind("refused", response=response)


@pytest.mark.parametrize(
    "error, message",
    [
        ("RepositoryNotFoundError", "not found on the Hugging Face Hub: some-org/tiny"),
        ("GatedRepoError", "gated on the Hugging Face Hub: accept its terms"),
        ("RevisionNotFoundError", "has no revision"),
    ],
)
def test_hub_failures_are_one_line(cache, monkeypatch, error, message):
    import huggingface_hub.errors as errors

    def failing(repo, revision):
        raise _http_error(getattr(errors, error), 404 if error != "GatedRepoError" else 403)

    monkeypatch.setattr(hub, "_download", failing)
    with pytest.raises(ConfigError, match=message) as caught:
        resolve_model_path("some-org/tiny@v9" if error == "RevisionNotFoundError" else "some-org/tiny")
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("error", http_client_connection_errors(), ids=lambda e: type(e).__module__.split(".")[0])
def test_a_hub_that_cannot_be_reached_is_one_line_naming_the_model(cache, monkeypatch, error):
    """huggingface_hub lets its HTTP client's connection errors through unwrapped (httpx2's, under 2.x): where the
    Hub's host does not resolve, the first request (the repo's file list) fails with one; and where a later one
    fails, the download's."""
    import huggingface_hub

    def unreachable(repo, **kwargs):
        raise error

    monkeypatch.setattr(huggingface_hub, "list_repo_files", unreachable)
    with pytest.raises(ConfigError) as caught:
        resolve_model_path("some-org/tiny")
    assert str(caught.value) == (
        "model some-org/tiny is no local model directory and could not be downloaded: the Hugging Face Hub could not "
        f"be reached ({type(error).__name__}: [Errno -2] Name or service not known)"
    )
    from huggingface_hub.errors import LocalEntryNotFoundError

    def download(repo, local_files_only=False, **kwargs):
        raise LocalEntryNotFoundError("not in the cache") if local_files_only else error

    monkeypatch.setattr(huggingface_hub, "list_repo_files", lambda repo, **kwargs: ["config.json"])
    monkeypatch.setattr(huggingface_hub, "snapshot_download", download)
    with pytest.raises(ConfigError, match=r"could not be downloaded: \[Errno -2\] Name or service not known$"):
        resolve_model_path("some-org/tiny")


def test_pickled_weights_only_and_code_of_its_own_are_refused(cache, tiny_model_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the snapshots laid out below are what the cache holds
    pickled = tmp_path / "pickled"
    shutil.copytree(tiny_model_dir, pickled)
    for weights in pickled.glob("*.safetensors"):
        weights.rename(weights.with_suffix(".bin"))
    lay_out(cache, "some-org/pickled", pickled)
    with pytest.raises(ConfigError, match="no safetensors weights"):
        resolve_model_path("some-org/pickled")
    remote = tmp_path / "remote"
    shutil.copytree(tiny_model_dir, remote)
    config = (remote / "config.json").read_text()
    (remote / "config.json").write_text(config.replace("{", '{"auto_map": {"AutoModel": "m.M"}, ', 1))
    lay_out(cache, "some-org/remote", remote)
    with pytest.raises(ConfigError, match="trust_remote_code stays off"):
        resolve_model_path("some-org/remote")


def test_what_is_fetched_is_configs_tokenizers_and_safetensors_only():
    from huggingface_hub.utils import filter_repo_objects

    files = [
        "config.json", "model.safetensors", "pytorch_model.bin", "tf_model.h5", "onnx/model.onnx", "vocab.txt",
        "tokenizer.json", "1_Pooling/config.json", "modules.json", "flax_model.msgpack", "spiece.model",
    ]  # fmt: skip
    kept = set(filter_repo_objects(files, allow_patterns=hub.ALLOW_PATTERNS))
    assert kept == {
        "config.json", "model.safetensors", "vocab.txt", "tokenizer.json", "1_Pooling/config.json", "modules.json",
        "spiece.model",
    }  # fmt: skip


def test_a_path_that_is_not_there_is_not_taken_for_a_hub_id(cache):
    # the last three pass a simple pattern but not the Hub's rules (an HFValidationError traceback before)
    for name in ("./missing-model", "/no/such/model", "a/b/c", "org/run--final", "org/name.git", "org/" + "a" * 100):
        with pytest.raises(ConfigError, match="neither a local model directory nor a Hugging Face hub id"):
            resolve_model_path(name)


def test_densepass_run_offline_with_an_uncached_model_exits_2_with_one_line(tmp_path, tiny_beir):
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "empty-cache"), "PATH": "/usr/bin:/bin"}
    args = ["run", "--set", f"data.name={tiny_beir}", "--set", "model.name_or_path=some-org/not-cached"]
    args += ["--set", f"output_dir={tmp_path}"]
    result = subprocess.run(
        [sys.executable, "-m", "densepass", *args], cwd=tmp_path, capture_output=True, text=True, env=env
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "some-org/not-cached" in lines[0] and "offline" in lines[0], result.stderr


def test_a_partial_snapshot_is_never_marked_whole_when_the_hub_cannot_be_reached_or_leaves_files_out(
    cache, tiny_model_dir, tmp_path, monkeypatch
):
    """Where the Hub cannot be reached, ``snapshot_download`` returns the cached snapshot whatever it holds: the
    download is checked against the repo's file list, so a partial snapshot is a one-line error, never marked
    complete (which would have it read as whole from then on), and a whole one is read."""
    import huggingface_hub

    from densepass.hub_snapshots import is_complete

    partial = tmp_path / "partial"
    shutil.copytree(tiny_model_dir, partial)
    (partial / "tokenizer.json").unlink()  # an interrupted first download: the weights came, a tokenizer file did not
    snapshot = lay_out(cache, "some-org/tiny", partial, commit="c0")
    listed = sorted(p.relative_to(tiny_model_dir).as_posix() for p in tiny_model_dir.rglob("*") if p.is_file())

    def unreachable(repo, **kwargs):
        raise httpx.ConnectError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(huggingface_hub, "list_repo_files", unreachable)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo, **kwargs: str(snapshot))
    with pytest.raises(ConfigError, match="could not be downloaded: the Hugging Face Hub could not be reached") as err:
        resolve_model_path("some-org/tiny")
    assert "\n" not in str(err.value) and not is_complete(snapshot, hub.ALLOW_PATTERNS)

    monkeypatch.setattr(huggingface_hub, "list_repo_files", lambda repo, **kwargs: [*listed, "README.md"])
    with pytest.raises(ConfigError, match=r"holds \d+ of the repo's \d+ files \(missing: tokenizer.json\); run again"):
        resolve_model_path("some-org/tiny")  # the fallback to the cache again, now seen against the list
    assert not is_complete(snapshot, hub.ALLOW_PATTERNS)

    shutil.copy(tiny_model_dir / "tokenizer.json", snapshot / "tokenizer.json")  # the Hub completes it
    assert resolve_model_path("some-org/tiny") == str(snapshot) and is_complete(snapshot, hub.ALLOW_PATTERNS)
