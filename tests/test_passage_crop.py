"""train.passage_max_length: training batches cut passages shorter than the model reads them (faster steps),
while the model keeps its own length for mining, indexing and evaluation; the token cache serves the cut
passages; a length past the model's is a one-line error before any work."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import small_run_overrides
from densepass.config import TrainConfig, load_config
from densepass.data import load_dataset
from densepass.errors import ConfigError
from densepass.models.biencoder import BiEncoder, BiEncoderConfig
from densepass.models.colbert import ColBERT, ColbertArchitecture
from densepass.models.splade import SpladeArchitecture, SpladeEncoder
from densepass.pipelines.experiment import run_experiment
from densepass.training.batches import TrainingData
from densepass.training.trainer import train

CROP = 6
TEXTS = ["tar [SEP] GNU version of tar", " ".join(["archiving utility with compression"] * 20), "x", ""]
MODELS = {  # each kind at the long length, and how it is configured at another
    "bi-encoder": lambda d, n: BiEncoder.from_pretrained(str(d), config=BiEncoderConfig(passage_max_length=n)),
    "splade": lambda d, n: SpladeEncoder.from_pretrained(str(d), config=SpladeArchitecture(passage_max_length=n)),
    "colbert": lambda d, n: ColBERT.from_pretrained(
        str(d), config=ColbertArchitecture(dim=8, passage_max_length=n, markers=True)
    ),
}


@pytest.mark.parametrize("kind", MODELS)
def test_tokenize_at_another_length_is_the_model_configured_at_it(tiny_model_dir, kind):
    long, short = MODELS[kind](tiny_model_dir, 24), MODELS[kind](tiny_model_dir, CROP)
    cut = long.tokenize(TEXTS, "passage", max_length=CROP)
    expected = short.tokenize(TEXTS, "passage")
    assert cut.keys() == expected.keys()
    assert all(torch.equal(cut[k], expected[k]) for k in expected)
    assert long.tokenize(TEXTS, "passage")["input_ids"].shape[1] > CROP  # the argument changed something


def _train(model_dir, tiny_beir, run_dir, crop: int | None, token_cache: bool = False):
    """Train a 24-token bi-encoder; return (widths of the passage batches it read, its weights, the model)."""
    dataset = load_dataset(str(tiny_beir))
    data = TrainingData(dataset, "train", "[SEP]", {q: list(dataset.corpus.ids[::3]) for q in dataset.queries}, 1)
    model = BiEncoder.from_pretrained(str(model_dir), config=BiEncoderConfig(passage_max_length=24))
    widths, forward = [], model.forward

    def spy(input_ids, attention_mask, side, **embedded):
        if side == "passage" and torch.is_grad_enabled():
            widths.append(input_ids.shape[1])
        return forward(input_ids, attention_mask, side, **embedded)

    model.forward = spy
    config = TrainConfig(
        batch_size=6, learning_rate=1e-3, warmup_ratio=0.0, seed=5, passage_max_length=crop, token_cache=token_cache
    )
    train(model, data, config, run_dir, torch.device("cpu"))
    return widths, {k: v.clone() for k, v in model.state_dict().items()}, model


def test_training_reads_passages_cut_to_the_crop_and_the_model_keeps_its_length(tiny_model_dir, tiny_beir, tmp_path):
    uncut, _, _ = _train(tiny_model_dir, tiny_beir, tmp_path / "uncut", None)
    assert max(uncut) > CROP  # the tiny passages are longer than the crop
    widths, weights, model = _train(tiny_model_dir, tiny_beir, tmp_path / "cut", CROP)
    assert widths and max(widths) == CROP
    assert model.config.passage_max_length == 24  # mining, indexing and evaluation read the model's length
    model.save(tmp_path / "saved")
    assert json.loads((tmp_path / "saved" / "densepass.json").read_text())["passage_max_length"] == 24
    cached_widths, cached_weights, _ = _train(tiny_model_dir, tiny_beir, tmp_path / "cached", CROP, token_cache=True)
    facts = json.loads((tmp_path / "cached" / "token_cache" / "passage" / "manifest.json").read_text())
    assert facts["max_length"] == CROP  # the cache holds the passages cut at the crop
    assert cached_widths == widths
    assert all(torch.equal(cached_weights[k], weights[k]) for k in weights)  # the cache serves the cut passages


def test_bad_crops_are_one_line_errors_before_any_work(tiny_beir, tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="passage_max_length: must be >= 2"):
        load_config(None, ["train.passage_max_length=1"])
    overrides = [*small_run_overrides(tiny_beir, tiny_model_dir, tmp_path, "g"), "train.passage_max_length=33"]
    with pytest.raises(ConfigError, match="train.passage_max_length=33 is longer than model.passage_max_length=32"):
        run_experiment(load_config(None, overrides))
    assert not (tmp_path / "g" / "config.yaml").exists()  # refused before the run was recorded
