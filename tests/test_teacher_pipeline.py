"""experiments/teacher_pipeline.py on tiny data: dense + BM25 fused, a cross-encoder over the fusion's top, each row
tested; its numbers are those of the library's fusion and of ``densepass rerank``'s run."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import script_here

SCRIPT = Path(__file__).parent.parent / "experiments" / "teacher_pipeline.py"


def pipeline(*args: str) -> subprocess.CompletedProcess:
    """``python experiments/teacher_pipeline.py ARGS``, run in this process (``conftest.script_here``)."""
    return script_here(SCRIPT, *args)


def write_run(path: Path, queries, score) -> None:
    path.write_text("".join(f"{q} Q0 p{i} {i + 1} {score(q, i)} x\n" for q in queries for i in range(12)))


def test_the_pipeline_fuses_reranks_and_tests_each_row(tiny_beir, tiny_model_dir, tmp_path):
    from densepass.config import load_config
    from densepass.data import load_dataset
    from densepass.evaluation.fusion import linear_fusion
    from densepass.evaluation.metrics import evaluate_run, read_trec_run
    from densepass.models.cross_encoder import CrossEncoder
    from densepass.pipelines.evalset import eval_qrels

    ce = CrossEncoder.new(str(tiny_model_dir), seed=5, max_length=48, device=torch.device("cpu"), precision="fp32")
    with torch.no_grad():  # scores spread wide enough that no two tie in a TREC file's 6 decimals
        ce.model.classifier.weight.mul_(1e4)
    ce.save(tmp_path / "ce")
    config = tmp_path / "config.yaml"
    config.write_text(f"name: t\ndata:\n  name: {tiny_beir}\n  max_eval_queries: null\n")
    qrels, _ = eval_qrels(load_dataset(str(tiny_beir)), load_config(config).data)
    queries = sorted(qrels)
    write_run(tmp_path / "dense.trec", queries, lambda q, i: round(1 - i / 20 + (hash(q) % 7) / 100, 4))
    write_run(tmp_path / "bm25.trec", queries, lambda q, i: 30 - ((i * 5) % 12))
    out = tmp_path / "out"
    args = ["--config", str(config), "--dense", str(tmp_path / "dense.trec")]
    args += ["--bm25", str(tmp_path / "bm25.trec"), "--cross-encoder", str(tmp_path / "ce"), "--dense-weight", "0.6"]
    done = pipeline(*args, "--depth", "4", "--out", str(out), "--device", "cpu")
    assert done.returncode == 0, done.stderr

    report = json.loads((out / "report.json").read_text())
    names = list(report)
    assert names[:2] == ["dense", "dense + BM25, linear (dense weight 0.60)"] and len(names) == 4
    dense, bm25 = read_trec_run(tmp_path / "dense.trec"), read_trec_run(tmp_path / "bm25.trec")
    hybrid = linear_fusion([dense, bm25], [0.6, 0.4])
    metrics = ["mrr@10", "ndcg@10", "recall@100"]
    assert report[names[1]]["metrics"] == pytest.approx(evaluate_run(qrels, hybrid, metrics))
    reranked = read_trec_run(out / "reranked-4.trec")
    alone = report["→ cross-encoder@4"]
    for q in queries:  # the fusion's top 4 reordered by the cross-encoder's scores
        top4 = sorted(hybrid[q], key=lambda p: -hybrid[q][p])[:4]
        assert sorted(top4, key=lambda p: -reranked[q][p]) == sorted(reranked[q], key=lambda p: -reranked[q][p])[:4]
    assert set(alone["tests"]) == {"dense", names[1]}
    for test in alone["tests"].values():
        assert 0 <= test["p"] <= 1 and test["wins"] + test["ties"] + test["losses"] == len(queries)

    # --cache-dir: another pipeline over the same queries reads the scores the first kept, and keeps none of its own
    cached = {path: path.read_bytes() for path in (out / "cache").rglob("*") if path.is_file()}
    assert cached
    shared = [*args, "--depth", "4", "--out", str(tmp_path / "out4"), "--device", "cpu"]
    shared += ["--cache-dir", str(out / "cache")]
    done = pipeline(*shared)
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "out4" / "cache").exists()
    assert {path: path.read_bytes() for path in (out / "cache").rglob("*") if path.is_file()} == cached  # none new
    assert read_trec_run(tmp_path / "out4" / "reranked-4.trec") == reranked

    # --set overrides the config: the runs then hold more queries than it evaluates
    done = pipeline(*args, "--out", str(tmp_path / "out3"), "--set", "data.max_eval_queries=2")
    assert done.returncode == 2 and f"holds {len(queries)} queries, not the 2 the config" in done.stderr
    write_run(tmp_path / "bm25.trec", queries[:-1], lambda q, i: 30 - i)  # a query short: one line, exit code 2
    done = pipeline(*args, "--out", str(tmp_path / "out2"))
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"teacher_pipeline.py: error: --bm25 holds {len(queries) - 1} queries, not the {len(queries)} the config "
        "evaluates"
    )


def test_the_pipeline_leaves_a_folder_of_ones_own_files_and_a_missing_model_as_one_line(
    tiny_beir, tiny_model_dir, tmp_path
):
    """Before any work: files of the script's names that it did not write (notes, another system's run) stop it in
    one line, untouched and nothing written beside them; so does a cross-encoder that is not there, and a missing
    input run leaves no output folder behind."""
    config = tmp_path / "config.yaml"
    config.write_text(f"name: t\ndata:\n  name: {tiny_beir}\n  max_eval_queries: null\n")
    (tmp_path / "run.trec").write_text("q1 Q0 p0 1 1.0 x\n")
    base = ["--config", str(config), "--dense", str(tmp_path / "run.trec")]
    base += ["--bm25", str(tmp_path / "run.trec"), "--device", "cpu"]
    notes = tmp_path / "notes"
    notes.mkdir()
    for name, text in (("report.md", "# my notes\n"), ("reranked-10.trec", "q1 Q0 p0 1 9.0 official-bm25\n")):
        (notes / name).write_text(text)
        done = pipeline(*base, "--cross-encoder", str(tmp_path), "--out", str(notes))
        assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
        assert f"--output {notes / name} exists and is not a" in done.stderr
        assert (notes / name).read_text() == text and not (notes / "first-stage.trec").exists()
        (notes / name).unlink()
    done = pipeline(*base, "--cross-encoder", str(tmp_path / "no-model"), "--out", str(notes))
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1 and "no-model" in done.stderr
    assert list(notes.iterdir()) == []
    missing = [*base[:3], str(tmp_path / "none.trec"), *base[4:], "--cross-encoder", str(tiny_model_dir), "--out"]
    done = pipeline(*missing, str(tmp_path / "new"))
    assert done.returncode == 2 and "none.trec" in done.stderr and not (tmp_path / "new").exists()


def test_weights_from_the_tuning_part_are_chosen_there_and_applied_to_the_reported_queries(
    tiny_beir, tiny_model_dir, tmp_path, monkeypatch
):
    """--weights-from: the cross-encoder's weight is the one ``best_weight`` picks on the tuning folder's queries
    (not 2-fold CV on the reported ones), and the fused row is that fusion; a folder sharing the reported queries,
    or the tuning folder as --out, is refused in one line."""
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    from densepass.config import load_config
    from densepass.data import load_dataset
    from densepass.evaluation.fusion import linear_fusion
    from densepass.evaluation.metrics import evaluate_run, read_trec_run
    from densepass.models.cross_encoder import CrossEncoder
    from densepass.pipelines.evalset import eval_qrels
    from recipe import best_weight, reranked_heads, reranked_runs

    ce = CrossEncoder.new(str(tiny_model_dir), seed=5, max_length=48, device=torch.device("cpu"), precision="fp32")
    with torch.no_grad():
        ce.model.classifier.weight.mul_(1e4)
    ce.save(tmp_path / "ce")
    config = tmp_path / "config.yaml"
    config.write_text(f"name: t\ndata:\n  name: {tiny_beir}\n  max_eval_queries: null\n")
    dataset = load_dataset(str(tiny_beir))
    outs = {}
    for part in ("tune", "report"):
        qrels, _ = eval_qrels(dataset, load_config(config, [f"data.eval_part={part}"]).data)
        queries = sorted(qrels)
        write_run(tmp_path / f"dense-{part}.trec", queries, lambda q, i: round(1 - i / 20 + (hash(q) % 7) / 100, 4))
        write_run(tmp_path / f"bm25-{part}.trec", queries, lambda q, i: 30 - ((i * 5) % 12))
        outs[part] = (tmp_path / f"out-{part}", qrels)
        args = ["--config", str(config), "--set", f"data.eval_part={part}"]
        args += ["--dense", str(tmp_path / f"dense-{part}.trec"), "--bm25", str(tmp_path / f"bm25-{part}.trec")]
        args += ["--cross-encoder", str(tmp_path / "ce"), "--dense-weight", "0.6", "--depth", "4", "--device", "cpu"]
        extra = ["--weights-from", str(outs["tune"][0])] if part == "report" else []
        done = pipeline(*args, *extra, "--out", str(outs[part][0]))
        assert done.returncode == 0, done.stderr
    tune_dir, tune_qrels = outs["tune"]
    head, alone = reranked_heads(
        read_trec_run(tune_dir / "first-stage.trec"), read_trec_run(tune_dir / "reranked-4.trec"), 4
    )
    weight = best_weight(tune_qrels, alone, head)
    report = json.loads((outs["report"][0] / "report.json").read_text())
    report_dir, report_qrels = outs["report"]
    dense, bm25 = read_trec_run(tmp_path / "dense-report.trec"), read_trec_run(tmp_path / "bm25-report.trec")
    tuning = (tune_qrels, read_trec_run(tune_dir / "first-stage.trec"), read_trec_run(tune_dir / "reranked-4.trec"))
    hybrid = linear_fusion([dense, bm25], [0.6, 0.4])
    _, fused, weights = reranked_runs(report_qrels, hybrid, read_trec_run(report_dir / "reranked-4.trec"), 4, 0, tuning)
    assert weights == f"{weight:.2f}"

    def tuned(w):  # the fused MRR@10 on the tuning queries at weight w
        return evaluate_run(tune_qrels, linear_fusion([alone, head], [w, 1 - w]), ["mrr@10"])["mrr@10"]

    there = tuned(weight)
    assert there == max(tuned(i / 20) for i in range(1, 20))  # the row names the best the tuning queries reach
    row = (
        f"→ cross-encoder@4, fused with the first stage (weight {weight:.2f} chosen on the --weights-from queries, "
        f"MRR@10 {there:.4f} there)"
    )
    assert row in report
    assert report[row]["metrics"] == pytest.approx(evaluate_run(report_qrels, fused, list(report[row]["metrics"])))
    text = (outs["report"][0] / "report.md").read_text()
    assert text.endswith("The depth the --weights-from queries choose (their best fused MRR@10): 4.\n")

    done = pipeline(*args, "--weights-from", str(outs["report"][0]), "--out", str(tmp_path / "again"))
    assert done.returncode == 2 and "holds" in done.stderr and "of the evaluated queries" in done.stderr
    assert not (tmp_path / "again").exists()
    done = pipeline(*args, "--weights-from", str(tune_dir), "--out", str(tune_dir))
    assert done.returncode == 2 and "--weights-from is the tuning part's folder" in done.stderr
