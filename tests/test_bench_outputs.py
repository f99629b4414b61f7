"""The benchmark scripts overwrite and remove only what they wrote: ``--out`` (and the table beside it) is checked
before any work, a run folder ``bench_scale.py`` replaces holds its mark; bad sizes are one usage line."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def benchmarks(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))


def test_out_is_a_missing_empty_or_earlier_result_and_its_table_one_a_run_marked(tmp_path, benchmarks):
    from common import output_file, output_with_table, write_json, write_table

    result = tmp_path / "result.json"
    assert output_file(str(result)) == str(result)  # missing
    write_json(result, {"benchmark": "x"})
    write_table(result.with_suffix(".md"), "| a |\n")
    assert output_with_table(str(result)) == str(result)  # a run's own: replaced
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    with pytest.raises(argparse.ArgumentTypeError, match="notes.txt exists and is not a benchmark's JSON results"):
        output_file(str(notes))
    mine = tmp_path / "mine.json"
    mine.with_suffix(".md").write_text("# my table\n")
    output_file(str(mine))  # the table is not this script's to write
    with pytest.raises(argparse.ArgumentTypeError, match="mine.md exists and is not a benchmark's table"):
        output_with_table(str(mine))


def test_bench_scale_replaces_only_its_own_run_folders(tmp_path, benchmarks):
    import bench_scale

    args = argparse.Namespace(work_dir=str(tmp_path), n=30, systems=["mine"], processes=[1])
    folder = bench_scale.run_folder(args, "mine", 1)
    folder.mkdir(parents=True)
    (folder / "user_notes.txt").write_text("precious")
    with pytest.raises(SystemExit, match="was not made by this script"):
        bench_scale.check_run_folders(args)
    (folder / bench_scale.RUN_MARK).write_text("")
    bench_scale.check_run_folders(args)


@pytest.mark.parametrize(
    ("script", "args", "said"),
    [
        ("bench_search.py", ["--k", "0"], "argument --k: must be >= 1, got 0"),
        ("bench_search.py", ["--sizes", "0"], "argument --sizes: must be >= 1, got 0"),
        ("bench_mine.py", ["--n", "-3"], "argument --n: must be >= 1, got -3"),
        ("bench_ann_curve.py", ["--random", "50", "--latency-queries", "0", "--out", "x"], "--latency-queries: must"),
        ("bench_scale.py", ["--processes", "0"], "argument --processes: must be >= 1, got 0"),
    ],
)
def test_bad_sizes_are_one_usage_line_before_any_work(tmp_path, script, args, said):
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args], cwd=tmp_path, capture_output=True, text=True
    )
    assert done.returncode == 2 and said in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_the_ann_curve_folder_is_checked_before_any_work(tmp_path, benchmarks):
    from bench_ann_curve import curve_folder

    (tmp_path / "curve.md").write_text("my curve notes")
    with pytest.raises(argparse.ArgumentTypeError, match="curve.md exists and is not a benchmark's table"):
        curve_folder(str(tmp_path))
    (tmp_path / "curve.md").unlink()
    (tmp_path / "curve.png").write_bytes(b"\x89PNG")
    with pytest.raises(argparse.ArgumentTypeError, match="curve.png exists"):
        curve_folder(str(tmp_path))
    (tmp_path / "curve.json").write_text(json.dumps({"benchmark": "ann_curve"}))
    assert curve_folder(str(tmp_path)) == str(tmp_path)
