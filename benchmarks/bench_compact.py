r"""Compact embeddings side by side (issue 53): for each model, MRR@10 and nDCG@10 at each prefix dimension (Matryoshka,
``--dims``) in fp32, int8 and binary, each with and without re-scoring (``index.binary.CompactIndex``), against
sentence-transformers' ``quantize_embeddings`` + rescoring recipe (ubinary and uint8 through
``semantic_search_faiss``; int8 through ``semantic_search_usearch`` where usearch installs) on the same embeddings;
the bytes per passage each holds in RAM, and the median / p99 latency of one query's search
(its embedding given: encoding is the same for every row). With two models, a paired randomization test
(``evaluation.metrics.randomization_p``) of the first against each other at each dimension, fp32.
``--principal-axes`` adds, for each model without a projection, the same model rotated to its principal axes after
the fact (``LABEL+pca``: what ``train.matryoshka_init: pca`` starts from), so a Matryoshka model can be set against
PCA of a model trained without it.

The corpus and the queries are encoded once per model at its full dimension (``--encode-precision``: fp32 by default;
bf16 is about 2.5x faster on a CPU with bf16 kernels, at cosine 0.9999 to fp32); each dimension cuts them
(``models.matryoshka.truncate``) as ``densepass index --dim`` does. Everything else runs on those embeddings.

    # a smoke run: 200 dev queries over their gold passages + 2,000 others
    python3 benchmarks/bench_compact.py --model zero-shot=all-MiniLM-L6-v2 --max-queries 200 --max-passages 2000 \
        --out outputs/compact/smoke.json
    # the issue's measurement: MiniLM fine-tuned with and without Matryoshka (configs/matryoshka.yaml), every dev
    # query over the full corpus (60,240 passages)
    python3 benchmarks/bench_compact.py --model mrl=outputs/matryoshka/model \
        --model base=outputs/matryoshka-base/model --out outputs/compact/full.json

``--synthetic N`` measures size instead of quality: N random unit vectors of the first model's dimension, indexed as
float32 FAISS HNSW and as binary HNSW and binary flat (a Hamming scan of every passage's bits), both re-scored with
float32 embeddings memory-mapped from the saved index; bytes
per passage in RAM, one-query latency and recall@10 against exact search of 1,000 random queries.

    python3 benchmarks/bench_compact.py --synthetic 1000000 --out outputs/compact/synthetic-1m.json
"""

from __future__ import annotations

import argparse
import importlib.util
import shutil
import time
import warnings

import numpy as np
import torch

from common import environment, markdown_table, output_with_table, pick_device, write_json, write_table
from densepass.config import DataConfig
from densepass.data import load_dataset
from densepass.evaluation.metrics import evaluate_run, per_query_scores, randomization_p
from densepass.index.binary import CompactIndex
from densepass.index.exact import exact_search
from densepass.models.biencoder import BiEncoder
from densepass.models.matryoshka import principal_rotation, truncate
from densepass.pipelines.evalset import EvalSet, build_eval_set
from densepass.pipelines.training import PCA_PASSAGES

METRICS = ["mrr@10", "ndcg@10"]
HAS_USEARCH = importlib.util.find_spec("usearch") is not None  # sentence-transformers' int8 path (pip install usearch)
DEPTH = 10


def restricted(evalset: EvalSet, max_passages: int | None, seed: int) -> EvalSet:
    """``evalset`` over its queries' gold passages plus ``max_passages`` seeded random others (a smoke run's
    corpus); the full corpus when None."""
    if max_passages is None:
        return evalset
    corpus = evalset.corpus
    gold = {corpus.position(p) for judged in evalset.qrels.values() for p in judged if p in corpus}
    rest = np.setdiff1d(np.arange(len(corpus)), np.fromiter(gold, dtype=np.int64))
    picked = np.random.default_rng(seed).choice(rest, size=min(max_passages, len(rest)), replace=False)
    keep = sorted(gold | {int(r) for r in picked})
    sub = corpus.subset(keep)
    return EvalSet(
        evalset.query_ids,
        evalset.query_texts,
        evalset.qrels,
        sub,
        f"{len(evalset.query_ids)} queries, {len(sub)} passages",
        evalset.answers,
    )


def as_run(evalset: EvalSet, scores: np.ndarray, rows: np.ndarray) -> dict[str, dict[str, float]]:
    """``{query id: {passage id: score}}`` of top-k rows (-1: none)."""
    ids = evalset.corpus.ids
    return {
        qid: {ids[r]: float(s) for s, r in zip(srow, rrow) if r >= 0}
        for qid, srow, rrow in zip(evalset.query_ids, scores.tolist(), rows.tolist())
    }


