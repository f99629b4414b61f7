"""Condenser (condenser §3.3-3.4) and coCondenser (abs-condenser-openqa §3.3) over a BERT backbone.

The backbone (a ``transformers`` BertModel) runs as usual, split into early layers (eq. 6) and late
layers (eq. 7). The head, ``head_layers`` BertLayers initialised at random, reads the late CLS with the
early token states (the short circuit, eq. 8):

    [h_cls^cd; h^cd] = Head([h_cls^late; h^early])

so new information from the late layers reaches the head only through the late CLS. Losses:

* ``mlm``: MLM on the late outputs only, i.e. exactly ``BertForMaskedLM`` (the baseline);
* ``condenser``: head MLM (eq. 9) + backbone MLM on the late outputs (eq. 10 of condenser, the
  "semantic constraint"), eq. 11: L = L_mlm + L_mlm^c, with one MLM prediction head (transform, bias,
  and the output matrix W tied to the word embeddings) shared by both terms;
* ``cocondenser``: the Condenser MLM plus the span contrastive loss on the late CLS (eq. 10 of
  abs-condenser-openqa), eq. 11 there: (1 / 2n) sum_ij [L_ij^mlm + L_ij^co].

Each MLM term is the mean cross-entropy over the batch's masked tokens (as ``BertForMaskedLM`` and the
reference Condenser code compute it) rather than a mean of per-span sums; the contrastive term is the
mean over the 2n spans. After pre-training the head is dropped: ``save_backbone`` writes a plain
BertModel.

Everything starts from the checkpoint but the head (condenser §3.4): the MLM prediction head too, where the
checkpoint has one (a ``BertForMaskedLM``'s ``cls.predictions``); a checkpoint without one (a plain encoder such as
all-MiniLM-L6-v2) starts it at random.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModel, PreTrainedTokenizerBase
from transformers.masking_utils import create_bidirectional_mask
from transformers.models.bert.modeling_bert import BertLayer, BertOnlyMLMHead

from densepass.errors import ConfigError
from densepass.losses.contrastive import contrastive_loss
from densepass.models.biencoder import BiEncoder, BiEncoderConfig
from densepass.pretraining.config import Mode
from densepass.pretraining.masking import IGNORE

MODES = ("mlm", "condenser", "cocondenser")


MLM_HEAD_KEYS = (  # a BertForMaskedLM's prediction head (``cls.``), but the decoder's weight (the embeddings)
    "predictions.bias",
    "predictions.transform.dense.weight",
    "predictions.transform.dense.bias",
    "predictions.transform.LayerNorm.weight",
    "predictions.transform.LayerNorm.bias",
)


def checkpoint_mlm_head(path: Path) -> dict[str, torch.Tensor] | None:
    """The MLM prediction head of the checkpoint in ``path`` (its ``cls.predictions`` tensors in its safetensors
    files, as ``BertOnlyMLMHead`` names them), or None where it has none, or only part of one."""
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            for key in handle.keys():  # noqa: SIM118 (a safetensors handle is no dict)
                name = key.removeprefix("cls.")
                if key.startswith("cls.") and name in MLM_HEAD_KEYS:
                    found[name] = handle.get_tensor(key).float()
    return found if set(found) == set(MLM_HEAD_KEYS) else None


@dataclass
class CondenserOutput:
    """Per-batch MLM terms and the late CLS vectors (for the contrastive loss)."""

    late_mlm: torch.Tensor  # mean CE of W h^late over masked tokens (condenser eq. 10)
    head_mlm: torch.Tensor | None  # mean CE of W h^cd over masked tokens (eq. 9); None in mlm mode
    cls: torch.Tensor  # [B, H] late CLS
    n_masked: int

    @property
    def mlm(self) -> torch.Tensor:
        """The MLM terms of the objective: late, plus head in Condenser modes."""
        return self.late_mlm if self.head_mlm is None else self.late_mlm + self.head_mlm


def head_input(early: torch.Tensor, late: torch.Tensor) -> torch.Tensor:
    """The head's input of eq. 8: [h_cls^late; h^early] (late CLS, then early states of tokens 1..L)."""
    return torch.cat([late[:, :1], early[:, 1:]], dim=1)


