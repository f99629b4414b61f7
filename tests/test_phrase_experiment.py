"""``densepass phrase``: every stage end to end on a tiny model and dataset, resuming, under ``torchrun``, and the
phrase index through ``densepass index`` / ``densepass search``; the token filter's AUC-PR against scikit-learn."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sklearn.metrics import average_precision_score

from conftest import run_densepass
from densepass.cli import main
from densepass.config import load_config
from densepass.errors import ConfigError
from densepass.phrase.config import PhraseConfig
from densepass.phrase.experiment import run_phrase
from densepass.phrase.metrics import average_precision, exact_match, f1_score, phrase_metrics
from phrase_fixtures import tiny_phrase_model, write_phrase_squad


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([-2.0, -0.5, 0.0, 0.3, 1.0, 4.0]), st.booleans()), min_size=1, max_size=40))
def test_average_precision_is_scikit_learns_on_the_same_scores_ties_included(pairs):
    scores, labels = [s for s, _ in pairs], [int(y) for _, y in pairs]
    if not any(labels):
        assert average_precision(scores, labels) == 0.0
        return
    assert average_precision(scores, labels) == pytest.approx(average_precision_score(labels, scores))


def test_squad_exact_match_and_f1_follow_the_official_normalisation():
    assert exact_match("The  Broncos!", ["Denver Broncos", "broncos"]) == 1.0
    assert exact_match("Denver", ["Denver Broncos"]) == 0.0
    assert f1_score("the Denver Broncos team", ["Denver Broncos"]) == pytest.approx(0.8)
    # punctuation is removed, not read as a space (SQuAD v1.1's evaluate-v1.1.py): U.S. is us, 1,000 is 1000
    assert [exact_match(p, [a]) for p, a in [("U.S.", "US"), ("1,000", "1000"), ("o'neil", "oneil")]] == [1.0] * 3
    assert exact_match("Denver-Broncos", ["Denver Broncos"]) == 0.0 and f1_score("U.S.", ["US"]) == 1.0
    metrics = phrase_metrics([["Paris", "France"], ["x", "y", "Rome"], []], [["france"], ["Rome"], ["z"]], [1, 2, 3])
    assert metrics["em@1"] == 0.0 and metrics["accuracy@2"] == pytest.approx(100 / 3)
    assert metrics["accuracy@3"] == pytest.approx(200 / 3)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("phrase-run")
    write_phrase_squad(root / "squad")
    tiny_phrase_model(root / "bert")
    overrides = [
        f"data.name={root / 'squad'}",
        f"output_dir={root / 'outputs'}",
        "name=tiny",
        "device=cpu",
        f"model.base={root / 'bert'}",
        "model.max_length=40",
        "model.stride=8",
        "model.title_max_tokens=4",
        "model.max_answer_tokens=5",
        "train.epochs=1",
        "train.max_steps=3",
        "train.passages_per_batch=2",
        "train.checkpoint_every=2",
        "validation.subcorpus=hard",
        "validation.k=1",
        "validation.every_steps=2",
        "filter.epochs=2",
        "filter.thresholds=[-100.0, 0.0, 100.0]",
        "filter.threshold=-100.0",
        "query_tuning.enabled=true",
        "query_tuning.batch_size=4",
        "query_tuning.top_k=5",
        "eval.ks=[1, 3]",
    ]
    return root, overrides


def test_every_stage_runs_and_a_rerun_skips_them(tiny_run):
    root, overrides = tiny_run
    config = load_config(None, overrides, PhraseConfig)
    metrics = run_phrase(config, show_progress=False)
    run_dir = root / "outputs" / "tiny"
    assert metrics["train"]["steps"] == 3 and metrics["train"]["best"]["step"] in (2, 3)
    evaluate = metrics["evaluate"]
    assert 0 <= evaluate["unfiltered"]["em@1"] <= evaluate["unfiltered"]["accuracy@3"] <= 100
    sweep = {r["threshold"]: r for r in evaluate["sweep"]}
    assert sweep[-100.0]["start_vectors"] == evaluate["unfiltered"]["start_vectors"]  # nothing filtered
    assert sweep[100.0]["start_vectors"] == 0 and sweep[100.0]["em@1"] == 0.0  # everything filtered
    assert 0 < metrics["filter"]["best_auc_pr"] <= 1
    assert metrics["query_tuning"]["steps"] > 0
    assert {"config.yaml", "report.md", "metrics.json", "subcorpus.json", "eval_log.jsonl"} <= {
        p.name for p in run_dir.iterdir()
    }
    again = run_phrase(config, show_progress=False)
    assert again == metrics  # every stage was skipped


def test_densepass_phrase_runs_every_stage_under_torchrun(tiny_run, tmp_path):
    """Two processes train (rank 0 mines the hard negatives and validates), rank 0 alone runs the later stages
    (the filter, the index, query tuning on the engine) and writes every file once."""
    _, overrides = tiny_run
    settings = [
        *(kv for kv in overrides if not kv.startswith(("output_dir=", "name="))),
        f"output_dir={tmp_path}",
        "name=dist",
        "train.loss=unified",
        "train.hard_negatives=1",
        "train.log_every=1",
    ]
    done = run_densepass("phrase", *(arg for kv in settings for arg in ("--set", kv)), cwd=tmp_path, processes=2)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("report:") == 1  # printed by rank 0 alone
    run_dir = tmp_path / "dist"
    stages = json.loads((run_dir / "stages.json").read_text())
    assert list(stages) == ["hard_negatives", "train", "filter", "evaluate", "query_tuning"]
    assert stages["train"]["steps"] == 3 and stages["train"]["best"]["step"] in (2, 3)
    assert stages["query_tuning"]["steps"] > 0
    assert [json.loads(line)["step"] for line in (run_dir / "train_log.jsonl").read_text().splitlines()] == [1, 2, 3]
    assert [json.loads(line)["step"] for line in (run_dir / "eval_log.jsonl").read_text().splitlines()] == [2, 3]
    assert json.loads((run_dir / "index" / "manifest.json").read_text())["kind"] == "phrase"
    assert (run_dir / "report.md").is_file() and (run_dir / "qsft-model").is_dir()
    assert json.loads((run_dir / "metrics.json").read_text())["train"] == stages["train"]


def test_the_saved_index_answers_densepass_search(tiny_run, capsys):
    root, overrides = tiny_run
    run_phrase(load_config(None, overrides, PhraseConfig), show_progress=False)
    index = root / "outputs" / "tiny" / "index"
    assert main(["search", str(index), "what is the kernel driver?", "--k", "3", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "answer" in out and "span" in out
    queries = root / "q.tsv"
    queries.write_text("q1\tkernel driver?\nq2\tmusic player?\n")
    assert main(["search", str(index), "--queries", str(queries), "--output", str(root / "run.trec")]) == 0
    lines = (root / "run.trec").read_text().splitlines()
    assert lines and all(len(line.split()) == 6 for line in lines)


def test_densepass_index_builds_a_phrase_index_with_a_filter_threshold(tiny_run, capsys):
    root, overrides = tiny_run
    run_phrase(load_config(None, overrides, PhraseConfig), show_progress=False)
    model = root / "outputs" / "tiny" / "model"
    code = main(
        [
            "index",
            str(root / "squad"),
            "--format",
            "squad",
            "--kind",
            "phrase",
            "--model",
            str(model),
            "--filter-threshold",
            "0.0",
            "--output",
            str(root / "idx"),
            "--device",
            "cpu",
        ]
    )
    assert code == 0
    manifest = json.loads((root / "idx" / "manifest.json").read_text())
    assert manifest["kind"] == "phrase" and manifest["options"]["threshold"] == 0.0
    logits = np.load(root / "idx" / "start_logits.npy")
    assert manifest["stats"]["start_vectors"] == int((logits > 0.0).sum())
    # searched with the same encoder saved without its filter (best-model): the threshold applies to the stored
    # logits, so it loads (the filter is needed to build a thresholded index, not to read one)
    best = root / "outputs" / "tiny" / "best-model"
    assert main(["search", str(root / "idx"), "kernel driver?", "--model", str(best), "--device", "cpu"]) == 0


def test_phrase_runs_refuse_a_layout_without_offsets_and_hard_negatives_with_eq1(tiny_run):
    _, overrides = tiny_run
    with pytest.raises(ConfigError, match="squad"):
        run_phrase(load_config(None, [*overrides, "data.format=beir"], PhraseConfig))
    with pytest.raises(ConfigError, match="unified"):
        run_phrase(load_config(None, [*overrides, "train.loss=separate", "train.hard_negatives=1"], PhraseConfig))


def test_every_phrase_config_key_has_help_and_densepass_config_explains_them(capsys):
    from densepass.config import explain

    rows = explain(PhraseConfig)
    assert all(help_text for _, _, _, help_text in rows), [k for k, _, _, h in rows if not h]
    assert main(["config", "--phrase", "--explain"]) == 0
    out = capsys.readouterr().out
    assert "train.lambda_inb" in out and "filter.threshold" in out and "query_tuning.top_k" in out
    assert main(["phrase", "--set", "train.lambda_inb=0"]) != 0  # out of range: one line, before any work
    assert capsys.readouterr().err.strip() == "densepass: error: config.train.lambda_inb: must be > 0, got 0.0"


def test_the_filter_is_validated_by_the_auc_pr_scikit_learn_gives_its_logits():
    from densepass.phrase.config import FilterConfig
    from densepass.phrase.encode import TokenVectors
    from densepass.phrase.token_filter import filter_logits, fit_filter

    rng = np.random.default_rng(0)

    def table(n):
        labels = rng.random((n, 2)) < 0.1
        start = rng.normal(size=(n, 8)).astype(np.float32) + labels[:, :1] * 1.5  # positives shifted: learnable
        end = rng.normal(size=(n, 8)).astype(np.float32) - labels[:, 1:] * 1.5
        return TokenVectors(np.array([0, n]), np.zeros((n, 2), dtype=np.int64), start, end), labels

    (train, train_labels), (valid, valid_labels) = table(2000), table(500)
    token_filter, log = fit_filter(train, train_labels, valid, valid_labels, FilterConfig(epochs=3, batch_size=256))
    start, end = filter_logits(token_filter, valid)
    best = max(log, key=lambda r: r["auc_pr"])
    assert best["auc_pr_start"] == pytest.approx(average_precision_score(valid_labels[:, 0], start))
    assert best["auc_pr_end"] == pytest.approx(average_precision_score(valid_labels[:, 1], end))
    assert best["auc_pr"] > 0.2  # well above the 0.1 base rate: the filter learnt something


def test_a_filter_threshold_without_a_filter_is_refused_before_any_work(tiny_run):
    from densepass.config import load_config
    from densepass.errors import ConfigError
    from densepass.phrase.config import PhraseConfig
    from densepass.phrase.experiment import check

    root, overrides = tiny_run
    config = load_config(None, [*overrides, "filter.enabled=false", "filter.threshold=-100.0"], PhraseConfig)
    with pytest.raises(ConfigError, match="filter.threshold filters the index"):
        check(config)


def test_an_empty_eval_ks_is_refused_before_any_work(tiny_run):
    from densepass.config import load_config
    from densepass.errors import ConfigError
    from densepass.phrase.config import PhraseConfig
    from densepass.phrase.experiment import check

    root, overrides = tiny_run
    with pytest.raises(ConfigError, match="eval.ks is empty"):
        check(load_config(None, [*overrides, "eval.ks=[]"], PhraseConfig))


def test_a_hard_negatives_file_naming_a_passage_outside_the_training_split_is_one_line(tiny_run, tmp_path):
    """A dev passage in ``train.hard_negatives_file`` was accepted (and would leak an evaluation passage into
    training), then failed at the first step with a ``KeyError`` traceback."""
    import json

    from densepass.config import load_config
    from densepass.data.squad import load_squad_spans
    from densepass.errors import DataError
    from densepass.phrase.config import PhraseConfig
    from densepass.phrase.experiment import run_phrase
    from densepass.phrase.train import split_rows

    root, overrides = tiny_run
    data = load_squad_spans(root / "squad")
    corpus = data.dataset.corpus
    dev, train = corpus.ids[split_rows(data, "dev")[0]], corpus.ids[split_rows(data, "train")[0]]
    qid = next(q for q in data.dataset.split("train") if q in data.spans)
    path = tmp_path / "negatives.jsonl"
    path.write_text(json.dumps({"qid": qid, "negatives": [train, dev]}) + "\n")
    extra = [f"train.hard_negatives_file={path}", "train.hard_negatives=1", "name=hard", f"output_dir={tmp_path}"]
    with pytest.raises(DataError, match=rf"negatives.jsonl:1: passage '{dev}' is not a passage of the training split"):
        run_phrase(load_config(None, [*overrides, *extra], PhraseConfig))


def test_a_rerun_with_other_settings_is_refused_and_a_refused_restart_removes_nothing(tiny_run, tmp_path):
    """A re-run with another learning rate skipped every finished stage, reported the old results as the new
    settings' and replaced config.yaml; a --restart whose hard-negatives file was missing removed the earlier run
    and only then failed."""
    import shutil

    from densepass.errors import DataError

    root, overrides = tiny_run
    run_phrase(load_config(None, overrides, PhraseConfig), show_progress=False)
    shutil.copytree(root / "outputs" / "tiny", tmp_path / "tiny")
    here = [*overrides, f"output_dir={tmp_path}"]
    saved = (tmp_path / "tiny" / "config.yaml").read_text()
    refused = r"holds a phrase run whose finished stages \(.*\) had other settings \(train.learning_rate differ"
    with pytest.raises(ConfigError, match=refused):
        run_phrase(load_config(None, [*here, "train.learning_rate=0.1"], PhraseConfig), show_progress=False)
    assert (tmp_path / "tiny" / "config.yaml").read_text() == saved
    # how often it logs, where its data is read from and how many windows evaluation encodes at once change no
    # result: the stages are kept
    kept = ["train.log_every=7", f"data.data_dir={root}", "eval.batch_size=8"]
    again = run_phrase(load_config(None, [*here, *kept], PhraseConfig), show_progress=False)
    assert again["train"]["steps"] == 3
    files = sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))
    missing = [*here, "train.hard_negatives=1", f"train.hard_negatives_file={tmp_path / 'none.jsonl'}"]
    with pytest.raises(DataError, match="hard-negatives file not found"):
        run_phrase(load_config(None, missing, PhraseConfig), restart=True, show_progress=False)
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == files


def test_a_filter_threshold_with_a_model_without_a_filter_is_refused_before_encoding(tiny_run, capsys):
    root, overrides = tiny_run
    run_phrase(load_config(None, overrides, PhraseConfig), show_progress=False)
    best = root / "outputs" / "tiny" / "best-model"  # saved before the token filter was trained
    out = root / "idx-no-filter"
    args = ["index", str(root / "squad"), "--format", "squad", "--kind", "phrase", "--model", str(best)]
    assert main([*args, "--filter-threshold", "-3", "--output", str(out), "--device", "cpu"]) == 2
    captured = capsys.readouterr()
    assert "a filter threshold needs a model with a trained token filter" in captured.err
    assert "encode" not in captured.err + captured.out and not out.exists()
