"""End to end: a config runs baselines, training, evaluation and writes the run directory."""

from __future__ import annotations

import json
import re

import pytest

from densepass.config import load_config
from densepass.errors import ConfigError
from densepass.pipelines.experiment import run_experiment


def tiny_config(tiny_beir, tiny_model_dir, tmp_path, *extra):
    overrides = [
        f"data.name={tiny_beir}",
        f"model.name_or_path={tiny_model_dir}",
        f"output_dir={tmp_path}",
        "name=t",
        "train.batch_size=8",
        "train.epochs=2",
        "train.checkpoint_every=3",
        "negatives.pool_depth=5",
        "eval.metrics=[mrr@10, ndcg@10, recall@20]",
        "eval.depth=20",
        "model.passage_max_length=32",
        *extra,
    ]
    return load_config(None, overrides)


def test_run_directory_contents_and_resume(tiny_beir, tiny_model_dir, tmp_path):
    config = tiny_config(tiny_beir, tiny_model_dir, tmp_path, "eval.each_epoch=true")
    results = run_experiment(config)
    assert set(results) == {"BM25", "zero-shot", "fine-tuned"}
    run_dir = tmp_path / "t"
    for name in (
        "config.yaml",
        "metrics.json",
        "report.md",
        "train_log.jsonl",
        "eval_log.jsonl",
        "loss.png",
        "epochs.png",
        "runs/bm25.trec",
        "runs/fine-tuned.trec",
        "model/densepass.json",
    ):
        assert (run_dir / name).exists(), name
    stored = json.loads((run_dir / "metrics.json").read_text())
    assert stored["results"] == results
    assert len((run_dir / "eval_log.jsonl").read_text().splitlines()) == 2
    assert "| fine-tuned |" in (run_dir / "report.md").read_text()
    # Re-running resumes from the final checkpoint: no more training, the same numbers, and a report that still
    # names the run's last loss and its whole training time (not NaN and the few seconds of the resume).
    report = (run_dir / "report.md").read_text()
    again = run_experiment(config)
    assert again["fine-tuned"] == pytest.approx(results["fine-tuned"])
    resumed = (run_dir / "report.md").read_text()
    last_loss = re.compile(r"final loss (\S+);")
    assert last_loss.search(resumed)[1] == last_loss.search(report)[1] != "nan"
    assert "; resumed: " in resumed and "resumed: " not in report
    last = max((run_dir / "checkpoints").glob("step-*/state.json"), key=lambda p: int(p.parent.name[5:]))
    earlier = json.loads(last.read_text())["extra"]["totals"]["seconds"]  # the first run's, to its last checkpoint
    assert json.loads((run_dir / "metrics.json").read_text())["timings"]["train_s"] >= earlier > 0


def test_a_run_directory_holding_another_run_is_refused_before_any_work(tiny_beir, tiny_model_dir, tmp_path):
    """Two evaluation-only runs with the same name and output_dir but other data used to share one run directory,
    the second silently replacing the first's metrics."""
    eval_only = ("train.enabled=false", "eval.baselines=[zero-shot]")
    first = tiny_config(tiny_beir, tiny_model_dir, tmp_path, *eval_only)
    results = run_experiment(first)
    assert run_experiment(first) == results  # the same run again
    assert run_experiment(tiny_config(tiny_beir, tiny_model_dir, tmp_path, *eval_only, "eval.batch_size=4")) == results
    metrics = (tmp_path / "t" / "metrics.json").read_text()
    other_data = tiny_config(tiny_beir, tiny_model_dir, tmp_path, *eval_only, "data.max_eval_queries=2")
    with pytest.raises(ConfigError, match=r"holds another run \(data\.max_eval_queries differ .*--restart"):
        run_experiment(other_data)
    with pytest.raises(ConfigError, match=r"holds another run \(train\."):
        run_experiment(tiny_config(tiny_beir, tiny_model_dir, tmp_path, "eval.baselines=[zero-shot]"))
    assert (tmp_path / "t" / "metrics.json").read_text() == metrics
    assert run_experiment(other_data, restart=True) != results  # --restart replaces it
    assert run_experiment(other_data) != results


def test_rerank_mode_and_answer_accuracy(tiny_beir, tiny_model_dir, tmp_path):
    lines = (tiny_beir / "queries.jsonl").read_text().splitlines()
    corpus = [json.loads(x) for x in (tiny_beir / "corpus.jsonl").read_text().splitlines()]
    with_answers = []
    for line in lines:
        record = json.loads(line)
        i = int(record["_id"][1:])
        if i < len(corpus):
            record["metadata"] = {"answers": [corpus[i]["text"].split()[0]]}
        with_answers.append(json.dumps(record))
    (tiny_beir / "queries.jsonl").write_text("\n".join(with_answers) + "\n")
    config = tiny_config(
        tiny_beir, tiny_model_dir, tmp_path, "train.enabled=false", "eval.mode=rerank", "eval.rerank_candidates=5"
    )
    results = run_experiment(config)
    assert "accuracy@5" in results["zero-shot"] and 0 <= results["zero-shot"]["accuracy@1"] <= 1
    trec = (tmp_path / "t" / "runs" / "zero-shot.trec").read_text().splitlines()
    per_query = {}
    for line in trec:
        per_query.setdefault(line.split()[0], []).append(line)
    assert all(len(v) == 5 for v in per_query.values())
    assert results["zero-shot"]["recall@20"] == 1.0  # every positive is among the candidates