def latency_ms(search, queries: np.ndarray, n: int) -> tuple[float, float]:
    """Median and p99 milliseconds of ``search`` of one query at a time, over the first ``n`` queries."""
    times = []
    for q in queries[:n]:
        started = time.perf_counter()
        search(q[None, :])
        times.append((time.perf_counter() - started) * 1000)
    return float(np.median(times)), float(np.percentile(times, 99))


def sentence_transformers_recipe(precision: str, passages: np.ndarray, queries: np.ndarray, multiplier: int):
    """sentence-transformers' recipe: ``quantize_embeddings`` of the corpus (ubinary, or uint8 with ranges from the
    corpus), an exact FAISS index, ``semantic_search_faiss`` with rescoring by the float queries; returns
    (scores, rows) and a one-query search function.

    uint8 is used as their FAISS benchmark does (examples/.../embedding-quantization/semantic_search_faiss_benchmark.py:
    the corpus quantised with the corpus as calibration; ``ranges`` here gives the same codes). Its first pass is
    weak by construction, increasingly so as the dimension falls: ``semantic_search_faiss`` puts the uint8 codes,
    ``floor((x - min) / step)`` in 0..255 with no centring (util/quantization.py, ``quantize_embeddings``), into a
    float ``IndexFlatIP`` and searches it with the query's uint8 codes, so candidates are ranked by
    ``(q - min) . p`` (each dimension weighted by ``1 / step^2``): the query plus one fixed vector ``-min``, every
    dimension's corpus minimum, which outweighs it and is the same for every query; its share of the passages'
    spread grows as fewer dimensions are kept. Re-scoring only reorders those ``top_k x rescore_multiplier``
    candidates. Their int8 codes (centred) have no such offset: ``int8`` runs their recommended scalar path,
    ``semantic_search_usearch`` (usearch's int8 HNSW index, inner product, then the same re-scoring; bytes per
    passage include its graph), where usearch installs. densepass's int8 scores the float query against decoded
    codes."""
    from sentence_transformers.util.quantization import (
        quantize_embeddings,
        semantic_search_faiss,
        semantic_search_usearch,
    )

    ranges = np.stack([passages.min(0), passages.max(0)]) if precision in ("uint8", "int8") else None
    corpus = quantize_embeddings(passages, precision, ranges=ranges)
    engine = semantic_search_usearch if precision == "int8" else semantic_search_faiss  # int8: their usearch path

    def search(q: np.ndarray, index=None):
        options = {"corpus_index": index} if index is not None else {"corpus_embeddings": corpus}
        hits, _, built = engine(
            q,
            corpus_precision=precision,
            top_k=DEPTH,
            ranges=ranges,
            rescore_multiplier=multiplier,
            output_index=True,
            **options,
        )
        return hits, built

    hits, index = search(queries)
    scores = np.full((len(queries), DEPTH), -np.inf, dtype=np.float32)
    rows = np.full((len(queries), DEPTH), -1, dtype=np.int64)
    for i, row in enumerate(hits):
        for j, hit in enumerate(row):
            scores[i, j], rows[i, j] = hit["score"], hit["corpus_id"]
    held = index.memory_usage if precision == "int8" else corpus.nbytes  # usearch's HNSW graph included
    return (scores, rows), lambda q: search(q, index), held / len(passages)


