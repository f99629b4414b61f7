"""How much of BM25's ranking the CPU decided: bm25s's own top-k against densepass's, on one query sample.

    python experiments/bm25_ties.py [--dataset debian-packages] [--split dev] [--queries 300] [--k 100]
        [--data-dir DIR] [--seed 13]

bm25s ranks a query's scores with NumPy's ``argpartition`` and quicksort ``argsort``, whose SIMD kernels (chosen
by the CPU: AVX-512, AVX2) break tied scores differently; densepass ranks the same scores by the k-th highest value
and a stable sort, ties to the lower row (``densepass.index.bm25.top_k``). Prints, over the full corpus: how many
queries' top-k lists bm25s orders otherwise than densepass, how many hold other passages, how many have ties
across the k-th place, and MRR@10 of both rankings with the number of queries whose reciprocal rank changed. Run
it on two CPUs to see bm25s's lists differ between them and densepass's not (docs/benchmarks.md, "Main job").
"""

from __future__ import annotations

import argparse

import bm25s
import numpy as np

from densepass.data import load_dataset
from densepass.data.dataset import sample_queries
from densepass.index.bm25 import BM25Index, top_k


def reciprocal_ranks(rows: np.ndarray, query_ids: list[str], qrels: dict, passage_ids) -> np.ndarray:
    """1 / rank of each query's first relevant passage in its top 10 (0 when none)."""
    out = np.zeros(len(query_ids))
    for i, (qid, row) in enumerate(zip(query_ids, rows)):
        relevant = {p for p, grade in qrels[qid].items() if grade > 0}
        hit = next((rank for rank, r in enumerate(row[:10], 1) if passage_ids[r] in relevant), None)
        out[i] = 1 / hit if hit else 0.0
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="debian-packages")
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--split", default="dev")
    parser.add_argument("--queries", type=int, default=300, help="seeded sample of the split's queries")
    parser.add_argument("--seed", type=int, default=13)
    parser.add_argument("--k", type=int, default=100)
    args = parser.parse_args()
    dataset = load_dataset(args.dataset, args.data_dir)
    index = BM25Index.build(dataset.corpus)
    qrels = sample_queries(dataset.split(args.split), args.queries, args.seed)
    query_ids = sorted(qrels)
    texts = [dataset.queries[q] for q in query_ids]
    k = min(args.k, index.size)
    _, ours = index.search_rows(texts, k)
    tokens = bm25s.tokenize(texts, stopwords="en", stemmer=index.stemmer, show_progress=False)
    theirs, _ = index.retriever.retrieve(tokens, k=k, show_progress=False, backend_selection="numpy")
    words = bm25s.tokenize(texts, stopwords="en", stemmer=index.stemmer, show_progress=False, return_ids=False)
    edge_ties = 0
    for query_words, row in zip(words, ours):
        scores = index._scores(query_words)
        edge_ties += int((scores == scores[row[-1]]).sum() > (scores[row] == scores[row[-1]]).sum())
        assert np.array_equal(top_k(scores, k)[1], row)
    order = sum(not np.array_equal(a, b) for a, b in zip(ours, theirs))
    members = sum(set(a.tolist()) != set(b.tolist()) for a, b in zip(ours, theirs))
    rr_ours = reciprocal_ranks(ours, query_ids, qrels, dataset.corpus.ids)
    rr_theirs = reciprocal_ranks(theirs, query_ids, qrels, dataset.corpus.ids)
    print(f"{args.dataset} {args.split}: {len(query_ids)} queries, full corpus ({index.size} passages), top {k}")
    print(f"bm25s's lists in another order than densepass's: {order}; with other passages: {members}")
    print(f"queries with tied scores across the {k}th place: {edge_ties}")
    print(
        f"MRR@10 densepass {rr_ours.mean():.4f}, bm25s on this CPU {rr_theirs.mean():.4f} "
        f"({int((rr_ours != rr_theirs).sum())} queries changed)"
    )


if __name__ == "__main__":
    main()
