"""The phrase encoder and the question encoder (DensePhrases, as in training-inference-gap §4.1).

The phrase encoder (a BERT-family model) gives every token of a passage window a hidden vector h_t; a start
vector W_s h_t and an end vector W_e h_t. The question encoder (a second model, so that query-side
fine-tuning can update it alone) pools the question's tokens (mean or CLS) into q and gives a start vector
U_s q and an end vector U_e q. The score of the phrase from token i to token j is

    s(q, (i, j)) = <U_s q, W_s h_i> + <U_e q, W_e h_j>,  i <= j < i + max_answer_tokens.

The four heads start as identities (the pre-trained geometry), so an untrained model already scores tokens
by their similarity with the question. The token filter (``phrase.token_filter``) adds two linear logits, one on
the start vectors and one on the end vectors. Saved as ``phrase/`` and ``question/`` (each loadable by
``transformers.AutoModel``), ``heads.safetensors`` and ``phrase.json``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModel, AutoTokenizer, PreTrainedTokenizerBase

from densepass.config import from_dict
from densepass.errors import ConfigError
from densepass.io import atomic_directory, atomic_write_text
from densepass.models.biencoder import check_model_files, resolve_model_path, token_pooling
from densepass.models.inputs import check_position_limit
from densepass.models.kinds import loading_weights
from densepass.numerics import refuse_nonfinite_weights
from densepass.phrase.config import PhraseModelConfig
from densepass.phrase.windows import TokenizedPassage, Window, tokenize_passages

CONFIG_NAME = "phrase.json"
HEADS = "heads.safetensors"


def _identity(size: int) -> nn.Linear:
    layer = nn.Linear(size, size)
    with torch.no_grad():
        layer.weight.copy_(torch.eye(size))
        layer.bias.zero_()
    return layer


class TokenFilter(nn.Module):
    """Two linear logits over token vectors: is this token the start (end) of an answer (training-inference-gap §5)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.start = nn.Linear(dim, 1)
        self.end = nn.Linear(dim, 1)

    def forward(self, start: torch.Tensor, end: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Start and end logits of token vectors [..., dim] -> [...]."""
        return self.start(start).squeeze(-1), self.end(end).squeeze(-1)


class PhraseEncoder(nn.Module):
    """Phrase and question towers with start/end heads; see the module docstring."""

    def __init__(
        self,
        phrase_encoder: nn.Module,
        question_encoder: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        config: PhraseModelConfig,
    ) -> None:
        super().__init__()
        self.phrase_encoder, self.question_encoder = phrase_encoder, question_encoder
        self.tokenizer, self.config = tokenizer, config
        hidden = phrase_encoder.config.hidden_size
        if question_encoder.config.hidden_size != hidden:
            raise ConfigError("the phrase and question encoders must have the same hidden size")
        check_position_limit(phrase_encoder.config, {"model.max_length": config.max_length})
        check_position_limit(question_encoder.config, {"model.question_max_length": config.question_max_length})
        self.start, self.end = _identity(hidden), _identity(hidden)
        self.question_start, self.question_end = _identity(hidden), _identity(hidden)
        self.filter: TokenFilter | None = None
        self.source: str | None = None

    @property
    def dim(self) -> int:
        """Size of the start and end vectors."""
        return self.start.out_features

    def phrase_modules(self) -> list[nn.Module]:
        """The modules that make the indexed vectors (what an index's fingerprint covers)."""
        return [self.phrase_encoder, self.start, self.end]

    def question_modules(self) -> list[nn.Module]:
        """The modules query-side fine-tuning trains."""
        return [self.question_encoder, self.question_start, self.question_end]

    # ---- vectors ------------------------------------------------------------------------------------

    def phrase_vectors(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Start and end vectors [W, L, dim] of a batch of windows (``collate_windows`` output)."""
        hidden = self.phrase_encoder(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], token_type_ids=batch["token_type_ids"]
        ).last_hidden_state.float()
        return self.start(hidden), self.end(hidden)

    def question_vectors(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Start and end vectors [Q, dim] of tokenised questions."""
        hidden = self.question_encoder(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
        pooled = token_pooling(hidden.last_hidden_state, batch["attention_mask"], self.config.pooling)
        return self.question_start(pooled), self.question_end(pooled)

    # ---- inputs -------------------------------------------------------------------------------------

    def tokenize_questions(self, texts: Sequence[str]) -> dict[str, torch.Tensor]:
        """Padded question tensors."""
        return self.tokenizer(
            list(texts), truncation=True, max_length=self.config.question_max_length, padding=True, return_tensors="pt"
        )

    def tokenize_passages(self, titles: Sequence[str], texts: Sequence[str]) -> list[TokenizedPassage]:
        """Windows and token tables of passages, with this model's window settings."""
        c = self.config
        return tokenize_passages(self.tokenizer, titles, texts, c.max_length, c.stride, c.title_max_tokens)

    def collate_windows(self, windows: Sequence[Window]) -> dict[str, torch.Tensor]:
        """Windows padded into one batch."""
        length = max(len(w.input_ids) for w in windows)
        pad = self.tokenizer.pad_token_id or 0
        ids = torch.full((len(windows), length), pad, dtype=torch.long)
        types = torch.zeros((len(windows), length), dtype=torch.long)
        mask = torch.zeros((len(windows), length), dtype=torch.long)
        for i, w in enumerate(windows):
            ids[i, : len(w.input_ids)] = torch.tensor(w.input_ids)
            types[i, : len(w.input_ids)] = torch.tensor(w.token_type_ids)
            mask[i, : len(w.input_ids)] = 1
        return {"input_ids": ids, "token_type_ids": types, "attention_mask": mask}

    @torch.no_grad()
    def encode_questions(
        self, texts: Sequence[str], batch_size: int = 64, device: torch.device | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Start and end vectors [n, dim] (float32) of question texts."""
        if isinstance(texts, str):
            raise ConfigError("encode_questions takes a list of questions, not one string")
        device = device or next(self.parameters()).device
        was_training = self.training
        self.eval()
        starts, ends = [], []
        for lo in range(0, len(texts), batch_size):
            batch = {k: v.to(device) for k, v in self.tokenize_questions(texts[lo : lo + batch_size]).items()}
            start, end = self.question_vectors(batch)
            starts.append(start.float().cpu().numpy())
            ends.append(end.float().cpu().numpy())
        self.train(was_training)
        empty = np.zeros((0, self.dim), dtype=np.float32)
        return (np.concatenate(starts) if starts else empty), (np.concatenate(ends) if ends else empty)

    # ---- persistence --------------------------------------------------------------------------------

    def heads_state(self) -> dict[str, torch.Tensor]:
        """The heads' (and the filter's) weights by name."""
        modules = {"start": self.start, "end": self.end, "question_start": self.question_start}
        modules["question_end"] = self.question_end
        if self.filter is not None:
            modules["filter"] = self.filter
        return {
            f"{name}.{key}": value.detach().cpu().contiguous()
            for name, module in modules.items()
            for key, value in module.state_dict().items()
        }

    def save(self, path: str | Path) -> None:
        """Write the model atomically (weights holding NaN or infinity are refused)."""
        refuse_nonfinite_weights(self, str(path), saving=True)
        with atomic_directory(path) as tmp:
            for name, encoder in (("phrase", self.phrase_encoder), ("question", self.question_encoder)):
                encoder.save_pretrained(tmp / name, safe_serialization=True)
                self.tokenizer.save_pretrained(tmp / name)
            save_file(self.heads_state(), str(tmp / HEADS))
            atomic_write_text(tmp / CONFIG_NAME, json.dumps(asdict(self.config), indent=2))

    def load_heads(self, path: Path) -> None:
        """Set the heads (and the filter, when saved) from ``heads.safetensors``."""
        with loading_weights(path.parent, path.name):
            state = load_file(str(path))
        if any(key.startswith("filter.") for key in state):
            self.filter = TokenFilter(self.dim)
        for name in ("start", "end", "question_start", "question_end", "filter"):
            module = getattr(self, name)
            if module is not None:
                module.load_state_dict({k.split(".", 1)[1]: v for k, v in state.items() if k.split(".", 1)[0] == name})

    @classmethod
    def from_pretrained(cls, name_or_path: str, config: PhraseModelConfig | None = None) -> PhraseEncoder:
        """A saved phrase model, or a new one whose two towers start from any BERT-family model.

        A saved model keeps its own window and pooling settings unless ``config`` is given."""
        saved = Path(name_or_path) / CONFIG_NAME
        path = Path(name_or_path) if saved.is_file() else Path(resolve_model_path(name_or_path))
        if saved.is_file():
            for tower in ("phrase", "question"):  # a tower asking for code of its own: refused before transformers
                check_model_files(path / tower)
            stored = from_dict(PhraseModelConfig, json.loads(saved.read_text()), str(saved))
            with loading_weights(path / "phrase"):
                phrase = AutoModel.from_pretrained(path / "phrase")
            with loading_weights(path / "question"):
                question = AutoModel.from_pretrained(path / "question")
            model = cls(phrase, question, AutoTokenizer.from_pretrained(path / "phrase"), config or stored)
            model.load_heads(path / HEADS)
            refuse_nonfinite_weights(model, str(path), saving=False)
        else:
            with loading_weights(path):
                phrase, question = AutoModel.from_pretrained(path), AutoModel.from_pretrained(path)
            model = cls(phrase, question, AutoTokenizer.from_pretrained(path), config or PhraseModelConfig())
        model.phrase_encoder.float()
        model.question_encoder.float()
        model.source = str(path)
        return model
