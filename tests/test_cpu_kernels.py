"""The C++ CPU kernels of the fused layers (``models.cpu_kernels``): attention over packed sequences and layer norm
against slow float64 references on random inputs, the fused encoder that runs them against ``transformers``, and
how the kernels are built, cached, refused and turned off. The numeric tests run where the CPU has AMX or
AVX512-BF16, on the build it runs (they skip elsewhere; tests/test_cpu_kernel_kinds.py runs each build the CPU has);
the build tests wherever a C++ compiler is found."""

from __future__ import annotations

import ctypes
import hashlib
import json
import math
import os
import shutil
import stat
import subprocess
import types
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import functional as F
from transformers.models.bert.modeling_bert import BertEmbeddings

from conftest import ONEDNN_BF16
from densepass.device import cpuinfo_words
from densepass.errors import ConfigError
from densepass.models import cpu_kernels
from densepass.models.fused import FusedBertEncoder
from test_fused import random_encoder, right_padded

BF16 = torch.bfloat16
available = cpu_kernels.usable(torch.zeros(1, dtype=BF16), 32)
needs_kernels = pytest.mark.skipif(not available, reason="the CPU kernels need AMX or AVX512-BF16")
HEADS = {"heads": st.integers(1, 3), "size": st.sampled_from([32, 64])}  # 1-3 heads of the sizes the kernels take
needs_compiler = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++")


def packed(seed: int, lengths: list[int], heads: int, size: int, spread: float = 2.0) -> tuple[torch.Tensor, ...]:
    """Random bf16 queries, keys and values of sequences of ``lengths`` packed one after the other, [tokens,
    3 x heads x size], and their offsets. ``spread`` scales them, so attention is far from uniform."""
    generator = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(sum(lengths), 3 * heads * size, generator=generator) * spread).to(BF16)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    return qkv, offsets


def reference_attention(qkv: torch.Tensor, offsets: torch.Tensor, heads: int, keys: list[int] | None = None):
    """softmax(q k^T / sqrt(size)) v per sequence and head over its first ``keys[b]`` tokens (default: all), in
    float64, one loop step at a time; zero for a sequence without keys."""
    width = qkv.shape[1] // 3
    size = width // heads
    out = torch.zeros(qkv.shape[0], width, dtype=torch.float64)
    for b, (start, end) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
        rows = qkv[start:end].double()
        count = end - start if keys is None else min(keys[b], end - start)
        if count == 0:
            continue
        for h in range(heads):
            q, k, v = (rows[:, part * width + h * size : part * width + (h + 1) * size] for part in range(3))
            weights = torch.softmax(q @ k[:count].T / math.sqrt(size), dim=1)
            out[start:end, h * size : (h + 1) * size] = weights @ v[:count]
    return out


@needs_kernels
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**16), lengths=st.lists(st.integers(0, 150), min_size=1, max_size=5), **HEADS)
def test_attention_agrees_with_a_float64_reference_to_bf16_rounding(seed, lengths, heads, size):
    """Any lengths (empty sequences, partial tiles, several key blocks), heads of 32 and 64: within bf16 rounding of
    the exact result, and as close to it as SDPA in bf16 is."""
    qkv, offsets = packed(seed, lengths, heads, size)
    got = cpu_kernels.self_attention(qkv, offsets, heads)
    expected = reference_attention(qkv, offsets, heads)
    assert got.dtype == BF16 and got.shape == (sum(lengths), heads * size)
    if sum(lengths) == 0:
        return
    error = (got.double() - expected).abs()
    assert error.max() <= 0.02 + 0.01 * expected.abs().max()
    sdpa_errors = []
    for start, end in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
        if end > start:
            q, k, v = qkv[start:end].view(1, end - start, 3, heads, size).permute(2, 0, 3, 1, 4)
            sdpa = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(end - start, -1)
            sdpa_errors.append((sdpa.double() - expected[start:end]).abs())
    if sdpa_errors:  # mean errors: both are bf16 rounding of the same probabilities and outputs
        assert error.mean() <= 1.5 * torch.cat(sdpa_errors).mean() + 1e-4


@needs_kernels
@settings(max_examples=15, deadline=None)
@given(seed=st.integers(0, 2**16), lengths=st.lists(st.integers(0, 70), min_size=1, max_size=4), data=st.data())
def test_tokens_past_a_sequences_keys_query_them_and_are_not_attended_to(seed, lengths, data):
    """``keys``: each sequence attends to its first ``keys[b]`` tokens only (ColBERT's [MASK] padding queries
    without being attended to); a sequence without keys gets zeros."""
    keys = [data.draw(st.integers(0, n)) for n in lengths]
    qkv, offsets = packed(seed, lengths, heads=2, size=32)
    got = cpu_kernels.self_attention(qkv, offsets, 2, torch.tensor(keys))
    expected = reference_attention(qkv, offsets, 2, keys)
    if sum(lengths):
        assert (got.double() - expected).abs().max() <= 0.02 + 0.01 * expected.abs().max()


@needs_kernels
def test_each_sequence_attends_to_itself_alone():
    """A sequence's context is the same packed alone or among others (bit for bit), and changes when one of its
    own keys changes, not when another sequence's does."""
    qkv, offsets = packed(1, [40, 17, 90], heads=2, size=32)
    together = cpu_kernels.self_attention(qkv, offsets, 2)
    alone = cpu_kernels.self_attention(qkv[40:57], torch.tensor([0, 17]), 2)
    assert torch.equal(together[40:57], alone)
    changed = qkv.clone()
    changed[57 + 5, 2 * 64 :] += 4  # a value of the third sequence
    again = cpu_kernels.self_attention(changed, offsets, 2)
    assert torch.equal(again[:57], together[:57]) and not torch.equal(again[57:], together[57:])


