r"""The vocabulary table's share of a CPU training step: its backward pass as torch runs it (a dense gradient the
size of the table for each forward pass that read it) against ``training.embedding_grads`` (the rows read, added
into one dense buffer kept across steps), side by side in one run, for the tables of the models users train.

One "step" reads the table twice, as a bi-encoder step does (``--query-tokens`` ids for the queries, then
``--passage-tokens`` for the passages, drawn uniformly from the vocabulary), backpropagates a random gradient
through both lookups, and drops ``.grad`` as the optimiser's ``zero_grad`` does. Only the table's forward and
backward passes are timed: the rest of a step (the encoder, AdamW) is the same on both sides. Each side runs
``--steps`` steps after ``--warmup``, in turn, ``--rounds`` times; the table shows the median round, and the two
gradients are checked equal after every side's last step.

    PYTHONPATH=src:benchmarks python3 benchmarks/bench_embedding_grads.py --out outputs/bench/embedding-grads.json

Tables (rows x width, float32): all-MiniLM-L6-v2 (30,522 x 384: 47 MB), BERT-base / e5-base (30,522 x 768:
94 MB), XLM-R large, as in bge-m3 (250,002 x 1,024: 1.0 GB), Qwen2-0.5B (151,936 x 896: 545 MB).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

from common import environment, markdown_table, median_round, output_file, pick_device, write_json
from densepass.training.embedding_grads import SparseEmbeddingGradients

TABLES = {
    "all-MiniLM-L6-v2": (30522, 384),
    "BERT-base (e5-base, bge-base)": (30522, 768),
    "Qwen2-0.5B": (151936, 896),
    "XLM-R large (bge-m3)": (250002, 1024),
}


def steps(table: nn.Embedding, ids: list[tuple[torch.Tensor, torch.Tensor]], grads) -> float:
    """Seconds for the steps of ``ids`` (queries' ids, passages' ids): both lookups, the backward pass through them,
    then ``.grad`` dropped (kept for the last step)."""
    started = time.perf_counter()
    for n, (queries, passages) in enumerate(ids):
        q, p = table(queries), table(passages)
        torch.autograd.backward([q, p], list(grads))
        if n < len(ids) - 1:
            table.weight.grad = None
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--query-tokens", type=int, default=32 * 12, help="ids a step's queries read (32 x 12)")
    parser.add_argument("--passage-tokens", type=int, default=64 * 90, help="ids its passages read (64 x 90)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=output_file, default=None)
    args = parser.parse_args()
    if min(args.query_tokens, args.passage_tokens, args.steps, args.rounds) < 1 or args.warmup < 0:
        parser.error("--query-tokens, --passage-tokens, --steps and --rounds must be at least 1, --warmup at least 0")
    device = pick_device("cpu")
    env = environment(device)
    print(f"device: {env['device']}; torch {env['torch']}")
    rows, results = [], {}
    for name, (vocabulary, width) in TABLES.items():
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(1)
        dense = nn.Embedding(vocabulary, width)
        sparse = nn.Embedding(vocabulary, width)
        sparse.load_state_dict(dense.state_dict())
        SparseEmbeddingGradients(sparse)
        ids = [
            tuple(torch.randint(0, vocabulary, (1, n), generator=g) for n in (args.query_tokens, args.passage_tokens))
            for _ in range(args.warmup + args.steps)
        ]
        grads = (torch.randn(1, args.query_tokens, width), torch.randn(1, args.passage_tokens, width))
        times: dict[str, list[float]] = {"dense": [], "row by row": []}
        for _ in range(args.rounds):
            for side, table in (("dense", dense), ("row by row", sparse)):
                table.weight.grad = None
                steps(table, ids[: args.warmup], grads)
                table.weight.grad = None
                times[side].append(steps(table, ids[args.warmup :], grads) / args.steps)
            torch.testing.assert_close(sparse.weight.grad, dense.weight.grad, rtol=1e-5, atol=1e-6)
        ratios = [d / s for d, s in zip(times["dense"], times["row by row"])]
        mid = median_round(list(range(args.rounds)), ratios.__getitem__)
        dense_ms, sparse_ms = times["dense"][mid] * 1e3, times["row by row"][mid] * 1e3
        megabytes = vocabulary * width * 4 / 1e6
        rows.append([name, f"{vocabulary:,} x {width:,}", f"{megabytes:,.0f}", f"{dense_ms:.1f}", f"{sparse_ms:.1f}",
                     f"**{ratios[mid]:.1f}x**"])  # fmt: skip
        results[name] = {"rows": vocabulary, "width": width, "dense_s": times["dense"],
                         "row_by_row_s": times["row by row"], "ratios": ratios}  # fmt: skip
        print(f"  {name}: dense {dense_ms:.1f} ms a step, row by row {sparse_ms:.1f} ms, "
              f"ratios by round {', '.join(f'{r:.1f}x' for r in ratios)}")  # fmt: skip
        del dense, sparse
    headers = ["table", "rows x width", "MB (float32)", "dense backward ms/step", "row by row ms/step", "speed-up"]
    print(markdown_table(headers, rows))
    write_json(args.out, {"environment": env, "args": vars(args), "results": results})


if __name__ == "__main__":
    main()
