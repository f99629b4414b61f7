"""Metric tables: one row per system, one column per metric, as markdown or as a rich terminal table."""

from __future__ import annotations


def metrics_table(results: dict[str, dict[str, float]], metrics: list[str]) -> str:
    """A markdown table of ``results`` ({system: {metric: value}}), values to 4 decimals (nan when missing)."""
    header = "| system | " + " | ".join(metrics) + " |"
    rule = "|---|" + "---:|" * len(metrics)
    rows = [
        f"| {name} | " + " | ".join(f"{values.get(m, float('nan')):.4f}" for m in metrics) + " |"
        for name, values in results.items()
    ]
    return "\n".join([header, rule, *rows])


def print_table(results: dict[str, dict[str, float]], metrics: list[str], title: str) -> None:
    """The same table printed to the terminal with rich."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    table.add_column("system")
    for m in metrics:
        table.add_column(m, justify="right")
    for name, values in results.items():
        table.add_row(name, *(f"{values.get(m, float('nan')):.4f}" for m in metrics))
    Console().print(table)
