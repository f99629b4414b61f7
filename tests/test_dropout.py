"""CPU dropout with counter-based masks (models.dropout): the draws against SplitMix64 computed one word at a time,
the distribution and scale of the masks, the same mask forwards and backwards, masks that follow torch's seed (and
replay), attention that equals SDPA's when nothing is dropped, and a switch that changes neither what a model
computes in evaluation nor what it saves. For each build of the CPU kernels this CPU runs (``build``: AMX,
AVX512-BF16, AVX2): their draws and dropout equal NumPy's, and the fused attention probabilities (forward and
backward) against float64 and against the unfused path."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import BertModel

import densepass.models.dropout as dropout_module
from conftest import tiny_bert_config
from densepass.device import RandomState
from densepass.models import cpu_kernels
from densepass.models.dropout import (
    ATTENTION,
    BITS,
    CpuDropout,
    _attention,
    cpu_dropout,
    draws,
    dropout_mask,
    keep_threshold,
    use_cpu_dropout,
)

CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=cpu_kernels.KINDS)
def build(request):
    """Each build of the kernels this CPU runs, loaded alone (``$DENSEPASS_CPU_KERNEL_KIND``) for the module's tests
    that take it (module-scoped: hypothesis runs many examples per test); skipped where the CPU has not its flags
    or it does not load. The build the process runs otherwise is loaded again afterwards."""
    if request.param not in cpu_kernels.kinds():
        pytest.skip(f"the CPU cannot run the {request.param} kernels")
    before = os.environ.get(cpu_kernels.KIND_ENV)
    os.environ[cpu_kernels.KIND_ENV] = request.param
    cpu_kernels._library.cache_clear()
    try:
        if not cpu_kernels.trains() or cpu_kernels.kind() != request.param:
            pytest.skip(f"the {request.param} kernels did not load")
        yield request.param
    finally:
        if before is None:
            os.environ.pop(cpu_kernels.KIND_ENV, None)
        else:
            os.environ[cpu_kernels.KIND_ENV] = before
        cpu_kernels._library.cache_clear()


def splitmix64_word(seed: int, word: int) -> int:
    """SplitMix64's output for counter ``word + 1`` under ``seed``, in Python integers (Steele, Lea & Flood 2014)."""
    mask = 2**64 - 1
    z = (seed + (word + 1) * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)


