"""Shared helpers of the phrase tests: a small SQuAD-layout dataset with exact answer offsets, and a tiny
random phrase model."""

from __future__ import annotations

import json
import random
from pathlib import Path

from conftest import save_tiny_bert
from densepass.phrase.config import PhraseModelConfig
from densepass.phrase.model import PhraseEncoder

WORDS = (
    "audio video editor library game network terminal python font image mail server kernel driver printer "
    "music player browser database compiler shell backup archive viewer Denver Tesla Paris river castle"
).split()
SMALL = PhraseModelConfig(max_length=40, stride=8, title_max_tokens=4, max_answer_tokens=5, question_max_length=16)


def squad_article(title: str, n_paragraphs: int, rng: random.Random, prefix: str, words: int = 30) -> dict:
    paragraphs = []
    for p in range(n_paragraphs):
        tokens = [rng.choice(WORDS) for _ in range(rng.randint(8, words))]
        context = " ".join(tokens)
        qas = []
        for q in range(rng.randint(1, 3)):
            first = rng.randrange(len(tokens))
            last = min(len(tokens) - 1, first + rng.randint(0, 2))
            answer = " ".join(tokens[first : last + 1])
            start = len(" ".join(tokens[:first])) + (1 if first else 0)
            assert context[start : start + len(answer)] == answer
            question = " ".join(rng.choice(WORDS) for _ in range(4)) + f" {tokens[first]}?"
            qas.append(
                {
                    "id": f"{prefix}{title}-{p}-{q}",
                    "question": question,
                    "answers": [{"text": answer, "answer_start": start}],
                }
            )
        paragraphs.append({"context": context, "qas": qas})
    return {"title": title, "paragraphs": paragraphs}


def write_phrase_squad(root: Path, seed: int = 0, words: int = 30) -> Path:
    """train: 3 articles of 4 paragraphs; dev: 1 article of 3 paragraphs (1-3 questions each)."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    train = {"data": [squad_article(f"T{a}", 4, rng, "t", words) for a in range(3)]}
    dev = {"data": [squad_article("D0", 3, rng, "d", words)]}
    (root / "train-v1.1.json").write_text(json.dumps(train))
    (root / "dev-v1.1.json").write_text(json.dumps(dev))
    return root


def tiny_phrase_model(path: Path, config: PhraseModelConfig = SMALL, dropout: float = 0.0) -> PhraseEncoder:
    """A 2-layer, 32-dim random BERT as both towers (saved under ``path``)."""
    save_tiny_bert(path, dropout=dropout)
    return PhraseEncoder.from_pretrained(str(path), config)
