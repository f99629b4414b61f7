"""Training instances and the collation of a batch: positives, sampled hard negatives, masks.

The metadata of the *global* batch (ids, sampled negatives, false-negative mask) is computed
identically on every process from a seed of (epoch, step); each process tokenises only its slice.

Mixed-in pairs (``data.mix``, a forgetting guard): ``TrainingData.add_mix`` adds another dataset's (query, positive)
pairs, and every batch then ends with ``per_batch`` of them besides the planned queries of the main data: a share of
each batch rather than whole steps of their own, so that every step's gradient keeps both domains and the batch
order (planned over the main queries only) and the contrast size stay as they are. They are drawn by global step
from a seeded permutation of the mixed queries, each once per pass over them, so a resumed run draws the same. Their
passages are not in the main corpus, so nothing is mined or filtered for them: their negatives are the batch's other
passages, plus (where queries draw hard negatives) random passages among the mixed positives, their own and any
passage judged relevant to them masked out by content as for every query.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from densepass.data.dataset import RetrievalDataset
from densepass.data.keys import content_key, is_known_passage, passage_input
from densepass.errors import ConfigError, DataError, DataWarning
from densepass.losses.contrastive import false_negative_mask


def draw_negatives(
    pool: np.ndarray,
    h: int,
    rng: np.random.Generator,
    n_passages: int,
    keys: np.ndarray | None = None,
    relevant: set[int] | None = None,
) -> list[int]:
    """``h`` rows drawn uniformly from ``pool`` (distinct when the pool has >= h rows; a shorter pool repeats some,
    which ``TrainingData`` warns about and reports: ``PoolSizes``), the paper's "randomly select negatives from the
    pool for each question" (negative-contrast §4.3); an empty pool falls back to distinct random passages
    (training-inference-gap §4.3.2, footnote 6). Rows whose content key (``keys``) is ``relevant`` to the query are
    left out of either: a cross-encoder, which masks nothing, would learn its own positive as a negative."""
    pool = np.asarray(pool, dtype=np.int64)
    if len(pool) == 0:
        pool = rng.choice(n_passages, size=min(4 * h, n_passages), replace=False)
    if relevant and keys is not None:
        kept = pool[~np.isin(keys[pool], list(relevant))]
        pool = kept if len(kept) else pool  # (a corpus of nothing but the query's relevant passages)
    return [int(r) for r in rng.choice(pool, size=h, replace=len(pool) < h)]


@dataclass
class TrainingBatch:
    """One process's share of a global batch, plus the global mask."""

    query_texts: list[str]
    passage_texts: list[str]  # this process's positives, then its hard negatives
    n_local_queries: int
    positive_index: torch.Tensor  # [B_global] column of each query's positive in the global passage list
    mask: torch.Tensor  # [B_global, P_global]
    passage_keys: torch.Tensor  # [P_global] content key of each passage column (data.keys.content_key)
    relevant_keys: list[set[int]]  # per global query: keys of every passage judged relevant to it, and its positive's
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # per-batch data of other objectives


