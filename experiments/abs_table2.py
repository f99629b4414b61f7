"""Reproduce the ABS paper's Table 2 rows on one dataset under one training budget.

    python experiments/abs_table2.py [--config configs/abs_table2.yaml] [--set key=value ...] [--out DIR]

Runs the shared config once per batch order (reusing a variant whose run directory already holds a
finished run of the same config) and writes ``table2.md`` (dev metrics, scheduling time,
time training waited for batches, mean batch hardness vs random) and ``table2_loss.png`` (training
loss curves, the paper's Figure 5) into --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from densepass.cli import run_guarded
from densepass.config import from_dict, load_config
from densepass.errors import ConfigError
from densepass.io import atomic_write_text
from densepass.pipelines.experiment import run_experiment

VARIANTS = {
    "Non-ABS-Sequential": ["schedule.method=sequential"],
    "Non-ABS-Random": ["schedule.method=random"],
    "ABS-BM25": ["schedule.method=abs-greedy", "schedule.similarity=bm25"],
    "ABS-Encode": ["schedule.method=abs-greedy", "schedule.similarity=bm25-then-encoder"],
    "ABS-BeamSearch": ["schedule.method=abs-beam", "schedule.similarity=bm25-then-encoder", "schedule.beam_width=4"],
}


def finished(config) -> bool:
    """Whether the variant's run directory holds a finished run of exactly this config."""
    path = config.run_dir / "metrics.json"
    if not path.is_file():
        return False
    stored = json.loads(path.read_text())
    same = from_dict(type(config), stored["config"]) == config  # fields added since then take their defaults
    return same and "fine-tuned" in stored["results"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/abs_table2.yaml")
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument(
        "--only", nargs="*", default=None, help="run only these variants (the table still shows every finished one)"
    )
    parser.add_argument("--out", default="outputs/abs-table2")
    args = parser.parse_args()
    unknown = sorted(set(args.only or ()) - set(VARIANTS))
    if unknown:
        raise ConfigError(f"--only: unknown variant(s) {', '.join(unknown)} (known: {', '.join(VARIANTS)})")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows, curves = [], {}
    for label, overrides in VARIANTS.items():
        slug = label.lower()
        config = load_config(args.config, [*args.set, *overrides, f"name={slug}"])
        run_dir = config.run_dir
        if finished(config):
            print(f"{label}: finished earlier with the same config, reusing {run_dir / 'metrics.json'}")
        elif args.only and label not in args.only:
            continue  # not asked for, and no finished run of this config to show
        else:
            run_experiment(config)
        metrics = json.loads((run_dir / "metrics.json").read_text())
        results = metrics["results"]["fine-tuned"]
        log = [json.loads(line) for line in (run_dir / "train_log.jsonl").read_text().splitlines()]
        curves[label] = ([r["step"] for r in log], [r["loss"] for r in log])
        schedule = run_dir / "schedule_log.jsonl"
        sched = [json.loads(line) for line in schedule.read_text().splitlines()] if schedule.is_file() else []
        rows.append((label, results, metrics["timings"]["train_s"], sched))
    metric_names = list(rows[0][1]) if rows else []
    lines = [
        "| batches | "
        + " | ".join(metric_names)
        + " | train s | schedule s (per epoch) | waited s | h(B) / random (per epoch) |",
        "|---|" + "---:|" * (len(metric_names) + 4),
    ]
    for label, results, train_s, sched in rows:
        sched_s = ", ".join(f"{r['schedule_s']:.0f}" for r in sched) or "-"
        waited = f"{sum(r['waited_s'] for r in sched):.1f}" if sched else "-"
        ratio = (
            ", ".join(f"{r['mean_hardness'] / r['random_mean_hardness']:.1f} ({r['similarity']})" for r in sched) or "-"
        )
        lines.append(
            f"| {label} | "
            + " | ".join(f"{results[m]:.4f}" for m in metric_names)
            + f" | {train_s:.0f} | {sched_s} | {waited} | {ratio} |"
        )
    atomic_write_text(out / "table2.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, (steps, losses) in curves.items():
        ax.plot(steps, losses, label=label, linewidth=1)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "table2_loss.png", dpi=120)


if __name__ == "__main__":
    sys.exit(run_guarded(main, Path(__file__).name))