def qkv_layers(seed: int, heads: int, size: int) -> tuple[torch.nn.Linear, ...]:
    """Random bf16 query, key and value layers of ``heads`` x ``size`` (weights scaled so attention is far from
    uniform)."""
    torch.manual_seed(seed)
    width = heads * size
    layers = [torch.nn.Linear(width, width) for _ in range(3)]
    with torch.no_grad():
        for layer in layers:
            layer.weight.normal_(0, 2 / math.sqrt(width))
            layer.bias.normal_(0, 0.5)
    return tuple(layer.to(BF16) for layer in layers)


@needs_kernels
@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16), lengths=st.lists(st.integers(0, 300), min_size=1, max_size=5), data=st.data(), **HEADS
)
def test_the_product_and_attention_as_one_kernel_agree_with_a_float64_reference(seed, lengths, heads, size, data):
    """``SelfAttention``: any lengths (empty sequences, groups of several sequences, one past a group's 256 tokens),
    keys, heads of 32 and 64: as close to attention over the exact product as the exact product rounded to bf16 and
    then ``self_attention`` is (the two-step path; both round q, k and v to bf16)."""
    keys = torch.tensor([data.draw(st.integers(0, n)) for n in lengths])
    query, key, value = qkv_layers(seed, heads, size)
    width = heads * size
    x = torch.randn(sum(lengths), width, generator=torch.Generator().manual_seed(seed)).to(BF16)
    offsets = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    got = cpu_kernels.SelfAttention(query, key, value, heads)(x, offsets, keys)
    assert got.dtype == BF16 and got.shape == (sum(lengths), width)
    if sum(lengths) == 0:
        return
    weight = torch.cat([layer.weight for layer in (query, key, value)]).double()
    bias = torch.cat([layer.bias for layer in (query, key, value)]).double()
    exact_qkv = x.double() @ weight.T + bias
    expected = reference_attention(exact_qkv, offsets, heads, keys.tolist())
    two_step = cpu_kernels.self_attention(exact_qkv.to(BF16), offsets, heads, keys)
    error, two_step_error = (got.double() - expected).abs(), (two_step.double() - expected).abs()
    assert error.max() <= 1.5 * two_step_error.max() + 0.01  # mostly the bf16 rounding of q, k and v, in both
    assert error.mean() <= 1.1 * two_step_error.mean() + 1e-5


@needs_kernels
def test_the_one_kernel_attends_each_sequence_alone_whatever_its_group():
    """A sequence's context is the same bit for bit packed alone or among others (in a group of several, or after
    a sequence longer than a group), and refuses what it does not compute."""
    layers = qkv_layers(2, heads=2, size=32)
    attention = cpu_kernels.SelfAttention(*layers, heads=2)
    x = torch.randn(300 + 40 + 17 + 90, 64).to(BF16)
    offsets = torch.tensor([0, 300, 340, 357, 447])
    together = attention(x, offsets)
    assert torch.equal(together[340:357], attention(x[340:357], torch.tensor([0, 17])))
    assert torch.equal(together[:300], attention(x[:300], torch.tensor([0, 300])))
    float32 = [torch.nn.Linear(64, 64) for _ in range(3)]
    assert not cpu_kernels.SelfAttention.fits(*float32, heads=2)
    assert not cpu_kernels.SelfAttention.fits(*layers, heads=4)  # heads of 16
    with pytest.raises(ValueError, match="bf16 query, key and value layers"):
        cpu_kernels.SelfAttention(*float32, heads=2)
    with pytest.raises(ValueError, match="x must be bf16 \\[tokens, 64\\]"):
        attention(x.float(), offsets)
    with pytest.raises(ValueError, match="offsets must be int64"):
        attention(x, torch.tensor([0, 300]))


@needs_kernels
@pytest.mark.parametrize(
    ("qkv", "offsets", "heads", "message"),
    [
        (torch.zeros(4, 3 * 2 * 32), torch.tensor([0, 4]), 2, "bf16"),
        (torch.zeros(4, 3 * 4 * 16, dtype=BF16), torch.tensor([0, 4]), 4, "32 or 64"),
        (torch.zeros(4, 3 * 64, dtype=BF16), torch.tensor([0, 3]), 2, "from 0 to the 4 tokens"),
        (torch.zeros(4, 3 * 64, dtype=BF16), torch.tensor([0, 4], dtype=torch.int32), 2, "int64"),
        (torch.zeros(4, 3 * 64, dtype=BF16), torch.tensor([], dtype=torch.int64), 2, "from 0 to the 4 tokens"),
        (torch.zeros(4, 3 * 64, dtype=BF16), torch.tensor([0, 3, 2, 4]), 2, "must not decrease"),
        (torch.zeros(4, 3 * 64, dtype=BF16), torch.tensor([0, 4]), 2, "keys must be int64 \\[1\\]"),
    ],
)
def test_attention_refuses_what_it_does_not_compute(qkv, offsets, heads, message):
    keys = torch.tensor([4, 4]) if "keys" in message else None
    with pytest.raises(ValueError, match=message):
        cpu_kernels.self_attention(qkv, offsets, heads, keys)


@needs_kernels
@pytest.mark.parametrize("width", [16, 384, 1024, 2048])
@pytest.mark.parametrize("with_residual", [False, True])
def test_layer_norm_in_place_agrees_with_a_float64_reference(width, with_residual):
    """LayerNorm(x) or LayerNorm(x + residual) over ``x``'s storage, as close to the exact result as torch's bf16
    layer norm of the same input (the residual added in float32, torch's sum rounded to bf16 first)."""
    torch.manual_seed(width)
    norm = torch.nn.LayerNorm(width, eps=1e-5).to(BF16)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    x = (torch.randn(300, width) * 3 + 1).to(BF16)
    residual = (torch.randn(300, width) * 2).to(BF16) if with_residual else None
    exact_input = x.double() + (0 if residual is None else residual.double())
    expected = F.layer_norm(exact_input, (width,), norm.weight.double(), norm.bias.double(), norm.eps)
    torch_bf16 = norm(x if residual is None else x + residual)
    got = cpu_kernels.layer_norm_(x, norm, residual)
    assert got.data_ptr() == x.data_ptr()  # in place
    error, torch_error = (got.double() - expected).abs(), (torch_bf16.double() - expected).abs()
    assert error.max() <= torch_error.max() * 1.01 + 1e-6 and error.mean() <= torch_error.mean() * 1.05


