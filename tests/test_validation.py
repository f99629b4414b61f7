"""Validation subcorpora (C0, R_r, H_k), best-checkpoint selection and the validate-study ordering."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import small_run_overrides
from densepass.config import ValidationConfig, load_config
from densepass.data import load_dataset
from densepass.errors import ConfigError, DataError
from densepass.evaluation.metrics import evaluate_run, make_run
from densepass.evaluation.subcorpus import Subcorpus, gold_subcorpus, hard_subcorpus, random_subcorpus
from densepass.models.biencoder import BiEncoder
from densepass.models.encode import encode_texts
from densepass.pipelines.experiment import run_experiment
from densepass.pipelines.study import StudySettings, checkpoint_name, expand_checkpoints, ordering_agreement, run_study
from densepass.pipelines.validation import Validator, bm25_retriever

SETTINGS = StudySettings(rs=[0.5], ks=[2], seed=0)


@pytest.fixture
def data(tiny_beir):
    dataset = load_dataset(str(tiny_beir))
    return dataset, dataset.split("dev")


def test_subcorpora_nest_and_sizes(data):
    dataset, qrels = data
    corpus = dataset.corpus
    c0 = set(gold_subcorpus(corpus, qrels).ids)
    assert c0 == {p for rels in qrels.values() for p in rels}
    for r in (0.3, 0.5, 1.0):
        sub = random_subcorpus(corpus, qrels, r, seed=1)
        assert c0 <= set(sub.ids) <= set(corpus.ids)
        assert len(sub) == max(len(c0), round(r * len(corpus)))
        assert sub.ids == random_subcorpus(corpus, qrels, r, seed=1).ids  # seeded
    assert random_subcorpus(corpus, qrels, 0.5, seed=1).ids != random_subcorpus(corpus, qrels, 0.5, seed=2).ids
    assert len(random_subcorpus(corpus, qrels, 0.01)) == len(c0)  # never smaller than C0


def test_hard_subcorpus_contains_retriever_top_k(data):
    dataset, qrels = data
    corpus = dataset.corpus
    texts = [dataset.queries[q] for q in qrels]
    retriever = bm25_retriever(corpus)
    sub = hard_subcorpus(corpus, qrels, texts, 3, retriever, "bm25")
    top = {corpus.ids[r] for r in retriever(texts, 3).ravel()}
    assert set(gold_subcorpus(corpus, qrels).ids) <= set(sub.ids)
    assert top <= set(sub.ids)
    assert set(sub.ids) == top | set(gold_subcorpus(corpus, qrels).ids)
    assert sub.provenance == {"k": 3, "retriever": "bm25", "queries": len(qrels)}


def test_subcorpus_errors_and_round_trip(data, tmp_path):
    dataset, qrels = data
    for r in (0, -0.1, 1.5):
        with pytest.raises(ConfigError, match=r"\(0, 1\]"):
            random_subcorpus(dataset.corpus, qrels, r)
    with pytest.raises(ConfigError, match="k must be >= 1"):
        hard_subcorpus(dataset.corpus, qrels, ["q"] * len(qrels), 0, lambda q, k: np.zeros((len(q), 0)), "x")
    sub = random_subcorpus(dataset.corpus, qrels, 0.5)
    sub.save(tmp_path / "s.json")
    assert Subcorpus.load(tmp_path / "s.json") == sub
    with pytest.raises(DataError, match="not found"):
        Subcorpus.load(tmp_path / "missing.json")


def test_kendall_tau_on_hand_orderings():
    assert ordering_agreement([0.1, 0.2, 0.3], [1, 2, 3]) == pytest.approx(1.0)
    assert ordering_agreement([0.3, 0.2, 0.1], [1, 2, 3]) == pytest.approx(-1.0)
    # one discordant pair of three: (concordant - discordant) / pairs = (2 - 1) / 3
    assert ordering_agreement([0.1, 0.3, 0.2], [1, 2, 3]) == pytest.approx(1 / 3)


def test_best_checkpoint_is_the_argmax(data, tiny_model_dir, tmp_path, monkeypatch):
    dataset, _ = data
    model = BiEncoder.from_pretrained(str(tiny_model_dir))
    config = ValidationConfig(enabled=True, subcorpus="random", r=0.5, every_steps=2, metric="mrr@10")
    validator = Validator(config, dataset, model, model.query_encoder.device, tmp_path, ["mrr@10"])
    values = iter([0.2, 0.5, 0.4, 0.1])
    saved_at = []
    monkeypatch.setattr(Validator, "evaluate", lambda self: {"mrr@10": next(values)})
    monkeypatch.setattr(BiEncoder, "save", lambda self, path: saved_at.append(step))
    for step in range(1, 9):
        validator(step)
    best = {"step": 4, "metric": "mrr@10", "score": 0.5, "subcorpus": "R_0.5"}
    assert json.loads((tmp_path / "best.json").read_text()) == best
    assert saved_at == [2, 4]
    log = [json.loads(line) for line in (tmp_path / "validation_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [2, 4, 6, 8] and log[0]["subcorpus"] == "R_0.5"


def test_a_resumed_validation_keeps_its_best_only_for_the_same_metric_and_subcorpus(data, tiny_model_dir, tmp_path):
    """best.json of another validation metric (recall@100's 0.9) was kept on a resume: mrr@10 never beat it, and
    the model it chose was the one restored."""
    dataset, _ = data
    model = BiEncoder.from_pretrained(str(tiny_model_dir))
    (tmp_path / "best.json").write_text(json.dumps({"step": 2, "metric": "recall@100", "score": 0.9}))
    config = ValidationConfig(enabled=True, subcorpus="random", r=0.5, every_steps=2, metric="mrr@10")
    assert Validator(config, dataset, model, model.query_encoder.device, tmp_path, ["mrr@10"]).best == float("-inf")
    (tmp_path / "best.json").write_text(json.dumps({"step": 2, "metric": "mrr@10", "score": 0.3, "subcorpus": "R_0.5"}))
    assert Validator(config, dataset, model, model.query_encoder.device, tmp_path, ["mrr@10"]).best == 0.3


def test_validation_logs_the_ranking_metrics_of_the_evaluation_as_deep_as_their_cutoffs(data, tiny_model_dir, tmp_path):
    """eval.metrics with accuracy@k stopped a run at its first validation (validation reads no answers); a cutoff
    past the top 100 (recall@1000) was computed on the top 100; validation.metric accuracy@k is one line."""
    dataset, _ = data
    model = BiEncoder.from_pretrained(str(tiny_model_dir))
    config = ValidationConfig(enabled=True, subcorpus="random", r=0.5, every_steps=2, metric="mrr@10")
    validator = Validator(config, dataset, model, model.query_encoder.device, tmp_path, ["accuracy@20", "recall@1000"])
    assert validator.depth == 1000 and set(validator.evaluate()) == {"recall@1000", "mrr@10"}
    with pytest.raises(ConfigError, match="validation has no answer strings"):
        Validator(ValidationConfig(enabled=True, metric="accuracy@5"), dataset, model, model.query_encoder.device,
                  tmp_path, ["mrr@10"])  # fmt: skip


def test_the_last_step_is_validated_for_selection_and_excluded_queries_never_validate(
    data, tiny_model_dir, tmp_path, monkeypatch
):
    dataset, _ = data
    model = BiEncoder.from_pretrained(str(tiny_model_dir))
    train = sorted(dataset.split("train"))
    config = ValidationConfig(enabled=True, split="train", subcorpus="gold", every_steps=4)
    validator = Validator(config, dataset, model, model.query_encoder.device, tmp_path, ["mrr@10"], train[:-3])
    assert sorted(validator.qrels) == train[-3:]  # only the queries not trained on
    values = iter([0.3, 0.6])
    monkeypatch.setattr(Validator, "evaluate", lambda self: {"mrr@10": next(values)})
    monkeypatch.setattr(BiEncoder, "save", lambda self, path: None)
    for step in range(1, 7):
        validator(step)
    best = {"step": 6, "metric": "mrr@10", "score": 0.6, "subcorpus": validator.subcorpus.label}
    assert validator.best_after(6) == best  # step 6 was not due
    assert validator.best_after(8) == best  # due at 8: not validated again
    assert [json.loads(x)["step"] for x in (tmp_path / "validation_log.jsonl").read_text().splitlines()] == [4, 6]


def test_a_run_with_selection_evaluates_and_saves_the_best_validated_weights(
    tiny_beir, tiny_model_dir, tmp_path, monkeypatch
):
    scores = iter([0.9, 0.1])  # step 4 validates best, the last step (6) worse
    monkeypatch.setattr(Validator, "evaluate", lambda self: {"mrr@10": next(scores)})
    overrides = [
        *small_run_overrides(tiny_beir, tiny_model_dir, tmp_path, "s"),
        "data.max_train_queries=24",
        "train.batch_size=4",
        "train.learning_rate=1e-3",
        "validation.enabled=true",
        "validation.split=train",
        "validation.subcorpus=gold",
        "validation.every_steps=4",
        "validation.select=true",
    ]
    results = run_experiment(load_config(None, overrides))
    run_dir = tmp_path / "s"
    best = json.loads((run_dir / "best.json").read_text())
    log = [json.loads(x) for x in (run_dir / "validation_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [4, 6]  # every 4 steps, and the last (6) for the selection
    assert best == {"step": 4, "metric": "mrr@10", "score": 0.9, "subcorpus": "C0"}
    chosen = BiEncoder.from_pretrained(str(run_dir / "model")).state_dict()
    kept = BiEncoder.from_pretrained(str(run_dir / "best-model")).state_dict()
    last = BiEncoder.from_pretrained(str(run_dir / "checkpoints" / "step-6" / "model")).state_dict()
    for name, tensor in kept.items():
        assert torch.equal(chosen[name], tensor), name
    name = "query_encoder.encoder.layer.0.attention.self.query.weight"
    assert not torch.equal(chosen[name], last[name])  # not the last step's weights
    with pytest.raises(ConfigError, match="validation.select needs validation.enabled: true"):
        run_experiment(load_config(None, [*overrides, "validation.enabled=false"]))
    notes = json.loads((run_dir / "metrics.json").read_text())["notes"]
    assert any(f"the model is the step-{best['step']} weights" in note for note in notes)
    assert "fine-tuned" in results


def test_validate_study_end_to_end(data, tiny_model_dir, tmp_path, monkeypatch):
    dataset, _ = data
    import torch

    paths = []
    for i in range(3):  # three checkpoints of different (random) quality
        model = BiEncoder.from_pretrained(str(tiny_model_dir))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * i * torch.randn_like(p))
        model.save(tmp_path / f"m{i}")
        paths.append(str(tmp_path / f"m{i}"))
    rows = run_study(dataset, expand_checkpoints(paths), SETTINGS, tmp_path / "study")
    assert [r.subcorpus.label for r in rows] == ["C0", "R_0.5", "H_2", "C"]
    # Reference: each checkpoint evaluated on each subcorpus encoded on its own (the study slices C's embeddings).
    qrels = {q: r for q, r in dataset.split("dev").items() if any(g > 0 for g in r.values())}
    texts = [dataset.queries[q] for q in qrels]
    for j, path in enumerate(paths):
        model = BiEncoder.from_pretrained(path)
        for row in rows:
            passages = dataset.corpus.subset([dataset.corpus.position(p) for p in row.subcorpus.ids])
            p = encode_texts(model, passages.passage_inputs(model.tokenizer.sep_token), "passage", show_progress=False)
            q = encode_texts(model, texts, "query", show_progress=False)
            full = q @ p.T  # brute force, every passage
            hits = np.argsort(-full, axis=1, kind="stable")[:, :100]
            top = np.take_along_axis(full, hits, axis=1)
            direct = evaluate_run(qrels, make_run(list(qrels), passages.ids, top, hits), ["mrr@10"])["mrr@10"]
            assert row.scores[j] == pytest.approx(direct, abs=1e-9)
    assert all(r.seconds > 0 for r in rows)
    assert json.loads((tmp_path / "study" / "study.json").read_text())["direct_vs_sliced_max_diff"] < 1e-9

    # Resuming: saved checkpoint results are reused, not recomputed; a reordered list recomputes the new first one.
    import densepass.pipelines.study as study

    evaluated = []
    original = study._evaluate_checkpoint
    monkeypatch.setattr(
        study, "_evaluate_checkpoint", lambda path, *a, **kw: evaluated.append(path) or original(path, *a, **kw)
    )
    again = run_study(dataset, expand_checkpoints(paths), SETTINGS, tmp_path / "study")
    assert evaluated == [] and [r.scores for r in again] == [r.scores for r in rows]
    run_study(dataset, expand_checkpoints(paths[::-1]), SETTINGS, tmp_path / "study")
    assert [p.name for p in evaluated] == ["m2", "m0"]  # m1 kept its position, so its saved result is reused
    (tmp_path / "study" / "checkpoints" / "01-m1.json").write_text("{not json")  # a damaged file is recomputed
    run_study(dataset, expand_checkpoints(paths[::-1]), SETTINGS, tmp_path / "study")
    assert [p.name for p in evaluated] == ["m2", "m0", "m1"]
    assert rows[-1].tau == pytest.approx(1.0) or np.isnan(rows[-1].tau)
    assert (tmp_path / "study" / "study.md").is_file() and (tmp_path / "study" / "study.png").is_file()
    with pytest.raises(ConfigError, match="at least 2"):
        expand_checkpoints(paths[:1])

    # A stand-in C (C0 + half the corpus): every subcorpus is drawn from it, and it is recorded as such.
    rows = run_study(
        dataset,
        expand_checkpoints(paths),
        StudySettings(rs=[0.5], ks=[2], seed=0, corpus_fraction=0.5),
        tmp_path / "study-half",
    )
    full = rows[-1].subcorpus
    assert full.provenance["stand_in_for_full_corpus"] and full.provenance["r"] == 0.5
    assert len(full) == max(len(rows[0].subcorpus), round(0.5 * len(dataset.corpus)))
    assert all(set(row.subcorpus.ids) <= set(full.ids) for row in rows)
    assert len(rows[1].subcorpus) == max(len(rows[0].subcorpus), round(0.5 * len(full)))
    with pytest.raises(ConfigError, match=r"corpus fraction must be in \(0, 1\]"):
        StudySettings(rs=[], ks=[], corpus_fraction=1.5)


def test_checkpoint_names_and_the_default_model():
    from pathlib import Path

    assert checkpoint_name(Path("runs/abs/non-abs-random/model")) == "non-abs-random"
    assert checkpoint_name(Path("runs/abs/non-abs-random/checkpoints/step-32/model")) == "non-abs-random@32"
    assert checkpoint_name(Path("/models/m1")) == "m1"
    with pytest.raises(ConfigError, match="given twice"):
        expand_checkpoints(["all-MiniLM-L6-v2", "all-MiniLM-L6-v2"])


def test_a_study_recomputes_a_checkpoint_saved_again_at_the_same_path(tiny_beir, tiny_model_dir, tmp_path):
    """Saved results are keyed by the checkpoint's content, not its path."""
    dataset = load_dataset(str(tiny_beir))
    paths = []
    for i in range(2):
        model = BiEncoder.from_pretrained(str(tiny_model_dir))
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * i * torch.randn_like(p))
        model.save(tmp_path / f"m{i}")
        paths.append(str(tmp_path / f"m{i}"))
    settings = StudySettings(rs=[0.5], ks=[], seed=0)
    first = run_study(dataset, expand_checkpoints(paths), settings, tmp_path / "study")
    other = BiEncoder.from_pretrained(str(tiny_model_dir))
    with torch.no_grad():
        torch.manual_seed(5)
        for p in other.parameters():
            p.add_(0.5 * torch.randn_like(p))  # another model, saved where m0 was
    other.save(tmp_path / "m0")
    again = run_study(dataset, expand_checkpoints(paths), settings, tmp_path / "study")
    direct = run_study(dataset, expand_checkpoints(paths), settings, tmp_path / "fresh")
    assert [r.scores for r in again] == [r.scores for r in direct]
    assert [r.scores[0] for r in again] != [r.scores[0] for r in first]


