"""Model-based hard negatives for phrase retrieval (training-inference-gap §4.3.1).

A trained model indexes the training passages; each training question retrieves its top-k phrases, and the
passages of those phrases that contain none of its answer strings (SQuAD normalisation, token boundaries)
become its hard negatives, best first. The list is saved as JSONL (``{"qid", "negatives": [passage ids]}``)
with the number of retrieved passages removed because they contain an answer.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from densepass.data.dataset import Corpus
from densepass.data.squad import SquadSpans
from densepass.errors import DataError
from densepass.evaluation.answers import has_answer
from densepass.io import atomic_write_text
from densepass.phrase.index import PhraseIndex
from densepass.phrase.model import PhraseEncoder


@dataclass
class MinedNegatives:
    """Hard-negative passage ids per question, and how many retrieved passages were dropped as answers."""

    negatives: dict[str, list[str]]
    retrieved: int
    removed: int

    def save(self, path: str | Path) -> None:
        """Write the JSONL file (one question a line)."""
        lines = (json.dumps({"qid": q, "negatives": n}) for q, n in self.negatives.items())
        atomic_write_text(path, "".join(f"{line}\n" for line in lines))

    def as_rows(self, corpus: Corpus) -> dict[str, list[int]]:
        """The negatives as corpus rows."""
        return {q: [corpus.position(p) for p in ids] for q, ids in self.negatives.items()}


def read_negatives(path: str | Path, corpus: Corpus, training: Collection[str] | None = None) -> MinedNegatives:
    """Read a hard-negatives JSONL file; a passage id not in the corpus is an error, and so is one outside
    ``training`` (the ids of the training split's passages, where given): training on an evaluation passage would
    leak it, and the training batches hold only the training passages."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"hard-negatives file not found: {path}")
    negatives = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            qid, ids = str(record["qid"]), [str(p) for p in record["negatives"]]
        except (ValueError, KeyError, TypeError):
            raise DataError(f'{path}:{number}: expected {{"qid": ..., "negatives": [...]}}') from None
        missing = next((p for p in ids if p not in corpus), None)
        if missing is not None:
            raise DataError(f"{path}:{number}: passage {missing!r} is not in the corpus")
        outside = next((p for p in ids if p not in training), None) if training is not None else None
        if outside is not None:
            raise DataError(f"{path}:{number}: passage {outside!r} is not a passage of the training split")
        negatives[qid] = ids
    return MinedNegatives(negatives, 0, 0)


def mine_hard_negatives(
    model: PhraseEncoder,
    data: SquadSpans,
    rows: Sequence[int],
    qids: Sequence[str],
    depth: int,
    device: torch.device,
    batch_size: int = 32,
) -> MinedNegatives:
    """Hard negatives of ``qids`` among the passages at corpus ``rows``: the passages of each question's top
    ``depth`` phrases that hold none of its answers."""
    corpus = data.dataset.corpus
    passages = corpus.subset(list(rows))
    index = PhraseIndex.build(model, passages, device=device, batch_size=batch_size, vector_dtype="float32")
    negatives, retrieved, removed = {}, 0, 0
    step = 64
    for lo in range(0, len(qids), step):
        chunk = list(qids[lo : lo + step])
        results = index.search([data.dataset.queries[q] for q in chunk], depth)
        for i, qid in enumerate(chunk):
            answers = [s.text for s in data.spans[qid]]
            found = list(dict.fromkeys(results.ids(i)))
            kept = [p for p in found if not has_answer(passages.texts[passages.position(p)], answers)]
            retrieved += len(found)
            removed += len(found) - len(kept)
            negatives[qid] = kept
    return MinedNegatives(negatives, retrieved, removed)
