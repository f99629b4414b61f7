"""``densepass validate-study``: which validation subcorpus orders checkpoints like the full corpus,
at what fraction of its cost (training-inference-gap §3, Figure 3).

Each checkpoint is evaluated on C0, every R_r, every H_k and the full corpus C; for each subcorpus we
report its size, encode+search time, the metric per checkpoint, and Kendall's tau between its ordering
of the checkpoints and the full corpus's ordering.

A passage's embedding does not depend on which corpus it sits in, so each checkpoint encodes C once and
every subcorpus is searched over its rows of C's embeddings: the study costs one corpus encoding per
checkpoint. What a subcorpus would cost on its own is measured the way validation would pay it, by
encoding that subcorpus alone and searching it, with the first checkpoint; that run's metric is also
compared with the sliced one (``direct_vs_sliced_max_diff`` in ``study.json``). Each checkpoint's
results are saved as it finishes (``checkpoints/`` in the output), so an interrupted study resumes.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.stats import kendalltau

from densepass.config import DEFAULT_MODEL
from densepass.data import load_dataset
from densepass.data.dataset import RetrievalDataset
from densepass.data.paths import check_output_apart
from densepass.errors import ConfigError
from densepass.evaluation.metrics import check_metrics, depth_for, evaluate_run, make_run, refuse_answer_metrics
from densepass.evaluation.subcorpus import Subcorpus, gold_subcorpus, hard_subcorpus, random_subcorpus
from densepass.fingerprints import fingerprint_corpus, fingerprint_directory, fingerprint_json, fingerprint_strings
from densepass.index.dense import DenseIndex
from densepass.index.exact import exact_search
from densepass.io import atomic_write_text, locked_run_directory
from densepass.models.biencoder import CONFIG_NAME, BiEncoder, resolve_model_path
from densepass.models.encode import encode_texts
from densepass.pipelines.validation import bm25_retriever, dense_retriever


@dataclass
class StudyRow:
    """One subcorpus of a study: the metric of each checkpoint on it, its cost and its Kendall tau."""

    subcorpus: Subcorpus
    scores: list[float]  # metric per checkpoint
    seconds: float  # encode + search time of this subcorpus alone, with the first checkpoint
    tau: float


def expand_checkpoints(paths: list[str]) -> list[Path]:
    """Model directories from model paths or run directories (final model + every checkpoint)."""
    found: list[Path] = []
    for raw in paths:
        path = Path(resolve_model_path(raw) if raw == DEFAULT_MODEL else raw)
        if (path / CONFIG_NAME).is_file() or (path / "config.json").is_file():
            found.append(path)
        elif (path / "checkpoints").is_dir() or (path / "model").is_dir():
            steps = sorted((path / "checkpoints").glob("step-*/model"), key=lambda p: int(p.parent.name[5:]))
            found.extend(steps)
            if (path / "model").is_dir():
                found.append(path / "model")
        else:
            raise ConfigError(f"{path} is neither a saved model nor a run directory")
    if len(found) < 2:
        raise ConfigError(f"a study needs at least 2 checkpoints, got {len(found)}")
    seen: dict[str, Path] = {}
    for path in found:
        key = fingerprint_directory(path)
        if key in seen:
            raise ConfigError(f"the same model is given twice ({seen[key]} and {path}): its ordering would be a tie")
        seen[key] = path
    return found


def checkpoint_name(path: Path) -> str:
    """``run`` for a run's final model, ``run@step`` for one of its checkpoints, else the directory name."""
    if path.name != "model":
        return path.name
    path = path.absolute()  # a relative ``model`` has no parent name to show (a link keeps its own name)
    if path.parent.name.startswith("step-") and path.parent.parent.name == "checkpoints":
        return f"{path.parent.parent.parent.name}@{path.parent.name[5:]}"
    return path.parent.name or path.name


