"""The report of ``densepass run``: the metrics table and PNG plots of the training, validation and schedule logs."""

from __future__ import annotations

from pathlib import Path

from densepass.evaluation.tables import metrics_table
from densepass.io import atomic_write_text
from densepass.plots import figure, read_log


def plot_training_log(log_path: Path, out_path: Path) -> bool:
    """Loss per step as a PNG; False when there is no log to plot."""
    records = read_log(log_path)
    if not records:
        return False
    with figure(out_path, xlabel="step", ylabel="training loss") as ax:
        ax.plot([r["step"] for r in records], [r["loss"] for r in records], marker=".")
    return True


def plot_schedule_log(log_path: Path, out_path: Path) -> bool:
    """Mean batch hardness per epoch, scheduled vs random batches (abs-condenser-openqa Figures 3-5)."""
    records = read_log(log_path)
    if not records:
        return False
    epochs = [r["epoch"] + 1 for r in records]
    with figure(out_path, xlabel="epoch", ylabel="mean batch hardness h(B)") as ax:
        ax.plot(epochs, [r["mean_hardness"] for r in records], marker="o", label="scheduled")
        ax.plot(epochs, [r["random_mean_hardness"] for r in records], marker="x", label="random")
        for e, r in zip(epochs, records):
            ax.annotate(r["similarity"], (e, r["mean_hardness"]), fontsize=7)
        ax.legend()
    return True


def plot_log_metrics(log_path: Path, metrics: list[str], out_path: Path, x: str) -> bool:
    """Metrics from a JSONL log against ``x`` (epoch or step)."""
    records = read_log(log_path)
    if not records:
        return False
    with figure(out_path, xlabel=x, ylabel="metric") as ax:
        for m in metrics:
            if m in records[0]:
                ax.plot([r[x] for r in records], [r[m] for r in records], marker="o", label=m)
        if "subcorpus" in records[0]:
            ax.set_title(f"validation on {records[0]['subcorpus']} ({records[0]['size']} passages)", fontsize=9)
        ax.legend(fontsize=8)
    return True


def plot_metrics(results: dict[str, dict[str, float]], metrics: list[str], out_path: Path) -> None:
    """Grouped bars of each system's metrics."""
    import numpy as np

    width = 0.8 / max(len(results), 1)
    x = np.arange(len(metrics))
    with figure(out_path, size=(7, 3.5)) as ax:
        for i, (name, values) in enumerate(results.items()):
            ax.bar(x + i * width, [values.get(m, 0.0) for m in metrics], width, label=name)
        ax.set_xticks(x + width * (len(results) - 1) / 2, metrics)
        ax.set_ylim(0, 1)
        ax.legend(fontsize=8)


def write_report(
    run_dir: Path,
    title: str,
    description: str,
    results: dict[str, dict[str, float]],
    metrics: list[str],
    notes: list[str],
) -> Path:
    """Write ``report.md`` (table, notes and plots of the run's logs) into ``run_dir``."""
    plots = []
    if plot_training_log(run_dir / "train_log.jsonl", run_dir / "loss.png"):
        plots.append("![training loss](loss.png)")
    if plot_log_metrics(run_dir / "eval_log.jsonl", metrics, run_dir / "epochs.png", "epoch"):
        plots.append("![metrics per epoch](epochs.png)")
    if plot_log_metrics(run_dir / "validation_log.jsonl", metrics, run_dir / "validation.png", "step"):
        plots.append("![validation metrics per step](validation.png)")
    if plot_schedule_log(run_dir / "schedule_log.jsonl", run_dir / "hardness.png"):
        plots.append("![batch hardness](hardness.png)")
    plot_metrics(results, metrics, run_dir / "metrics.png")
    plots.append("![metrics](metrics.png)")
    text = "\n\n".join([f"# {title}", description, metrics_table(results, metrics), *notes, *plots]) + "\n"
    path = run_dir / "report.md"
    atomic_write_text(path, text)
    return path
