"""L2-SP (training.l2sp): the penalty α/2 ‖w − w₀‖² and its gradient against a float64 reference, zero at the
first step, a pull that keeps the weights near w₀, an exact resume, and the settings it is refused with."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import interrupted_at_step
from densepass.config import TrainConfig
from densepass.data import load_dataset
from densepass.errors import ConfigError
from densepass.models.biencoder import BiEncoder, BiEncoderConfig
from densepass.training.batches import TrainingData
from densepass.training.l2sp import L2SP, anchored_parameters, check_l2sp
from densepass.training.trainer import train

CPU = torch.device("cpu")


def _data(beir_dir):
    dataset = load_dataset(str(beir_dir))
    return TrainingData(dataset, "train", "[SEP]", {q: list(dataset.corpus.ids[::3]) for q in dataset.queries}, 1)


def _config(**kw):
    base = dict(
        epochs=1,
        batch_size=6,
        learning_rate=1e-3,
        weight_decay=0.0,
        warmup_ratio=0.0,
        checkpoint_every=2,
        log_every=1,
        seed=3,
        keep_checkpoints=5,
        cpu_bf16=False,
    )
    return TrainConfig(**{**base, **kw})


def _params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_the_penalty_and_its_gradient_equal_a_float64_reference(tiny_model_dir):
    model = BiEncoder.from_pretrained(str(tiny_model_dir), config=BiEncoderConfig(projection_dim=8))
    anchored = anchored_parameters(model, "encoder")
    assert anchored and not any(name.startswith("projection") for name in anchored)  # the new head trains freely
    assert any(name.startswith("projection") for name in anchored_parameters(model, "all"))
    from transformers import BertForSequenceClassification

    from conftest import tiny_bert_config

    cross = BertForSequenceClassification(tiny_bert_config(100))  # a cross-encoder: its classifier may be new
    assert not any("classifier" in name for name in anchored_parameters(cross, "encoder"))
    assert {n for n in anchored_parameters(cross, "all") if "classifier" in n} == {
        "classifier.weight",
        "classifier.bias",
    }
    start = {name: p.detach().double().clone() for name, p in anchored.items()}
    l2sp = L2SP(0.37, anchored)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
            p.grad = torch.randn_like(p)
    before = {name: p.grad.double().clone() for name, p in anchored.items()}
    penalty = l2sp.add_gradient()
    reference = 0.5 * 0.37 * sum(((p.detach().double() - start[n]) ** 2).sum() for n, p in anchored.items())
    assert penalty.item() == pytest.approx(reference.item(), rel=1e-5)
    assert l2sp.penalty().item() == pytest.approx(reference.item(), rel=1e-5)
    for name, p in anchored.items():
        expected = before[name] + 0.37 * (p.detach().double() - start[name])
        torch.testing.assert_close(p.grad.double(), expected, rtol=1e-6, atol=1e-7, msg=name)
    # a process that does not add it (torch.distributed: rank 0 does) leaves the gradients alone
    grads = [p.grad.clone() for p in anchored.values()]
    l2sp.add_gradient(apply=False)
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, anchored.values()))


def test_the_penalty_is_logged_zero_at_the_first_step_and_keeps_a_huge_alpha_near_the_start(
    tiny_model_dir, tiny_beir, tmp_path
):
    data = _data(tiny_beir)
    start = _params(BiEncoder.from_pretrained(str(tiny_model_dir)))
    free, pulled = BiEncoder.from_pretrained(str(tiny_model_dir)), BiEncoder.from_pretrained(str(tiny_model_dir))
    train(free, data, _config(), tmp_path / "free", CPU)
    result = train(pulled, data, _config(l2sp=1e4), tmp_path / "pulled", CPU)
    records = [json.loads(line) for line in result.log_path.read_text().splitlines()]
    assert records[0]["l2sp"] == 0.0  # w = w0 before the first update
    assert all(r["l2sp"] > 0 for r in records[1:])
    moved_free = (_params(free) - start).norm()
    moved_pulled = (_params(pulled) - start).norm()
    assert moved_pulled < 0.5 * moved_free, (moved_pulled, moved_free)


def test_a_resumed_run_equals_an_uninterrupted_one(tiny_model_dir, tiny_beir, tmp_path):
    data = _data(tiny_beir)
    config = _config(l2sp=0.5)
    full = BiEncoder.from_pretrained(str(tiny_model_dir))
    train(full, data, config, tmp_path / "full", CPU)

    with interrupted_at_step(4):
        train(BiEncoder.from_pretrained(str(tiny_model_dir)), data, config, tmp_path / "resumed", CPU)
    # the resumed run starts from other weights: w0 must come from the checkpoint, not from the model given
    other = BiEncoder.from_pretrained(str(tiny_model_dir))
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.5)
    train(other, data, config, tmp_path / "resumed", CPU)
    assert torch.equal(_params(other), _params(full))
    log = lambda run: (tmp_path / run / "train_log.jsonl").read_text()  # noqa: E731
    assert [json.loads(r)["l2sp"] for r in log("resumed").splitlines()] == [
        json.loads(r)["l2sp"] for r in log("full").splitlines()
    ]


def test_lora_and_fsdp_are_refused_in_one_line(tiny_model_dir, tiny_beir, tmp_path):
    with pytest.raises(ConfigError, match="train.l2sp does not combine with lora_rank"):
        check_l2sp(TrainConfig(l2sp=0.1, lora_rank=4))
    with pytest.raises(ConfigError, match="train.l2sp does not combine with fsdp"):
        check_l2sp(TrainConfig(l2sp=0.1, fsdp=True))
    with pytest.raises(ConfigError, match="lora_rank"):
        train(
            BiEncoder.from_pretrained(str(tiny_model_dir)),
            _data(tiny_beir),
            _config(l2sp=1.0, lora_rank=2),
            tmp_path / "lora",
            CPU,
        )
    assert not (tmp_path / "lora" / "checkpoints").exists()


def test_a_run_refuses_l2sp_with_lora_before_any_work_and_logs_the_penalty(tiny_model_dir, tiny_beir, tmp_path):
    from conftest import small_run_overrides
    from densepass.config import load_config
    from densepass.pipelines.experiment import run_experiment

    overrides = small_run_overrides(tiny_beir, tiny_model_dir, tmp_path / "out", "l2sp")
    overrides += [
        "train.batch_size=6",
        "train.max_steps=2",
        "train.log_every=1",
        "negatives.source=none",
        "train.l2sp=0.1",
    ]
    with pytest.raises(ConfigError, match="train.l2sp does not combine with lora_rank"):
        run_experiment(load_config(None, [*overrides, "train.lora_rank=2"]))
    with pytest.raises(ConfigError, match="reranker.train.l2sp does not combine with lora_rank"):
        run_experiment(
            load_config(
                None,
                [
                    *overrides,
                    "reranker.enabled=true",
                    "negatives.source=bm25",
                    "reranker.train.negatives_per_query=2",
                    "reranker.first_stages=[]",
                    "reranker.train.l2sp=1.0",
                    "reranker.train.lora_rank=2",
                ],
            )
        )
    assert not (tmp_path / "out" / "l2sp").exists()
    run_experiment(load_config(None, overrides))
    records = [json.loads(line) for line in (tmp_path / "out" / "l2sp" / "train_log.jsonl").read_text().splitlines()]
    assert records[0]["l2sp"] == 0.0 and records[1]["l2sp"] > 0
