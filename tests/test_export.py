"""``densepass export``: a model card from the run, ONNX with pooling and normalisation in the graph (checked
against PyTorch with ONNX Runtime), the Hub upload through a monkeypatched API (never the network), and output
paths owned as everywhere else."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import http_client_connection_errors, small_run_overrides
from densepass.config import load_config
from densepass.errors import ConfigError, DensepassError
from densepass.models.biencoder import BiEncoder
from densepass.pipelines.experiment import run_experiment
from densepass.pipelines.export import export_model


@pytest.fixture(scope="module")
def trained_run(tiny_model_dir, tmp_path_factory) -> Path:
    from conftest import write_tiny_beir

    root = tmp_path_factory.mktemp("export")
    overrides = small_run_overrides(write_tiny_beir(root / "beir"), tiny_model_dir, root, "run")
    run_experiment(load_config(None, [*overrides, "train.max_steps=2", "train.batch_size=6"]))
    return root / "run"


def test_a_folder_export_has_the_model_and_a_card_of_the_run(trained_run, tmp_path):
    out = tmp_path / "published"
    export_model(trained_run / "model", "dir", str(out))
    card = (out / "README.md").read_text()
    assert "library_name: sentence-transformers" in card and "## Results" in card and "| fine-tuned |" in card
    assert "- data: a local dataset (split `train`)" in card and "Karpukhin" in card and "encode_query" in card
    # the run's model and data are folders of this machine: the card names neither (it may be published)
    assert str(trained_run.parent) not in card and "A bi-encoder retriever.\n" in card
    again = BiEncoder.from_pretrained(str(out))
    texts = ["audio editor"]
    np.testing.assert_array_equal(
        again.encode_queries(texts, show_progress=False, precision="fp32"),
        BiEncoder.from_pretrained(str(trained_run / "model")).encode_queries(
            texts, show_progress=False, precision="fp32"
        ),
    )


def test_onnx_holds_pooling_and_normalisation_and_matches_pytorch(trained_run, tmp_path):
    import onnxruntime
    from transformers import AutoTokenizer

    result = export_model(trained_run / "model", "onnx", str(tmp_path / "onnx"))
    assert result.min_cosine >= 0.9999 and result.max_abs_diff < 1e-4
    session = onnxruntime.InferenceSession(str(tmp_path / "onnx" / "model.onnx"), providers=["CPUExecutionProvider"])
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path / "onnx"))
    long = tokenizer(["word " * 600], truncation=True, return_tensors="np")  # truncated at the graph's limit
    assert tokenizer.model_max_length == 32 and long["input_ids"].shape[1] == 32
    session.run(None, {"input_ids": long["input_ids"], "attention_mask": long["attention_mask"]})
    texts = ["a network terminal", "kernel driver for the printer", "x"]
    tokens = tokenizer(texts, padding=True, truncation=True, max_length=32, return_tensors="np")
    ours = session.run(None, {"input_ids": tokens["input_ids"], "attention_mask": tokens["attention_mask"]})[0]
    model = BiEncoder.from_pretrained(str(trained_run / "model"))
    reference = model.encode_passages(texts, show_progress=False, precision="fp32")
    assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)  # normalised inside the graph
    assert (ours * reference).sum(1).min() >= 0.9999


def test_the_onnx_cards_usage_runs_and_gives_the_models_embeddings(trained_run, tmp_path):
    """The ONNX folder's card showed dp.load_model and SentenceTransformer, which load neither (no config.json, no
    modules.json): it shows onnxruntime, queries with their prompt and token limit; its code is run here."""
    export_model(trained_run / "model", "onnx", str(tmp_path / "onnx"))
    card = (tmp_path / "onnx" / "README.md").read_text()
    assert "library_name: onnx" in card and "SentenceTransformer" not in card and "dp.load_model" not in card
    code = card.split("```python\n", 1)[1].split("```", 1)[0].replace("PATH", str(tmp_path / "onnx"))
    namespace: dict = {}
    exec(code, namespace)  # noqa: S102 - the card's own example, on the folder it describes
    model = BiEncoder.from_pretrained(str(trained_run / "model"))
    queries = model.encode_queries(["a question"], show_progress=False, precision="fp32")
    passages = model.encode_passages(["a passage"], show_progress=False, precision="fp32")
    np.testing.assert_allclose(namespace["queries"], queries, atol=1e-4)
    np.testing.assert_allclose(namespace["passages"], passages, atol=1e-4)


def test_the_hub_upload_sends_the_exported_folder(trained_run, monkeypatch):
    from huggingface_hub import HfApi

    sent = {}

    def create_repo(self, repo_id, private=False, exist_ok=False):
        sent["repo"], sent["private"] = repo_id, private

    def upload_folder(self, repo_id, folder_path, commit_message=None):
        sent["files"] = sorted(str(p.relative_to(folder_path)) for p in Path(folder_path).rglob("*") if p.is_file())
        sent["card"] = (Path(folder_path) / "README.md").read_text()

    monkeypatch.setattr(HfApi, "create_repo", create_repo)
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    monkeypatch.setattr(HfApi, "repo_info", lambda self, repo_id: SimpleNamespace(private=sent["private"]))
    result = export_model(trained_run / "model", "hub", "some-org/tiny-retriever", private=True)
    assert result.target == "https://huggingface.co/some-org/tiny-retriever"
    assert sent["repo"] == "some-org/tiny-retriever" and sent["private"]
    assert "model.safetensors" in sent["files"] and "README.md" in sent["files"] and "modules.json" in sent["files"]
    assert not any(name.startswith(".densepass") for name in sent["files"])


def test_a_private_export_never_uploads_into_an_existing_public_repo(trained_run, monkeypatch):
    """``create_repo(private=True, exist_ok=True)`` leaves an existing repo as it is: the export was published."""
    from huggingface_hub import HfApi

    uploads = []
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, private=False, exist_ok=False: None)
    monkeypatch.setattr(HfApi, "repo_info", lambda self, repo_id: SimpleNamespace(private=False))
    monkeypatch.setattr(HfApi, "upload_folder", lambda self, **kwargs: uploads.append(kwargs))
    with pytest.raises(ConfigError, match=r"repo me/model exists and is public: --private would upload into it"):
        export_model(trained_run / "model", "hub", "me/model", private=True)
    assert uploads == []


@pytest.mark.parametrize("repo", ["bad repo name!", "a/b/c", "", "org/"])
def test_a_repo_id_the_hub_does_not_take_is_one_line_before_the_model_loads(trained_run, monkeypatch, repo):
    import densepass.pipelines.export as export

    monkeypatch.setattr(export, "load_model", lambda *a: pytest.fail("the model was loaded"))
    with pytest.raises(ConfigError, match=r"^--to hub takes a repo id, org/name: .* is not one"):
        export_model(trained_run / "model", "hub", repo)


@pytest.mark.parametrize("error", http_client_connection_errors(), ids=lambda e: type(e).__module__.split(".")[0])
def test_an_upload_to_a_hub_that_cannot_be_reached_is_one_line(trained_run, monkeypatch, error):
    from huggingface_hub import HfApi

    def unreachable(self, *args, **kwargs):
        raise error

    monkeypatch.setattr(HfApi, "create_repo", unreachable)
    with pytest.raises(ConfigError) as caught:
        export_model(trained_run / "model", "hub", "some-org/tiny-retriever")
    assert str(caught.value) == (
        "could not upload to the Hugging Face Hub repo some-org/tiny-retriever: [Errno -2] Name or service not known"
    )


def test_an_export_never_writes_over_a_users_folder_and_bad_input_is_one_line(trained_run, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(DensepassError, match="densepass did not write"):
        export_model(trained_run / "model", "dir", str(mine))
    assert (mine / "notes.txt").read_text() == "keep"
    with pytest.raises(ConfigError, match="not a saved model directory"):
        export_model(tmp_path / "missing", "dir", str(tmp_path / "out"))
    result = subprocess.run(
        [sys.executable, "-m", "densepass", "export", str(trained_run / "model"), "--to", "dir", str(mine)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1


def test_the_command_line_exports_and_says_where(trained_run, tmp_path):
    out = tmp_path / "cli-dir"
    result = subprocess.run(
        [sys.executable, "-m", "densepass", "export", str(trained_run / "model"), "--to", "dir", str(out)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == f"exported {trained_run / 'model'} to {out}"
    assert json.loads((out / "densepass.json").read_text())["pooling"] == "mean"


def test_the_cards_usage_says_how_sentence_transformers_loads_each_model(tiny_model_dir, tmp_path):
    """Two towers: sentence-transformers loads the query tower from ``query/``; one tower: its one token limit is
    the passages', said where queries are cut shorter; SPLADE and ColBERT: densepass's loader only."""
    from densepass.config import BiEncoderConfig
    from densepass.models.splade import SpladeEncoder
    from densepass.pipelines.export import model_card

    shared = model_card(tmp_path / "m", BiEncoder.from_pretrained(str(tiny_model_dir)))
    assert "encode_query" in shared and "cuts every text at 128 tokens: queries longer than 32" in shared
    assert 'dp.load_model("PATH_OR_REPO")' in shared
    towers = model_card(tmp_path / "m", BiEncoder.from_pretrained(str(tiny_model_dir), BiEncoderConfig(shared=False)))
    assert 'SentenceTransformer("PATH/query")' in towers and "cuts every text" not in towers
    splade = model_card(tmp_path / "m", SpladeEncoder.from_pretrained(str(tiny_model_dir)))
    assert 'dp.load_model("PATH_OR_REPO")' in splade and "SentenceTransformer(" not in splade


def test_a_card_names_hub_models_and_data_but_no_local_path_and_quotes_prompts_in_their_cells(tmp_path, monkeypatch):
    """A card published a local path as the base model (without a run, the exported folder itself) and a prompt
    with a newline or a ``|`` broke its table."""
    from densepass.config import BiEncoderConfig
    from densepass.pipelines.export import code_cell, model_card, public_name

    assert public_name("BAAI/bge-small-en-v1.5") == "BAAI/bge-small-en-v1.5" and public_name("debian-packages")
    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path)
    for local in (str(tmp_path), "/home/me/model", "~/models/m", "runs", None, 3):
        assert public_name(local) is None
    assert code_cell("Instruct: find it\nQuery: ") == '`"Instruct: find it\\nQuery: "`'
    assert code_cell("a|b `c`") == '``"a\\|b `c`"``'
    config = BiEncoderConfig(query_prompt="Instruct: find the package\nQuery: ", passage_prompt="a | b")
    model = BiEncoder.from_pretrained("all-MiniLM-L6-v2", config)
    card = model_card(tmp_path / "exported", model)
    assert "A bi-encoder retriever.\n" in card and str(tmp_path) not in card
    rows = [
        line for line in card.splitlines() if line.startswith("| query_prompt") or line.startswith("| passage_prompt")
    ]
    assert rows == ['| query_prompt | `"Instruct: find the package\\nQuery: "` |', '| passage_prompt | `"a \\| b"` |']