def synthetic(model: BiEncoder, args: argparse.Namespace) -> None:
    """Float32 HNSW against binary HNSW and binary flat, each + float re-scoring from disk, on ``args.synthetic``
    random unit vectors."""
    import tempfile

    import faiss

    from densepass.index import load_index
    from densepass.index.dense import DenseIndex

    rng = np.random.default_rng(args.seed)
    n, dim = args.synthetic, model.dim
    passages = rng.standard_normal((n, dim), dtype=np.float32)
    passages /= np.linalg.norm(passages, axis=1, keepdims=True)
    queries = rng.standard_normal((1000, dim), dtype=np.float32)
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    truth = exact_search(queries, passages, DEPTH)[1]
    texts = [str(i) for i in range(n)]
    rows = []
    with tempfile.TemporaryDirectory(dir=".") as work:
        for name, index in [
            ("float32 HNSW", DenseIndex(model, "faiss-hnsw", show_progress=False)),
            ("binary HNSW + float re-scoring", CompactIndex(model, "binary-hnsw", show_progress=False)),
            ("binary flat + float re-scoring", CompactIndex(model, "binary-flat", show_progress=False)),
        ]:
            started = time.perf_counter()
            index.add_embeddings(texts, passages)
            built = time.perf_counter() - started
            index.save(f"{work}/index")
            loaded = load_index(f"{work}/index", model=model)  # the re-scoring embeddings memory-mapped
            compact = isinstance(loaded, CompactIndex)
            in_ram = loaded.memory_bytes() if compact else int(faiss.serialize_index(loaded.faiss).nbytes)
            found = loaded.search_rows(queries, DEPTH)[1]
            recall = float(np.mean([len(set(a) & set(b)) / DEPTH for a, b in zip(found, truth)]))
            median, p99 = latency_ms(lambda x, i=loaded: i.search_rows(x, DEPTH), queries, args.latency_queries)
            rows.append({"index": name, "bytes_per_passage": in_ram / n, "recall@10": recall, "build_s": built,
                         "latency_ms_median": median, "latency_ms_p99": p99})  # fmt: skip
            shutil.rmtree(f"{work}/index")
    table = markdown_table(
        ["index", "bytes / passage (RAM)", "recall@10 vs exact", "build s", "latency ms (median)", "p99"],
        [[r["index"], f"{r['bytes_per_passage']:.1f}", f"{r['recall@10']:.4f}", f"{r['build_s']:.0f}",
          f"{r['latency_ms_median']:.2f}", f"{r['latency_ms_p99']:.2f}"] for r in rows],
    )  # fmt: skip
    print(f"{n:,} random unit vectors of {dim} dimensions\n{table}")
    write_json(args.out, {"environment": environment(torch.device("cpu")), "passages": n, "dim": dim, "rows": rows})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", action="append", default=None, help="LABEL=PATH of a bi-encoder (repeat; the first is compared)"
    )
    parser.add_argument("--dataset", default="debian-packages")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--split", default="dev")
    parser.add_argument("--max-queries", type=int, default=None, help="a seeded sample of the split's queries")
    parser.add_argument("--max-passages", type=int, default=None, help="the gold passages + this many others")
    parser.add_argument("--dims", type=int, nargs="+", default=[384, 256, 128, 64])
    parser.add_argument("--rescore-multiplier", type=int, default=4, help="candidates re-scored per query, x k")
    parser.add_argument("--latency-queries", type=int, default=200, help="queries timed one at a time")
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--device", default=None)
    parser.add_argument(
        "--encode-precision",
        default="fp32",
        choices=("fp32", "bf16", "auto"),
        help="precision the corpus and queries are encoded in (every row's index is built from those embeddings)",
    )
    parser.add_argument(
        "--principal-axes",
        action="store_true",
        help="also measure each model trained without train.matryoshka_init=pca rotated to its principal axes after"
        " the fact (PCA of a seeded sample of its passage embeddings, as that option does before training): LABEL+pca",
    )
    parser.add_argument(
        "--out", type=output_with_table, default=None, help="JSON results (the markdown table goes beside it, .md)"
    )
    parser.add_argument("--synthetic", type=int, default=None, help="N random vectors: memory and latency only")
    args = parser.parse_args()
    models = [m.split("=", 1) if "=" in m else (m, m) for m in (args.model or ["zero-shot=all-MiniLM-L6-v2"])]
    device = pick_device(args.device)
    if args.synthetic:
        synthetic(BiEncoder.from_pretrained(models[0][1]), args)
        return

    dataset = load_dataset(args.dataset, args.data_dir)
    data = DataConfig(eval_split=args.split, max_eval_queries=args.max_queries, seed=args.seed)
    evalset = restricted(build_eval_set(dataset, data, None), args.max_passages, args.seed)
    print(f"{args.dataset} {args.split}: {evalset.description}; {torch.get_num_threads()} threads")

    rows_out, runs, results = [], {}, []

    def record(where: dict, system: str, scores: np.ndarray, rows: np.ndarray, per_passage: float, search) -> None:
        """One row of the table: quality of (scores, rows), bytes per passage, one-query latency of ``search``."""
        run = as_run(evalset, scores, rows)
        runs[(where["model"], where["dim"], system)] = run
        median, p99 = latency_ms(search, where["queries"], args.latency_queries)
        metrics = evaluate_run(evalset.qrels, run, METRICS)
        result = {"model": where["model"], "dim": where["dim"], "system": system, "bytes_per_passage": per_passage}
        results.append({**result, **metrics, "latency_ms_median": median, "latency_ms_p99": p99})
        rows_out.append(
            [where["model"], where["dim"], system, f"{per_passage:g}"]
            + [f"{metrics[m]:.4f}" for m in METRICS]
            + [f"{median:.2f}", f"{p99:.2f}"]
        )

    def measure(model: BiEncoder, label: str, passages: np.ndarray, queries: np.ndarray) -> None:
        """Every row of one model's embeddings: each dimension, precision and re-scoring."""
        for dim in args.dims:
            if dim > model.dim:
                continue
            p, q = truncate(passages, dim, model.config.normalize), truncate(queries, dim, model.config.normalize)
            where = {"model": label, "dim": dim, "queries": q}

            exact = lambda x, p=p: exact_search(x, p, DEPTH, device=device)  # noqa: E731
            record(where, "fp32 (exact)", *exact(q), 4.0 * dim, exact)
            for kind, rescores in [("int8-flat", ["none", "float"]), ("binary-flat", ["none", "int8", "float"])]:
                if kind == "binary-flat" and dim % 8:
                    continue
                with warnings.catch_warnings():  # a dimension the model was not trained at: measured anyway
                    warnings.simplefilter("ignore")
                    index = CompactIndex(model, kind, dim=dim, show_progress=False, device=device)
                index.add_embeddings(evalset.corpus, passages)
                per_passage = index.memory_bytes() / len(p)
                for rescore in rescores:
                    index.rescore_with, index.rescore_multiplier = rescore, args.rescore_multiplier
                    name = f"{kind.split('-')[0]} + {rescore} re-scoring" if rescore != "none" else kind.split("-")[0]
                    search = lambda x, index=index: index.search_rows(x, DEPTH)  # noqa: E731
                    record(where, name, *search(q), per_passage, search)
            for precision in ("ubinary", "uint8", "int8"):
                if precision == "ubinary" and dim % 8 or precision == "int8" and not HAS_USEARCH:
                    continue
                found, search, per_passage = sentence_transformers_recipe(precision, p, q, args.rescore_multiplier)
                record(where, f"sentence-transformers {precision} + rescore", *found, per_passage, search)

    labels = []  # every measured model, rotated ones included, in order
    for label, path in models:
        model = BiEncoder.from_pretrained(path)
        options = {"batch_size": args.batch_size, "device": device, "precision": args.encode_precision}
        started = time.perf_counter()
        passages = model.encode_passages(evalset.corpus, **options)  # with the model's prompts, as an index does
        queries = model.encode_queries(evalset.query_texts, **options)
        print(
            f"{label}: encoded ({args.encode_precision}) in {time.perf_counter() - started:.0f} s; "
            f"trained dims {model.config.matryoshka_dims}"
        )
        variants = [(label, passages, queries)]
        if args.principal_axes and model.projection is None:  # a rotated model has its projection (2_Dense)
            rows = np.random.default_rng(args.seed).choice(len(passages), min(PCA_PASSAGES, len(passages)), False)
            rotation = principal_rotation(passages[np.sort(rows)]).astype(np.float32)
            variants.append((f"{label}+pca", passages @ rotation.T, queries @ rotation.T))
        for name, embedded, asked in variants:
            measure(model, name, embedded, asked)
            labels.append(name)

    paired = []  # the first model against each other one, at each dimension
    first = labels[0]
    for second in labels[1:]:
        for dim in args.dims:
            a, b = runs.get((first, dim, "fp32 (exact)")), runs.get((second, dim, "fp32 (exact)"))
            if a is None or b is None:
                continue
            sa, sb = per_query_scores(evalset.qrels, a, "mrr@10"), per_query_scores(evalset.qrels, b, "mrr@10")
            p_value = randomization_p(sa, sb)
            paired.append(
                {"dim": dim, "a": first, "b": second, "delta_mrr@10": float(sa.mean() - sb.mean()), "p": p_value}
            )

    headers = ["model", "dim", "system", "bytes / passage (RAM)", *METRICS, "latency ms (median)", "p99"]
    table = markdown_table(headers, rows_out)
    print(table)
    for test in paired:
        print(f"{test['a']} - {test['b']} at {test['dim']}: MRR@10 {test['delta_mrr@10']:+.4f}, p = {test['p']:.4f}")
    payload = {
        "environment": environment(device),
        "dataset": args.dataset,
        "evalset": evalset.description,
        "rescore_multiplier": args.rescore_multiplier,
        "encode_precision": args.encode_precision,
        "results": results,
        "paired": paired,
    }
    write_json(args.out, payload)
    if args.out:
        from pathlib import Path

        write_table(Path(args.out).with_suffix(".md"), table + "\n")


if __name__ == "__main__":
    main()
