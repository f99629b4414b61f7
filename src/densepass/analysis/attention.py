"""CLS attention entropy per layer (condenser §5, after clark2019) and the Figure 2 plot.

For a passage and an attention head, the CLS row a_0 = softmax over the passage's tokens gives the
entropy H = -sum_j a_0j log a_0j (nats; padding has zero weight and adds nothing). The entropy of a
layer is the mean over its heads and over a sample of passages: high = broad attention, low = focused.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

import torch

from densepass.data import load_dataset
from densepass.data.dataset import Corpus
from densepass.data.paths import check_output_apart
from densepass.device import resolve_device
from densepass.errors import ConfigError, DensepassError
from densepass.io import atomic_write_text, check_output_file
from densepass.plots import PNG_METADATA, is_densepass_png


def cls_attention_entropy(attention: torch.Tensor) -> torch.Tensor:
    """[B, heads, L, L] attention probabilities of one layer -> [B, heads] entropy of the CLS row."""
    row = attention[:, :, 0, :].double()
    return -(torch.where(row > 0, row * row.log(), torch.zeros_like(row))).sum(-1)


def sample_passages(corpus: Corpus, n: int, seed: int, sep_token: str) -> list[str]:
    """``n`` random passages (seeded) as encoder inputs."""
    positions = sorted(random.Random(seed).sample(range(len(corpus)), min(n, len(corpus))))
    return corpus.passage_inputs(sep_token, positions)


@torch.no_grad()
def attention_entropy(
    model_path: str, texts: list[str], max_length: int = 128, batch_size: int = 32, device: torch.device | None = None
) -> list[float]:
    """Mean CLS attention entropy of each layer of a saved model over ``texts``."""
    from transformers import AutoModel, AutoTokenizer

    from densepass.models.biencoder import resolve_model_path
    from densepass.models.inputs import check_position_limit
    from densepass.models.kinds import loading_weights
    from densepass.numerics import refuse_nonfinite_weights

    if not texts:
        raise ConfigError("attention entropy needs at least one passage")
    path = resolve_model_path(model_path)
    device = device or torch.device("cpu")
    tokenizer = AutoTokenizer.from_pretrained(path)
    with loading_weights(path):
        model = AutoModel.from_pretrained(path, attn_implementation="eager").float().to(device).eval()
    refuse_nonfinite_weights(model, model_path, saving=False)  # NaN attention rows would read as entropy 0
    check_position_limit(model.config, {"--max-length": max_length}, model_path)
    totals: torch.Tensor | None = None
    for start in range(0, len(texts), batch_size):
        tokens = tokenizer(
            texts[start : start + batch_size], truncation=True, max_length=max_length, padding=True, return_tensors="pt"
        ).to(device)
        attentions = model(**tokens, output_attentions=True).attentions
        sums = torch.stack([cls_attention_entropy(a).mean(1).sum() for a in attentions]).cpu()
        totals = sums if totals is None else totals + sums
    return (totals / len(texts)).tolist()


def entropy_table(results: dict[str, list[float]]) -> str:
    """Markdown table: one row per model, one column per layer."""
    layers = max(len(v) for v in results.values())
    header = "| model | " + " | ".join(f"layer {i + 1}" for i in range(layers)) + " |"
    rows = [f"| {name} | " + " | ".join(f"{v:.3f}" for v in values) + " |" for name, values in results.items()]
    return "\n".join([header, "|---|" + "---:|" * layers, *rows])


def entropy_shift(before: list[float], after: list[float]) -> float:
    """Mean over layers of |entropy after - entropy before|: how far fine-tuning moved the CLS attention.

    Condenser §5 reads Figure 2 this way: a model with "structural readiness" changes little when
    fine-tuned, pre-trained BERT changes drastically.
    """
    if len(before) != len(after) or not before:
        raise DensepassError(f"entropy per layer of different models: {len(before)} vs {len(after)} layers")
    return sum(abs(a - b) for a, b in zip(after, before)) / len(before)


def plot_entropy(
    results: dict[str, list[float]],
    out_path: str | Path,
    title: str = "CLS attention entropy",
    panels: dict[str, list[str]] | None = None,
) -> None:
    """Entropy against layer for several models on one PNG (condenser Figure 2).

    With ``panels`` (panel title -> model names), one subplot per group, e.g. a model pre-trained and
    fine-tuned side by side as in the paper's Figure 2 (a)-(c); otherwise every model in one plot.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = panels or {"": list(results)}
    unknown = [name for names in groups.values() for name in names if name not in results]
    if unknown:
        raise DensepassError(f"no entropy for {unknown}: known models are {sorted(results)}")
    fig, axes = plt.subplots(1, len(groups), figsize=(max(6.0, 3.2 * len(groups)), 3.8), sharey=True, squeeze=False)
    for ax, (panel, names) in zip(axes[0], groups.items()):
        for name in names:
            values = results[name]
            ax.plot(range(1, len(values) + 1), values, marker="o", label=name.removeprefix(panel).strip() or name)
        ax.set_xlabel("layer")
        ax.set_title(panel or title, fontsize=10)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("mean CLS attention entropy (nats)")
    if panels:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=120, metadata=PNG_METADATA)
    plt.close(fig)


RESULT_KIND = "analyze-attention"  # what the numbers file says it is: a user's JSON of the same shape is not ours


def is_attention_result(path: str | Path) -> bool:
    """Whether ``path`` holds what ``analyze_attention`` writes beside its plot:
    ``{"densepass": "analyze-attention", "entropy": {label: [entropy per layer]}}``."""
    values = json.loads(Path(path).read_text(encoding="utf-8"))
    return (
        isinstance(values, dict) and values.get("densepass") == RESULT_KIND and isinstance(values.get("entropy"), dict)
    )


def analyze_attention(
    models: Sequence[str],
    output: str | Path,
    dataset: str,
    *,
    labels: Sequence[str] | None = None,
    data_dir: str | Path | None = None,
    format: str = "beir",
    samples: int = 1000,
    max_length: int = 128,
    seed: int = 13,
    device: str | torch.device | None = None,
) -> dict[str, list[float]]:
    """``densepass analyze-attention``: the CLS attention entropy per layer of each saved model (named by
    ``labels``, default the models themselves) over ``samples`` passages of ``dataset``, plotted to the PNG
    ``output`` with the numbers beside it (the same path with ``.json``); returns them.

    Before any work, one-line errors for: labels that do not match the models one to one, an ``output`` without
    a ``.png`` name, or among the inputs (``data.paths.check_output_apart``), and a plot or numbers file already
    there that densepass did not write (``io.check_output_file``)."""
    labels = list(labels or models)
    if len(labels) != len(models):
        raise ConfigError(f"--labels gives {len(labels)} names for {len(models)} models")
    if Path(output).suffix.lower() != ".png":
        raise ConfigError(f"--output {output} is the plot's path: give it a .png name (the numbers go beside it)")
    check_output_apart(output, dataset, data_dir, list(models))
    check_output_file(output, "attention plot", is_densepass_png)
    numbers = Path(output).with_suffix(".json")
    check_output_file(numbers, "attention result", is_attention_result)
    data = load_dataset(dataset, data_dir, format)
    texts = sample_passages(data.corpus, samples, seed, "[SEP]")
    device = device if isinstance(device, torch.device) else resolve_device(device)
    results = {
        label: attention_entropy(model, texts, max_length, device=device) for label, model in zip(labels, models)
    }
    plot_entropy(results, output, f"CLS attention entropy, {len(texts)} {data.name} passages")
    atomic_write_text(numbers, json.dumps({"densepass": RESULT_KIND, "entropy": results}, indent=2))
    return results
