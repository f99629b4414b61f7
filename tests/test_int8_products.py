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

from conftest import needs_onednn_bf16
from densepass.models import cpu_kernels

runs = pytest.mark.skipif(
    not cpu_kernels.usable(torch.zeros(1, dtype=torch.bfloat16), 32), reason="densepass's CPU kernels do not run here"
)


def reference(layer: cpu_kernels.Int8Linear, x: torch.Tensor) -> torch.Tensor:
    """What ``Int8Linear`` computes, slowly: each row quantised over its range as the kernel does (in float32), the
    integer sums in float64 (exact), rescaled in float32, then GELU (exact, erf) where the layer has it."""
    xf = x.float()
    low = xf.amin(dim=1)
    span = (xf.amax(dim=1) - low).numpy()
    with np.errstate(divide="ignore"):  # IEEE division, as the kernel's (torch's scalar division multiplies by
        inverse = torch.from_numpy(np.where(span > 0, np.float32(255) / span, 0).astype(np.float32))  # a reciprocal)
    q = torch.round((xf - low[:, None]) * inverse[:, None]).clamp(0, 255)
    scale = torch.from_numpy((span / np.float32(255)).astype(np.float32))
    sums = (q.double() @ layer.weight.double().T).float()  # exact: |sum| < 2^24 at these depths
    y = (sums * scale[:, None] + low[:, None] * layer.sums[None, :]) * layer.scale[None, :]
    y = y + (0 if layer.bias is None else layer.bias.float())
    return F.gelu(y) if layer.gelu else y


@runs
@settings(max_examples=30, deadline=None)
@given(
    rows=st.integers(1, 70),
    depth=st.sampled_from([16, 32, 48, 64, 192, 384]),  # multiples of 64 on AMX tiles where they run
    width=st.sampled_from([32, 64, 96]),
    bias=st.booleans(),
    gelu=st.booleans(),
    constant_rows=st.integers(0, 2),
    skew=st.floats(-3, 3),
    seed=st.integers(0, 10_000),
)
def test_the_kernel_computes_the_quantised_product(rows, depth, width, bias, gelu, constant_rows, skew, seed):
    torch.manual_seed(seed)
    linear = nn.Linear(depth, width, bias=bias)
    layer = cpu_kernels.Int8Linear(linear, gelu=gelu)
    x = ((torch.randn(rows, depth) + skew) * torch.rand(rows, 1) * 4).bfloat16()
    x[: min(constant_rows, rows)] = skew  # a constant row has scale 0: its output is its value times the sums
    got = layer(x).float()
    expected = reference(layer, x)
    # the same integer sums, rescaled in float32, then rounded to bf16 (half of its 2^-7 spacing); GELU within
    # its polynomial's error
    torch.testing.assert_close(got, expected, rtol=2**-8, atol=1e-5 * float(expected.abs().max() + 1e-3))
    # and close to the float layer: a range per token keeps the product within a few percent of its scale
    exact = linear(x.float()).detach()
    exact = F.gelu(exact) if gelu else exact
    assert (got - exact).abs().max() <= 0.03 * float(exact.abs().max() + 1e-3)


@runs
def test_a_row_with_a_nan_or_an_infinity_gives_nan_as_a_float_product_would():
    layer = cpu_kernels.Int8Linear(nn.Linear(64, 32))
    x = torch.randn(6, 64).bfloat16()
    for row, (position, value) in enumerate(
        [(0, "nan"), (5, "nan"), (17, "nan"), (63, "nan"), (3, "inf"), (40, "-inf")]
    ):
        x[row, position] = float(value)
    clean = torch.randn(2, 64).bfloat16()
    out = layer(torch.cat([x, clean]))
    assert out[:6].isnan().all() and out[6:].isfinite().all()


@pytest.mark.skipif(cpu_kernels.kinds()[:1] != ["amx"], reason="the AMX build does not run here")
@pytest.mark.parametrize("gelu", [False, True])
def test_the_tiles_write_what_vpdpbusd_writes_bit_for_bit(gelu, tmp_path):
    """In the AMX build, depths of multiples of 64 run on tiles (``tdpbusd``): the same exact integer sums and the
    same epilogue as the AVX512-BF16 build's ``vpdpbusd``, so the same bits (the other build run in a process of
    its own, ``$DENSEPASS_CPU_KERNEL_KIND``)."""
    import os
    import subprocess
    import sys

    from safetensors.torch import load_file, save_file

    torch.manual_seed(1)
    linear = nn.Linear(384, 96)
    x = (torch.randn(77, 384) * torch.rand(77, 1) * 3 + 0.5).bfloat16()
    script = (
        "import sys\n"
        "from safetensors.torch import load_file, save_file\n"
        "from torch import nn\n"
        "from densepass.models import cpu_kernels\n"
        "assert cpu_kernels.kind() == sys.argv[2], cpu_kernels.kind()\n"
        "state = load_file(sys.argv[1])\n"
        "linear = nn.Linear(384, 96)\n"
        "linear.load_state_dict({'weight': state['weight'], 'bias': state['bias']})\n"
        "out = cpu_kernels.Int8Linear(linear, gelu=bool(state['gelu']))(state['x'])\n"
        "save_file({'out': out}, sys.argv[3])\n"
    )
    inputs = tmp_path / "inputs.safetensors"
    tensors = {"weight": linear.weight.detach(), "bias": linear.bias.detach(), "x": x, "gelu": torch.tensor(gelu)}
    save_file(tensors, inputs)
    outs = {}
    for kind in ("amx", "avx512_bf16"):
        env = {**os.environ, cpu_kernels.KIND_ENV: kind, "OMP_NUM_THREADS": "1"}
        out = tmp_path / f"{kind}.safetensors"
        subprocess.run([sys.executable, "-c", script, str(inputs), kind, str(out)], env=env, check=True,
                       capture_output=True, text=True)  # fmt: skip
        outs[kind] = load_file(out)["out"]
    assert torch.equal(outs["amx"].view(torch.int16), outs["avx512_bf16"].view(torch.int16))
    assert outs["amx"].isfinite().all() and outs["amx"].abs().max() > 0


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


