"""densepass run with a cross-encoder: it trains the reranker on the run's pool, adds reranked rows,
distils it into the bi-encoder (with ABS batches), resumes, and refuses bad input with one line before
writing anything."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from densepass.cli import main
from densepass.errors import ConfigError, DataError
from densepass.pipelines.experiment import run_experiment
from test_experiment import tiny_config

RERANKER = [
    "negatives.per_query=2",
    "reranker.enabled=true",
    "reranker.max_length=48",
    "reranker.depth=10",
    "reranker.train.batch_size=5",
    "reranker.train.negatives_per_query=3",
    "reranker.first_stages=[bm25, fine-tuned]",
]


def config_with(tiny_beir, tiny_model_dir, tmp_path, *extra):
    return tiny_config(
        tiny_beir, tiny_model_dir, tmp_path, f"reranker.name_or_path={tiny_model_dir}", *RERANKER, *extra
    )


def test_a_run_trains_the_reranker_distils_it_with_abs_batches_and_resumes(tiny_beir, tiny_model_dir, tmp_path):
    from sentence_transformers import CrossEncoder as STCrossEncoder

    from densepass.models.cross_encoder import CrossEncoder

    config = config_with(
        tiny_beir,
        tiny_model_dir,
        tmp_path,
        "reranker.distill.loss=kl",
        "reranker.distill.contrastive=true",
        "reranker.distill.temperature=2.0",
        "schedule.method=abs-greedy",
        "schedule.similarity=bm25",
    )
    results = run_experiment(config)
    assert set(results) == {
        "BM25",
        "zero-shot",
        "fine-tuned",
        "BM25 → cross-encoder@10",
        "fine-tuned → cross-encoder@10",
    }
    run_dir = tmp_path / "t"
    for name in (
        "reranker/model/config.json",
        "reranker/train_log.jsonl",
        "teacher_scores.jsonl",
        "runs/bm25-rerank10.trec",
    ):
        assert (run_dir / name).exists(), name
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["timings"]["rerank_bm25_ms_per_query"] > 0
    assert "listwise KL (T=2) + contrastive" in (run_dir / "report.md").read_text()
    pairs = [("audio editor", "pkg3 audio video"), ("kernel", "a font viewer")]
    ours = CrossEncoder.from_pretrained(str(run_dir / "reranker" / "model"), precision="fp32").score_pairs(*zip(*pairs))
    np.testing.assert_allclose(STCrossEncoder(str(run_dir / "reranker" / "model")).predict(pairs), ours, rtol=1e-5)
    assert f"Cross-encoder ({tiny_model_dir} + a new one-logit head)" in (run_dir / "report.md").read_text()
    again = run_experiment(config)  # resumes from the final checkpoints: the same numbers
    for row in results:
        assert again[row] == pytest.approx(results[row])
    assert "s of training in earlier pieces; saved in reranker/model." in (run_dir / "report.md").read_text()
    trained = run_dir / "reranker" / "model"  # a second run continues that cross-encoder, head and all
    more = tiny_config(
        tiny_beir, tiny_model_dir, tmp_path / "more", f"reranker.name_or_path={trained}", *RERANKER[:-1],
        "reranker.first_stages=[bm25]", "train.enabled=false",
    )  # fmt: skip
    run_experiment(more)
    assert (
        f"Cross-encoder ({trained} + its own trained head, continued)"
        in (tmp_path / "more" / "t" / "report.md").read_text()
    )


def test_a_teacher_file_of_another_pool_is_refused_before_anything_is_written(tiny_beir, tiny_model_dir, tmp_path):
    first = config_with(tiny_beir, tiny_model_dir, tmp_path, "reranker.distill.loss=margin-mse", "train.epochs=1")
    run_experiment(first)
    scores = tmp_path / "scores.jsonl"
    shutil.copy(tmp_path / "t" / "teacher_scores.jsonl", scores)
    other = config_with(
        tiny_beir,
        tiny_model_dir,
        tmp_path,
        "name=other",
        "reranker.distill.loss=margin-mse",
        "negatives.pool_depth=7",
        f"reranker.distill.teacher={tmp_path / 't' / 'reranker' / 'model'}",
        f"reranker.distill.scores_file={scores}",
    )
    with pytest.raises(DataError, match="computed for another hard-negative pool"):
        run_experiment(other)
    # the run directory's marker and lock, and the pool it mined (kept for the run that follows a fix: it reads it)
    assert sorted(p.name for p in (tmp_path / "other").iterdir()) == [".densepass-run", ".lock", "negatives"]
    kept = sorted(str(p.relative_to(tmp_path / "other")) for p in (tmp_path / "other" / "negatives").rglob("*.json*"))
    assert [Path(p).parts[:2] for p in kept] == [("negatives", "negative-pools")] * 2
    assert sorted(Path(p).name for p in kept) == ["mining.json", "pool.jsonl"]


def test_a_reranker_without_a_usable_head_is_refused_before_anything_is_written(tiny_beir, tiny_model_dir, tmp_path):
    config = config_with(tiny_beir, tiny_model_dir, tmp_path, "reranker.train.enabled=false")
    with pytest.raises(ConfigError, match="no trained relevance head"):
        run_experiment(config)
    assert not (tmp_path / "t").exists()  # refused before the run directory was made


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["reranker.depth=30"], "reranker.depth 30 is larger than the 20 candidates per query of eval.depth"),
        (["eval.baselines=[zero-shot]"], "reranker.first_stages names 'bm25', which this run does not evaluate"),
        (["reranker.distill.loss=kl", "negatives.per_query=0"], "scores each query's hard negatives"),
        (
            ["reranker.distill.loss=kl", "reranker.distill.source=rows", "negatives.refresh_every=2"],
            "scores the rows' own negatives: it cannot follow negatives.refresh_every",
        ),
        (["reranker.enabled=false", "reranker.distill.loss=kl"], "reranker.distill needs a teacher"),
        (["reranker.distill.loss=kl", "loss.memory=pre-batch"], "adds to the plain contrastive loss"),
        (["reranker.train.loss=lce"], "'lce' is not one of 'listwise', 'pointwise'"),
        (["reranker.max_length=256"], "reranker.max_length 256 exceeds .*'s 128 positions"),
    ],
)
def test_inconsistent_reranker_settings_are_one_line_errors(tiny_beir, tiny_model_dir, tmp_path, extra, message):
    with pytest.raises(ConfigError, match=message):
        run_experiment(config_with(tiny_beir, tiny_model_dir, tmp_path, *extra))
    assert not (tmp_path / "t").exists()


def test_search_with_a_rerank_depth_beyond_the_index_is_a_one_line_error(tiny_beir, tiny_model_dir, tmp_path, capsys):
    from densepass.models.cross_encoder import CrossEncoder

    CrossEncoder.new(str(tiny_model_dir), max_length=32).save(tmp_path / "ce")
    assert main(["index", str(tiny_beir), "--kind", "bm25", "--output", str(tmp_path / "idx")]) == 0
    capsys.readouterr()
    args = ["search", str(tmp_path / "idx"), "audio", "--rerank", str(tmp_path / "ce")]
    assert main([*args, "--rerank-depth", "41"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1] == "densepass: error: rerank depth 41 is larger than the index's 40 passages"
    assert "Traceback" not in err
    assert main([*args, "--rerank-depth", "5", "--k", "8"]) == 0
    assert "'audio': 8 hits" in capsys.readouterr().out
    assert main([*args, "--k", "50"]) == 0  # the default depth: 100, or every passage of a smaller index
    assert "'audio': 16 hits" in capsys.readouterr().out  # BM25 matches 16 of the 40 passages


@pytest.mark.filterwarnings("ignore:.*have tied scores")  # BM25 ties on the tiny corpus; ties keep the rank order
def test_search_with_a_fused_rerank_writes_the_run_that_rerank_fuse_weight_writes_from_its_first_stage(
    tiny_beir, tiny_model_dir, tmp_path, capsys
):
    """One command for the pipeline the README gives in two: ``search --rerank M --rerank-depth d
    --rerank-fuse-weight w`` ranks as ``search`` then ``rerank --depth d --fuse-weight w`` of its run."""
    from densepass.evaluation.metrics import read_trec_run
    from densepass.models.cross_encoder import CrossEncoder

    ce = CrossEncoder.new(str(tiny_model_dir), seed=3, max_length=32, device=torch.device("cpu"), precision="fp32")
    with torch.no_grad():  # scores spread wide enough that no two tie in a TREC file's 6 decimals
        ce.model.classifier.weight.mul_(1e4)
    ce.save(tmp_path / "ce")
    assert main(["index", str(tiny_beir), "--kind", "bm25", "--output", str(tmp_path / "idx")]) == 0
    search = ["search", str(tmp_path / "idx"), "--queries", str(tiny_beir / "queries.jsonl"), "--k", "10"]
    assert main([*search, "--output", str(tmp_path / "first.trec")]) == 0
    second = ["--rerank", str(tmp_path / "ce"), "--rerank-depth", "6", "--rerank-precision", "fp32"]
    assert main([*search, *second, "--rerank-fuse-weight", "0.4", "--output", str(tmp_path / "one.trec")]) == 0
    rerank = ["rerank", str(tiny_beir), str(tmp_path / "first.trec"), "--model", str(tmp_path / "ce"), "--depth", "6"]
    assert main([*rerank, "--precision", "fp32", "--fuse-weight", "0.4", "--output", str(tmp_path / "two.trec")]) == 0
    capsys.readouterr()
    one, two = read_trec_run(tmp_path / "one.trec"), read_trec_run(tmp_path / "two.trec")
    assert one.keys() == two.keys() and len(one) > 3
    alone = read_trec_run(tmp_path / "first.trec")
    for q in one:
        assert sorted(one[q], key=lambda p: -one[q][p]) == sorted(two[q], key=lambda p: -two[q][p])
        assert one[q] == pytest.approx(two[q], abs=1e-5)
    assert any(  # and the fusion changed something: neither the first stage's order nor the reranker's alone
        sorted(one[q], key=lambda p: -one[q][p]) != sorted(alone[q], key=lambda p: -alone[q][p]) for q in one
    )
    assert main([*search, "--rerank-fuse-weight", "0.4", "--output", str(tmp_path / "x.trec")]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "densepass: error: --rerank-fuse-weight applies to the second stage of --rerank, which is not given"
    )


@pytest.mark.parametrize("kind", ["splade", "colbert"])
def test_splade_and_colbert_runs_distil_the_reranker_and_resume(tiny_beir, tiny_model_dir, tmp_path, kind):
    config = config_with(
        tiny_beir,
        tiny_model_dir,
        tmp_path,
        f"model.kind={kind}",
        "model.temperature=1.0",
        "model.colbert.centroids=8",
        "reranker.distill.loss=margin-mse",
        "reranker.distill.contrastive=true",
        "reranker.first_stages=[bm25]",
        "eval.baselines=[bm25]",
    )
    results = run_experiment(config)
    report = (tmp_path / "t" / "report.md").read_text()
    assert "distillation: 1 x Margin-MSE + contrastive" in report
    assert ("+ FLOPS" in report) == (kind == "splade")
    assert (tmp_path / "t" / "teacher_scores.jsonl").exists()
    again = run_experiment(config)  # resumes from the final checkpoint: the same numbers
    assert again["fine-tuned"] == pytest.approx(results["fine-tuned"])


def test_a_distilled_run_that_refreshes_its_pool_has_the_teacher_score_every_new_candidate(
    tiny_beir, tiny_model_dir, tmp_path, monkeypatch
):
    """Re-mining with the model being trained brings candidates the teacher has not scored: each refresh scores
    them (refresh-teacher-step-N.jsonl) before any batch draws them, so no batch carries an unscored pair; a run
    interrupted after the first refresh reads its scores again and ends with the uninterrupted run's model."""
    from densepass.training.batches import TrainingData

    collate, drawn = TrainingData.collate, []

    def checked(self, *args, **kwargs):
        batch = collate(self, *args, **kwargs)
        scores = batch.extras.get("teacher_scores")  # the bi-encoder's batches (the cross-encoder trains on others)
        assert scores is None or not scores.isnan().any(), "a batch drew a pair the teacher never scored"
        drawn.append(scores is not None)
        return batch

    monkeypatch.setattr(TrainingData, "collate", checked)
    settings = [
        "reranker.distill.loss=kl",
        "reranker.distill.contrastive=true",
        "reranker.first_stages=[bm25]",
        "negatives.source=bm25",
        "negatives.refresh_every=2",
        "train.checkpoint_every=2",
        "train.keep_checkpoints=10",
    ]
    first = run_experiment(config_with(tiny_beir, tiny_model_dir, tmp_path / "a", *settings))["fine-tuned"]
    assert sum(drawn) >= 6  # every step of the bi-encoder was checked
    work = tmp_path / "a" / "t" / "negatives"
    log = [json.loads(line) for line in (work / "refresh_log.jsonl").read_text().splitlines()]
    # the first refresh mines with the model where the pool came from BM25: new candidates, scored then; the second
    # mines with the same model two steps on, and may find none the teacher has not scored (tiny data)
    assert [r["step"] for r in log] == [2, 4] and log[0]["teacher_scored"] > 0
    files = sorted(p.name for p in work.glob("refresh-teacher-step-*.jsonl"))
    assert files == ["refresh-teacher-step-2.jsonl", "refresh-teacher-step-4.jsonl"]

    # interrupted after step 2: the refresh of step 4 (pool and scores) is made again by the resumed run
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    run = tmp_path / "b" / "t"
    shutil.rmtree(run / "model")
    for step in (4, 6):
        shutil.rmtree(run / "checkpoints" / f"step-{step}", ignore_errors=True)
    (run / "negatives" / "refresh-teacher-step-4.jsonl").unlink()
    users = [run / "negatives" / name for name in ("refresh-step-9-old.jsonl", "refresh-teacher-step-9.jsonl.bak")]
    for path in users:  # a user's copies, named like the refresh's files: neither read nor removed
        path.write_text("mine\n")
    resumed = run_experiment(config_with(tiny_beir, tiny_model_dir, tmp_path / "b", *settings))["fine-tuned"]
    assert resumed == pytest.approx(first)
    again = (run / "negatives" / "refresh-teacher-step-4.jsonl").read_text()
    assert again == (work / "refresh-teacher-step-4.jsonl").read_text()
    assert all(path.read_text() == "mine\n" for path in users)

    # a refresh's pool kept without its teacher's scores: refused, not trained on with unscored pairs
    shutil.rmtree(run / "model")
    for step in (4, 6):
        shutil.rmtree(run / "checkpoints" / f"step-{step}", ignore_errors=True)
    (run / "negatives" / "refresh-teacher-step-2.jsonl").unlink()
    with pytest.raises(DataError, match="lack the teacher's scores"):
        run_experiment(config_with(tiny_beir, tiny_model_dir, tmp_path / "b", *settings))


