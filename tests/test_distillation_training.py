"""Distilling a teacher into the bi-encoder: each batch carries the teacher's scores of its queries' own
candidates, the objective reads the right columns, gradient caching gives the plain gradient, the
combined loss is contrastive + weight x distillation, and an interrupted run resumes exactly."""

from __future__ import annotations

import pytest
import torch

from conftest import interrupted_at_step
from densepass.config import TrainConfig
from densepass.data import load_dataset
from densepass.errors import ConfigError
from densepass.losses.contrastive import info_nce
from densepass.losses.listwise_kl import listwise_kl_loss
from densepass.losses.objectives import Distillation, InfoNCE, own_candidates
from densepass.models.biencoder import BiEncoder, BiEncoderConfig
from densepass.training.batches import TrainingData
from densepass.training.step import batch_tensors, forward_backward
from densepass.training.trainer import train

CPU = torch.device("cpu")


def teacher_of(dataset):
    """A made-up teacher: the score of (q, p) is a function of the two ids, so any pair can be looked up."""
    return {
        q: {p: float((int(q[1:]) * 7 + int(p[1:]) * 3) % 11) - 5.0 for p in dataset.corpus.ids} for q in dataset.queries
    }


def make_data(beir_dir, per_query=2, teacher=True):
    dataset = load_dataset(str(beir_dir))
    negatives = {q: list(dataset.corpus.ids[::3]) for q in dataset.queries}
    scores = teacher_of(dataset) if teacher else None
    return TrainingData(dataset, "train", "[SEP]", negatives, per_query, teacher_scores=scores), scores


def test_a_batch_carries_the_teacher_scores_of_each_querys_positive_and_drawn_negatives(tiny_beir):
    data, scores = make_data(tiny_beir, per_query=3)
    batch = data.collate([4, 0, 7], seed=(1, 0, 0))
    corpus, texts = data.dataset.corpus, data.passage_inputs
    teacher = batch.extras["teacher_scores"]
    assert teacher.shape == (3, 4)
    for j, i in enumerate([4, 0, 7]):
        qid = data.query_ids[i]
        own = [batch.passage_texts[j], *batch.passage_texts[3 + 3 * j : 3 + 3 * (j + 1)]]
        pids = [corpus.ids[texts.index(t)] for t in own]
        assert teacher[j].tolist() == [scores[qid][p] for p in pids]


def test_unscored_candidates_arrive_as_nan(tiny_beir):
    dataset = load_dataset(str(tiny_beir))
    negatives = {q: list(dataset.corpus.ids[::3]) for q in dataset.queries}
    only_positives = {q: {p: 1.0 for p in dataset.positives("train")[q]} for q in dataset.positives("train")}
    data = TrainingData(dataset, "train", "[SEP]", negatives, 2, teacher_scores=only_positives)
    teacher = data.collate([0, 1], seed=(1, 0, 0)).extras["teacher_scores"]
    assert teacher[:, 0].tolist() == [1.0, 1.0] and torch.isnan(teacher[:, 1:]).all()


def test_a_refreshed_pools_unscored_pairs_are_named_and_added_keeping_earlier_scores(tiny_beir):
    """``unscored`` names exactly the pool's pairs the teacher lacks; ``add_teacher_scores`` fills them, and a
    pair scored before keeps its first score."""
    dataset = load_dataset(str(tiny_beir))
    positives = dataset.positives("train")
    negatives = {q: list(dataset.corpus.ids[::3]) for q in dataset.queries}
    first = {q: {p: 1.0 for p in [*positives[q], *negatives[q][:2]]} for q in positives}
    data = TrainingData(dataset, "train", "[SEP]", negatives, 2, teacher_scores=first)
    new_pool = {q: list(dataset.corpus.ids[1::3]) + negatives[q][:2] for q in data.query_ids}
    missing = data.unscored(new_pool)
    assert missing == {q: [p for p in dataset.corpus.ids[1::3] if p not in first[q]] for q in data.query_ids}
    data.add_teacher_scores({q: {p: 2.0 for p in new_pool[q]} for q in data.query_ids})
    assert data.unscored(new_pool) == {}
    data.replace_negatives(new_pool, from_step=0)
    teacher = data.collate(list(range(len(data))), seed=(1, 0, 0), step=0).extras["teacher_scores"]
    assert not torch.isnan(teacher).any()
    q0 = data.query_ids[0]
    row = data._row(negatives[q0][0])
    assert data.teacher[0][row] == 1.0  # scored by the first pool: kept


