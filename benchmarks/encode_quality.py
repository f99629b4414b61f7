r"""Quality of the encoding precisions (``models.encode``: fp32, bf16, int8): each precision's mean cosine to the
fp32 embeddings (passages and queries) and its retrieval metrics, with the difference to fp32, on the same
queries and corpus. The issue's bar: mean cosine >= 0.99 and MRR@10 within 0.005 of fp32.

A saved SPLADE or ColBERT ``--model`` (fp32 and bf16; they run no int8) is measured through its own index, built
in each precision (``pipelines.retrievers.index_for_model``: the SPLADE inverted index, the ColBERT fp16 index with
centroid pruning); the cosines are those of the passages' term-weight vectors (SPLADE) or of their token vectors
(ColBERT, as the index stores them in fp16), and of the queries' likewise.

    python benchmarks/encode_quality.py --model outputs/sl/sl-splade/model --precisions fp32 bf16 \
        --max-queries 1000 --subcorpus --hard-k 20 --random 10000 --out outputs/quality/splade-sub.json

    # a seeded sample of dev queries in a subcorpus (their gold passages + BM25 top-k + random passages)
    python benchmarks/encode_quality.py --max-queries 1000 --subcorpus --hard-k 20 --random 10000 \
        --out outputs/quality/encode-sub.json
    # every dev query in the full corpus (60,240 passages: ~14 minutes of fp32 MiniLM per precision on 2 cores)
    python benchmarks/encode_quality.py --out outputs/quality/encode-full.json

``--precisions int8-token int8-token-ffn-out-float int8-token-range`` (bi-encoders) simulate in float32 what int8
products with a scale per token would keep (``SIMULATED``): how an int8 kernel should quantise, measured before it
is written. ``int8`` itself is densepass's: on a CPU with its kernels, the fused layers on int8 products.

Timings are printed for orientation only (measure speed with bench_encode.py on a quiet machine). bf16 is
slower than fp32 on a CPU without fast bf16 (AMX, or AVX512-BF16 on AMD: ``device.cpu_has_fast_bf16``).
"""

from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch

from common import markdown_table, output_with_table, pick_device, write_json, write_table
from densepass.config import DataConfig
from densepass.data import load_dataset
from densepass.device import resolve_precision
from densepass.evaluation.metrics import evaluate_run, per_query_scores, randomization_p
from densepass.index.bm25 import BM25Index
from densepass.index.exact import exact_search
from densepass.models.biencoder import BiEncoder, resolve_model_path
from densepass.models.copies import float_precision
from densepass.models.encode import encode_texts
from densepass.models.kinds import model_kind
from densepass.models.load import load_model
from densepass.models.splade import SpladeEncoder
from densepass.pipelines.evalset import build_eval_set
from densepass.pipelines.retrievers import index_for_model

METRICS = ["mrr@10", "ndcg@10", "recall@100"]


def row_cosines(a: np.ndarray | sp.spmatrix, b: np.ndarray | sp.spmatrix) -> np.ndarray:
    """Cosine of each row of ``a`` with the same row of ``b`` (dense or sparse)."""
    if sp.issparse(a):
        dots = np.asarray(a.multiply(b).sum(axis=1)).ravel()
        norms = np.sqrt(np.asarray(a.multiply(a).sum(axis=1)).ravel() * np.asarray(b.multiply(b).sum(axis=1)).ravel())
    else:
        dots, norms = np.sum(a * b, 1), np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)
    return dots / np.maximum(norms, 1e-30)