def ordering_agreement(scores: list[float], reference: list[float]) -> float:
    """Kendall's tau between two score lists over the same checkpoints (1 = same ordering)."""
    if len(scores) != len(reference):
        raise ConfigError("score lists differ in length")
    if len(set(reference)) == 1 or len(set(scores)) == 1:
        return float("nan")
    return float(kendalltau(scores, reference).statistic)


@dataclass
class StudySettings:
    """Which subcorpora a study compares, on which queries and metric.

    ``corpus_fraction`` f makes the study affordable where the full corpus is not (a CPU): C is then
    the seeded random subcorpus R_f of the dataset's corpus, and every R_r and H_k is drawn from it
    (r is a fraction of that C; H_k's retriever searches it).
    """

    split: str = "dev"
    rs: Sequence[float] = (0.01, 0.1, 0.3)
    ks: Sequence[int] = (10, 50)
    retriever: str = "bm25"
    metric: str = "mrr@10"
    max_queries: int | None = None
    seed: int = 13
    corpus_fraction: float | None = None

    def __post_init__(self) -> None:
        for r in self.rs:
            if not 0 < r <= 1:
                raise ConfigError(f"r must be in (0, 1], got {r}")
        for k in self.ks:
            if k < 1:
                raise ConfigError(f"k must be >= 1, got {k}")
        if self.corpus_fraction is not None and not 0 < self.corpus_fraction <= 1:
            raise ConfigError(f"corpus fraction must be in (0, 1], got {self.corpus_fraction}")
        if self.max_queries is not None and self.max_queries < 1:
            raise ConfigError(f"max queries must be >= 1, got {self.max_queries}")
        check_metrics([self.metric])  # a typo: one line before any checkpoint is encoded
        refuse_answer_metrics([self.metric], "a study")


# What a study writes in its output folder: the folder is made a study's (``io.locked_run_directory``) before any
# of it is written, so a folder of the user's is never written into.
STUDY_ENTRIES = ("study.json", "study.md", "study.png", "subcorpus-*.json", "checkpoints/*.json")


def run_study(
    dataset: RetrievalDataset,
    checkpoints: list[Path],
    settings: StudySettings,
    out_dir: Path,
    claim: Callable[[], object] = lambda: None,
) -> list[StudyRow]:
    """Evaluate every checkpoint on C0, each R_r, each H_k and C (see ``StudySettings``). ``claim()`` is called
    before anything is written into ``out_dir`` (``io.locked_run_directory``'s): what can refuse the study (its
    split, its retriever's model) is checked first."""
    s = settings
    rs, ks, retriever, metric, seed = s.rs, s.ks, s.retriever, s.metric, s.seed
    qrels = dataset.sample(s.split, s.max_queries, seed)
    texts = [dataset.queries[q] for q in qrels]
    corpus = dataset.corpus
    full_provenance: dict = {"passages_in_dataset": len(corpus)}
    if s.corpus_fraction is not None:
        stand_in = random_subcorpus(corpus, qrels, s.corpus_fraction, seed)
        corpus = corpus.subset([corpus.position(p) for p in stand_in.ids])
        full_provenance.update(stand_in.provenance, stand_in_for_full_corpus=True)
    subcorpora = [gold_subcorpus(corpus, qrels)]
    subcorpora += [random_subcorpus(corpus, qrels, r, seed) for r in rs]
    if ks:
        search = bm25_retriever(corpus) if retriever == "bm25" else dense_retriever(corpus, retriever)
        subcorpora += [hard_subcorpus(corpus, qrels, texts, k, search, retriever) for k in ks]
    subcorpora.append(Subcorpus("full", list(corpus.ids), full_provenance))
    claim()
    out_dir.mkdir(parents=True, exist_ok=True)
    for sub in subcorpora:
        sub.save(out_dir / f"subcorpus-{sub.label}.json")
    positions = [np.array([corpus.position(p) for p in sub.ids]) for sub in subcorpora]
    # the study's content, not only its ids: passages, query texts and grades changed under the same ids are
    # another study (their checkpoints' saved scores are not reused)
    content = [fingerprint_corpus(corpus), fingerprint_json(qrels), fingerprint_strings(texts)]
    key = hashlib.sha1(json.dumps([metric, list(qrels), [sub.ids for sub in subcorpora], content]).encode()).hexdigest()
    results, fingerprints = [], [fingerprint_directory(path) for path in checkpoints]
    for j, path in enumerate(checkpoints):  # one result file per checkpoint: an interrupted study resumes
        cache = out_dir / "checkpoints" / f"{j:02d}-{checkpoint_name(path)}.json"
        identity = {"key": key, "checkpoint": fingerprints[j], "timed": j == 0}
        record = _read_saved(cache)
        if {k: record.get(k) for k in identity} != identity:
            record = {
                **identity,
                **_evaluate_checkpoint(path, corpus, subcorpora, positions, qrels, texts, metric, timed=j == 0),
            }
            cache.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(cache, json.dumps(record))
        results.append(record)
    scores = np.array([r["scores"] for r in results]).T  # [subcorpus, checkpoint]
    seconds, direct_diff = results[0]["seconds"], results[0]["direct_vs_sliced_max_diff"]
    full = scores[-1].tolist()
    rows_out = [
        StudyRow(sub, scores[i].tolist(), seconds[i], ordering_agreement(scores[i].tolist(), full))
        for i, sub in enumerate(subcorpora)
    ]
    write_study(rows_out, checkpoints, metric, out_dir, direct_diff)
    return rows_out


