"""Cross-encoder training on hard-negative pools: listwise and pointwise losses lower the loss and the
trained model ranks positives higher, groups are (query, positive, negatives) in order, and an
interrupted run resumes to the same weights."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from densepass.config import RerankerTrainConfig
from densepass.data import load_dataset
from densepass.errors import ConfigError
from densepass.models.cross_encoder import CrossEncoder
from densepass.training.batches import TrainingData
from densepass.training.cross_encoder import group_pairs, train_cross_encoder

CPU = torch.device("cpu")


def make_data(beir_dir, n=3):
    dataset = load_dataset(str(beir_dir))
    negatives = {q: list(dataset.corpus.ids[::2]) for q in dataset.queries}
    return TrainingData(dataset, "train", " ", negatives, n)


def config(**kw):
    base = dict(negatives_per_query=3, epochs=4, batch_size=5, learning_rate=2e-3, warmup_ratio=0.0)
    base.update(checkpoint_every=4, log_every=1, keep_checkpoints=5)
    base.update(kw)
    return RerankerTrainConfig(**base)


def new_model(model_dir):
    return CrossEncoder.new(str(model_dir), seed=5, max_length=48, device=CPU)


def test_groups_pair_each_query_with_its_positive_then_its_negatives(tiny_beir):
    data = make_data(tiny_beir)
    batch = data.collate([2, 5], seed=(0, 0, 0))
    queries, passages = group_pairs(batch, 3)
    assert queries == [batch.query_texts[0]] * 4 + [batch.query_texts[1]] * 4
    assert passages[0] == batch.passage_texts[0] and passages[4] == batch.passage_texts[1]
    assert passages[1:4] == batch.passage_texts[2:5] and passages[5:8] == batch.passage_texts[5:8]


def _positive_margin(model, data):
    """Mean of (positive score - mean negative score) over the training queries."""
    batch = data.collate(list(range(len(data))), seed=(9, 9, 9))
    scores = model.score_pairs(*group_pairs(batch, data.negatives_per_query)).reshape(len(data), -1)
    return float(np.mean(scores[:, 0] - scores[:, 1:].mean(1)))


@pytest.mark.parametrize("loss", ["listwise", "pointwise"])
def test_training_lowers_the_loss_and_ranks_positives_higher(tiny_model_dir, tiny_beir, tmp_path, loss):
    data = make_data(tiny_beir)
    model = new_model(tiny_model_dir)
    before = _positive_margin(model, data)
    result = train_cross_encoder(
        model, data, config(loss=loss, epochs=10, learning_rate=5e-3, head_learning_rate=None), tmp_path, CPU
    )
    assert result.steps == 10 * (len(data) // 5)
    losses = [float(line.split('"loss": ')[1].split(",")[0]) for line in result.log_path.read_text().splitlines()]
    assert np.mean(losses[-4:]) < np.mean(losses[:4])
    assert _positive_margin(model, data) > before + 0.5  # logits: untrained, every pair scores alike


def _params(model):
    return torch.cat([p.detach().flatten() for p in model.model.parameters()])


def test_an_interrupted_cross_encoder_run_resumes_to_the_same_weights(tiny_model_dir, tiny_beir, tmp_path, monkeypatch):
    data = make_data(tiny_beir)
    full = new_model(tiny_model_dir)
    train_cross_encoder(full, data, config(epochs=2), tmp_path / "full", CPU)

    calls = []
    interrupted = new_model(tiny_model_dir)
    real_logits = interrupted.logits

    def crash_on_sixth(tokens):
        calls.append(1)
        if len(calls) == 6:
            raise KeyboardInterrupt
        return real_logits(tokens)

    monkeypatch.setattr(interrupted, "logits", crash_on_sixth)
    with pytest.raises(KeyboardInterrupt):
        train_cross_encoder(interrupted, data, config(epochs=2), tmp_path / "resumed", CPU)
    steps = sorted(p.name for p in (tmp_path / "resumed" / "checkpoints").iterdir() if not p.name.startswith("."))
    assert steps == ["step-4"]
    resumed = new_model(tiny_model_dir)
    train_cross_encoder(resumed, data, config(epochs=2), tmp_path / "resumed", CPU)
    torch.testing.assert_close(_params(resumed), _params(full), rtol=1e-5, atol=1e-6)
    with pytest.raises(ConfigError, match="other settings"):
        train_cross_encoder(
            new_model(tiny_model_dir), data, config(epochs=2, loss="pointwise"), tmp_path / "resumed", CPU
        )


def test_the_config_and_the_data_must_draw_the_same_number_of_negatives(tiny_model_dir, tiny_beir, tmp_path):
    with pytest.raises(ConfigError, match="draws 3 negatives per query, the config 2"):
        train_cross_encoder(
            new_model(tiny_model_dir), make_data(tiny_beir), config(negatives_per_query=2), tmp_path, CPU
        )


def test_a_new_head_and_the_pooler_learn_at_the_head_rate_and_the_encoder_at_the_base_rate(tiny_model_dir):
    from densepass.training.cross_encoder import parameter_groups

    model = new_model(tiny_model_dir)
    names = {id(p): n for n, p in model.model.named_parameters()}
    base, head = parameter_groups(model, config(head_learning_rate=1e-2))
    head_names = {names[id(p)] for p in head["params"]}
    assert head["lr"] == 1e-2 and "lr" not in base
    assert any(n.startswith("classifier.") for n in head_names) and any(".pooler." in n for n in head_names)
    assert not any(".encoder." in n or ".embeddings." in n for n in head_names)
    assert len(base["params"]) + len(head["params"]) == len(names)
    assert len(parameter_groups(model, config(head_learning_rate=None))) == 1


# ---- torch.distributed ---------------------------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _distributed_config():
    # pointwise: under the listwise softmax the head's bias has no gradient but float noise, which Adam scales up to a
    # full step in either run
    return config(epochs=1, batch_size=5, checkpoint_every=3, loss="pointwise")  # groups split 3 + 2 over 2 processes


def _cross_encoder_worker(rank, world, port, model_dir, beir_dir, out_dir):
    import os
    from pathlib import Path

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        model = new_model(model_dir)
        train_cross_encoder(model, make_data(beir_dir), _distributed_config(), Path(out_dir) / "dist", CPU)
        torch.save(_params(model), Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_gloo_processes_end_with_the_weights_of_one_process_on_the_whole_step(tiny_model_dir, tiny_beir, tmp_path):
    """Each process scores its share of a step's groups (3 and 2 of 5) and the logits are gathered: the summed
    gradient is that of the whole step, so the weights equal one process's up to float rounding (the two runs
    differ only in the order of sums; one thread each, so no thread count changes it further); the log is written
    once, with the global step's loss."""
    import json

    import torch.multiprocessing as mp

    mp.spawn(_cross_encoder_worker, args=(2, _free_port(), tiny_model_dir, tiny_beir, str(tmp_path)), nprocs=2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = new_model(tiny_model_dir)
        train_cross_encoder(single, make_data(tiny_beir), _distributed_config(), tmp_path / "single", CPU)
    finally:
        torch.set_num_threads(threads)
    ranks = [torch.load(tmp_path / f"rank{rank}.pt") for rank in range(2)]
    assert torch.equal(ranks[0], ranks[1])  # the same updates on every process
    assert not torch.equal(ranks[0], _params(new_model(tiny_model_dir)))  # it trained
    torch.testing.assert_close(ranks[0], _params(single), rtol=1e-4, atol=1e-5)

    def losses(run: str) -> list[float]:
        return [json.loads(line)["loss"] for line in (tmp_path / run / "train_log.jsonl").read_text().splitlines()]

    assert len(losses("dist")) == len(losses("single")) == 6
    assert losses("dist") == pytest.approx(losses("single"), rel=1e-4)
    steps = sorted(p.name for p in (tmp_path / "dist" / "checkpoints").iterdir())
    assert steps == ["step-3", "step-6"]  # written by rank 0 alone: no partial directory of a second writer
