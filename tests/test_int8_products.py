"""int8 products on AVX512-VNNI (models.cpu_kernels.Int8Linear): the kernel against a float64 reference of the same
quantised maths (a scale per token, a scale per weight row, exact integer sums), on random inputs and shapes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

from densepass.models import cpu_kernels

runs = pytest.mark.skipif(
    not cpu_kernels.usable(torch.zeros(1, dtype=torch.bfloat16), 32), reason="densepass's CPU kernels do not run here"
)


def reference(layer: cpu_kernels.Int8Linear, x: torch.Tensor) -> torch.Tensor:
    """What ``Int8Linear`` computes, slowly: each row quantised as the kernel does (in float32), the integer sums
    in float64 (exact), rescaled in float32."""
    xf = x.float()
    top = xf.abs().amax(dim=1).numpy()
    with np.errstate(divide="ignore"):  # IEEE division, as the kernel's (torch's scalar division multiplies by
        inverse = torch.from_numpy(np.where(top > 0, np.float32(127) / top, 0).astype(np.float32))  # a reciprocal)
    q = torch.round(xf * inverse[:, None]).clamp(-127, 127)
    scale = torch.from_numpy((top / np.float32(127)).astype(np.float32))
    sums = (q.double() @ layer.weight.double().T).float()  # exact: |sum| < 2^24 at these depths
    y = sums * scale[:, None] * layer.scale[None, :]
    return y + (0 if layer.bias is None else layer.bias.float())


@runs
@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 70),
    depth=st.sampled_from([16, 32, 48, 384]),
    width=st.sampled_from([32, 64, 96]),
    bias=st.booleans(),
    zero_rows=st.integers(0, 2),
    seed=st.integers(0, 10_000),
)
def test_the_kernel_computes_the_quantised_product(rows, depth, width, bias, zero_rows, seed):
    torch.manual_seed(seed)
    linear = nn.Linear(depth, width, bias=bias)
    layer = cpu_kernels.Int8Linear(linear)
    x = (torch.randn(rows, depth) * torch.rand(rows, 1) * 4).bfloat16()
    x[: min(zero_rows, rows)] = 0  # a row of zeros has scale 0: its output is the bias
    got = layer(x).float()
    expected = reference(layer, x)
    # the same integer sums, rescaled in float32, then rounded to bf16 (half of its 2^-7 spacing)
    torch.testing.assert_close(got, expected, rtol=2**-8, atol=1e-6 * float(expected.abs().max() + 1e-3))
    # and close to the float layer: a scale per token keeps the product within a few percent of its scale
    error = (got - linear(x.float()).detach()).abs().max()
    assert error <= 0.05 * float(linear(x.float()).detach().abs().max() + 1e-3)


def test_the_weights_are_int8_with_a_scale_per_row_and_laid_out_for_vpdpbusd():
    torch.manual_seed(0)
    weight = torch.randn(32, 16)
    weight[3] = 0
    q, scale = cpu_kernels.quantized_weight(weight)
    assert q.dtype == torch.int8 and q.abs().max() == 127 and scale[3] == 1 and (q[3] == 0).all()
    torch.testing.assert_close(q.float() * scale[:, None], weight, atol=float(scale.max()) / 2 + 1e-6, rtol=0)
    layout = cpu_kernels.vnni_layout(q)
    assert layout.shape == (2, 4, 16, 4)
    for column, k in [(0, 0), (5, 7), (17, 13), (31, 15)]:  # panel, depth quad, column in panel, depth in quad
        assert layout[column // 16, k // 4, column % 16, k % 4] == q[column, k]


def test_shapes_the_kernel_does_not_take_are_refused():
    with pytest.raises(ValueError, match="multiples of 32 outputs and 16 inputs"):
        cpu_kernels.Int8Linear(nn.Linear(20, 32))
    with pytest.raises(ValueError, match="vnni_layout takes an int8 weight"):
        cpu_kernels.vnni_layout(torch.zeros(16, 16, dtype=torch.int8))
    layer = cpu_kernels.Int8Linear(nn.Linear(32, 32))
    with pytest.raises(ValueError, match=r"bf16 \[rows, 32\]"):
        layer(torch.zeros(3, 32))


@runs
def test_fused_layers_switched_to_int8_products_stay_close_to_bf16(monkeypatch):
    """``bench_int8_products.use_int8_products`` (what bench_encode and encode_quality measure): every layer's
    products through ``Int8Linear``, the layer's output within int8's rounding of the bf16 kernels'."""
    from pathlib import Path

    from transformers import BertConfig, BertModel

    from densepass.models.fused import FusedBertEncoder

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_int8_products import use_int8_products

    torch.manual_seed(0)
    config = BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=128, max_position_embeddings=64)  # fmt: skip
    bert = BertModel(config, add_pooling_layer=False).bfloat16().eval()
    ids = torch.randint(5, 100, (3, 20))
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    bf16 = FusedBertEncoder(bert)(ids, mask).last_hidden_state.float()
    switched = FusedBertEncoder(bert)
    use_int8_products(switched)
    int8 = switched(ids, mask).last_hidden_state.float()
    kept = mask.bool()
    cosine = F.cosine_similarity(int8[kept], bf16[kept], dim=-1)
    assert cosine.min() > 0.99 and not torch.equal(int8, bf16)  # int8's rounding, and nothing else
