"""SPLADE: a masked-language-model head turned into vocabulary-sized sparse term weights.

For a text with tokens t_1..t_N, BERT states h_i and MLM logits w_ij = transform(h_i)^T E_j + b_j over the
vocabulary, the representation is (SPLADE v2's max pooling, neural-retrieval-lecture)

    w_j = max_i log(1 + ReLU(w_ij))            (over the non-padding tokens i)

and the score of a query and a passage is the dot product of their weights. log(1 + ReLU(.)) is
non-decreasing, so w_j = log(1 + ReLU(max_i w_ij)): the forward takes the max of the logits first and
keeps one [B, N, V] tensor instead of three (same values and gradients).

**The MLM head.** all-MiniLM-L6-v2 (and any sentence-transformers model) ships no MLM head. When the
starting checkpoint has one (e.g. a ``BertForMaskedLM``), it is used as it is. Otherwise the vocabulary
projection is *tied to the input embeddings* E (so a token's weight starts as the similarity of the
contextual state to that token's own embedding) and the fresh transform is initialised to the identity
(dense = I, bias 0, then GELU and LayerNorm as in BERT's head) instead of at random: a random transform
scrambles the states and starts from weights unrelated to the text, while the identity gives a passage's
own words and near-synonyms the top weights from the first step ("audio editor" -> audio, sound, editor,
music). The vocabulary bias starts at ``FRESH_HEAD_BIAS`` = -6, so that a fresh model starts sparse and the FLOPS
regulariser has less to undo (``benchmarks/splade_head_bias.py`` counts the positive terms per bias:
docs/benchmarks.md, "How sparse a fresh SPLADE model starts").
The saved model is a ``BertForMaskedLM``-style checkpoint (loadable by ``AutoModelForMaskedLM``) with
sentence-transformers' SparseEncoder module files (MLMTransformer + SpladePooling(max, relu)).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import AutoModelForMaskedLM, AutoTokenizer, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

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
)
from densepass.models.kinds import CONFIG_FILES, loading_weights, saved_architecture
from densepass.models.packing import packed_forward
from densepass.numerics import refuse_nonfinite_weights

FRESH_HEAD_BIAS = -6.0  # the vocabulary bias of a fresh MLM head (see the module docstring)


@dataclass
class SpladeArchitecture:
    """What a saved SPLADE model needs besides its weights (``densepass-splade.json``)."""

    query_max_length: int = option(32, "queries are cut to this many tokens", min=1)
    passage_max_length: int = option(128, "passages are cut to this many tokens", min=1)
    temperature: float = option(1.0, "softmax temperature of the contrastive loss", above=0)


CPU_ENCODE_PIECE_TOKENS = 256
"""Tokens per piece of an encoding forward pass on the CPU (``models.inputs.forward_in_pieces``). Fewer than
the bi-encoder's 2,048: every token has vocabulary-sized logits (30,522 floats = 122 KB for BERT), and 256
tokens keep them at 31 MB, under glibc's mmap threshold, so that their memory is reused rather than mapped afresh
(whole batches against these pieces: docs/history/benchmarks-log.md, "SPLADE and ColBERT";
``benchmarks/bench_sparse_late.py`` compares the result with sentence-transformers: docs/benchmarks.md)."""


def splade_weights(logits: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """w_j = max_i log(1 + ReLU(logits_ij)) over the tokens the mask keeps: [B, N, V] -> [B, V] float32.

    >>> logits = torch.tensor([[[1.0, -2.0], [3.0, -1.0], [9.0, 9.0]]])
    >>> splade_weights(logits, torch.tensor([[1, 1, 0]])).round(decimals=4)
    tensor([[1.3863, 0.0000]])
    """
    masked = logits.masked_fill(~attention_mask.bool().unsqueeze(-1), float("-inf"))
    return torch.log1p(torch.relu(masked.amax(dim=1).float()))  # the max is exact in any precision


def _identity_head(mlm: nn.Module, bias: float) -> None:
    """A fresh BERT-style MLM head: identity transform, vocabulary bias ``bias`` (the decoder stays tied to
    the input embeddings)."""
    predictions = getattr(getattr(mlm, "cls", None), "predictions", None)
    if predictions is None:
        return  # not a BERT-style head: keep the library's initialisation
    with torch.no_grad():
        dense = predictions.transform.dense
        dense.weight.copy_(torch.eye(dense.weight.shape[0], dense.weight.shape[1]))
        dense.bias.zero_()
        predictions.transform.LayerNorm.reset_parameters()
        predictions.bias.fill_(bias)


class SpladeEncoder(SidedInputs, nn.Module):
    """One shared MLM encoder for queries and passages; representations are [B, |V|] term weights.

    Offers what the trainer needs (``forward(input_ids, attention_mask, side)``, ``similarity``,
    ``tokenize``, ``save`` / ``from_pretrained``, ``config.temperature``), so the contrastive objective,
    hard negatives, batch schedules by BM25 and gradient caching apply unchanged.
    """

    def __init__(self, mlm: nn.Module, tokenizer: PreTrainedTokenizerBase, config: SpladeArchitecture) -> None:
        super().__init__()
        if config.temperature <= 0:
            raise ConfigError(f"temperature must be positive, got {config.temperature}")
        pad_on_the_right(tokenizer)
        self.mlm, self.tokenizer, self.config = mlm, tokenizer, config
        self.check_positions(mlm)
        self.source: str | None = None
        self.head_source = "checkpoint"  # or "tied embeddings + identity transform" when it was created

    packing = False
    """Padding-free training (``train.packing``; the trainer sets it): in training mode the encoder and its MLM head
    run on each batch's tokens packed back to back (``models.packing``)."""

    def packed_encoders(self) -> dict[str, nn.Module]:
        """The encoders a packed forward runs, by what to call them in a refusal (``packing.check_packable``)."""
        return {"the MLM encoder": self.mlm}

    @property
    def dim(self) -> int:
        """Size of the term-weight vectors (the vocabulary)."""
        return self.mlm.get_output_embeddings().out_features

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, side: Side, mlm: nn.Module | None = None
    ) -> torch.Tensor:
        """Term weights [B, |V|] (float32) of one side's tokenised batch (both sides share the encoder); ``mlm``:
        another copy of the model to run (a bf16 one)."""
        if self.packing and self.training and mlm is None:  # padding-free training (models.packing): the MLM
            # head's vocabulary-sized logits on the tokens alone, the max over each text's packed rows
            out, packing = packed_forward(self.mlm, input_ids, attention_mask)
            return torch.log1p(torch.relu(packing.max(out.logits[0]).float()))
        logits = (mlm or self.mlm)(input_ids=input_ids, attention_mask=attention_mask).logits
        return splade_weights(logits, attention_mask)

    def similarity(self, queries: torch.Tensor, passages: torch.Tensor) -> torch.Tensor:
        """Scores [len(queries), len(passages)]: dot products of the term weights."""
        return queries.float() @ passages.float().T

    # ---- encoding --------------------------------------------------------------------------------------

    def encode(
        self,
        texts: Sequence[str],
        side: Side,
        batch_size: int = 64,
        device: torch.device | None = None,
        show_progress: bool = False,
        top_terms: int | None = None,
        precision: str = "auto",
    ) -> sp.csr_matrix:
        """Sparse term weights [len(texts), |V|] (float32 CSR, rows in the order of ``texts``);
        ``top_terms`` keeps each row's heaviest terms only (index pruning). ``precision``: fp32, bf16 (a bfloat16
        copy of the model, its encoder with fused layers on the CPU: ``models.copies``; the max over tokens is
        taken in bf16, log(1 + ReLU) in float32) or auto (bf16 where it is fast)."""
        if top_terms is not None and (isinstance(top_terms, bool) or not isinstance(top_terms, int) or top_terms < 1):
            raise ConfigError(f"top_terms must be a positive integer, got {top_terms!r}")
        check_texts(texts, f"{side} text")
        device = device if isinstance(device, torch.device) else resolve_device(device)
        precision = float_precision(precision, device, "splade")
        was_training = self.training
        self.to(device).eval()
        mlm = encoder_in_precision(self.mlm, precision, device)
        parts, placed = [], []

        def forward(tokens: dict[str, torch.Tensor]) -> torch.Tensor:
            return self(tokens["input_ids"], tokens["attention_mask"], side, mlm)

        # bf16 logits take half the bytes: twice the tokens per piece for the same memory
        pieces = piece_tokens(device, precision == "bf16", CPU_ENCODE_PIECE_TOKENS)
        progress = tqdm(total=len(texts), desc=f"encode {side}s", disable=not show_progress, dynamic_ncols=True)
        with torch.inference_mode(), attention_kernels(device):
            for rows in length_sorted_batches(texts, batch_size):
                tokens = {k: v.to(device) for k, v in self.tokenize([texts[r] for r in rows], side).items()}
                weights = forward_in_pieces(forward, tokens, pieces)
                if top_terms is not None and top_terms < weights.shape[1]:
                    values, columns = weights.topk(top_terms, dim=1)
                    weights = torch.zeros_like(weights).scatter_(1, columns, values)
                parts.append(_to_csr(weights))
                placed.append(rows)
                progress.update(len(rows))
        progress.close()
        self.train(was_training)
        if not parts:
            return sp.csr_matrix((0, self.dim), dtype=np.float32)
        stacked = sp.vstack(parts, format="csr")
        inverse = np.empty(len(texts), dtype=np.int64)
        inverse[np.concatenate(placed)] = np.arange(len(texts))
        return stacked[inverse]

    def encode_queries(self, texts: Sequence[str], batch_size: int = 64, **options) -> sp.csr_matrix:
        """Sparse query term weights (see ``encode``)."""
        return self.encode(text_list(texts, "encode_queries"), "query", batch_size, **options)

    def encode_passages(self, passages: Sequence[str] | Corpus, batch_size: int = 64, **options) -> sp.csr_matrix:
        """Sparse passage term weights of strings, or of a ``Corpus`` as ``title [SEP] text``."""
        if isinstance(passages, Corpus):
            passages = passages.passage_inputs(self.tokenizer.sep_token or " ")
        return self.encode(text_list(passages, "encode_passages"), "passage", batch_size, **options)

    def vocabulary(self) -> list[str]:
        """The token of every column of the term weights."""
        return self.tokenizer.convert_ids_to_tokens(list(range(self.dim)))

    # ---- construction and persistence -------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls, name_or_path: str, config: SpladeArchitecture | None = None, head_bias: float = FRESH_HEAD_BIAS
    ) -> SpladeEncoder:
        """Load a saved SPLADE model, or start one from any BERT-style model (see the module docstring for
        how a missing MLM head is initialised; ``head_bias``: its vocabulary bias)."""
        path = resolve_model_path(name_or_path)
        saved = saved_architecture(path, "splade", SpladeArchitecture, "a SPLADE model")  # another kind: refused
        config = config or saved
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # a missing head is expected here, and reported below as head_source
        try:
            with loading_weights(path):
                mlm, info = AutoModelForMaskedLM.from_pretrained(path, output_loading_info=True)
        finally:
            hf_logging.set_verbosity(verbosity)
        mlm.float()
        model = cls(mlm, AutoTokenizer.from_pretrained(path), config or SpladeArchitecture())
        if any("predictions" in key or "lm_head" in key for key in info["missing_keys"]):
            _identity_head(mlm, head_bias)
            model.head_source = "tied embeddings + identity transform"
        refuse_nonfinite_weights(model, path, saving=False)
        model.source = path
        return model

    def save(self, path: str | Path) -> None:
        """Write the model atomically: MLM weights, tokenizer, our config and SparseEncoder module files (weights
        holding NaN or infinity are refused)."""
        refuse_nonfinite_weights(self, str(path), saving=True)
        with atomic_directory(path) as tmp:
            self.mlm.save_pretrained(tmp, safe_serialization=True)
            self.tokenizer.save_pretrained(tmp)
            atomic_write_text(tmp / CONFIG_FILES["splade"], json.dumps(asdict(self.config), indent=2))
            modules = [
                {
                    "idx": 0,
                    "name": "0",
                    "path": "",
                    "type": "sentence_transformers.sparse_encoder.modules.MLMTransformer",
                },
                {
                    "idx": 1,
                    "name": "1",
                    "path": "1_SpladePooling",
                    "type": "sentence_transformers.sparse_encoder.modules.SpladePooling",
                },
            ]
            atomic_write_text(tmp / "modules.json", json.dumps(modules, indent=2))
            pooling = {"pooling_strategy": "max", "activation_function": "relu", "embedding_dimension": self.dim}
            (tmp / "1_SpladePooling").mkdir()
            atomic_write_text(tmp / "1_SpladePooling" / "config.json", json.dumps(pooling, indent=2))
            bert_config = {"max_seq_length": self.config.passage_max_length, "do_lower_case": False}
            atomic_write_text(tmp / "sentence_bert_config.json", json.dumps(bert_config, indent=2))
            st_config = {"model_type": "SparseEncoder", "similarity_fn_name": "dot"}
            atomic_write_text(tmp / "config_sentence_transformers.json", json.dumps(st_config, indent=2))


def _to_csr(weights: torch.Tensor) -> sp.csr_matrix:
    """A [B, V] tensor as a float32 SciPy CSR matrix (its non-zeros only)."""
    weights = weights.float()
    rows, cols = torch.nonzero(weights, as_tuple=True)
    values = weights[rows, cols].cpu().numpy()
    shape = tuple(weights.shape)
    return sp.csr_matrix((values, (rows.cpu().numpy(), cols.cpu().numpy())), shape=shape, dtype=np.float32)