@needs_kernels
def test_layer_norm_leaves_what_it_does_not_take_to_torch():
    """A width that is not a multiple of 16, float32 weights, no bias, a residual to broadcast: ``norm(x + residual)``,
    and ``x`` unchanged."""
    for norm, width, residual in [
        (torch.nn.LayerNorm(40).to(BF16), 40, None),
        (torch.nn.LayerNorm(64), 64, None),
        (torch.nn.LayerNorm(64, bias=False).to(BF16), 64, None),
        (torch.nn.LayerNorm(64).to(BF16), 64, torch.randn(1, 64).to(BF16)),
    ]:
        x = torch.randn(8, width).to(BF16)
        before = x.clone()
        out = cpu_kernels.layer_norm_(x, norm, residual)
        assert torch.equal(x, before) and torch.equal(out, norm(before if residual is None else before + residual))


def random_embeddings(seed: int, width: int, dtype: torch.dtype = BF16) -> torch.nn.Module:
    """A BERT embeddings module (100 tokens, 128 positions, 2 token types) with random tables and norm."""
    config = random_encoder(seed, hidden_size=width, num_attention_heads=1, intermediate_size=width).config
    embeddings = BertEmbeddings(config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in embeddings.parameters():
            param.normal_(0.5, 2.0)
    return embeddings.to(dtype).eval()


@needs_kernels
@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), tokens=st.integers(0, 300), width=st.sampled_from([16, 384, 2048]))
def test_embeddings_of_packed_tokens_agree_with_a_float64_reference(seed, tokens, width):
    """LayerNorm(word[id] + position[p] + type[t]) per token, as close to the exact result as ``transformers``'
    bf16 embeddings (which round each sum to bf16 before the norm), and the same wherever a token sits."""
    embeddings = random_embeddings(seed, width)
    generator = torch.Generator().manual_seed(seed)
    ids, positions, types = (torch.randint(0, n, (tokens,), generator=generator) for n in (100, 128, 2))
    word, position, kind = (t.weight.double() for t in (embeddings.word_embeddings, embeddings.position_embeddings,
                                                       embeddings.token_type_embeddings))  # fmt: skip
    norm = embeddings.LayerNorm
    exact = F.layer_norm(word[ids] + position[positions] + kind[types], (width,), norm.weight.double(),
                         norm.bias.double(), norm.eps)  # fmt: skip
    with torch.inference_mode():
        got = cpu_kernels.embed(embeddings, ids, positions, types)
        eager = norm(embeddings.word_embeddings(ids) + embeddings.token_type_embeddings(types)
                     + embeddings.position_embeddings(positions))  # fmt: skip
    assert got.shape == (tokens, width) and got.dtype == BF16
    if tokens:
        error, eager_error = (got.double() - exact).abs(), (eager.double() - exact).abs()
        assert error.max() <= eager_error.max() * 1.01 + 1e-6 and error.mean() <= eager_error.mean() * 1.05
        alone = cpu_kernels.embed(embeddings, ids[-1:], positions[-1:], types[-1:])
        assert torch.equal(alone, got[-1:])


@needs_kernels
def test_embeddings_refuse_indices_outside_their_tables_and_leave_other_tables_to_torch():
    """An id, position or type past its table (or negative), or indices that are not int64 [tokens]: a one-line
    error before any work; float32 tables: the eager sum."""
    embeddings = random_embeddings(3, 32)
    ids, positions, types = torch.tensor([1, 99]), torch.tensor([0, 127]), torch.tensor([0, 1])
    for bad, message in [
        ((torch.tensor([1, 100]), positions, types), "token id is outside the model's table of 100"),
        ((ids, torch.tensor([-1, 0]), types), "position is outside the model's table of 128"),
        ((ids, positions, torch.tensor([0, 2])), "token type is outside the model's table of 2"),
        ((ids.int(), positions, types), "token ids must be int64"),
        ((ids, positions[:1], types), "positions must be int64 \\[tokens\\]"),
    ]:
        with pytest.raises(ValueError, match=message):
            cpu_kernels.embed(embeddings, *bad)
    float32 = random_embeddings(3, 32, torch.float32)
    with torch.inference_mode():
        expected = float32(input_ids=ids[None], position_ids=positions[None], token_type_ids=types[None])[0]
        torch.testing.assert_close(cpu_kernels.embed(float32, ids, positions, types), expected)


def exact_gelu(x: torch.Tensor) -> torch.Tensor:
    """0.5 x (1 + erf(x / sqrt(2))) in float64."""
    x = x.double()
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


@needs_kernels
@settings(max_examples=20, deadline=None)
@given(values=st.lists(st.floats(-1e4, 1e4, width=32), min_size=16, max_size=16))
def test_gelu_is_within_1e6_of_the_exact_gelu(values):
    """The piecewise quartic against erf's GELU in float64: on a dense grid over and past its range [-6, 6] (every
    interval, both sides of each end), and on any floats; exactly 0 at 0."""
    grid = torch.cat([torch.linspace(-20, 20, 2**18), torch.tensor([0.0, -6.0, 6.0, 5.9999, -6.0001, 6.0001])])
    grid = torch.cat([grid, torch.zeros(-len(grid) % 16)])
    for x in (grid, torch.tensor(values)):
        error = (cpu_kernels.gelu(x).double() - exact_gelu(x)).abs()
        assert error.max() <= 1.5e-6 + 1e-7 * x.abs().max()
    assert cpu_kernels.gelu(torch.zeros(16)).eq(0).all()
    special = cpu_kernels.gelu(torch.tensor([math.nan, math.inf, -math.inf] + [1.0] * 13))
    assert special[0].isnan() and special[1] == math.inf and abs(special[2]) < 1e-8  # NaN stays; limits at +-inf
    with pytest.raises(ValueError, match="a multiple of 16"):
        cpu_kernels.gelu(torch.zeros(15))