def validate_study(
    dataset: str,
    checkpoints: Sequence[str | Path],
    output: str | Path,
    settings: StudySettings | None = None,
    data_dir: str | Path | None = None,
    format: str = "beir",
) -> list[StudyRow]:
    """``densepass validate-study``: ``run_study`` of the saved models or run directories ``checkpoints``
    (``expand_checkpoints``) on dataset ``dataset``, written to the folder ``output``. An ``output`` that is, holds
    or lies in the dataset's folder or a checkpoint's is refused before any work (``data.paths.check_output_apart``);
    the folder is made a study's (``io.locked_run_directory``) only once the study's own checks pass, so a folder
    of the user's is never written into."""
    check_output_apart(output, dataset, data_dir, list(checkpoints))
    settings = settings or StudySettings()
    paths = expand_checkpoints([str(path) for path in checkpoints])
    data = load_dataset(dataset, data_dir, format)
    with locked_run_directory(output, "validation study", STUDY_ENTRIES, restart=False) as claim:
        return run_study(data, paths, settings, Path(output), claim)


def _read_saved(path: Path) -> dict:
    """A checkpoint's saved results, or {} when there are none usable (they are then recomputed)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _evaluate_checkpoint(
    path: Path,
    corpus,
    subcorpora: list[Subcorpus],
    positions: list[np.ndarray],
    qrels,
    texts: list[str],
    metric: str,
    timed: bool,
) -> dict:
    """The metric on every subcorpus from one encoding of C (rows sliced per subcorpus); if ``timed``,
    also each subcorpus's encode+search time on its own and the largest direct-vs-sliced difference."""
    model = BiEncoder.from_pretrained(str(path))
    sep = model.tokenizer.sep_token or " "

    def score(top: np.ndarray, rows: np.ndarray, ids: list[str]) -> float:
        return evaluate_run(qrels, make_run(list(qrels), ids, top, rows), [metric])[metric]

    depth = depth_for([metric])  # recall@300 of a top 100 was recall@100, under its own name
    started = time.perf_counter()
    passage_emb = encode_texts(model, corpus.passage_inputs(sep), "passage")
    query_emb = encode_texts(model, texts, "query", show_progress=False)
    scores = []
    for i, sub in enumerate(subcorpora):
        top, rows = exact_search(query_emb, passage_emb[positions[i]], min(depth, len(positions[i])))
        scores.append(score(top, rows, sub.ids))
    full_seconds = time.perf_counter() - started  # C's encode + search (the sliced searches are milliseconds)
    record: dict = {"scores": scores}
    if timed:
        seconds, diff = [], 0.0
        for i, sub in enumerate(subcorpora[:-1]):  # the last subcorpus is C itself, timed above
            passages = corpus.subset(positions[i].tolist())
            begun = time.perf_counter()
            direct = DenseIndex.build(model, passages, show_progress=False).search(texts, min(depth, len(passages)))
            seconds.append(time.perf_counter() - begun)
            diff = max(diff, abs(score(direct.scores, direct.rows, sub.ids) - scores[i]))
        record.update(seconds=[*seconds, full_seconds], direct_vs_sliced_max_diff=diff)
    return record


