"""The BM25 baseline of `densepass run` names passages by their ids (it once named them by row number and scored 0)."""

from __future__ import annotations

from densepass.config import load_config
from densepass.evaluation.metrics import read_trec_run
from densepass.pipelines.experiment import run_experiment


def test_the_bm25_baseline_run_names_corpus_passages(tiny_beir, tiny_model_dir, tmp_path):
    config = load_config(
        None,
        [
            f"data.name={tiny_beir}",
            f"model.name_or_path={tiny_model_dir}",
            f"output_dir={tmp_path}",
            "name=b",
            "train.enabled=false",
            "eval.baselines=[bm25]",
            "eval.metrics=[mrr@10]",
            "eval.depth=10",
        ],
    )
    results = run_experiment(config)
    run = read_trec_run(tmp_path / "b" / "runs" / "bm25.trec")
    assert all(pid.startswith("p") for hits in run.values() for pid in hits)
    assert results["BM25"]["mrr@10"] > 0
