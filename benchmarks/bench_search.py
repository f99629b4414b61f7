r"""Exact search: densepass ``exact_search`` (chunked matrix product + top-k, on GPU when present)
against FAISS ``IndexFlatIP`` (faiss-cpu) on the same vectors, in one run; plus FAISS HNSW and IVF-PQ
from ``densepass.index.faiss_index`` with their recall@k against exact search.

    python benchmarks/bench_search.py --sizes 60000 --queries 1000 --out outputs/bench/search-cpu.json     # CPU
    python benchmarks/bench_search.py --sizes 60000 1000000 --out outputs/bench/search-h100.json           # H100
    python benchmarks/bench_search.py --sizes 60240 --embeddings outputs/bench/emb/passages.npy \
        --query-embeddings outputs/bench/emb/queries.npy --out outputs/bench/search-minilm-h100.json

Vectors: --embeddings PASSAGES.npy [--query-embeddings QUERIES.npy] (e.g. MiniLM embeddings of
debian-packages), else synthetic unit vectors (384-d, normal). Corpora larger than the file are not
made up: sizes are capped at its rows. Times cover search only (index building is reported apart).
Overlap = mean |top-k of densepass ∩ top-k of FAISS| / k (ties at the k-th score may differ); for HNSW
and IVF-PQ it is their recall@k. Random vectors have no neighbourhood structure, the worst case for
approximate indexes: use real embeddings (bench_encode.py --save-embeddings) to judge those.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import faiss
import numpy as np
import torch

from common import environment, markdown_table, output_file, pick_device, rate, timer, write_json
from densepass.cli import positive_int, run_guarded
from densepass.index.exact import exact_search
from densepass.index.faiss_index import build_faiss_index, faiss_search


def unit_vectors(n: int, dim: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n, dim), dtype=np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def overlap(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean([len(np.intersect1d(x, y, assume_unique=True)) / len(x) for x, y in zip(a, b)]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=positive_int, nargs="+", default=[60_000, 1_000_000])
    parser.add_argument("--queries", type=positive_int, default=6_000)
    parser.add_argument("--k", type=positive_int, default=100)
    parser.add_argument("--dim", type=positive_int, default=384)
    parser.add_argument("--embeddings", default=None, help="passage embeddings .npy (float32 [n, d])")
    parser.add_argument("--query-embeddings", default=None, help="query embeddings .npy (default: synthetic)")
    parser.add_argument(
        "--approximate-max",
        type=int,
        default=100_000,
        help="largest corpus for the HNSW / IVF-PQ rows (their build is slow on CPU)",
    )
    parser.add_argument("--device", default=None)
    parser.add_argument("--out", type=output_file, default=None, help="JSON results")
    args = parser.parse_args()
    device = pick_device(args.device)
    env = environment(device)
    env["faiss"] = faiss.__version__
    env["faiss_threads"] = faiss.omp_get_max_threads()
    print(f"device: {env['device']}; torch {env['torch']}, faiss {env['faiss']} ({env['faiss_threads']} threads)")

    source = "synthetic unit vectors"
    if args.embeddings:
        corpus = np.load(args.embeddings, mmap_mode="r")
        source = args.embeddings
    else:
        corpus = unit_vectors(max(args.sizes), args.dim, seed=0)
    dim = corpus.shape[1]
    queries = (
        np.load(args.query_embeddings).astype(np.float32)
        if args.query_embeddings
        else unit_vectors(args.queries, dim, seed=1)
    )[: args.queries]
    print(f"{len(queries):,} queries, k={args.k}, {dim}-d, {source}\n")

    results = []
    for n in sorted({min(s, len(corpus)) for s in args.sizes}):
        passages = np.ascontiguousarray(corpus[:n], dtype=np.float32)
        exact_search(queries[:64], passages, args.k, device=device)  # warm-up (kernels, copies)
        with timer(device) as took:
            _, ours = exact_search(queries, passages, args.k, device=device)
        exact_s = took()
        results.append(
            {
                "corpus": n,
                "system": f"densepass exact_search ({device.type})",
                "build_s": 0.0,
                "search_s": exact_s,
                "queries_per_s": len(queries) / exact_s,
                "recall_vs_exact": 1.0,
            }
        )
        for kind in ["faiss-flat"] + (["faiss-hnsw", "faiss-ivfpq"] if n <= args.approximate_max else []):
            started = time.perf_counter()
            index = build_faiss_index(passages, kind)
            build = time.perf_counter() - started
            faiss_search(index, queries[:64], args.k)  # warm-up, as densepass's above
            started = time.perf_counter()
            _, found = faiss_search(index, queries, args.k)
            search = time.perf_counter() - started
            results.append(
                {
                    "corpus": n,
                    "system": f"FAISS {kind.removeprefix('faiss-')} (CPU)",
                    "build_s": build,
                    "search_s": search,
                    "queries_per_s": len(queries) / search,
                    "recall_vs_exact": overlap(ours, found),
                }
            )
            print(f"  {n:,} {kind}: build {build:.1f}s, search {search:.2f}s", flush=True)
            del index
        del passages
        if device.type == "cuda":
            torch.cuda.empty_cache()

    rows = []
    for r in results:
        ours = next(x for x in results if x["corpus"] == r["corpus"] and x["system"].startswith("densepass"))
        rows.append(
            [
                r["system"] + (" **(densepass)**" if r is ours else ""),
                f"{r['corpus']:,}",
                f"{r['build_s']:.1f}",
                f"{r['search_s']:.2f}",
                rate(r["queries_per_s"]),
                f"{ours['queries_per_s'] / r['queries_per_s']:.2f}x",
                f"{r['recall_vs_exact']:.4f}",
            ]
        )
    print()
    print(
        markdown_table(
            [
                "system",
                "corpus",
                "build s",
                "search s",
                "queries/s",
                "densepass ÷ row",
                f"top-{args.k} overlap with exact",
            ],
            rows,
        )
    )
    write_json(
        args.out,
        {
            "benchmark": "search",
            **env,
            "vectors": source,
            "dim": dim,
            "n_queries": len(queries),
            "k": args.k,
            "results": results,
        },
    )


if __name__ == "__main__":
    sys.exit(run_guarded(main, Path(__file__).name))