def write_study(rows: list[StudyRow], checkpoints: list[Path], metric: str, out_dir: Path, direct_diff: float) -> None:
    """``study.md`` (table), ``study.json`` (the same numbers) and ``study.png`` (metric against index
    size on a log axis: per checkpoint, a solid line C0 -> R_r -> C and a dashed one C0 -> H_k -> C)."""
    full = rows[-1]
    names = [checkpoint_name(p) for p in checkpoints]
    record = {
        "metric": metric,
        "checkpoints": [str(p) for p in checkpoints],
        "names": names,
        "direct_vs_sliced_max_diff": direct_diff,
        "rows": [
            {
                "subcorpus": r.subcorpus.label,
                "kind": r.subcorpus.kind,
                "passages": len(r.subcorpus),
                "provenance": r.subcorpus.provenance,
                "seconds": r.seconds,
                "kendall_tau": r.tau,
                "scores": r.scores,
            }
            for r in rows
        ],
    }
    atomic_write_text(out_dir / "study.json", json.dumps(record, indent=2))
    header = (
        "| subcorpus | passages | % of C | encode+search s | % of C's time | Kendall tau | " + " | ".join(names) + " |"
    )
    lines = [header, "|---|" + "---:|" * (5 + len(names))]
    for row in rows:
        lines.append(
            f"| {row.subcorpus.label} | {len(row.subcorpus):,} | "
            f"{100 * len(row.subcorpus) / len(full.subcorpus):.1f} | "
            f"{row.seconds:.1f} | {100 * row.seconds / full.seconds:.0f} | {row.tau:.2f} | "
            + " | ".join(f"{s:.4f}" for s in row.scores)
            + " |"
        )
    intro = (
        f"Metric: {metric}. Encode+search time: the subcorpus alone, with the first checkpoint. Largest "
        f"difference between that run's metric and the one from C's sliced embeddings: {direct_diff:.2g}."
    )
    atomic_write_text(out_dir / "study.md", intro + "\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    families = {
        kind: sorted((r for r in rows if r.subcorpus.kind in ("gold", kind, "full")), key=lambda r: len(r.subcorpus))
        for kind in ("random", "hard")
    }
    for j, name in enumerate(names):
        color = f"C{j % 10}"
        for kind, style in (("random", "-"), ("hard", "--")):
            family = families[kind]
            ax.plot(
                [len(r.subcorpus) for r in family],
                [r.scores[j] for r in family],
                style,
                marker="o",
                color=color,
                linewidth=1,
                markersize=3,
                label=name if kind == "random" else None,
            )
    for r in rows:
        ax.annotate(
            r.subcorpus.label,
            (len(r.subcorpus), max(r.scores)),
            fontsize=7,
            xytext=(0, 4),
            textcoords="offset points",
            ha="center",
        )
    ax.set_title("solid: C0 -> R_r -> C (random), dashed: C0 -> H_k -> C (hard)", fontsize=9)
    ax.set_xscale("log")
    ax.set_xlabel("index size (passages, log scale)")
    ax.set_ylabel(metric)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_dir / "study.png", dpi=120)
    plt.close(fig)
