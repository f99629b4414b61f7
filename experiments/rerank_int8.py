"""How close int8 cross-encoder scores are to fp32 ones, and which linear layers to leave in float32.

    python experiments/rerank_int8.py --cross-encoder PATH --queries 100 --depth 20 --out outputs/rerank-int8/trained
    python experiments/rerank_int8.py --queries 40 --depth 20 --out outputs/rerank-int8/new-head   # MiniLM + new head

Reranks a seeded sample of dev queries' candidates (each query's positives, up to 3, then BM25's top passages,
``--depth`` in all, as ``eval.mode: rerank`` does) with the cross-encoder in fp32 and in two int8 variants
(``models.quantize``): every linear layer quantised, and every one but the feed-forward output projections
(what ``CrossEncoder`` runs where densepass's CPU kernels do not); where they do, also ``precision="int8"`` as it
runs there (``models.fused``'s int8 layers, each token quantised over its own range). Per variant: the agreement
with fp32 (``evaluation.agreement``) and MRR@10 against fp32's, with the paired randomization test
(``evaluation.metrics.paired_significance``). Writes ``int8.json`` and ``int8.md`` into ``--out``. A quality
experiment: the seconds it prints are not benchmarks.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from densepass.data import load_dataset
from densepass.evaluation.agreement import score_agreement
from densepass.evaluation.metrics import evaluate_run, paired_significance
from densepass.index.bm25 import BM25Index
from densepass.io import atomic_write_text
from densepass.models.cross_encoder import PASSAGE_SEP, CrossEncoder
from densepass.models.quantize import feed_forward_output, quantized_linear_copy

VARIANTS = {
    "int8, every linear layer": lambda name: False,
    "int8, feed-forward outputs in fp32 (shipped without the kernels)": feed_forward_output,
}
FUSED = "int8, a scale and an offset per token (shipped with the kernels)"  # ``CrossEncoder.int8_fuses``


def candidates(dataset, query_ids: list[str], depth: int) -> list[list[int]]:
    """Per query, corpus rows: its dev positives (up to 3), then BM25's top passages, ``depth`` in all."""
    bm25 = BM25Index.build(dataset.corpus)
    _, rows = bm25.search_rows([dataset.queries[q] for q in query_ids], depth)
    positives = dataset.positives("dev")
    out = []
    for q, found in zip(query_ids, rows):
        first = [dataset.corpus.position(p) for p in positives[q][:3]]
        out.append(list(dict.fromkeys([*first, *map(int, found)]))[:depth])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cross-encoder", default=None, help="a trained cross-encoder (default: MiniLM + a new head)")
    parser.add_argument("--dataset", default="debian-packages")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--queries", type=int, default=100, help="dev queries (a seeded sample)")
    parser.add_argument("--depth", type=int, default=20, help="candidates per query")
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--out", required=True, help="output folder")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    dataset = load_dataset(args.dataset, args.data_dir)
    query_ids = sorted(dataset.sample("dev", args.queries, 13))
    rows = candidates(dataset, query_ids, args.depth)
    texts = dataset.corpus.passage_inputs(PASSAGE_SEP)
    queries = [dataset.queries[q] for q, found in zip(query_ids, rows) for _ in found]
    passages = [texts[r] for found in rows for r in found]
    options = {"max_length": args.max_length, "device": torch.device("cpu"), "precision": "fp32"}
    if args.cross_encoder:
        scorer = CrossEncoder.from_pretrained(args.cross_encoder, **options)
    else:
        scorer = CrossEncoder.new("all-MiniLM-L6-v2", seed=13, **options)
    scores = {"fp32": scorer.score_pairs(queries, passages)}
    fp32_model = scorer.model
    for name, keep_float in VARIANTS.items():
        scorer.model = quantized_linear_copy(fp32_model, keep_float)
        scores[name] = scorer.score_pairs(queries, passages)
        print(f"{name}: {time.perf_counter() - started:.0f}s", flush=True)
    scorer.model = fp32_model
    if scorer.int8_fuses():
        scores[FUSED] = scorer.score_pairs(queries, passages, precision="int8")
        print(f"{FUSED}: {time.perf_counter() - started:.0f}s", flush=True)

    ids = dataset.corpus.ids
    qrels = {q: dataset.split("dev")[q] for q in query_ids}
    runs = {}
    for name, values in scores.items():
        runs[name] = {q: {} for q in query_ids}
        for (q, r), value in zip(((q, r) for q, found in zip(query_ids, rows) for r in found), values.tolist()):
            runs[name][q][ids[r]] = value
    tests = paired_significance(qrels, runs, "fp32", "mrr@10")
    results = {
        name: {
            "mrr@10": evaluate_run(qrels, runs[name], ["mrr@10"])["mrr@10"],
            **({} if name == "fp32" else score_agreement(values, scores["fp32"], args.depth)),
            **({} if name == "fp32" else {"mrr@10_p": tests[name]["p"]}),
        }
        for name, values in scores.items()
    }
    columns = ["mrr@10", "mrr@10_p", "mean_abs_difference", "reference_std", "spearman", "mean_query_spearman"]
    columns += [f"top{min(10, args.depth)}_order_unchanged", "top1_unchanged"]
    lines = ["| scores | " + " | ".join(columns) + " |", "|---|" + "---:|" * len(columns)]
    for name, values in results.items():
        lines.append(f"| {name} | " + " | ".join(f"{values[c]:.4g}" if c in values else "" for c in columns) + " |")
    table = "\n".join(lines)
    seconds = time.perf_counter() - started
    print(f"\n{len(queries):,} pairs ({len(query_ids)} queries x {args.depth}), {seconds:.0f}s\n{table}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload = {"settings": {k: v for k, v in vars(args).items() if k != "out"}, "seconds": seconds, "results": results}
    atomic_write_text(out / "int8.json", json.dumps(payload, indent=1))
    atomic_write_text(out / "int8.md", table + "\n")


if __name__ == "__main__":
    main()
