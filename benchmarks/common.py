"""Shared by the benchmark scripts: device choice, where it ran, timing, the markdown table and JSON."""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import time
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import torch

from densepass.io import atomic_write_text


def pick_device(name: str | None) -> torch.device:
    return torch.device(name or ("cuda" if torch.cuda.is_available() else "cpu"))


def environment(device: torch.device) -> dict:
    """Where a benchmark ran: the device and the versions of the libraries compared."""
    import sentence_transformers
    import transformers

    if device.type == "cuda":
        where = torch.cuda.get_device_name(device)
    else:
        cpu = platform.processor() or platform.machine()
        where = f"CPU {cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"
    return {
        "device": where,
        **cpu_facts(),
        "date": datetime.date.today().isoformat(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "sentence_transformers": sentence_transformers.__version__,
    }


def cpu_facts() -> dict:
    """The CPU's model name (/proc/cpuinfo), its flags that decide which bf16 path runs (AMX, AVX512-BF16, AVX2) and
    the build of densepass's CPU kernels that runs (``models.cpu_kernels.kind``, None: torch's path), and the load
    average when the benchmark started (other work on the machine slows every system alike only roughly)."""
    from densepass.device import cpuinfo_words
    from densepass.models import cpu_kernels

    model = "unknown"
    with contextlib.suppress(OSError):
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), model)
    wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8")
    flags = [flag for flag in wanted if flag in cpuinfo_words()]
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {"cpu_model": model, "cpu_flags": flags, "cpu_kernels": cpu_kernels.kind(), "load_average": load}


def encoder_flops_per_token(path: str, mean_length: float, backward: bool = False) -> float:
    """FLOPs per real token of a transformer encoder's forward pass (``backward``: forward and backward, three
    times as many): 2 x its non-embedding parameters + attention's two products (QK^T and PV) over ``mean_length``
    tokens, 4 x layers x width x ``mean_length``."""
    from transformers import AutoConfig, AutoModel

    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        model = AutoModel.from_config(config)
    weights = sum(p.numel() for n, p in model.named_parameters() if "embeddings" not in n and "pooler" not in n)
    forward = 2 * weights + 4 * config.num_hidden_layers * config.hidden_size * mean_length
    return 3 * forward if backward else forward


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepClock:
    """Seconds between the end of step ``start`` and the end of step ``stop`` (device synchronised); pass it as a
    trainer's ``on_step_end``."""

    def __init__(self, device: torch.device, start: int, stop: int) -> None:
        self.device, self.start, self.stop = device, start, stop
        self.t0 = self.seconds = None

    def __call__(self, step: int) -> None:
        """Record the time of step ``step``."""
        if step in (self.start, self.stop):
            sync(self.device)
            if step == self.start:
                self.t0 = time.perf_counter()
            else:
                self.seconds = time.perf_counter() - self.t0


@contextmanager
def timer(device: torch.device):
    """``with timer(device) as t: ...`` then ``t()`` is the elapsed seconds (device work included)."""
    sync(device)
    started = time.perf_counter()
    box = {}
    try:
        yield lambda: box["s"]
    finally:
        sync(device)
        box["s"] = time.perf_counter() - started


def print_profile(fn, device: torch.device, rows: int = 15, shapes: bool = False) -> None:
    """``fn()`` under ``torch.profiler``; prints the ``rows`` ops with the most self CPU time (where the time goes).
    ``shapes``: then also the ``rows`` (op, input shapes) pairs with the most (``record_shapes``): which tensors an
    op's time goes to, e.g. a fill of a whole vocabulary table or the casts of one activation. On a GPU also the
    ops by self GPU time grouped by their Python call sites (which code launches the kernels that fill the device),
    and each place where the host waited for the device (``torch.cuda.set_sync_debug_mode``: one warning per call
    site, with its stack)."""
    import warnings

    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    before = torch.cuda.get_sync_debug_mode() if cuda else 0
    with (
        profile(activities=activities, with_stack=cuda, record_shapes=shapes) as prof,
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("default")  # once per call site
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(before)
    waits = [w for w in caught if "synchroniz" in str(w.message)]
    for w in caught:  # the others, as they would have been shown
        if w not in waits:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    averages = prof.key_averages()
    print(averages.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=40))
    if shapes:
        by_shape = prof.key_averages(group_by_input_shape=True)
        print(by_shape.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=30,
                             max_shapes_column_width=70))  # fmt: skip
    if not cuda:
        return
    by_site = prof.key_averages(group_by_stack_n=4)
    print(by_site.table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=40))
    print(f"{len(waits)} call sites where the host waited for the device:")
    for w in waits:
        print(f"  {w.filename}:{w.lineno}: {str(w.message).splitlines()[0]}")


Round = TypeVar("Round")


def median_round(rounds: list[Round], ratio: Callable[[Round], float]) -> Round:
    """The median of ``rounds`` by ``ratio(round)`` (the lower middle of an even count): the round a table shows."""
    return sorted(rounds, key=ratio)[(len(rounds) - 1) // 2]


def markdown_table(headers: list[str], rows: list[list]) -> str:
    lines = [
        "| " + " | ".join(headers) + " |",
        "|" + "|".join("---" if i == 0 else "---:" for i in range(len(headers))) + "|",
    ]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


TABLE_MARK = "<!-- written by a densepass benchmark -->"  # the first line of a table file a benchmark writes


def _json_object(path: Path) -> bool:
    return isinstance(json.loads(path.read_text(encoding="utf-8")), dict)


def _our_table(path: Path) -> bool:
    return path.read_text(encoding="utf-8").startswith(TABLE_MARK)


def _checked(path: Path, what: str, ours: Callable[[Path], bool]) -> None:
    """``io.check_output_file`` for a benchmark's ``--out``, as an argparse error (a usage line, before any work)."""
    import argparse

    from densepass.errors import DensepassError
    from densepass.io import check_output_file

    try:
        check_output_file(path, what, ours)
    except (DensepassError, OSError) as err:  # (OSError: a path no file can be made at)
        raise argparse.ArgumentTypeError(str(err).replace("--output ", "", 1)) from None


def output_file(value: str) -> str:
    """argparse type of a benchmark's ``--out`` JSON: a path it may write (missing, empty, or a JSON object a run
    wrote), checked before any work: a benchmark overwrites only its own results."""
    _checked(Path(value), "benchmark's JSON results", _json_object)
    return value


def output_with_table(value: str) -> str:
    """``output_file`` for a benchmark that writes its markdown table beside the JSON (``.md``): that one too."""
    output_file(value)
    _checked(Path(value).with_suffix(".md"), "benchmark's table", _our_table)
    return value


def write_table(path: str | Path, text: str) -> None:
    """A benchmark's markdown table (first line ``TABLE_MARK``, so that a run may replace it), atomically."""
    atomic_write_text(Path(path), f"{TABLE_MARK}\n{text}")


def write_json(path: str | Path | None, payload: dict) -> None:
    if path:
        atomic_write_text(Path(path), json.dumps(payload, indent=2))
        print(f"\nwrote {path}")


def rate(x: float) -> str:
    """A throughput for a table: whole numbers when large, two decimals when small."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.2f}"
