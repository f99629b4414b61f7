"""Padding-free steps against padded ones, over several training seeds of the main job (issue 54).

    python experiments/packing_seeds.py --seeds 13 14 15 16 17 --out outputs/packing-seeds

Runs ``configs/main.yaml`` once per seed (``train.seed``: batches, negative draws, dropout) with
``train.packing=true`` and once with ``train.packing=false``, each alone, as ``densepass run`` in a process of its own
(``<out>/packed-<seed>``, ``<out>/padded-<seed>``; a run whose ``runs/fine-tuned.trec`` exists is reused). Then,
on the fine-tuned models' MRR@10 over the main job's 300 dev queries: each seed's paired randomization test of the
packed model against the padded one (``evaluation.metrics.paired_significance``), and the test that answers whether
packing changes what training gives: a packed step draws other dropout masks than a padded one (its tensors have
other shapes), so the packed and padded runs of one seed differ as two seeds' runs do, and a per-query test of two
runs measures that difference too. So the seeds' MRR@10 of the packed runs are compared with the padded runs' by
a two-sample permutation test (the splits of the 2 x seeds values into two groups, every one of them or 10,000 seeded
ones; the statistic: the difference of the groups' means), with the seed-to-seed standard deviation of each kind
beside it, and, since the two runs of a seed share its batches and negative draws, by Fisher's randomization test on
the per-seed differences (their signs flipped: ``randomization_p``, exact for up to 13 seeds). Writes
``packing_seeds.json`` and ``packing_seeds.md`` into ``--out``. The wall times it prints are not benchmarks
(``benchmarks/bench_train.py --packing`` times the steps).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from densepass.data import load_dataset
from densepass.errors import DensepassError
from densepass.evaluation.metrics import (
    answered_qrels,
    paired_significance,
    per_query_scores,
    randomization_p,
    read_trec_run,
)
from densepass.io import atomic_write_text, check_output_file

KINDS = {"packed": "true", "padded": "false"}
ROOT = Path(__file__).resolve().parents[1]
METRIC = "mrr@10"


def run_main_job(out: Path, kind: str, seed: int, data_dir: str | None) -> float | None:
    """The main job for one seed and kind, unless its ranking exists; its wall seconds (None: reused)."""
    name = f"{kind}-{seed}"
    if (out / name / "runs" / "fine-tuned.trec").is_file():
        print(f"{name}: reused", flush=True)
        return None
    command = [sys.executable, "-m", "densepass", "run", str(ROOT / "configs" / "main.yaml")]
    command += ["--set", f"output_dir={out.resolve()}"]
    command += ["--set", f"name={name}", "--set", f"train.seed={seed}", "--set", f"train.packing={KINDS[kind]}"]
    command += ["--set", f"data.data_dir={data_dir}"] if data_dir else []
    started = time.perf_counter()
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    seconds = time.perf_counter() - started
    print(f"{name}: {seconds:.1f} s", flush=True)
    return seconds


def permutation_p(a: np.ndarray, b: np.ndarray, n_permutations: int = 10_000, seed: int = 42) -> float:
    """Two-sided p of the two-sample permutation test: the share of the splits of ``a`` and ``b``'s values into
    groups of their sizes whose means differ at least as much as ``a``'s and ``b``'s (equal up to rounding counts).
    Exact (every split) where there are at most ``n_permutations`` of them; otherwise ``n_permutations`` seeded
    random splits plus the observed one, so the same values always give the same p."""
    values, n = np.concatenate([a, b]), len(a)
    observed = abs(a.mean() - b.mean()) - 1e-12
    if math.comb(len(values), n) <= n_permutations:
        splits = np.zeros((math.comb(len(values), n), len(values)), dtype=bool)
        for row, group in enumerate(itertools.combinations(range(len(values)), n)):
            splits[row, list(group)] = True
        extra = 0
    else:
        rng = np.random.default_rng(seed)
        order = np.argsort(rng.random((n_permutations, len(values))), axis=1)
        splits = np.zeros((n_permutations, len(values)), dtype=bool)
        np.put_along_axis(splits, order[:, :n], True, axis=1)
        extra = 1  # the observed split
    gaps = np.abs((splits * values).sum(1) / n - (~splits * values).sum(1) / len(b))
    return float((np.count_nonzero(gaps >= observed) + extra) / (len(splits) + extra))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[13, 14, 15, 16, 17])
    parser.add_argument("--out", type=Path, default=Path("outputs/packing-seeds"))
    parser.add_argument("--data-dir", default=None, help="where debian-packages is (default: densepass's search)")
    args = parser.parse_args()
    if len(set(args.seeds)) != len(args.seeds) or min(args.seeds) < 0:
        parser.error(f"--seeds: each seed once, none below 0, got {args.seeds}")
    try:  # a user's file of one of these names in --out is never overwritten
        check_output_file(
            args.out / "packing_seeds.json", "seeds' table", lambda p: "over_seeds" in json.loads(p.read_text())
        )
        check_output_file(args.out / "packing_seeds.md", "seeds' table", lambda p: p.read_text().startswith("| seed |"))
    except DensepassError as err:
        parser.error(str(err))
    seconds = {f"{k}-{s}": run_main_job(args.out, k, s, args.data_dir) for s in args.seeds for k in KINDS}

    dataset = load_dataset("debian-packages", args.data_dir)
    runs = {name: read_trec_run(args.out / name / "runs" / "fine-tuned.trec", dataset.corpus) for name in seconds}
    qrels = answered_qrels(dataset.split("dev"), list(runs.values()))
    rows = []
    for seed in args.seeds:
        pair = {kind: runs[f"{kind}-{seed}"] for kind in KINDS}
        test = paired_significance(qrels, pair, "padded", METRIC)["packed"]
        means = {kind: float(per_query_scores(qrels, pair[kind], METRIC).mean()) for kind in KINDS}
        rows.append({"seed": seed, **means, **test})
    packed, padded = (np.array([r[kind] for r in rows]) for kind in KINDS)
    seeds = {
        "packed": float(packed.mean()),
        "padded": float(padded.mean()),
        "delta": float(packed.mean() - padded.mean()),
        "packed_sd": float(packed.std(ddof=1)) if len(rows) > 1 else 0.0,
        "padded_sd": float(padded.std(ddof=1)) if len(rows) > 1 else 0.0,
        "p": permutation_p(packed, padded),
        "p_paired": randomization_p(packed, padded),
    }
    result = {"metric": METRIC, "queries": len(qrels), "seeds": rows, "over_seeds": seeds, "seconds": seconds}

    lines = [f"| seed | packed {METRIC} | padded {METRIC} | Δ | wins / ties / losses | p (per query) |"]
    lines.append("|---|---:|---:|---:|---|---:|")
    for r in rows:
        lines.append(
            f"| {r['seed']} | {r['packed']:.4f} | {r['padded']:.4f} | {r['delta']:+.4f} | "
            f"{r['wins']} / {r['ties']} / {r['losses']} | {r['p']:.3g} |"
        )
    o = seeds
    lines.append(
        f"| mean of {len(rows)} seeds (sd) | {o['packed']:.4f} ({o['packed_sd']:.4f}) | {o['padded']:.4f} "
        f"({o['padded_sd']:.4f}) | {o['delta']:+.4f} | | {o['p']:.3g} (the seeds' values, permuted) |"
    )
    lines.append(
        f"| the seeds' Δ, paired by seed | | | {o['delta']:+.4f} | {int((packed > padded).sum())} / "
        f"{int((packed == padded).sum())} / {int((packed < padded).sum())} seeds | {o['p_paired']:.3g} (signs "
        "flipped) |"
    )
    table = "\n".join(lines)
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(args.out / "packing_seeds.json", json.dumps(result, indent=2, default=float) + "\n")
    atomic_write_text(args.out / "packing_seeds.md", table + "\n")


if __name__ == "__main__":
    main()
