"""The tuning and reporting parts of an eval split (data.parts, data.eval_part) and evaluation without the query's
own id (eval.ignore_identical_ids, BEIR's rule for ArguAna)."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from conftest import small_run_overrides
from densepass import cli
from densepass.config import load_config
from densepass.data import load_dataset
from densepass.data.dataset import Corpus
from densepass.data.parts import query_groups, split_query_parts
from densepass.errors import ConfigError, DataError
from densepass.evaluation.metrics import evaluate_run
from densepass.pipelines.evalset import eval_qrels
from densepass.pipelines.experiment import check, run_experiment, without_identical_ids


def grouped(n_docs: int = 60, seed: int = 0) -> tuple[Corpus, dict]:
    """A corpus of ``n_docs`` documents of 1-3 passages each, and 1-4 queries per document (each relevant to one
    passage of it), a few of them relevant to passages of two documents."""
    rng = random.Random(seed)
    ids, docs, qrels = [], [], {}
    for d in range(n_docs):
        for p in range(rng.randint(1, 3)):
            ids.append(f"d{d}p{p}")
            docs.append(f"doc{d}")
    for d in range(n_docs):
        for q in range(rng.randint(1, 4)):
            qrels[f"q{d}-{q}"] = {f"d{d}p0": 1}
    qrels["q-two"] = {"d7p0": 1, "d3p0": 1}  # equal grades: the passage first in the corpus (doc3) decides
    qrels["q-graded"] = {"d3p0": 1, "d9p0": 2}  # the better graded one (doc9) decides
    qrels["q-none"] = {"d1p0": 0}  # no relevant passage: in no part
    n = len(ids)
    return Corpus(ids, [""] * n, ["text"] * n, docs), qrels


def test_the_parts_are_disjoint_cover_the_queries_and_keep_every_group_whole():
    corpus, qrels = grouped()
    parts = split_query_parts(qrels, corpus, 0.5, seed=3)
    tune, report = set(parts.tune), set(parts.report)
    assert not tune & report
    assert tune | report == set(qrels) - {"q-none"}
    groups, by = query_groups(qrels, corpus)
    assert by == "document" and parts.by == "document" and parts.groups == 60
    assert not {groups[q] for q in tune} & {groups[q] for q in report}
    assert groups["q-two"] == ("document", "doc3") and groups["q-graded"] == ("document", "doc9")
    # the tuning part holds the fraction of the queries to within half the largest group (here 4 + 2 queries)
    for fraction in (0.3, 0.5, 0.8):
        part = split_query_parts(qrels, corpus, fraction, seed=3)
        assert abs(len(part.tune) - fraction * (len(qrels) - 1)) <= 3, fraction


def test_the_split_depends_on_the_seed_only():
    corpus, qrels = grouped()
    first = split_query_parts(qrels, corpus, 0.5, seed=3)
    shuffled = dict(reversed(list(qrels.items())))  # another order of the qrels file: the same parts
    assert split_query_parts(shuffled, corpus, 0.5, seed=3) == first
    other = split_query_parts(qrels, corpus, 0.5, seed=4)
    assert other.tune != first.tune
    assert first.describe("report") == {
        "part": "report",
        "part_queries": len(first.report),
        "split_queries": len(qrels) - 1,
        "by": "document",
        "groups": 60,
        "fraction": 0.5,
        "seed": 3,
    }


def test_a_corpus_without_documents_is_split_by_query():
    ids = [f"p{i}" for i in range(20)]
    corpus = Corpus(ids, [""] * 20, ["t"] * 20, list(ids))  # each passage its own document: no groups
    qrels = {f"q{i}": {f"p{i % 10}": 1} for i in range(20)}  # two queries share each passage
    parts = split_query_parts(qrels, corpus, 0.5, seed=1)
    assert parts.by == "query" and parts.groups == 20 and len(parts.tune) == 10
    assert sorted(parts.tune + parts.report) == sorted(qrels)


def test_too_few_groups_or_a_bad_fraction_is_a_one_line_error():
    corpus = Corpus(["a", "b"], ["", ""], ["x", "y"], ["doc", "doc"])
    with pytest.raises(DataError, match=r"dev: its 2 queries .* fall in 1 group\(s\) \(by document\): too few"):
        split_query_parts({"q1": {"a": 1}, "q2": {"b": 1}}, corpus, 0.5, seed=0, where="dev")
    for fraction in (0.0, 1.0, 1.5):
        with pytest.raises(DataError, match="strictly between 0 and 1"):
            split_query_parts({"q1": {"a": 1}}, corpus, fraction, seed=0)


def test_config_validation(tmp_path):
    with pytest.raises(ConfigError, match="data.eval_part: 'dev' is not one of 'all', 'tune', 'report'"):
        load_config(None, ["data.eval_part=dev"])
    with pytest.raises(ConfigError, match="data.eval_part_fraction: must be > 0"):
        load_config(None, ["data.eval_part=tune", "data.eval_part_fraction=0"])
    with pytest.raises(ConfigError, match="data.eval_part_fraction: must be <= 1"):
        load_config(None, ["data.eval_part=tune", "data.eval_part_fraction=1.5"])
    cpu = ["device=cpu"]
    with pytest.raises(ConfigError, match="data.eval_part_fraction must be below 1"):
        check(load_config(None, [*cpu, "data.eval_part=report", "data.eval_part_fraction=1"]))
    with pytest.raises(ConfigError, match="need data.eval_part: tune or report"):
        check(load_config(None, [*cpu, "data.eval_part_seed=7"]))
    check(load_config(None, [*cpu, "data.eval_part=report", "data.eval_part_fraction=0.3", "data.eval_part_seed=7"]))


def test_the_part_comes_before_the_sample(tiny_beir):
    dataset = load_dataset(str(tiny_beir))
    base = load_config(None, [f"data.name={tiny_beir}", "data.eval_part=tune"]).data
    parts = split_query_parts(dataset.split("dev"), dataset.corpus, 0.5, 13)
    qrels, part = eval_qrels(dataset, base)
    assert sorted(qrels) == parts.tune and part["part"] == "tune" and part["queries"] == len(parts.tune)
    sampled, part = eval_qrels(
        dataset, load_config(None, [f"data.name={tiny_beir}", "data.eval_part=report", "data.max_eval_queries=2"]).data
    )
    assert len(sampled) == 2 and set(sampled) <= set(parts.report) and part["queries"] == 2
    assert part["part_queries"] == len(parts.report)
    everything, none = eval_qrels(dataset, load_config(None, [f"data.name={tiny_beir}"]).data)
    assert none is None and set(everything) == set(parts.tune) | set(parts.report)


def test_a_run_records_its_part(tiny_beir, tiny_model_dir, tmp_path):
    sets = small_run_overrides(tiny_beir, tiny_model_dir, tmp_path, "part")
    config = load_config(None, [*sets, "train.enabled=false", "eval.baselines=[zero-shot]", "data.eval_part=report"])
    run_experiment(config)
    stored = json.loads((tmp_path / "part" / "metrics.json").read_text())
    assert stored["eval_part"]["part"] == "report" and stored["eval_part"]["by"] == "document"
    assert stored["eval_part"]["queries"] == stored["eval_part"]["part_queries"] < stored["eval_part"]["split_queries"]
    assert "of the report part" in stored["eval"]
    ran = {line.split()[0] for line in (tmp_path / "part" / "runs" / "zero-shot.trec").read_text().splitlines()}
    assert len(ran) == stored["eval_part"]["queries"]


def test_a_bad_part_is_one_line_before_any_work(tmp_path, capsys):
    out = tmp_path / "out"
    code = cli.main(["run", "--set", f"output_dir={out}", "--set", "data.eval_part_fraction=0.2"])
    assert code == 2 and not out.exists()
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "they need data.eval_part: tune or report" in err


def test_identical_ids_are_dropped_by_hand():
    """ArguAna's rule: the query's own document is not a hit. q1's counter-argument c1 comes second behind q1
    itself; without q1 it is first. nDCG@10 with one relevant passage at rank r is 1 / log2(r + 1)."""
    qrels = {"q1": {"c1": 1}, "q2": {"c2": 1}}
    run = {"q1": {"q1": 0.9, "c1": 0.8, "x": 0.7}, "q2": {"x": 0.9, "q2": 0.85, "c2": 0.8}}
    kept = without_identical_ids(run, depth=2)
    assert kept == {"q1": {"c1": 0.8, "x": 0.7}, "q2": {"x": 0.9, "c2": 0.8}}
    assert evaluate_run(qrels, run, ["ndcg@10"])["ndcg@10"] == pytest.approx((1 / math.log2(3) + 1 / 2) / 2)
    assert evaluate_run(qrels, kept, ["ndcg@10"])["ndcg@10"] == pytest.approx((1 + 1 / math.log2(3)) / 2)


def write_self_retrieval(root: Path) -> Path:
    """Six arguments; each query is an argument (same id, same text) whose counter is the next one."""
    root.mkdir()
    words = ["audio editor", "font viewer", "mail server", "music player", "python shell", "kernel driver"]
    with open(root / "corpus.jsonl", "w") as f:
        for i, text in enumerate(words):
            f.write(json.dumps({"_id": f"a{i}", "title": "", "text": text}) + "\n")
    with open(root / "queries.jsonl", "w") as f:
        for i, text in enumerate(words):
            f.write(json.dumps({"_id": f"a{i}", "text": text}) + "\n")
    (root / "qrels").mkdir()
    lines = ["query-id\tcorpus-id\tscore", *(f"a{i}\ta{(i + 1) % 6}\t1" for i in range(6))]
    (root / "qrels" / "test.tsv").write_text("\n".join(lines) + "\n")
    return root


def test_a_run_without_identical_ids_keeps_its_depth(tiny_model_dir, tmp_path):
    data = write_self_retrieval(tmp_path / "args")
    runs = {}
    for ignore in (False, True):
        sets = small_run_overrides(data, tiny_model_dir, tmp_path, f"ignore-{ignore}")
        sets += [
            "data.eval_split=test",
            "train.enabled=false",
            "negatives.source=none",
            "eval.baselines=[zero-shot]",
            "eval.depth=3",
        ]
        results = run_experiment(load_config(None, [*sets, f"eval.ignore_identical_ids={str(ignore).lower()}"]))
        lines = (tmp_path / f"ignore-{ignore}" / "runs" / "zero-shot.trec").read_text().splitlines()
        runs[ignore] = [line.split() for line in lines]
        runs[ignore, "mrr"] = results["zero-shot"]["mrr@10"]
    own = [(q, rank) for q, _, p, rank, *_ in runs[False] if q == p]
    assert own == [(f"a{i}", "1") for i in range(6)]  # the same text: each query's own argument comes first
    assert not any(q == p for q, _, p, *_ in runs[True])
    assert len(runs[True]) == len(runs[False]) == 6 * 3  # still eval.depth hits per query
    assert runs[False, "mrr"] < runs[True, "mrr"]
