"""A full disk (issue 49, items 8 and 10): every write that finds no space is a one-line error, before the work where
its size is known (memory-mapped files have their blocks reserved: never SIGBUS), with nothing half-written and no
temporary left; the temporaries a killed process left are removed at the next start, and nothing else is.

The end-to-end tests run the real ``densepass`` on a small tmpfs (skipped where mounting one is not permitted); the
in-process tests simulate the same errors with monkeypatching and always run."""

from __future__ import annotations

import errno
import fcntl
import os
import re
import subprocess
import time
from pathlib import Path

import pytest

from conftest import densepass_here, run_densepass, small_run_overrides, write_tiny_beir
from densepass.errors import DensepassError

pytestmark = pytest.mark.timeout(600)

FULL = re.compile(r"^densepass: error: no space left on device writing \S+.*\n$")


def no_space(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def temporaries(root: Path) -> list[str]:
    """What densepass writes while it works and should not leave behind: temporaries, partial arrays."""
    return sorted(
        str(p.relative_to(root)) for p in root.rglob("*") if p.name.endswith((".tmp", ".partial", ".partial.npz"))
    )


def assert_one_line(result: subprocess.CompletedProcess, pattern: re.Pattern = FULL) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines(keepends=True) if line.startswith("densepass: error:")]
    assert len(errors) == 1 and pattern.match(errors[0]), result.stderr


# ---- a small real file system --------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path):
    """``mount(size)``: a tmpfs of ``size`` at a new directory (skipped where mounting is not permitted)."""
    mounted: list[Path] = []

    def mount(size: str) -> Path:
        target = tmp_path / f"disk{len(mounted)}"
        target.mkdir()
        try:
            done = subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(target)], capture_output=True, text=True
            )
        except OSError as err:
            pytest.skip(f"cannot mount a tmpfs here ({err})")
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()})")
        mounted.append(target)
        return target

    yield mount
    for target in mounted:
        if subprocess.run(["umount", str(target)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(target)], capture_output=True)


def fill(disk: Path) -> None:
    """Write a file on ``disk`` until no space is left."""
    with open(disk / "filler", "wb", buffering=0) as handle:
        try:
            while True:
                handle.write(b"\0" * 4096)
        except OSError as err:
            assert err.errno == errno.ENOSPC


def test_a_dense_index_larger_than_the_disk_is_one_line_before_encoding(tmp_path, tiny_model_dir, small_disk):
    data = write_tiny_beir(tmp_path / "data", 3000, seed=1)  # 3000 x 32 floats: 384 KB of embeddings
    disk = small_disk("256k")
    result = run_densepass("index", str(data), "--model", str(tiny_model_dir), "--output", "idx", cwd=disk)
    assert_one_line(result)  # was: killed by SIGBUS (exit 135), no message
    assert "needs ~0.4 MB" in result.stderr and "rows-" in result.stderr
    assert "encode passages" not in result.stderr  # refused before the encoding started
    assert not (disk / "idx").exists() and temporaries(disk) == []


def test_a_dense_index_whose_save_fails_resumes_once_space_is_freed(tmp_path, tiny_model_dir, small_disk):
    data = write_tiny_beir(tmp_path / "data", 3000, seed=1)
    args = ["index", str(data), "--model", str(tiny_model_dir)]
    assert densepass_here(*args, "--output", str(tmp_path / "reference"), cwd=tmp_path).returncode == 0
    disk = small_disk("440k")  # the encoding fits, the saved index beside it does not
    result = run_densepass(*args, "--output", "idx", cwd=disk)
    assert_one_line(result)
    assert "writing idx" in result.stderr
    assert not (disk / "idx").exists() and temporaries(disk) == []
    assert list((disk / ".idx.encoding").glob("rows-*.npy"))  # the encoding is kept: a re-run resumes from it
    subprocess.run(["mount", "-o", "remount,size=4m", str(disk)], check=True)
    again = densepass_here(*args, "--output", "idx", cwd=disk)  # the failed run is a program, these need not be
    assert again.returncode == 0, again.stderr
    assert "encode passages" not in again.stderr  # nothing encoded again
    for name in ("embeddings.npy", "passages.jsonl"):
        assert (disk / "idx" / name).read_bytes() == (tmp_path / "reference" / name).read_bytes()
    assert not (disk / ".idx.encoding").exists() and temporaries(disk) == []


