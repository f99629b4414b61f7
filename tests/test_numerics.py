"""Numeric health (docs/reliability.md): a non-finite loss or gradient stops every training loop with one line
naming the step, or skips its batch with ``skip_nonfinite`` (and a resumed run skips the same batches); models
and dense indexes holding NaN are refused when saved and when loaded."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import interrupted_at_step
from densepass.config import RerankerTrainConfig, TrainConfig, load_config
from densepass.data import load_dataset
from densepass.errors import DataError
from densepass.index.base import load_index
from densepass.index.dense import DenseIndex
from densepass.io import MANIFEST, write_manifest
from densepass.losses.objectives import InfoNCE
from densepass.models.biencoder import BiEncoder
from densepass.models.cross_encoder import CrossEncoder
from densepass.numerics import Diverged, DivergenceGuard, SkippedBatchWarning, first_nonfinite, nonfinite_row
from densepass.training.batches import TrainingData
from densepass.training.cross_encoder import train_cross_encoder
from densepass.training.trainer import train

CPU = torch.device("cpu")
NAN = float("nan")


def test_the_first_nonfinite_tensor_and_row_are_found_block_by_block(monkeypatch):
    import densepass.numerics as numerics

    assert first_nonfinite([("a", torch.ones(3)), ("ids", torch.arange(3))]) is None
    assert first_nonfinite([("a", torch.ones(3)), ("b", torch.tensor([1.0, -float("inf")]))]) == ("b", "inf")
    monkeypatch.setattr(numerics, "BLOCK_BYTES", 3 * 4 * 4)  # 3 rows of 4 float32 per block
    array = np.zeros((10, 4), dtype=np.float32)
    assert nonfinite_row(array) is None
    array[7, 2] = NAN
    assert nonfinite_row(array) == 7
    assert nonfinite_row(np.zeros((3, 2), dtype=np.int64)) is None


def test_the_guard_stops_or_skips_and_bounds_the_skips_in_a_row():
    with pytest.raises(Diverged, match=r"^training diverged at step 2: the loss is nan; lower train.learning_rate"):
        DivergenceGuard(False).check(2, torch.tensor(NAN), torch.tensor(1.0))
    with pytest.raises(Diverged, match="step 7: the gradient norm is inf; lower reranker.train.learning_rate"):
        DivergenceGuard(False, "reranker.train").check(7, 0.5, torch.tensor(float("inf")))
    guard = DivergenceGuard(True, limit=2)
    with pytest.warns(SkippedBatchWarning, match="step 1: the loss is nan; batch skipped"):
        assert not guard.check(1, NAN, torch.tensor(1.0))
    assert guard.check(2, 0.3, torch.tensor(1.0)) and guard.in_a_row == 0 and guard.skipped == 1
    with pytest.warns(SkippedBatchWarning):
        assert not guard.check(3, NAN, torch.tensor(NAN)) and not guard.check(4, NAN, torch.tensor(NAN))
    with pytest.raises(Diverged, match="step 5: .*3 batches in a row .*skips at most 2 in a row"):
        guard.check(5, NAN, torch.tensor(NAN))
    restored = DivergenceGuard(True)
    restored.load_state_dict(guard.state_dict())
    assert (restored.skipped, restored.in_a_row) == (guard.skipped, guard.in_a_row)


def _guard_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results = {}
        for skip in (False, True):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:  # only rank 1's loss is NaN
                    loss = torch.tensor(NAN if rank else 0.5)
                    result = {"taken": DivergenceGuard(skip).check(4, loss, torch.tensor(1.0))}
                except Diverged as err:
                    result = {"error": str(err)}
            result["warnings"] = [str(w.message) for w in caught if w.category is SkippedBatchWarning]
            results[str(skip)] = result
        Path(out_dir, f"{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


def test_every_process_stops_or_skips_when_one_of_them_meets_a_nan(tmp_path):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_guard_worker, args=(2, port, str(tmp_path)), nprocs=2)
    first, second = (json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1))
    assert first["False"]["error"].startswith("training diverged at step 4: the loss is not finite on another process")
    assert second["False"]["error"].startswith("training diverged at step 4: the loss is nan")
    assert first["True"]["taken"] is False and second["True"]["taken"] is False  # both skip the batch
    assert "the loss is not finite on another process; batch skipped" in first["True"]["warnings"][0]


# ---- the bi-encoder loop -------------------------------------------------------------------------------


class Poisoned(InfoNCE):
    """The contrastive loss, NaN on the batches whose passage keys sum to a multiple of 3: the same batches in
    every run, whatever the process's history."""

    def __call__(self, model, queries, passages, batch):
        loss = super().__call__(model, queries, passages, batch)
        return loss * NAN if int(batch.passage_keys.sum()) % 3 == 0 else loss


