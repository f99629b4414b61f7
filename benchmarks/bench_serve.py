r"""Load test of the search service: queries/s and p50/p95/p99 latency at concurrency 1, 8 and 64, one query
per request, for one or more services side by side (e.g. micro-batched against batching off), with the ratio.

    # services already running (NAME=URL):
    python benchmarks/bench_serve.py --queries queries.jsonl.gz \
        --url batched=http://127.0.0.1:8000 --url unbatched=http://127.0.0.1:8001 --out runs/bench/serve.json
    # or started (and stopped) by the script, one at a time; {port} becomes a free port:
    python benchmarks/bench_serve.py --queries queries.jsonl.gz \
        --start "batched=densepass serve IDX --port {port}" \
        --start "unbatched=densepass serve IDX --port {port} --max-batch-size 1"

Under change: ``--during COMMAND`` runs a shell command while each level is measured (``{url}`` becomes the
service's URL), e.g. index updates swapped in by a reload, so that the errors and p99 of a level say what a reload
costs (docs/guide/living-index.md):

    python benchmarks/bench_serve.py --queries queries.jsonl.gz --concurrency 8 --seconds 60 \
        --start "live=densepass serve IDX --port {port} --watch-index 1" \
        --during "for i in 1 2 3; do densepass index-update IDX --upsert new.jsonl; sleep 10; done"

The OpenAI or TEI embedding route instead of /search: ``--route v1/embeddings`` (``{"input": [...], "model": M}``)
or ``--route embed`` (``{"inputs": [...]}``), ``--texts-per-request N`` texts each (embeddings per second are
then ``texts_per_s``), ``--api-key`` (or $DENSEPASS_API_KEY) sent as a bearer token. A peer service that speaks
OpenAI's API is measured the same way by URL or command, e.g. infinity-emb (``--route embeddings``, its path; the
service needs a GET /health that answers 200):

    python benchmarks/bench_serve.py --queries queries.jsonl.gz --route v1/embeddings --texts-per-request 32 \
        --start "densepass=densepass serve IDX --port {port}"
    python benchmarks/bench_serve.py --queries queries.jsonl.gz --route embeddings --texts-per-request 32 \
        --model sentence-transformers/all-MiniLM-L6-v2 \
        --start "infinity=infinity_emb v2 --model-id sentence-transformers/all-MiniLM-L6-v2 --port {port}"

densepass against infinity-emb serving the same model files, side by side in one run (both started, pinned to the
same cores with the same threads, measured in turn round after round; texts per request x concurrent clients; the
embeddings checked to agree first; see serve_peer.py):

    python benchmarks/bench_serve.py --peer infinity --peer-python /path/to/infinity-venv/bin/python \
        --index IDX --passages corpus.jsonl.gz --out runs/bench/serve-infinity.json

with infinity's bf16 and ONNX Runtime settings beside (``--peer-dtypes float32 bfloat16 --peer-engines torch optimum
--peer-onnx ONNX_DIR``), or the same for a cross-encoder's ``/rerank`` (``--route rerank --reranker CE``: one query
with N passages per request, raw scores checked to agree first; see serve_peer.py and docs/benchmarks.md).

Queries: a BEIR queries.jsonl(.gz) (its ``text`` fields) or a text file with one query per line, sent in
order and cycled. Each concurrency level runs until --requests requests or --seconds seconds, whichever comes
first, after --warmup requests that are not counted. Services given by URL are measured level by level in
turn (c=1 on each, then c=8...); started services run one after the other, so that they never share the
machine. Latency is the client's (request sent to answer read), over successful requests; errors are
counted apart. The mean batch size is read from the services' /health counters. The client is Python: its
CPU use is reported per level (share of one core per client process); near 100% the client, not the
service, is the limit, and --processes N spreads the workers over N client processes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import itertools
import multiprocessing
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from common import markdown_table, output_with_table, rate, write_json, write_table
from densepass.data.beir import open_text, read_queries


@dataclass
class Service:
    """A search service under test: its name, base URL and, when the script started it, its command."""

    name: str
    url: str = ""
    command: str | None = None
    process: subprocess.Popen | None = field(default=None, repr=False)
    health: dict = field(default_factory=dict)
    route: str | None = None  # its own path (--peer: each server's embeddings route), else --route
    model: str | None = None  # the model name sent to it (--peer), else --model
    env: dict | None = field(default=None, repr=False)  # extra environment of its command
    api: str | None = None  # --peer: its request shapes (openai; /rerank: tei for densepass, cohere for infinity)
    cwd: str | None = None  # the folder its command runs in (default: this one)


def named(value: str, index: int) -> tuple[str, str]:
    """``NAME=VALUE`` as (NAME, VALUE); without a name (or with a name that is not a plain word) the value is the
    whole string and the name is ``service{index}``."""
    name, sep, rest = value.partition("=")
    return (name, rest) if sep and re.fullmatch(r"[\w.-]+", name) else (f"service{index}", value)


def read_query_texts(path: Path) -> list[str]:
    """Query texts from a BEIR queries.jsonl(.gz) or a plain text file (one query per line, blank lines skipped)."""
    if path.name.endswith((".jsonl", ".jsonl.gz")):
        return list(read_queries(path)[0].values())
    with open_text(path) as handle:
        return [line.strip() for line in handle if line.strip()]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def get_health(client: httpx.Client, url: str) -> dict:
    response = client.get(f"{url}/health")
    response.raise_for_status()
    return response.json()


def start(service: Service, client: httpx.Client, startup_s: float) -> None:
    """Start the service's command on a free port and wait until its /health answers."""
    port = free_port()
    service.url = f"http://127.0.0.1:{port}"
    service.process = subprocess.Popen(
        shlex.split(service.command.replace("{port}", str(port))),
        start_new_session=True,
        env={**os.environ, **service.env} if service.env else None,
        cwd=service.cwd,
    )
    deadline = time.monotonic() + startup_s
    while time.monotonic() < deadline:
        if service.process.poll() is not None:
            raise SystemExit(f"bench_serve: {service.name}: the command exited with {service.process.returncode}")
        try:
            get_health(client, service.url)
            return
        except httpx.HTTPError:
            time.sleep(0.2)
    stop(service)
    raise SystemExit(f"bench_serve: {service.name}: no answer on {service.url}/health after {startup_s:.0f}s")