def test_a_bm25_index_on_a_full_disk_is_one_line(tmp_path, small_disk):
    data = write_tiny_beir(tmp_path / "data", 3000, seed=1)
    disk = small_disk("128k")
    result = run_densepass("index", str(data), "--kind", "bm25", "--output", "idx", cwd=disk)
    assert_one_line(result)
    assert "writing idx" in result.stderr
    assert not (disk / "idx").exists() and temporaries(disk) == []


def test_a_run_file_on_a_full_disk_is_one_line(tmp_path, small_disk):
    data = write_tiny_beir(tmp_path / "data", 40)
    assert densepass_here("index", str(data), "--kind", "bm25", "--output", "idx", cwd=tmp_path).returncode == 0
    disk = small_disk("64k")
    fill(disk)
    queries = data / "queries.jsonl"
    result = run_densepass("search", "idx", "--queries", str(queries), "--output", str(disk / "run.trec"), cwd=tmp_path)
    assert_one_line(result)
    assert "run.trec (needs ~" in result.stderr and "0.0 MB free" in result.stderr
    assert sorted(p.name for p in disk.iterdir()) == ["filler"]


def test_a_checkpoint_that_does_not_fit_is_one_line_and_leaves_no_partial_checkpoint(
    tmp_path, tiny_beir, tiny_model_dir, small_disk
):
    disk = small_disk("3m")  # the run's first files fit; a checkpoint of the tiny model (~12 MB) does not
    overrides = [*small_run_overrides(tiny_beir, tiny_model_dir, disk, "run"), "train.batch_size=8"]
    overrides += ["train.epochs=1", "train.checkpoint_every=1", "train.log_every=1"]
    config = tmp_path / "config.yaml"
    config.write_text("{}\n")
    result = run_densepass("run", str(config), *[arg for o in overrides for arg in ("--set", o)], cwd=tmp_path)
    assert_one_line(result)
    assert f"writing {disk}/run/checkpoints/step-1" in result.stderr
    assert not (disk / "run" / "checkpoints" / "step-1").exists() and temporaries(disk) == []


# ---- the same errors, simulated in-process -------------------------------------------------------------------


def test_a_memory_map_reserves_its_blocks_or_fails_in_one_line(tmp_path, monkeypatch):
    from densepass.index.embeddings import create_memmap

    out = create_memmap(tmp_path / "fits.npy", (100, 8))
    assert out.shape == (100, 8) and os.stat(tmp_path / "fits.npy").st_blocks * 512 >= out.nbytes  # not sparse
    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(DensepassError, match=r"no space left on device writing \S+full.npy \(needs ~0.3 MB, .* free\)"):
        create_memmap(tmp_path / "full.npy", (10_000, 8))
    assert not (tmp_path / "full.npy").exists()


def test_where_blocks_cannot_be_reserved_the_free_space_is_checked(tmp_path, monkeypatch):
    import densepass.io as io
    from densepass.index.embeddings import create_memmap

    def unsupported(*args):
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    assert create_memmap(tmp_path / "fits.npy", (100, 8)).shape == (100, 8)
    monkeypatch.setattr(io, "free_bytes", lambda path: 1000)
    with pytest.raises(DensepassError, match=r"writing \S+big.npy \(needs ~0.3 MB, 0.0 MB free\)"):
        create_memmap(tmp_path / "big.npy", (10_000, 8))
    assert not (tmp_path / "big.npy").exists()


def test_a_dense_index_on_a_full_disk_never_starts_encoding(tmp_path, tiny_model_dir, monkeypatch, capsys):
    import densepass.index.embeddings as embeddings
    from densepass.cli import main

    def never(*args, **kwargs):
        raise AssertionError("encoding started")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    monkeypatch.setattr(embeddings, "encode_texts", never)
    data = write_tiny_beir(tmp_path / "data", 40)
    output = tmp_path / "idx"
    assert main(["index", str(data), "--model", str(tiny_model_dir), "--output", str(output)]) == 2
    assert FULL.match(capsys.readouterr().err.splitlines(keepends=True)[-1])
    assert not output.exists() and temporaries(tmp_path) == []


