"""Training rows from a dataset on the Hugging Face Hub (``data.hub``), without the network: a dataset repo laid
out in a hub cache as the Hub lays it out (a card naming two subsets of Parquet files), read by
huggingface_hub's own cache lookup and ``datasets``, or downloaded once by a fake of the download; the same rows
as the local file; every failure one line."""

from __future__ import annotations

import shutil
from pathlib import Path

import datasets
import httpx
import pytest
import torch

import densepass as dp
from conftest import http_client_connection_errors, hub_cache_without_network, run_densepass
from densepass.data import hub, load_dataset
from densepass.data.pairs import load_pairs
from densepass.errors import ConfigError, DataError

CARD = """---
configs:
- config_name: triplet
  default: true
  data_files:
  - split: train
    path: triplet/train-*.parquet
  - split: dev
    path: triplet/dev-*.parquet
- config_name: pair
  data_files:
  - split: train
    path: pair/train-*.parquet
---
# rows
"""


def triplets(n: int, tag: str) -> list[dict]:
    return [
        {"anchor": f"question {tag} {i}", "positive": f"answer {tag} {i} words", "negative": f"other {tag} {i} text"}
        for i in range(n)
    ]


@pytest.fixture
def repo_files(tmp_path) -> Path:
    """The files of a dataset repo: a card with subsets triplet (train and dev) and pair (train), Parquet files."""
    root = tmp_path / "repo"
    (root / "triplet").mkdir(parents=True)
    (root / "pair").mkdir()
    (root / "README.md").write_text(CARD)
    datasets.Dataset.from_list(triplets(16, "t")).to_parquet(str(root / "triplet" / "train-00000.parquet"))
    datasets.Dataset.from_list(triplets(4, "d")).to_parquet(str(root / "triplet" / "dev-00000.parquet"))
    pairs = [{"anchor": r["anchor"], "positive": r["positive"]} for r in triplets(6, "p")]
    datasets.Dataset.from_list(pairs).to_parquet(str(root / "pair" / "train-00000.parquet"))
    return root


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty hub cache and datasets cache, the Hub online as far as densepass can tell, no connection possible."""
    root = hub_cache_without_network(tmp_path, monkeypatch)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # datasets reads the local snapshot only
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")
    return root


def lay_out(cache: Path, repo: str, source: Path, revision: str = "main", commit: str = "0123abcd", patterns=None):
    """``source``'s files (those matching ``patterns``) stored in ``cache`` as the Hub stores a dataset snapshot."""
    from fnmatch import fnmatch

    folder = cache / f"datasets--{repo.replace('/', '--')}"
    snapshot = folder / "snapshots" / commit
    for path in source.rglob("*"):
        relative = path.relative_to(source).as_posix()
        if path.is_file() and (patterns is None or any(fnmatch(relative, p) for p in patterns)):
            (snapshot / relative).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, snapshot / relative)
    snapshot.mkdir(parents=True, exist_ok=True)
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / revision).write_text(commit)
    return snapshot


@pytest.fixture
def fake_hub(cache, repo_files, monkeypatch):
    """A download that stores the repo's files the patterns ask for in the cache, recording each call."""
    calls = []

    def download(repo, **kwargs):
        calls.append((repo, kwargs["revision"], tuple(kwargs["allow_patterns"])))
        return str(lay_out(cache, repo, repo_files, kwargs["revision"] or "main", "c0", kwargs["allow_patterns"]))

    monkeypatch.setattr(hub, "_download", download)
    return calls


