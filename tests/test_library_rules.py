"""The rules of ``densepass index``, ``rerank``, ``mine``, ``ensemble``, ``analyze-attention``, ``validate-study`` and
``config`` live in the library: a Python caller of ``IndexSettings``, ``index_dataset``, ``rerank_run_file``,
``write_trec_run``, ``mine_training_negatives``, ``save_ensemble_report``, ``analyze_attention``, ``validate_study``
and ``export_config`` gets the command line's one-line refusals, before any work and with nothing written or moved.
(``SearchPipeline.load``'s: tests/test_search_api.py.)"""

from __future__ import annotations

import json

import pytest

from densepass.config import DEFAULT_MODEL
from densepass.errors import ConfigError, DensepassError
from densepass.evaluation.metrics import read_trec_run, write_trec_run
from densepass.pipelines.indexing import IndexSettings, index_dataset
from densepass.pipelines.search import rerank_run_file


def test_index_settings_refuse_a_model_for_bm25_and_default_it_for_the_others():
    with pytest.raises(ConfigError, match=r"^--kind bm25 indexes words, not a model's vectors: drop --model$"):
        IndexSettings("bm25", "some-model")
    assert IndexSettings("bm25").model is None
    assert IndexSettings("exact").model == DEFAULT_MODEL


@pytest.mark.parametrize("force", [False, True], ids=["plain", "force"])
def test_index_dataset_refuses_an_output_among_its_inputs_and_moves_nothing(tiny_beir, tiny_model_dir, force):
    model_files = sorted(p.name for p in tiny_model_dir.iterdir())
    data_files = sorted(p.name for p in tiny_beir.iterdir())
    settings = IndexSettings("exact", str(tiny_model_dir))
    for output in (tiny_model_dir, tiny_beir, tiny_beir / "idx", tiny_beir.parent):
        with pytest.raises(ConfigError, match="is, holds or lies inside .*, which this command reads$"):
            index_dataset(str(tiny_beir), None, "beir", output, settings, force=force)
    assert sorted(p.name for p in tiny_model_dir.iterdir()) == model_files
    assert sorted(p.name for p in tiny_beir.iterdir()) == data_files
    assert not [p for p in tiny_beir.parent.iterdir() if ".replaced-" in p.name]


def test_rerank_run_file_refuses_its_own_input_and_a_users_file_before_reading_anything(tiny_beir, tmp_path):
    run = tmp_path / "first.trec"
    run.write_text("q30 Q0 p30 1 1.0 densepass\n")
    mine = tmp_path / "notes.txt"
    mine.write_text("my notes\n")
    refused = [
        (run, ConfigError, "is the run being reranked; write the reranked run elsewhere$"),
        (mine, DensepassError, r"is not a TREC run \(tag densepass-rerank\) densepass wrote"),
        (tmp_path, ConfigError, "is a directory; give a run file path$"),
    ]
    for output, error, message in refused:
        with pytest.raises(error, match=message):  # "none" is no model: the output is refused before it is looked up
            rerank_run_file(str(tiny_beir), run, "none", output, device="cpu")
    assert run.read_text() == "q30 Q0 p30 1 1.0 densepass\n" and mine.read_text() == "my notes\n"


def test_a_run_of_another_tag_is_not_written_over(tmp_path):
    """A run another system wrote (an official BM25 run) is not replaced by a densepass run of another tag; a run of
    the same tag, densepass's own output of an earlier call, is."""
    official = tmp_path / "bm25.trec"
    official.write_text("q Q0 a 1 18.8 Anserini\n")
    with pytest.raises(DensepassError, match=r"is not a TREC run \(tag densepass\) densepass wrote"):
        write_trec_run({"q": {"b": 1.0}}, official)
    assert official.read_text() == "q Q0 a 1 18.8 Anserini\n"
    write_trec_run({"q": {"b": 1.0}}, official, tag="Anserini")  # (the same tag: replaced)
    assert read_trec_run(official) == {"q": {"b": 1.0}}


def test_write_trec_run_writes_over_a_run_only(tmp_path):
    path = tmp_path / "run.trec"
    write_trec_run({}, path)
    assert path.read_text() == ""  # a run without hits: an empty file, which the next write may replace
    write_trec_run({"q": {"a": 2.0, "b": 1.0}}, path, tag="t")
    assert path.read_text() == "q Q0 a 1 2.0 t\nq Q0 b 2 1.0 t\n"
    write_trec_run({"q": {"b": 3.0}}, path, tag="t")
    assert read_trec_run(path) == {"q": {"b": 3.0}}
    mine = tmp_path / "mine.txt"
    mine.write_text("a line of my own\n")
    with pytest.raises(DensepassError, match=r"is not a TREC run \(tag densepass\) densepass wrote"):
        write_trec_run({"q": {"a": 1.0}}, mine)
    assert mine.read_text() == "a line of my own\n"