@pytest.mark.parametrize(
    "error, message",
    [
        (OSError(errno.ENOSPC, "No space left on device"), r"no space left on device writing \S+out \(needs ~0.0 MB, "),
        (OSError(errno.EDQUOT, "Disk quota exceeded"), r"disk quota exceeded writing \S+out \("),
        (OSError(errno.EROFS, "Read-only file system"), r"read-only file system: cannot write \S+out$"),
        (PermissionError(errno.EACCES, "Permission denied"), r"permission denied: cannot write \S+out$"),
        (
            RuntimeError("write error in x: 4051 != 640000 (No space left on device)"),
            r"no space left on device writing",
        ),
    ],
)
def test_write_errors_of_space_and_permission_are_one_line(tmp_path, error, message):
    from densepass.io import disk_errors

    with pytest.raises(DensepassError, match=message), disk_errors(tmp_path / "out", needs=100):
        raise error


def test_a_safetensors_error_wrapping_a_full_disk_is_one_line(tmp_path):
    from safetensors import SafetensorError

    from densepass.io import disk_errors

    with pytest.raises(DensepassError, match="no space left on device writing"), disk_errors(tmp_path / "model"):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


@pytest.mark.parametrize("error", [OSError(errno.ENOENT, "No such file"), ValueError("x"), RuntimeError("boom")])
def test_other_errors_pass_unchanged(tmp_path, error):
    from densepass.io import disk_errors

    with pytest.raises(type(error)), disk_errors(tmp_path / "out"):
        raise error


class FullDiskHandle:
    """A file handle whose writes find the disk full."""

    def __init__(self, handle):
        self.handle = handle

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.close()

    def fileno(self):
        return self.handle.fileno()

    def write(self, data):
        no_space()


def test_a_run_file_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    import densepass.io as io
    from densepass.evaluation.metrics import write_trec_run

    path = tmp_path / "run.trec"
    path.write_text("q0 Q0 p0 1 1.0 old\n")
    real = os.fdopen
    monkeypatch.setattr(io.os, "fdopen", lambda fd, mode: FullDiskHandle(real(fd, mode)))
    with pytest.raises(DensepassError, match=r"no space left on device writing \S+run.trec \(needs ~"):
        write_trec_run({"q1": {"p1": 1.0}}, path, tag="old")  # (a run of its tag: replaceable)
    assert path.read_text() == "q0 Q0 p0 1 1.0 old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["run.trec"]


def test_a_checkpoint_save_that_fails_is_one_line_and_removes_the_partial_checkpoint(tmp_path, monkeypatch):
    import torch

    import densepass.checkpoints as checkpoints

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    saver = checkpoints.Checkpoints(tmp_path, 2, {})
    monkeypatch.setattr(checkpoints, "save_file", no_space)
    with pytest.raises(DensepassError, match=r"no space left on device writing \S+checkpoints/step-3"):
        saver.save(3, lambda directory: None, optimizer, scheduler)
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_the_cli_reports_an_unnamed_write_error_in_one_line(capsys):
    from densepass.cli import run_guarded

    assert run_guarded(no_space) == 2
    err = capsys.readouterr().err
    assert err.startswith("densepass: error: no space left on device") and err.count("\n") == 1
    with pytest.raises(ValueError):
        run_guarded(lambda: int("x"))


# ---- what a killed process left ------------------------------------------------------------------------------


def plant(path: Path, directory: bool = False, age_s: float = 0.0) -> Path:
    if directory:
        path.mkdir()
        (path / "model.safetensors").write_bytes(b"\0" * 100)
    else:
        path.write_text("partial")
    if age_s:
        then = time.time() - age_s
        os.utime(path, (then, then))
    return path


FOREIGN = (".x.tmp", ".x.abc.tmp", ".x.ABCDEFGH.tmp", "x.abcd1234.tmp", ".y.abcd1234.tmp", ".x.abcd1234.tmp.bak")