def test_a_cached_hub_dataset_gives_the_rows_of_its_subset_and_split(cache, repo_files, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lay_out(cache, "some-org/rows", repo_files)
    local = load_pairs(repo_files / "triplet" / "train-00000.parquet")
    rows = load_dataset("some-org/rows", format="pairs", subset="triplet")
    assert rows.digest == local.digest and rows.name == "some-org/rows (triplet)"
    assert load_dataset("hf://datasets/some-org/rows", format="pairs").digest == local.digest  # the default subset
    dev = load_dataset("hf://datasets/some-org/rows", format="pairs", subset="triplet", split="dev")
    assert len(dev.queries) == 4 and set(dev.qrels) == {"dev"}
    pair = load_dataset("some-org/rows", format="pairs", subset="pair")
    assert len(pair.queries) == 6 and not any(pair.negatives.values())


def test_a_download_fetches_the_card_then_the_subsets_files_once(fake_hub, cache):
    rows = load_dataset("hf://datasets/some-org/rows@v1", format="pairs", subset="pair")
    assert len(rows.queries) == 6
    assert fake_hub == [
        ("some-org/rows", "v1", ("README.md",)),
        ("some-org/rows", "v1", ("README.md", "pair/train-*.parquet")),
    ]
    snapshot = cache / "datasets--some-org--rows" / "snapshots" / "c0"
    assert not (snapshot / "triplet").exists()  # the other subset's files are not fetched
    again = load_dataset("hf://datasets/some-org/rows@v1", format="pairs", subset="pair")
    assert again.digest == rows.digest and len(fake_hub) == 2  # the cache, not a second download


def test_a_partial_snapshot_is_completed_by_the_next_online_run(cache, repo_files, tmp_path, monkeypatch):
    """A first download stopped after one of two shards: the next online run downloads again (the Hub fetches
    what is missing) and reads both shards, where it read one shard as the whole split."""
    (repo_files / "triplet" / "train-00001.parquet").write_bytes(
        (repo_files / "triplet" / "train-00000.parquet").read_bytes()
    )
    datasets.Dataset.from_list(triplets(5, "s")).to_parquet(str(repo_files / "triplet" / "train-00001.parquet"))
    lay_out(cache, "some-org/rows", repo_files, commit="c0", patterns=["README.md", "triplet/train-00000.parquet"])
    calls = []

    def download(repo, **kwargs):
        calls.append(kwargs["allow_patterns"])
        return str(lay_out(cache, repo, repo_files, "main", "c0", kwargs["allow_patterns"]))

    monkeypatch.setattr(hub, "_download", download)
    rows = load_dataset("some-org/rows", format="pairs", subset="triplet")
    assert len(rows.queries) == 16 + 5 and calls  # both shards
    again = load_dataset("some-org/rows", format="pairs", subset="triplet")
    assert again.digest == rows.digest and len(calls) == 2  # card and files downloaded in full once: the cache now


def test_a_partial_snapshot_is_refused_not_read_whole_where_the_hub_cannot_be_reached(cache, repo_files, monkeypatch):
    """One of two shards cached, the Hub out of reach: ``snapshot_download`` would hand back the cached part, so
    the download is checked against the repo's list, a one-line error instead of training on one shard."""
    import huggingface_hub

    datasets.Dataset.from_list(triplets(5, "s")).to_parquet(str(repo_files / "triplet" / "train-00001.parquet"))
    snapshot = lay_out(cache, "some-org/rows", repo_files, commit="c0", patterns=["README.md", "triplet/*-00000.*"])
    listed = sorted(p.relative_to(repo_files).as_posix() for p in repo_files.rglob("*") if p.is_file())
    monkeypatch.setattr(huggingface_hub, "list_repo_files", lambda repo, **kwargs: listed)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda repo, **kwargs: str(snapshot))
    with pytest.raises(DataError, match=r"could not be downloaded: .*\(missing: triplet/train-00001.parquet\)") as err:
        load_dataset("some-org/rows", format="pairs", subset="triplet")
    assert "\n" not in str(err.value)


def _http_error(kind, status):
    response = httpx.Response(status, request=httpx.Request("GET", "https://huggingface.co/api/datasets/x"))
    return kind("refused", response=response)


@pytest.mark.parametrize("error", http_client_connection_errors(), ids=lambda e: type(e).__module__.split(".")[0])
def test_a_hub_that_cannot_be_reached_is_one_line_naming_the_dataset(cache, monkeypatch, error):
    import huggingface_hub

    def unreachable(repo, **kwargs):
        raise error

    monkeypatch.setattr(huggingface_hub, "list_repo_files", unreachable)
    with pytest.raises(DataError) as caught:
        load_dataset("some-org/rows", format="pairs")
    assert str(caught.value) == (
        "dataset some-org/rows could not be downloaded: the Hugging Face Hub could not be reached "
        f"({type(error).__name__}: [Errno -2] Name or service not known)"
    )


@pytest.mark.parametrize(
    "error, message",
    [
        ("RepositoryNotFoundError", "dataset not found on the Hugging Face Hub: some-org/rows, nor a local file"),
        ("GatedRepoError", "dataset some-org/rows is gated on the Hugging Face Hub: accept its terms"),
        ("RevisionNotFoundError", "dataset some-org/rows has no revision v9"),
    ],
)
def test_hub_failures_are_one_line(cache, monkeypatch, error, message):
    import huggingface_hub.errors as errors

    def failing(repo, **kwargs):
        raise _http_error(getattr(errors, error), 404 if error != "GatedRepoError" else 403)

    monkeypatch.setattr(hub, "_download", failing)
    with pytest.raises(DataError, match=message) as caught:
        load_dataset("some-org/rows@v9" if error == "RevisionNotFoundError" else "some-org/rows", format="pairs")
    assert "\n" not in str(caught.value)


