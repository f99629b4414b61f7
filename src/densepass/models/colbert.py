"""ColBERT: late interaction over per-token vectors, scored by MaxSim (neural-retrieval-lecture, ColBERT v2).

Every token of a text becomes a vector: the encoder's last states, projected linearly (no bias) to
``dim`` (128) dimensions and L2-normalised. A query and a passage score

    s(q, p) = sum_i max_j  q_i . p_j           (MaxSim: each query vector takes its best passage vector)

- queries are padded with [MASK] tokens to exactly ``query_max_length`` tokens (query augmentation: the
  [MASK] positions are not attended to but do produce vectors, which take part in MaxSim); a longer query
  is cut at that length, like every encoder here;
- passages drop the vectors of punctuation tokens (the skiplist) and of padding;
- optional [unused0] / [unused1] markers after [CLS] tell the shared encoder which side it reads.

A batch's representation is a [B, L, dim] tensor, padded with zero vectors: absent tokens (padding,
skiplist) are exactly zero, real ones have norm 1, so ``maxsim`` tells them apart without a separate mask.
Passages are always padded to ``passage_max_length`` so that the representations of every chunk of a
gradient-cached batch, and of every process, have one shape.
"""

from __future__ import annotations

import json
import string
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoModel, AutoTokenizer, PreTrainedTokenizerBase

from densepass.config import option
from densepass.data.dataset import Corpus
from densepass.data.texts import check_texts
from densepass.device import attention_kernels, resolve_device
from densepass.errors import ConfigError
from densepass.io import atomic_directory, atomic_write_text
from densepass.models.biencoder import Side, resolve_model_path
from densepass.models.copies import encoder_in_precision, float_precision
from densepass.models.inputs import (
    SidedInputs,
    forward_in_pieces,
    length_sorted_batches,
    pad_on_the_right,
    piece_tokens,
    text_list,
    tokenize,
)
from densepass.models.kinds import CONFIG_FILES, loading_weights, saved_architecture
from densepass.models.packing import packed_forward
from densepass.numerics import refuse_nonfinite_weights

LINEAR_FILE = "colbert_linear.safetensors"
MARKERS = {"query": "[unused0]", "passage": "[unused1]"}


@dataclass
class ColbertArchitecture:
    """What a saved ColBERT model needs besides its weights (``densepass-colbert.json``)."""

    dim: int = option(128, "token vectors are projected to this many dimensions", min=1, max=65_536)
    query_max_length: int = option(32, "queries are padded with [MASK] (or cut) to this many tokens", min=2)
    passage_max_length: int = option(128, "passages are cut to this many tokens", min=2)
    skiplist: bool = option(True, "drop punctuation tokens from passages")
    markers: bool = option(True, "insert [unused0] / [unused1] query / passage markers after [CLS]")
    temperature: float = option(1.0, "softmax temperature of the contrastive loss", above=0)


def maxsim(queries: torch.Tensor, passages: torch.Tensor) -> torch.Tensor:
    """MaxSim scores [Q, P] of query token vectors [Q, Lq, d] and passage token vectors [P, Lp, d]; zero
    vectors are absent tokens (a query's take no part; a passage without any token scores 0).

    >>> q = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    >>> p = torch.tensor([[[0.6, 0.8], [1.0, 0.0], [0.0, 0.0]]])
    >>> maxsim(q, p)
    tensor([[1.8000]])
    """
    queries, passages = queries.float(), passages.float()
    sims = torch.einsum("qid,pjd->qpij", queries, passages)
    present = passages.abs().sum(-1) > 0  # [P, Lp]
    sims = sims.masked_fill(~present[None, :, None, :], float("-inf"))
    best = sims.amax(dim=-1)  # [Q, P, Lq]
    best = torch.where(torch.isfinite(best), best, torch.zeros_like(best))
    query_present = (queries.abs().sum(-1) > 0).to(best.dtype)  # [Q, Lq]
    return (best * query_present[:, None, :]).sum(-1)