def test_an_atomic_write_removes_the_temporaries_a_killed_process_left_and_nothing_else(tmp_path):
    from densepass.io import atomic_write_text

    stale = [plant(tmp_path / ".x.abcd1234.tmp", age_s=600), plant(tmp_path / ".x.k_9z0q1w.tmp", True, age_s=600)]
    fresh = plant(tmp_path / ".x.fresh123.tmp")  # perhaps another process's, just made: kept until it is older
    held = plant(tmp_path / ".x.held4567.tmp", age_s=600)  # a live process holds it
    foreign = [plant(tmp_path / name, age_s=600) for name in FOREIGN]
    elsewhere = plant(tmp_path / "elsewhere", True)
    (tmp_path / ".x.link1234.tmp").symlink_to(elsewhere)  # a link of our name: neither it nor its target is touched
    with open(held) as handle:
        fcntl.flock(handle, fcntl.LOCK_SH)
        atomic_write_text(tmp_path / "x", "new")
    assert (tmp_path / "x").read_text() == "new"
    assert not any(p.exists() for p in stale)
    assert fresh.exists() and held.exists() and all(p.exists() for p in foreign)
    assert (tmp_path / ".x.link1234.tmp").is_symlink() and (elsewhere / "model.safetensors").exists()


def test_a_resumed_run_removes_its_killed_checkpoint_save_and_nothing_else(tmp_path):
    from densepass.checkpoints import Checkpoints

    root = tmp_path / "checkpoints"
    root.mkdir()
    stale = [plant(root / ".step-7.abcd1234.tmp", True), plant(root / ".step-12.q1w2e3r4.tmp")]  # just now: killed
    foreign = [plant(root / name, True) for name in (".step-7.tmp", ".step-x.abcd1234.tmp", ".model.abcd1234.tmp")]
    assert Checkpoints(tmp_path, 2, {}).latest() is None
    assert not any(p.exists() for p in stale) and all(p.exists() for p in foreign)


def test_an_index_build_removes_a_killed_save_of_the_same_output(tmp_path):
    data = write_tiny_beir(tmp_path / "data", 40)
    stale = plant(tmp_path / ".idx.abcd1234.tmp", True, age_s=600)
    other = plant(tmp_path / ".other.abcd1234.tmp", True, age_s=600)  # another output's: not this build's to remove
    mine = plant(tmp_path / ".idx.notes.tmp", age_s=600)
    assert densepass_here("index", str(data), "--kind", "bm25", "--output", "idx", cwd=tmp_path).returncode == 0
    assert not stale.exists() and other.exists() and mine.exists()
    assert (tmp_path / "idx" / "manifest.json").is_file()


# ---- output paths the file system refuses: one line naming the path, before the work where cheap ---------------

LONG = "n" * 300  # a file name longer than any file system takes (255 bytes): ENAMETOOLONG