def test_mine_training_negatives_checks_its_output_and_precision_before_any_work(tiny_beir, tmp_path):
    from densepass.config import load_config
    from densepass.pipelines.mine_command import mine_training_negatives

    config = load_config(None, [f"data.name={tiny_beir}", "negatives.source=bm25", "device=cpu"])
    out = tmp_path / "out"
    out.mkdir()
    mine = out / "notes.txt"
    mine.write_text("my notes\n")
    refused = [
        (out, None, ConfigError, "is a directory; give the path of the hard-negatives file to write$"),
        (mine, None, DensepassError, "is not a hard-negatives file densepass wrote"),
        (out / "n.jsonl", "bf16", ConfigError, "^--precision sets how a model encodes; the bm25 strategy mines"),
    ]
    for output, precision, error, message in refused:
        with pytest.raises(error, match=message):
            mine_training_negatives(config, output, precision)
    assert mine.read_text() == "my notes\n" and sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_analyze_attention_refuses_bad_outputs_and_labels_before_any_work(
    tiny_beir, tiny_model_dir, tmp_path, monkeypatch
):
    from densepass.analysis import attention

    monkeypatch.setattr(attention, "load_dataset", lambda *a, **k: pytest.fail("loaded the dataset before refusing"))
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.png").write_text("my drawing")
    (out / "theirs.json").write_text("my numbers")
    models = [str(tiny_model_dir)]
    refused = [
        ({"labels": ["a", "b"]}, out / "p.png", "^--labels gives 2 names for 1 models$"),
        ({}, out / "p.jpg", "is the plot's path: give it a .png name"),
        ({}, tiny_beir / "p.png", "which this command reads$"),
        ({}, out / "mine.png", "is not a attention plot densepass wrote"),
        ({}, out / "theirs.png", "theirs.json exists and is not a attention result densepass wrote"),
    ]
    for keywords, output, message in refused:
        with pytest.raises(DensepassError, match=message):
            attention.analyze_attention(models, output, str(tiny_beir), **keywords)
    assert sorted(p.name for p in out.iterdir()) == ["mine.png", "theirs.json"]
    assert (out / "mine.png").read_text() == "my drawing" and not (tiny_beir / "p.png").exists()


def test_validate_study_refuses_an_output_among_its_inputs_before_any_work(tiny_beir, tiny_model_dir, monkeypatch):
    from densepass.pipelines import study

    monkeypatch.setattr(study, "load_dataset", lambda *a, **k: pytest.fail("loaded the dataset before refusing"))
    model_files = sorted(p.name for p in tiny_model_dir.iterdir())
    for output in (tiny_model_dir, tiny_model_dir / "study", tiny_beir / "study"):
        with pytest.raises(ConfigError, match="is, holds or lies inside .*, which this command reads$"):
            study.validate_study(str(tiny_beir), [str(tiny_model_dir)], output)
    assert sorted(p.name for p in tiny_model_dir.iterdir()) == model_files and not (tiny_beir / "study").exists()


def test_an_ensemble_report_is_written_over_nothing_but_an_ensemble_report(tmp_path):
    from densepass.pipelines.ensemble import save_ensemble_report

    report = {"results": {"a": {"mrr@10": 0.5}}, "queries": 3}
    path = tmp_path / "report.json"
    save_ensemble_report(report, path)
    save_ensemble_report({**report, "queries": 4}, path)  # its own report: replaced
    assert json.loads(path.read_text())["queries"] == 4
    mine = tmp_path / "mine.json"
    mine.write_text('{"results": {}, "queries": 1, "my notes": "keep"}')
    with pytest.raises(DensepassError, match="is not a ensemble report densepass wrote"):
        save_ensemble_report(report, mine)
    assert "my notes" in mine.read_text()


def test_export_config_writes_over_nothing_but_a_config_it_wrote(tmp_path):
    from densepass.config import ExperimentConfig, export_config, load_config

    path = tmp_path / "config.yaml"
    export_config(ExperimentConfig(), path)
    export_config(load_config(None, ["train.batch_size=8"]), path)  # its own config: replaced
    assert load_config(path).train.batch_size == 8
    for text in ("# my notes\n" + path.read_text(), "train:\n  batch_size: 4\n"):  # comments; a partial config
        mine = tmp_path / "mine.yaml"
        mine.write_text(text)
        with pytest.raises(DensepassError, match="is not a config densepass wrote"):
            export_config(ExperimentConfig(), mine)
        assert mine.read_text() == text


def test_analyze_attention_refuses_a_model_with_non_finite_weights(tiny_model_dir, tiny_beir, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from densepass.analysis.attention import analyze_attention
    from densepass.errors import DensepassError

    model = tmp_path / "nan-model"
    shutil.copytree(tiny_model_dir, model)
    weights = load_file(str(model / "model.safetensors"))
    name = next(k for k in weights if "word_embeddings" in k)
    weights[name][0, 0] = float("nan")
    save_file(weights, str(model / "model.safetensors"))
    with pytest.raises(DensepassError, match="nan"):
        analyze_attention([str(model)], tmp_path / "plot.png", str(tiny_beir), samples=2)
    assert not (tmp_path / "plot.png").exists()
