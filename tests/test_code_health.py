"""Code health, checked with the suite: layers point one way, no import cycles, ruff lint and format clean, and
every benchmark and experiment script imports."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tool(name: str) -> str:
    found = shutil.which(name) or str(Path(sys.executable).with_name(name))
    if not Path(found).exists():
        pytest.fail(f"{name} is missing: pip install -e '.[test]'")
    return found


def test_no_lower_layer_imports_a_higher_one():
    """The import-linter contract in pyproject.toml (function-level and ``TYPE_CHECKING`` imports included)."""
    result = subprocess.run([_tool("lint-imports"), "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff_is_clean(command):
    """ruff's lint rules and formatting (configured in pyproject.toml) hold for the whole tree."""
    paths = ["src", "tests", "benchmarks", "experiments"]
    result = subprocess.run([_tool("ruff"), *command, *paths], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components of a directed graph (iterative, any size)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    out.append(component)
            elif child not in index:
                index[child] = low[child] = counter[0]
                counter[0] += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return out


def test_strongly_connected_finds_a_cycle_and_nothing_else():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    components = sorted(sorted(c) for c in strongly_connected(graph))
    assert components == [["a", "b", "c"], ["d"]]


def import_cycles(package: str) -> list[list[str]]:
    """The import circles among ``package``'s modules: every import counts, function-level ones and those under
    ``if TYPE_CHECKING:`` too (an annotation-only import still ties the two modules together)."""
    modules = grimp.build_graph(package, cache_dir=None, exclude_type_checking_imports=False)
    graph = {m: set(modules.find_modules_directly_imported_by(m)) for m in modules.modules}
    return sorted(sorted(c) for c in strongly_connected(graph) if len(c) > 1)


def test_import_cycles_sees_type_checking_and_function_level_imports(tmp_path, monkeypatch):
    package = tmp_path / "planted_circles"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from planted_circles.b import B\n"
    )
    (package / "b.py").write_text("def b():\n    from planted_circles.a import A\n")
    (package / "c.py").write_text("import planted_circles.a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert import_cycles("planted_circles") == [["planted_circles.a", "planted_circles.b"]]


def test_no_module_imports_itself_through_others():
    cycles = import_cycles("densepass")
    assert not cycles, f"import cycles: {cycles}"


UNPICKLING = ("torch.load(", "import pickle", "pickle.load", "joblib", "allow_pickle=True", "trust_remote_code=True")


def test_nothing_densepass_reads_can_unpickle_or_run_remote_code():
    """Checkpoints are safetensors + JSON, arrays are read with allow_pickle=False, models never run remote code:
    a planted pickle is never executed (tests/test_faults.py checks that end to end)."""
    offenders = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in sorted((ROOT / "src").rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if any(pattern in line for pattern in UNPICKLING)
    ]
    assert offenders == []


SCRIPTS = sorted([*ROOT.glob("benchmarks/*.py"), *ROOT.glob("experiments/*.py")])


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_benchmark_and_experiment_script_imports(script, monkeypatch):
    # A script is run by hand, so a densepass name it imports that was renamed breaks it unseen until the next
    # benchmark run (bench_mine.py imported a private helper after its rename); importing each one catches that.
    monkeypatch.syspath_prepend(str(script.parent))
    name = f"script_{script.parent.name}_{script.stem}"
    spec = importlib.util.spec_from_file_location(name, script)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    assert module.__doc__, f"{script.name} has no docstring saying what it measures and how to run it"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_a_scripts_help_shows_its_commands_as_written(script):
    # --help prints the module docstring: a shell line continuation (a backslash at a line's end) in a plain
    # string joins the command's lines into one, so such docstrings are raw strings
    text = script.read_text()
    assert text.startswith(('"""', 'r"""')), f"{script.name} does not start with its docstring"
    body = text[text.index('"""') + 3 : text.index('"""', text.index('"""') + 3)]
    assert text.startswith('r"""') or not re.search(r"(?<!\\)\\\n", body), f"{script.name}: make its docstring raw"


def test_evaluating_a_run_file_imports_no_torch(tiny_beir, tmp_path):
    # `densepass evaluate` reads a dataset and a run file: importing torch would add seconds to every evaluation
    # (about 2 s on a 2-core AMD EPYC) for nothing; its own process, since the suite's has torch loaded already
    run = tmp_path / "run.trec"
    run.write_text("q0 Q0 p0 1 2.0 t\nq0 Q0 p1 2 1.0 t\n")
    program = (
        "import sys; from densepass.cli import main; "
        f"code = main(['evaluate', {str(tiny_beir)!r}, {str(run)!r}, '--split', 'train', '--metrics', 'mrr@10']); "
        "sys.exit(code or 10 * ('torch' in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
