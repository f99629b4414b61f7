"""Plot helpers for reports: JSONL logs read back, and a figure context that saves a PNG (matplotlib, Agg)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def read_log(path: Path) -> list[dict]:
    """The records of a JSONL log (empty when the file is missing or empty); a line that is not a JSON object
    (cut short, or damaged bytes) is left out: a log only draws plots."""
    if not path.is_file():
        return []
    records = []
    for line in path.read_bytes().splitlines():  # a line cut short or damaged (a crash mid-append): left out
        try:
            record = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


PNG_METADATA = {"Software": "densepass"}  # the tEXt chunk that tells densepass's own plots from a user's images


def is_densepass_png(path: str | Path) -> bool:
    """Whether ``path`` is a PNG densepass drew (its ``Software`` text chunk says so): the only images it replaces."""
    data = Path(path).read_bytes()
    return data.startswith(b"\x89PNG") and b"tEXtSoftware\x00densepass" in data


@contextmanager
def figure(out_path: Path, size: tuple[float, float] = (6, 3.5), xlabel: str = "", ylabel: str = "") -> Iterator[Any]:
    """Yield the axes of a new figure; on leaving, grid, labels, tight layout, save ``out_path`` (PNG), close."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=size)
    try:
        yield ax
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out_path, dpi=120, metadata=PNG_METADATA)
    finally:
        plt.close(fig)
