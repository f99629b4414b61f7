"""Helper processes die with their parent: a real ``densepass run`` with ABS scheduling in a background process,
killed (SIGKILL, SIGTERM) while it trains, leaves no process behind (the scheduler worker nor multiprocessing's
resource tracker); and ``die_with_parent`` itself, in a child whose parent is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import save_tiny_bert, write_tiny_beir

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds processes through /proc"),
]

GONE_WITHIN_S = 10.0


# ---- processes, through /proc -------------------------------------------------------------------------


def stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, start time) of ``pid``; None when there is no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the command name in parentheses may hold spaces
    return fields[0], int(fields[1]), int(fields[19])


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except (FileNotFoundError, ProcessLookupError):
        return ""


def descendants(root: int) -> dict[int, int]:
    """pid -> start time of every living process below ``root``."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (found := stat(int(entry.name))) is not None and found[0] != "Z":
            parents[int(entry.name)] = (found[1], found[2])
    below, frontier = {}, [root]
    while frontier:
        parent = frontier.pop()
        for pid, (ppid, started) in parents.items():
            if ppid == parent and pid not in below:
                below[pid] = started
                frontier.append(pid)
    return below


def alive(processes: dict[int, int]) -> dict[int, str]:
    """Those of ``processes`` (pid -> start time) still running (a zombie has ended), with their command lines."""
    out = {}
    for pid, started in processes.items():
        found = stat(pid)
        if found is not None and found[2] == started and found[0] != "Z":
            out[pid] = cmdline(pid)
    return out


def assert_all_end(processes: dict[int, int]) -> None:
    deadline = time.monotonic() + GONE_WITHIN_S
    while (left := alive(processes)) and time.monotonic() < deadline:
        time.sleep(0.05)
    for pid in left:  # clean up before failing, so that a failure leaves nothing running either
        os.kill(pid, signal.SIGKILL)
    assert not left, f"still running {GONE_WITHIN_S:.0f} s after their parent was killed: {left}"


# ---- a densepass run with a background ABS scheduler ------------------------------------------------------


@pytest.fixture(scope="module")
def abs_run_config(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("abs-run")
    data, model = write_tiny_beir(root / "tiny"), save_tiny_bert(root / "bert")
    lines = [
        "name: run",
        f"output_dir: {root}",
        f"data: {{name: {data}}}",
        f"model: {{name_or_path: {model}, passage_max_length: 32}}",
        "negatives: {source: none, per_query: 0}",
        "train: {batch_size: 4, epochs: 1000, log_every: 1, checkpoint_every: 100000}",  # trains until killed
        "schedule: {method: abs-greedy, similarity: bm25-then-encoder, background: true}",
        "eval: {baselines: [], metrics: [mrr@10], depth: 10}",
    ]
    (root / "config.yaml").write_text("\n".join(lines) + "\n")
    return root / "config.yaml"


@pytest.mark.parametrize("kill_signal", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_killing_a_run_ends_its_abs_scheduler_and_the_resource_tracker(abs_run_config, tmp_path, kill_signal):
    import densepass

    env = {**os.environ, "PYTHONPATH": str(Path(densepass.__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "densepass",
            "run",
            str(abs_run_config),
            "--restart",
            "--set",
            f"name={kill_signal.name}",
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    train_log = abs_run_config.parent / kill_signal.name / "train_log.jsonl"
    deadline = time.monotonic() + 120
    try:
        while not (train_log.is_file() and train_log.read_text().count("\n") >= 2):  # batches came from the worker
            assert process.poll() is None, process.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the run never reached its second step"
            time.sleep(0.05)
        started = descendants(process.pid)
        commands = alive(started)
        assert any("spawn_main" in c for c in commands.values()), commands  # the scheduler worker
        assert any("resource_tracker" in c for c in commands.values()), commands
    except BaseException:
        process.kill()
        process.wait()
        raise
    process.send_signal(kill_signal)
    assert process.wait(timeout=30) == -kill_signal
    assert_all_end(started)


# ---- die_with_parent on its own -------------------------------------------------------------------------

PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", *sys.argv[1:]])
print(child.pid, flush=True)
time.sleep(600)
"""

CHILD = """
import os, sys, time
from densepass import processes
if sys.argv[1] == "polling":  # the fallback where the kernel cannot be asked (not Linux)
    processes._kernel_kills_on_parent_death = lambda: False
processes.die_with_parent(os.getppid(), poll_s=0.05)
print("ready", flush=True)
time.sleep(600)
"""

CHILD_TOO_LATE = """
import os, time
from densepass.processes import die_with_parent
parent = os.getppid()
print("ready", flush=True)
while os.getppid() == parent:  # the parent is killed before this process asks to die with it
    time.sleep(0.01)
die_with_parent(parent)
time.sleep(600)
"""


def start_parent(child_code: str, *child_args: str) -> tuple[subprocess.Popen, int, int]:
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, child_code, *child_args], stdout=subprocess.PIPE, text=True
    )
    child = int(parent.stdout.readline())
    assert parent.stdout.readline() == "ready\n"  # the child's own line (it shares the parent's stdout)
    return parent, child, stat(child)[2]


@pytest.mark.parametrize("mechanism", ["kernel", "polling"])
@pytest.mark.parametrize("kill_signal", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_a_process_that_asked_to_die_with_its_parent_does(kill_signal, mechanism):
    parent, child, started = start_parent(CHILD, mechanism)
    parent.send_signal(kill_signal)
    parent.wait()
    assert_all_end({child: started})


def test_a_process_whose_parent_died_before_it_asked_ends_at_once():
    parent, child, started = start_parent(CHILD_TOO_LATE)
    parent.kill()
    parent.wait()
    assert_all_end({child: started})