def _data(beir_dir):
    dataset = load_dataset(str(beir_dir))
    negatives = {q: list(dataset.corpus.ids[::3]) for q in dataset.queries}
    return TrainingData(dataset, "train", "[SEP]", negatives, 1)


def _config(**kw):
    base = dict(epochs=2, batch_size=6, learning_rate=1e-3, warmup_ratio=0.0, checkpoint_every=3, log_every=1)
    return TrainConfig(**{**base, "seed": 3, "keep_checkpoints": 5, "cpu_bf16": False, **kw})


def _params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _records(run_dir: Path, timed: bool = True) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
    return records if timed else [{k: v for k, v in r.items() if k != "examples_per_s"} for r in records]


def test_a_nonfinite_loss_stops_training_naming_the_step_and_writes_no_checkpoint(tiny_model_dir, tiny_beir, tmp_path):
    model = BiEncoder.from_pretrained(str(tiny_model_dir))
    with pytest.raises(Diverged, match=r"training diverged at step \d+: the loss is nan and the gradient norm is nan"):
        train(model, _data(tiny_beir), _config(checkpoint_every=100), tmp_path, CPU, objective=Poisoned())
    assert not list((tmp_path / "checkpoints").glob("step-*"))


def test_skip_nonfinite_skips_the_batches_finishes_and_resumes_to_the_same_weights(tiny_model_dir, tiny_beir, tmp_path):
    data, config = _data(tiny_beir), _config(skip_nonfinite=True)
    full = BiEncoder.from_pretrained(str(tiny_model_dir))
    with pytest.warns(SkippedBatchWarning) as warned:
        result = train(full, data, config, tmp_path / "full", CPU, objective=Poisoned())
    skipped = [w for w in warned if w.category is SkippedBatchWarning]
    assert result.steps == 10 and 0 < len(skipped) < 10
    assert torch.isfinite(_params(full)).all()
    assert max(r.get("skipped", 0) for r in _records(tmp_path / "full")) > 0
    assert len(warned) == len(skipped)  # nothing else: torch's warning of a first step skipped is silenced

    with warnings.catch_warnings(), interrupted_at_step(8):
        warnings.simplefilter("ignore", SkippedBatchWarning)
        train(
            BiEncoder.from_pretrained(str(tiny_model_dir)),
            data,
            config,
            tmp_path / "resumed",
            CPU,
            objective=Poisoned(),
        )
    resumed = BiEncoder.from_pretrained(str(tiny_model_dir))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SkippedBatchWarning)
        train(resumed, data, config, tmp_path / "resumed", CPU, objective=Poisoned())
    assert torch.equal(_params(resumed), _params(full))
    assert _records(tmp_path / "resumed", timed=False) == _records(tmp_path / "full", timed=False)


def test_more_skipped_batches_in_a_row_than_the_bound_stop_training(tiny_model_dir, tiny_beir, tmp_path):
    class AlwaysNan(InfoNCE):
        def __call__(self, *args):
            return super().__call__(*args) * NAN

    model = BiEncoder.from_pretrained(str(tiny_model_dir))
    config = _config(epochs=1, batch_size=2, skip_nonfinite=True)  # 15 steps
    with warnings.catch_warnings(), pytest.raises(Diverged, match="step 11: .*11 batches in a row"):
        warnings.simplefilter("ignore", SkippedBatchWarning)
        train(model, _data(tiny_beir), config, tmp_path, CPU, objective=AlwaysNan())


# ---- the other loops -----------------------------------------------------------------------------------


def test_cross_encoder_training_stops_at_a_nonfinite_step(tiny_model_dir, tiny_beir, tmp_path):
    dataset = load_dataset(str(tiny_beir))
    data = TrainingData(dataset, "train", " ", {q: list(dataset.corpus.ids[::2]) for q in dataset.queries}, 3)
    model = CrossEncoder.new(str(tiny_model_dir), seed=5, max_length=48, device=CPU)
    config = RerankerTrainConfig(
        negatives_per_query=3, epochs=2, batch_size=5, learning_rate=1e308, warmup_ratio=0.0, checkpoint_every=1
    )
    with pytest.raises(Diverged, match=r"training diverged at step 1: .*lower reranker.train.learning_rate"):
        train_cross_encoder(model, data, config, tmp_path, CPU)
    assert not list((tmp_path / "checkpoints").glob("step-*"))