def random_layer(seed: int, width: int, inner: int) -> tuple[torch.nn.Module, ...]:
    """A BERT layer's modules after its attention (output product, layer norm, feed-forward products, layer norm),
    bf16, with random weights at the scale of a trained model's."""
    generator = torch.Generator().manual_seed(seed)
    modules = (torch.nn.Linear(width, width), torch.nn.LayerNorm(width, eps=1e-12), torch.nn.Linear(width, inner),
               torch.nn.Linear(inner, width), torch.nn.LayerNorm(width, eps=1e-12))  # fmt: skip
    with torch.no_grad():
        for module in modules:
            fan_in = module.weight.shape[-1]
            module.weight.copy_(torch.randn(module.weight.shape, generator=generator) / math.sqrt(fan_in))
            module.bias.copy_(torch.randn(module.bias.shape, generator=generator) * 0.2)
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.add_(1)
    return tuple(module.to(BF16) for module in modules)


def after_attention_in(dtype: torch.dtype, modules, context: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """LayerNorm(h + GELU(h Wi^T + bi) Wf^T + bf), h = LayerNorm(x + context Wo^T + bo), each step in ``dtype``
    (float64: the exact result of the bf16 parameters and inputs; bf16: torch's bf16 eager layer)."""
    out, norm1, inner, ffn, norm2 = modules
    cast = lambda t: t.to(dtype)  # noqa: E731
    norm = lambda y, n: F.layer_norm(y, y.shape[-1:], cast(n.weight), cast(n.bias), n.eps)  # noqa: E731
    h = norm(cast(x) + F.linear(cast(context), cast(out.weight), cast(out.bias)), norm1)
    f = F.gelu(F.linear(h, cast(inner.weight), cast(inner.bias)))
    return norm(h + F.linear(f, cast(ffn.weight), cast(ffn.bias)), norm2)


@needs_kernels
@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    rows=st.integers(1, 600),
    width=st.sampled_from([32, 64, 416]),
    inner=st.sampled_from([32, 160, 800]),
)
def test_after_attention_agrees_with_a_float64_reference_to_bf16_rounding(seed, rows, width, inner):
    """Any number of tokens (partial tiles, partial and several blocks of 256), widths and inner widths of one tile
    and of several (depths past 384 summed in chunks): as close to the exact result as torch's bf16 layer is."""
    modules = random_layer(seed, width, inner)
    generator = torch.Generator().manual_seed(seed + 1)
    context, x = (torch.randn(rows, width, generator=generator).to(BF16) for _ in range(2))
    got = cpu_kernels.AfterAttention(*modules)(context, x)
    expected = after_attention_in(torch.float64, modules, context, x)
    torch_bf16 = after_attention_in(BF16, modules, context, x)
    assert got.dtype == BF16 and got.shape == (rows, width)
    error, torch_error = (got.double() - expected).abs(), (torch_bf16.double() - expected).abs()
    assert error.max() <= 1.5 * torch_error.max() and error.mean() <= 1.1 * torch_error.mean()


@needs_kernels
def test_after_attention_computes_each_token_on_its_own():
    """A token's output does not depend on the others (the rows a last, partial block pads with): the first rows of a
    longer input come out bit for bit as on their own, at every boundary of a tile and a block, and a NaN stays in
    its row; and the kernel keeps the layer as it was built, whatever later happens to its modules."""
    modules = random_layer(0, 64, 160)
    kernel = cpu_kernels.AfterAttention(*modules)
    context, x = torch.randn(2, 700, 64).to(BF16)
    whole = kernel(context, x)
    for rows in (1, 15, 16, 17, 31, 32, 33, 255, 256, 257, 513):
        assert torch.equal(kernel(context[:rows], x[:rows]), whole[:rows])
    context[300, 5] = math.nan  # a NaN stays in its row, as in torch
    poisoned = kernel(context, x)
    assert poisoned[300].isnan().all() and torch.equal(poisoned[:300], whole[:300])
    assert torch.equal(poisoned[301:], whole[301:])
    with torch.no_grad():  # the kernel computes the layer as it was built
        for module in modules:
            module.weight.add_(1)
            module.bias.add_(1)
    assert torch.equal(kernel(context[:10], x[:10]), whole[:10])


@needs_kernels
def test_after_attention_takes_only_what_it_computes():
    """``fits`` refuses layers it does not compute (float32, a width or inner width off whole tiles, a norm without
    a bias), the constructor says why in one line, and a call refuses inputs of another shape or dtype."""
    layer = random_layer(0, 64, 96)
    assert cpu_kernels.AfterAttention.fits(*layer)
    unfit = [
        tuple(module.float() for module in random_layer(0, 64, 96)),
        random_layer(0, 48, 96),
        random_layer(0, 64, 80),
        (*layer[:4], torch.nn.LayerNorm(64, bias=False).to(BF16)),
    ]
    for modules in unfit:
        assert not cpu_kernels.AfterAttention.fits(*modules)
        with pytest.raises(ValueError, match="^the after-attention kernel takes bf16 layers"):
            cpu_kernels.AfterAttention(*modules)
    kernel = cpu_kernels.AfterAttention(*layer)
    wrong = [
        (torch.zeros(4, 64), torch.zeros(4, 64).to(BF16)),  # float32
        (torch.zeros(4, 32).to(BF16), torch.zeros(4, 32).to(BF16)),  # another width
        (torch.zeros(4, 64).to(BF16), torch.zeros(5, 64).to(BF16)),  # other token counts
        (torch.zeros(64).to(BF16), torch.zeros(64).to(BF16)),  # one token, not [tokens, width]
        (torch.zeros(2, 5, 64).to(BF16), torch.zeros(2, 5, 64).to(BF16)),  # a batch of sequences
    ]
    for context, x in wrong:
        with pytest.raises(ValueError, match=r"^context and x must be bf16 \[tokens, 64\]"):
            kernel(context, x)