def test_a_study_recomputes_when_the_passages_change_under_the_same_ids(tiny_model_dir, tmp_path):
    """Saved checkpoint scores are keyed by the study's content: other passage texts under the same ids are
    another study (its saved scores were reused)."""
    from conftest import write_tiny_beir

    settings = StudySettings(rs=[0.5], ks=[], seed=0)
    other = BiEncoder.from_pretrained(str(tiny_model_dir))
    with torch.no_grad():
        torch.manual_seed(5)
        for p in other.parameters():
            p.add_(0.05 * torch.randn_like(p))
    other.save(tmp_path / "m1")
    paths = expand_checkpoints([str(tiny_model_dir), str(tmp_path / "m1")])
    first = run_study(load_dataset(str(write_tiny_beir(tmp_path / "a", seed=0))), paths, settings, tmp_path / "s")
    changed = write_tiny_beir(tmp_path / "b", seed=0)
    records = [json.loads(line) for line in (changed / "corpus.jsonl").read_text().splitlines()]
    shuffled = [{**r, "text": records[(i + 7) % len(records)]["text"]} for i, r in enumerate(records)]
    (changed / "corpus.jsonl").write_text("".join(json.dumps(r) + "\n" for r in shuffled))
    again = run_study(load_dataset(str(changed)), paths, settings, tmp_path / "s")
    fresh = run_study(load_dataset(str(changed)), paths, settings, tmp_path / "fresh")
    assert [r.scores for r in again] == [r.scores for r in fresh] != [r.scores for r in first]