def stop(service: Service) -> None:
    """Stop a started service: Ctrl-C (graceful shutdown), then kill after 30 s."""
    if service.process is None or service.process.poll() is not None:
        return
    service.process.send_signal(signal.SIGINT)
    try:
        service.process.wait(30)
    except subprocess.TimeoutExpired:
        service.process.kill()
        service.process.wait()


async def load(
    url: str,
    queries: list[str],
    first: int,
    step: int,
    concurrency: int,
    requests: int,
    seconds: float,
    k: int,
    timeout: float,
    route: str = "search",
    texts_per_request: int = 1,
    model: str | None = None,
    api_key: str | None = None,
    api: str | None = None,
    rerank_queries: list[str] | None = None,
) -> dict:
    """Send one-query requests (``texts_per_request`` texts to an embedding ``route``) numbered ``first, first +
    step, ...`` below ``requests`` (or for ``seconds``) from
    ``concurrency`` workers, once all of them are connected (connecting is not timed). Each worker has its own
    client and keep-alive connection: one shared pool of many connections costs the client time that grows with
    their number (httpcore scans the pool on every request)."""
    latencies: list[float] = []
    failures: Counter[str] = Counter()
    numbers = itertools.count(first, step)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None

    async def worker(client: httpx.AsyncClient, deadline: float) -> None:
        for i in numbers:
            if i >= requests or time.perf_counter() > deadline:
                return
            sent = time.perf_counter()
            try:
                response = await client.post(
                    f"{url}/{route}", json=body(route, queries, i, texts_per_request, k, model, api, rerank_queries)
                )
                if response.status_code != 200:
                    failures[str(response.status_code)] += 1
                    continue
            except httpx.HTTPError as err:
                failures[type(err).__name__] += 1
                continue
            latencies.append(time.perf_counter() - sent)

    async with contextlib.AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(httpx.AsyncClient(timeout=timeout, trust_env=False, headers=headers))
            for _ in range(concurrency)
        ]
        await asyncio.gather(*(client.get(f"{url}/health") for client in clients))
        cpu, started = time.process_time(), time.perf_counter()
        await asyncio.gather(*(worker(client, started + seconds) for client in clients))
        wall = time.perf_counter() - started
    return {"latencies": latencies, "failures": failures, "seconds": wall, "cpu_s": time.process_time() - cpu}


