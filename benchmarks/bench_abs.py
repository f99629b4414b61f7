r"""ABS scheduling time and batch hardness: exact running-sum greedy (densepass), one batch at a time
and many batches at once, against a naive matrix greedy, the paper's top-100 restricted variant, TAS-style
topic clusters and random batches.

    python benchmarks/bench_abs.py --sizes 10000 --batch-sizes 64            # CPU
    python benchmarks/bench_abs.py --sizes 10000 100000 500000 --batch-sizes 64 128 --bm25 \
        --data-dir .carry/data                                                # H100

Synthetic data: 384-d unit vectors around 1,000 topic centres (queries and positives share a topic).
Real data: BM25 over debian-packages train instances (query, positive package description).
Each method may stop at --time-limit seconds; it then reports the batches it made and a projection at the rate of
those batches (an overestimate: the greedy's products run over the unscheduled instances alone, which shrink).
``--compact-below 0.5 0.875`` runs the exact greedy's rows once per share (``scheduling.greedy.COMPACT_BELOW``: how
soon the products' matrix is rebuilt from the unscheduled rows; 0: never), the same batches at different speeds.
``--profile FILE`` then runs the first ``--concurrent`` greedy again under torch.profiler for ``--profile-seconds``
and writes where its time goes (operators by self time on the host and on the device; one ``aten::bmm`` per round)
to FILE: what a GPU session brings back to see what bounds the schedule beside its products.
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np
import torch

from densepass.scheduling import greedy
from densepass.scheduling.baselines import clustered_batches, random_batches
from densepass.scheduling.concurrent import iter_concurrent_batches
from densepass.scheduling.greedy import iter_batches, neighbour_lists
from densepass.scheduling.similarity import BilinearSimilarity, bm25_instance_matrices, mean_hardness
from densepass.scheduling.unscheduled import Unscheduled


def synthetic(n: int, dim: int = 384, topics: int = 1000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(topics, dim)).astype(np.float32)
    labels = rng.integers(0, topics, size=n)
    q = centres[labels] + 1.5 * rng.normal(size=(n, dim)).astype(np.float32)
    p = centres[labels] + 1.5 * rng.normal(size=(n, dim)).astype(np.float32)
    return q / np.linalg.norm(q, axis=1, keepdims=True), p / np.linalg.norm(p, axis=1, keepdims=True)


def naive_matrix_greedy(sim: BilinearSimilarity, batch_size: int, seed: int, limit: float):
    """What a direct implementation does: precompute S = Q P^T (N x N), then score every removal and
    every addition from S's rows and columns at each step (eq. 3-4, no running sums)."""
    q, p = sim.stacked[:, : sim.dim], sim.stacked[:, sim.dim :]
    S = q @ p.T
    n = sim.n
    unscheduled = Unscheduled(n, seed)
    available = torch.ones(n, dtype=torch.bool, device=sim.device)
    started, batches = time.perf_counter(), []
    while unscheduled.remaining > batch_size and time.perf_counter() - started < limit:
        members = unscheduled.seed_batch(batch_size, _NoConflicts())
        available[members] = False
        for _ in range(4 * batch_size):
            m = torch.as_tensor(members, device=sim.device)
            block = S[m][:, m]
            contrib = block.sum(0) + block.sum(1) - 2 * block.diagonal()
            pos = int(torch.argmin(contrib))
            rest = torch.cat([m[:pos], m[pos + 1 :]])
            gains = S[:, rest].sum(1) + S[rest].sum(0)
            gains = torch.where(available, gains, torch.tensor(float("-inf"), device=sim.device))
            a = int(torch.argmax(gains))
            if not float(gains[a] - contrib[pos]) > 0:
                break
            available[members[pos]], available[a] = True, False
            members[pos] = a
        unscheduled.take(members)
        batches.append(members)
    return batches


class _NoConflicts:
    def __getitem__(self, i):
        return ()


def timed(fn, *args, limit: float, total_batches: int, **kwargs):
    """Run a batch generator until done or ``limit`` seconds; return (batches, seconds, finished)."""
    started = time.perf_counter()
    out = []
    for batch in fn(*args, **kwargs):
        out.append(batch)
        if time.perf_counter() - started > limit:
            break
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    return out, elapsed, len(out) >= total_batches


def row(name, n, b, batches, seconds, finished, sim, random_h, total):
    h = mean_hardness(sim, [x for x in batches if len(x) == b])
    shown = (
        f"{seconds:.1f}"
        if finished
        else f">{seconds:.0f} ({len(batches)}/{total} batches; ~{seconds * total / max(len(batches), 1):.0f} projected)"
    )
    print(f"| {name} | {n:,} | {b} | {shown} | {h:.2f} | {h / random_h:.2f} |", flush=True)


