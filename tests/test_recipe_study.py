"""experiments/recipe.py end to end on tiny data (two cumulative rows, their out-of-domain check, a wise-ft
interpolation and the report), so that the study cannot drift from the pipeline unnoticed."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from conftest import script_here, script_module
from densepass import cli
from densepass.config import load_config
from densepass.models.cross_encoder import CrossEncoder
from phrase_fixtures import write_phrase_squad

SCRIPT = Path(__file__).parent.parent / "experiments" / "recipe.py"


def recipe_program(*args: str) -> subprocess.CompletedProcess:
    """``python experiments/recipe.py ARGS`` in a process of its own."""
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)


def recipe(*args: str) -> subprocess.CompletedProcess:
    """experiments/recipe.py ARGS run in this process (``conftest.script_here``). Its stages call the pipeline's
    functions; a process of its own for each would only pay the imports again (:func:`recipe_program` runs it as a
    program where that is the point)."""
    return script_here(SCRIPT, *args)


def test_rows_out_of_domain_wise_ft_and_report(tiny_beir, tiny_model_dir, tmp_path):
    squad = write_phrase_squad(tmp_path / "squad")
    out = tmp_path / "out"
    sets = [
        f"data.name={tiny_beir}",
        f"model.name_or_path={tiny_model_dir}",
        "model.passage_max_length=32",
        "train.batch_size=8",
        "negatives.pool_depth=5",
        "eval.depth=20",
    ]
    ood = [f"data.name={squad}", "model.passage_max_length=32"]
    common = ["--out", str(out), "--train-queries", "24", "--eval-queries", "12"]
    common += [a for s in sets for a in ("--set", s)] + [a for s in ood for a in ("--ood-set", s)]
    arguana = [f"data.name={tiny_beir}", "data.eval_split=dev", "model.query_max_length=32"]
    arguana += ["model.passage_max_length=32"]
    common += [a for s in arguana for a in ("--arguana-set", s)]  # the tiny data stands in for ArguAna
    rows = ["README recipe", "+ 3 hard negatives"]
    done = recipe("--stage", "train", "--only", *rows, *common)
    assert done.returncode == 0, done.stderr[-3000:]
    for row in reversed(rows):  # the report lists every interpolation on disk, in the rows' order
        done = recipe("--stage", "wise-ft", "--wise-ft-row", row, "--alphas", "0.5", *common)
        assert done.returncode == 0, done.stderr[-3000:]
    freeze = ["--variant-row", "+ 3 hard negatives", "--variants", "freeze embeddings + 3 layers"]
    done = recipe("--stage", "variant", *freeze, *common, "--set", "train.freeze_layers=1")  # the tiny model: 2
    assert done.returncode == 0, done.stderr[-3000:]
    done = recipe("--stage", "report", *common)  # found on disk, not named again
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    wise, wise_hn = "README recipe, wise-ft α=0.5", "+ 3 hard negatives, wise-ft α=0.5"
    frozen = "+ 3 hard negatives, freeze embeddings + 3 layers"
    hybrids = [name for name in report["rows"] if "+ BM25" in name]
    assert list(report["rows"]) == [*rows, frozen, wise, wise_hn, *hybrids]
    assert report["tests"][wise_hn]["against"] == "+ 3 hard negatives"
    assert report["tests"][frozen]["against"] == "+ 3 hard negatives"
    frozen_config = yaml.safe_load(
        (out / "runs" / "3-hard-negatives-freeze-embeddings-3-layers" / "config.yaml").read_text()
    )
    assert frozen_config["train"]["freeze_layers"] == 1 and frozen_config["negatives"]["per_query"] == 3
    assert hybrids[0] == "README recipe + BM25 (RRF)" and hybrids[1].startswith("README recipe + BM25 (linear, dense")
    assert all(report["tests"][name]["against"] in rows for name in hybrids)
    for name in [*rows, frozen, wise, wise_hn]:
        row = report["rows"][name]
        assert 0 <= row["in"]["mrr@10"] <= 1 and 0 <= row["ood"]["accuracy@5"] <= 1, name
    assert report["tests"]["+ 3 hard negatives"]["against"] == "README recipe"
    assert report["tests"][wise]["against"] == "README recipe"
    # The interpolated model sits between the start and the fine-tuned model (its own directory).
    assert (out / "wise-ft" / "readme-recipe-wise-ft-0-5" / "model.safetensors").is_file()
    text = (out / "report.md").read_text()
    assert "| BM25 |" in text and "| zero-shot MiniLM |" in text and "| + 3 hard negatives |" in text
    # The best model's first stages are written for a cross-encoder; its reranked runs become rows.
    stages = out / "first-stages"
    assert sorted(path.name for path in stages.iterdir()) == ["bm25.trec", "dense.trec", "pipeline.trec"]
    ce = tmp_path / "ce"
    CrossEncoder.new(str(tiny_model_dir), seed=1, max_length=48, device=torch.device("cpu"), precision="fp32").save(ce)
    for stage in ("bm25", "pipeline"):
        reranked = ["rerank", str(tiny_beir), str(stages / f"{stage}.trec"), "--model", str(ce), "--device", "cpu"]
        assert cli.main([*reranked, "--output", str(out / "reranked" / f"{stage}.trec")]) == 0
    done = recipe("--stage", "report", *common)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    reranked = [name for name in report["rows"] if "→ cross-encoder@" in name]
    assert len(reranked) == 8  # BM25, then the pipeline: reranked at 100 and 10, alone and fused
    pipeline = report["tests"][reranked[4]]["against"]  # the best model + BM25, linear
    assert pipeline in hybrids and "linear" in pipeline
    for first, names in (("BM25", reranked[:4]), (pipeline, reranked[4:])):
        for i, depth in enumerate((100, 10)):
            alone, fused = names[2 * i : 2 * i + 2]
            assert alone == f"{first} → cross-encoder@{depth}"
            assert fused.startswith(f"{alone}, fused with its first stage (weight ")
            assert report["tests"][alone]["against"] == first and report["tests"][fused]["against"] == first
    # A finished row is not run again.
    again = recipe("--stage", "train", "--only", "README recipe", *common)
    assert again.returncode == 0 and "done:" in again.stdout


def test_bad_arguments_are_one_line_errors(tmp_path):
    done = recipe_program("--train-queries", "0")  # the script as a program: its exit code and one line
    assert done.returncode == 2 and "--train-queries must be >= 1, got 0" in done.stderr
    done = recipe("--stage", "report", "--set", "train.batch_szie=3")
    assert done.returncode == 2
    assert done.stderr.strip().endswith("config.train: unknown key 'batch_szie' (did you mean 'batch_size'?)")
    done = recipe("--stage", "wise-ft", "--out", str(tmp_path / "out"))
    assert done.returncode == 2
    assert done.stderr.strip().endswith("row 'README recipe' has no model yet: run --stage train --only it first")
    assert not (tmp_path / "out").exists()  # nothing written


def load_driver(monkeypatch):
    monkeypatch.setattr(sys, "argv", [str(SCRIPT)])
    return script_module(SCRIPT)


def test_the_recommended_config_is_the_studys_recommended_run(monkeypatch):
    """configs/recommended.yaml trains exactly what the study measured as its best variant (all the training
    queries), and reports on the dev split's reporting part, as the study's report does."""
    driver = load_driver(monkeypatch)
    study = driver.row_config(driver.parse_args(), driver.DENSE, driver.ALL_QUERIES)
    shipped = load_config(str(SCRIPT.parent.parent / "configs" / "recommended.yaml"))
    where = {"name": "recommended", "output_dir": "outputs", "cache_dir": None}
    where["data"] = dataclasses.replace(study.data, eval_part="report")
    assert dataclasses.asdict(dataclasses.replace(study, **where)) == dataclasses.asdict(shipped)


def flat(values: dict, prefix: str = "") -> dict[str, object]:
    """A config as dotted keys (``reranker.distill.loss``) and their values."""
    out = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_each_ingredient_changes_only_its_own_keys(monkeypatch):
    """Every variant of the dense row loads (no key typo reaches a 20-minute run) and differs from the row in
    the settings it names, the half epoch resolved to steps."""
    driver = load_driver(monkeypatch)
    args = driver.parse_args()
    row = flat(dataclasses.asdict(driver.row_config(args, driver.DENSE)))
    half_epoch = row["data.max_train_queries"] // row["train.batch_size"] // 2
    for variant, keys in driver.VARIANTS.items():
        config = flat(dataclasses.asdict(driver.row_config(args, driver.DENSE, variant)))
        changed = {key for key, value in config.items() if "." in key and value != row[key]}  # not the run's name
        assert changed <= {key.split("=")[0] for key in keys}, variant
        assert changed, variant
    remine = driver.row_config(args, driver.DENSE, "re-mining every half epoch with the model being trained")
    assert remine.negatives.refresh_every == half_epoch == 128


def test_issue_55_levers_are_one_change_each_to_the_recommended_recipe(monkeypatch):
    """The levers of issue 55 (squad pairs mixed in, L2-SP, all training queries) differ from the recommended
    variant in their own setting only; all the queries re-mine every half of their longer epoch."""
    driver = load_driver(monkeypatch)
    args = driver.parse_args()
    recommended = flat(dataclasses.asdict(driver.row_config(args, driver.DENSE, driver.RECOMMENDED)))

    def changes(variant: str) -> dict[str, object]:
        config = flat(dataclasses.asdict(driver.row_config(args, driver.DENSE, variant)))
        return {key: value for key, value in config.items() if "." in key and value != recommended[key]}

    mix = {"name": "squad-v1.1-dev-split", "format": "squad", "split": "train", "fraction": 0.1}
    assert changes(driver.MIX_SQUAD) == {"data.mix": [mix]}
    assert changes(driver.L2SP) == {"train.l2sp": 0.5}
    assert changes(driver.ALL_QUERIES) == {"data.max_train_queries": 47732, "negatives.refresh_every": 745}
    assert changes(driver.ALL_QUERIES_TWO_EPOCHS) == {
        "data.max_train_queries": 47732,
        "train.epochs": 2,
        "negatives.refresh_every": 746,  # half of 1,491 steps, rounded up: none on the last steps
    }
    teacher = {
        "reranker.enabled": True,
        "reranker.name_or_path": "outputs/recipe/runs/recipe-teacher/reranker/model",
        "reranker.train.enabled": False,
        "reranker.first_stages": [],
    }
    kl = {"reranker.distill.loss": "kl", "reranker.distill.contrastive": True}
    assert changes(driver.DISTILL_KL) == {**teacher, **kl}
    assert changes(driver.DISTILL_MARGIN_MSE) == {**teacher, "reranker.distill.loss": "margin-mse"}
    assert changes(driver.DENOISED) == {
        "negatives.filters": ["qrels", "answers", "relative-margin"],
        "negatives.cross_encoder": teacher["reranker.name_or_path"],
        "negatives.filter_precision": "auto",
        "negatives.relative_activation": "exp",
    }
    assert changes(driver.DENOISED_BI) == {
        "negatives.filters": ["qrels", "answers", "relative-margin"],
        "negatives.relative_teacher": "bi-encoder",
    }
    assert changes(driver.PRETRAINED) == {"model.name_or_path": "outputs/recipe/runs/recipe-pretrain/backbone"}


def test_every_variant_evaluates_on_the_parts_of_dev(monkeypatch):
    """The evaluation-only config of each variant's model on a part of dev passes the pipeline's checks: settings
    that only shape training (squad pairs mixed in, L2-SP) do not stop its evaluation."""
    from densepass.pipelines.experiment import check

    driver = load_driver(monkeypatch)
    args = driver.parse_args()
    for variant in driver.VARIANTS:
        trained = driver.row_config(args, driver.DENSE, variant)
        for part in ("tune", "report"):
            config = driver.part_config(args, trained, variant, "some/model", part)
            assert not config.train.enabled and not config.data.mix
            check(config)


@pytest.mark.parametrize(
    ("variant", "needs"),
    [
        ("recommended + distilled from the teacher, Margin-MSE", "the teacher model in"),
        (
            "recommended from MiniLM pre-trained on the corpus (Contriever crops, 2,000 steps)",
            "the pretrained model in",
        ),
    ],
)
def test_a_variant_that_needs_a_model_before_it_is_made_is_one_line(tmp_path, variant, needs):
    result = recipe("--out", str(tmp_path), "--stage", "variant", "--variants", "lr 2e-5", variant)
    assert result.returncode == 2 and needs in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "runs").exists()


def test_levers_are_tested_against_the_recommended_recipe_and_a_variant_gets_wise_ft_points(
    tiny_beir, tiny_model_dir, tmp_path
):
    """With ``--eval-part report``: an issue-55 lever is tested against the recommended variant (not its row, absent
    here); ``--wise-ft-variant`` interpolates a variant's fine-tuned weights, its α chosen on the tuning part among
    its points and the variant's own wise-ft; the best model's first stages are written though no row is on disk."""
    driver = script_module(SCRIPT)
    assert set(driver.LEVERS) <= set(driver.VARIANTS) and driver.RECOMMENDED not in driver.LEVERS
    assert driver.tested_against(driver.DENSE, "2 epochs") == driver.DENSE
    squad = write_phrase_squad(tmp_path / "squad")
    out = tmp_path / "out"
    sets = [f"data.name={tiny_beir}", f"model.name_or_path={tiny_model_dir}", f"negatives.model={tiny_model_dir}"]
    sets += ["model.passage_max_length=32", "train.passage_max_length=24", "train.batch_size=8"]
    sets += ["negatives.pool_depth=5", "eval.depth=20", "data.max_train_queries=24"]
    ood = [f"data.name={squad}", "model.passage_max_length=32"]
    arguana = [f"data.name={tiny_beir}", "data.eval_split=dev", "model.query_max_length=32"]
    arguana += ["model.passage_max_length=32"]
    common = ["--out", str(out), "--train-queries", "24", "--eval-queries", "12", "--eval-part", "report"]
    common += [a for s in sets for a in ("--set", s)] + [a for s in ood for a in ("--ood-set", s)]
    common += [a for s in arguana for a in ("--arguana-set", s)]
    common += ["--variant-row", driver.DENSE]
    lever = driver.ALL_QUERIES
    done = recipe("--stage", "variant", "--variants", driver.RECOMMENDED, lever, *common)
    assert done.returncode == 0, done.stderr[-3000:]
    done = recipe("--stage", "wise-ft", "--wise-ft-variant", lever, "--alphas", "0.5", "1.0", *common)
    assert done.returncode == 0, done.stderr[-3000:]
    done = recipe("--stage", "report", *common)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    recommended, tried = (driver.variant_name(driver.DENSE, v) for v in (driver.RECOMMENDED, lever))
    assert report["tests"][tried]["against"] == recommended
    for alpha in ("0.5", "1"):
        assert report["tests"][f"{tried}, wise-ft α={alpha}"]["against"] == tried
    choice = report["choices"][f"wise-ft α of {tried}"]
    points = {tried: 0.85, f"{tried}, wise-ft α=0.5": 0.5, f"{tried}, wise-ft α=1": 1.0}  # its own model: α 0.85
    assert choice["alpha"] == points[choice["chosen"]]
    assert choice["tune mrr@10"] == max(report["rows"][name]["tune"]["mrr@10"] for name in points)
    # a variant's points are evaluated on the parts of dev, as the variant is: without --eval-part report, a usage error
    assert recipe("--stage", "wise-ft", "--wise-ft-variant", lever, "--out", str(tmp_path / "x")).returncode == 2
    # α = 1 is the weights the lever saved before its own wise-ft
    from densepass.models.biencoder import BiEncoder

    tuned = BiEncoder.from_pretrained(str(out / "runs" / driver.slug(tried) / "model-fine-tuned")).state_dict()
    one = BiEncoder.from_pretrained(str(out / "wise-ft" / driver.slug(f"{tried}, wise-ft α=1"))).state_dict()
    assert all(torch.equal(tuned[k], one[k]) for k in tuned)
    assert sorted(p.name for p in (out / "first-stages").iterdir()) == ["bm25.trec", "dense.trec", "pipeline.trec"]