def test_bad_baseline_name(tiny_beir, tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="eval.baselines.0.: 'bm26' is not one of 'bm25', 'zero-shot'"):
        run_experiment(tiny_config(tiny_beir, tiny_model_dir, tmp_path, "eval.baselines=[bm26]"))


def test_abs_run_logs_the_schedule_of_every_epoch(tiny_beir, tiny_model_dir, tmp_path):
    """The last epoch's scheduling statistics are written too (the trainer lets the planner finish)."""
    config = tiny_config(
        tiny_beir,
        tiny_model_dir,
        tmp_path,
        "schedule.method=abs-greedy",
        "schedule.similarity=bm25-then-encoder",
        "negatives.source=none",
        "negatives.per_query=0",
        "eval.baselines=[]",
    )
    run_experiment(config)
    log = [json.loads(line) for line in (tmp_path / "t" / "schedule_log.jsonl").read_text().splitlines()]
    assert [(r["epoch"], r["similarity"]) for r in log] == [(0, "bm25"), (1, "encoder")]
    assert all(r["mean_hardness"] >= r["random_mean_hardness"] for r in log)


def test_the_bm25_row_of_a_run_names_the_datasets_passage_ids(tiny_beir, tiny_model_dir, tmp_path):
    run_experiment(tiny_config(tiny_beir, tiny_model_dir, tmp_path, "train.enabled=false", "eval.baselines=[bm25]"))
    lines = (tmp_path / "t" / "runs" / "bm25.trec").read_text().split("\n")
    assert lines[0].split()[2].startswith("p")  # a corpus id, not the index's row number


@pytest.mark.parametrize(
    "extra, where",
    [
        (["data.train_split=dev"], "data.train_split"),
        (["data.mix=[{name: NAME, format: beir, split: dev, fraction: 0.5}]"], r"data.mix\[0\]"),
        (["data.mix=[{name: PATH, format: beir, split: dev, fraction: 0.5}]"], r"data.mix\[0\]"),  # same folder
        (["data.train_split=dev", "train.enabled=false", "negatives.source=none"], None),  # nothing trained
        (["data.eval_split=train", "data.train_split=dev"], None),  # two splits
    ],
)
def test_a_run_that_would_train_on_the_queries_it_evaluates_is_refused_before_any_work(
    tiny_beir, tiny_model_dir, tmp_path, extra, where
):
    extra = [e.replace("NAME", tiny_beir.name).replace("PATH", str(tiny_beir)) for e in extra]
    config = tiny_config(tiny_beir, tiny_model_dir, tmp_path, f"data.data_dir={tiny_beir.parent}", *extra)
    config.data.name = tiny_beir.name
    if where is None:
        from densepass.pipelines.experiment import check

        check(config)  # the checks before any work pass
        return
    with pytest.raises(ConfigError, match=rf"^{where} trains on the 'dev' queries of .*, the split evaluated"):
        run_experiment(config)
    assert not (tmp_path / "t").exists()  # the run's folder (name=t): nothing written


def test_metrics_cut_deeper_than_the_evaluation_retrieves_are_warned_about(tiny_beir, tiny_model_dir, tmp_path):
    """A recall@1000 of a top 10 was reported as recall@1000 without a word."""
    import warnings

    from densepass.pipelines.experiment import check

    config = tiny_config(tiny_beir, tiny_model_dir, tmp_path, "eval.depth=10", "eval.metrics=[mrr@10, recall@1000]")
    with pytest.warns(UserWarning, match=r"^eval.metrics cut at 1000 and eval.depth retrieves 10 passages a query"):
        check(config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check(tiny_config(tiny_beir, tiny_model_dir, tmp_path, "eval.depth=10", "eval.metrics=[mrr@10, map]"))


def test_eval_hard_k_builds_no_bm25_index_without_the_subcorpus(tiny_beir, tiny_model_dir, tmp_path):
    """`--set data.eval_subcorpus=false` on a config with eval_hard_k (configs/main.yaml) searches the full corpus,
    yet a BM25 index of the whole training corpus was still built for the unused subcorpus."""
    from densepass.pipelines.experiment import check, prepare

    config = tiny_config(tiny_beir, tiny_model_dir, tmp_path, "data.eval_hard_k=3", "negatives.source=context")
    exp = prepare(config, check(config), main=True)
    assert exp.full_bm25 is None and len(exp.evalset.corpus) == 40
    config = tiny_config(tiny_beir, tiny_model_dir, tmp_path, "data.eval_hard_k=3", "data.eval_subcorpus=true")
    assert prepare(config, check(config), main=True).full_bm25 is not None
