"""densepass deletes or overwrites only what it wrote: foreign files planted in every output path of every
command survive re-indexing, --restart, resume and failure (docs/reliability.md, "Nothing of yours is lost")."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path

import pytest

from conftest import small_run_overrides
from densepass.cli import main
from densepass.config import ExperimentConfig
from densepass.errors import ConfigError, DensepassError
from densepass.io import (
    OWNED,
    RUN_MARKER,
    atomic_directory,
    claim_run_directory,
    exclusive_lock,
    foreign_files,
    run_entry,
    write_manifest,
)
from densepass.pipelines.experiment import RUN_ENTRIES


def plant(directory: Path) -> dict[str, str]:
    """Foreign files in ``directory`` (a note, a nested folder, a file named like densepass's own); returns
    {relative path: content}."""
    planted = {"notes.txt": "my notes\n", "sub/thesis.tex": "\\section{x}\n", "sub/deeper/data.csv": "a,b\n"}
    for name, text in planted.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_text(text)
    return planted


def assert_intact(directory: Path, planted: dict[str, str]) -> None:
    for name, text in planted.items():
        assert (directory / name).read_text() == text, name


# ---- io: the rules ---------------------------------------------------------------------------------------


def test_atomic_directory_replaces_only_a_directory_it_wrote(tmp_path):
    target = tmp_path / "out"
    with atomic_directory(target) as tmp:
        (tmp / "a.bin").write_bytes(b"1")
        (tmp / "nested").mkdir()
        (tmp / "nested" / "b.bin").write_bytes(b"2")
    assert json.loads((target / OWNED).read_text()) == ["a.bin", "nested/b.bin"]
    assert foreign_files(target) == []
    with atomic_directory(target) as tmp:  # its own directory: replaced
        (tmp / "c.bin").write_bytes(b"3")
    assert sorted(p.name for p in target.iterdir()) == [OWNED, "c.bin"]
    (target / "mine.txt").write_text("added by the user")
    with pytest.raises(DensepassError, match=r"holds files densepass did not write \(mine.txt\)"):
        with atomic_directory(target) as tmp:
            pytest.fail("the block must not run")
    assert (target / "mine.txt").read_text() == "added by the user"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary left


@pytest.mark.parametrize("exchange", [True, False])
def test_replacing_a_directory_never_leaves_it_missing(tmp_path, monkeypatch, exchange):
    """The swap is one step where the system has one (renameat2's exchange): the target is the old directory or
    the new one at every moment. Without it (two renames), a save killed between them left the target missing and
    the old directory hidden: the next save puts it back first."""
    import densepass.io as io

    target = tmp_path / "out"
    with atomic_directory(target) as tmp:
        (tmp / "v").write_text("1")
    if not exchange:
        monkeypatch.setattr(io, "_exchange", lambda a, b: False)
    renames = []
    real_replace = os.replace

    def replace(source, destination):
        renames.append((Path(source).name, Path(destination).name))
        return real_replace(source, destination)

    monkeypatch.setattr(io.os, "replace", replace)
    with atomic_directory(target) as tmp:
        (tmp / "v").write_text("2")
    assert (target / "v").read_text() == "2" and [p.name for p in tmp_path.iterdir()] == ["out"]
    moved = [r for r in renames if r[1] == "out" or r[0] == "out"]
    assert len(moved) == (0 if exchange else 2)  # the exchange renames nothing: it swaps
    # a save killed between the two renames: the old directory hidden as .out.<random>.old, the target missing
    hidden = tmp_path / ".out.abcd1234.old"
    real_replace(target, hidden)
    with pytest.raises(RuntimeError):
        with atomic_directory(target):
            raise RuntimeError("this save fails too")
    assert (target / "v").read_text() == "2" and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_atomic_directory_refuses_a_foreign_directory_and_accepts_an_empty_one(tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    planted = plant(foreign)
    with pytest.raises(DensepassError, match="notes.txt"):
        with atomic_directory(foreign):
            pass
    assert_intact(foreign, planted)
    empty = tmp_path / "empty"
    empty.mkdir()
    with atomic_directory(empty) as tmp:
        (tmp / "x").write_text("x")
    assert (empty / "x").read_text() == "x"
    link = tmp_path / "link"
    link.symlink_to(foreign)
    with pytest.raises(DensepassError, match="not a directory densepass wrote"):
        with atomic_directory(link):
            pass
    assert_intact(foreign, planted)


def test_a_file_added_while_a_directory_is_written_stops_the_swap(tmp_path):
    """The check runs again right before the swap: a file the user adds during a long save survives it."""
    target = tmp_path / "out"
    with atomic_directory(target) as tmp:
        (tmp / "a").write_text("a")
    with pytest.raises(DensepassError, match="late.txt"):
        with atomic_directory(target) as tmp:
            (tmp / "a").write_text("b")
            (target / "late.txt").write_text("written meanwhile")
    assert (target / "late.txt").read_text() == "written meanwhile"
    assert (target / "a").read_text() == "a"


def test_a_directory_saved_before_ownership_lists_counts_through_its_manifest(tmp_path):
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "embeddings.npy").write_bytes(b"x")
    (legacy / "manifest.json").write_text(json.dumps({"files": {"embeddings.npy": {"bytes": 1, "blake2b": "y"}}}))
    assert foreign_files(legacy) == ["embeddings.npy", "manifest.json"]  # a manifest whose digests do not match
    write_manifest(legacy)
    assert foreign_files(legacy) == []
    (legacy / "notes.txt").write_text("n")
    assert foreign_files(legacy) == ["notes.txt"]


@pytest.mark.parametrize(
    "name",
    [
        *["", ".", "..", "a/b", "../../etc", "/tmp/abs", " padded", "tab\there"],
        *["r\u202egpj.exe", "zero\u200bwidth", "line\u2028sep", "para\u2029sep", "bom\ufeff", "del\x7f", "c1\x85"],
    ],
)
def test_a_run_name_is_one_folder_name(name):
    # a bidi override (U+202E) shows the name reversed in a listing, format characters not at all (categories Cc,
    # Cf, Zl, Zp)
    with pytest.raises(ConfigError, match="must be one folder name"):
        ExperimentConfig(name=name)


@pytest.mark.parametrize("name", ["run-1", "élan", "数据", "exp_2024.05", "a b"])
def test_a_run_name_of_visible_characters_is_accepted(name):
    assert ExperimentConfig(name=name).name == name


def test_run_entries_cover_densepass_temporaries_only():
    assert run_entry("checkpoints", RUN_ENTRIES)
    assert run_entry("train_log.jsonl", RUN_ENTRIES)
    assert run_entry(".config.yaml.ab12_x9z.tmp", RUN_ENTRIES)  # tempfile's 8 characters of [a-z0-9_]
    assert run_entry(".best-model.k2j3h4q_.old", RUN_ENTRIES)
    assert not run_entry("notes.txt", RUN_ENTRIES)
    assert not run_entry(".notes.txt.abc.tmp", RUN_ENTRIES)
    assert not run_entry("thesis", RUN_ENTRIES)
    # a user's backups named like an entry, in a form densepass never writes
    for name in (".report.md.2024_05.old", ".config.yaml.ABCDEFGH.tmp", ".model.backup12.old.tmp", ".model.encoding"):
        assert not run_entry(name, RUN_ENTRIES), name


def test_restart_keeps_a_users_backup_named_like_a_temporary_and_a_users_lock_file(tmp_path):
    run = tmp_path / "run"
    claim_run_directory(run, "run", RUN_ENTRIES, restart=False)
    (run / "report.md").write_text("# densepass run: run\n")
    (run / ".report.md.2024_05.old").write_text("my May report")  # not tempfile's form: a user's
    (run / ".report.md.k2j3h4q_.old").write_text("a killed save's")  # densepass's own form: removed
    (run / "checkpoints" / "step-1").mkdir(parents=True)
    (run / "checkpoints" / ".lock").write_text("l")  # a user's file named like a lock
    (run / "token_cache" / "query").mkdir(parents=True)
    (run / "token_cache" / "query" / ".lock").write_text("pid 123")  # a lock densepass took there
    kept = claim_run_directory(run, "run", RUN_ENTRIES, restart=True)
    assert kept == [".report.md.2024_05.old", "checkpoints/.lock"]
    assert (run / ".report.md.2024_05.old").read_text() == "my May report"
    assert (run / "checkpoints" / ".lock").read_text() == "l"
    assert not (run / ".report.md.k2j3h4q_.old").exists() and not (run / "token_cache").exists()
    assert not (run / "report.md").exists()


def test_a_users_file_named_lock_is_neither_rewritten_nor_taken_for_a_lock(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / ".lock").write_text("my lock notes\n")
    with pytest.raises(DensepassError, match=r"\.lock is not a lock file densepass wrote"):
        with exclusive_lock(folder):
            pass
    assert (folder / ".lock").read_text() == "my lock notes\n"
    assert foreign_files(folder) == [".lock"]  # an index would not replace this folder
    (folder / ".lock").write_text("pid 42")
    with exclusive_lock(folder):
        assert (folder / ".lock").read_text() == f"pid {os.getpid()}"
    assert foreign_files(folder) == []


def test_claim_refuses_a_foreign_folder_and_restart_keeps_foreign_files(tmp_path):
    foreign = tmp_path / "thesis"
    foreign.mkdir()
    planted = plant(foreign)
    with pytest.raises(DensepassError, match="is not a densepass run directory"):
        claim_run_directory(foreign, "run", RUN_ENTRIES, restart=True)
    assert_intact(foreign, planted)
    assert not (foreign / RUN_MARKER).exists()

    run = tmp_path / "run"
    assert claim_run_directory(run, "run", RUN_ENTRIES, restart=False) == []
    (run / "checkpoints" / "step-1").mkdir(parents=True)
    (run / "report.md").write_text("# densepass run: run\n\nan earlier run's report\n")
    (run / "model").symlink_to(foreign)  # a link where the run writes: refused, never followed
    planted_in_run = plant(run)
    with pytest.raises(DensepassError, match=r"holds links where a run writes \(model\)"):
        claim_run_directory(run, "run", RUN_ENTRIES, restart=True)
    assert (run / "report.md").is_file()  # nothing removed
    (run / "model").unlink()
    with pytest.raises(DensepassError, match="is a densepass run directory, not a pre-training's"):
        claim_run_directory(run, "pre-training", ("checkpoints", "report.md"), restart=True)
    kept = claim_run_directory(run, "run", RUN_ENTRIES, restart=True)
    assert kept == ["notes.txt", "sub"]
    # inside the run's own entries too: a user's file named like a log is kept; one in a saved model stops the
    # restart before anything goes (the new run could not save that model)
    with atomic_directory(run / "best-model") as tmp:
        (tmp / "weights.bin").write_text("w")
    (run / "best-model" / "my_notes.txt").write_text("mine")
    with pytest.raises(DensepassError, match=r"best-model/my_notes.txt is not densepass's, inside .*best-model"):
        claim_run_directory(run, "run", RUN_ENTRIES, restart=True)
    assert (run / "best-model" / "weights.bin").is_file()
    (run / "best-model" / "my_notes.txt").rename(run / "best-model-notes.txt")
    (run / "meeting_log.jsonl").write_text("{}")
    (run / "subcorpus_ideas.json").write_text("{}")
    (run / "runs").mkdir()
    (run / "runs" / "bm25.trec").write_text("q Q0 p 1 1.000000 bm25\n")  # a run's own: tagged with its system
    (run / "runs" / "my-bm25.trec").write_text("q Q0 p 1 1.0 anserini\n")  # a user's, named like one
    (run / "runs" / "copy.trec").write_text("q Q0 p 1 1.0 densepass\n")  # a user's copy of densepass search's output
    (run / "runs" / "draft.txt").write_text("mine")
    (run / "negatives" / "miner-8d-abc").mkdir(parents=True)
    (run / "negatives" / "miner-8d-abc" / "train_log.jsonl").write_text("{}")
    (run / "negatives" / "refresh_log.jsonl").write_text("{}")
    (run / "negatives" / "my-pool.jsonl").write_text("mine")
    (run / "reranker" / "model").mkdir(parents=True)
    (run / "reranker" / "train_log.jsonl").write_text("{}")
    (run / "reranker" / "notes.txt").write_text("mine")
    kept = claim_run_directory(run, "run", RUN_ENTRIES, restart=True)
    assert kept == [
        "best-model-notes.txt",
        "meeting_log.jsonl",
        "negatives/my-pool.jsonl",
        "notes.txt",
        "reranker/notes.txt",
        "runs/copy.trec",
        "runs/draft.txt",
        "runs/my-bm25.trec",
        "sub",
        "subcorpus_ideas.json",
    ]
    assert (run / "runs" / "my-bm25.trec").read_text() == "q Q0 p 1 1.0 anserini\n"
    assert (run / "runs" / "copy.trec").read_text() == "q Q0 p 1 1.0 densepass\n"
    assert (run / "best-model-notes.txt").read_text() == "mine"
    assert (run / "runs" / "draft.txt").read_text() == "mine"
    assert not (run / "checkpoints").exists() and not (run / "report.md").exists()
    assert not (run / "model").is_symlink()
    assert_intact(run, planted_in_run)
    assert_intact(foreign, planted)


def test_a_run_directory_of_an_older_version_is_still_a_run_directory(tmp_path):
    old = tmp_path / "old"
    (old / "checkpoints").mkdir(parents=True)
    (old / "config.yaml").write_text(f"name: old\noutput_dir: {tmp_path}\n")
    claim_run_directory(old, "run", RUN_ENTRIES, restart=False)
    assert (old / RUN_MARKER).is_file()
    # a user's project folder that merely looks like one (a config.yaml of its own, a report, a model folder)
    project = tmp_path / "proj"
    (project / "model").mkdir(parents=True)
    (project / "config.yaml").write_text("lr: 1\n")
    (project / "report.md").write_text("# my report\n")
    (project / "model" / "my_weights.bin").write_text("w")
    with pytest.raises(DensepassError, match="is not a densepass run directory"):
        claim_run_directory(project, "run", RUN_ENTRIES, restart=True)
    assert (project / "report.md").read_text() == "# my report\n"
    assert (project / "model" / "my_weights.bin").read_text() == "w"


def test_a_lock_whose_directory_its_holder_removed_is_not_a_lock(tmp_path):
    """The gap that let a bm25 index into a folder a dense index was writing: the holder removes its work
    directory (and lock file) before it lets go; a process that was waiting on the removed file must not think
    it holds the lock on the path."""
    import shutil

    work = tmp_path / ".out.encoding"
    acquired = threading.Event()
    holder = exclusive_lock(work, "index build")
    holder.__enter__()
    result = {}

    def waiter():
        with exclusive_lock(work, "index build", wait=True):
            acquired.set()
            try:
                with exclusive_lock(work, "index build"):
                    result["third"] = "got it"
            except DensepassError as err:
                result["third"] = str(err)
            time.sleep(0.2)

    thread = threading.Thread(target=waiter)
    thread.start()
    time.sleep(0.3)  # the waiter has opened the lock file and blocks on it
    assert not acquired.is_set()
    shutil.rmtree(work)
    holder.__exit__(None, None, None)
    thread.join(timeout=30)
    assert acquired.is_set()
    assert "in use by another densepass index build" in result["third"]


def test_a_process_waiting_for_a_lock_says_once_what_it_waits_for(tmp_path, capsys):
    entry = tmp_path / "negative-pools" / "k"
    acquired = threading.Event()
    with exclusive_lock(entry, "mining"):
        thread = threading.Thread(target=lambda: _hold_then_signal(entry, acquired))
        thread.start()
        time.sleep(0.3)  # the waiter blocks on the lock
        assert not acquired.is_set()
    thread.join(timeout=30)
    assert acquired.is_set()
    err = capsys.readouterr().err
    assert err.count("waiting for another densepass mining in") == 1 and f"(pid {os.getpid()})" in err


def _hold_then_signal(directory, event) -> None:
    with exclusive_lock(directory, "mining", wait=True):
        event.set()


# ---- the commands --------------------------------------------------------------------------------------


def test_index_never_replaces_a_folder_it_did_not_write(tiny_beir, tiny_model_dir, tmp_path, capsys):
    for kind, model in (("exact", ["--model", str(tiny_model_dir)]), ("bm25", [])):
        out = tmp_path / f"x-{kind}"
        out.mkdir()
        planted = plant(out)
        code = main(["index", str(tiny_beir), "--kind", kind, *model, "--output", str(out)])
        assert code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "holds files densepass did not write" in err[0], err
        assert_intact(out, planted)
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # nothing left beside
    # re-indexing into densepass's own index replaces it; a file the user adds to it afterwards stops the next one
    out = tmp_path / "idx"
    args = ["index", str(tiny_beir), "--kind", "exact", "--model", str(tiny_model_dir), "--output", str(out)]
    assert main(args) == 0
    assert main(args) == 0
    (out / "notes.txt").write_text("mine")
    assert main(args) == 2
    assert (out / "notes.txt").read_text() == "mine"
    # --force moves what is in the way aside, whole, and writes the index
    assert main([*args, "--force"]) == 0
    moved = [p for p in tmp_path.iterdir() if p.name.startswith("idx.replaced-")]
    assert len(moved) == 1 and (moved[0] / "notes.txt").read_text() == "mine"
    assert (out / "manifest.json").is_file() and not (out / "notes.txt").exists()
    capsys.readouterr()


@pytest.mark.parametrize("threshold", ["nan", "0.5"])
def test_index_refuses_the_phrase_filter_threshold_for_other_kinds(tiny_beir, tmp_path, capsys, threshold):
    output = tmp_path / "i"
    args = ["index", str(tiny_beir), "--kind", "bm25", "--output", str(output), "--filter-threshold", threshold]
    assert main(args) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line == "densepass: error: --filter-threshold is the phrase index's token filter; a bm25 index has none"
    assert not output.exists()


def test_a_phrase_filter_threshold_that_is_not_finite_is_refused():
    from densepass.pipelines.indexing import IndexSettings

    for value in (float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="--filter-threshold must be a finite number"):
            IndexSettings("phrase", "m", threshold=value)


def test_index_bm25_refuses_a_model(tiny_beir, tiny_model_dir, tmp_path, capsys):
    code = main(
        ["index", str(tiny_beir), "--kind", "bm25", "--model", str(tiny_model_dir), "--output", str(tmp_path / "b")]
    )
    assert code == 2
    assert "drop --model" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def test_index_never_replaces_the_working_directory_or_a_folder_holding_it(tiny_beir, tmp_path, capsys, monkeypatch):
    project = tmp_path / "project" / "work"
    project.mkdir(parents=True)
    planted = plant(project)
    monkeypatch.chdir(project)
    for output in (".", "./", "..", "sub/..", str(project), str(tmp_path), "/"):
        for force in ([], ["--force"]):
            assert main(["index", str(tiny_beir), "--kind", "bm25", "--output", output, *force]) == 2, output
            err = capsys.readouterr().err
            assert "Traceback" not in err
            [line] = err.strip().splitlines()
            assert re.match(r"densepass: error: --output .* is (the working directory|a folder holding the work)", line)
    assert_intact(project, planted)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["project", "tiny"]  # nothing moved aside, no work folder
    assert sorted(p.name for p in project.iterdir()) == ["notes.txt", "sub"]
    assert main(["index", str(tiny_beir), "--kind", "bm25", "--output", "sub/../index"]) == 0  # a new folder here
    assert (project / "index").is_dir()


def run_args(tiny_beir, tiny_model_dir, output_dir, name, *extra):
    sets = small_run_overrides(tiny_beir, tiny_model_dir, output_dir, name)
    sets += ["data.max_train_queries=8", "train.batch_size=4", "negatives.per_query=0", *extra]
    return ["run", *[a for s in sets for a in ("--set", s)]]


def test_run_never_deletes_what_it_did_not_write(tiny_beir, tiny_model_dir, tmp_path, capsys):
    outputs = tmp_path / "outputs"
    thesis = outputs / "thesis"
    thesis.mkdir(parents=True)
    planted = plant(thesis)
    # a name that points elsewhere, or a folder that is not a run, is refused before any work, restart or not
    for name in (".", "..", "", "../outputs/thesis"):
        assert main([*run_args(tiny_beir, tiny_model_dir, thesis, name), "--restart"]) == 2
    assert main([*run_args(tiny_beir, tiny_model_dir, outputs, "thesis"), "--restart"]) == 2
    assert main(run_args(tiny_beir, tiny_model_dir, outputs, "thesis")) == 2
    err = capsys.readouterr().err
    assert "is not a densepass run directory" in err and "Traceback" not in err
    assert_intact(thesis, planted)
    assert sorted(p.name for p in thesis.iterdir()) == ["notes.txt", "sub"]  # not even a .lock

    # a run, a file of the user's put into its directory, then --restart: the run's files go, the user's stay
    args = run_args(tiny_beir, tiny_model_dir, outputs, "r")
    assert main(args) == 0
    run_dir = outputs / "r"
    unknown = [p.name for p in run_dir.iterdir() if not run_entry(p.name, RUN_ENTRIES)]
    assert sorted(unknown) == sorted([".lock", RUN_MARKER])  # every entry a run writes is one --restart may remove
    planted_in_run = plant(run_dir)
    assert main(args) == 0  # resume / evaluate again: the user's files are untouched
    assert_intact(run_dir, planted_in_run)
    assert main([*args, "--restart"]) == 0
    assert_intact(run_dir, planted_in_run)
    assert (run_dir / "report.md").is_file()
    # a failed run (a setting refused before work) leaves them too
    assert main([*args, "--set", "train.learning_rate=-1"]) == 2
    assert_intact(run_dir, planted_in_run)
    assert_intact(thesis, planted)
    capsys.readouterr()


def test_file_outputs_overwrite_only_what_densepass_wrote(tiny_beir, tiny_model_dir, tmp_path, capsys):
    """search / rerank / mine / config / ensemble --output: a user's file at that path is refused before any
    work; densepass's own earlier output there is replaced."""
    index = tmp_path / "idx"
    assert main(["index", str(tiny_beir), "--model", str(tiny_model_dir), "--output", str(index)]) == 0
    queries = tmp_path / "queries.tsv"
    queries.write_text("a\taudio editor\nb\tfont viewer\n")
    user_file = tmp_path / "thesis.txt"
    user_file.write_text("chapter one\n")
    blank_first = tmp_path / "blank-first.txt"
    blank_first.write_text("\nmy precious notes\n")
    assert main(["search", str(index), "--queries", str(queries), "--output", str(blank_first)]) == 2
    assert blank_first.read_text() == "\nmy precious notes\n"
    model_config = tiny_model_dir / "config.json"  # JSON that starts with '{' is not a config densepass wrote
    before = model_config.read_text()
    assert main(["config", "--output", str(model_config)]) == 2
    assert model_config.read_text() == before
    capsys.readouterr()
    search = ["search", str(index), "--queries", str(queries), "--k", "3", "--output"]
    assert main([*search, str(user_file)]) == 2
    assert user_file.read_text() == "chapter one\n"
    assert "densepass overwrites only its own files" in capsys.readouterr().err
    run = tmp_path / "run.trec"
    assert main([*search, str(run)]) == 0
    assert main([*search, str(run)]) == 0  # its own run file: replaced
    capsys.readouterr()
    assert main(["config", "--output", str(user_file)]) == 2
    assert main(["mine", str(tiny_beir), "--strategy", "bm25", "--output", str(user_file)]) == 2
    assert user_file.read_text() == "chapter one\n"
    config = tmp_path / "resolved.yaml"
    assert main(["config", "--output", str(config)]) == 0
    assert main(["config", "--output", str(config), "--set", "name=other"]) == 0
    err = capsys.readouterr().err
    assert err.count("densepass overwrites only its own files") == 2


def test_a_planted_encoding_directory_is_not_used(tiny_beir, tiny_model_dir, tmp_path, capsys):
    """The encoding's work directory has a predictable name beside --output: a link planted there (or a folder
    anyone can write to) would steer densepass's writes, so it is refused, and what it points to is untouched."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / ".idx.encoding").symlink_to(elsewhere)
    args = ["index", str(tiny_beir), "--model", str(tiny_model_dir), "--output", str(tmp_path / "idx")]
    assert main(args) == 2
    assert "is not a private directory of this user" in capsys.readouterr().err
    assert list(elsewhere.iterdir()) == []
    (tmp_path / ".idx.encoding").unlink()
    (tmp_path / ".idx.encoding").mkdir(mode=0o777)
    (tmp_path / ".idx.encoding").chmod(0o777)
    assert main(args) == 2
    (tmp_path / ".idx.encoding").chmod(0o755)
    assert main(args) == 0
    assert not (tmp_path / ".idx.encoding").exists()


def test_a_failed_index_build_leaves_no_empty_work_directory(tiny_beir, tmp_path, capsys):
    assert main(["index", str(tiny_beir), "--model", str(tmp_path / "no-model"), "--output", str(tmp_path / "i")]) == 2
    assert "Traceback" not in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tiny"]  # the dataset alone


def test_an_encoding_directory_holding_a_users_files_is_refused_not_removed(
    tiny_beir, tiny_model_dir, tmp_path, capsys
):
    work = tmp_path / ".idx.encoding"
    work.mkdir(mode=0o700)
    (work / "notes.txt").write_text("precious")
    args = ["index", str(tiny_beir), "--model", str(tiny_model_dir), "--output", str(tmp_path / "idx")]
    assert main(args) == 2
    assert "holds files densepass did not write (notes.txt)" in capsys.readouterr().err
    assert (work / "notes.txt").read_text() == "precious"


def test_an_index_output_that_is_its_own_input_is_refused(tiny_beir, tiny_model_dir, tmp_path, capsys):
    before = sorted(p.name for p in tiny_model_dir.iterdir())
    for output in (tiny_model_dir, tiny_beir, tiny_beir / "idx", tiny_beir.parent):
        for force in ([], ["--force"]):
            args = ["index", str(tiny_beir), "--model", str(tiny_model_dir), "--output", str(output), *force]
            assert main(args) == 2
            assert "which this command reads" in capsys.readouterr().err
    assert sorted(p.name for p in tiny_model_dir.iterdir()) == before
    assert (tiny_beir / "corpus.jsonl").is_file() and not (tiny_beir / "idx").exists()


def test_search_of_one_query_refuses_an_output_it_would_not_write(tmp_path, capsys):
    assert main(["search", str(tmp_path / "idx"), "audio", "--output", str(tmp_path / "run.trec")]) == 2
    assert "one QUERY's hits are printed" in capsys.readouterr().err


def test_an_index_replaces_only_an_index(tiny_beir, tiny_model_dir, tmp_path, capsys):
    """A model or a checkpoint densepass saved is its own output too, but not an index's to replace."""
    from densepass.models.biencoder import BiEncoder

    model = tmp_path / "fine-tuned"
    BiEncoder.from_pretrained(str(tiny_model_dir)).save(model)
    before = sorted(p.name for p in model.iterdir())
    for force in ([], ["--force"]):  # --force moves a user's files aside, never a model densepass saved
        assert main(["index", str(tiny_beir), "--kind", "bm25", "--output", str(model), *force]) == 2
        assert "not a densepass index" in capsys.readouterr().err
        assert sorted(p.name for p in model.iterdir()) == before


def test_index_force_moves_nothing_aside_when_the_command_fails_before_the_index_is_ready(tmp_path, capsys):
    """``--force`` used to move the output aside first: a corpus that does not read (or a model that does not
    load) then left the user's folder renamed, and no index in its place."""
    out = tmp_path / "notes"
    out.mkdir()
    (out / "mine.txt").write_text("mine")
    bad = tmp_path / "corpus.jsonl"
    bad.write_text('{"_id": "a", "title": "x"}\n')  # no text
    assert main(["index", str(bad), "--kind", "bm25", "--output", str(out), "--force"]) == 2
    assert "missing field 'text'" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.jsonl", "notes"]
    assert (out / "mine.txt").read_text() == "mine"
    bad.write_text('{"_id": "a", "text": "an audio editor"}\n')
    assert main(["index", str(bad), "--kind", "bm25", "--output", str(out), "--force"]) == 0
    assert f"moved what was at {out} to {out}.replaced-" in capsys.readouterr().err
    moved = [p for p in tmp_path.iterdir() if p.name.startswith("notes.replaced-")]
    assert len(moved) == 1 and (moved[0] / "mine.txt").read_text() == "mine" and (out / "manifest.json").is_file()


def test_checkpoint_rotation_keeps_a_checkpoint_holding_a_users_file(tmp_path):
    import torch

    from densepass.checkpoints import Checkpoints

    layer = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    checkpoints = Checkpoints(tmp_path, keep=1, identity={})

    def save(step):
        return checkpoints.save(step, lambda d: (d / "w.bin").write_bytes(b"w"), optimizer, scheduler)

    first = save(1)
    (first / "NOTES.txt").write_text("mine")
    with pytest.warns(UserWarning, match="is kept: it holds files densepass did not write"):
        save(2)
    assert (first / "NOTES.txt").read_text() == "mine"
    with pytest.warns(UserWarning, match="step-1 is kept"):
        save(3)
    assert not (tmp_path / "checkpoints" / "step-2").exists()  # its own: rotated away


def test_a_model_that_needs_its_own_code_or_does_not_parse_is_one_line(tiny_beir, tiny_model_dir, tmp_path, capsys):
    import shutil

    evil = tmp_path / "evil"
    shutil.copytree(tiny_model_dir, evil)
    config = json.loads((evil / "config.json").read_text())
    (evil / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModel": "evil_model.EvilModel"}}))
    (evil / "evil_model.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\n")
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "tokenizer.json").write_text((broken / "tokenizer.json").read_text()[:1000])
    for model, message in ((evil, "never runs a model's code"), (broken, "tokenizer.json does not load")):
        assert main(["index", str(tiny_beir), "--model", str(model), "--output", str(tmp_path / "i")]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "ran").exists()


def test_rerank_refuses_to_write_over_the_run_it_reranks(tiny_beir, tmp_path, capsys):
    run = tmp_path / "first.trec"
    run.write_text("q30 Q0 p30 1 1.0 densepass\n")
    assert main(["rerank", str(tiny_beir), str(run), "--model", "none", "--output", str(run)]) == 2
    assert "is the run being reranked" in capsys.readouterr().err
    assert run.read_text() == "q30 Q0 p30 1 1.0 densepass\n"


def test_a_users_own_config_with_notes_is_not_overwritten_and_outputs_keep_their_mode(tmp_path, capsys):
    mine = tmp_path / "my.yaml"
    assert main(["config", "--output", str(mine)]) == 0
    assert mine.stat().st_mode & 0o777 == 0o666 & ~_umask_now()  # as open() makes a file, not mkstemp's 0600
    mine.chmod(0o640)
    assert main(["config", "--output", str(mine), "--set", "name=again"]) == 0  # its own output: replaced
    assert mine.stat().st_mode & 0o777 == 0o640  # keeping the mode it had
    mine.write_text("# my precious notes\n" + mine.read_text())
    assert main(["config", "--output", str(mine), "--set", "train.batch_size=8"]) == 2
    assert mine.read_text().startswith("# my precious notes\n")
    capsys.readouterr()


def _umask_now() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def test_attention_and_study_outputs_never_write_over_a_users_files(tiny_beir, tiny_model_dir, tmp_path, capsys):
    user = tmp_path / "fig.png"
    user.write_text("my figure")
    attention = ["analyze-attention", str(tiny_model_dir), "--dataset", str(tiny_beir), "--samples", "2", "--output"]
    config = tiny_model_dir / "config.json"
    before = config.read_text()
    for output in (user, tiny_model_dir / "config.png", tmp_path / "plot"):
        assert main([*attention, str(output)]) == 2
    assert user.read_text() == "my figure" and config.read_text() == before
    # a real image of the user's (matplotlib's, not densepass's), and numbers of theirs of the same shape
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, _ = plt.subplots()
    fig.savefig(tmp_path / "chart.png")
    plt.close(fig)
    picture = (tmp_path / "chart.png").read_bytes()
    (tmp_path / "mine.json").write_text('{"my model": [1.0, 2.0]}')
    assert main([*attention, str(tmp_path / "chart.png")]) == 2
    assert main([*attention, str(tmp_path / "mine.png")]) == 2  # its numbers would go over mine.json
    assert (tmp_path / "chart.png").read_bytes() == picture
    assert (tmp_path / "mine.json").read_text() == '{"my model": [1.0, 2.0]}'
    ours = tmp_path / "ours.png"
    assert main([*attention, str(ours)]) == 0 and main([*attention, str(ours)]) == 0  # its own output: replaced
    notes = tmp_path / "study"
    notes.mkdir()
    (notes / "study.md").write_text("# my study notes\n")
    study = ["validate-study", str(tiny_beir), "--checkpoints", str(tiny_model_dir), "--max-queries", "4", "--output"]
    assert main([*study, str(notes)]) == 2
    assert main([*study, str(tiny_beir)]) == 2
    assert (notes / "study.md").read_text() == "# my study notes\n"
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("densepass: error:") == 7


def test_a_model_config_without_a_model_type_is_one_line(tiny_beir, tiny_model_dir, tmp_path, capsys):
    import shutil

    model = tmp_path / "m"
    shutil.copytree(tiny_model_dir, model)
    (model / "config.json").write_text('{"a": 1}')
    assert main(["index", str(tiny_beir), "--model", str(model), "--output", str(tmp_path / "i")]) == 2
    assert "names no model_type" in capsys.readouterr().err


def _listing(directory: Path) -> dict[str, bytes | None]:
    """Every path under ``directory`` with its bytes (None for a folder; a lock's holder left out): to compare
    before and after."""
    return {
        str(p.relative_to(directory)): None if p.is_dir() or p.name == ".lock" else p.read_bytes()
        for p in sorted(directory.rglob("*"))
    }


def test_a_pretraining_refused_by_its_model_checks_removes_nothing_with_restart(
    tiny_beir, tiny_model_dir, tmp_path, capsys
):
    """The pre-training's own checks (early_layers against the model's depth, max_length against its positions)
    run before --restart removes the earlier run's files: a refused run leaves them all."""
    sets = [
        f"data.name={tiny_beir}",
        f"model.name_or_path={tiny_model_dir}",
        f"output_dir={tmp_path / 'out'}",
        "name=pt",
        "model.mode=mlm",
        "train.max_steps=1",
        "train.batch_size=2",
        "train.max_length=16",
    ]
    args = ["pretrain", *[a for s in sets for a in ("--set", s)]]
    assert main(args) == 0
    run = tmp_path / "out" / "pt"
    before = _listing(run)
    assert "backbone/config.json" in before and "checkpoints/step-1" in before
    capsys.readouterr()
    refused = (
        (["model.mode=condenser", "model.early_layers=2"], "early_layers must be in [1, 1]"),  # a 2-layer model
        (["train.max_length=512"], "train.max_length"),  # beyond its 128 positions
    )
    for extra, message in refused:
        assert main([*args, *[a for s in extra for a in ("--set", s)], "--restart"]) == 2
        err = capsys.readouterr().err
        assert err.count("densepass: error:") == 1 and message in err and "Traceback" not in err, err
        assert _listing(run) == before


def test_a_run_refused_by_its_model_checks_removes_nothing_with_restart(tiny_beir, tiny_model_dir, tmp_path, capsys):
    """`run --restart`: the model's checks (freeze_layers against its depth, a max length beyond its positions)
    come before the earlier run's files are removed."""
    args = run_args(tiny_beir, tiny_model_dir, tmp_path, "r", "train.epochs=1")
    assert main(args) == 0
    run = tmp_path / "r"
    before = _listing(run)
    assert "report.md" in before and "model/config.json" in before
    capsys.readouterr()
    for extra, message in (("train.freeze_layers=5", "freeze_layers"), ("model.passage_max_length=512", "positions")):
        assert main([*args, "--set", extra, "--restart"]) == 2
        err = capsys.readouterr().err
        assert err.count("densepass: error:") == 1 and message in err and "Traceback" not in err, err
        assert _listing(run) == before


def test_a_phrase_run_refused_by_its_model_checks_removes_nothing_with_restart(tiny_model_dir, tmp_path):
    """`phrase --restart`: the starting model is loaded (and refused) before the earlier run's files are removed."""
    from densepass.config import load_config
    from densepass.phrase.config import PhraseConfig
    from densepass.phrase.experiment import RUN_ENTRIES as PHRASE_ENTRIES
    from densepass.phrase.experiment import run_phrase
    from phrase_fixtures import write_phrase_squad

    run = tmp_path / "out" / "p"
    claim_run_directory(run, "phrase run", PHRASE_ENTRIES, restart=False)
    (run / "report.md").write_text("# Phrase retrieval run `p`\n\nthe earlier run's report\n")
    (run / "train_log.jsonl").write_text("{}\n")
    before = _listing(run)
    sets = [f"data.name={write_phrase_squad(tmp_path / 'squad')}", f"output_dir={tmp_path / 'out'}", "name=p"]
    config = load_config(None, [*sets, f"train.init={tiny_model_dir}"], PhraseConfig)  # not a saved phrase model
    with pytest.raises(ConfigError, match="is not a saved phrase model"):
        run_phrase(config, restart=True, show_progress=False)
    assert _listing(run) == before
    # a user's note inside the run's saved index: refused before --restart removes anything (not after training)
    (run / "index").mkdir()
    (run / "index" / "my-notes.txt").write_text("mine")
    before = _listing(run)
    with pytest.raises(DensepassError, match="my-notes.txt"):
        run_phrase(load_config(None, sets, PhraseConfig), restart=True, show_progress=False)
    assert _listing(run) == before


def test_a_study_refused_by_its_checks_leaves_no_folder(tiny_beir, tiny_model_dir, tmp_path, capsys):
    """validate-study makes its output folder only once its retriever's model has loaded."""
    from conftest import save_tiny_bert

    other = save_tiny_bert(tmp_path / "other", seed=1)
    study = ["validate-study", str(tiny_beir), "--checkpoints", str(tiny_model_dir), str(other), "--max-queries", "4"]
    args = [*study, "--retriever", str(tmp_path / "no-such-model"), "--output", str(tmp_path / "out" / "study")]
    assert main(args) == 2
    assert "densepass: error:" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_run_directory_of_an_older_version_gets_nothing_written_when_a_check_refuses_the_run(
    tiny_beir, tiny_model_dir, tmp_path, capsys
):
    """An older version's run directory (no marker, recognised by its config.yaml) is marked and locked only
    once every check has passed: a run refused by one (another run's settings here) leaves it as it was."""
    old = tmp_path / "old"
    old.mkdir()
    sets = [f"name={old.name}", f"output_dir={tmp_path}", f"data.name={tiny_beir}", "train.batch_size=8"]
    assert main(["config", "--output", str(old / "config.yaml"), *[a for s in sets for a in ("--set", s)]]) == 0
    (old / "report.md").write_text("# densepass run: old\n\nthe older version's report\n")
    before = _listing(old)
    capsys.readouterr()
    assert main(run_args(tiny_beir, tiny_model_dir, tmp_path, "old")) == 2
    err = capsys.readouterr().err
    assert err.count("densepass: error:") == 1 and "holds another run" in err, err
    assert _listing(old) == before and not (old / RUN_MARKER).exists() and not (old / ".lock").exists()


@pytest.mark.parametrize(
    "name, text",
    [("config.yaml", "# my experiment, with notes\nname: run\n"), ("report.md", "Draft of my report on this run\n")],
)
def test_a_users_file_where_the_run_writes_its_own_is_refused_before_anything_is_written(tmp_path, name, text):
    run = tmp_path / "run"
    claim_run_directory(run, "run", RUN_ENTRIES, restart=False)
    (run / name).write_text(text)
    for restart in (False, True):
        with pytest.raises(DensepassError, match=f"{name} is not a file densepass wrote"):
            claim_run_directory(run, "run", RUN_ENTRIES, restart=restart)
        assert (run / name).read_text() == text


def test_a_runs_own_trec_files_are_its_own_and_a_users_is_not(tmp_path):
    from densepass.io import written_by_densepass

    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "fine-tuned.trec").write_text("q1 Q0 p1 1 0.500000 fine-tuned\n")  # what a run writes
    (runs / "bm25.trec").write_text("q1 Q0 p1 1 0.500000 anserini\n")  # a user's, under a run's name
    assert written_by_densepass(runs / "fine-tuned.trec") and not written_by_densepass(runs / "bm25.trec")


def test_a_file_output_that_could_not_be_written_is_refused_before_any_work(tiny_beir, tmp_path, capsys):
    """An output under a file used to fail after the search or the reranking, at the write (``io.check_writable``:
    a probe file made and removed where the output would go)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("mine\n")
    queries = tmp_path / "queries.tsv"
    queries.write_text("a\taudio editor\n")
    for output in (blocker / "run.trec", blocker / "sub" / "run.trec"):
        for command in (
            ["search", str(tmp_path / "no-index"), "--queries", str(queries), "--output", str(output)],
            ["rerank", str(tiny_beir), str(queries), "--model", str(tmp_path / "no-model"), "--output", str(output)],
            ["mine", str(tiny_beir), "--strategy", "bm25", "--output", str(output)],
        ):
            assert main(command) == 2
            assert (
                f"cannot write {output}: Not a directory ({blocker} is a file, not a folder)" in capsys.readouterr().err
            )
    assert blocker.read_text() == "mine\n" and not [
        p.name for p in tmp_path.iterdir() if p.name.startswith(".")
    ]  # no probe left


def _run_with_marker(run: Path) -> Path:
    run.mkdir()
    (run / RUN_MARKER).write_text(json.dumps({"densepass": "run"}) + "\n")
    return run


def test_restart_never_deletes_a_users_file_put_inside_a_folder_an_entry_pattern_names(tmp_path):
    """A pattern's ``*`` matched across folders (``miner-*`` took ``miner-8d-abc/model/my_notes.txt``; ``model/*`` of
    the reranker took its model's notes): the notes were deleted. A pattern names files, folder by folder; a user's
    file in a folder densepass saves whole stops the restart before anything goes (the run could not save there)."""
    run = _run_with_marker(tmp_path / "run")
    folders = ("negatives/miner-8d-abc/model", "reranker/model", "reranker/checkpoints/step-2")
    for folder in folders:
        with atomic_directory(run / folder) as tmp:
            (tmp / "model.safetensors").write_text("w")
    (run / "negatives" / "miner-8d-abc" / "train_log.jsonl").write_text("{}\n")
    (run / "reranker" / "train_log.jsonl").write_text("{}\n")
    before = sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.is_file())
    for folder in folders:
        (run / folder / "my_notes.txt").write_text("mine")
        with pytest.raises(DensepassError, match=rf"{folder}/my_notes.txt is not densepass's, inside .*{folder}"):
            claim_run_directory(run, "run", RUN_ENTRIES, restart=True)
        (run / folder / "my_notes.txt").unlink()
        assert sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.is_file()) == before  # nothing removed
    assert claim_run_directory(run, "run", RUN_ENTRIES, restart=True) == []
    assert sorted(p.name for p in run.iterdir()) == [RUN_MARKER]  # the miner's and the reranker's files all went


def test_restart_removes_the_old_checkpoints_beside_a_users_file(tmp_path):
    """An entry holding a user's file was kept whole, its checkpoints with it: a --restart then resumed the old run
    (or refused it for other settings after removing its outputs). Now densepass's files go and the user's stays."""
    run = _run_with_marker(tmp_path / "run")
    for step in (2, 3):
        with atomic_directory(run / "checkpoints" / f"step-{step}") as tmp:
            (tmp / "state.json").write_text("{}")
    (run / "checkpoints" / "notes.txt").write_text("mine")
    (run / "schedule").mkdir()
    (run / "schedule" / "epoch-1.npz").write_bytes(b"old")
    (run / "schedule" / ".epoch-2.npz.k3j5x9q2.tmp").write_bytes(b"killed save")  # atomic_file's temporary
    (run / "schedule" / "ideas.txt").write_text("mine")
    kept = claim_run_directory(run, "run", RUN_ENTRIES, restart=True)
    assert sorted(kept) == ["checkpoints/notes.txt", "schedule/ideas.txt"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["notes.txt"]
    assert sorted(p.name for p in (run / "schedule").iterdir()) == ["ideas.txt"]


def test_the_scheduling_embeddings_are_saved_under_densepass_temporary_name(tmp_path, monkeypatch):
    """A killed save left ``.epoch-N.npz.partial.npz``, which --restart took for a user's file (keeping the folder
    and the stale embeddings beside it); the save now writes through ``atomic_file``, as every other output."""
    import numpy as np

    from densepass.io import _TEMPORARY
    from densepass.training import planner

    names = []
    real = np.savez

    def savez(file, **arrays):
        names.extend(p.name for p in (tmp_path / "schedule").iterdir())  # what a kill now would leave
        return real(file, **arrays)

    monkeypatch.setattr(planner.np, "savez", savez)
    plan = planner.EpochPlanner.__new__(planner.EpochPlanner)
    plan.state_dir = tmp_path / "schedule"
    plan._encode_now = lambda: (np.ones((2, 3), np.float32), np.ones((2, 3), np.float32))
    queries, _ = plan._encode(4)
    assert queries.shape == (2, 3) and (tmp_path / "schedule" / "epoch-4.npz").is_file()
    assert len(names) == 1 and _TEMPORARY.fullmatch(names[0]) and names[0].startswith(".epoch-4.npz.")