def body(
    route: str,
    queries: list[str],
    i: int,
    texts: int,
    k: int,
    model: str | None,
    api: str | None = None,
    rerank_queries: list[str] | None = None,
) -> dict:
    """The JSON of request ``i``: one query to /search, or ``texts`` texts from the ``i``-th on to an OpenAI
    (``.../embeddings``) or TEI (``embed``) route, or (``rerank``) the ``i``-th of ``rerank_queries`` with ``texts``
    of ``queries`` (passages) as TEI's ``texts`` or, ``api`` cohere (infinity-emb), as Cohere's ``documents``."""
    if route.rstrip("/").endswith("rerank"):
        documents = [queries[(i * texts + j) % len(queries)] for j in range(texts)]
        field = "documents" if api == "cohere" else "texts"
        return {"query": rerank_queries[i % len(rerank_queries)], field: documents}
    if route.rstrip("/").endswith("embeddings"):
        chosen = [queries[(i * texts + j) % len(queries)] for j in range(texts)]
        return {"input": chosen, **({"model": model} if model else {})}
    if route.rstrip("/").endswith("embed"):
        return {"inputs": [queries[(i * texts + j) % len(queries)] for j in range(texts)]}
    if texts > 1:
        return {"queries": [queries[(i * texts + j) % len(queries)] for j in range(texts)], "k": k}
    return {"query": queries[i % len(queries)], "k": k}


def run_load(*args) -> dict:
    """:func:`load` in its own event loop (also the entry point of the client processes)."""
    return asyncio.run(load(*args))


def measure(
    pool: ProcessPoolExecutor | None,
    client: httpx.Client,
    service: Service,
    queries: list[str],
    concurrency: int,
    args: argparse.Namespace,
) -> dict:
    """One level on one service: the client's workers split over ``pool``'s processes (or run here), the
    latency percentiles over all of them, and the mean batch size from the service's /health counters."""
    before = get_health(client, service.url).get("served", {})
    shares = min(concurrency, args.processes)
    jobs = [
        (
            service.url,
            queries,
            p,
            shares,
            concurrency // shares + (p < concurrency % shares),
            args.requests,
            args.seconds,
            args.k,
            args.timeout,
            service.route or args.route,
            args.texts_per_request,
            service.model or args.model,
            args.api_key,
            service.api,
            getattr(args, "rerank_queries", None),
        )
        for p in range(shares)
    ]
    during = subprocess.Popen(args.during.replace("{url}", service.url), shell=True) if args.during else None
    try:
        parts = list(pool.map(run_load, *zip(*jobs))) if pool else [run_load(*jobs[0])]
    finally:
        during_rc = during.wait() if during is not None else None  # the level's numbers cover the whole command
    wall = max(part["seconds"] for part in parts)
    after = get_health(client, service.url).get("served", {})
    latencies = np.array([x for part in parts for x in part["latencies"]]) * 1000
    failures = sum((part["failures"] for part in parts), Counter())
    p50, p95, p99 = np.percentile(latencies, [50, 95, 99]).tolist() if len(latencies) else [float("nan")] * 3
    batches = after.get("batches", 0) - before.get("batches", 0)
    return {
        "service": service.name,
        "concurrency": concurrency,
        "texts_per_request": args.texts_per_request,
        "requests": len(latencies) + sum(failures.values()),
        "errors": sum(failures.values()),
        "error_kinds": dict(failures),
        "seconds": wall,
        "queries_per_s": len(latencies) / wall,
        "texts_per_s": len(latencies) * args.texts_per_request / wall,
        "p50_ms": p50,
        "p95_ms": p95,
        "p99_ms": p99,
        "mean_batch": (after["queries"] - before["queries"]) / batches if batches else None,
        "client_cpu": sum(part["cpu_s"] / part["seconds"] for part in parts) / shares,
        "during": None if during is None else {"command": args.during, "returncode": during_rc},
    }


