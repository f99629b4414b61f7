r"""Issue 55's pipeline with a given cross-encoder: dense + BM25 (linear fusion), then the cross-encoder over the
fusion's top candidates, alone and fused with the fusion's scores; each row with a paired test against the dense
model alone and against the dense + BM25 fusion.

    python3 experiments/teacher_pipeline.py --config configs/recommended.yaml \
        --dense outputs/recommended/runs/fine-tuned.trec --bm25 outputs/teacher-h200/bm25-report/runs/bm25.trec \
        --cross-encoder outputs/teacher-h200/teacher-fp16 --dense-weight 0.75 --depth 10 \
        --out outputs/teacher-h200/pipeline

The queries are those of the dense run (the config's evaluated part: ``data.eval_part``, ``data.max_eval_queries``;
``--set data.eval_part=tune`` for the tuning part), judged with the config's qrels. ``--dense-weight`` is the dense
side's weight in the linear fusion, chosen elsewhere (the recipe study chose 0.75 on the tuning part:
docs/experiments.md); without it, it is 2-fold cross-validated on these queries. The cross-encoder's own fusion
weight is 2-fold cross-validated (chosen on one half of the queries for the other: no query is scored with a weight
chosen on it), as in ``experiments/recipe.py``; with ``--weights-from DIR`` (this script's folder for the tuning
part, at the same depths) each depth's weight is chosen once on all of that folder's queries and applied to these,
as a user applies one ``densepass rerank --fuse-weight``, and the report names the depth whose fusion scores best
there. Reranking is ``densepass rerank``'s (``rerank_run_file``;
its scores kept in ``<out>/cache`` by content, so a second depth or a re-run scores only new pairs; ``--cache-dir``
shares one cache between pipelines of other first stages over the same queries).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from densepass.cli import run_guarded  # noqa: E402
from densepass.config import load_config  # noqa: E402
from densepass.data import load_dataset  # noqa: E402
from densepass.device import resolve_device  # noqa: E402
from densepass.errors import ConfigError, DataError  # noqa: E402
from densepass.evaluation.fusion import linear_fusion  # noqa: E402
from densepass.evaluation.metrics import (  # noqa: E402
    Run,
    check_run_file,
    evaluate_run,
    paired_significance,
    read_trec_run,
    write_trec_run,
)
from densepass.io import atomic_write_text, check_output_file  # noqa: E402
from densepass.pipelines.evalset import eval_qrels  # noqa: E402
from densepass.pipelines.search import check_reranker_precision, rerank_run_file  # noqa: E402
from recipe import RERANK_DEPTH, cv_linear_fusion, fused_mrr, reranked_heads, reranked_runs, top  # noqa: E402

METRICS = ["mrr@10", "ndcg@10", "recall@100"]
TITLE = "# densepass pipeline: dense + BM25, then the cross-encoder "
RERANK_TAG = "densepass-rerank"  # rerank_run_file's runs


def check_outputs(out: Path, depths: list[int]) -> None:
    """A one-line error, before any work, where ``out`` holds under this script's names files it did not write
    (its report opens with ``TITLE``; its runs are TREC runs of its tags): a folder of one's own notes is left as
    it is, and no run of another system is read as the cross-encoder's."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out} is a file; give a folder")
    check_run_file(out / "first-stage.trec", "densepass")
    for depth in depths:
        check_run_file(out / f"reranked-{depth}.trec", RERANK_TAG)
    check_output_file(out / "report.md", "pipeline report", lambda path: path.read_text().startswith(TITLE))
    check_output_file(out / "report.json", "pipeline report", lambda path: _is_report(json.loads(path.read_text())))


def tuning_runs(folder: Path, depths: list[int], split_qrels: dict, qrels: dict) -> tuple[dict, Run, dict[int, Run]]:
    """What ``--weights-from`` chooses the cross-encoder's weights on: that folder's queries' qrels (of the eval
    split), its first stage and its cross-encoder's run at each depth; one line, before any work, where a run is
    missing or the folder shares queries with the evaluated ones (a weight chosen on a query it then scores)."""
    first_path = folder / "first-stage.trec"
    for path in [first_path, *(folder / f"reranked-{depth}.trec" for depth in depths)]:
        if not path.is_file():
            raise DataError(f"--weights-from {folder} has no {path.name} (run this script there at the same depths)")
    first = read_trec_run(first_path)
    shared = set(first) & set(qrels)
    if shared:
        raise DataError(f"--weights-from {folder} holds {len(shared)} of the evaluated queries: choose on other ones")
    judged = {q: split_qrels[q] for q in first if q in split_qrels}
    if not judged:
        raise DataError(f"--weights-from {folder}: none of its queries is judged in the eval split")
    reranked = {depth: read_trec_run(folder / f"reranked-{depth}.trec") for depth in depths}
    for depth, run in reranked.items():  # each scores its first stage's top (a ConfigError in one line otherwise)
        reranked_heads(first, run, depth)
    return judged, first, reranked


def tuning_score(tuning: tuple[dict, Run, Run], depth: int, weight: float) -> float:
    """MRR@10 on the --weights-from queries of their first stage's top ``depth`` fused with the cross-encoder's
    scores at ``weight`` (the one chosen there): what a choice of depth compares."""
    judged, first, scores = tuning
    head, alone = reranked_heads(first, scores, depth)
    return fused_mrr(judged, alone, head, weight)  # as best_weight scored it when it chose the weight