def test_a_teacher_score_that_is_not_finite_stops_the_scoring(tiny_beir, tiny_model_dir, tmp_path, monkeypatch):
    """A diverged teacher's NaN would be a file every later read refuses: it is refused as it is computed."""
    from densepass.data import load_dataset
    from densepass.models.cross_encoder import CrossEncoder
    from densepass.training.teacher_scores import compute_teacher_scores

    teacher = CrossEncoder.new(str(tiny_model_dir), max_length=32)
    monkeypatch.setattr(teacher, "score_pairs", lambda q, p, precision=None: np.full(len(q), np.nan, np.float32))
    dataset = load_dataset(str(tiny_beir))
    qid = sorted(dataset.queries)[0]
    with pytest.raises(DataError, match="not a finite number"):
        compute_teacher_scores(teacher, dataset, {qid: dataset.corpus.ids[:2]}, tmp_path / "scores.jsonl")


def test_students_of_one_fixed_teacher_with_a_cache_dir_have_it_score_each_pair_once(
    tiny_beir, tiny_model_dir, tmp_path, monkeypatch
):
    """Two distilled runs of one saved teacher over the same pool (KL, then Margin-MSE) with one ``cache_dir``: the
    second run's targets are read from the cache (``models.score_cache``), not scored again, and its scores file is
    the first run's."""
    import torch

    from densepass.models.cross_encoder import CrossEncoder

    teacher = tmp_path / "teacher"
    CrossEncoder.new(str(tiny_model_dir), seed=4, max_length=48, device=torch.device("cpu")).save(teacher)
    scored = []
    score_pairs = CrossEncoder.score_pairs
    monkeypatch.setattr(
        CrossEncoder,
        "score_pairs",
        lambda self, q, p, precision=None: scored.append(len(q)) or score_pairs(self, q, p, precision),
    )
    fixed = [f"reranker.name_or_path={teacher}", "reranker.train.enabled=false", "reranker.first_stages=[]"]
    shared = [*fixed, f"cache_dir={tmp_path / 'cache'}", "train.epochs=1"]
    run_experiment(tiny_config(tiny_beir, tiny_model_dir, tmp_path, *RERANKER, *shared, "reranker.distill.loss=kl"))
    assert sum(scored) > 0
    scored.clear()
    other = [*shared, "name=margin", "reranker.distill.loss=margin-mse"]
    run_experiment(tiny_config(tiny_beir, tiny_model_dir, tmp_path, *RERANKER, *other))
    assert scored == []
    assert (tmp_path / "margin" / "teacher_scores.jsonl").read_text() == (
        tmp_path / "t" / "teacher_scores.jsonl"
    ).read_text()