def run(services: list[Service], queries: list[str], args: argparse.Namespace) -> list[dict]:
    """Every level on every service (see the module doc for the order); started services are stopped after."""
    results: list[dict] = []
    pool = (
        ProcessPoolExecutor(args.processes, mp_context=multiprocessing.get_context("fork"))
        if args.processes > 1
        else None
    )
    with httpx.Client(timeout=args.timeout, trust_env=False) as client:

        def prepare(service: Service) -> None:
            if service.command:
                start(service, client, args.startup_seconds)
            service.health = get_health(client, service.url)
            run_load(
                service.url, queries, 0, 1, 1, args.warmup, args.seconds, args.k, args.timeout, args.route,
                args.texts_per_request, args.model, args.api_key,
            )  # fmt: skip
            print(
                f"{service.name}: {service.url} {service.health.get('searcher')} "
                f"batching {service.health.get('batching')}",
                flush=True,
            )

        def level(service: Service, concurrency: int) -> None:
            r = measure(pool, client, service, queries, concurrency, args)
            results.append(r)
            print(
                f"  {service.name} c={concurrency}: {rate(r['queries_per_s'])} requests/s "
                f"({rate(r['texts_per_s'])} texts/s), p50 {r['p50_ms']:.1f} ms"
                f", {r['errors']} errors, client CPU {r['client_cpu']:.0%}",
                flush=True,
            )

        try:
            if any(s.command for s in services):  # started services run one at a time
                for service in services:
                    try:
                        prepare(service)
                        for concurrency in args.concurrency:
                            level(service, concurrency)
                    finally:
                        stop(service)
            else:
                for service in services:
                    prepare(service)
                for concurrency in args.concurrency:
                    for service in services:
                        level(service, concurrency)
        finally:
            if pool:
                pool.shutdown()
    return results


def run_peer(services: list[Service], texts: list[str], args: argparse.Namespace) -> dict:
    """``--peer``: start every server (all stay up; see serve_peer's doc), warm each up, check that their
    embeddings (``--route rerank``: raw scores) agree on a sample, then ``--rounds`` rounds of every
    texts-per-request x concurrency cell measured on each server in turn (the order rotated each round); every
    server is stopped after."""
    results: list[dict] = []
    with httpx.Client(timeout=args.timeout, trust_env=False) as client:
        try:
            for service in services:
                start(service, client, args.startup_seconds)
                service.health = get_health(client, service.url)
                models = client.get(f"{service.url}/{'v1/' if service.name.startswith('densepass') else ''}models")
                service.health["models"] = models.json() if models.status_code == 200 else None  # infinity: batch size
                print(f"{service.name}: {service.url} ({service.command})", flush=True)
            for service in services:
                run_load(
                    service.url, texts, 0, 1, 1, args.warmup, args.seconds, args.k, args.timeout, service.route,
                    max(args.texts_per_request), None, args.api_key, service.api, args.rerank_queries,
                )  # fmt: skip
            check = rerank_agreement if args.route == "rerank" else embedding_agreement
            try:
                agreement = check(client, services, texts, args)
            except httpx.HTTPStatusError as err:
                answer = f"{err.request.url} answered {err.response.status_code}: {err.response.text[:200]!r}"
                raise SystemExit(f"bench_serve: the agreement check: {answer}") from None
            unit = "documents" if args.route == "rerank" else "texts"
            for round_ in range(args.rounds):
                order = services[round_ % len(services) :] + services[: round_ % len(services)]
                for per_request in args.texts_per_request:
                    cell_args = argparse.Namespace(**{**vars(args), "texts_per_request": per_request})
                    for concurrency in args.concurrency:
                        for service in order:
                            r = measure(None, client, service, texts, concurrency, cell_args)
                            r["round"] = round_
                            results.append(r)
                            print(
                                f"  round {round_} {per_request} {unit} x {concurrency} clients {service.name}: "
                                f"{rate(r['texts_per_s'])} {unit}/s, p50 {r['p50_ms']:.1f} ms, p99 "
                                f"{r['p99_ms']:.1f} ms, {r['errors']} errors, client CPU {r['client_cpu']:.0%}",
                                flush=True,
                            )
        finally:
            for service in services:
                stop(service)
    return {"results": results, "agreement": agreement}


def embedding_agreement(client: httpx.Client, services: list[Service], texts: list[str], args) -> dict[str, dict]:
    """Each server's embeddings of the first ``--check-texts`` texts against the first server's: the least cosine,
    at least ``--min-cosine`` (else a one-line exit)."""
    from serve_peer import cosines, embeddings

    agreement: dict[str, dict] = {}
    sample = texts[: args.check_texts]
    reference = embeddings(client, services[0].url, services[0].route, sample)
    for service in services[1:]:
        cos = cosines(reference, embeddings(client, service.url, service.route, sample))
        agreement[service.name] = {"versus": services[0].name, "texts": len(sample), "min_cosine": cos.min()}
        print(f"{service.name} against {services[0].name}: min cosine {cos.min():.6f} over {len(sample)} texts")
        if cos.min() < args.min_cosine:
            raise SystemExit(
                f"bench_serve: {service.name}'s embeddings differ from {services[0].name}'s (min cosine "
                f"{cos.min():.6f} < {args.min_cosine}): the servers do not compute the same thing"
            )
    return agreement