def test_the_tile_layout_is_undone_exactly():
    """``untiled`` gives back the weight ``tile_layout`` was given, and a tile holds its 16 columns' pairs of
    depths side by side."""
    weight = torch.randn(96, 64).to(BF16)
    tiles = cpu_kernels.tile_layout(weight)
    assert tiles.shape == (6, 2, 16, 16, 2) and torch.equal(cpu_kernels.untiled(tiles), weight)
    n, k, r, column, pair = 3, 1, 5, 7, 1
    assert tiles[n, k, r, column, pair] == weight[16 * n + column, 32 * k + 2 * r + pair]
    for shape in [(96, 48), (80, 64), (64,)]:
        with pytest.raises(ValueError, match=r"^tile_layout takes a weight \[out, in\] of multiples of 32"):
            cpu_kernels.tile_layout(torch.zeros(shape))


@needs_kernels
@pytest.mark.parametrize("kind", ["bert", "roberta"])  # RoBERTa numbers positions from its non-pad tokens
@pytest.mark.parametrize("hidden", [64, 128])  # heads of 32 and 64
def test_the_fused_encoder_on_the_kernels_agrees_with_transformers_in_bf16(kind, hidden):
    """bf16 ``transformers`` against the fused encoder with the kernels and with SDPA (padded batches): within bf16
    rounding of it at every position, padding included (attending to the tokens, as ``transformers`` computes
    it), or zeros at padding with ``padding_outputs=False``; and the kernels' path is the one that runs."""
    bert = random_encoder(4, BF16, kind=kind, hidden_size=hidden, num_attention_heads=2, intermediate_size=128)
    ids, mask = right_padded(4, [70, 33, 1, 16])
    mask[1, 5] = 0  # a hole in the mask: not attended to, its output computed all the same
    keep = mask.bool()
    fused, tokens_only = FusedBertEncoder(bert), FusedBertEncoder(bert, padding_outputs=False)
    with torch.inference_mode():
        expected = bert(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        got = fused(input_ids=ids, attention_mask=mask).last_hidden_state
        alone = tokens_only(input_ids=ids, attention_mask=mask).last_hidden_state
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(cpu_kernels.ENV, "0")
            sdpa = fused(input_ids=ids, attention_mask=mask).last_hidden_state
    assert got.shape == alone.shape == expected.shape and not alone[~keep].any()
    for output, where in ((got, torch.ones_like(keep)), (sdpa, torch.ones_like(keep)), (alone, keep)):
        cosine = F.cosine_similarity(output.float()[where], expected[where], dim=-1)
        assert cosine.min() > 0.999
    assert not torch.equal(got[keep], sdpa[keep])  # the kernels ran (SDPA rounds differently)
    assert all(layer.attention is not None and layer.after is not None for layer in fused.layers)  # both kernels


@needs_kernels
@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_the_kernels_path_takes_ids_as_the_model_does(kind):
    """int32 ids and token types as int64 ones; token vectors taken over ids where both are given (as the
    embeddings take them); a position past the table: a one-line error."""
    bert = random_encoder(8, BF16, kind=kind, hidden_size=64, num_attention_heads=2, intermediate_size=128)
    ids, mask = right_padded(8, [30, 12])
    types = (torch.arange(30)[None, :] >= 10).long() * mask
    fused = FusedBertEncoder(bert)
    with torch.inference_mode():
        wide = fused(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        narrow = fused(input_ids=ids.int(), attention_mask=mask, token_type_ids=types.int()).last_hidden_state
        vectors = bert.get_input_embeddings()(ids)
        by_vectors = fused(inputs_embeds=vectors, attention_mask=mask).last_hidden_state
        both = fused(input_ids=torch.zeros_like(ids), inputs_embeds=vectors, attention_mask=mask).last_hidden_state
        assert torch.equal(wide, narrow) and torch.equal(by_vectors, both)
        table = bert.config.max_position_embeddings
        with pytest.raises(ValueError, match=f"position is outside the model's table of {table}"):
            fused(input_ids=torch.ones(1, table + 1, dtype=torch.long))


@needs_kernels
@pytest.mark.parametrize("kind", ["bert", "roberta", "xlm-roberta"])
def test_the_kernels_path_embeds_segments_and_token_vectors_as_the_model_does(kind):
    """Token types, and token vectors instead of ids, through the packed embeddings: as ``transformers`` computes
    them, and the segments matter."""
    bert = random_encoder(7, BF16, kind=kind, hidden_size=64, num_attention_heads=2, intermediate_size=128)
    ids, mask = right_padded(7, [60, 21])
    types = (torch.arange(60)[None, :] >= 20).long() * mask
    keep = mask.bool()
    fused = FusedBertEncoder(bert)
    with torch.inference_mode():
        expected = bert(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state.float()
        by_ids = fused(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
        vectors = bert.get_input_embeddings()(ids)
        by_vectors = fused(inputs_embeds=vectors, attention_mask=mask, token_type_ids=types).last_hidden_state
        untyped = fused(input_ids=ids, attention_mask=mask).last_hidden_state
        expected_vectors = bert(inputs_embeds=vectors, attention_mask=mask, token_type_ids=types).last_hidden_state
    for got, reference in ((by_ids, expected), (by_vectors, expected_vectors.float())):
        assert F.cosine_similarity(got.float()[keep], reference[keep], dim=-1).min() > 0.999
    assert F.cosine_similarity(untyped.float()[keep], expected[keep], dim=-1).min() < 0.99  # segments matter


@needs_kernels
@pytest.mark.parametrize("side", ["right", "left"])
def test_the_first_position_of_a_cross_encoder_agrees_with_transformers(side):
    """The last layer's first position, a token or (padded on the left) not: as ``transformers`` computes it."""
    bert = random_encoder(5, BF16, hidden_size=64, num_attention_heads=2, intermediate_size=128)
    ids, mask = right_padded(5, [50, 20, 9])
    if side == "left":
        ids, mask = ids.flip(1), mask.flip(1)
    fused = FusedBertEncoder(bert, first_position=True)
    with torch.inference_mode():
        full = bert(input_ids=ids, attention_mask=mask).last_hidden_state[:, :1].float()
        first = fused(input_ids=ids, attention_mask=mask, first_position=True).last_hidden_state
    assert first.shape == (3, 1, 64)
    assert F.cosine_similarity(first.float().squeeze(1), full.squeeze(1), dim=-1).min() > 0.999


@needs_compiler
def test_the_kernels_load_wherever_the_cpu_has_amx():
    """A CPU with the flags and a compiler: the library builds and loads (a broken build would otherwise only
    skip the numeric tests above)."""
    if not cpu_kernels.REQUIRED <= cpuinfo_words():
        pytest.skip("the CPU has no AMX")
    assert cpu_kernels._library() is not None and available


def test_the_kernels_are_off_where_asked_or_not_applicable(monkeypatch):
    monkeypatch.setenv(cpu_kernels.ENV, "0")
    assert not cpu_kernels.usable(torch.zeros(1, dtype=BF16), 32)
    monkeypatch.setenv(cpu_kernels.ENV, "off")
    with pytest.raises(ConfigError, match="DENSEPASS_CPU_KERNELS must be 0 or 1, got 'off'"):
        cpu_kernels.usable(torch.zeros(1, dtype=BF16), 32)
    monkeypatch.delenv(cpu_kernels.ENV)
    assert not cpu_kernels.usable(torch.zeros(1), 32)  # float32 runs SDPA
    assert not cpu_kernels.usable(torch.zeros(1, dtype=BF16), 16)  # a head size it does not take


@needs_compiler
def test_the_library_is_built_once_per_source_into_the_cache(tmp_path, monkeypatch):
    """Built on first use under a key of source, flags and compiler, complete under its final name (no partial
    file left), reused afterwards; another source builds another library."""
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(tmp_path))
    compiler = shutil.which("c++") or shutil.which("g++")
    first = cpu_kernels._built(compiler)
    manifest = first.with_suffix(".json")
    assert first.parent == tmp_path and sorted(p.name for p in tmp_path.iterdir()) == [manifest.name, first.name]
    assert stat.S_IMODE(first.stat().st_mode) == 0o700  # this user's alone: a cache shared by users is not supported
    built_at = first.stat().st_mtime_ns
    assert cpu_kernels._built(compiler) == first and first.stat().st_mtime_ns == built_at
    edited = tmp_path / "edited" / "cpu_kernels.cpp"
    edited.parent.mkdir()
    edited.write_text(cpu_kernels.SOURCE.read_text() + "\n// edited\n")
    monkeypatch.setattr(cpu_kernels, "SOURCE", edited)
    second = cpu_kernels._built(compiler)
    assert second != first and second.exists() and not list(tmp_path.glob("*.tmp"))


@needs_compiler
def test_a_damaged_library_in_the_cache_is_built_again(tmp_path, monkeypatch):
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(tmp_path))
    compiler = shutil.which("c++") or shutil.which("g++")
    target = cpu_kernels._built(compiler)
    target.write_bytes(b"")  # e.g. a disk that filled up under another tool
    library = cpu_kernels._loaded(compiler)
    assert hasattr(library, "densepass_attention") and target.stat().st_size > 0


@pytest.mark.parametrize(
    "compiler",
    [
        "exit 1",  # fails
        "exit 0",  # "succeeds" and writes nothing
        "printf '\\377\\376 not UTF-8\\n'; exit 0",  # a version line that is not text
    ],
)
def test_a_failed_build_warns_once_and_the_layers_run_sdpa(tmp_path, monkeypatch, compiler):
    fake = tmp_path / "fake-c++"
    fake.write_text(f"#!/bin/sh\n{compiler}\n")
    fake.chmod(0o755)
    cache = tmp_path / "cache"
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(cache))
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setattr(cpu_kernels, "REQUIRED", frozenset())  # as if the CPU had AMX
    cpu_kernels._library.cache_clear()
    try:
        with pytest.warns(UserWarning, match="did not build, SDPA runs instead"):
            assert not cpu_kernels.usable(torch.zeros(1, dtype=BF16), 32)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert not cpu_kernels.usable(torch.zeros(1, dtype=BF16), 32)  # once per process
        assert not cache.exists() or not list(cache.iterdir())  # nothing cached
        if not ONEDNN_BF16:
            return  # no bf16 fused layers on this CPU at all (AVX2 only: test_fused.py)
        bert = random_encoder(6, BF16, hidden_size=64, num_attention_heads=2, intermediate_size=128)
        ids, mask = right_padded(6, [20, 7])
        with torch.inference_mode():
            expected = bert(input_ids=ids, attention_mask=mask).last_hidden_state.float()
            got = FusedBertEncoder(bert)(input_ids=ids, attention_mask=mask).last_hidden_state
        keep = mask.bool()
        assert F.cosine_similarity(got.float()[keep], expected[keep], dim=-1).min() > 0.999
        assert not cache.exists() or not list(cache.iterdir())  # nothing cached
    finally:
        cpu_kernels._library.cache_clear()


# densepass loads no native code it did not build for this user: the tests below build a tiny library in place of
# the kernels' source (any CPU, a fraction of a second) and plant, beside or instead of it, a library whose
# constructor writes a marker file the moment it is loaded.
PLANTED = """#include <cstdio>
__attribute__((constructor)) static void planted() { std::FILE* f = std::fopen("MARKER", "w"); if (f) std::fclose(f); }
extern "C" int densepass_tiny() { return 666; }
"""


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """``SOURCE`` a one-function library, the cache ``tmp_path/cache``, a compiler that counts its builds, and a
    planted library (``tmp_path/planted.so``) that writes ``tmp_path/marker`` when it is loaded."""
    real = shutil.which("c++") or shutil.which("g++")
    if real is None:
        pytest.skip("no C++ compiler")
    source = tmp_path / "tiny.cpp"
    source.write_text('extern "C" int densepass_tiny() { return 7; }\n')
    monkeypatch.setattr(cpu_kernels, "SOURCE", source)
    log, compiler = tmp_path / "builds.log", tmp_path / "counting-c++"
    compiler.write_text(f'#!/bin/sh\ncase " $* " in *" -o "*) echo build >> {log};; esac\nexec {real} "$@"\n')
    compiler.chmod(0o755)
    marker, planted = tmp_path / "marker", tmp_path / "planted.so"
    planted_source = tmp_path / "planted.cpp"
    planted_source.write_text(PLANTED.replace("MARKER", str(marker)))
    subprocess.run([real, "-shared", "-fPIC", str(planted_source), "-o", str(planted)], check=True)
    cache = tmp_path / "cache"
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(cache))
    inputs = cpu_kernels._inputs(str(compiler))
    target = cache / f"cpu_kernels-{inputs['key']}.so"

    def forged_manifest(library: Path, at: Path) -> Path:
        """A manifest at ``at`` that records ``library``'s size and digest and this build's inputs."""
        data = library.read_bytes()
        facts = {"library": target.name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest(), **inputs}
        at.write_text(json.dumps(facts))
        return at

    builds = lambda: len(log.read_text().splitlines()) if log.exists() else 0  # noqa: E731
    return types.SimpleNamespace(compiler=str(compiler), cache=cache, target=target, manifest=target.with_suffix(
        ".json"), marker=marker, planted=planted, builds=builds, forged_manifest=forged_manifest)  # fmt: skip


