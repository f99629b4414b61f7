"""Sharded encoding and mining with 1, 2 and 4 processes (``index.sharded`` under torchrun) against
sentence-transformers' multi-process ``encode`` pool and ``util.mine_hard_negatives``: time and peak
resident memory per process on a synthetic corpus of N passages.

    python benchmarks/bench_scale.py --n 100000 --processes 1 2 4 --out outputs/bench/scale-100k.json
    python benchmarks/bench_scale.py --n 1000000 --processes 1 2 4 --out outputs/bench/scale-1m.json

The corpus repeats debian-packages' 60,240 passages (copy r > 0 has `` (copy r)`` appended to its text, so
no two passages are equal) as a BEIR directory under ``--work-dir``; the queries are debian-packages train
queries, each relevant to the first copy of its passage. Each system gets the same passage strings
(``title [SEP] text``), model, max length, batch size and, with P processes, ``--threads`` // P torch
threads per process (the same total). Rows:

- densepass encode: ``torchrun --nproc_per_node P`` of ``encode_sharded`` into memory-mapped shards, each
  process streaming only its shard of ``corpus.jsonl``; seconds from the model loaded to every shard written.
- sentence-transformers encode: the whole list of passages in memory, ``encode(..., pool=...)`` over a pool
  of P CPU processes from ``start_multi_process_pool`` (P = 1: plain ``encode``); pool start excluded.
- densepass mine: ``torchrun --nproc_per_node P -m densepass mine --strategy model`` (qrels filter only);
  seconds = the mining itself (encode, search, filter), as the command reports it.
- sentence-transformers mine: ``mine_hard_negatives(..., use_multi_process=["cpu"] * P)``, top-``--depth``
  of ranks [0, depth + margin), the same queries and corpus (needs the ``datasets`` package). Its exact
  search holds a ``faiss_batch_size`` x N matrix of scores (16,384 queries by default, so all 10,000 queries
  at once: 4 GB at N = 100k, 40 GB at 1M); ``--st-faiss-batch-size`` sets a smaller chunk.

``--random-model 1x64`` replaces the model by a 1-layer, 64-unit BERT with random weights (MiniLM's tokenizer):
at 88 passages/s, MiniLM on 2 CPU cores would need hours per 1M-passage row.

Peak RSS (``getrusage`` max resident set size) is per process: for densepass the largest rank, for
sentence-transformers the main process (which holds every passage string and embedding) and the largest
pool worker. Every measurement runs in fresh processes. Use ``--model`` with a tiny model directory and a
small ``--n`` to smoke-test the script; timings only mean something on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from common import environment, markdown_table, output_file, rate, write_json  # noqa: E402
from densepass.cli import positive_int  # noqa: E402
from densepass.data import load_dataset  # noqa: E402
from densepass.io import atomic_write_text  # noqa: E402


def peak_rss_mib(who: int = resource.RUSAGE_SELF) -> float:
    """Maximum resident set size of this process (or of its largest waited-for child), MiB."""
    return resource.getrusage(who).ru_maxrss / 1024


# ---- the synthetic corpus ------------------------------------------------------------------------


def build_corpus(source: str, data_dir: str | None, n: int, queries: int, out: Path, seed: int) -> Path:
    """A BEIR directory of ``n`` passages (debian-packages repeated) and ``queries`` train queries."""
    source_dir = str(Path(data_dir).resolve()) if data_dir else None  # another folder's data: built again
    done, recipe = (
        out / "done.json",
        {"source": source, "data_dir": source_dir, "n": n, "queries": queries, "seed": seed},
    )
    if done.is_file() and json.loads(done.read_text()) == recipe:
        return out
    dataset = load_dataset(source, data_dir)
    corpus = dataset.corpus
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "corpus.jsonl", "w") as handle:
        for i in range(n):
            row, copy = i % len(corpus), i // len(corpus)
            text = corpus.texts[row] + (f" (copy {copy})" if copy else "")
            record = {"_id": f"p{i}", "title": corpus.titles[row], "text": text, "doc_id": f"d{i}"}
            handle.write(json.dumps(record) + "\n")
    pairs = [(q, corpus.position(p[0])) for q, p in sorted(dataset.positives("train").items())]
    pairs = [(q, row) for q, row in pairs if row < n]
    chosen = random.Random(seed).sample(pairs, min(queries, len(pairs)))
    with open(out / "queries.jsonl", "w") as handle:
        for j, (q, _) in enumerate(chosen):
            handle.write(json.dumps({"_id": f"q{j}", "text": dataset.queries[q]}) + "\n")
    (out / "qrels").mkdir(exist_ok=True)
    with open(out / "qrels" / "train.tsv", "w") as handle:
        handle.write("query-id\tcorpus-id\tscore\n")
        for j, (_, row) in enumerate(chosen):
            handle.write(f"q{j}\tp{row}\t1\n")
    atomic_write_text(done, json.dumps(recipe))
    return out


# ---- workers (each in fresh processes) -------------------------------------------------------------


def densepass_encode_worker(args: argparse.Namespace) -> dict:
    """One torchrun process: encode its shard of the streamed corpus into memory-mapped shards."""
    from densepass import distributed
    from densepass.data import stream_passage_inputs
    from densepass.index.sharded import encode_sharded
    from densepass.models.biencoder import BiEncoder, BiEncoderConfig, resolve_model_path

    with distributed.process_group():
        config = BiEncoderConfig(query_max_length=args.max_length, passage_max_length=args.max_length)
        model = BiEncoder.from_pretrained(resolve_model_path(args.model), config=config)
        rows = sum(1 for _ in open(Path(args.data) / "corpus.jsonl"))
        texts = stream_passage_inputs(args.data, None, "beir", model.tokenizer.sep_token, rows)
        distributed.barrier()
        started = time.perf_counter()
        encode_sharded(
            model,
            texts,
            args.shards,
            f"synthetic-{rows}",
            block=args.block,
            batch_size=args.batch_size,
            device=torch.device("cpu"),
            show_progress=False,
        )  # ends with a barrier: every shard is written
        return {"seconds": time.perf_counter() - started, "rank": distributed.rank()}


def densepass_mine_worker(args: argparse.Namespace) -> dict:
    """One torchrun process of ``densepass mine``."""
    from densepass import distributed
    from densepass.config import load_config
    from densepass.pipelines.mine_command import mine_training_negatives

    overrides = {
        "data.name": args.data,
        "negatives.source": "model",
        "negatives.model": args.model_path,
        "negatives.pool_depth": args.depth,
        "negatives.filters": ["qrels"],
        "negatives.batch_size": args.batch_size,
        "negatives.shard_block": args.block,
        "device": "cpu",
    }
    config = load_config(None, [f"{k}={json.dumps(v)}" for k, v in overrides.items()])
    with distributed.process_group():
        result = mine_training_negatives(config, Path(args.shards) / "negatives.jsonl")
        return {"seconds": result.seconds, "rank": distributed.rank(), "negatives": len(result.pool)}


def st_worker(args: argparse.Namespace) -> dict:
    """sentence-transformers' encode (pool of P processes) or mine_hard_negatives, in this process."""
    from sentence_transformers import SentenceTransformer

    from densepass.models.biencoder import resolve_model_path
    from densepass.negatives.mine import fetch_depth

    model = SentenceTransformer(resolve_model_path(args.model), device="cpu")
    model.max_seq_length = args.max_length
    dataset = load_dataset(args.data)
    texts = dataset.corpus.passage_inputs(model.tokenizer.sep_token)
    devices = ["cpu"] * args.processes
    if args.worker == "st-encode":
        pool = model.start_multi_process_pool(devices) if args.processes > 1 else None
        started = time.perf_counter()
        model.encode(texts, batch_size=args.batch_size, pool=pool, show_progress_bar=False)
        seconds = time.perf_counter() - started
        if pool is not None:
            model.stop_multi_process_pool(pool)
        return {"seconds": seconds}
    from datasets import Dataset
    from sentence_transformers.util import mine_hard_negatives

    positives = dataset.positives("train")
    query_ids = sorted(positives)
    pairs = Dataset.from_dict(
        {
            "query": [dataset.queries[q] for q in query_ids],
            "positive": [texts[dataset.corpus.position(positives[q][0])] for q in query_ids],
        }
    )
    started = time.perf_counter()
    mine_hard_negatives(
        pairs,
        model,
        corpus=texts,
        range_max=fetch_depth(args.depth),
        num_negatives=args.depth,
        sampling_strategy="top",
        batch_size=args.batch_size,
        output_format="n-tuple",
        use_multi_process=devices if args.processes > 1 else False,
        **({"faiss_batch_size": args.st_faiss_batch_size} if args.st_faiss_batch_size else {}),
        verbose=False,
    )
    return {"seconds": time.perf_counter() - started}