CHECK_DOCUMENTS = 8  # --route rerank: documents per query in the agreement check


def rerank_agreement(client: httpx.Client, services: list[Service], texts: list[str], args) -> dict[str, dict]:
    """Each server's raw scores (``raw_scores``: the logits, no sigmoid) of ``--check-texts`` pairs (queries with
    ``CHECK_DOCUMENTS`` passages each) against the first server's: the largest absolute difference, at most
    ``--max-score-diff`` of the spread of the first server's scores (else a one-line exit), and the share of queries
    ranked in the same order."""
    from serve_peer import rerank_scores, score_agreement

    n = -(-args.check_texts // CHECK_DOCUMENTS)
    sample = [
        (args.rerank_queries[j % len(args.rerank_queries)], texts[j * CHECK_DOCUMENTS : (j + 1) * CHECK_DOCUMENTS])
        for j in range(n)
    ]
    first = services[0]
    reference = [rerank_scores(client, first.url, first.api, q, docs) for q, docs in sample]
    agreement: dict[str, dict] = {}
    for service in services[1:]:
        found = score_agreement(reference, [rerank_scores(client, service.url, service.api, q, d) for q, d in sample])
        agreement[service.name] = {"versus": first.name, **found}
        print(
            f"{service.name} against {first.name}: raw scores differ by at most {found['max_abs_diff']:.2e} "
            f"({found['relative_diff']:.2%} of their spread {found['spread']:.3g}) over {found['pairs']} pairs; "
            f"{found['same_order']:.0%} of {found['queries']} queries in the same order"
        )
        if not found["relative_diff"] <= args.max_score_diff:
            raise SystemExit(
                f"bench_serve: {service.name}'s raw scores differ from {first.name}'s by {found['max_abs_diff']:.3g}, "
                f"{found['relative_diff']:.2%} of their spread (> --max-score-diff {args.max_score_diff:.0%}): the "
                "servers do not compute the same thing"
            )
    return agreement


def tables(services: list[Service], results: list[dict], concurrency: list[int]) -> tuple[str, list[dict]]:
    """The markdown tables (per service and level; the first service against each other one) and the ratios."""
    rows = [
        [
            r["concurrency"],
            r["service"],
            r["requests"],
            r["errors"],
            rate(r["queries_per_s"]),
            rate(r["texts_per_s"]),
            f"{r['p50_ms']:.1f}",
            f"{r['p95_ms']:.1f}",
            f"{r['p99_ms']:.1f}",
            "" if r["mean_batch"] is None else f"{r['mean_batch']:.1f}",
            f"{r['client_cpu']:.0%}",
        ]
        for c in concurrency
        for r in results
        if r["concurrency"] == c
    ]
    text = markdown_table(
        [
            "concurrency",
            "service",
            "requests",
            "errors",
            "requests/s",
            "texts/s",
            "p50 ms",
            "p95 ms",
            "p99 ms",
            "mean batch",
            "client CPU",
        ],
        rows,
    )
    ratios = []
    first = services[0].name
    for other in services[1:]:
        for c in concurrency:
            a, b = (
                next(r for r in results if r["service"] == name and r["concurrency"] == c)
                for name in (first, other.name)
            )
            qps = a["queries_per_s"] / b["queries_per_s"] if b["queries_per_s"] else None
            ratios.append(
                {
                    "concurrency": c,
                    "service": first,
                    "versus": other.name,
                    "queries_per_s_ratio": qps,
                    "p50_ratio": a["p50_ms"] / b["p50_ms"],
                    "p99_ratio": a["p99_ms"] / b["p99_ms"],
                }
            )
    if ratios:
        text += "\n\n" + markdown_table(
            ["concurrency", "services", "queries/s ratio", "p50 ratio", "p99 ratio"],
            [
                [
                    r["concurrency"],
                    f"{r['service']} ÷ {r['versus']}",
                    "n/a" if r["queries_per_s_ratio"] is None else f"{r['queries_per_s_ratio']:.2f}x",
                    f"{r['p50_ratio']:.2f}x",
                    f"{r['p99_ratio']:.2f}x",
                ]
                for r in ratios
            ],
        )
    return text, ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", action="append", default=[], metavar="NAME=URL", help="a running service")
    parser.add_argument(
        "--start",
        action="append",
        default=[],
        metavar="NAME=COMMAND",
        help="a command that serves on {port} (started, measured, then stopped with Ctrl-C)",
    )
    parser.add_argument(
        "--queries",
        type=Path,
        help="BEIR queries.jsonl(.gz) or a text file with one query per line (--peer --route rerank: the queries "
        "sent with the passages; default: the queries.jsonl(.gz) beside --passages)",
    )
    peer = parser.add_argument_group("--peer: densepass against another embedding server, started side by side")
    peer.add_argument("--peer", choices=("infinity",), default=None, help="the other server (infinity-emb)")
    peer.add_argument("--index", type=Path, help="--peer: the densepass index whose bi-encoder serves embeddings")
    peer.add_argument("--passages", type=Path, help="--peer: a BEIR corpus.jsonl(.gz) whose passages are sent")
    peer.add_argument(
        "--model-path", default=None, help="--peer: the model folder infinity loads (default: all-MiniLM-L6-v2's)"
    )
    peer.add_argument("--peer-python", default=None, help="--peer: the python of infinity-emb's environment")
    peer.add_argument(
        "--peer-command", default=None, help="--peer: the command before 'v2 ...' (default: infinity_emb)"
    )
    peer.add_argument(
        "--peer-engines", nargs="+", default=["torch"], choices=("torch", "optimum"), help="--peer: infinity engines"
    )
    peer.add_argument(
        "--peer-dtypes",
        nargs="+",
        default=["float32"],
        choices=("float32", "bfloat16"),
        help="--peer: infinity's --dtype, each with each engine (optimum ignores it: started once)",
    )
    peer.add_argument(
        "--peer-onnx", default=None, help="--peer-engines optimum: a folder with an ONNX export of the same model"
    )
    peer.add_argument(
        "--reranker", type=Path, default=None, help="--route rerank: the cross-encoder folder both servers load"
    )
    peer.add_argument(
        "--max-score-diff",
        type=float,
        default=0.02,
        help="--route rerank: largest difference between the servers' raw scores of a pair, as a share of the "
        "spread of the first server's scores over the sample",
    )
    peer.add_argument("--peer-batch-size", type=int, default=32, help="--peer: infinity's --batch-size (its default)")
    peer.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], help="--peer: densepass's --precision")
    peer.add_argument("--cores", default="0,1", help="--peer: taskset -c CPU list every server is pinned to")
    peer.add_argument("--threads", type=int, default=2, help="--peer: OMP/MKL/RAYON threads of every server")
    peer.add_argument("--rounds", type=int, default=3, help="--peer: rounds; each cell is the median over them")
    peer.add_argument("--max-tokens", type=int, default=128, help="--peer: longest passage sent, in tokens")
    peer.add_argument("--n-passages", type=int, default=5000, help="--peer: passages read and cycled")
    peer.add_argument("--check-texts", type=int, default=64, help="--peer: texts whose embeddings are compared")
    peer.add_argument("--min-cosine", type=float, default=0.999, help="--peer: least cosine between the servers")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--requests", type=int, default=2000, help="at most this many requests per level")
    parser.add_argument("--seconds", type=float, default=30.0, help="at most this long per level")
    parser.add_argument("--warmup", type=int, default=20, help="requests sent first to each service, not counted")
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument(
        "--route",
        default="search",
        help="the path requests go to: search (densepass), v1/embeddings (OpenAI's API; a peer's path, e.g. "
        "embeddings for infinity-emb), embed (TEI's); --peer: rerank (each server's /rerank), else embeddings",
    )
    parser.add_argument(
        "--texts-per-request",
        type=int,
        nargs="+",
        default=None,
        help="texts (queries) in each request (default 1; --peer: 1 32, and several values measure each)",
    )
    parser.add_argument("--model", default=None, help="the model name sent to an OpenAI route (default: none)")
    parser.add_argument(
        "--api-key", default=os.environ.get("DENSEPASS_API_KEY"), help="bearer token (default: $DENSEPASS_API_KEY)"
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="client processes the concurrent workers are spread over (when one is not enough)",
    )
    parser.add_argument(
        "--during",
        default=None,
        metavar="COMMAND",
        help="a shell command run while each level is measured ({url}: the service's), e.g. index updates and "
        "reloads; the level waits for it to end and records its exit status",
    )
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds one request may take")
    parser.add_argument("--startup-seconds", type=float, default=300.0, help="how long a started service may load")
    parser.add_argument("--out", type=output_with_table, default=None, help="JSON results")
    args = parser.parse_args()
    args.route = args.route.strip("/")
    args.texts_per_request = args.texts_per_request or ([1, 32] if args.peer else [1])
    if min(args.texts_per_request) < 1:
        parser.error("--texts-per-request must be at least 1")
    if args.peer:
        peer_main(parser, args)
        return
    if len(args.texts_per_request) > 1:
        parser.error("several --texts-per-request values are for --peer only")
    if args.route == "rerank":
        parser.error("--route rerank is for --peer (it sends queries with passages)")
    args.texts_per_request = args.texts_per_request[0]
    if args.queries is None:
        parser.error("--queries is required (without --peer)")
    if bool(args.url) == bool(args.start):
        parser.error("give the services either with --url or with --start")
    services = [Service(name, url=url.rstrip("/")) for name, url in (named(v, i) for i, v in enumerate(args.url, 1))]
    services += [Service(name, command=cmd) for name, cmd in (named(v, i) for i, v in enumerate(args.start, 1))]
    if len({s.name for s in services}) < len(services):
        parser.error("two services have the same name")
    queries = read_query_texts(args.queries)
    print(
        f"{len(queries):,} queries from {args.queries}; concurrency {args.concurrency}; at most {args.requests} "
        f"requests or {args.seconds:g}s per level; k={args.k}\n"
    )

    results = run(services, queries, args)
    text, ratios = tables(services, results, args.concurrency)
    print()
    print(text)
    write_json(
        args.out,
        {
            "benchmark": "serve",
            "date": datetime.date.today().isoformat(),
            "client": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
            f"python {platform.python_version()}, httpx {httpx.__version__}",
            "queries_file": str(args.queries),
            "n_queries": len(queries),
            "k": args.k,
            "route": args.route,
            "texts_per_request": args.texts_per_request,
            "requests_per_level": args.requests,
            "seconds_per_level": args.seconds,
            "services": [{"name": s.name, "url": s.url, "command": s.command, "health": s.health} for s in services],
            "results": results,
            "ratios": ratios,
        },
    )