def test_a_study_metric_deeper_than_100_is_of_a_ranking_that_deep(tmp_path, tiny_model_dir):
    """The study searched every subcorpus for its top 100 whatever the metric: recall@300 of a 300-passage corpus,
    where every passage is retrieved, came out 0.1-0.3."""
    from conftest import save_tiny_bert, write_tiny_beir
    from densepass.pipelines.study import validate_study

    data = write_tiny_beir(tmp_path / "data", n_passages=300)
    other = save_tiny_bert(tmp_path / "other", seed=1)
    settings = StudySettings(rs=(0.5,), ks=(), metric="recall@300", max_queries=10)
    rows = validate_study(str(data), [tiny_model_dir, other], tmp_path / "out", settings)
    full = [row for row in rows if len(row.subcorpus) == 300]
    assert full and all(score == 1.0 for row in full for score in row.scores)


@pytest.mark.parametrize("every", [1, 3])  # the run has 4 steps: 3 validates its last step apart
def test_a_resumed_run_validates_each_step_once_in_its_log(tiny_beir, tiny_model_dir, tmp_path, every):
    """validation_log.jsonl was never trimmed: the steps trained again after a resume were logged twice, and every
    re-run of a finished run validated its last step again."""
    from conftest import interrupted_at_step

    def run(name):
        extra = ["validation.enabled=true", f"validation.every_steps={every}", "validation.split=dev"]
        extra += ["train.batch_size=8"]
        extra += ["train.epochs=2", "train.checkpoint_every=2", "validation.subcorpus=full"]
        config = load_config(None, [*small_run_overrides(tiny_beir, tiny_model_dir, tmp_path, name), *extra])
        return run_experiment(config)

    run("straight")
    with interrupted_at_step(4):
        run("resumed")
    run("resumed")
    run("resumed")  # finished: nothing trained, nothing validated again

    def steps(name):
        lines = (tmp_path / name / "validation_log.jsonl").read_text().splitlines()
        return [json.loads(line)["step"] for line in lines]

    assert steps("resumed") == steps("straight") and len(set(steps("straight"))) == len(steps("straight"))


