"""wise-ft weight interpolation: against an element-by-element reference, its ends, tied modules, bad input,
and the run option that saves the interpolated model."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import small_run_overrides
from densepass.config import load_config
from densepass.errors import ConfigError
from densepass.models.biencoder import BiEncoder, BiEncoderConfig
from densepass.models.interpolate import interpolate_weights, snapshot
from densepass.pipelines.experiment import run_experiment


def perturbed(model: BiEncoder, seed: int) -> BiEncoder:
    """``model`` with every floating tensor moved by seeded noise (a stand-in for fine-tuning)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for tensor in model.state_dict().values():
            if tensor.is_floating_point():
                tensor.add_(torch.randn(tensor.shape, generator=generator) * 0.1)
    return model


def reference(start: dict[str, np.ndarray], tuned: dict[str, np.ndarray], alpha: float) -> dict[str, np.ndarray]:
    """(1 - alpha) * start + alpha * tuned, one element at a time, in float64."""
    out = {}
    for name, values in tuned.items():
        if values.dtype.kind != "f":
            out[name] = values
            continue
        flat_start, flat_tuned = start[name].reshape(-1), values.reshape(-1)
        mixed = np.array([(1 - alpha) * float(a) + alpha * float(b) for a, b in zip(flat_start, flat_tuned)])
        out[name] = mixed.reshape(values.shape)
    return out


def as_numpy(model: torch.nn.Module) -> dict[str, np.ndarray]:
    return {name: tensor.detach().numpy().copy() for name, tensor in model.state_dict().items()}


@settings(max_examples=8, deadline=None)
@given(alpha=st.floats(0.0, 1.0), seed=st.integers(0, 1000))
def test_interpolation_matches_an_element_by_element_reference(tiny_model_dir, alpha, seed):
    start = BiEncoder.from_pretrained(str(tiny_model_dir))
    model = perturbed(BiEncoder.from_pretrained(str(tiny_model_dir)), seed)
    expected = reference(as_numpy(start), as_numpy(model), alpha)
    interpolate_weights(model, snapshot(start), alpha)
    for name, values in as_numpy(model).items():
        np.testing.assert_allclose(values, expected[name], rtol=1e-6, atol=1e-6, err_msg=name)


def test_the_ends_are_the_two_models_and_a_shared_encoder_is_mixed_once(tiny_model_dir):
    start = BiEncoder.from_pretrained(str(tiny_model_dir))
    tuned = as_numpy(perturbed(BiEncoder.from_pretrained(str(tiny_model_dir)), 1))
    for alpha, want in ((0.0, as_numpy(start)), (1.0, tuned)):
        model = perturbed(BiEncoder.from_pretrained(str(tiny_model_dir)), 1)
        interpolate_weights(model, snapshot(start), alpha)
        for name, values in as_numpy(model).items():
            np.testing.assert_array_equal(values, want[name], err_msg=f"alpha={alpha} {name}")
    # One encoder serves both towers: its weights appear twice in the state dict and must move once.
    model = perturbed(BiEncoder.from_pretrained(str(tiny_model_dir)), 1)
    assert model.query_encoder is model.passage_encoder
    interpolate_weights(model, snapshot(start), 0.5)
    name = "query_encoder.embeddings.word_embeddings.weight"
    np.testing.assert_allclose(
        model.state_dict()[name].numpy(), 0.5 * as_numpy(start)[name] + 0.5 * tuned[name], rtol=1e-6, atol=1e-7
    )


def test_mismatched_weights_and_bad_alpha_fail_before_any_change(tiny_model_dir):
    model = BiEncoder.from_pretrained(str(tiny_model_dir))
    before = as_numpy(model)
    projected = BiEncoder.from_pretrained(str(tiny_model_dir), BiEncoderConfig(projection_dim=8))
    with pytest.raises(ConfigError, match="cannot interpolate: the starting weights lack"):
        interpolate_weights(model, snapshot(projected), 0.5)
    wrong_shape = snapshot(model)
    wrong_shape["query_encoder.pooler.dense.bias"] = torch.zeros(3)
    with pytest.raises(ConfigError, match=r"cannot interpolate query_encoder.pooler.dense.bias: shape \(3,\)"):
        interpolate_weights(model, wrong_shape, 0.5)
    for alpha in (-0.1, 1.5, "0.5", True):
        with pytest.raises(ConfigError, match="alpha must be a number in"):
            interpolate_weights(model, snapshot(model), alpha)
    for name, values in as_numpy(model).items():
        np.testing.assert_array_equal(values, before[name])


def test_a_run_with_wise_ft_saves_the_interpolated_model(tiny_beir, tiny_model_dir, tmp_path):
    overrides = [
        *small_run_overrides(tiny_beir, tiny_model_dir, tmp_path, "w"),
        "train.batch_size=8",
        "train.learning_rate=1e-3",
        "train.wise_ft=0.25",
    ]
    results = run_experiment(load_config(None, overrides))
    run_dir = tmp_path / "w"
    start = as_numpy(BiEncoder.from_pretrained(str(tiny_model_dir)))
    tuned = as_numpy(BiEncoder.from_pretrained(str(run_dir / "model-fine-tuned")))
    saved = as_numpy(BiEncoder.from_pretrained(str(run_dir / "model")))
    name = "query_encoder.encoder.layer.0.attention.self.query.weight"
    assert np.abs(tuned[name] - start[name]).max() > 1e-4  # training moved the weights
    for key, values in saved.items():
        np.testing.assert_allclose(values, 0.75 * start[key] + 0.25 * tuned[key], rtol=1e-5, atol=1e-6, err_msg=key)
    assert "fine-tuned" in results
    with pytest.raises(ConfigError, match="wise_ft"):
        load_config(None, ["train.wise_ft=1.5"])
    with pytest.raises(ConfigError, match="train.wise_ft interpolates fine-tuned weights: it needs train.enabled"):
        run_experiment(load_config(None, [*overrides, "train.enabled=false"]))
