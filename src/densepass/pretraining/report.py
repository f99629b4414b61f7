"""``report.md`` of a pre-training run: settings, final loss terms, throughput and loss curves."""

from __future__ import annotations

from pathlib import Path

import torch

from densepass.evaluation.tables import metrics_table
from densepass.io import atomic_write_text
from densepass.plots import figure, read_log
from densepass.pretraining.config import PretrainConfig

TERMS = ("loss", "late_mlm", "head_mlm", "contrastive")


def plot_loss_terms(records: list[dict], out_path: Path) -> None:
    """Plot each loss term against the step into a PNG."""
    steps = [r["step"] for r in records]
    with figure(out_path, xlabel="step", ylabel="loss") as ax:
        for term in TERMS:
            if any(r.get(term) for r in records):
                ax.plot(steps, [r[term] for r in records], label=term, linewidth=1)
        ax.legend(fontsize=8)


def _objective_settings(config: PretrainConfig) -> str:
    m, c = config.model, config.contriever
    if m.mode == "contriever":
        pairs = f"crops of {c.crop_ratio_min:.0%}-{c.crop_ratio_max:.0%} of {c.document_tokens}-token windows"
        pairs += f", {c.token_deletion:.0%} token deletion" + (
            f", {c.ict_probability:.0%} ICT" if c.ict_probability else ""
        )
        negatives = f"MoCo queue K={c.queue_size}, m={c.momentum}" if c.negatives == "moco" else "in-batch negatives"
        return f"{pairs}, {negatives}, {m.save_pooling} pooling, temperature {m.temperature}"
    layers = f"{m.early_layers} early layers + {m.head_layers}-layer head, " if m.mode != "mlm" else ""
    return layers + f"masking {config.masking.probability:.0%}{' whole words' if config.masking.whole_word else ''}"


def write_pretrain_report(config: PretrainConfig, log_path: Path, device: torch.device, bf16: bool) -> Path:
    """Write the run's ``report.md``: settings, final loss terms, throughput and loss curves."""
    run_dir = config.run_dir
    records = read_log(log_path)
    m, t = config.model, config.train
    lines = [
        f"# densepass pretrain: {config.name}",
        f"Mode `{m.mode}` from `{m.name_or_path}` on `{config.data.name}`"
        + (f" ({config.data.max_passages} passages)" if config.data.max_passages else "")
        + f": {t.max_steps} steps of {t.batch_size} x {t.max_length} tokens"
        + (f" ({t.grad_accumulation} micro-batches)" if t.grad_accumulation > 1 else "")
        + f", lr {t.learning_rate}, warm-up {t.warmup_ratio}, bf16 {bf16}, "
        + _objective_settings(config)
        + f"; device {device.type}.",
    ]
    if records:
        last = records[-1]
        lines.append(metrics_table({f"step {last['step']}": last}, [k for k in TERMS if k in last]))
        lines.append(f"Throughput (non-padding tokens/s, this session): {last['tokens_per_s']:.0f}.")
        plot_loss_terms(records, run_dir / "loss.png")
        lines.append("![loss terms](loss.png)")
    lines.append(
        "The backbone (head dropped) is in `backbone/`: load it with AutoModel, "
        "`BiEncoder.from_pretrained` or SentenceTransformer."
    )
    path = run_dir / "report.md"
    atomic_write_text(path, "\n\n".join(lines) + "\n")
    return path
