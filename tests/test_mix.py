"""General-domain pairs mixed into the batches (data.mix): each batch ends with its share of another dataset's
pairs, drawn once per pass in a seeded order by step (the same after a resume), their false negatives masked by
content; the run counts them; the combinations it cannot support are refused in one line before any work."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import interrupted_at_step, small_run_overrides
from densepass.config import MixConfig, ScheduleConfig, TrainConfig, load_config
from densepass.data import load_dataset
from densepass.errors import ConfigError, DensepassError
from densepass.models.biencoder import BiEncoder
from densepass.pipelines.experiment import run_experiment
from densepass.pipelines.training import check_mix, load_mix, mixed_counts
from densepass.training.batches import TrainingData
from densepass.training.trainer import train
from phrase_fixtures import write_phrase_squad

CPU = torch.device("cpu")


@pytest.fixture
def squad(tmp_path):
    return write_phrase_squad(tmp_path / "squad")


def _data(beir_dir, squad_dir, per_query=1, per_batch=2, seed=5):
    dataset = load_dataset(str(beir_dir))
    data = TrainingData(
        dataset, "train", "[SEP]", {q: list(dataset.corpus.ids[::3]) for q in dataset.queries}, per_query
    )
    mixed = load_dataset(str(squad_dir), format="squad")
    data.add_mix(mixed, "train", per_batch, seed)
    return data, mixed


def test_each_batch_ends_with_its_share_of_mixed_pairs_each_drawn_once_per_pass(tiny_beir, squad):
    data, mixed = _data(tiny_beir, squad, per_batch=3)
    source = data.mix[0]
    questions = mixed.positives("train")
    n = len(questions)
    assert data.mixed_per_batch == 3 and len(source.query_texts) == n
    steps = -(-n // 3) * 2  # two passes over the mixed queries
    drawn = [i for step in range(steps) for i in source.members(step)]
    assert sorted(drawn[:n]) == list(range(n)) and sorted(drawn[n : 2 * n]) == list(range(n))
    assert drawn[:n] != drawn[n : 2 * n]  # a new order each pass
    again, _ = _data(tiny_beir, squad, per_batch=3)  # the same seed and step: the same pairs, as after a resume
    assert [again.mix[0].members(s) for s in range(steps)] == [source.members(s) for s in range(steps)]

    batch = data.collate([0, 1, 2, 3], seed=(1, 0, 7), step=7)
    main_queries = [data.query_texts[i] for i in range(4)]
    assert batch.query_texts[:4] == main_queries
    assert batch.query_texts[4:] == [source.query_texts[i] for i in source.members(7)]
    # each mixed query's positive is its paragraph, in the positives' columns after the main ones
    by_text = {mixed.queries[q]: mixed.corpus.texts[mixed.corpus.position(p[0])] for q, p in questions.items()}
    for j, question in enumerate(batch.query_texts[4:], start=4):
        assert by_text[question] in batch.passage_texts[j]
    assert len(batch.passage_texts) == 7 * 2  # 7 positives, one hard negative each
    assert batch.mask.shape == (7, 14)
    # a mixed query's negatives: every other column but duplicates and what is relevant to it
    for j in range(4, 7):
        masked = batch.mask[j].nonzero().flatten().tolist()
        for col in masked:
            key = int(batch.passage_keys[col])
            assert key in batch.relevant_keys[j] or key in batch.passage_keys[:col].tolist()


def test_a_mixed_querys_negatives_are_never_its_own_positive(tiny_beir, squad):
    """Mixed queries draw their negatives among the mixed positives: never one relevant to the query by content (a
    cross-encoder, masking nothing, would learn its positive as a negative; with 4 mixed pairs a draw hit it 1 in 4)."""
    data, _ = _data(tiny_beir, squad, per_query=2, per_batch=2)
    source = data.mix[0]
    for step in range(40):
        batch = data.collate([0, 1], seed=(3, 0, step), step=step)
        n = len(batch.query_texts)
        negatives = batch.passage_keys[n:].tolist()
        for j, i in enumerate(source.members(step), start=2):
            own = negatives[2 * j : 2 * j + 2]
            assert not set(own) & source.relevant_keys[i]


def test_the_batch_splits_over_processes_with_the_mixed_pairs(tiny_beir, squad):
    data, _ = _data(tiny_beir, squad, per_batch=2)
    whole = data.collate([0, 1, 2, 3], seed=(1, 0, 0), step=0)
    halves = [data.collate([0, 1, 2, 3], seed=(1, 0, 0), rank=r, world=2, step=0) for r in range(2)]
    assert halves[0].query_texts + halves[1].query_texts == whole.query_texts
    assert torch.equal(halves[1].mask, whole.mask)
    with pytest.raises(ConfigError, match="global batch of 5 does not split over 2"):
        data.collate([0, 1, 2], seed=(1, 0, 0), world=2, step=0)


def _config(**kw):
    base = dict(epochs=1, batch_size=6, learning_rate=1e-3, warmup_ratio=0.0, checkpoint_every=2, log_every=1, seed=3)
    return TrainConfig(**{**base, "cpu_bf16": False, "keep_checkpoints": 5, **kw})


def test_a_run_with_mixed_pairs_logs_them_and_resumes_exactly(tiny_model_dir, tiny_beir, squad, tmp_path):
    data, _ = _data(tiny_beir, squad, per_batch=2)
    full = BiEncoder.from_pretrained(str(tiny_model_dir))
    result = train(full, data, _config(), tmp_path / "full", CPU)
    assert result.steps == 31 // 4  # the planner plans the 4 main queries of each batch of 6
    records = [json.loads(line) for line in result.log_path.read_text().splitlines()]
    assert all(r["mixed_queries"] == 2.0 for r in records)

    with interrupted_at_step(4):
        train(BiEncoder.from_pretrained(str(tiny_model_dir)), data, _config(), tmp_path / "resumed", CPU)
    resumed = BiEncoder.from_pretrained(str(tiny_model_dir))
    train(resumed, data, _config(), tmp_path / "resumed", CPU)
    params = lambda m: torch.cat([p.detach().flatten() for p in m.parameters()])  # noqa: E731
    assert torch.equal(params(resumed), params(full))


def test_what_mixing_cannot_support_is_one_line():
    mix = [MixConfig(fraction=0.5), MixConfig(fraction=0.5)]
    assert mixed_counts(mix, 6) == [3, 3] and mixed_counts([MixConfig(fraction=0.01)], 6) == [1]
    with pytest.raises(ConfigError, match="takes 6 of every batch's 6 queries"):
        check_mix(mix, TrainConfig(batch_size=6), ScheduleConfig(), False)
    with pytest.raises(ConfigError, match="schedule.method abs-greedy"):
        check_mix([MixConfig()], TrainConfig(), ScheduleConfig(method="abs-greedy"), False)
    with pytest.raises(ConfigError, match="distillation"):
        check_mix([MixConfig()], TrainConfig(), ScheduleConfig(), True)
    check_mix([], TrainConfig(batch_size=1), ScheduleConfig(method="abs-beam"), True)  # nothing mixed: nothing to check


def test_a_run_mixes_counts_and_refuses_a_missing_dataset_before_writing(tiny_model_dir, tiny_beir, squad, tmp_path):
    overrides = small_run_overrides(tiny_beir, tiny_model_dir, tmp_path / "out", "mixed")
    overrides += ["train.batch_size=6", "train.max_steps=3", "train.cpu_bf16=false", "negatives.source=none"]
    mix = f"data.mix=[{{name: {squad}, format: squad, split: train, fraction: 0.34}}]"
    with pytest.raises(DensepassError, match="nowhere"):
        run_experiment(load_config(None, [*overrides, mix.replace(str(squad), str(tmp_path / "nowhere"))]))
    assert not (tmp_path / "out" / "mixed").exists()
    with pytest.raises(ConfigError, match="data.mix mixes pairs into the training batches: it needs train.enabled"):
        run_experiment(load_config(None, [*overrides, mix, "train.enabled=false"]))
    with pytest.raises(ConfigError, match="data.mix does not combine with schedule.method clustered"):
        run_experiment(load_config(None, [*overrides, mix, "schedule.method=clustered"]))
    run_experiment(load_config(None, [*overrides, mix]))
    metrics = json.loads((tmp_path / "out" / "mixed" / "metrics.json").read_text())
    note = next(n for n in metrics["notes"] if n.startswith("Mixed into each batch of 6"))
    assert "2 from squad (train) (6 pairs over the run" in note, note
    assert load_mix([], None) == []
    # a changed mix dataset file: the run's checkpoints are refused in one line naming it, before any work
    train_file = squad / "train-v1.1.json"
    rows = json.loads(train_file.read_text())
    rows["version"] = "changed"
    train_file.write_text(json.dumps(rows))
    with pytest.raises(ConfigError, match=r"squad/train-v1\.1\.json changed since its checkpoint step-") as refused:
        run_experiment(load_config(None, [*overrides, mix]))
    assert "\n" not in str(refused.value)


def test_the_python_api_mixes_pairs_like_a_run_and_its_identity_names_them(tiny_model_dir, tiny_beir, squad, tmp_path):
    import densepass as dp

    def call(mix, **kw):
        model = dp.BiEncoder.from_pretrained(str(tiny_model_dir))
        args = dp.TrainConfig(batch_size=6, max_steps=2, cpu_bf16=False)
        negatives = dp.NegativesConfig(source="none")
        return dp.train(
            model, str(tiny_beir), output_dir=tmp_path / "api", negatives=negatives, args=args, mix=mix, **kw
        )

    mix = [dp.MixConfig(name=str(squad), format="squad", fraction=0.34)]
    out = call(mix)
    assert out.log and all(r["mixed_queries"] == 2.0 for r in out.log)
    written = sorted(p.relative_to(tmp_path) for p in (tmp_path / "api").rglob("*"))
    with pytest.raises(ConfigError, match="takes 10 of every batch's 6"):  # before restart removes anything
        call([MixConfig(name=str(squad), format="squad", fraction=0.9)] * 2, restart=True)
    assert sorted(p.relative_to(tmp_path) for p in (tmp_path / "api").rglob("*")) == written
    other = [MixConfig(name=str(squad), format="squad", fraction=0.17)]
    with pytest.raises(DensepassError, match="holds a run with other settings .*mix"):  # other mixed pairs: not resumed
        call(other)
    assert all(r["mixed_queries"] == 1.0 for r in call(other, restart=True).log)
