r"""int8 products with a scale and an offset per token (``cpu_kernels.Int8Linear``: ``vpdpbusd``, or AMX tiles'
``tdpbusd`` where the AMX kernels run; what the ``int8`` precision's fused layers run) against bf16 products
(oneDNN's ``F.linear`` on bf16), at a BERT layer's four shapes (MiniLM: 384 -> 1152 for the query, key and value,
384 -> 384, 384 -> 1536, 1536 -> 384), on ``--tokens`` rows of random bf16 values. Each product runs ``--repeats``
times in turn with the other, the fastest of each reported, as multiply-adds per second and as a share of the CPU's
measured peak (``cpu_peak.py``: bf16 and int8 each against their own, the AMX tiles' where the AMX kernels run).

    PYTHONPATH=src:benchmarks python benchmarks/bench_int8_products.py --tokens 8192 --repeats 20 \
        --out outputs/bench/int8-products.json
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from torch.nn import functional as F

import cpu_peak
from common import cpu_facts, markdown_table, output_file, write_json
from densepass.models import cpu_kernels

SHAPES = {"query, key, value": (384, 1152), "output": (384, 384), "inner": (384, 1536), "ffn output": (1536, 384)}


def fastest(fn, repeats: int) -> float:
    """The fastest of ``repeats`` timed calls of ``fn`` (after one untimed)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=output_file, default=None)
    args = parser.parse_args()
    if args.tokens < 1 or args.repeats < 1:
        parser.error("--tokens and --repeats must be >= 1")
    x_probe = torch.zeros(1, dtype=torch.bfloat16)
    if not cpu_kernels.usable(x_probe, 32):
        raise SystemExit("densepass's CPU kernels do not run on this CPU (AVX512-BF16 and AVX512-VNNI needed)")
    tiles = cpu_kernels.kind() == "amx"  # the products on AMX tiles: the tiles' peaks
    kinds = {"bf16": "amx_bf16" if tiles else "bf16", "int8": "amx_int8" if tiles else "int8"}
    peaks = {precision: cpu_peak.peak_gmacs(kind) for precision, kind in kinds.items()}
    torch.manual_seed(0)
    rows, results = [], []
    for name, (depth, width) in SHAPES.items():
        linear = nn.Linear(depth, width)
        bf16 = nn.Linear(depth, width).bfloat16()
        bf16.load_state_dict(linear.state_dict())
        int8 = cpu_kernels.Int8Linear(linear)
        x = torch.randn(args.tokens, depth).bfloat16()
        macs = args.tokens * depth * width
        with torch.inference_mode():
            t_bf16 = fastest(lambda x=x, w=bf16: F.linear(x, w.weight, w.bias), args.repeats)
            t_int8 = fastest(lambda x=x, layer=int8: layer(x), args.repeats)
        g_bf16, g_int8 = macs / t_bf16 / 1e9, macs / t_int8 / 1e9
        results.append({"product": name, "depth": depth, "width": width, "bf16_gmacs": g_bf16, "int8_gmacs": g_int8})
        rows.append(
            [
                f"{name} ({depth} -> {width})",
                f"{t_bf16 * 1e3:.2f}",
                f"{g_bf16:.0f} ({100 * g_bf16 / peaks['bf16']:.0f}%)",
                f"{t_int8 * 1e3:.2f}",
                f"{g_int8:.0f} ({100 * g_int8 / peaks['int8']:.0f}%)",
                f"{t_bf16 / t_int8:.2f}x",
            ]
        )
    facts = cpu_facts()
    flags = " ".join(facts["cpu_flags"])
    print(f"{facts['cpu_model']} ({flags}), {torch.get_num_threads()} threads, {args.tokens} tokens")
    print(f"peaks (G multiply-adds/s): {kinds['bf16']} {peaks['bf16']:.0f}, {kinds['int8']} {peaks['int8']:.0f}\n")
    headers = ["product", "bf16 ms", "bf16 G MAC/s (of peak)", "int8 ms", "int8 G MAC/s (of peak)", "int8 ÷ bf16"]
    print(markdown_table(headers, rows))
    write_json(args.out, {"cpu": facts, "tokens": args.tokens, "peaks_gmacs": peaks, "peak_kinds": kinds,
                          "results": results})  # fmt: skip


if __name__ == "__main__":
    main()
