r"""Recall against latency of approximate search on real embeddings: FAISS HNSW over an efSearch sweep and IVF-PQ
over an nprobe sweep (``densepass.index.faiss_index``), and exact search in fp32 and in reduced precision with
fp32 re-scoring (``densepass.index.exact``), each against fp32 exact search; a markdown table and a PNG.

    # a saved dense index (densepass index debian-packages --output outputs/idx-minilm): its model encodes the
    # dataset's dev queries
    python benchmarks/bench_ann_curve.py --index outputs/idx-minilm --dataset debian-packages --out outputs/bench/ann
    # embeddings saved by bench_encode.py --save-embeddings
    python benchmarks/bench_ann_curve.py --embeddings outputs/bench/emb/passages.npy \
        --query-embeddings outputs/bench/emb/queries.npy --out outputs/bench/ann
    # random unit vectors (a smoke test: recall on random vectors says nothing about real ones)
    python benchmarks/bench_ann_curve.py --random 2000 --dim 32 --out outputs/bench/ann-random

Recall@k = mean |top-k of the index ∩ top-k of fp32 exact search| / k over every query (searched in one
batch). Latency = median time of one query searched alone (``--latency-queries`` of them, after a warm-up), the
case of a server; ``--threads`` sets FAISS's and torch's threads for everything.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import faiss
import numpy as np
import torch

from common import environment, markdown_table, output_file, output_with_table, pick_device, write_json, write_table
from densepass.cli import positive_int, run_guarded
from densepass.index.exact import ReducedPassages, exact_search
from densepass.index.faiss_index import build_faiss_index, faiss_search

KS = (10, 100)


def load_vectors(args) -> tuple[np.ndarray, np.ndarray, str]:
    """(passages, queries, description) from a saved index, .npy files, or random unit vectors."""
    if args.index:
        from densepass.data import load_dataset
        from densepass.index.base import load_index

        index = load_index(args.index)
        dataset = load_dataset(args.dataset, args.data_dir)
        ids = sorted(dataset.positives(args.split))
        if args.max_queries:
            ids = sorted(np.random.default_rng(args.seed).choice(ids, args.max_queries, replace=False).tolist())
        queries = index.encode_queries([dataset.queries[q] for q in ids])
        return np.asarray(index.embeddings, dtype=np.float32), queries, f"index {args.index}, {args.split} queries"
    if args.embeddings:
        passages = np.load(args.embeddings, mmap_mode="r").astype(np.float32)
        queries = np.load(args.query_embeddings).astype(np.float32)
        if args.max_queries and len(queries) > args.max_queries:
            rows = np.random.default_rng(args.seed).choice(len(queries), args.max_queries, replace=False)
            queries = queries[np.sort(rows)]
        return passages, queries, f"embeddings {args.embeddings}"
    rng = np.random.default_rng(args.seed)

    def unit(n: int) -> np.ndarray:
        x = rng.normal(size=(n, args.dim))
        return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)

    return unit(args.random), unit(args.max_queries or 200), f"random unit vectors, {args.dim}-d"


def recall(found: np.ndarray, truth: np.ndarray, k: int) -> float:
    """Mean |found top-k ∩ true top-k| / k."""
    return float(np.mean([len(set(f[:k].tolist()) & set(t[:k].tolist())) / k for f, t in zip(found, truth)]))


def latency_ms(search, queries: np.ndarray, n: int) -> float:
    """Median milliseconds of one query searched alone, over the first ``n`` queries (after 5 warm-ups)."""
    for q in queries[:5]:
        search(q[None])
    times = []
    for q in queries[:n]:
        started = time.perf_counter()
        search(q[None])
        times.append(time.perf_counter() - started)
    return 1000 * float(np.median(times))


def curve_folder(value: str) -> str:
    """argparse type of ``--out``: a folder whose curve files, where there are any, an earlier run wrote (its JSON
    a benchmark's, its table marked; the plot is the JSON's), checked before any work."""
    out = Path(value)
    output_file(str(out / "curve.json"))
    output_with_table(str(out / "curve.json"))  # curve.md
    if (out / "curve.png").exists() and not (out / "curve.json").is_file():
        raise argparse.ArgumentTypeError(f"{out / 'curve.png'} exists and no curve.json of a run beside it: not ours")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--index", help="a saved dense index directory (densepass index)")
    source.add_argument("--embeddings", help="passage embeddings .npy (with --query-embeddings)")
    source.add_argument("--random", type=positive_int, help="this many random unit vectors (smoke test)")
    parser.add_argument("--query-embeddings", help="query embeddings .npy (with --embeddings)")
    parser.add_argument("--dataset", default="debian-packages", help="--index: the dataset whose queries are encoded")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--split", default="dev")
    parser.add_argument("--max-queries", type=positive_int, default=None, help="a seeded sample of the queries")
    parser.add_argument("--dim", type=positive_int, default=384, help="--random: dimension")
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--hnsw-m", type=int, default=32)
    parser.add_argument("--ef-construction", type=int, default=None, help="HNSW (default: densepass's, FAISS's 40)")
    parser.add_argument("--ef-search", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512])
    parser.add_argument("--ivf-lists", type=int, default=None, help="IVF lists (default: 4 sqrt(n), as densepass)")
    parser.add_argument("--pq-m", type=int, default=None, help="PQ sub-quantisers (default: dim / 4, as densepass)")
    parser.add_argument("--nprobe", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    parser.add_argument("--reduced", nargs="*", default=["bf16", "int8"], help="exact search precisions to add")
    parser.add_argument("--rescore", type=int, default=4, help="reduced precision: candidates re-scored, x k")
    parser.add_argument("--latency-queries", type=positive_int, default=200, help="queries timed one at a time")
    parser.add_argument("--threads", type=int, default=None, help="FAISS and torch threads (default: theirs)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--out", type=curve_folder, required=True, help="directory for curve.md, curve.png and curve.json"
    )
    args = parser.parse_args()
    if args.embeddings and not args.query_embeddings:
        parser.error("--embeddings needs --query-embeddings")
    if args.threads:
        faiss.omp_set_num_threads(args.threads)
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    passages, queries, description = load_vectors(args)
    n, dim = passages.shape
    k = max(KS)
    print(f"{description}: {n:,} passages, {len(queries):,} queries, {dim}-d; {torch.get_num_threads()} threads")
    _, truth = exact_search(queries, passages, k, device=device)
    points: list[dict] = []

    def measure(family: str, setting: str, search, build_s: float, memory: int) -> None:
        found = search(queries)
        point = {
            "family": family,
            "setting": setting,
            **{f"recall@{c}": recall(found, truth, c) for c in KS},
            "ms_per_query": latency_ms(search, queries, args.latency_queries),
            "build_s": build_s,
            "memory_mb": memory / 1e6,
        }
        points.append(point)
        print(
            f"  {family} {setting}: recall@10 {point['recall@10']:.4f}, recall@100 {point['recall@100']:.4f}, "
            f"{point['ms_per_query']:.3f} ms/query",
            flush=True,
        )

    measure("exact fp32", "-", lambda q: exact_search(q, passages, k, device=device)[1], 0.0, passages.nbytes)
    for precision in args.reduced:
        started = time.perf_counter()
        reduced = ReducedPassages(passages, precision, device)
        built = time.perf_counter() - started
        measure(
            f"exact {precision} + fp32 re-scoring",
            f"rescore {args.rescore}",
            lambda q, r=reduced: exact_search(q, passages, k, reduced=r, rescore=args.rescore)[1],
            built,
            sum(c.numel() * c.element_size() for c in reduced.chunks) + 4 * n,
        )
    for family, kind, options, knob, values in [
        ("HNSW", "faiss-hnsw", {"hnsw_m": args.hnsw_m}, "efSearch", args.ef_search),
        ("IVF-PQ", "faiss-ivfpq", {"ivf_lists": args.ivf_lists, "pq_m": args.pq_m}, "nprobe", args.nprobe),
    ]:
        started = time.perf_counter()
        if kind == "faiss-hnsw" and args.ef_construction:
            index = faiss.IndexHNSWFlat(dim, args.hnsw_m, faiss.METRIC_INNER_PRODUCT)
            index.hnsw.efConstruction = args.ef_construction
            index.add(np.ascontiguousarray(passages))
        else:  # the index densepass builds (faiss-hnsw: FAISS's efConstruction, 40)
            index = build_faiss_index(passages, kind, **options)
        built = time.perf_counter() - started
        memory = faiss.serialize_index(index).nbytes
        print(f"{family}: built in {built:.1f}s, {memory / 1e6:.1f} MB")
        for value in values:
            if kind == "faiss-hnsw":
                index.hnsw.efSearch = value
            elif value > index.nlist:
                continue
            else:
                index.nprobe = value
            measure(family, f"{knob} {value}", lambda q, i=index: faiss_search(i, q, k)[1], built, memory)
    write_outputs(Path(args.out), points, description, n, len(queries), dim, device)


def write_outputs(out: Path, points: list[dict], description: str, n: int, nq: int, dim: int, device) -> None:
    """curve.md (the table), curve.png (recall@10 and @100 against latency) and curve.json."""
    out.mkdir(parents=True, exist_ok=True)
    headers = ["index", "setting", "recall@10", "recall@100", "ms / query", "build s", "MB"]
    rows = [
        [
            p["family"],
            p["setting"],
            f"{p['recall@10']:.4f}",
            f"{p['recall@100']:.4f}",
            f"{p['ms_per_query']:.3f}",
            f"{p['build_s']:.1f}",
            f"{p['memory_mb']:.1f}",
        ]
        for p in points
    ]
    title = f"{description}: {n:,} passages, {nq:,} queries, {dim}-d"
    table = markdown_table(headers, rows)
    write_table(out / "curve.md", f"{title}\n\n{table}\n")
    print(f"\n{title}\n\n{table}")
    plot(points, title, out / "curve.png")
    write_json(out / "curve.json", {"benchmark": "ann_curve", **environment(device), "title": title, "points": points})
    print(f"wrote {out / 'curve.md'} and {out / 'curve.png'}")


def plot(points: list[dict], title: str, path: Path) -> None:
    """Recall@10 and recall@100 against milliseconds per query, one line per index family (settings marked)."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
    for axis, k in zip(axes, KS):
        for family in dict.fromkeys(p["family"] for p in points):
            members = [p for p in points if p["family"] == family]
            x, y = [p["ms_per_query"] for p in members], [p[f"recall@{k}"] for p in members]
            axis.plot(x, y, marker="o", label=family)
            for p, xi, yi in zip(members, x, y):
                if p["setting"] != "-":
                    axis.annotate(p["setting"].split()[-1], (xi, yi), fontsize=6, alpha=0.7)
        axis.set_xscale("log")
        axis.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        axis.set_xlabel("ms per query (one at a time, log scale)")
        axis.set_title(f"recall@{k} against fp32 exact search", fontsize=9)
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("recall")
    axes[1].legend(fontsize=7, loc="lower right")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(run_guarded(main, Path(__file__).name))
