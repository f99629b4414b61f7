"""Encoding walks a model's modules (``to``, ``eval``, ``train``) only where its device or mode must change: a
service encodes a few texts per call and would otherwise pay the walks on every request. The mode a model was in
is kept, and the embeddings are those of a model placed and put in eval mode the plain way."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

import densepass as dp
from conftest import save_tiny_bert
from densepass.serve.backends import Embedder

TEXTS = ["a video player", "mail server for the desktop", "image viewer"]


def counting(monkeypatch) -> dict[str, int]:
    calls = {"to": 0, "train": 0}
    to, train = nn.Module.to, nn.Module.train

    def counted_to(self, *args, **kwargs):
        calls["to"] += 1
        return to(self, *args, **kwargs)

    def counted_train(self, mode=True):
        calls["train"] += 1
        return train(self, mode)

    monkeypatch.setattr(nn.Module, "to", counted_to)
    monkeypatch.setattr(nn.Module, "train", counted_train)
    return calls


def test_a_placed_model_in_eval_mode_is_not_walked_again(tiny_model_dir, monkeypatch):
    model = dp.BiEncoder.from_pretrained(str(tiny_model_dir))
    cpu = torch.device("cpu")
    reference = model.to(cpu).eval().encode_passages(TEXTS, show_progress=False, device=cpu, precision="fp32")
    calls = counting(monkeypatch)
    again = model.encode_passages(TEXTS, show_progress=False, device=cpu, precision="fp32")
    assert calls == {"to": 0, "train": 0}
    np.testing.assert_array_equal(again, reference)


def test_a_model_in_training_mode_is_encoded_in_eval_mode_and_left_training(tmp_path):
    model = dp.BiEncoder.from_pretrained(str(save_tiny_bert(tmp_path / "model", dropout=0.5)))
    cpu = torch.device("cpu")
    reference = model.eval().encode_passages(TEXTS, show_progress=False, device=cpu, precision="fp32")
    model.train()
    out = model.encode_passages(TEXTS, show_progress=False, device=cpu, precision="fp32")
    assert all(m.training for m in model.modules())
    np.testing.assert_array_equal(out, reference)  # dropout (0.5) was off while encoding


def test_the_service_embedder_puts_its_model_in_eval_mode_once(tiny_model_dir, monkeypatch):
    model = dp.BiEncoder.from_pretrained(str(tiny_model_dir)).train()
    embedder = Embedder(model, str(tiny_model_dir), torch.device("cpu"), "fp32", 8)
    assert not any(m.training for m in model.modules())
    calls = counting(monkeypatch)
    (vector, tokens), *_ = embedder.embed(TEXTS, "passage")
    assert calls == {"to": 0, "train": 0} and vector.shape == (model.dim,) and tokens > 0
