"""The tuning and reporting parts of an eval split (data.parts, data.eval_part) and evaluation without the query's
own id (eval.ignore_identical_ids, BEIR's rule for ArguAna)."""

from __future__ import annotations

import json
import math
import random
import shutil
import sys
from pathlib import Path

import pytest

from conftest import script_module, small_run_overrides
from densepass import cli
from densepass.config import load_config
from densepass.data import load_dataset
from densepass.data.dataset import Corpus
from densepass.data.parts import query_groups, split_query_parts
from densepass.errors import ConfigError, DataError
from densepass.evaluation.metrics import evaluate_run
from densepass.pipelines.evalset import eval_qrels
from densepass.pipelines.experiment import check, run_experiment, without_identical_ids
from phrase_fixtures import write_phrase_squad


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
    for fraction in ("1.5", "1"):  # 1 too: the reporting part would hold no query (--explain shows "< 1")
        with pytest.raises(ConfigError, match="data.eval_part_fraction: must be < 1"):
            load_config(None, ["data.eval_part=tune", f"data.eval_part_fraction={fraction}"])
    cpu = ["device=cpu"]
    built = load_config(None, [*cpu, "data.eval_part=report"])
    built.data.eval_part_fraction = 1.0  # a config built in Python: check() refuses it
    with pytest.raises(ConfigError, match="data.eval_part_fraction must be below 1"):
        check(built)
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


RECIPE = Path(__file__).parent.parent / "experiments" / "recipe.py"


def load_recipe():
    """experiments/recipe.py as a module (run in this process: no interpreter start per stage)."""
    return script_module(RECIPE)


def test_the_recipe_study_chooses_on_the_tuning_part_and_reports_arguana(
    tiny_beir, tiny_model_dir, tmp_path, monkeypatch, capsys
):
    """experiments/recipe.py --eval-part report on tiny data: one row and one wise-ft point, each evaluated on both
    parts of dev and on ArguAna; the α and the fusion weight are chosen on the tuning part; an ArguAna evaluation
    that is missing is run by the next report, without training again."""
    arguana = write_self_retrieval(tmp_path / "arguana")
    squad = write_phrase_squad(tmp_path / "squad")
    out = tmp_path / "out"
    sets = [f"data.name={tiny_beir}", f"model.name_or_path={tiny_model_dir}", "model.passage_max_length=32"]
    sets += ["train.batch_size=8", "negatives.pool_depth=5", "eval.depth=20"]
    common = ["--out", str(out), "--train-queries", "16", "--eval-queries", "12", "--eval-part", "report"]
    common += [a for s in sets for a in ("--set", s)]
    common += ["--ood-set", f"data.name={squad}", "--ood-set", "model.passage_max_length=32"]
    common += ["--arguana-set", f"data.name={arguana}", "--arguana-set", "eval.depth=3"]
    common += ["--arguana-set", "model.query_max_length=32", "--arguana-set", "model.passage_max_length=32"]
    driver = load_recipe()

    def recipe(*args: str) -> None:
        monkeypatch.setattr(sys, "argv", [str(RECIPE), *args, *common])
        driver.main()

    recipe("--stage", "train", "--only", "README recipe")
    recipe("--stage", "wise-ft", "--alphas", "0.5")
    trained = (out / "runs" / "readme-recipe" / "metrics.json").stat().st_mtime_ns
    shutil.rmtree(out / "ood-arguana" / "readme-recipe")  # as if the row were trained before ArguAna was added
    capsys.readouterr()
    recipe("--stage", "report")
    assert (out / "runs" / "readme-recipe" / "metrics.json").stat().st_mtime_ns == trained  # not trained again
    assert (out / "ood-arguana" / "readme-recipe" / "metrics.json").is_file()
    report = json.loads((out / "report.json").read_text())
    dataset = load_dataset(str(tiny_beir))
    parts = split_query_parts(dataset.split("dev"), dataset.corpus, 0.5, 13)
    assert report["eval_part"]["part"] == "report" and report["eval_part"]["queries"] == len(parts.report)
    row, wise = "README recipe", "README recipe, wise-ft α=0.5"
    for name in (row, wise):
        found = report["rows"][name]
        assert found["trec"] == str(out / "parts" / "report" / slug_of(name) / "runs" / "zero-shot.trec")
        ran = {line.split()[0] for line in Path(found["trec"]).read_text().splitlines()}
        assert ran == set(parts.report)  # reported on the reporting part only
        stored = json.loads((out / "parts" / "tune" / slug_of(name) / "metrics.json").read_text())
        assert stored["eval_part"]["part"] == "tune" and found["tune"] == stored["results"]["zero-shot"]
        assert 0 <= found["arguana"]["ndcg@10"] <= 1 and 0 <= found["ood"]["accuracy@5"] <= 1
    arguana_run = (out / "ood-arguana" / "readme-recipe" / "runs" / "zero-shot.trec").read_text().splitlines()
    assert arguana_run and not any(line.split()[0] == line.split()[2] for line in arguana_run)
    choice = report["choices"]["wise-ft α of README recipe"]
    tuning = {name: report["rows"][name]["tune"]["mrr@10"] for name in (row, wise)}
    assert choice["chosen"] == max(tuning, key=tuning.get) and choice["tune mrr@10"] == max(tuning.values())
    fused = [name for name in report["rows"] if "linear, dense weight" in name]
    assert fused and all("chosen on the tuning part" in name for name in fused)
    assert report["tests"][wise]["against"] == row
    text = (out / "report.md").read_text()
    assert "ArguAna ndcg@10" in text and "tuning MRR@10" in text and "| choice on the tuning part |" in text
    assert "**reporting part**" in text


def slug_of(name: str) -> str:
    text = "".join(c if c.isascii() and c.isalnum() else "-" for c in name.lower())
    while "--" in text:
        text = text.replace("--", "-")
    return text.strip("-")


def test_the_recipe_drivers_part_options_are_checked(monkeypatch, capsys):
    driver = load_recipe()
    for args, message in (
        (["--eval-part", "report", "--eval-part-fraction", "1"], "--eval-part-fraction must lie strictly between"),
        (["--eval-part-seed", "5"], "shape the parts of --eval-part report"),
        (["--eval-part", "tune"], "invalid choice: 'tune'"),
    ):
        monkeypatch.setattr(sys, "argv", [str(RECIPE), *args])
        with pytest.raises(SystemExit) as exit:
            driver.parse_args()
        assert exit.value.code == 2 and message in capsys.readouterr().err, args


def test_a_run_reported_on_report_validates_on_the_tuning_part(tiny_beir, tiny_model_dir, tmp_path):
    """Choosing a checkpoint is tuning: validation on the eval split of a run evaluated on ``report`` sees the
    tuning part's queries only (here: C0, the gold passages of exactly those queries)."""
    sets = small_run_overrides(tiny_beir, tiny_model_dir, tmp_path, "validated")
    sets += ["data.eval_part=report", "data.max_train_queries=8", "train.batch_size=4", "train.max_steps=1"]
    sets += ["validation.enabled=true", "validation.split=dev", "validation.subcorpus=gold"]
    run_experiment(load_config(None, sets))
    dataset = load_dataset(str(tiny_beir))
    parts = split_query_parts(dataset.split("dev"), dataset.corpus, 0.5, 13)
    gold = sorted({p for q in parts.tune for p in dataset.split("dev")[q]}, key=dataset.corpus.position)
    validated = json.loads((tmp_path / "validated" / "subcorpus-C0.json").read_text())
    assert validated["ids"] == gold and validated["provenance"]["queries"] == len(parts.tune)
