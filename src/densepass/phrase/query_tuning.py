"""Query-side fine-tuning (DensePhrases; training-inference-gap §4.1): only the question encoder is trained,
against a fixed phrase index of the training passages, with hard negatives from that index.

For each training question the current question vectors retrieve the index's top-k phrases (no gradient);
the candidates are those phrases plus the annotated gold phrase. Candidates whose text matches an answer
(exact match after SQuAD normalisation) are positives, the others are the question's hard negatives, and
the loss is the negative log of the positives' share of the softmax over the candidates (the marginal
likelihood of the correct phrases among the retrieved ones):

    L = -log sum_{c in positives} e^{s(q, c)} + log sum_{c in candidates} e^{s(q, c)},
    s(q, (i, j)) = <q_start, start_i> + <q_end, end_j>.

The phrase side is frozen, so the index stays valid. The training engine (``training.engine``) runs it.

Under torch.distributed every process holds the step's questions (rank 0's plan), encodes its share of them
(``training.distributed.shares``) and gathers every process's question vectors (only its own carry gradient): each
retrieves the candidates and computes the loss of the global step, and the engine sums the gradients, so the update
is that of one process on the whole step.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from typing_extensions import override

from densepass import distributed
from densepass.checkpoints import training_identity
from densepass.data.squad import SquadSpans
from densepass.device import autocast_context
from densepass.errors import ConfigError
from densepass.models.dropout import use_cpu_dropout
from densepass.phrase.batches import PhraseExample
from densepass.phrase.config import QueryTuningConfig
from densepass.phrase.index import PhraseIndex
from densepass.phrase.metrics import exact_match
from densepass.phrase.model import PhraseEncoder
from densepass.phrase.span_search import top_spans
from densepass.phrase.train import PhraseModelTask
from densepass.phrase.windows import char_span_to_tokens
from densepass.training import engine
from densepass.training.distributed import gather_rows, shares


def gold_rows(index: PhraseIndex, data: SquadSpans, qids: Sequence[str]) -> dict[str, tuple[int, int]]:
    """Index rows (start, end) of each question's annotated phrase (its first answer span), for the questions
    whose passage is in the index."""
    out = {}
    for qid in qids:
        pid = data.passage.get(qid)
        if pid is None or pid not in index.passages:
            continue
        p = index.passages.position(pid)
        lo, hi = index.bounds[p], index.bounds[p + 1]
        span = data.spans[qid][0]
        tokens = char_span_to_tokens(index.offsets[lo:hi], span.start, span.end)
        if tokens is not None:
            out[qid] = (int(lo + tokens[0]), int(lo + tokens[1]))
    return out


def marginal_loss(scores: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
    """Mean of -log (softmax mass of the positive candidates) over rows; ``scores`` [B, C] (-inf: no candidate),
    ``positive`` [B, C] booleans with at least one positive per row."""
    return (torch.logsumexp(scores, 1) - torch.logsumexp(scores.masked_fill(~positive, float("-inf")), 1)).mean()


class QueryTuningTask(PhraseModelTask):
    """The question encoder of ``model`` trained against ``index`` (its phrase side frozen): each step retrieves
    the top-k phrases of its questions without gradient, then minimises the marginal loss over them and the gold
    phrase; under torch.distributed each process encodes its share of the questions (module docstring)."""

    section = "query_tuning"
    description = "query-side fine-tuning"
    distributed = True

    def __init__(
        self,
        model: PhraseEncoder,
        index: PhraseIndex,
        examples: list[PhraseExample],
        gold: dict[str, tuple[int, int]],
        config: QueryTuningConfig,
    ) -> None:
        if index.threshold is not None:
            raise ConfigError("query-side fine-tuning needs an unfiltered index of the training passages")
        self.examples = [e for e in examples if e.qid in gold]
        if not self.examples:
            raise ConfigError("no training question has its gold phrase in the index")
        if len(index.stored["start"][1]) != len(index.offsets):
            raise ConfigError("query-side fine-tuning needs every token's vectors in the index")
        self.model, self.index, self.gold, self.config = model, index, gold, config
        self.steps_per_epoch, self.epochs = -(-len(self.examples) // config.batch_size), config.epochs
        self.passage_of_row = index.passage_of_row.numpy()

    @override
    def setup(self, device: torch.device) -> None:
        use_cpu_dropout(self.model.to(device).train(), device)  # on the CPU, faster dropout masks (models.dropout)
        for module in self.model.phrase_modules():
            module.eval()
            module.requires_grad_(False)
        stored = self.index.stored
        self.start_vectors = torch.from_numpy(np.asarray(stored["start"][1], dtype=np.float32)).to(device)
        self.end_vectors = torch.from_numpy(np.asarray(stored["end"][1], dtype=np.float32)).to(device)

    @override
    def parameter_groups(self) -> list[dict]:
        return [{"params": [p for m in self.model.question_modules() for p in m.parameters()]}]

    @override
    def plan(self, epoch: int) -> list[list[PhraseExample]]:
        size = self.config.batch_size
        order = np.random.default_rng([self.config.seed, epoch]).permutation(len(self.examples))
        return [[self.examples[i] for i in order[lo : lo + size]] for lo in range(0, len(order), size)]

    def candidates(self, batch: list[PhraseExample], q_start: torch.Tensor, q_end: torch.Tensor):
        """Each question's gold phrase, then its top-k phrases under the current question vectors (rows of the
        index, -1 where fewer exist), and which of them are correct (their text matches an answer)."""
        index = self.index
        with torch.no_grad():
            a, b = (q_start.detach() @ self.start_vectors.T).cpu(), (q_end.detach() @ self.end_vectors.T).cpu()
            _, starts, ends = top_spans(a, b, index.limit, self.config.top_k)
        gold_starts = torch.tensor([[self.gold[e.qid][0]] for e in batch], dtype=starts.dtype)
        gold_ends = torch.tensor([[self.gold[e.qid][1]] for e in batch], dtype=ends.dtype)
        again = (starts == gold_starts) & (ends == gold_ends)  # the gold retrieved too: a candidate once, not twice
        starts, ends = starts.masked_fill(again, -1), ends.masked_fill(again, -1)
        starts, ends = torch.cat([gold_starts, starts], 1), torch.cat([gold_ends, ends], 1)
        positive = torch.zeros(starts.shape, dtype=torch.bool)
        positive[:, 0] = True
        texts = index.passages.texts
        for i, e in enumerate(batch):
            for j in range(1, starts.shape[1]):
                s, t = int(starts[i, j]), int(ends[i, j])
                if s >= 0:
                    text = texts[self.passage_of_row[s]][index.offsets[s, 0] : index.offsets[t, 1]]
                    positive[i, j] = exact_match(text, e.answers)
        return starts, ends, positive

    @override
    def step(self, batch: list[PhraseExample], context: engine.StepContext) -> engine.StepOutput:
        device = context.device
        parts = shares(len(batch))
        mine = parts[distributed.rank()]
        if len(mine):  # padded as the whole step's questions, so that each is encoded as in one process
            questions = self.model.tokenize_questions([e.question for e in batch])
            with autocast_context(device, context.bf16):
                q_start, q_end = self.model.question_vectors(
                    {k: v[mine.start : mine.stop].to(device) for k, v in questions.items()}
                )
            q_start, q_end = q_start.float(), q_end.float()
        else:  # more processes than questions: this one encodes none
            q_start = q_end = torch.zeros(0, self.model.dim, device=device)
        counts = [len(part) for part in parts]
        q_start, q_end = gather_rows(q_start, counts), gather_rows(q_end, counts)
        starts, ends, positive = self.candidates(batch, q_start, q_end)
        valid = starts >= 0
        safe_start, safe_end = starts.clamp_min(0).to(device), ends.clamp_min(0).to(device)
        scores = (q_start[:, None, :] * self.start_vectors[safe_start]).sum(-1) + (
            q_end[:, None, :] * self.end_vectors[safe_end]
        ).sum(-1)
        loss = marginal_loss(scores.masked_fill(~valid.to(device), float("-inf")), positive.to(device))
        if loss.requires_grad:  # not when this process encoded no question
            loss.backward()
        terms = {"positives": positive.sum(1).float().mean()}
        return engine.StepOutput(loss.detach(), size=len(batch), terms=terms)

    @override
    def finish(self) -> None:
        for module in self.model.phrase_modules():
            module.requires_grad_(True)


def tune_question_encoder(
    model: PhraseEncoder,
    index: PhraseIndex,
    examples: list[PhraseExample],
    gold: dict[str, tuple[int, int]],
    config: QueryTuningConfig,
    run_dir: Path,
    device: torch.device,
    show_progress: bool = True,
    identity: dict | None = None,
) -> dict:
    """Fine-tune ``model``'s question encoder in place against ``index`` (the phrase side is frozen);
    ``gold``: index rows (start, end) of each example's annotated phrase. Resumes from ``run_dir``;
    ``identity``: the caller's settings that define the run besides ``config`` (its data files)."""
    task = QueryTuningTask(model, index, examples, gold, config)
    result = engine.fit(
        task,
        config,
        run_dir,
        device,
        total=task.steps_per_epoch * config.epochs,
        identity={"query_tuning": training_identity(config), **(identity or {})},
        show_progress=show_progress,
    )
    return {"steps": result.steps, "seconds": result.seconds, "questions": len(task.examples)}