def error_line(capsys) -> str:
    """The one ``densepass: error:`` line the command printed (warnings aside)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if line.startswith("densepass: error:")]
    assert len(errors) == 1, err
    return errors[0]


@pytest.fixture
def commands(tmp_path, tiny_beir, tiny_model_dir, monkeypatch):
    """``command(output)``: each command that writes ``--output`` (or a run's ``name`` / ``output_dir``), in
    ``tmp_path``, with a saved BM25 index to search and a queries file."""
    from densepass.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["index", str(tiny_beir), "--kind", "bm25", "--output", "bm25"]) == 0
    (tmp_path / "queries.tsv").write_text("q1\taudio editor\n")
    run = ["run", "--set", f"data.name={tiny_beir}", "--set", f"model.name_or_path={tiny_model_dir}"]
    return {
        "run name": lambda out: [*run, "--set", f"name={out}"],
        "run output_dir": lambda out: [*run, "--set", f"output_dir={out}"],
        "index": lambda out: ["index", str(tiny_beir), "--kind", "bm25", "--output", out],
        "search": lambda out: ["search", "bm25", "--queries", "queries.tsv", "--output", out],
        "mine": lambda out: ["mine", str(tiny_beir), "--strategy", "bm25", "--output", out],
        "config": lambda out: ["config", "--output", out],
    }


COMMANDS = ["run name", "run output_dir", "index", "search", "mine", "config"]
PLACES = COMMANDS[1:]  # a run's name is one folder name (a path is refused as such): output_dir is its place


@pytest.mark.parametrize("command", COMMANDS)
def test_a_name_longer_than_the_file_system_takes_is_one_line(commands, capsys, command):
    from densepass.cli import main

    capsys.readouterr()
    assert main(commands[command](LONG)) == 2
    line = error_line(capsys)
    assert line.startswith("densepass: error: cannot write ") and LONG in line
    assert line.endswith("File name too long (a name of 300 bytes; a file or folder name is at most 255)")


@pytest.mark.parametrize("command", PLACES)
def test_an_output_under_a_regular_file_is_one_line_and_leaves_the_file(commands, tmp_path, capsys, command):
    from densepass.cli import main

    (tmp_path / "afile").write_text("mine\n")
    out = "afile" if command == "run output_dir" else "afile/sub"
    capsys.readouterr()
    assert main(commands[command](out)) == 2
    line = error_line(capsys)
    assert re.match(r"densepass: error: cannot write afile\S*: .*\(afile is a file, not a folder\)$", line), line
    assert (tmp_path / "afile").read_text() == "mine\n"


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="no /proc")
@pytest.mark.parametrize("command", PLACES)
def test_an_output_where_nothing_can_be_made_is_one_line(commands, capsys, command):
    from densepass.cli import main

    out = "/proc/self" if command == "run output_dir" else "/proc/self/x"
    capsys.readouterr()
    assert main(commands[command](out)) == 2
    line = error_line(capsys)  # ENOENT as root, EACCES otherwise: either way the path, not a temporary's name
    assert re.match(r"densepass: error: .*/proc/self/\S+", line) and ".tmp" not in line, line


def test_mining_checks_its_output_before_it_loads_anything(tmp_path, monkeypatch):
    import densepass.pipelines.mine_command as mine_command
    from densepass.config import load_config

    monkeypatch.setattr(mine_command, "load_dataset", lambda *a, **k: pytest.fail("the dataset was loaded"))
    (tmp_path / "afile").write_text("")
    for out in (tmp_path / LONG, tmp_path / "afile" / "x.jsonl"):
        with pytest.raises(OSError) as raised:
            mine_command.mine_training_negatives(load_config(None, ["negatives.source=bm25"]), out)
        assert raised.value.filename == str(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]  # the probe is gone


# ---- <output>.miners: made only for a dense miner, private, removed when it holds none ---------------------------

DENSE = ["--strategy", "dense", "--dense-dim", "8", "--miner-steps", "2", "--set", "train.batch_size=8"]


def test_mining_leaves_a_miners_folder_only_where_it_holds_a_trained_miner(tiny_beir, tiny_model_dir, tmp_path):
    from densepass.cli import main

    model = ["--set", f"model.name_or_path={tiny_model_dir}"]
    assert main(["mine", str(tiny_beir), "--strategy", "bm25", "--output", str(tmp_path / "b.jsonl")]) == 0
    assert main(["mine", str(tiny_beir), "--strategy", "bm25", "--output", str(tmp_path / "d" / "b.jsonl")]) == 0
    failing = [*DENSE[:-1], "train.batch_size=64", *model]  # 64 > the 31 training queries: the miner cannot train
    assert main(["mine", str(tiny_beir), *failing, "--output", str(tmp_path / "f.jsonl")]) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.jsonl", "d", "tiny"]
    assert main(["mine", str(tiny_beir), *DENSE, *model, "--output", str(tmp_path / "m.jsonl")]) == 0
    miners = tmp_path / "m.jsonl.miners"
    assert [p.name.startswith("miner-8d-") for p in miners.iterdir() if p.name != ".lock"] == [True]


@pytest.mark.parametrize("planted", ["link", "open to all", "another user's", "a file"])
def test_a_miners_folder_that_is_not_this_users_own_is_refused(tiny_beir, tiny_model_dir, tmp_path, capsys, planted):
    from densepass.cli import main

    miners, elsewhere = tmp_path / "m.jsonl.miners", tmp_path / "elsewhere"
    elsewhere.mkdir()
    if planted == "link":
        miners.symlink_to(elsewhere)
    elif planted == "a file":
        miners.write_text("")
    else:
        miners.mkdir()
        if planted == "open to all":
            miners.chmod(0o777)
        else:
            if os.getuid() != 0:
                pytest.skip("giving a folder to another user needs root")
            os.chown(miners, 65534, 65534)
    capsys.readouterr()
    args = ["mine", str(tiny_beir), *DENSE, "--set", f"model.name_or_path={tiny_model_dir}"]
    assert main([*args, "--output", str(tmp_path / "m.jsonl")]) == 2
    line = error_line(capsys)
    assert line.startswith(f"densepass: error: {miners}, where the miners of ") and "not a private directory" in line
    assert list(elsewhere.iterdir()) == [] and (miners.is_symlink() or miners.exists())
    assert not (tmp_path / "m.jsonl").exists()
