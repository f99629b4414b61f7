"""Query-side fine-tuning (DensePhrases; training-inference-gap §4.1): only the question encoder is trained,
against a fixed phrase index of the training passages, with hard negatives from that index.

For each training question the current question vectors retrieve the index's top-k phrases (no gradient);
the candidates are those phrases plus the annotated gold phrase. Candidates whose text matches an answer
(exact match after SQuAD normalisation) are positives, the others are the question's hard negatives, and
the loss is the negative log of the positives' share of the softmax over the candidates (the marginal
likelihood of the correct phrases among the retrieved ones):

    L = -log sum_{c in positives} e^{s(q, c)} + log sum_{c in candidates} e^{s(q, c)},
    s(q, (i, j)) = <q_start, start_i> + <q_end, end_j>.

The phrase side is frozen, so the index stays valid. Checkpoints and resume are as in ``phrase.train``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm
from transformers import get_linear_schedule_with_warmup

from densepass.checkpoints import Checkpoints, trim_log, without_later_defaults
from densepass.data.squad import SquadSpans
from densepass.errors import ConfigError
from densepass.models.dropout import use_cpu_dropout
from densepass.numerics import DivergenceGuard
from densepass.phrase.batches import PhraseExample
from densepass.phrase.config import QueryTuningConfig
from densepass.phrase.index import PhraseIndex
from densepass.phrase.metrics import exact_match
from densepass.phrase.model import PhraseEncoder
from densepass.phrase.spans import top_spans
from densepass.phrase.train import restore_training
from densepass.phrase.windows import char_span_to_tokens
from densepass.training.trainer import seed_everything


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
    if index.threshold is not None:
        raise ConfigError("query-side fine-tuning needs an unfiltered index of the training passages")
    examples = [e for e in examples if e.qid in gold]
    if not examples:
        raise ConfigError("no training question has its gold phrase in the index")
    seed_everything(config.seed)
    run_dir.mkdir(parents=True, exist_ok=True)
    use_cpu_dropout(model.to(device).train(), device)  # on the CPU, faster dropout masks (models.dropout)
    for module in model.phrase_modules():
        module.eval()
        module.requires_grad_(False)
    parameters = [p for m in model.question_modules() for p in m.parameters()]
    steps_per_epoch = -(-len(examples) // config.batch_size)
    total = steps_per_epoch * config.epochs
    optimizer = torch.optim.AdamW(parameters, lr=config.learning_rate, fused=True)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(config.warmup_ratio * total), total)
    settings = without_later_defaults({k: v for k, v in asdict(config).items() if k != "checkpoint_every"})
    checkpoints = Checkpoints(run_dir, 1, {"query_tuning": settings, **(identity or {})})
    log_path = run_dir / "train_log.jsonl"
    step = 0
    guard = DivergenceGuard(config.skip_nonfinite, "query_tuning")
    resumed = checkpoints.latest()
    if resumed is not None:
        restore_training(resumed, model, optimizer, scheduler, device)
        guard.load_state_dict(resumed.extra.get("nonfinite"))
        step = resumed.step
    trim_log(log_path, step)
    start_vectors = torch.from_numpy(np.asarray(index.stored["start"][1], dtype=np.float32)).to(device)
    end_vectors = torch.from_numpy(np.asarray(index.stored["end"][1], dtype=np.float32)).to(device)
    if len(start_vectors) != len(index.offsets):
        raise ConfigError("query-side fine-tuning needs every token's vectors in the index")
    texts = index.passages.texts
    passage_of_row = index.passage_of_row.numpy()
    started = time.perf_counter()
    progress = tqdm(total=total, initial=step, desc="query-side fine-tuning", disable=not show_progress)
    for epoch in range(step // steps_per_epoch, config.epochs):
        order = np.random.default_rng([config.seed, epoch]).permutation(len(examples))
        for index_in_epoch in range(steps_per_epoch):
            if epoch * steps_per_epoch + index_in_epoch < step:
                continue
            batch = [
                examples[i]
                for i in order[index_in_epoch * config.batch_size : (index_in_epoch + 1) * config.batch_size]
            ]
            questions = {k: v.to(device) for k, v in model.tokenize_questions([e.question for e in batch]).items()}
            q_start, q_end = model.question_vectors(questions)
            with torch.no_grad():
                a, b = (q_start.detach() @ start_vectors.T).cpu(), (q_end.detach() @ end_vectors.T).cpu()
                _, starts, ends = top_spans(a, b, index.limit, config.top_k)
            candidates_start = torch.cat([torch.tensor([[gold[e.qid][0]] for e in batch]), starts], 1)
            candidates_end = torch.cat([torch.tensor([[gold[e.qid][1]] for e in batch]), ends], 1)
            positive = torch.zeros(candidates_start.shape, dtype=torch.bool)
            positive[:, 0] = True
            for i, e in enumerate(batch):
                for j in range(1, candidates_start.shape[1]):
                    s, t = int(candidates_start[i, j]), int(candidates_end[i, j])
                    if s >= 0:
                        text = texts[passage_of_row[s]][index.offsets[s, 0] : index.offsets[t, 1]]
                        positive[i, j] = exact_match(text, e.answers)
            valid = candidates_start >= 0
            safe_start, safe_end = candidates_start.clamp_min(0).to(device), candidates_end.clamp_min(0).to(device)
            scores = (q_start[:, None, :] * start_vectors[safe_start]).sum(-1) + (
                q_end[:, None, :] * end_vectors[safe_end]
            ).sum(-1)
            scores = scores.masked_fill(~valid.to(device), float("-inf"))
            loss = marginal_loss(scores, positive.to(device))
            loss.backward()
            taken, _ = guard.step(step + 1, loss, parameters, optimizer, scheduler)
            step += 1
            progress.update(1)
            with open(log_path, "a") as handle:
                record = {
                    "step": step,
                    "loss": float(loss.detach()) if taken else None,  # a skipped batch's loss: not a number
                    "positives": float(positive.sum(1).float().mean()),
                    **({"skipped": guard.skipped} if guard.skipped else {}),
                }
                handle.write(json.dumps(record) + "\n")
            if step % config.checkpoint_every == 0 or step == total:
                guard.check_weights(step, model.named_parameters())
                extra = {"nonfinite": guard.state_dict()}
                checkpoints.save(step, lambda directory: model.save(directory / "model"), optimizer, scheduler, extra)
    progress.close()
    for module in model.phrase_modules():
        module.requires_grad_(True)
    return {"steps": step, "seconds": time.perf_counter() - started, "questions": len(examples)}