def test_offline_not_cached_and_what_the_dataset_lacks_are_one_line(cache, repo_files, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(hub, "_download", lambda *a, **k: pytest.fail("downloaded while offline"))
    with pytest.raises(
        DataError, match="dataset some-org/rows is not in the Hugging Face cache and the Hub is offline"
    ):
        load_dataset("some-org/rows", format="pairs")
    lay_out(cache, "some-org/rows", repo_files)
    for options, message in [
        ({"subset": "triplet", "split": "test"}, "has no split 'test'"),
        ({"subset": "quadruplet"}, "has no subset 'quadruplet'"),
    ]:
        with pytest.raises(DataError, match=message) as caught:
            load_dataset("some-org/rows", format="pairs", **options)
        assert "\n" not in str(caught.value)
    with pytest.raises(DataError, match="write a Hugging Face dataset as hf://datasets/org/name"):
        load_dataset("hf://models/some-org/rows", format="pairs")
    with pytest.raises(DataError, match="pins revision v1 and data.revision says v2"):
        load_dataset("some-org/rows@v1", format="pairs", revision="v2")
    with pytest.raises(DataError, match="training rows 'missing.jsonl' not found"):  # a file name stays a path
        load_dataset("missing.jsonl", format="pairs")


def test_dp_train_from_the_hub_gives_the_weights_of_the_local_file(
    cache, repo_files, tiny_model_dir, monkeypatch, tmp_path
):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lay_out(cache, "some-org/rows", repo_files)
    args = dp.TrainConfig(batch_size=8, max_steps=2, cpu_bf16=False, learning_rate=1e-3)
    weights = []
    for n, source in enumerate(["hf://datasets/some-org/rows", repo_files / "triplet" / "train-00000.parquet"]):
        model = dp.BiEncoder.from_pretrained(str(tiny_model_dir), dp.BiEncoderConfig(passage_max_length=32))
        options = {"subset": "triplet"} if n == 0 else {}
        dp.train(model, source, output_dir=tmp_path / f"out{n}", args=args, device="cpu", **options)
        weights.append(model.state_dict())
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    with pytest.raises(ConfigError, match="subset names a subset of a Hugging Face dataset"):
        dp.train(model, repo_files / "pair" / "train-00000.parquet", output_dir=tmp_path / "x", subset="pair")


def test_densepass_run_offline_with_an_uncached_hub_dataset_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # an empty cache
    command = ["run", "--set", "data.format=pairs", "--set", "data.name=some-org/not-cached", "--set",
               "data.eval_name=debian-packages", "--set", f"output_dir={tmp_path / 'out'}"]  # fmt: skip
    result = run_densepass(*command, cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "dataset some-org/not-cached is not in the Hugging Face cache" in lines[0]
    assert not (tmp_path / "out").exists()


def test_a_card_without_subsets_reads_the_splits_from_the_file_names(cache, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    files = tmp_path / "plain"
    (files / "data").mkdir(parents=True)
    (files / "README.md").write_text("# rows without a configs section\n")
    datasets.Dataset.from_list(triplets(5, "x")).to_json(str(files / "data" / "train.jsonl"))
    datasets.Dataset.from_list(triplets(3, "y")).to_json(str(files / "data" / "test.jsonl"))
    lay_out(cache, "some-org/plain", files, patterns=["README.md", "data/*"])
    rows = load_dataset("some-org/plain", format="pairs")
    assert len(rows.queries) == 5 and len(load_dataset("some-org/plain", format="pairs", split="test").queries) == 3
    with pytest.raises(DataError, match="has no subsets"):
        load_dataset("some-org/plain", format="pairs", subset="triplet")


def test_a_subset_or_revision_of_another_layout_is_one_line():
    from densepass.config import DataConfig
    from densepass.data import hub_options

    assert hub_options(DataConfig(format="pairs", subset="s", train_split="dev")) == {
        "subset": "s",
        "revision": None,
        "split": "dev",
    }
    assert hub_options(DataConfig()) == {}
    with pytest.raises(DataError, match="need data.format: pairs"):
        hub_options(DataConfig(revision="v1"))


def test_a_cards_top_level_file_is_not_another_subsets_file_of_the_same_name(cache, tmp_path, monkeypatch):
    """A card's ``train.jsonl`` names the file at the repo's root: ``nested/train.jsonl`` of another subset, in
    the same cached snapshot, is not read with it (a file's name alone matched)."""
    import json

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    repo = tmp_path / "repo"
    (repo / "nested").mkdir(parents=True)
    card = "---\nconfigs:\n- config_name: top\n  data_files: train.jsonl\n- config_name: nested\n  data_files: "
    (repo / "README.md").write_text(card + "nested/train.jsonl\n---\n")
    for path, rows in ((repo / "train.jsonl", triplets(3, "a")), (repo / "nested" / "train.jsonl", triplets(5, "b"))):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    lay_out(cache, "some-org/two", repo)
    assert len(load_dataset("some-org/two", format="pairs", subset="top").queries) == 3
    assert len(load_dataset("some-org/two", format="pairs", subset="nested").queries) == 5