def tiny_bert(seed: int = 0):
    from transformers import BertConfig, BertModel

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=30522, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=128, max_position_embeddings=128)  # fmt: skip
    return BertModel(config, add_pooling_layer=False).eval()


@runs
def test_int8_layers_stay_close_to_the_bf16_layers_and_skip_the_padding():
    """``FusedBertEncoder(int8=True)``: every product through ``Int8Linear``, the output within int8's rounding of
    the bf16 layers', zeros at the padding (its hidden states are not computed)."""
    from densepass.models.fused import FusedBertEncoder

    bert = tiny_bert().bfloat16()
    ids = torch.randint(5, 100, (3, 20))
    mask = torch.ones_like(ids)
    mask[1, 12:] = 0
    bf16 = FusedBertEncoder(bert, padding_outputs=False)(ids, mask).last_hidden_state.float()
    int8 = FusedBertEncoder(bert, padding_outputs=False, int8=True)(ids, mask).last_hidden_state.float()
    kept = mask.bool()
    cosine = F.cosine_similarity(int8[kept], bf16[kept], dim=-1)
    assert cosine.min() > 0.99 and not torch.equal(int8, bf16)  # int8's rounding, and nothing else
    assert (int8[~kept] == 0).all()


@runs
def test_int8_layers_reuse_their_buffers_without_changing_a_value():
    """The layers write their products into one workspace, the output over the input: the same values as each
    layer with buffers of its own, and a text's hidden states do not depend on the texts packed with it."""
    from densepass.models.fused import FusedBertEncoder

    encoder = FusedBertEncoder(tiny_bert().bfloat16(), padding_outputs=False, int8=True)
    ids = torch.randint(5, 100, (4, 24))
    mask = torch.ones_like(ids)
    mask[2, 9:] = 0
    together = encoder(ids, mask).last_hidden_state
    alone = encoder(ids[2:3, :9], mask[2:3, :9]).last_hidden_state
    assert torch.equal(together[2, :9], alone[0])
    kept = mask.bool()
    counts = kept.sum(1)
    x = cpu_kernels.embed(
        encoder.embeddings, ids[kept], torch.arange(24).expand_as(ids)[kept], torch.zeros_like(ids)[kept]
    )
    offsets = F.pad(counts.cumsum(0), (1, 0))
    for layer in encoder.layers:
        x = layer.packed_tokens(x, offsets, counts)  # fresh buffers for each layer
    assert torch.equal(together[kept], x)


@needs_onednn_bf16
def test_int8_layers_are_refused_where_they_cannot_run(monkeypatch):
    from densepass.models.fused import FusedBertEncoder

    bert = tiny_bert().bfloat16()
    with pytest.raises(ValueError, match="int8 layers run bf16 encoders on densepass's CPU kernels"):
        FusedBertEncoder(bert, first_position=True, int8=True)
    with pytest.raises(ValueError, match="int8 layers run bf16 encoders"):
        FusedBertEncoder(tiny_bert(), int8=True)  # float32
    monkeypatch.setenv(cpu_kernels.ENV, "0")
    with pytest.raises(ValueError, match="int8 layers run bf16 encoders"):
        FusedBertEncoder(bert, int8=True)


@runs
def test_int8_encoding_runs_the_int8_layers_where_the_kernels_run_and_dynamic_quantisation_elsewhere(
    monkeypatch, tmp_path
):
    """``precision="int8"`` (``models.encode.quantized_copy``): a BERT tower on the kernels as int8 fused layers,
    close to fp32; with the kernels switched off, torch's dynamic quantisation, as on other CPUs."""
    from transformers import AutoTokenizer

    from densepass.models.biencoder import BiEncoder, resolve_model_path
    from densepass.models.encode import encode_texts, quantized_copy
    from densepass.models.fused import FusedBertEncoder

    tiny_bert().save_pretrained(tmp_path)  # heads of 32, which the kernels take
    AutoTokenizer.from_pretrained(resolve_model_path("all-MiniLM-L6-v2")).save_pretrained(tmp_path)
    model = BiEncoder.from_pretrained(str(tmp_path))
    assert isinstance(quantized_copy(model).passage_encoder, FusedBertEncoder)
    words = "audio video editor library game network terminal python font image mail server kernel".split()
    texts = [" ".join(words[(7 * i + j) % len(words)] for j in range(3 + i % 17)) for i in range(40)]
    options = {"side": "passage", "device": torch.device("cpu"), "show_progress": False, "batch_size": 16}
    fp32 = encode_texts(model, texts, precision="fp32", **options)
    int8 = encode_texts(model, texts, precision="int8", **options)
    cosine = (fp32 * int8).sum(1) / np.linalg.norm(fp32, axis=1) / np.linalg.norm(int8, axis=1)
    assert cosine.min() > 0.99
    monkeypatch.setenv(cpu_kernels.ENV, "0")
    assert not isinstance(quantized_copy(model).passage_encoder, FusedBertEncoder)
    dynamic = encode_texts(model, texts, precision="int8", **options)  # not the fused copy cached above
    assert np.isfinite(dynamic).all() and not np.array_equal(dynamic, int8)