def loads_the_tiny_library(tiny, warning: str | None = None) -> ctypes.CDLL:
    """``_loaded`` as ``_library`` calls it: the tiny library (not the planted one, whose constructor never ran),
    with a warning matching ``warning`` or none."""
    if warning is None:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            library = cpu_kernels._loaded(tiny.compiler)
    else:
        with pytest.warns(UserWarning, match=warning) as caught:
            library = cpu_kernels._loaded(tiny.compiler)
        assert all("\n" not in str(w.message) for w in caught)  # one line
    assert library.densepass_tiny() == 7 and library._name.startswith("/proc/self/fd/")
    assert not tiny.marker.exists()
    return library


def matches_its_manifest(target: Path) -> bool:
    manifest = json.loads(target.with_suffix(".json").read_text())
    return manifest["sha256"] == hashlib.sha256(target.read_bytes()).hexdigest()


def foreign(*paths: Path) -> None:
    """``paths`` made another user's (root alone can)."""
    if os.getuid() != 0:
        pytest.skip("making a file another user's takes root")
    for path in paths:
        os.chown(path, 65534, 65534, follow_symlinks=False)


def test_a_built_library_is_loaded_from_the_cache_without_compiling_again(tiny):
    loads_the_tiny_library(tiny)
    assert tiny.builds() == 1
    assert stat.S_IMODE(tiny.cache.stat().st_mode) == 0o700  # made private
    assert stat.S_IMODE(tiny.target.stat().st_mode) == 0o700 and tiny.manifest.stat().st_mode & 0o022 == 0
    manifest = json.loads(tiny.manifest.read_text())
    assert manifest["size"] == tiny.target.stat().st_size and matches_its_manifest(tiny.target)
    version = subprocess.run([tiny.compiler, "--version"], capture_output=True, text=True, check=True).stdout
    assert manifest["flags"] == list(cpu_kernels.FLAGS) and manifest["compiler_version"] == version
    assert manifest["source_sha256"] == hashlib.sha256(cpu_kernels.SOURCE.read_bytes()).hexdigest()
    built_at = tiny.target.stat().st_mtime_ns
    loads_the_tiny_library(tiny)
    assert tiny.builds() == 1 and tiny.target.stat().st_mtime_ns == built_at
    assert sorted(p.name for p in tiny.cache.iterdir()) == [tiny.manifest.name, tiny.target.name]