def test_pretraining_stops_at_a_nonfinite_step_and_skips_on_request(tiny_beir, tiny_model_dir, tmp_path):
    from densepass.pretraining.config import PretrainConfig
    from densepass.pretraining.trainer import pretrain

    def config(*extra):
        settings = [f"data.name={tiny_beir}", f"model.name_or_path={tiny_model_dir}", f"output_dir={tmp_path}"]
        settings += ["name=pt", "model.early_layers=1", "train.max_steps=4", "train.batch_size=4"]
        settings += ["train.max_length=32", "train.log_every=1", "train.learning_rate=1e308", *extra]
        return load_config(None, settings, PretrainConfig)

    with pytest.raises(Diverged, match=r"training diverged at step 2: the loss is nan"):
        pretrain(config("train.checkpoint_every=10"))
    with pytest.raises(
        Diverged, match=r"training diverged at step 1: its optimiser step left (nan|inf) in the weights"
    ):
        pretrain(config("train.checkpoint_every=1"), restart=True)
    with pytest.warns(SkippedBatchWarning), pytest.raises(Diverged, match="step 4: its optimiser step left"):
        pretrain(config("train.checkpoint_every=10", "train.skip_nonfinite=true"), restart=True)
    assert not (tmp_path / "pt" / "backbone").exists() and not list((tmp_path / "pt").glob("checkpoints/step-*"))


# ---- saved models and indexes --------------------------------------------------------------------------


def _plant_nan(path: Path, name_part: str = "") -> None:
    """A NaN written into a saved model's weights, its manifest rewritten: only the finiteness check can tell."""
    weights = path / "model.safetensors"
    tensors = load_file(str(weights))
    name = next(n for n, t in tensors.items() if t.is_floating_point() and name_part in n)
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = NAN
    save_file(tensors, str(weights), metadata={"format": "pt"})
    if (path / MANIFEST).is_file():
        facts = {k: v for k, v in json.loads((path / MANIFEST).read_text()).items() if k != "files"}
        write_manifest(path, **facts)


def test_a_model_with_nan_weights_is_refused_at_save_and_at_load(tiny_model_dir, tmp_path):
    model = BiEncoder.from_pretrained(str(tiny_model_dir))
    model.save(tmp_path / "good")
    _plant_nan(tmp_path / "good", "encoder.layer.1")
    with pytest.raises(DataError, match=r"good is not a usable model: its weights hold nan \(in .*encoder.layer.1"):
        BiEncoder.from_pretrained(str(tmp_path / "good"))
    with torch.no_grad():
        model.passage_encoder.pooler.dense.weight[0, 0] = float("inf")
    with pytest.raises(DataError, match="refusing to save the model to .*bad: its weights hold inf"):
        model.save(tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
    reranker = CrossEncoder.new(str(tiny_model_dir), seed=5, max_length=48, device=CPU)
    reranker.save(tmp_path / "reranker")
    _plant_nan(tmp_path / "reranker")
    with pytest.raises(DataError, match="reranker is not a usable model: its weights hold nan"):
        CrossEncoder.from_pretrained(str(tmp_path / "reranker"))


def test_an_index_with_nan_embeddings_is_refused_at_save_and_at_load(tiny_model_dir, tiny_beir, tmp_path):
    model = BiEncoder.from_pretrained(str(tiny_model_dir))
    model.save(tmp_path / "model")
    model = BiEncoder.from_pretrained(str(tmp_path / "model"))
    corpus = load_dataset(str(tiny_beir)).corpus
    for kind in ("exact", "faiss-flat"):
        index = DenseIndex.build(model, corpus, kind, show_progress=False)
        index.save(tmp_path / kind)
        embeddings = np.load(tmp_path / kind / "embeddings.npy")
        embeddings[5, 3] = NAN
        np.save(tmp_path / kind / "embeddings.npy", embeddings)
        facts = {k: v for k, v in json.loads((tmp_path / kind / MANIFEST).read_text()).items() if k != "files"}
        write_manifest(tmp_path / kind, **facts)
        with pytest.raises(DataError, match=rf"{kind} is not a usable index: the embedding of passage 'p5' \(row 5\)"):
            load_index(tmp_path / kind, model=model)
        index.embeddings = embeddings
        with pytest.raises(DataError, match=r"refusing to save the index to .*again: the embedding of passage 'p5'"):
            index.save(tmp_path / "again")
        assert not (tmp_path / "again").exists()


def test_phrase_training_stops_at_a_nonfinite_step(tmp_path):
    from densepass.data.squad import load_squad_spans
    from densepass.phrase.config import PhraseTrainConfig
    from densepass.phrase.train import build_phrase_data, train_phrases
    from phrase_fixtures import tiny_phrase_model, write_phrase_squad

    data = load_squad_spans(write_phrase_squad(tmp_path / "squad"))
    model = tiny_phrase_model(tmp_path / "bert")
    phrase_data = build_phrase_data(model, data, "train")
    config = PhraseTrainConfig(
        passages_per_batch=2, questions_per_passage=2, max_steps=4, learning_rate=1e308, warmup_ratio=0.0
    )
    with pytest.raises(Diverged, match=r"training diverged at step 2: the loss is nan"):
        train_phrases(model, phrase_data, config, tmp_path / "run", CPU, show_progress=False)
    assert not list((tmp_path / "run").glob("checkpoints/step-*"))