def _is_report(values) -> bool:
    return isinstance(values, dict) and all(
        isinstance(v, dict) and set(v) == {"metrics", "tests"} for v in values.values()
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/recommended.yaml", help="the dataset and evaluated part")
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a config override (data.eval_part=tune)"
    )
    parser.add_argument("--dense", required=True, help="the dense model's TREC run over the evaluated queries")
    parser.add_argument("--bm25", required=True, help="BM25's TREC run over the same queries")
    parser.add_argument("--cross-encoder", required=True, help="a saved cross-encoder (densepass rerank --model)")
    parser.add_argument("--dense-weight", type=float, default=None, help="dense weight of the linear fusion")
    parser.add_argument("--depth", type=int, nargs="+", default=[10], help="candidates the cross-encoder re-scores")
    parser.add_argument(
        "--weights-from",
        default=None,
        metavar="DIR",
        help="this script's folder for other queries (the tuning part): each depth's cross-encoder weight is chosen"
        " there, on all its queries, and applied here (default: 2-fold cross-validation on these queries)",
    )
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="the cross-encoder's scores, by content (default: <out>/cache); pipelines of other first stages over "
        "the same queries that share one score only the pairs not met before",
    )
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    if args.dense_weight is not None and not 0 < args.dense_weight < 1:
        parser.error(f"--dense-weight must be between 0 and 1, got {args.dense_weight}")
    if any(not 1 <= d <= RERANK_DEPTH for d in args.depth):
        parser.error(f"--depth must be from 1 to {RERANK_DEPTH}")
    config = load_config(args.config, args.set)
    out = Path(args.out)
    if args.weights_from and Path(args.weights_from).resolve() == out.resolve():
        parser.error("--weights-from is the tuning part's folder: give --out another one")
    check_outputs(out, args.depth)  # before any work: densepass replaces only what it wrote
    check_reranker_precision(args.cross_encoder, "auto", resolve_device(args.device))  # a missing model: one line

    dataset = load_dataset(config.data.name, config.data.data_dir, config.data.format)
    qrels, _ = eval_qrels(dataset, config.data)
    dense, bm25 = read_trec_run(args.dense), read_trec_run(args.bm25)
    for name, run in (("--dense", dense), ("--bm25", bm25)):
        if set(run) != set(qrels):
            raise DataError(f"{name} holds {len(run)} queries, not the {len(qrels)} the config evaluates")
    tuning = tuning_runs(Path(args.weights_from), args.depth, dataset.split(config.data.eval_split), qrels) if (
        args.weights_from
    ) else None  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)  # (the inputs read: a bad one leaves no folder behind)
    seed = config.data.seed
    if args.dense_weight is None:
        hybrid, weight = cv_linear_fusion(qrels, dense, bm25, seed)
    else:
        hybrid = linear_fusion([dense, bm25], [args.dense_weight, 1 - args.dense_weight])
        weight = f"{args.dense_weight:.2f}"
    runs = {"dense": dense, f"dense + BM25, linear (dense weight {weight})": hybrid}
    cache_dir = Path(args.cache_dir) if args.cache_dir is not None else out / "cache"
    there: dict[int, float] = {}  # each depth's fused MRR@10 on the --weights-from queries, at the weight chosen there
    first = out / "first-stage.trec"
    write_trec_run(top(hybrid, RERANK_DEPTH), first)
    for depth in args.depth:
        reranked = out / f"reranked-{depth}.trec"  # (one there is this script's: check_outputs)
        # always made again from this first stage (one made from another would score other passages); the pairs
        # scored before are read from the cache, so a re-run costs no scoring
        rerank_run_file(
            config.data.name, first, args.cross_encoder, reranked, data_dir=config.data.data_dir,
            format=config.data.format, depth=depth, device=args.device, cache_dir=cache_dir,
        )  # fmt: skip
        chosen = (tuning[0], tuning[1], tuning[2][depth]) if tuning else None
        alone, fused, weights = reranked_runs(qrels, hybrid, read_trec_run(reranked), depth, seed, chosen)
        how = "by 2-fold CV"
        if chosen is not None:
            there[depth] = tuning_score(chosen, depth, float(weights))
            how = f"chosen on the --weights-from queries, MRR@10 {there[depth]:.4f} there"
        runs[f"→ cross-encoder@{depth}"] = alone
        runs[f"→ cross-encoder@{depth}, fused with the first stage (weight {weights} {how})"] = fused

    names = list(runs)
    lines = [
        f"{TITLE}{args.cross_encoder}",
        "",
        f"{len(qrels)} queries",
        "",
        "| row | " + " | ".join(METRICS) + " | Δ MRR@10 vs dense (wins / losses, p) | Δ vs dense + BM25 (p) |",
        "|---|" + "---:|" * len(METRICS) + "---|---|",
    ]
    results = {}
    for name in names:
        values = evaluate_run(qrels, runs[name], METRICS)
        tests = {
            against: paired_significance(qrels, {against: runs[against], name: runs[name]}, against, "mrr@10")[name]
            for against in names[:2]
            if against != name
        }
        results[name] = {"metrics": values, "tests": tests}
        cells = [f"{values[m]:.4f}" for m in METRICS]
        test_cells = []
        for against in names[:2]:
            t = tests.get(against)
            test_cells.append("" if t is None else f"{t['delta']:+.4f} ({t['wins']} / {t['losses']}, p = {t['p']:.4f})")
        lines.append(f"| {name} | " + " | ".join(cells) + " | " + " | ".join(test_cells) + " |")
    if there:
        best = max(there, key=lambda depth: there[depth])  # the first of equals: the shallower, cheaper depth
        lines += ["", f"The depth the --weights-from queries choose (their best fused MRR@10): {best}."]
    text = "\n".join(lines) + "\n"
    atomic_write_text(out / "report.md", text)
    atomic_write_text(out / "report.json", json.dumps(results, indent=2))
    print(text)


if __name__ == "__main__":
    sys.exit(run_guarded(main, Path(__file__).name))