def _symmetric(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` rounded to 255 levels, symmetric, with one scale per slice along ``dim`` (max |x| / 127)."""
    scale = x.abs().amax(dim=dim, keepdim=True).clamp_min(1e-12) / 127
    return torch.round(x / scale).clamp_(-127, 127) * scale


def _over_range(x: torch.Tensor, dim: int) -> torch.Tensor:
    """``x`` rounded to 256 levels over each slice's range along ``dim`` (its minimum, (max - min) / 255)."""
    low = x.amin(dim=dim, keepdim=True)
    scale = (x.amax(dim=dim, keepdim=True) - low).clamp_min(1e-12) / 255
    return torch.round((x - low) / scale).clamp_(0, 255) * scale + low


SIMULATED = {
    "int8-token": (_symmetric, ()),
    "int8-token-ffn-out-float": (_symmetric, ("output.dense",)),
    "int8-token-range": (_over_range, ()),
}
"""``--precisions`` names that simulate int8 products in float32 (``int8_products``): each linear layer's input
rounded to int8 per token (row), its weight with a symmetric scale per output channel, the product of the integers
rescaled, the bias added. ``int8-token``: a symmetric scale per token (max |x| / 127); ``int8-token-ffn-out-float``
the same, the feed-forward output product (whose input is GELU's) left in float32; ``int8-token-range``: each token
over its own range (minimum and (max - min) / 255), what densepass's ``int8`` computes on its CPU kernels
(``cpu_kernels.Int8Linear``) but in float32 throughout."""


@contextlib.contextmanager
def int8_products(model: torch.nn.Module, rounding, keep: tuple[str, ...]):
    """``SIMULATED``: ``model``'s linear layers (but those whose names end in ``keep``) compute int8 products, their
    inputs rounded per token by ``rounding`` and their weights per output channel (symmetric), in float32, while
    the context lasts."""
    originals = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and not name.endswith(keep):
            weight = _symmetric(module.weight.detach(), dim=1)
            originals[module] = module.forward
            module.forward = lambda x, m=module, w=weight: torch.nn.functional.linear(rounding(x, -1), w, m.bias)
    try:
        yield
    finally:
        for module, forward in originals.items():
            module.forward = forward


def encoded_run(model, evalset, precision: str, batch_size: int, device: torch.device):
    """The top-100 run of ``evalset``'s queries with ``model`` encoding in ``precision``, and the passages' and
    queries' representations (rows to compare across precisions)."""
    queries = evalset.query_texts
    if not isinstance(model, BiEncoder):
        index = index_for_model(model, evalset.corpus, batch_size=batch_size, device=device, precision=precision)
        run = index.search(queries, 100).as_run(evalset.query_ids)
        if isinstance(model, SpladeEncoder):
            return run, index.postings.T.tocsr(), index.encode_queries(queries)
        return run, index.vectors.astype(np.float32), index.encode_queries(queries).reshape(-1, model.dim)
    simulated = int8_products(model, *SIMULATED[precision]) if precision in SIMULATED else contextlib.nullcontext()
    precision = "fp32" if precision in SIMULATED else precision
    options = {"batch_size": batch_size, "device": device, "precision": precision, "show_progress": False}
    with simulated:
        p = encode_texts(model, evalset.corpus.passage_inputs(model.tokenizer.sep_token or " "), "passage", **options)
        q = encode_texts(model, queries, "query", **options)
    scores, rows = exact_search(q, p, 100, device=device)
    ids = evalset.corpus.ids
    run = {
        qid: {ids[r]: float(s) for s, r in zip(row_s, row_r)}
        for qid, row_s, row_r in zip(evalset.query_ids, scores.tolist(), rows.tolist())
    }
    return run, p, q


def paired(scores: np.ndarray, fp32: np.ndarray) -> dict:
    """A precision's per-query MRR@10 against fp32's on the same queries: the 95% confidence interval of the mean
    difference (normal approximation of the paired differences) and the two-sided p of Fisher's randomization test
    (``evaluation.metrics.randomization_p``)."""
    differences = scores - fp32
    half = 1.96 * differences.std(ddof=1) / np.sqrt(len(differences)) if len(differences) > 1 else 0.0
    mean = float(differences.mean())
    return {"mrr@10_ci95": [mean - half, mean + half], "mrr@10_p": randomization_p(scores, fp32)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="all-MiniLM-L6-v2")
    parser.add_argument("--dataset", default="debian-packages")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--split", default="dev")
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16", "int8"], help="fp32 always runs first")
    parser.add_argument("--max-queries", type=int, default=None, help="a seeded sample of the split's queries")
    parser.add_argument("--subcorpus", action="store_true", help="search a subcorpus instead of the full corpus")
    parser.add_argument("--hard-k", type=int, default=20, help="subcorpus: each query's BM25 top-k")
    parser.add_argument("--random", type=int, default=10_000, help="subcorpus: this many random passages")
    parser.add_argument("--seed", type=int, default=13, help="seed of the query sample and the random passages")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--device", default=None)
    parser.add_argument(
        "--out", type=output_with_table, default=None, help="JSON results (the markdown table goes beside it, .md)"
    )
    args = parser.parse_args()
    device = pick_device(args.device)
    precisions = ["fp32", *(p for p in args.precisions if p != "fp32")]
    kind = model_kind(resolve_model_path(args.model)) or "bi-encoder"
    for precision in precisions:  # a bad name, int8 on a GPU or for SPLADE / ColBERT fails before any work
        if kind == "bi-encoder":
            resolve_precision(precision if precision not in SIMULATED else "fp32", device)
        else:
            float_precision(precision, device, kind)

    dataset = load_dataset(args.dataset, args.data_dir)
    data = DataConfig(
        eval_split=args.split,
        max_eval_queries=args.max_queries,
        eval_subcorpus=args.subcorpus,
        eval_hard_k=args.hard_k if args.subcorpus else 0,
        eval_random=args.random if args.subcorpus else 0,
        seed=args.seed,
    )
    bm25 = BM25Index.build(dataset.corpus.passage_inputs(" ")) if data.eval_hard_k else None
    evalset = build_eval_set(dataset, data, bm25)
    model = load_model(resolve_model_path(args.model))
    print(f"{args.model} on {args.dataset}: {evalset.description}; device {device}, {torch.get_num_threads()} threads")

    reference, results, fp32_scores = {}, [], None
    for precision in precisions:
        started = time.perf_counter()
        run, p, q = encoded_run(model, evalset, precision, args.batch_size, device)
        seconds = time.perf_counter() - started
        reference = reference or {"p": p, "q": q}
        metrics = evaluate_run(evalset.qrels, run, METRICS)
        passage_cos, query_cos = row_cosines(p, reference["p"]), row_cosines(q, reference["q"])
        scores = per_query_scores(evalset.qrels, run, "mrr@10")
        fp32_scores = scores if fp32_scores is None else fp32_scores
        results.append(
            {
                "precision": precision,
                "passage_cosine_mean": float(passage_cos.mean()),
                "passage_cosine_min": float(passage_cos.min()),
                "query_cosine_mean": float(query_cos.mean()),
                "index_s": seconds,
                **metrics,
                **paired(scores, fp32_scores),
            }
        )
        print(f"  {precision}: {metrics}, passage cosine {passage_cos.mean():.5f}, {seconds:.0f}s", flush=True)

    fp32 = results[0]
    rows = [
        [
            r["precision"],
            f"{r['passage_cosine_mean']:.5f}",
            f"{r['passage_cosine_min']:.4f}",
            f"{r['query_cosine_mean']:.5f}",
            *(f"{r[m]:.4f}" for m in METRICS),
            f"{r['mrr@10'] - fp32['mrr@10']:+.4f}",
            f"[{r['mrr@10_ci95'][0]:+.4f}, {r['mrr@10_ci95'][1]:+.4f}]",
            f"{r['mrr@10_p']:.3f}",
            f"{r['index_s']:.0f}",
        ]
        for r in results
    ]
    headers = [
        "precision",
        "passage cos (mean)",
        "(min)",
        "query cos",
        *METRICS,
        "Δ MRR@10",
        "95% CI",
        "p",
        "encode + search s",
    ]
    table = markdown_table(headers, rows)
    print(f"\n{evalset.description}\n\n{table}")
    payload = {
        "benchmark": "encode_quality",
        "model": args.model,
        "kind": kind,
        "dataset": args.dataset,
        "evaluation_set": evalset.description,
        "device": str(device),
        "threads": torch.get_num_threads(),
        "results": results,
    }
    write_json(args.out, payload)
    if args.out:
        write_table(Path(args.out).with_suffix(".md"), f"{evalset.description}\n\n{table}\n")


if __name__ == "__main__":
    main()
