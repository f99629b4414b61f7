r"""Hard-negative mining speed: densepass BM25 and dense mining of debian-packages train queries, and
sentence-transformers' ``util.mine_hard_negatives`` on the same model, queries and corpus.

    python benchmarks/bench_mine.py --n 200 --corpus-n 3000                  # CPU (2 cores: ~2 min)
    python benchmarks/bench_mine.py --model .carry/minilm-l6-fp16 --data-dir .carry/data \
        --out outputs/bench_mine.json                                            # H100: all queries, full corpus

Same work on both sides: top-``--depth`` negatives per query from ranks [0, depth + margin) of an
exact search over the same passage strings (``title [SEP] text``), the positive removed, the same
max sequence length and dtype (bf16 on GPU, fp32 on CPU). Times include encoding the corpus and the
queries (each timed run after a warm-up). ``agreement`` is the mean fraction of sentence-transformers'
negatives (as texts) that densepass also returns for the query.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from common import output_file
from densepass.cli import positive_int, run_guarded
from densepass.config import NegativesConfig
from densepass.data import load_dataset
from densepass.data.dataset import RetrievalDataset
from densepass.device import default_device
from densepass.io import atomic_write_text
from densepass.models.biencoder import BiEncoder, BiEncoderConfig, resolve_model_path
from densepass.negatives.mine import MiningContext, fetch_depth, mine_negatives


def subset(dataset: RetrievalDataset, query_ids: list[str], corpus_n: int | None, seed: int) -> RetrievalDataset:
    """The dataset restricted to the positives of ``query_ids`` plus random passages, ``corpus_n`` in all."""
    if corpus_n is None or corpus_n >= len(dataset.corpus):
        return dataset
    corpus = dataset.corpus
    relevant = dataset.relevant_sets()
    keep = {corpus.position(p) for q in query_ids for p in relevant.get(q, ())}
    others = [r for r in range(len(corpus)) if r not in keep]
    keep |= set(random.Random(seed).sample(others, max(0, corpus_n - len(keep))))
    sub = corpus.subset(sorted(keep))
    qrels = {"train": {q: {p: g for p, g in dataset.qrels["train"][q].items() if p in sub} for q in query_ids}}
    return RetrievalDataset(dataset.name, sub, {q: dataset.queries[q] for q in query_ids}, qrels)


def time_st(
    model_path: str,
    dataset: RetrievalDataset,
    query_ids: list[str],
    depth: int,
    max_length: int,
    batch_size: int,
    device: torch.device,
) -> tuple[float, list[list[str]]] | str:
    try:
        from datasets import Dataset
        from sentence_transformers import SentenceTransformer
        from sentence_transformers.util import mine_hard_negatives
    except ImportError as err:
        return f"skipped ({err})"
    model = SentenceTransformer(model_path, device=str(device))
    model.max_seq_length = max_length
    model.to(torch.bfloat16 if device.type == "cuda" else torch.float32)
    sep = model.tokenizer.sep_token
    corpus = dataset.corpus
    texts = corpus.passage_inputs(sep)
    positives = dataset.positives("train")
    pairs = Dataset.from_dict(
        {
            "query": [dataset.queries[q] for q in query_ids],
            "positive": [texts[corpus.position(positives[q][0])] for q in query_ids],
        }
    )

    def run() -> list[list[str]]:
        out = mine_hard_negatives(
            pairs,
            model,
            corpus=texts,
            range_min=0,
            range_max=fetch_depth(depth),
            num_negatives=depth,
            sampling_strategy="top",
            batch_size=batch_size,
            output_format="n-tuple",
            verbose=False,
        )
        cols = [c for c in out.column_names if c.startswith("negative")]
        return [[row[c] for c in cols] for row in out]

    model.encode(texts[:64], batch_size=batch_size)  # warm-up
    _sync(device)
    started = time.perf_counter()
    negatives = run()
    _sync(device)
    return time.perf_counter() - started, negatives


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="all-MiniLM-L6-v2")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--dataset", default="debian-packages")
    parser.add_argument("--n", type=positive_int, default=None, help="train queries (default: all)")
    parser.add_argument("--corpus-n", type=positive_int, default=None, help="corpus passages (default: all)")
    parser.add_argument("--depth", type=positive_int, default=100)
    parser.add_argument("--max-length", type=positive_int, default=128)
    parser.add_argument("--batch-size", type=positive_int, default=256)
    parser.add_argument("--skip-st", action="store_true")
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--out", type=output_file, default=None)
    args = parser.parse_args()

    device = default_device()
    full = load_dataset(args.dataset, args.data_dir)
    query_ids = sorted(full.positives("train"))
    if args.n is not None and args.n < len(query_ids):
        query_ids = sorted(random.Random(args.seed).sample(query_ids, args.n))
    dataset = subset(full, query_ids, args.corpus_n, args.seed)
    config = NegativesConfig(pool_depth=args.depth, filters=["qrels"], batch_size=args.batch_size)
    rows, results = [], {}

    started = time.perf_counter()
    bm25 = mine_negatives(
        dataset,
        query_ids,
        NegativesConfig(source="bm25", pool_depth=args.depth, filters=["qrels"]),
        MiningContext(show_progress=False),
    )
    results["densepass bm25"] = time.perf_counter() - started
    rows.append(("densepass BM25 (index + search + filter)", results["densepass bm25"], None))

    path = resolve_model_path(args.model)
    model = BiEncoder.from_pretrained(
        path, config=BiEncoderConfig(query_max_length=args.max_length, passage_max_length=args.max_length)
    )
    saved = tempfile.mkdtemp(prefix="bench-mine-model-")
    model.save(saved)  # with our config (max lengths), for source=model
    config.source, config.model = "model", saved
    precision = "bf16" if device.type == "cuda" else "fp32"  # sentence-transformers' dtype below (time_st)
    ctx = MiningContext(device=device, show_progress=False, precision=precision)
    mine_negatives(dataset, query_ids[:64], config, ctx)  # warm-up
    _sync(device)
    started = time.perf_counter()
    dense = mine_negatives(dataset, query_ids, config, ctx)
    _sync(device)
    results["densepass dense"] = time.perf_counter() - started

    st = (
        None
        if args.skip_st
        else time_st(path, dataset, query_ids, args.depth, args.max_length, args.batch_size, device)
    )
    agreement = None
    if isinstance(st, tuple):
        results["sentence-transformers dense"] = st[0]
        sep = model.tokenizer.sep_token
        texts = dataset.corpus.passage_inputs(sep)
        ours = [{texts[dataset.corpus.position(c.passage_id)] for c in dense.pool[q]} for q in query_ids]
        agreement = float(np.mean([len(set(theirs) & mine) / max(len(theirs), 1) for theirs, mine in zip(st[1], ours)]))
    rows.append(
        (
            "densepass dense (encode + exact top-k + filter)",
            results["densepass dense"],
            results["densepass dense"] / st[0] if isinstance(st, tuple) else None,
        )
    )
    if isinstance(st, tuple):
        rows.append(("sentence-transformers mine_hard_negatives", st[0], 1.0))

    title = (
        f"{args.dataset}: {len(query_ids)} train queries, {len(dataset.corpus)} passages, top-{args.depth}, "
        f"max length {args.max_length}, {device.type}, {precision} on both sides"
    )
    lines = [
        f"**{title}**",
        "",
        "| miner | seconds | queries/s | time / sentence-transformers |",
        "|---|---:|---:|---:|",
    ]
    for name, seconds, ratio in rows:
        lines.append(
            f"| {name} | {seconds:.2f} | {len(query_ids) / seconds:.0f} | {'-' if ratio is None else f'{ratio:.2f}'} |"
        )
    if agreement is not None:
        lines.append(f"\nagreement of the dense negatives with sentence-transformers': {agreement:.3f}")
    elif isinstance(st, str):
        lines.append(f"\nsentence-transformers: {st}")
    print("\n".join(lines))
    if args.out:
        payload = {
            "title": title,
            "seconds": results,
            "agreement": agreement,
            "queries": len(query_ids),
            "passages": len(dataset.corpus),
            "depth": args.depth,
            "device": str(device),
            "precision": precision,
            "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
            "cpu": platform.processor() or platform.machine(),
            "bm25_summary": bm25.summary(),
            "dense_summary": dense.summary(),
        }
        atomic_write_text(args.out, json.dumps(payload, indent=2))


if __name__ == "__main__":
    sys.exit(run_guarded(main, Path(__file__).name))
