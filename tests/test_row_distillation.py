"""Teacher scores carried by training rows (a pairs file's ``scores`` column) as the distillation targets, with no
cross-encoder: the loss of a batch equals a slow reference computed from the file's numbers, ``densepass run``
with ``reranker.distill.source: rows`` and ``dp.train`` with a ``Distillation`` loss train and save, and the
settings that cannot work are one line before any work."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch

import densepass as dp
from conftest import WORDS, write_tiny_beir
from densepass.config import load_config
from densepass.data.pairs import load_pairs
from densepass.errors import ConfigError
from densepass.losses.objectives import Distillation
from densepass.negatives.pool import passage_ids
from densepass.pipelines.experiment import run_experiment
from densepass.pipelines.training import given_pool
from densepass.training.batches import TrainingData
from densepass.training.step import batch_tensors


def scored_rows(n: int = 16, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)

    def words(k: int, tag: str) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(k)) + f" {tag}"

    return [
        {"anchor": words(3, f"a{i}"), "positive": words(8, f"p{i}"), "negative_1": words(8, f"n{i}"),
         "negative_2": words(8, f"m{i}"), "scores": [rng.uniform(2, 9), rng.uniform(-3, 5), rng.uniform(-3, 5)]}
        for i in range(n)
    ]  # fmt: skip


def write_rows(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize("loss", ["margin-mse", "kl"])
def test_the_loss_of_a_batch_is_the_reference_computed_from_the_rows_numbers(tmp_path, tiny_model_dir, loss):
    records = scored_rows(8)
    dataset = load_pairs(write_rows(tmp_path / "r.jsonl", records))
    query_ids = sorted(dataset.queries)
    pool = passage_ids(given_pool(dataset, query_ids).pool)
    data = TrainingData(dataset, "train", " ", pool, 2, query_ids=query_ids, teacher_scores=dataset.teacher_scores)
    model = dp.BiEncoder.from_pretrained(str(tiny_model_dir), dp.BiEncoderConfig(temperature=0.5))
    batch = data.collate(list(range(8)), seed=(3, 0, 0))
    tensors = batch_tensors(model, batch)
    with torch.no_grad():
        q = model(tensors.queries["input_ids"], tensors.queries["attention_mask"], "query")
        p = model(tensors.passages["input_ids"], tensors.passages["attention_mask"], "passage")
        got = float(Distillation(loss, 1.0, 2.0)(model, q, p, tensors))
    # the reference: each query's own positive and two negatives found by text in the file's rows, the teacher's
    # numbers read from those rows, the student's scores dot products over the model's temperature, in floats
    by_anchor = {r["anchor"]: r for r in records}
    texts = batch.passage_texts
    terms = []
    for j in range(8):
        row = by_anchor[batch.query_texts[j]]
        columns = [texts[j], texts[8 + 2 * j], texts[8 + 2 * j + 1]]
        named = {row["positive"]: 0, row["negative_1"]: 1, row["negative_2"]: 2}
        teacher = [row["scores"][named[t]] for t in columns]
        rows_of = [j, 8 + 2 * j, 8 + 2 * j + 1]
        student = [float(q[j] @ p[r]) / 0.5 for r in rows_of]
        if loss == "margin-mse":
            terms += [((student[0] - student[k]) - (teacher[0] - teacher[k])) ** 2 for k in (1, 2)]
        else:
            t_norm = sum(math.exp(t / 2.0) for t in teacher)
            s_norm = sum(math.exp(s / 2.0) for s in student)
            terms.append(
                4.0
                * sum(
                    math.exp(t / 2.0)
                    / t_norm
                    * (math.log(math.exp(t / 2.0) / t_norm) - math.log(math.exp(s / 2.0) / s_norm))
                    for t, s in zip(teacher, student)
                )
            )
    assert got == pytest.approx(sum(terms) / len(terms), rel=1e-5)


def test_the_contrastive_term_of_a_distillation_runs_at_its_own_temperature(tmp_path, tiny_model_dir):
    """``Distillation(contrastive=InfoNCE(temperature=τ))`` adds InfoNCE at τ, not at the model's temperature (the
    student's distillation scores stay at the model's); bad weights and temperatures are refused when built."""
    from densepass.losses.objectives import InfoNCE

    dataset = load_pairs(write_rows(tmp_path / "r.jsonl", scored_rows(8)))
    query_ids = sorted(dataset.queries)
    pool = passage_ids(given_pool(dataset, query_ids).pool)
    data = TrainingData(dataset, "train", " ", pool, 2, query_ids=query_ids, teacher_scores=dataset.teacher_scores)
    model = dp.BiEncoder.from_pretrained(str(tiny_model_dir), dp.BiEncoderConfig(temperature=0.5))
    tensors = batch_tensors(model, data.collate(list(range(8)), seed=(3, 0, 0)))
    with torch.no_grad():
        q = model(tensors.queries["input_ids"], tensors.queries["attention_mask"], "query")
        p = model(tensors.passages["input_ids"], tensors.passages["attention_mask"], "passage")
        for tau in (None, 0.05):
            contrastive = InfoNCE(temperature=tau)
            both = float(Distillation("kl", 0.0, 2.0, contrastive=contrastive)(model, q, p, tensors))
            assert both == pytest.approx(float(contrastive(model, q, p, tensors)), rel=1e-6)
    for bad in ({"weight": -1.0}, {"temperature": 0.0}, {"weight": float("nan")}):
        with pytest.raises(ConfigError, match="distillation weight must be >= 0 and temperature > 0"):
            Distillation("kl", **bad)


def test_densepass_run_distils_the_rows_scores_without_a_cross_encoder(tmp_path, tiny_model_dir):
    rows_file = write_rows(tmp_path / "r.jsonl", scored_rows(16))
    beir = write_tiny_beir(tmp_path / "beir")
    overrides = [
        "data.format=pairs",
        f"data.name={rows_file}",
        f"data.eval_name={beir}",
        f"model.name_or_path={tiny_model_dir}",
        f"output_dir={tmp_path / 'out'}",
        "model.passage_max_length=32",
        "eval.metrics=[mrr@10]",
        "eval.depth=10",
        "eval.baselines=[]",
        "negatives.source=given",
        "negatives.per_query=2",
        "train.batch_size=8",
        "train.max_steps=2",
        "reranker.distill.loss=margin-mse",
        "reranker.distill.source=rows",
    ]
    results = run_experiment(load_config(None, [*overrides, "name=rows"]))
    run = tmp_path / "out" / "rows"
    assert "fine-tuned" in results and (run / "model" / "densepass.json").is_file()
    assert not (run / "reranker").exists() and not (run / "teacher_scores.jsonl").exists()
    log = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["step"] == 2 and all(math.isfinite(r["loss"]) for r in log if "loss" in r)
    # refused before any work, in one line: rows without scores, mined negatives, rows mode on a BEIR set
    bare = write_rows(tmp_path / "bare.jsonl", [{k: v for k, v in r.items() if k != "scores"} for r in scored_rows(16)])
    for extra, message in [
        ([f"data.name={bare}"], "carry no teacher scores"),
        (["negatives.source=bm25"], "set negatives.source: given"),
        (["reranker.distill.teacher=some-model"], "leave reranker.distill.teacher out"),
        ([f"data.name={beir}", "data.format=beir", "negatives.source=bm25"], "set data.format: pairs"),
    ]:
        with pytest.raises(ConfigError, match=message) as err:
            run_experiment(load_config(None, [*overrides, *extra, "name=refused"]))
        assert "\n" not in str(err.value)
        assert not (tmp_path / "out" / "refused").exists()


def test_dp_train_distils_the_rows_scores_and_refuses_rows_without_them(tmp_path, tiny_model_dir):
    records = scored_rows(16)
    model = dp.BiEncoder.from_pretrained(str(tiny_model_dir), dp.BiEncoderConfig(passage_max_length=32))
    start = {k: v.clone() for k, v in model.state_dict().items()}
    args = dp.TrainConfig(batch_size=8, max_steps=2, cpu_bf16=False, learning_rate=1e-3)
    out = dp.train(
        model, write_rows(tmp_path / "r.jsonl", records), output_dir=tmp_path / "a", loss=Distillation("kl"), args=args
    )
    assert out.steps == 2 and (out.model_dir / "densepass.json").is_file()
    assert any(not torch.equal(model.state_dict()[k], start[k]) for k in start)
    # the rows' scores are what it learns from: other scores, other weights
    flipped = [{**r, "scores": [-v for v in r["scores"]]} for r in records]
    other = dp.BiEncoder.from_pretrained(str(tiny_model_dir), dp.BiEncoderConfig(passage_max_length=32))
    dp.train(other, write_rows(tmp_path / "f.jsonl", flipped), output_dir=tmp_path / "f", loss=Distillation("kl"),
             args=args)  # fmt: skip
    assert any(not torch.equal(model.state_dict()[k], other.state_dict()[k]) for k in start)
    bare = write_rows(tmp_path / "bare.jsonl", [{k: v for k, v in r.items() if k != "scores"} for r in records])
    with pytest.raises(ConfigError, match="carry no teacher scores"):
        dp.train(model, bare, output_dir=tmp_path / "b", loss=Distillation("kl"), args=args)
    with pytest.raises(ConfigError, match="distils the teacher scores of training rows over their given negatives"):
        dp.train(model, bare, output_dir=tmp_path / "c", loss=Distillation("kl"), args=args,
                 negatives=dp.NegativesConfig(source="none"))  # fmt: skip
    assert not (tmp_path / "b").exists() and not (tmp_path / "c").exists()