def test_own_candidates_picks_each_querys_positive_then_its_negatives():
    scores = torch.arange(2 * 6, dtype=torch.float32).view(2, 6)  # 2 queries, 2 positives + 2 x 2 negatives
    assert own_candidates(scores, torch.tensor([0, 1])).tolist() == [[0, 2, 3], [7, 10, 11]]
    with pytest.raises(ConfigError, match="same number"):
        own_candidates(torch.zeros(2, 5), torch.tensor([0, 1]))


def _model(model_dir):
    return BiEncoder.from_pretrained(str(model_dir), config=BiEncoderConfig(pooling="cls", temperature=0.1))


def test_the_combined_loss_is_contrastive_plus_weight_times_kl(tiny_model_dir, tiny_beir):
    data, _ = make_data(tiny_beir)
    model = _model(tiny_model_dir)
    batch = data.collate(list(range(6)), seed=(1, 0, 0))
    tensors = batch_tensors(model, batch)
    with torch.no_grad():
        q = model(tensors.queries["input_ids"], tensors.queries["attention_mask"], "query")
        p = model(tensors.passages["input_ids"], tensors.passages["attention_mask"], "passage")
        combined = Distillation("kl", 0.3, 2.0, InfoNCE())(model, q, p, tensors)
        scores = q @ p.T / 0.1
        expected = info_nce(scores, tensors.positive_index, tensors.mask) + 0.3 * listwise_kl_loss(
            own_candidates(scores, tensors.positive_index), tensors.extras["teacher_scores"], 2.0
        )
    assert float(combined) == pytest.approx(float(expected), rel=1e-6)


@pytest.mark.parametrize("loss", ["margin-mse", "kl"])
def test_grad_cache_gives_the_plain_gradient_of_the_distillation_loss(tiny_model_dir, tiny_beir, loss):
    data, _ = make_data(tiny_beir)
    batch = data.collate(list(range(8)), seed=(1, 0, 0))

    def grads(chunk):
        model = _model(tiny_model_dir)
        out = forward_backward(model, batch, CPU, Distillation(loss, 1.0, 1.0, InfoNCE()), chunk_size=chunk)
        return out.loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    loss_full, full = grads(None)
    loss_gc, cached = grads(3)
    assert float(loss_full) == pytest.approx(float(loss_gc), rel=1e-5)
    for name in full:
        torch.testing.assert_close(cached[name], full[name], rtol=1e-4, atol=1e-6, msg=name)


def test_distillation_needs_teacher_scores_in_the_batch(tiny_model_dir, tiny_beir):
    data, _ = make_data(tiny_beir, teacher=False)
    with pytest.raises(ConfigError, match="needs teacher scores"):
        forward_backward(_model(tiny_model_dir), data.collate([0, 1], seed=(1, 0, 0)), CPU, Distillation("kl"))


def _params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_distillation_training_lowers_the_loss_and_resumes_exactly(tiny_model_dir, tiny_beir, tmp_path):
    data, _ = make_data(tiny_beir)
    config = TrainConfig(epochs=2, batch_size=6, learning_rate=1e-3, warmup_ratio=0.0, checkpoint_every=3, log_every=1)
    objective = Distillation("margin-mse", 0.5, 1.0, InfoNCE())
    full = _model(tiny_model_dir)
    result = train(full, data, config, tmp_path / "full", CPU, objective=objective)
    losses = [float(line.split('"loss": ')[1].split(",")[0]) for line in result.log_path.read_text().splitlines()]
    assert sum(losses[-3:]) < sum(losses[:3])

    with interrupted_at_step(5):
        train(_model(tiny_model_dir), data, config, tmp_path / "resumed", CPU, objective=objective)
    resumed = _model(tiny_model_dir)
    train(resumed, data, config, tmp_path / "resumed", CPU, objective=objective)
    torch.testing.assert_close(_params(resumed), _params(full), rtol=1e-5, atol=1e-6)