def test_under_umask_002_the_library_is_built_into_private_folders_and_loaded(tiny, tmp_path, monkeypatch):
    """umask 002 (many distributions' default for users): the manifest came out group-writable, so the library
    the build had just made was refused as damaged, every time; and the default cache's missing parents came out
    0775, so the cache itself was refused. Every folder made, and the manifest, are this user's alone."""
    cache = tmp_path / "home" / ".cache" / "densepass"
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(cache))
    old = os.umask(0o002)
    try:
        library = cpu_kernels._loaded(tiny.compiler)
    finally:
        os.umask(old)
    assert library.densepass_tiny() == 7 and tiny.builds() == 1
    made = [tmp_path / "home", tmp_path / "home" / ".cache", cache]
    assert [stat.S_IMODE(p.stat().st_mode) for p in made] == [0o700] * 3
    assert [stat.S_IMODE(p.stat().st_mode) for p in cache.glob("*.json")] == [0o600]


def test_a_library_planted_under_the_cache_name_is_built_over_not_loaded(tiny):
    """This user's file under the library's name without a manifest (or with one of another library): built
    again."""
    tiny.cache.mkdir(mode=0o700)
    shutil.copy(tiny.planted, tiny.target)
    loads_the_tiny_library(tiny)
    assert tiny.builds() == 1 and matches_its_manifest(tiny.target)
    tiny.target.unlink()  # a new file: writing into the one this process has mapped would crash it at exit
    shutil.copy(tiny.planted, tiny.target)  # the manifest now records the tiny library
    loads_the_tiny_library(tiny)
    assert tiny.builds() == 2 and matches_its_manifest(tiny.target)