def run_worker(args: argparse.Namespace) -> None:
    """Run one worker and write its seconds and peak memory as JSON lines to ``--report``."""
    work = {"encode": densepass_encode_worker, "mine": densepass_mine_worker}.get(args.worker, st_worker)
    result = work(args)
    result.update(rss_mib=peak_rss_mib(), children_rss_mib=peak_rss_mib(resource.RUSAGE_CHILDREN))
    with open(args.report, "a") as handle:
        handle.write(json.dumps(result) + "\n")


# ---- the driver ----------------------------------------------------------------------------------------


RUN_MARK = ".bench-scale-run"  # in every run folder this script makes: the folders it may remove again


def run_folder(args: argparse.Namespace, worker: str, processes: int) -> Path:
    return Path(args.work_dir) / f"{worker}-{args.n}-p{processes}"


def check_run_folders(args: argparse.Namespace) -> None:
    """Before any work: every run folder this run will replace is one this script made (it holds ``RUN_MARK``)."""
    for worker in args.systems:
        for processes in args.processes:
            folder = run_folder(args, worker, processes)
            if folder.exists() and not (folder / RUN_MARK).is_file():
                raise SystemExit(
                    f"bench_scale.py: error: {folder} exists and was not made by this script: it removes only its own"
                    " run folders; choose another --work-dir, or move that folder away yourself"
                )


