"""Bi-encoder save/load: our loader, transformers.AutoModel and SentenceTransformer agree."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModel

from densepass.errors import ConfigError
from densepass.models.biencoder import BiEncoder, BiEncoderConfig, token_pooling
from densepass.models.encode import encode_texts
from densepass.models.inputs import forward_in_pieces

TEXTS = ["audio editor for the terminal", "a python library", "fonts [SEP] a collection of free fonts"]


@pytest.mark.parametrize("pooling", ["mean", "cls"])
@pytest.mark.parametrize("projection_dim", [None, 25])
def test_save_load_roundtrip_all_loaders(tiny_model_dir, tmp_path, pooling, projection_dim):
    from sentence_transformers import SentenceTransformer

    config = BiEncoderConfig(pooling=pooling, projection_dim=projection_dim, normalize=True)
    model = BiEncoder.from_pretrained(str(tiny_model_dir), config=config)
    # fp32 pinned: sentence-transformers and transformers below compute in fp32, and auto is bf16 on a CPU with it
    expected = encode_texts(model, TEXTS, "passage", precision="fp32", show_progress=False)
    assert expected.shape == (3, projection_dim or 32)
    model.save(tmp_path / "saved")

    ours = BiEncoder.from_pretrained(str(tmp_path / "saved"))
    assert ours.config == config
    np.testing.assert_allclose(
        encode_texts(ours, TEXTS, "passage", precision="fp32", show_progress=False), expected, atol=1e-5
    )

    st = SentenceTransformer(str(tmp_path / "saved"), device="cpu")
    np.testing.assert_allclose(st.encode(TEXTS, convert_to_numpy=True), expected, atol=1e-5)

    hf = AutoModel.from_pretrained(str(tmp_path / "saved"))
    tokens = model.tokenizer(TEXTS, padding=True, truncation=True, max_length=128, return_tensors="pt")
    with torch.no_grad():
        pooled = token_pooling(hf(**tokens).last_hidden_state, tokens["attention_mask"], pooling)
        if projection_dim is None:
            np.testing.assert_allclose(torch.nn.functional.normalize(pooled, dim=-1).numpy(), expected, atol=1e-5)


def test_separate_towers_saved_in_query_subdir(tiny_model_dir, tmp_path):
    from sentence_transformers import SentenceTransformer

    model = BiEncoder.from_pretrained(str(tiny_model_dir), config=BiEncoderConfig(shared=False))
    assert model.query_encoder is not model.passage_encoder
    with torch.no_grad():
        next(model.query_encoder.parameters()).add_(0.5)  # make the towers differ
    q = encode_texts(model, TEXTS, "query", precision="fp32", show_progress=False)
    p = encode_texts(model, TEXTS, "passage", precision="fp32", show_progress=False)
    assert not np.allclose(q, p)
    model.save(tmp_path / "m")
    loaded = BiEncoder.from_pretrained(str(tmp_path / "m"))
    np.testing.assert_allclose(
        encode_texts(loaded, TEXTS, "query", precision="fp32", show_progress=False), q, atol=1e-5
    )
    np.testing.assert_allclose(
        encode_texts(loaded, TEXTS, "passage", precision="fp32", show_progress=False), p, atol=1e-5
    )
    st_query = SentenceTransformer(str(tmp_path / "m" / "query"), device="cpu")
    np.testing.assert_allclose(st_query.encode(TEXTS), q, atol=1e-5)


def test_interrupted_save_keeps_previous_model(tiny_model_dir, tmp_path, monkeypatch):
    model = BiEncoder.from_pretrained(str(tiny_model_dir))
    model.save(tmp_path / "m")
    before = encode_texts(BiEncoder.from_pretrained(str(tmp_path / "m")), TEXTS, "passage", show_progress=False)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(BiEncoder, "_save_tower", broken)
    with pytest.raises(OSError):
        model.save(tmp_path / "m")
    after = encode_texts(BiEncoder.from_pretrained(str(tmp_path / "m")), TEXTS, "passage", show_progress=False)
    np.testing.assert_array_equal(before, after)
    assert [p.name for p in tmp_path.iterdir()] == ["m"]


def test_default_model_is_minilm():
    model = BiEncoder.from_pretrained("all-MiniLM-L6-v2")
    assert model.dim == 384 and model.config.pooling == "mean"
    assert model.query_encoder.config.num_hidden_layers == 6


def test_bad_model_configs(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="pooling"):
        BiEncoder.from_pretrained(str(tiny_model_dir), config=BiEncoderConfig(pooling="max"))
    with pytest.raises(ConfigError, match="temperature"):
        BiEncoder.from_pretrained(str(tiny_model_dir), config=BiEncoderConfig(temperature=0))
    with pytest.raises(ConfigError, match="not a model directory"):
        BiEncoder.from_pretrained(str(tmp_path))
    with pytest.raises(ConfigError, match="model not found"):
        BiEncoder.from_pretrained(str(tmp_path / "missing"))


def masked_row_sum(tokens):
    """A per-row output that reads only unmasked positions, and knows their position."""
    positions = torch.arange(1, tokens["input_ids"].shape[1] + 1, dtype=torch.float64)
    return (tokens["input_ids"].double() * positions * tokens["attention_mask"]).sum(1, keepdim=True)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 12), min_size=1, max_size=20), max_tokens=st.integers(1, 60), left=st.booleans())
def test_forward_in_pieces_puts_every_row_back_in_order(lengths, max_tokens, left):
    """Pieces cut to their longest row (right padding) or kept whole (left padding) give exactly the
    rows of one whole call, in input order."""
    width = max(lengths) + 2
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        if left:
            mask[i, width - n :] = 1
        else:
            mask[i, :n] = 1
    ids = torch.randint(1, 1000, mask.shape) * mask
    tokens = {"input_ids": ids, "attention_mask": mask, "token_type_ids": torch.zeros_like(ids)}
    seen = []

    def fn(piece):
        seen.append(piece["input_ids"].shape)
        return masked_row_sum(piece)

    out = forward_in_pieces(fn, tokens, max_tokens)
    assert torch.equal(out, masked_row_sum(tokens))
    if len(lengths) * width > max_tokens:
        assert sum(rows for rows, _ in seen) == len(lengths)
        assert all(rows == 1 or rows * cols <= max_tokens for rows, cols in seen)


def test_forward_in_pieces_matches_one_encoder_forward(tiny_model_dir):
    model = BiEncoder.from_pretrained(str(tiny_model_dir))
    texts = ["a", "python library for fonts", "kernel", "an audio and video editor for the terminal"] * 3
    tokens = model.tokenize(texts, "passage")
    run = lambda piece: model(piece["input_ids"], piece["attention_mask"], side="passage")  # noqa: E731
    torch.testing.assert_close(forward_in_pieces(run, tokens, 16), run(tokens), rtol=1e-5, atol=1e-6)
    assert torch.equal(forward_in_pieces(run, tokens, None), run(tokens))
    with pytest.raises(ConfigError, match="piece size"):
        forward_in_pieces(run, tokens, 0)


@pytest.mark.parametrize("length", [30, 32])
def test_any_max_length_tokenises_not_only_multiples_of_eight(tiny_model_dir, length):
    """transformers refuses pad_to_multiple_of=8 with a truncation length it does not divide: a query length
    of 30 used to fail every call."""
    model = BiEncoder.from_pretrained(str(tiny_model_dir), config=BiEncoderConfig(query_max_length=length))
    tokens = model.tokenize(["audio " * 50, "a font"], "query")
    assert tokens["input_ids"].shape == (2, length)
    assert tokens["attention_mask"][1].sum() < length


def test_an_encoding_batch_size_below_one_is_one_line_not_a_hang(tiny_model_dir):
    from densepass.errors import ConfigError
    from densepass.models.biencoder import BiEncoder

    model = BiEncoder.from_pretrained(str(tiny_model_dir))
    for bad in (0, -1, False, 2.5):
        with pytest.raises(ConfigError, match="batch_size must be a whole number"):
            model.encode_passages(["audio editor"], batch_size=bad, show_progress=False)