def bench(sim: BilinearSimilarity, label: str, b: int, args, dense: np.ndarray | None) -> None:
    n = sim.n
    total = n // b
    rand = random_batches(n, b, 0, 0)
    random_h = mean_hardness(sim, rand)
    print(f"| random | {n:,} | {b} | 0.0 | {random_h:.2f} | 1.00 |", flush=True)
    if dense is not None and not args.skip_clusters:
        t = time.perf_counter()
        clustered = clustered_batches(dense, b, max(2, n // (4 * b)), seed=0, epoch=0)
        row("topic clusters (k-means)", n, b, clustered, time.perf_counter() - t, True, sim, random_h, total)
    for share in args.compact_below or [greedy.COMPACT_BELOW]:
        greedy.COMPACT_BELOW = share
        compacted = f", compacted below {share:g} of its rows" if args.compact_below else ""
        if not args.skip_sequential:
            batches, sec, done = timed(iter_batches, sim, b, seed=0, limit=args.time_limit, total_batches=total)
            row(f"**ABS exact greedy (densepass)**{compacted} {label}", n, b, batches, sec, done, sim, random_h, total)
        for slots in args.concurrent:
            batches, sec, done = timed(
                iter_concurrent_batches, sim, b, slots, seed=0, limit=args.time_limit, total_batches=total
            )
            name = f"**ABS greedy, {slots} batches at once (densepass)**{compacted} {label}"
            row(name, n, b, batches, sec, done, sim, random_h, total)
    if args.profile and args.concurrent:
        profile(sim, b, args.concurrent[0], args.profile_seconds, args.profile, f"{n:,} instances {label}")
    if not sim.sparse and n <= args.restricted_max:
        t = time.perf_counter()
        neighbours = neighbour_lists(sim, 100)
        prep = time.perf_counter() - t
        batches, sec, done = timed(
            iter_batches, sim, b, seed=0, neighbours=neighbours, limit=args.time_limit, total_batches=total
        )
        row(
            f"ABS top-100 restricted (paper), incl. {prep:.1f}s search",
            n,
            b,
            batches,
            sec + prep,
            done,
            sim,
            random_h,
            total,
        )
    if not sim.sparse and n <= args.naive_max:
        t = time.perf_counter()
        batches = naive_matrix_greedy(sim, b, 0, args.time_limit)
        sec = time.perf_counter() - t
        row("naive matrix greedy (N x N)", n, b, batches, sec, len(batches) >= total, sim, random_h, total)
    if n <= args.beam_max and not sim.sparse:
        batches, sec, done = timed(
            iter_batches, sim, b, seed=0, beam_width=4, limit=args.time_limit, total_batches=total
        )
        row("ABS beam search k=4 (densepass)", n, b, batches, sec, done, sim, random_h, total)


def profile(sim: BilinearSimilarity, b: int, slots: int, seconds: float, path: str, label: str) -> None:
    """The ``slots``-batch greedy for ``seconds`` under torch.profiler: operators by self time, appended to
    ``path``."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if sim.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    made, started = 0, time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        for _ in iter_concurrent_batches(sim, b, slots, seed=0):
            made += 1
            if time.perf_counter() - started > seconds:
                break
        if sim.device.type == "cuda":
            torch.cuda.synchronize()
    wall = time.perf_counter() - started
    averages = prof.key_averages()
    with open(path, "a") as out:
        out.write(f"## {slots} batches at once, batch {b}, {label}: {made} batches in {wall:.1f} s (profiled)\n\n")
        for key in ["self_cpu_time_total"] + (["self_device_time_total"] if sim.device.type == "cuda" else []):
            out.write(f"by {key}\n{averages.table(sort_by=key, row_limit=30)}\n\n")
    print(f"(profile of {made} batches in {wall:.1f} s written to {path})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64])
    parser.add_argument("--naive-max", type=int, default=20_000)
    parser.add_argument("--restricted-max", type=int, default=100_000)
    parser.add_argument("--beam-max", type=int, default=10_000)
    parser.add_argument("--time-limit", type=float, default=120.0)
    parser.add_argument(
        "--concurrent",
        type=int,
        nargs="*",
        default=[64],
        help="batches grown at once (scheduling/concurrent.py), one row each",
    )
    parser.add_argument("--skip-sequential", action="store_true", help="leave out the one-batch-at-a-time greedy")
    parser.add_argument(
        "--compact-below",
        type=float,
        nargs="*",
        default=None,
        help="the exact greedy's rows once per share of rebuilding its matrix (default: the library's only)",
    )
    parser.add_argument(
        "--skip-clusters", action="store_true", help="leave out the topic clusters (FAISS k-means) on synthetic data"
    )
    parser.add_argument("--profile", default=None, help="profile the first --concurrent greedy into this file")
    parser.add_argument("--profile-seconds", type=float, default=20.0, help="how long --profile profiles")
    parser.add_argument("--bm25", action="store_true", help="also schedule debian-packages train with BM25")
    parser.add_argument("--data-dir", default=None)
    args = parser.parse_args()
    if args.compact_below and not all(0 <= share <= 1 for share in args.compact_below):
        parser.error("--compact-below takes shares from 0 (never rebuild) to 1 (after every batch)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    where = (
        torch.cuda.get_device_name()
        if device.type == "cuda"
        else f"CPU ({platform.processor() or 'x86-64'}, {torch.get_num_threads()} threads)"
    )
    print(f"device: {where}; torch {torch.__version__}\n")
    print("| method | instances | batch | seconds | mean h(B) | vs random |")
    print("|---|---:|---:|---:|---:|---:|")
    for n in args.sizes:
        q, p = synthetic(n)
        sim = BilinearSimilarity(q, p, device=device)
        for b in args.batch_sizes:
            bench(sim, "", b, args, q)
        del sim
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.bm25:
        from densepass.data import load_dataset

        dataset = load_dataset("debian-packages", args.data_dir)
        positives = dataset.positives("train")
        qids = sorted(positives)
        rows = [dataset.corpus.position(positives[q][0]) for q in qids]
        distinct = sorted(set(rows))
        where_row = {r: i for i, r in enumerate(distinct)}
        texts = dataset.corpus.passage_inputs(" ", distinct)
        t = time.perf_counter()
        qm, pm, _ = bm25_instance_matrices([dataset.queries[q] for q in qids], texts, [where_row[r] for r in rows])
        print(f"\n(BM25 matrices for {len(qids):,} debian-packages train instances: {time.perf_counter() - t:.1f}s)")
        sim = BilinearSimilarity(qm, pm, device=device)
        for b in args.batch_sizes:
            bench(sim, "BM25", b, args, None)


if __name__ == "__main__":
    main()