def measure(worker: str, processes: int, args: argparse.Namespace, data: Path, model_path: str) -> dict:
    """Run ``worker`` with ``processes`` processes (torchrun for densepass) and collect its reports."""
    run_dir = run_folder(args, worker, processes)
    if (run_dir / RUN_MARK).is_file():  # an earlier run's (check_run_folders refused any other)
        import shutil

        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    (run_dir / RUN_MARK).write_text("")
    report = run_dir / "report.jsonl"
    threads = max(1, args.threads // processes)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    common = [
        "--worker", worker, "--data", str(data), "--model", args.model, "--model-path", model_path,
        "--shards", str(run_dir), "--report", str(report), "--processes", str(processes),
        "--block", str(args.block), "--batch-size", str(args.batch_size), "--max-length", str(args.max_length),
        "--depth", str(args.depth),
    ] + (["--st-faiss-batch-size", str(args.st_faiss_batch_size)] if args.st_faiss_batch_size else [])  # fmt: skip
    launcher = [sys.executable]
    if worker in ("encode", "mine"):
        launcher += ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"]
    started = time.perf_counter()
    done = subprocess.run([*launcher, __file__, *common], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        (run_dir / "stderr.log").write_text(done.stderr)
        return {"error": failure(done.returncode, done.stderr), "wall": wall}
    reports = [json.loads(line) for line in report.read_text().splitlines()]
    pool = worker.startswith("st") and processes > 1  # sentence-transformers' worker processes
    return {
        "seconds": max(r["seconds"] for r in reports),
        "wall": wall,
        "rss_mib": max(r["rss_mib"] for r in reports),
        "workers_rss_mib": max(r["children_rss_mib"] for r in reports) if pool else None,
        "processes": processes,
        "threads_per_process": threads,
    }


def failure(returncode: int, stderr: str) -> str:
    """How a measurement ended: killed by a signal (``SIGKILL``: most often the kernel's out-of-memory killer)
    or its exit status, with the last stderr line that is not a warning (the whole stderr is kept beside the
    report as ``stderr.log``)."""
    import signal

    how = f"killed by {signal.Signals(-returncode).name}" if returncode < 0 else f"exit status {returncode}"
    lines = [line for line in stderr.strip().splitlines() if "warn" not in line.lower()]
    return f"{how}: {lines[-1].strip()}" if lines else how


def random_model(spec: str, work_dir: str) -> str:
    """A BERT of ``LAYERSxHIDDEN`` (e.g. ``1x64``) with random weights (seed 13) and MiniLM's tokenizer, saved
    under ``work_dir``: a model whose matrix products cost little, so that the benchmark measures the pipeline
    around it at corpus sizes MiniLM would take hours to encode on a CPU."""
    from densepass.models.load import save_random_bert

    try:
        layers, hidden = (int(x) for x in spec.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--random-model: expected LAYERSxHIDDEN such as 1x64, got {spec!r}") from None
    if layers < 1 or hidden < 1 or hidden % 64:
        raise SystemExit(f"--random-model: layers >= 1 and a hidden size that is a multiple of 64, got {spec!r}")
    return save_random_bert(Path(work_dir) / f"random-bert-{layers}x{hidden}", layers, hidden)


def saved_model(args: argparse.Namespace) -> str:
    """The model saved with the benchmark's max length, for ``densepass mine --strategy model`` (kept under the
    fingerprint of the model's files and the max length, so another ``--model`` never reuses it)."""
    from densepass.fingerprints import fingerprint_directory, fingerprint_json
    from densepass.models.biencoder import BiEncoder, BiEncoderConfig, resolve_model_path

    source = resolve_model_path(args.model)
    key = fingerprint_json([fingerprint_directory(source), args.max_length])[:16]
    path = Path(args.work_dir) / f"model-{key}"
    if not (path / "config.json").is_file():
        config = BiEncoderConfig(query_max_length=args.max_length, passage_max_length=args.max_length)
        BiEncoder.from_pretrained(source, config=config).save(path)
    return str(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=positive_int, default=100_000, help="passages in the synthetic corpus")
    parser.add_argument("--queries", type=positive_int, default=10_000, help="train queries mined (at most)")
    parser.add_argument("--processes", type=positive_int, nargs="+", default=[1, 2, 4])
    parser.add_argument(
        "--threads", type=positive_int, default=os.cpu_count(), help="torch threads in all (split per process)"
    )
    parser.add_argument("--model", default="all-MiniLM-L6-v2", help="a model name or directory")
    parser.add_argument(
        "--random-model", default=None, metavar="LAYERSxHIDDEN", help="instead of --model: a random BERT, e.g. 1x64"
    )
    parser.add_argument("--dataset", default="debian-packages", help="the passages and queries repeated")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--work-dir", default="outputs/bench_scale")
    parser.add_argument("--block", type=int, default=65_536, help="densepass: passages per block (shards are runs)")
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--depth", type=int, default=50, help="negatives per query")
    parser.add_argument(
        "--st-faiss-batch-size",
        type=int,
        default=None,
        help="sentence-transformers mine: queries per similarity chunk (default: its own, 16,384)",
    )
    parser.add_argument("--systems", nargs="+", default=["encode", "st-encode", "mine", "st-mine"])
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--out", type=output_file, default=None)
    # worker mode (the driver runs this script again for each measurement)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    for hidden in ("--data", "--model-path", "--shards", "--report"):
        parser.add_argument(hidden, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.processes = args.processes[0]
        run_worker(args)
        return

    if args.st_faiss_batch_size is not None and args.st_faiss_batch_size < 1:
        raise SystemExit(f"--st-faiss-batch-size must be >= 1, got {args.st_faiss_batch_size}")
    unknown = sorted(set(args.systems) - {"encode", "st-encode", "mine", "st-mine"})
    if unknown:
        parser.error(f"unknown --systems {', '.join(unknown)} (encode, st-encode, mine, st-mine)")
    check_run_folders(args)
    if args.random_model:
        args.model = random_model(args.random_model, args.work_dir)
    data = build_corpus(args.dataset, args.data_dir, args.n, args.queries, Path(args.work_dir) / f"data-{args.n}", 13)
    with open(data / "queries.jsonl") as handle:
        queries = sum(1 for line in handle if line.strip())  # those with a positive among the n passages
    model_path = saved_model(args)
    names = {
        "encode": "densepass encode_sharded (torchrun)",
        "st-encode": "sentence-transformers encode (multi-process pool)",
        "mine": "densepass mine (torchrun)",
        "st-mine": "sentence-transformers mine_hard_negatives (use_multi_process)",
    }
    results, rows = [], []
    for system in args.systems:
        for processes in args.processes:
            got = measure(system, processes, args, data, model_path)
            results.append({"system": names[system], **got})
            print(json.dumps(results[-1]), flush=True)
            per_second = args.n if "encode" in system else queries
            if "error" in got:
                rows.append([names[system], processes, got["error"], "-", "-", "-"])
                continue
            rows.append(
                [names[system], processes, f"{got['seconds']:.1f}", rate(per_second / got["seconds"])]
                + [f"{got['rss_mib']:,.0f}", _mib(got["workers_rss_mib"])]
            )
    headers = ["system", "processes", "seconds", "per second", "peak RSS MiB (main)", "peak RSS MiB (workers)"]
    print(f"\n**{args.n:,} passages, {queries:,} queries, {args.threads} threads in all, CPU**\n")
    print(markdown_table(headers, rows))
    write_json(
        args.out,
        {"args": vars(args), "queries": queries, "environment": environment(torch.device("cpu")), "results": results},
    )


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


if __name__ == "__main__":
    main()
