"""train.freeze_layers: training leaves the embeddings and the bottom layers exactly at their starting weights
and trains the rest; bad values are one-line errors before any work."""

from __future__ import annotations

import pytest
import torch

from conftest import small_run_overrides
from densepass.config import TrainConfig, load_config
from densepass.data import load_dataset
from densepass.errors import ConfigError
from densepass.models.biencoder import BiEncoder, BiEncoderConfig
from densepass.models.freeze import freeze_bottom
from densepass.pipelines.experiment import run_experiment
from densepass.training.batches import TrainingData
from densepass.training.trainer import train


def test_training_moves_only_the_layers_above_the_frozen_ones(tiny_model_dir, tiny_beir, tmp_path):
    dataset = load_dataset(str(tiny_beir))
    data = TrainingData(dataset, "train", "[SEP]", {q: list(dataset.corpus.ids[::3]) for q in dataset.queries})
    model = BiEncoder.from_pretrained(str(tiny_model_dir))
    start = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    assert model.query_encoder.config.num_hidden_layers >= 2  # one frozen layer and at least one trained
    config = TrainConfig(batch_size=6, learning_rate=1e-3, warmup_ratio=0.0, freeze_layers=1)
    train(model, data, config, tmp_path / "f", torch.device("cpu"))
    tuned = model.state_dict()
    moved = {name for name in start if start[name].is_floating_point() and not torch.equal(start[name], tuned[name])}
    frozen = {n for n in start if ".embeddings." in n or ".encoder.layer.0." in n}
    assert frozen and not moved & frozen  # bit-exact: no update and no weight decay reached them
    above = {n for n in start if ".encoder.layer." in n and n not in frozen and start[n].is_floating_point()}
    assert above and above <= moved  # every weight of the layers above trained


def test_a_shared_encoder_is_frozen_once_and_freezing_is_idempotent(tiny_model_dir):
    model = BiEncoder.from_pretrained(str(tiny_model_dir), config=BiEncoderConfig(shared=True))
    embeddings = sum(p.numel() for p in model.query_encoder.embeddings.parameters())
    layer = sum(p.numel() for p in model.query_encoder.encoder.layer[0].parameters())
    assert freeze_bottom(model, 1) == embeddings + layer
    assert freeze_bottom(model, 1) == embeddings + layer
    assert freeze_bottom(model, 0) == embeddings  # only counts what it asks for; nothing is unfrozen
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert trainable and all(id(p) not in trainable for p in model.query_encoder.embeddings.parameters())


def test_bad_values_are_one_line_errors_before_any_work(tiny_beir, tiny_model_dir, tmp_path):
    model = BiEncoder.from_pretrained(str(tiny_model_dir))
    layers = model.query_encoder.config.num_hidden_layers
    with pytest.raises(ConfigError, match=f"freeze_layers={layers + 1} but the encoder has {layers} layers"):
        freeze_bottom(model, layers + 1)
    assert all(p.requires_grad for p in model.parameters())  # the error came before any change
    with pytest.raises(ConfigError, match="whole number >= 0"):
        freeze_bottom(model, -1)
    with pytest.raises(ConfigError, match="freeze_layers"):
        load_config(None, ["train.freeze_layers=-1"])
    overrides = [*small_run_overrides(tiny_beir, tiny_model_dir, tmp_path, "g"), f"train.freeze_layers={layers + 1}"]
    with pytest.raises(ConfigError, match="but the encoder has"):
        run_experiment(load_config(None, overrides))
    assert not (tmp_path / "g" / "config.yaml").exists()  # refused before the run was recorded


@pytest.mark.parametrize("kind", ["SpladeEncoder", "ColBERT"])
def test_splade_and_colbert_freeze_the_bottom_of_their_encoder(tiny_model_dir, tiny_beir, tmp_path, kind):
    """train.freeze_layers on the other model kinds (an AttributeError traceback before: it looked for a
    bi-encoder's towers); and dp.train refuses too many layers before it writes or mines anything."""
    import densepass as dp

    model = getattr(dp, kind).from_pretrained(str(tiny_model_dir))
    encoder = model.mlm.bert if kind == "SpladeEncoder" else model.encoder
    expected = {id(p) for module in (encoder.embeddings, encoder.encoder.layer[0]) for p in module.parameters()}
    assert freeze_bottom(model, 1) == sum(p.numel() for p in encoder.parameters() if id(p) in expected)
    assert {id(p) for p in model.parameters() if not p.requires_grad} == expected
    layers = len(encoder.encoder.layer)
    with pytest.raises(ConfigError, match=f"^freeze_layers={layers + 1} but the encoder has {layers} layers$"):
        dp.train(model, str(tiny_beir), args=TrainConfig(freeze_layers=layers + 1), output_dir=tmp_path / "t")
    assert not (tmp_path / "t").exists()