class ColBERT(SidedInputs, nn.Module):
    """A shared encoder with a linear projection; representations are zero-padded token vectors."""

    def __init__(
        self,
        encoder: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        config: ColbertArchitecture,
        linear: nn.Linear | None = None,
    ) -> None:
        super().__init__()
        if config.temperature <= 0:
            raise ConfigError(f"temperature must be positive, got {config.temperature}")
        if tokenizer.mask_token_id is None or tokenizer.pad_token_id is None:
            raise ConfigError("ColBERT needs a tokenizer with [MASK] and [PAD] tokens (query augmentation)")
        pad_on_the_right(tokenizer)
        self.encoder, self.tokenizer, self.config = encoder, tokenizer, config
        self.check_positions(encoder)
        self.linear = linear or nn.Linear(encoder.config.hidden_size, config.dim, bias=False)
        if self.linear.out_features != config.dim:
            raise ConfigError(f"the saved projection has {self.linear.out_features} dimensions, not {config.dim}")
        skip = [tokenizer.convert_tokens_to_ids(c) for c in string.punctuation] if config.skiplist else []
        skip = sorted({i for i in skip if i is not None and i != tokenizer.unk_token_id})
        self.register_buffer("skiplist_ids", torch.tensor(skip, dtype=torch.long), persistent=False)
        self.marker_ids = {side: _marker_id(tokenizer, token) for side, token in MARKERS.items()}
        if config.markers and None in self.marker_ids.values():
            raise ConfigError("the tokenizer has no [unused0] / [unused1] tokens for markers: set markers to false")
        self.source: str | None = None

    packing = False
    """Padding-free training (``train.packing``; the trainer sets it): in training mode passages run on their tokens
    packed back to back (``models.packing``); queries keep their [MASK] positions, whose outputs count."""

    def packed_encoders(self) -> dict[str, nn.Module]:
        """The encoders a packed forward runs, by what to call them in a refusal (``packing.check_packable``)."""
        return {"the encoder": self.encoder}

    @property
    def dim(self) -> int:
        """Dimension of a token vector."""
        return self.config.dim

    def tokenize(
        self,
        texts: list[str],
        side: Side,
        padding: bool | str = True,
        tokenizer: PreTrainedTokenizerBase | None = None,
        max_length: int | None = None,
    ) -> dict[str, torch.Tensor]:
        """Token ids and attention masks; queries padded with [MASK] to exactly ``query_max_length`` (the
        [MASK] positions are not attended to), markers inserted after [CLS] when configured; ``max_length``:
        another token limit than the side's (markers included)."""
        tokenizer = tokenizer or self.tokenizer
        markers = self.config.markers
        length = (max_length or self.max_length(side)) - int(markers)
        tokens = tokenize(tokenizer, texts, length, "max_length" if side == "query" else padding)
        ids, mask = tokens["input_ids"], tokens["attention_mask"]
        if markers:
            marker = torch.full((len(ids), 1), self.marker_ids[side], dtype=ids.dtype)
            ids = torch.cat([ids[:, :1], marker, ids[:, 1:]], dim=1)
            mask = torch.cat([mask[:, :1], torch.ones_like(marker), mask[:, 1:]], dim=1)
        if side == "query":
            ids = ids.masked_fill(ids == tokenizer.pad_token_id, tokenizer.mask_token_id)
        return {"input_ids": ids, "attention_mask": mask}

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, side: Side, encoder: nn.Module | None = None
    ) -> torch.Tensor:
        """Token vectors [B, L, dim] (float32): L2-normalised, zero where a token is absent; passages are
        padded to ``passage_max_length`` tokens. ``encoder``: another copy of the encoder to run (a bf16 one)."""
        if self.packing and self.training and encoder is None and side == "passage":  # padding-free training
            # (models.packing): a passage's tokens alone, then padded back (queries keep every position anyway)
            out, packing = packed_forward(self.encoder, input_ids, attention_mask)
            vectors = nn.functional.normalize(self.linear(out.last_hidden_state[0].float()), dim=-1)
            keep = ~torch.isin(packing.pack(input_ids), self.skiplist_ids)
            vectors = packing.unpack(vectors * keep.unsqueeze(-1).to(vectors.dtype))
            missing = self.config.passage_max_length - vectors.shape[1]
            return nn.functional.pad(vectors, (0, 0, 0, missing)) if missing > 0 else vectors
        hidden = (encoder or self.encoder)(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        vectors = nn.functional.normalize(self.linear(hidden.float()), dim=-1)
        if side == "query":
            return vectors  # every position, [MASK] padding included
        keep = attention_mask.bool() & ~torch.isin(input_ids, self.skiplist_ids)
        vectors = vectors * keep.unsqueeze(-1).to(vectors.dtype)
        missing = self.config.passage_max_length - vectors.shape[1]
        return nn.functional.pad(vectors, (0, 0, 0, missing)) if missing > 0 else vectors

    def similarity(self, queries: torch.Tensor, passages: torch.Tensor) -> torch.Tensor:
        """MaxSim scores [len(queries), len(passages)]."""
        return maxsim(queries, passages)

    # ---- encoding --------------------------------------------------------------------------------------

    def encode(
        self,
        texts: Sequence[str],
        side: Side,
        batch_size: int = 64,
        device: torch.device | None = None,
        show_progress: bool = False,
        precision: str = "auto",
    ) -> list[np.ndarray]:
        """Per text, its present token vectors [n_i, dim] (float32; a query always has ``query_max_length``).
        ``precision``: fp32, bf16 (a bfloat16 copy of the encoder, with fused layers on the CPU:
        ``models.copies``; the projection and normalisation stay float32) or auto (bf16 where it is fast)."""
        check_texts(texts, f"{side} text")
        device = device if isinstance(device, torch.device) else resolve_device(device)
        precision = float_precision(precision, device, "colbert")
        was_training = self.training
        self.to(device).eval()
        encoder = encoder_in_precision(self.encoder, precision, device)
        out: list[np.ndarray | None] = [None] * len(texts)

        def forward(tokens: dict[str, torch.Tensor]) -> torch.Tensor:
            return self(tokens["input_ids"], tokens["attention_mask"], side, encoder)

        # passages in pieces on the CPU (as the bi-encoder); a query keeps every position, its [MASK] padding too
        pieces = piece_tokens(device, bf16=precision == "bf16")
        pieces = pieces if side == "passage" else None

        progress = tqdm(total=len(texts), desc=f"encode {side}s", disable=not show_progress, dynamic_ncols=True)
        with torch.inference_mode(), attention_kernels(device):
            for rows in length_sorted_batches(texts, batch_size):
                tokens = {k: v.to(device) for k, v in self.tokenize([texts[r] for r in rows], side).items()}
                vectors = forward_in_pieces(forward, tokens, pieces).float()
                present = (vectors.abs().sum(-1) > 0).cpu().numpy()
                vectors = vectors.cpu().numpy()
                for i, r in enumerate(rows):
                    out[r] = vectors[i] if side == "query" else vectors[i][present[i]]
                progress.update(len(rows))
        progress.close()
        self.train(was_training)
        return out  # type: ignore[return-value]

    def encode_queries(self, texts: Sequence[str], batch_size: int = 64, **options) -> np.ndarray:
        """Query token vectors [n, query_max_length, dim]."""
        vectors = self.encode(text_list(texts, "encode_queries"), "query", batch_size, **options)
        return np.stack(vectors) if vectors else np.zeros((0, self.config.query_max_length, self.dim), np.float32)

    def encode_passages(self, passages: Sequence[str] | Corpus, batch_size: int = 64, **options) -> list[np.ndarray]:
        """Per passage (strings, or a ``Corpus`` as ``title [SEP] text``), its token vectors [n_i, dim]."""
        if isinstance(passages, Corpus):
            passages = passages.passage_inputs(self.tokenizer.sep_token or " ")
        return self.encode(text_list(passages, "encode_passages"), "passage", batch_size, **options)

    # ---- construction and persistence -------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, name_or_path: str, config: ColbertArchitecture | None = None) -> ColBERT:
        """Load a saved ColBERT, or start one from any encoder (a new projection, seeded by torch's generator)."""
        path = resolve_model_path(name_or_path)
        stored = saved_architecture(path, "colbert", ColbertArchitecture, "a ColBERT model")
        config = config or stored or ColbertArchitecture()
        with loading_weights(path):
            encoder = AutoModel.from_pretrained(path)
        encoder.float()
        linear = None
        weights = Path(path) / LINEAR_FILE
        if weights.is_file():
            with loading_weights(path, LINEAR_FILE):
                state = load_file(str(weights))
            if state["weight"].shape[0] != config.dim:  # trained weights never silently replaced by random ones
                raise ConfigError(
                    f"{path} was saved with {state['weight'].shape[0]}-dimensional token vectors, not "
                    f"model.colbert.dim {config.dim}: leave it unset (or {state['weight'].shape[0]}) to load it"
                )
            linear = nn.Linear(state["weight"].shape[1], config.dim, bias=False)
            linear.load_state_dict(state)
        model = cls(encoder, AutoTokenizer.from_pretrained(path), config, linear)
        refuse_nonfinite_weights(model, path, saving=False)
        model.source = path
        return model

    def check_projection_saved(self) -> None:
        """A one-line error where the model's ``source`` holds no projection (it started from an encoder without
        one, and was not saved since): the projection is random, so an index that records where the model is would
        find another projection there when loaded."""
        if self.source is None or not (Path(self.source) / LINEAR_FILE).is_file():
            raise ConfigError(
                f"{self.source or 'the model'} has no ColBERT projection ({LINEAR_FILE}): a new one is random, so an "
                "index of it could never be searched again; train a ColBERT from it (model.kind: colbert) or save "
                "it (ColBERT.save) and index the saved model"
            )

    def save(self, path: str | Path) -> None:
        """Write the model atomically: encoder, tokenizer, projection and our config (weights holding NaN or
        infinity are refused). The saved folder becomes the model's ``source``: where an index of it records the
        model to load (its projection is there now)."""
        refuse_nonfinite_weights(self, str(path), saving=True)
        with atomic_directory(path) as tmp:
            self.encoder.save_pretrained(tmp, safe_serialization=True)
            self.tokenizer.save_pretrained(tmp)
            save_file({"weight": self.linear.weight.detach().cpu().contiguous()}, str(tmp / LINEAR_FILE))
            atomic_write_text(tmp / CONFIG_FILES["colbert"], json.dumps(asdict(self.config), indent=2))
        self.source = str(path)


class ColbertReranker:
    """A second stage that re-scores first-stage candidates (BM25, dense, SPLADE) by ColBERT MaxSim,
    encoding queries and passages on the fly (``pipelines.search.Reranker``)."""

    def __init__(
        self, model: ColBERT, batch_size: int = 64, device: torch.device | None = None, precision: str = "auto"
    ) -> None:
        if batch_size < 1:
            raise ConfigError(f"the reranker's batch size must be >= 1, got {batch_size}")
        self.model, self.batch_size, self.device, self.precision = model, batch_size, device, precision
        # a passage's title and text joined as ColBERT trains and indexes them (a cross-encoder's: a space)
        self.passage_sep = model.tokenizer.sep_token or " "

    def score_pairs(self, queries: Sequence[str], passages: Sequence[str]) -> np.ndarray:
        """MaxSim of each pair ``(queries[i], passages[i])`` (each distinct text encoded once)."""
        queries, passages = text_list(queries, "score_pairs (queries)"), text_list(passages, "score_pairs (passages)")
        if len(queries) != len(passages):
            raise ConfigError(f"{len(queries)} queries for {len(passages)} passages")
        unique_q, unique_p = list(dict.fromkeys(queries)), list(dict.fromkeys(passages))
        options = {"device": self.device, "precision": self.precision}
        q = dict(zip(unique_q, self.model.encode_queries(unique_q, self.batch_size, **options)))
        p = dict(zip(unique_p, self.model.encode_passages(unique_p, self.batch_size, **options)))
        return np.array(
            [float((q[a] @ p[b].T).max(axis=1).sum()) if len(p[b]) else 0.0 for a, b in zip(queries, passages)],
            dtype=np.float32,
        )

    def describe(self) -> dict:
        """What reranks (for ``/health`` and reports)."""
        return {"kind": "colbert", "model": self.model.source, "precision": self.precision}


def _marker_id(tokenizer: PreTrainedTokenizerBase, token: str) -> int | None:
    """The id of ``token`` when the vocabulary has it."""
    token_id = tokenizer.convert_tokens_to_ids(token)
    return None if token_id is None or token_id == tokenizer.unk_token_id else int(token_id)
