r"""Where a fused bf16 BERT layer's time goes on the CPU, part by part, against each part's arithmetic: how much
faster kernels could still make bi-encoder encoding.

densepass encodes ``--n`` debian-packages passages in bf16 (``encode_texts``: length-sorted batches, pieces of
``BF16_PIECE_TOKENS``, the fused encoder of ``models.fused`` on the ``models.cpu_kernels`` path) and keeps the
packed tokens each piece hands its first layer. Then each part of that layer runs on its own over those pieces, the
parts in turn, ``--repeats`` rounds, the fastest round of each reported:

    qkv and attention  cpu_kernels.SelfAttention           the query, key and value product and attention, whole
                                                           sequences of up to 256 tokens at a time through both
    after attention    cpu_kernels.AfterAttention          the output product, the feed-forward and the two layer
                                                           norms, 256 tokens at a time through all of them

and the whole layer, whose time above the sum of its parts is what running them in sequence costs (each part's
inputs are no longer in cache), and, for comparison, SDPA on the same sequences padded to each piece's longest.
Then what each kernel replaced, one part at a time (oneDNN's products on the weights in its blocked layout, the
attention kernel on their output, and the layer-norm kernel):

    qkv              x Wqkv^T + b                          one product for the query, key and value projections
    attention        cpu_kernels.self_attention            per sequence, on AMX tiles, over qkv in memory

    output           context Wo^T + bo                     the bias as a oneDNN post-op
    layer norms      LayerNorm(x + ...), twice             cpu_kernels.layer_norm_, the residual added (in place,
                                                           over stored product outputs: their values change from
                                                           round to round, the work does not)
    inner            h Wi^T + bi                           without its GELU
    GELU             the GELU post-op: inner with GELU fused, minus inner without
    ffn output       f Wf^T + bf                           the feed-forward output product

Each part's rate is its multiply-adds (or, GELU and layer norms, its elements) per second; attention counts Q K^T
and P V over each sequence's own length.

    PYTHONPATH=src:benchmarks python benchmarks/bench_layer_parts.py --n 2000 --repeats 7 \
        --data-dir /work/shared/data --out outputs/bench/layer-parts.json
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.nn import functional as F

from common import environment, markdown_table, output_file, write_json
from densepass.data import load_dataset
from densepass.models import cpu_kernels
from densepass.models.biencoder import BiEncoder, BiEncoderConfig, resolve_model_path
from densepass.models.encode import encode_texts, inference_runner
from densepass.models.fused import FusedBertEncoder


def captured_pieces(model: BiEncoder, texts: list[str]) -> tuple[FusedBertEncoder, list[tuple]]:
    """The fused bf16 passage tower and the (packed tokens, offsets) each piece of an ``encode_texts`` run hands
    its first layer."""
    cpu = torch.device("cpu")
    tower = inference_runner(model, "bf16", cpu).passage_encoder
    if not isinstance(tower, FusedBertEncoder):
        raise SystemExit("the model's bf16 copy does not run fused layers on this CPU (models.fused.fusable)")
    first = tower.layers[0]
    if not cpu_kernels.usable(first.qkv_bias, tower.head_size) or first.after is None or first.attention is None:
        raise SystemExit("the AMX kernels do not run here (models.cpu_kernels.usable)")
    pieces = []

    def capture(x: torch.Tensor, offsets: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        pieces.append((x, offsets))  # every token a key: the bi-encoder's towers skip the padding
        return type(first).packed_tokens(first, x, offsets, keys)

    first.packed_tokens = capture
    try:
        encode_texts(model, texts, "passage", device=cpu, precision="bf16", show_progress=False)
    finally:
        del first.packed_tokens
    return tower, pieces


def padded(qkv: torch.Tensor, offsets: torch.Tensor, heads: int) -> tuple[torch.Tensor, ...]:
    """Packed ``qkv`` [tokens, 3 x width] as SDPA takes it: q, k, v [sequences, heads, longest, size] padded
    with zeros, and the key mask [sequences, 1, 1, longest]."""
    lengths = offsets.diff()
    longest, width = int(lengths.max()), qkv.shape[1] // 3
    kept = torch.arange(longest)[None, :] < lengths[:, None]
    grid = qkv.new_zeros(len(lengths), longest, 3 * width)
    grid[kept] = qkv
    q, k, v = grid.view(len(lengths), longest, 3, heads, width // heads).permute(2, 0, 3, 1, 4)
    return q, k, v, kept[:, None, None, :]


def layer_parts(layer, pieces: list[tuple]) -> tuple[list[dict], dict, dict]:
    """Each piece's inputs to every part (computed once), name -> the part run on one piece's inputs, and name ->
    its work over all pieces (multiply-adds, or elements for GELU and the layer norms)."""
    linear = torch.ops.mkldnn._linear_pointwise
    out, inner, ffn = (layer.products(name) for name in ("out", "inner", "ffn"))
    width, heads = pieces[0][0].shape[-1], layer.heads
    inner_width = layer.inner_bias.numel()
    stages = []
    for x, offsets in pieces:
        qkv = linear(x, layer.products("qkv"), layer.qkv_bias, "none", [], "")
        context = cpu_kernels.self_attention(qkv, offsets, heads)
        attended = linear(context, out, layer.out_bias, "none", [], "")
        h = cpu_kernels.layer_norm_(attended.clone(), layer.attention_norm, x)
        f = linear(h, inner, layer.inner_bias, "gelu", [], "none")
        q, k, v, keep = padded(qkv, offsets, heads)
        stages.append(
            {
                "x": x, "offsets": offsets, "qkv": qkv, "context": context, "h": h, "f": f,
                "attended": attended, "ffn": linear(f, ffn, layer.ffn_bias, "none", [], ""),
                "q": q, "k": k, "v": v, "keep": keep, "tokens": x.shape[0],
                "attention_macs": 2 * heads * int((offsets.diff() ** 2).sum()) * (width // heads),
            }
        )  # fmt: skip
    sdpa = F.scaled_dot_product_attention
    runs = {
        "qkv": lambda s: linear(s["x"], layer.products("qkv"), layer.qkv_bias, "none", [], ""),
        "attention": lambda s: cpu_kernels.self_attention(s["qkv"], s["offsets"], heads),
        "qkv and attention": lambda s: layer.attention(s["x"], s["offsets"]),
        "after attention": lambda s: layer.after(s["context"], s["x"]),
        "whole layer": lambda s: layer.packed_tokens(s["x"], s["offsets"], s["offsets"].diff()),
        "SDPA": lambda s: sdpa(s["q"], s["k"], s["v"], attn_mask=s["keep"]),
        "output": lambda s: linear(s["context"], out, layer.out_bias, "none", [], ""),
        "layer norms": lambda s: (
            cpu_kernels.layer_norm_(s["attended"], layer.attention_norm, s["x"]),
            cpu_kernels.layer_norm_(s["ffn"], layer.output_norm, s["h"]),
        ),
        "inner": lambda s: linear(s["h"], inner, layer.inner_bias, "none", [], ""),
        "inner with GELU": lambda s: linear(s["h"], inner, layer.inner_bias, "gelu", [], "none"),
        "ffn output": lambda s: linear(s["f"], ffn, layer.ffn_bias, "none", [], ""),
    }
    per_token = {"qkv": 3 * width, "output": width, "layer norms": 2, "inner": inner_width, "ffn output": inner_width}
    per_token["after attention"] = width + 2 * inner_width
    tokens = sum(s["tokens"] for s in stages)
    work = {name: tokens * width * count for name, count in per_token.items()}
    work["GELU"] = tokens * inner_width
    work["attention"] = work["SDPA"] = sum(s["attention_macs"] for s in stages)
    work["qkv and attention"] = work["qkv"] + work["attention"]
    return stages, runs, work


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="all-MiniLM-L6-v2")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--n", type=int, default=2000, help="debian-packages passages")
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=7, help="rounds; each part's fastest is reported")
    parser.add_argument("--out", type=output_file, default=None, help="JSON results")
    args = parser.parse_args()
    if min(args.n, args.repeats, args.max_length) < 1:
        parser.error("--n, --repeats and --max-length must be >= 1")
    cpu = torch.device("cpu")
    env = environment(cpu)
    print(f"device: {env['device']}; torch {env['torch']}")
    path = resolve_model_path(args.model)
    lengths = BiEncoderConfig(query_max_length=args.max_length, passage_max_length=args.max_length)
    model = BiEncoder.from_pretrained(path, config=lengths)
    texts = load_dataset("debian-packages", args.data_dir).corpus.passage_inputs(model.tokenizer.sep_token)[: args.n]
    tower, pieces = captured_pieces(model, texts)
    stages, runs, work = layer_parts(tower.layers[0], pieces)
    best = dict.fromkeys(runs, float("inf"))
    with torch.inference_mode():
        for _ in range(args.repeats + 1):  # the first round warms up
            for name, run in runs.items():
                started = time.perf_counter()
                for stage in stages:
                    run(stage)
                best[name] = min(best[name], time.perf_counter() - started)
    ms = {name: 1000 * seconds * 1000 / len(texts) for name, seconds in best.items()}  # per 1,000 passages
    ms["GELU"] = ms.pop("inner with GELU") - ms["inner"]
    rate = {name: work[name] / (ms[name] * len(texts) / 1e6) / 1e9 for name in work}
    parts = ["qkv and attention", "after attention"]
    total = sum(ms[name] for name in parts)
    rows = [[name, f"{ms[name]:.1f}", f"{ms[name] / total:.0%}", f"{rate[name]:,.0f}"] for name in parts]
    rows.append(["sum of the parts", f"{total:.1f}", "100%", ""])
    rows.append(["the whole layer", f"{ms['whole layer']:.1f}", f"{ms['whole layer'] / total:.0%}", ""])
    rows.append(["(SDPA instead of the kernel, each piece padded to its longest)", f"{ms['SDPA']:.1f}", "",
                 f"{rate['SDPA']:,.0f}"])  # fmt: skip
    tokens = sum(s["tokens"] for s in stages)
    print(f"\n{len(texts):,} passages, {len(pieces)} pieces, {tokens:,} tokens packed, one layer:\n")
    header = ["part", "ms per 1,000 passages", "share", "rate (G multiply-adds / s; GELU, norms: G elements / s)"]
    print(markdown_table(header, rows))
    for kernel, replaced, what in [
        ("qkv and attention", ["qkv", "attention"], "oneDNN's product and the attention kernel"),
        ("after attention", ["output", "layer norms", "inner", "GELU", "ffn output"],
         "oneDNN's products and the layer-norm kernel"),
    ]:  # fmt: skip
        before = sum(ms[name] for name in replaced)
        rows = [[name, f"{ms[name]:.1f}", f"{ms[name] / before:.0%}", f"{rate[name]:,.0f}"] for name in replaced]
        rows.append([f"sum ({what})", f"{before:.1f}", "100%", ""])
        rows.append([f"the {kernel} kernel", f"{ms[kernel]:.1f}", f"{ms[kernel] / before:.0%}", f"{rate[kernel]:,.0f}"])
        print(f"\nthe {kernel} part, one part at a time:\n")
        print(markdown_table(header, rows))
    results = {"ms_per_1000": ms}
    write_json(args.out, {"environment": env, "args": vars(args), **results})


if __name__ == "__main__":
    main()