@dataclass
class MixSource:
    """One dataset's pairs mixed into every batch (``TrainingData.add_mix``): its queries, the rows of their
    positives (appended after the main passages), the content keys of what is relevant to each, how many join each
    batch, and the seed of their order."""

    name: str
    query_texts: list[str]
    positive_rows: np.ndarray
    relevant_keys: list[set[int]]
    per_batch: int
    seed: int

    def members(self, step: int) -> list[int]:
        """The indices of the queries mixed into global step ``step``: the next ``per_batch`` of a sequence of
        seeded permutations (each query once per pass over them)."""
        n, out = len(self.query_texts), []
        for position in range(step * self.per_batch, (step + 1) * self.per_batch):
            permutation = np.random.default_rng([self.seed, 0x6D6978, position // n]).permutation(n)
            out.append(int(permutation[position % n]))
        return out


@dataclass(frozen=True)
class PoolSizes:
    """How the hard-negative pools of the training queries compare with the negatives drawn per query: ``short``
    queries have some, but fewer than ``per_query``, distinct negatives in their pool (the smallest such pool holds
    ``smallest``), so their draws repeat negatives; ``empty`` have none (random passages are drawn instead)."""

    queries: int
    per_query: int
    short: int = 0
    smallest: int | None = None
    empty: int = 0

    @classmethod
    def of(cls, pools: Sequence[np.ndarray], per_query: int) -> PoolSizes:
        """The sizes of ``pools`` (one per training query) against ``per_query`` negatives drawn from each."""
        short = [len(pool) for pool in pools if 0 < len(pool) < per_query]
        empty = sum(1 for pool in pools if len(pool) == 0)
        return cls(len(pools), per_query, len(short), min(short) if short else None, empty)

    def summary(self) -> str:
        """One sentence for the run's report: the true number of distinct negatives the draws had."""
        text = f"{self.per_query} hard negative(s) drawn per query and step"
        if self.short:
            text += (
                f"; {self.short} of the {self.queries} queries have fewer distinct ones in their pool (the smallest "
                f"{self.smallest}), so their draws repeat negatives"
            )
        if self.empty:
            text += f"; {self.empty} of the {self.queries} have an empty pool (random passages instead)"
        return text + "."

    def warn(self, which: str = "their pool") -> None:
        """One DataWarning when some pools are shorter than ``per_query`` (never one per query); ``which`` names
        the pools (a refresh's)."""
        if self.short:
            warnings.warn(
                f"{self.short} of {self.queries} training queries have fewer distinct hard negatives in {which} "
                f"than the {self.per_query} drawn per query (the smallest pool holds {self.smallest}): their draws "
                "repeat negatives",
                DataWarning,
                stacklevel=3,
            )


class TrainingData:
    """(query, positive) instances from one split, with optional hard-negative pools per query and optional
    teacher scores of (query, passage) pairs (distillation: each batch then carries, in
    ``extras["teacher_scores"]``, the teacher's scores of every query's positive and drawn negatives)."""

    def __init__(
        self,
        dataset: RetrievalDataset,
        split: str,
        sep_token: str,
        negatives: dict[str, list[str]] | None = None,
        negatives_per_query: int = 0,
        query_ids: Sequence[str] | None = None,
        teacher_scores: Mapping[str, Mapping[str, float]] | None = None,
    ) -> None:
        positives = dataset.positives(split)
        self.query_ids = sorted(positives) if query_ids is None else list(query_ids)
        missing = [q for q in self.query_ids if q not in positives]
        if missing:
            raise DataError(f"{len(missing)} training queries have no positive in qrels/{split} (e.g. {missing[0]!r})")
        if negatives_per_query < 0:
            raise ConfigError("negatives per query must be >= 0")
        if negatives_per_query > 0 and not negatives:
            raise ConfigError("hard negatives were requested but no negative pool was given")
        self.dataset = dataset
        self.positives = positives
        self.negatives_per_query = negatives_per_query
        self.query_texts = [dataset.queries[q] for q in self.query_ids]
        self.passage_inputs = dataset.corpus.passage_inputs(sep_token)
        self.keys = np.array([content_key(t) for t in self.passage_inputs], dtype=np.int64)
        corpus = dataset.corpus
        relevant = dataset.relevant_sets()
        self.relevant_keys = [{int(self.keys[corpus.position(p)]) for p in relevant.get(q, ())} for q in self.query_ids]
        self.positive_rows = [[corpus.position(p) for p in positives[q]] for q in self.query_ids]
        self.sep_token = sep_token
        self._extra_rows: dict[str, int] = {}  # synthetic passages (context halves) -> rows after the corpus
        self.negative_rows = self._negative_pools(negatives or {}) if negatives_per_query else None
        self.pool_sizes: PoolSizes | None = None  # the pools against negatives_per_query: what a report says
        if self.negative_rows is not None:
            self.pool_sizes = PoolSizes.of(self.negative_rows, negatives_per_query)
            self.pool_sizes.warn()  # a pool shorter than negatives_per_query repeats negatives: never silently
        self._refreshed: list[tuple[int, list[np.ndarray]]] = []  # (first step, pools), by first step
        self.mix: list[MixSource] = []
        self.teacher: list[dict[int, float]] | None = None
        if teacher_scores is not None:
            rows = [{self._row(p): float(v) for p, v in teacher_scores.get(q, {}).items()} for q in self.query_ids]
            self._add_extra_keys()
            self.teacher = [{r: v for r, v in scored.items() if r is not None} for scored in rows]

    def __len__(self) -> int:
        return len(self.query_ids)

    @property
    def mixed_per_batch(self) -> int:
        """Queries of ``add_mix``'s datasets that join every batch (the planner plans the rest of it)."""
        return sum(source.per_batch for source in self.mix)

    def add_mix(self, dataset: RetrievalDataset, split: str, per_batch: int, seed: int) -> MixSource:
        """Mix ``per_batch`` (query, positive) pairs of ``dataset``'s ``split`` into every batch (module docstring);
        its positives' passages are appended after the main ones."""
        if self.teacher is not None:
            raise ConfigError("mixed-in pairs have no teacher scores: data.mix does not combine with distillation")
        positives = dataset.positives(split)
        if not positives:
            raise DataError(f"data.mix: {dataset.name} has no queries with a positive in its {split} split")
        query_ids = sorted(positives)
        rows: dict[str, int] = {}
        for qid in query_ids:
            pid = positives[qid][0]
            if pid not in rows:
                rows[pid] = len(self.passage_inputs)
                self.passage_inputs.append(passage_input(dataset.corpus, pid, self.sep_token))
        self._add_extra_keys()
        relevant = dataset.relevant_sets()

        def key(pid: str) -> int:
            return (
                int(self.keys[rows[pid]])
                if pid in rows
                else content_key(passage_input(dataset.corpus, pid, self.sep_token))
            )

        source = MixSource(
            f"{dataset.name} ({split})",
            [dataset.queries[q] for q in query_ids],
            np.asarray([rows[positives[q][0]] for q in query_ids], dtype=np.int64),
            [{key(p) for p in relevant.get(q, ()) if p in dataset.corpus} for q in query_ids],
            per_batch,
            seed + 1_000_003 * (len(self.mix) + 1),
        )
        self.mix.append(source)
        return source

    def texts_in_use(self) -> dict[str, list[str]]:
        """The texts batches draw, per side (what the trainer's token cache holds): every training query, and
        every passage that is a positive or in a negative pool (an empty pool's random fallback and a later
        refresh may draw others)."""
        rows = {r for positives in self.positive_rows for r in positives}
        rows.update(int(r) for source in self.mix for r in source.positive_rows)
        for pools in [self.negative_rows or [], *(pools for _, pools in self._refreshed)]:
            rows.update(int(r) for pool in pools for r in pool)
        queries = [*self.query_texts, *(q for source in self.mix for q in source.query_texts)]
        return {"query": queries, "passage": [self.passage_inputs[r] for r in sorted(rows)]}

    def _row(self, pid: str) -> int | None:
        """The row of passage ``pid``; synthetic passages (context halves, ``<pid>#half0``) get rows appended
        after the corpus (their content keys by ``_add_extra_keys``); None for an unknown id."""
        corpus = self.dataset.corpus
        if pid in corpus:
            return corpus.position(pid)
        if pid not in self._extra_rows and is_known_passage(corpus, pid):
            self._extra_rows[pid] = len(self.passage_inputs)
            self.passage_inputs.append(passage_input(corpus, pid, self.sep_token))
        return self._extra_rows.get(pid)

    def _add_extra_keys(self) -> None:
        """Content keys of the rows ``_row`` appended since the last call."""
        new = [content_key(t) for t in self.passage_inputs[len(self.keys) :]]
        if new:
            self.keys = np.concatenate([self.keys, np.array(new, dtype=np.int64)])

    def _negative_pools(self, negatives: dict[str, list[str]]) -> list[np.ndarray]:
        """Per instance: rows of its distinct candidate negatives, minus anything relevant to it."""
        pools = []
        for qid in self.query_ids:
            pools.append([r for r in dict.fromkeys(map(self._row, negatives.get(qid, ()))) if r is not None])
        self._add_extra_keys()
        return [
            np.asarray([r for r in rows if int(self.keys[r]) not in self.relevant_keys[i]], dtype=np.int64)
            for i, rows in enumerate(pools)
        ]

    def unscored(self, negatives: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
        """Per training query, the passages of the pool ``negatives`` that its teacher scores lack (a refreshed
        pool's new candidates, for the teacher to score before any batch draws them); empty without teacher
        scores."""
        if self.teacher is None:
            return {}
        out = {}
        for i, qid in enumerate(self.query_ids):
            rows = {pid: self._row(pid) for pid in negatives.get(qid, ())}
            missing = [pid for pid, row in rows.items() if row is not None and row not in self.teacher[i]]
            if missing:
                out[qid] = missing
        self._add_extra_keys()
        return out

    def add_teacher_scores(self, scores: Mapping[str, Mapping[str, float]]) -> None:
        """Add the teacher's scores of more (query, passage) pairs, a refreshed pool's; a pair scored before keeps
        its first score (its batches drew it with that one)."""
        if self.teacher is None:
            raise ConfigError("this training data has no teacher scores to add to (it is not distilled)")
        position = {qid: i for i, qid in enumerate(self.query_ids)}
        teacher = list(self.teacher)
        for qid, values in scores.items():
            i = position.get(qid)
            if i is None:
                continue
            merged = dict(teacher[i])
            for pid, value in values.items():
                row = self._row(pid)
                if row is not None and row not in merged:
                    merged[row] = float(value)
            teacher[i] = merged
        self._add_extra_keys()
        self.teacher = teacher  # a new list, swapped in at once: the trainer's prefetch thread may be reading

    def replace_negatives(self, negatives: dict[str, list[str]], from_step: int) -> None:
        """Use a new pool (query id -> passage ids) for the batches of step ``from_step`` on (a refresh)."""
        if not self.negatives_per_query:
            raise ConfigError("this training data samples no hard negatives: nothing to refresh")
        pools = self._negative_pools(negatives)
        PoolSizes.of(pools, self.negatives_per_query).warn(f"the pool re-mined for step {from_step}")
        # a new list, swapped in at once: the trainer's prefetch thread may be reading the old one
        self._refreshed = sorted([*self._refreshed, (from_step, pools)], key=lambda item: item[0])

    def negative_rows_at(self, step: int | None) -> list[np.ndarray] | None:
        """The pools in force at global step ``step`` (0-based; None: the pool given at construction)."""
        current = self.negative_rows
        for first, pools in self._refreshed:
            if step is None or first > step:
                break
            current = pools
        return current

    def collate(
        self, batch: Sequence[int], seed: Sequence[int], rank: int = 0, world: int = 1, step: int | None = None
    ) -> TrainingBatch:
        """Build the global batch ``batch`` (instance indices) of global step ``step`` and return this
        process's share; with ``add_mix``'s datasets, their queries of ``step`` follow ``batch``'s."""
        mixed = [(source, i) for source in self.mix for i in source.members(step or 0)]
        n = len(batch) + len(mixed)
        if n % world:
            raise ConfigError(f"global batch of {n} does not split over {world} processes")
        rng = np.random.default_rng(list(seed))
        pos_rows = [int(self.positive_rows[i][0]) for i in batch]
        pos_rows += [int(source.positive_rows[i]) for source, i in mixed]
        relevant = [self.relevant_keys[i] for i in batch] + [source.relevant_keys[i] for source, i in mixed]
        h = self.negatives_per_query
        neg_rows: list[int] = []
        if h:
            pools = self.negative_rows_at(step)
            for i in batch:
                neg_rows.extend(
                    draw_negatives(pools[i], h, rng, len(self.passage_inputs), self.keys, self.relevant_keys[i])
                )
            for source, i in mixed:  # random passages among the mixed positives (none mined for these queries)
                neg_rows.extend(
                    draw_negatives(
                        source.positive_rows, h, rng, len(self.passage_inputs), self.keys, source.relevant_keys[i]
                    )
                )
        all_rows = pos_rows + neg_rows
        keys = [int(self.keys[r]) for r in all_rows]
        mask = false_negative_mask(
            positive_keys=keys[:n], passage_keys=keys, relevant_keys=relevant, positive_index=list(range(n))
        )
        query_texts = [self.query_texts[i] for i in batch] + [source.query_texts[i] for source, i in mixed]
        b = n // world
        local = slice(rank * b, (rank + 1) * b)
        local_neg = neg_rows[rank * b * h : (rank + 1) * b * h]
        extras = {} if self.teacher is None else {"teacher_scores": self._teacher_scores(batch, pos_rows, neg_rows)}
        return TrainingBatch(
            query_texts=query_texts[local],
            passage_texts=[self.passage_inputs[r] for r in pos_rows[local] + local_neg],
            n_local_queries=b,
            positive_index=torch.arange(n),
            mask=mask,
            passage_keys=torch.tensor(keys, dtype=torch.long),
            relevant_keys=[keys_of | {keys[j]} for j, keys_of in enumerate(relevant)],
            extras=extras,
        )

    def _teacher_scores(self, batch: Sequence[int], pos_rows: list[int], neg_rows: list[int]) -> torch.Tensor:
        """[B, 1 + h]: the teacher's score of each query's positive, then of its drawn negatives (NaN: unscored)."""
        h = self.negatives_per_query
        rows = [[p, *neg_rows[j * h : (j + 1) * h]] for j, p in enumerate(pos_rows)]
        values = [[self.teacher[i].get(r, float("nan")) for r in row] for i, row in zip(batch, rows)]
        return torch.tensor(values, dtype=torch.float32)