@given(st.integers(0, 2**62), st.integers(0, 10**9), st.integers(0, 70))
@settings(max_examples=50, deadline=None)
def test_the_draws_are_splitmix64_words_cut_into_four(seed, first, count):
    expected = [(splitmix64_word(seed, e // 4) >> (16 * (e % 4))) & 0xFFFF for e in range(first, first + count)]
    assert draws(seed, count, first).tolist() == expected


def test_numpy_draws_across_chunks_equal_the_draws_of_their_parts():
    whole = draws(3, 300_000, 5)
    assert np.array_equal(whole[131_070:131_090], draws(3, 20, 5 + 131_070))
    assert np.array_equal(whole[-7:], draws(3, 7, 5 + 300_000 - 7))


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

    def keep_all(p):
        calls.append(p)
        return 1 << BITS, 1.0  # every draw is below 2^16

    monkeypatch.setattr(dropout_module, "keep_threshold", keep_all)
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


@given(st.integers(0, 2**62), st.integers(0, 10**9), st.integers(1, 200))
@settings(max_examples=40, deadline=None)
def test_the_kernels_draw_what_numpy_draws(build, seed, first, count):
    assert cpu_kernels.dropout_draws(seed, count, first).tolist() == draws(seed, count, first).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@given(n=st.integers(1, 9000), p=st.sampled_from([0.1, 0.5, 0.97, 1.0]), seed=st.integers(0, 2**62))
@settings(max_examples=25, deadline=None)
def test_kernel_dropout_equals_numpy_dropout(build, dtype, n, p, seed):
    x = torch.randn(n).to(dtype)
    threshold, scale = keep_threshold(p)
    keep = torch.from_numpy(draws(seed, n) < threshold)
    expected = torch.where(keep, x, 0).mul_(scale)  # torch's own product, rounded as torch rounds bf16
    assert torch.equal(cpu_kernels.dropout(x, seed, threshold, scale), expected)


def _reference_probs(scores, mask, scale, seed, p):
    """float64 dropout(softmax(scale scores)) over the kept keys, as torch computes it: the probabilities, the
    dropped-out probabilities, and the keep mask; a row without keys gets uniform probabilities."""
    s = scores.double() * scale
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    empty = torch.isinf(s).all(-1, keepdim=True)
    probs = torch.where(empty, 1.0 / s.shape[-1], torch.softmax(s.masked_fill(empty, 0.0), -1))
    threshold, keep_scale = keep_threshold(p)
    keep = torch.from_numpy(draws(seed, scores.numel()) < threshold).view(scores.shape)
    return probs, probs * keep * keep_scale, keep


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@given(
    batch=st.integers(1, 3),
    heads=st.integers(1, 3),
    queries=st.integers(1, 20),
    keys=st.integers(1, 150),
    mask_kind=st.sampled_from(["none", "keys", "full"]),
    p=st.sampled_from([0.1, 0.5]),
    seed=st.integers(0, 2**62),
)
@settings(max_examples=40, deadline=None)
def test_softmax_dropout_forward_and_backward_against_float64(
    build, dtype, batch, heads, queries, keys, mask_kind, p, seed
):
    """bf16 within bf16's rounding (and the probabilities it keeps in bf16), float32 within float32's."""
    generator = torch.Generator().manual_seed(seed % 2**31)
    scores = (torch.randn(batch, heads, queries, keys, generator=generator) * 3).to(dtype)
    tolerance = {"rtol": 1e-2, "atol": 2e-3} if dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-6}
    mask = None
    if mask_kind == "keys":  # key padding, broadcast over heads and queries, one row without keys at most
        mask = torch.rand(batch, 1, 1, keys, generator=generator) > 0.3
    elif mask_kind == "full":
        mask = torch.rand(batch, 1, queries, keys, generator=generator) > 0.3
    scale = 0.35
    threshold, keep_scale = keep_threshold(p)
    out, probs = cpu_kernels.softmax_dropout(scores, mask, scale, seed, threshold, keep_scale)
    expected_probs, expected_out, keep = _reference_probs(scores, mask, scale, seed, p)
    empty = (torch.zeros_like(expected_probs, dtype=torch.bool) if mask is None
             else ~mask.expand_as(expected_probs).any(-1, keepdim=True).expand_as(expected_probs))  # fmt: skip
    assert out.dtype == probs.dtype == dtype
    torch.testing.assert_close(out.double(), expected_out, **tolerance)
    torch.testing.assert_close(probs.double(), expected_probs.masked_fill(empty, 0.0), **tolerance)

    grad = torch.randn(scores.shape, generator=generator).to(dtype)
    reference = scores.double().requires_grad_()
    s = reference * scale
    if mask is not None:
        s = s.masked_fill(~mask, torch.finfo(torch.float64).min)  # the unfused path's fill: zero gradient there
    (torch.softmax(s, -1) * keep * keep_scale * grad.double()).sum().backward()
    got = cpu_kernels.softmax_dropout_backward(grad, probs, scale, seed, threshold, keep_scale)
    # the probabilities are kept in bf16 (2^-9 relative), so each row's sum c = sum_j dP_j P_j carries an error of
    # about 2^-9 max |P dP|, as large as bf16's rounding of dP itself: the tolerance is on that scale
    scale_of_terms = float((expected_probs * (grad.double() * keep * keep_scale).abs()).max())
    assert got.dtype == dtype
    if dtype == torch.bfloat16:
        torch.testing.assert_close(got.double(), reference.grad, rtol=2e-2, atol=1e-2 * scale_of_terms * scale + 1e-6)
    else:
        torch.testing.assert_close(got.double(), reference.grad, rtol=1e-4, atol=1e-5 * scale_of_terms * scale + 1e-7)


@pytest.mark.parametrize("autocast", [True, False])
@pytest.mark.parametrize("masked", [False, True])
def test_fused_attention_equals_the_unfused_path(build, monkeypatch, masked, autocast):
    """The same seed gives the same masks on both paths, so the fused kernel's attention output and the gradients
    of queries, keys and values equal the torch operations' (DENSEPASS_CPU_KERNELS=0): to bf16 rounding under
    autocast, to float32 rounding in float32."""

    class Module:
        is_causal = False

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 4, 37, 32, generator=generator).requires_grad_() for _ in range(3))
    mask = None
    if masked:
        mask = torch.ones(3, 1, 37, 37, dtype=torch.bool)
        mask[0, ..., 30:] = mask[2, ..., 5:] = False

    def run() -> tuple[torch.Tensor, ...]:
        for x in (q, k, v):
            x.grad = None
        torch.manual_seed(7)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out, _ = _attention(Module(), q, k, v, mask, 0.2)
        out.float().pow(2).sum().backward()
        return out.detach().float(), q.grad, k.grad, v.grad

    fused = run()
    monkeypatch.setenv(cpu_kernels.ENV, "0")
    unfused = run()
    relative = 3e-2 if autocast else 1e-5
    for got, expected in zip(fused, unfused):
        assert got.abs().sum() > 0
        torch.testing.assert_close(got, expected, rtol=relative, atol=relative * float(expected.abs().max()))