def test_another_users_library_and_manifest_in_the_cache_are_refused_and_left(tiny):
    """Another user's library under the name, with a manifest that records it exactly: a warning, the library
    built for this process elsewhere, the planted files left as they were."""
    tiny.cache.mkdir(mode=0o700)
    shutil.copy(tiny.planted, tiny.target)
    tiny.forged_manifest(tiny.target, tiny.manifest)
    foreign(tiny.target, tiny.manifest)
    loads_the_tiny_library(tiny, warning=r"not loaded from their cache: .*belongs to uid 65534, not this user")
    assert tiny.builds() == 1 and tiny.target.read_bytes() == tiny.planted.read_bytes()
    assert sorted(p.name for p in tiny.cache.iterdir()) == [tiny.manifest.name, tiny.target.name]


@pytest.mark.parametrize("where", ["cache open to others", "cache open to its group", "inside a directory open to "
                                   "others", "cache of another user"])  # fmt: skip
def test_a_cache_directory_others_can_change_is_not_used(tiny, tmp_path, monkeypatch, where):
    """A library and a manifest that would pass every check of a file, in a directory others can change: nothing
    is loaded from it or written to it; a warning names the problem and the library is built in a private
    temporary directory."""
    cache = tmp_path / "open" / "cache" if where.startswith("inside") else tiny.cache
    cache.mkdir(parents=True, mode=0o700)
    monkeypatch.setenv(cpu_kernels.CACHE_ENV, str(cache))
    library = cache / tiny.target.name
    shutil.copy(tiny.planted, library)
    tiny.forged_manifest(library, library.with_suffix(".json"))
    problem = {
        "cache open to others": (cache, 0o777, "is writable by group or others"),
        "cache open to its group": (cache, 0o770, "is writable by group or others"),
        "inside a directory open to others": (cache.parent, 0o777, "which group or others can write to"),
        "cache of another user": (cache, 0o700, "belongs to uid 65534"),
    }[where]
    problem[0].chmod(problem[1])
    if where == "cache of another user":
        foreign(cache)
    before = sorted(p.name for p in cache.iterdir())
    loads_the_tiny_library(tiny, warning=f"not loaded from their cache: .*{problem[2]}.*private temporary directory")
    assert tiny.builds() == 1 and sorted(p.name for p in cache.iterdir()) == before
    assert stat.S_IMODE(problem[0].stat().st_mode) == problem[1]  # left as it was


@pytest.mark.parametrize("change", ["bytes", "mode"])
def test_a_library_changed_after_its_build_is_built_again_not_loaded(tiny, change):
    """The library's bytes changed in place (its manifest intact), or the file opened to others' writes."""
    cpu_kernels._built(tiny.compiler)
    if change == "bytes":
        tiny.target.write_bytes(tiny.planted.read_bytes())  # same file, owner and mode
    else:
        tiny.target.chmod(0o766)
    loads_the_tiny_library(tiny)
    assert tiny.builds() == 2 and matches_its_manifest(tiny.target)
    assert stat.S_IMODE(tiny.target.stat().st_mode) == 0o700


@pytest.mark.parametrize("entry", ["library", "manifest"])
def test_a_symlink_planted_in_the_cache_is_not_followed(tiny, tmp_path, entry):
    """A link under the library's (or the manifest's) name to a library (manifest) that would pass the checks:
    refused with a warning, left in place."""
    tiny.cache.mkdir(mode=0o700)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    if entry == "library":
        tiny.target.symlink_to(tiny.planted)
        tiny.forged_manifest(tiny.planted, tiny.manifest)
    else:
        shutil.copy(tiny.planted, tiny.target)
        tiny.manifest.symlink_to(tiny.forged_manifest(tiny.planted, elsewhere / "manifest.json"))
    loads_the_tiny_library(tiny, warning="not loaded from their cache: .* is a symbolic link")
    assert tiny.builds() == 1 and (tiny.target if entry == "library" else tiny.manifest).is_symlink()


def test_a_pipe_planted_under_the_library_name_is_refused_without_waiting(tiny):
    tiny.cache.mkdir(mode=0o700)
    os.mkfifo(tiny.target)
    tiny.forged_manifest(tiny.planted, tiny.manifest)
    loads_the_tiny_library(tiny, warning="is not a regular file")


def test_a_library_swapped_in_after_the_check_is_not_the_one_loaded(tiny, monkeypatch):
    """The file loaded is the one whose digest was checked (through its descriptor), whatever lies under its name
    by the time ``dlopen`` runs."""
    cpu_kernels._built(tiny.compiler)
    checked = cpu_kernels._verified

    def then_swapped(target, inputs):
        fd = checked(target, inputs)
        swapped = target.with_name("swapped")
        shutil.copy(tiny.planted, swapped)
        os.replace(swapped, target)
        return fd

    monkeypatch.setattr(cpu_kernels, "_verified", then_swapped)
    library = cpu_kernels._verified_load(tiny.target, cpu_kernels._inputs(tiny.compiler))
    assert library.densepass_tiny() == 7 and not tiny.marker.exists()