def mlm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the positions whose label is not -100 (eq. 9/10 up to normalisation);
    0 when nothing is masked (so that a micro-batch without masked tokens adds nothing)."""
    total = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE, reduction="sum"
    )
    return total / (labels != IGNORE).sum().clamp_min(1)


def span_contrastive_loss(cls: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """abs-condenser-openqa eq. 10, averaged over the 2n spans: rows 2i and 2i + 1 are the two spans of
    document i; each span's positive is its partner and every other span of the batch (not itself) is a
    negative, scored by dot products of the late CLS vectors."""
    n = cls.shape[0]
    if n < 2 or n % 2:
        raise ConfigError(f"the span contrastive loss needs an even number (>= 2) of spans, got {n}")
    partner = torch.arange(n, device=cls.device) ^ 1
    self_mask = torch.eye(n, dtype=torch.bool, device=cls.device)
    return contrastive_loss(cls, cls, partner, temperature, mask=self_mask)


class Condenser(nn.Module):
    """A BertModel backbone with an optional Condenser head and one shared MLM prediction head."""

    def __init__(
        self,
        backbone: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        mode: Mode = "condenser",
        early_layers: int = 3,
        head_layers: int = 2,
        temperature: float = 1.0,
    ) -> None:
        super().__init__()
        if mode not in MODES:
            raise ConfigError(f"unknown pre-training mode {mode!r} (known: {', '.join(MODES)})")
        layers = getattr(getattr(backbone, "encoder", None), "layer", None)
        if layers is None or not hasattr(backbone, "embeddings"):
            raise ConfigError(f"{type(backbone).__name__} is not a BERT-family encoder (embeddings + encoder.layer)")
        if mode != "mlm" and not 1 <= early_layers < len(layers):
            raise ConfigError(f"early_layers must be in [1, {len(layers) - 1}] for a {len(layers)}-layer backbone")
        if mode != "mlm" and head_layers < 1:
            raise ConfigError(f"head_layers must be >= 1, got {head_layers}")
        if temperature <= 0:
            raise ConfigError(f"temperature must be positive, got {temperature}")
        self.backbone = backbone
        self.tokenizer = tokenizer
        self.mode = mode
        self.early_layers = early_layers
        self.temperature = temperature
        config = backbone.config
        self.head = nn.ModuleList([BertLayer(config) for _ in range(head_layers)]) if mode != "mlm" else None
        self.mlm_head = BertOnlyMLMHead(config)
        init = backbone._init_weights
        for module in [self.mlm_head, *(self.head or [])]:
            module.apply(init)
        predictions = self.mlm_head.predictions
        predictions.decoder.weight = backbone.embeddings.word_embeddings.weight  # W tied to the embeddings
        predictions.decoder.bias = predictions.bias

    @classmethod
    def from_pretrained(
        cls,
        name_or_path: str,
        mode: Mode = "condenser",
        early_layers: int = 3,
        head_layers: int = 2,
        temperature: float = 1.0,
    ) -> Condenser:
        """Backbone (and tokenizer) from a pre-trained model, the MLM prediction head from it too where it has one
        (else at random), the head at random."""
        from transformers import AutoTokenizer

        from densepass.models.biencoder import resolve_model_path
        from densepass.models.kinds import loading_weights

        path = resolve_model_path(name_or_path)
        with loading_weights(path):
            backbone = AutoModel.from_pretrained(path).float()
        model = cls(backbone, AutoTokenizer.from_pretrained(path), mode, early_layers, head_layers, temperature)
        head = checkpoint_mlm_head(Path(path))
        if head is not None:
            try:
                model.mlm_head.load_state_dict(head, strict=False)  # the decoder's weight: the tied embeddings
            except RuntimeError as err:
                raise ConfigError(
                    f"{path}: its MLM head does not fit its encoder ({str(err).splitlines()[-1]})"
                ) from None
        return model

    def _mask(self, hidden: torch.Tensor, attention_mask: torch.Tensor):
        return create_bidirectional_mask(
            config=self.backbone.config, inputs_embeds=hidden, attention_mask=attention_mask
        )

    @staticmethod
    def _layer(layer: nn.Module, hidden: torch.Tensor, mask) -> torch.Tensor:
        out = layer(hidden, attention_mask=mask)
        return out[0] if isinstance(out, tuple) else out

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(early, late) hidden states of the backbone (eq. 6-7); ``late`` equals BertModel's output."""
        hidden = self.backbone.embeddings(input_ids=input_ids)
        mask = self._mask(hidden, attention_mask)
        layers = self.backbone.encoder.layer
        split = self.early_layers if self.head is not None else len(layers)
        for layer in layers[:split]:
            hidden = self._layer(layer, hidden, mask)
        early = hidden
        for layer in layers[split:]:
            hidden = self._layer(layer, hidden, mask)
        return early, hidden

    def run_head(self, early: torch.Tensor, late: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """[h_cls^cd; h^cd] of eq. 8."""
        hidden = head_input(early, late)
        mask = self._mask(hidden, attention_mask)
        for layer in self.head:
            hidden = self._layer(layer, hidden, mask)
        return hidden

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> CondenserOutput:
        """MLM terms and late CLS vectors of a masked batch."""
        early, late = self.encode(input_ids, attention_mask)
        masked = labels != IGNORE  # the prediction head is per token: apply it to masked positions only
        targets = labels[masked]
        late_mlm = mlm_loss(self.mlm_head(late[masked]), targets)
        head_mlm = None
        if self.head is not None:
            head_mlm = mlm_loss(self.mlm_head(self.run_head(early, late, attention_mask)[masked]), targets)
        return CondenserOutput(late_mlm, head_mlm, late[:, 0], int(masked.sum()))

    def loss(self, output: CondenserOutput) -> torch.Tensor:
        """The full objective of one (whole) batch: eq. 11 of condenser, or of abs-condenser-openqa."""
        if self.mode == "cocondenser":
            return output.mlm + span_contrastive_loss(output.cls, self.temperature)
        return output.mlm

    def save_backbone(self, path: str | Path, pooling: str = "cls", max_length: int = 128) -> None:
        """Write the backbone alone (head dropped) as a plain BertModel + tokenizer that AutoModel,
        ``BiEncoder.from_pretrained`` and SentenceTransformer load (atomically, via BiEncoder.save)."""
        config = BiEncoderConfig(pooling=pooling, normalize=False, passage_max_length=max_length)
        BiEncoder(self.backbone, self.backbone, self.tokenizer, config).save(path)
