"""A seeded split of one qrels split's queries into a **tuning part** and a **reporting part**, by group.

Choosing anything on the queries a result is then reported on (a wise-ft α, a crop length, a fusion weight, the
best of several rows) makes the reported number optimistic: the winner of many tries on one sample is partly the
luckiest on it. The honest way is the one the held-out test split already follows: choose on one set of queries,
report on another. ``split_query_parts`` makes those two sets out of one split (``data.eval_part``), so a study
can tune on ``tune`` and report on ``report`` with paired tests, without touching the kept-aside test split.

Queries are split **by group**, as the dataset's own splits are, so that no group has queries in both parts:
a query's group is the document (``doc_id``) of its first relevant passage (highest grade first, then the
passage that comes first in the corpus: deterministic whatever the order of the qrels file); on debian-packages
that is the source package, the unit its train / dev / test splits were cut by, so near-duplicate queries of
one package never sit on both sides. A query whose relevant passages span several documents goes with that
first one. A corpus without documents (every passage its own ``doc_id``, as a BEIR reader makes them when the
field is absent) has no groups: its queries are then split one by one, by query id.

The groups are shuffled by ``seed`` (the order of their sorted keys, so the result depends on the seed and the
data only), and taken in that order into the tuning part while each brings its query count closer to
``fraction`` of all queries: the tuning part holds ``fraction`` of the queries to within half the largest group.
Only queries with a relevant passage take part (the others are never evaluated).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from densepass.data.dataset import Corpus, Qrels
from densepass.errors import DataError

PARTS = ("all", "tune", "report")


@dataclass(frozen=True)
class QueryParts:
    """The two parts of a split's queries (sorted ids), what they were grouped by and how many groups."""

    tune: list[str]
    report: list[str]
    by: str  # "document" (the doc_id of each query's first relevant passage) or "query" (no documents)
    groups: int
    fraction: float
    seed: int

    def part(self, name: str) -> list[str]:
        """The queries of part ``name`` (``tune`` or ``report``)."""
        if name not in ("tune", "report"):
            raise DataError(f"no query part {name!r} (tune or report)")
        return self.tune if name == "tune" else self.report

    def describe(self, name: str) -> dict:
        """What a run records of the part it evaluated: which part, its size and how it was made."""
        return {
            "part": name,
            "part_queries": len(self.part(name)),
            "split_queries": len(self.tune) + len(self.report),
            "by": self.by,
            "groups": self.groups,
            "fraction": self.fraction,
            "seed": self.seed,
        }


def query_groups(qrels: Qrels, corpus: Corpus) -> tuple[dict[str, tuple[str, str]], str]:
    """Each query's group (``("document", doc_id)`` or ``("query", query id)``) and what the groups are: by
    ``document`` where the corpus has documents, else by ``query``. Queries without a relevant passage are left
    out."""
    has_documents = any(doc != pid for pid, doc in zip(corpus.ids, corpus.doc_ids))
    groups: dict[str, tuple[str, str]] = {}
    for qid, rels in qrels.items():
        positives = [p for p, g in rels.items() if g > 0 and p in corpus]
        if not positives:
            continue
        if not has_documents:
            groups[qid] = ("query", qid)
            continue
        first = min(positives, key=lambda p: (-rels[p], corpus.position(p)))
        groups[qid] = ("document", corpus.doc_ids[corpus.position(first)])
    return groups, "document" if has_documents else "query"


def split_query_parts(qrels: Qrels, corpus: Corpus, fraction: float, seed: int, where: str = "the split") -> QueryParts:
    """The tuning and reporting parts of ``qrels``' queries (the module docstring says how). A one-line
    DataError where ``fraction`` is not strictly between 0 and 1, or the queries fall in too few groups for both
    parts to hold some (``where`` names the split in it)."""
    if not 0 < fraction < 1:
        raise DataError(f"the tuning part's fraction must lie strictly between 0 and 1, got {fraction:g}")
    groups, by = query_groups(qrels, corpus)
    members: dict[tuple[str, str], list[str]] = {}
    for qid in sorted(groups):
        members.setdefault(groups[qid], []).append(qid)
    order = sorted(members)
    random.Random(seed).shuffle(order)
    target = fraction * len(groups)
    tune: list[str] = []
    for key in order:
        size = len(members[key])
        if len(tune) + size / 2 < target:  # this group brings the tuning part closer to its share
            tune += members[key]
    report = sorted(set(groups) - set(tune))
    if not tune or not report:
        raise DataError(
            f"{where}: its {len(groups)} queries with a relevant passage fall in {len(members)} group(s) (by {by}): "
            f"too few to split into a tuning part of {fraction:g} and a reporting part, both non-empty"
        )
    return QueryParts(sorted(tune), report, by, len(members), fraction, seed)
