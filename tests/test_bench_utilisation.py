"""What the benchmarks' model FLOPs utilisation divides: FLOPs per token counted from a model's weights, and the
CPU's peak measured by ``benchmarks/cpu_peak.py``."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from conftest import tiny_bert_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def benchmarks(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))


def test_flops_per_token_count_the_layers_weights_and_attention_but_not_embeddings_or_pooler(tmp_path, benchmarks):
    from common import encoder_flops_per_token

    config = tiny_bert_config(vocab_size=100)
    config.save_pretrained(tmp_path)
    h, i, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    # per layer: query, key, value and output products with biases, the feed-forward's two, two layer norms
    per_layer = 4 * (h * h + h) + (h * i + i) + (i * h + h) + 2 * 2 * h
    forward = 2 * layers * per_layer + 4 * layers * h * 50.0
    assert encoder_flops_per_token(str(tmp_path), 50.0) == pytest.approx(forward)
    assert encoder_flops_per_token(str(tmp_path), 50.0, backward=True) == pytest.approx(3 * forward)


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler")
def test_the_measured_peak_is_a_rate_the_hardware_can_have(benchmarks):
    import cpu_peak
    from densepass.device import cpuinfo_words

    if not {"avx2", "fma"} <= cpuinfo_words():
        pytest.skip("the CPU has no AVX2 / FMA")
    gmacs = cpu_peak.peak_gmacs("fp32", threads=1, iters=2_000_000)
    # one core retires at most two 512-bit FMAs a cycle (32 multiply-adds) below 6 GHz; a loop the compiler
    # removed would report far more, and a rate under 1 G would be no vector unit at all
    assert gmacs is not None and 1.0 < gmacs < 32 * 6.0
    tflops, source = cpu_peak.peak_tflops(bf16=False, threads=1)
    assert tflops > 0 and source.startswith("measured")


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None, reason="no C++ compiler")
def test_the_tiles_peak_is_a_rate_amx_can_have_and_is_the_bf16_ceiling_there(benchmarks):
    import cpu_peak
    from densepass.device import cpuinfo_words

    if not {"amx_tile", "amx_bf16", "amx_int8"} <= cpuinfo_words():
        pytest.skip("the CPU has no AMX")
    bf16 = cpu_peak.peak_gmacs("amx_bf16", threads=1, iters=600_000)
    int8 = cpu_peak.peak_gmacs("amx_int8", threads=1, iters=600_000)
    # a core's tiles retire at most 512 bf16 and 1,024 int8 multiply-adds a cycle (one 16 x 16 x 32 or x 64 tile
    # product each 16 cycles), below 6 GHz; above the vector units' 32 a cycle at 1 GHz
    assert bf16 is not None and 32.0 < bf16 < 512 * 6.0
    assert int8 is not None and 32.0 < int8 < 1024 * 6.0
    tflops, source = cpu_peak.peak_tflops(bf16=True, threads=1)
    assert tflops > 2 * 32 * 1.0 / 1e3 and "amx_bf16" in source


def test_no_peak_is_measured_for_instructions_the_cpu_lacks(benchmarks, monkeypatch):
    import cpu_peak
    from densepass import device

    monkeypatch.setattr(device, "cpuinfo_words", lambda: frozenset({"avx2", "fma"}))
    assert cpu_peak.peak_gmacs("bf16") is None and cpu_peak.peak_gmacs("int8") is None
    assert cpu_peak.peak_gmacs("amx_bf16") is None and cpu_peak.peak_gmacs("amx_int8") is None
    assert cpu_peak.peak_tflops(bf16=True) == (None, "no bf16 peak measured on this CPU")