def peer_main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--peer``: check the arguments (before starting anything), read the passages (and, ``--route rerank``, the
    queries), run, write the tables."""
    from serve_peer import MAX_QUERY_TOKENS, onnx_refusal, read_passages, reads_tokens, texts_within

    if args.url or args.start or args.during:
        parser.error("--peer starts its own servers: no --url, --start or --during with it")
    if args.route not in ("search", "embeddings", "v1/embeddings", "rerank"):
        parser.error(f"--peer --route {args.route}: embeddings or rerank")
    args.route = "rerank" if args.route == "rerank" else "embeddings"
    rerank = args.route == "rerank"
    if args.queries and not rerank:
        parser.error("--peer sends passages to the embedding routes: --queries is for --route rerank")
    if args.index is None or args.passages is None:
        parser.error("--peer needs --index (a densepass index of the model) and --passages (a BEIR corpus)")
    if not args.index.is_dir():
        parser.error(f"--index {args.index}: not a densepass index folder")
    if not args.passages.is_file():
        parser.error(f"--passages {args.passages}: no such file")
    if args.peer_python and not Path(args.peer_python).is_file():
        parser.error(f"--peer-python {args.peer_python}: no such file")
    if args.rounds < 1 or args.threads < 1 or args.check_texts < 1:
        parser.error("--rounds, --threads and --check-texts must be at least 1")
    if args.processes != 1:
        parser.error("--peer measures with one client process (its CPU use is reported)")
    if rerank:
        if args.reranker is None or not (args.reranker / "config.json").is_file():
            parser.error(f"--peer --route rerank needs --reranker, a saved cross-encoder folder (got {args.reranker})")
        if args.model_path is not None:
            parser.error("--route rerank: both servers load --reranker (no --model-path)")
        args.model_path = str(args.reranker)
        if args.queries is None:
            beside = [args.passages.parent / f"queries.jsonl{gz}" for gz in (".gz", "")]
            args.queries = next((path for path in beside if path.is_file()), None)
            if args.queries is None:
                parser.error(f"--route rerank: no queries.jsonl(.gz) beside {args.passages}: give --queries")
        elif not args.queries.is_file():
            parser.error(f"--queries {args.queries}: no such file")
    elif args.reranker is not None:
        parser.error("--reranker is for --route rerank")
    if "optimum" in args.peer_engines:
        refusal = onnx_refusal(args.peer_onnx, args.peer_python)
        if refusal:
            parser.error(refusal)
    elif args.peer_onnx:
        parser.error("--peer-onnx is for --peer-engines optimum")
    if args.model_path is None:
        from serve_peer import default_model_path

        args.model_path = default_model_path()
    args.rerank_queries = None
    if rerank:
        limit = reads_tokens(args.model_path)
        if limit is not None and MAX_QUERY_TOKENS + args.max_tokens - 1 > limit:
            parser.error(
                f"--max-tokens {args.max_tokens}: a pair of a {MAX_QUERY_TOKENS}-token query and such a passage is "
                f"longer than the {limit} tokens the cross-encoder reads"
            )
        first = read_query_texts(args.queries)[: args.n_passages]  # as many as passages are read, at most
        args.rerank_queries = texts_within(first, args.model_path, MAX_QUERY_TOKENS)
        if not args.rerank_queries:
            parser.error(f"--queries {args.queries}: no query of at most {MAX_QUERY_TOKENS} tokens")
    texts = read_passages(args.passages, args.model_path, args.max_tokens, args.n_passages)
    if len(texts) < args.check_texts:
        parser.error(f"--passages: only {len(texts)} passages of at most {args.max_tokens} tokens")
    onnx_cache = tempfile.mkdtemp(prefix="bench-serve-onnx-cache-") if "optimum" in args.peer_engines else None
    try:
        peer_run(args, texts, onnx_cache)
    finally:
        if onnx_cache:
            shutil.rmtree(onnx_cache, ignore_errors=True)


def peer_run(args: argparse.Namespace, texts: list[str], onnx_cache: str | None) -> None:
    """``--peer`` once the arguments are checked: start, measure and stop the servers, write the tables."""
    from serve_peer import peer_services, peer_tables, ratios, summarise

    services = peer_services(args, Service, onnx_cache)
    unit = "documents" if args.route == "rerank" else "texts"
    queries = f"{len(args.rerank_queries):,} queries from {args.queries}; " if args.rerank_queries else ""
    print(
        f"{len(texts):,} passages of at most {args.max_tokens} tokens from {args.passages}; {queries}"
        f"{unit} per request {args.texts_per_request}; clients {args.concurrency}; {args.rounds} rounds of at most "
        f"{args.requests} requests or {args.seconds:g}s per cell; servers pinned to cores {args.cores}, "
        f"{args.threads} threads each\n",
        flush=True,
    )
    from common import cpu_facts

    machine = cpu_facts()
    measured = run_peer(services, texts, args)
    summary = summarise(measured["results"])
    compared = ratios(summary)
    text = peer_tables(summary, compared, unit)
    print()
    print(text)
    if args.out:
        write_table(Path(args.out).with_suffix(".md"), text + "\n")
    write_json(
        args.out,
        {
            "benchmark": "serve-peer",
            "peer": args.peer,
            "route": args.route,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
            "machine": machine,
            "client": f"one process, asyncio + httpx {httpx.__version__}, python {platform.python_version()}, "
            "not pinned",
            "cores": args.cores,
            "threads": args.threads,
            "passages_file": str(args.passages),
            "n_passages": len(texts),
            "max_tokens": args.max_tokens,
            "model_path": args.model_path,
            "onnx_path": args.peer_onnx,
            "queries_file": str(args.queries) if args.rerank_queries else None,
            "n_queries": len(args.rerank_queries) if args.rerank_queries else None,
            "index": str(args.index),
            "texts_per_request": args.texts_per_request,
            "concurrency": args.concurrency,
            "rounds": args.rounds,
            "requests_per_cell": args.requests,
            "seconds_per_cell": args.seconds,
            "services": [
                {"name": s.name, "command": s.command, "cwd": s.cwd, "env": s.env, "health": s.health} for s in services
            ],
            "agreement": measured["agreement"],
            "summary": summary,
            "ratios": compared,
            "results": measured["results"],
        },
    )


if __name__ == "__main__":
    main()