def test_resuming_a_selecting_run_with_other_validation_settings_is_refused(tiny_beir, tiny_model_dir, tmp_path):
    """validation.select picks the saved model, yet its settings were not in the run's identity: a resume with
    another query sample mixed two samples' scores and saved another step's model."""
    from conftest import interrupted_at_step

    def run(seed, restart=False):
        extra = ["validation.enabled=true", "validation.select=true", "validation.every_steps=1", "train.batch_size=8"]
        extra += ["validation.split=dev", "validation.max_queries=2", f"validation.seed={seed}", "train.epochs=2"]
        extra += ["train.checkpoint_every=2", "validation.subcorpus=full"]
        config = load_config(None, [*small_run_overrides(tiny_beir, tiny_model_dir, tmp_path, "r"), *extra])
        return run_experiment(config, restart=restart)

    with interrupted_at_step(4):
        run(seed=2)
    with pytest.raises(ConfigError, match=r"validation\.seed"):
        run(seed=1)
    run(seed=2)  # the same settings resume


def test_the_validation_retriever_is_checked_before_any_work(tiny_model_dir, tmp_path):
    """A retriever that is neither bm25 nor a model was loaded only once training had started (after mining, and
    after ~30 s of Hub retries for a name such as BM25)."""
    from densepass.pipelines.experiment import check

    base = ["device=cpu", f"output_dir={tmp_path}", "validation.enabled=true"]
    with pytest.raises(ConfigError, match=r"^validation\.retriever 'BM25': write bm25"):
        check(load_config(None, [*base, "validation.retriever=BM25"]))
    with pytest.raises(ConfigError, match=r"^validation\.retriever '/no/such/model' \(bm25 or a saved model\): model"):
        check(load_config(None, [*base, "validation.retriever=/no/such/model"]))
    check(load_config(None, [*base, f"validation.retriever={tiny_model_dir}"]))
    check(load_config(None, [*base, "validation.retriever=/no/such/model", "validation.subcorpus=gold"]))  # unused
    assert list(tmp_path.iterdir()) == []
