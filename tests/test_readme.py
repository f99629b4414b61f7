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
    assert "bash scripts/setup.sh && python3 -m pytest -n 2" in first


def python_training_example() -> str:
    section = README.read_text().split("## Train from Python", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_python_training_example_runs_and_gives_the_yaml_runs_weights(tmp_path, monkeypatch, capsys):
    """The README's ``dp.train`` example, run as written (MiniLM on debian-packages), and ``densepass run`` with the
    settings the README names end with the same weights. Both run in this process (from ``tmp_path``): what they
    check is the code and the settings, which a process of their own would only import again."""
    from safetensors.torch import load_file

    from densepass.cli import main
    from densepass.data.paths import default_data_dir

    monkeypatch.setenv("DENSEPASS_DATA", str(default_data_dir().resolve()))  # the data beside the checkout
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    exec(compile(python_training_example(), "README.md", "exec"), {"__name__": "__main__"})
    assert capsys.readouterr().out.split() == ["4", "1"]  # 4 steps, one log record (log_every 10, and the last step)
    settings = [
        "name=yaml",
        f"output_dir={tmp_path}",
        "data.name=debian-packages",
        "data.max_train_queries=64",
        "data.max_eval_queries=5",
        "data.eval_subcorpus=true",
        "data.eval_random=20",
        "negatives.source=bm25",
        "negatives.pool_depth=30",
        "negatives.per_query=1",
        "train.max_steps=4",
        "train.batch_size=16",
        "train.learning_rate=5e-5",
        "model.temperature=0.05",
        "eval.baselines=[]",
    ]
    assert main(["run", *[a for s in settings for a in ("--set", s)]]) == 0, capsys.readouterr().err[-2000:]
    python = load_file(str(tmp_path / "outputs" / "python-first" / "model" / "model.safetensors"))
    yaml = load_file(str(tmp_path / "yaml" / "model" / "model.safetensors"))
    assert python.keys() == yaml.keys() and all(python[k].equal(yaml[k]) for k in python)


def test_the_bring_your_own_model_and_data_example_runs_as_written(tmp_path):
    """The README's decoder + LoRA + prompts example on a triplets file, run as written."""
    section = README.read_text().split("## Bring your own model and data", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["3", "runs/decoder/model"]
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(tmp_path / "runs" / "decoder" / "model"), device="cpu")
    assert st.prompts["query"] == "Instruct: find the tool\nQuery: "
