"""CPU dropout with NumPy masks (models.dropout): the distribution and scale of the masks, the same mask forwards
and backwards, masks that follow torch's seed (and replay), attention that equals SDPA's when nothing is dropped,
and a switch that changes neither what a model computes in evaluation nor what it saves."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import BertModel

import densepass.models.dropout as dropout_module
from conftest import tiny_bert_config
from densepass.device import RandomState
from densepass.models.dropout import ATTENTION, BITS, CpuDropout, cpu_dropout, dropout_mask, use_cpu_dropout

CPU = torch.device("cpu")


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_each_element_is_dropped_with_probability_p_and_kept_ones_keep_the_expectation(p):
    torch.manual_seed(0)
    n = 1_000_000
    out = cpu_dropout(torch.ones(n), p)
    dropped = float((out == 0).float().mean())
    assert abs(dropped - p) < 5 * (p * (1 - p) / n) ** 0.5  # five standard deviations
    threshold = round((1 - p) * 2**BITS)
    kept = out[out != 0]
    assert torch.all(kept == torch.tensor(2**BITS / threshold))  # 1 / keep probability, that probability to 2^-16
    assert abs(float(out.mean()) - 1.0) < 5 * (p / ((1 - p) * n)) ** 0.5


def test_no_dropout_when_not_training_with_p_zero_and_an_empty_tensor():
    x = torch.randn(100)
    assert torch.equal(cpu_dropout(x, 0.5, training=False), x)
    assert torch.equal(cpu_dropout(x, 0.0), x)
    assert cpu_dropout(torch.ones(0), 0.5).shape == (0,)


def test_the_gradient_goes_through_the_forward_mask():
    torch.manual_seed(1)
    x = (torch.rand(4, 50) + 0.5).requires_grad_()  # no zero inputs: a zero output means a dropped element
    out = cpu_dropout(x, 0.3)
    weights = torch.randn(4, 50)
    (out * weights).sum().backward()
    keep = out.detach() != 0
    scale = 2**BITS / round(0.7 * 2**BITS)
    torch.testing.assert_close(x.grad, weights * keep * scale)
    assert 0 < keep.sum() < keep.numel()


def test_masks_follow_torch_seed_and_replay_under_a_random_state():
    shape = torch.Size([3, 1000])
    torch.manual_seed(5)
    first, _ = dropout_mask(shape, 0.2)
    second, _ = dropout_mask(shape, 0.2)
    torch.manual_seed(5)
    assert torch.equal(dropout_mask(shape, 0.2)[0], first)
    assert not torch.equal(first, second)  # each call draws a new seed
    state = RandomState(CPU)
    drawn, _ = dropout_mask(shape, 0.2)
    with state.replay():
        assert torch.equal(dropout_mask(shape, 0.2)[0], drawn)


def _tiny_bert(attention_dropout: float, hidden_dropout: float) -> BertModel:
    torch.manual_seed(0)
    return BertModel(tiny_bert_config(100, hidden_dropout, attention_dropout), add_pooling_layer=False)


IDS = torch.tensor([[2, 10, 11, 12, 3, 0, 0], [2, 20, 21, 22, 23, 24, 3]])
MASK = (IDS != 0).long()


def test_attention_with_nothing_dropped_equals_sdpa_attention(monkeypatch):
    """With every mask element kept (scale 1), the switched model in training computes what the original computes
    without dropout: the attention (padding mask included) is SDPA's."""
    model = _tiny_bert(attention_dropout=0.5, hidden_dropout=0.0)
    expected = model.eval()(input_ids=IDS, attention_mask=MASK).last_hidden_state
    use_cpu_dropout(model, CPU)
    assert model.config._attn_implementation == ATTENTION
    calls = []

    def keep_all(shape, p):
        calls.append(p)
        return torch.ones(shape, dtype=torch.bool), 1.0

    monkeypatch.setattr(dropout_module, "dropout_mask", keep_all)
    got = model.train()(input_ids=IDS, attention_mask=MASK).last_hidden_state
    assert calls == [0.5, 0.5]  # one attention dropout per layer
    valid = MASK.bool()  # padded positions' outputs are not compared (they attend like any other row)
    torch.testing.assert_close(got[valid], expected[valid], rtol=1e-5, atol=1e-5)


def test_the_switch_changes_no_evaluation_output_and_nothing_saved(tmp_path):
    model = _tiny_bert(attention_dropout=0.1, hidden_dropout=0.1).eval()
    before = model(input_ids=IDS, attention_mask=MASK).last_hidden_state
    state = {k: v.clone() for k, v in model.state_dict().items()}
    use_cpu_dropout(model, CPU)
    assert not any(type(m) is torch.nn.Dropout for m in model.modules())
    assert any(isinstance(m, CpuDropout) for m in model.modules())
    torch.testing.assert_close(model(input_ids=IDS, attention_mask=MASK).last_hidden_state, before)
    assert model.state_dict().keys() == state.keys()
    model.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert ATTENTION not in json.dumps(saved)
    reloaded = BertModel.from_pretrained(tmp_path / "saved", add_pooling_layer=False).eval()
    assert reloaded.config._attn_implementation == "sdpa"
    torch.testing.assert_close(reloaded(input_ids=IDS, attention_mask=MASK).last_hidden_state, before)


def test_training_outputs_are_random_and_seeded():
    model = use_cpu_dropout(_tiny_bert(attention_dropout=0.2, hidden_dropout=0.1), CPU).train()

    def forward(seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        return model(input_ids=IDS, attention_mask=MASK).last_hidden_state

    torch.testing.assert_close(forward(3), forward(3), rtol=0, atol=0)
    assert not torch.allclose(forward(3), forward(4))


def test_nothing_changes_off_the_cpu():
    model = _tiny_bert(attention_dropout=0.1, hidden_dropout=0.1)
    use_cpu_dropout(model, torch.device("cuda"))  # nothing is moved or run: only the switch is skipped
    assert model.config._attn_implementation == "sdpa"
    assert any(type(m) is torch.nn.Dropout for m in model.modules())
