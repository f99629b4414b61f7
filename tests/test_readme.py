"""The README's quickstart runs as written and prints what a user expects."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def quickstart() -> str:
    text = README.read_text()
    section = text.split("## Quickstart (Python)", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_quickstart_is_about_ten_lines_and_runs(tmp_path):
    code = quickstart()
    assert 8 <= len(code.strip().splitlines()) <= 14
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("vlc ")  # the video player is the best match
    assert (tmp_path / "my-index" / "manifest.json").is_file()


def test_the_readme_starts_with_the_two_commands():
    first = README.read_text().split("```bash", 1)[1].split("```", 1)[0]
    assert "bash scripts/setup.sh && python3 -m densepass run configs/main.yaml" in first
    assert "bash scripts/setup.sh && python3 -m pytest" in first
