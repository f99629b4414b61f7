"""Cross-encoders (neural-retrieval-lecture: "cross-encoder re-ranking"): query and passage read together
by one transformer, one relevance logit per pair.

Any model that ``transformers.AutoModelForSequenceClassification`` loads with a single, trained output is
accepted (``from_pretrained``); ``CrossEncoder.new`` starts one from any encoder (the shipped
all-MiniLM-L6-v2 by default) with a fresh one-logit head, to be trained (``training.cross_encoder``).
A saved cross-encoder is a plain Hugging Face directory that ``transformers`` and
``sentence_transformers.CrossEncoder`` both load and score identically: its config names the identity
as the activation (``predict`` returns the raw logits) and its tokenizer's ``model_max_length`` is the
cross-encoder's truncation length.

Scoring tokenises pairs in large chunks (in a worker thread, ahead of the model), batches them by token length
(little padding) and, for BERT, RoBERTa, XLM-R and ELECTRA classifiers, runs the last layer on the first position
only, the one the head reads (``first_position_logits``: the same logits for about 14% fewer multiply-adds in a
6-layer model). It runs in one of three precisions (``device.resolve_precision``; ``auto`` is bf16 where bfloat16 is
faster than float32: a GPU, or a CPU with AMX or AMD's AVX512-BF16, else fp32): ``fp32``; ``bf16``, under bf16
autocast (on the CPU, a BERT, RoBERTa or XLM-R classifier instead runs a bf16 copy whose encoder has fused layers,
``models.fused``, the last on the first position only: ``fused_first_position_logits``), with the one-logit output
layer computing in float32 (``fp32_logit_layer``: a bf16 logit has 8 significant bits, so candidates with close
scores tie; docs/history/experiments-log.md counts the ties on SQuAD, "SQuAD: the same rows with a 192-step
teacher"); ``int8`` (CPU only): where densepass's CPU kernels run a BERT, RoBERTa or XLM-R
classifier's encoder (``models.fused.int8_runs``), a bf16 copy whose encoder runs ``models.fused``'s int8 layers
(each token quantised over its own range, the padding skipped, every layer on every token), the head on the first
position (``fused_int8_logits``); elsewhere a copy whose linear layers are dynamically quantised
(``models.quantize``: int8 weights with a scale per output channel, activations with one scale per batch, so it runs
the full last layer), as for the bi-encoder with the feed-forward output projections in float32 (quantising them
too moves scores further from fp32: ``experiments/rerank_int8.py``; docs/experiments.md, "int8 cross-encoder scores
against fp32"). Either copy is made once and reused until the weights change.
int8 scores are close to fp32 but not equal, so near-ties swap and the order of close candidates changes; the int8
layers kept fp32's MRR@10 within noise where dynamic int8 lost significantly (docs/experiments.md), and int8 is
opt-in.
``benchmarks/bench_rerank.py --precision int8`` measures the agreement on its pairs with the timings.

>>> from densepass.models.cross_encoder import CrossEncoder
>>> reranker = CrossEncoder.from_pretrained("path/to/cross-encoder")  # doctest: +SKIP
>>> reranker.score_pairs(["audio editor"], ["Audacity: fast audio editor"])  # doctest: +SKIP
array([7.3], dtype=float32)
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, PreTrainedTokenizerBase

from densepass.device import autocast_context, default_device, resolve_precision
from densepass.errors import ConfigError
from densepass.io import atomic_directory
from densepass.models.copies import bf16_copy, fusable_base, int8_copy, reused_copy
from densepass.models.fused import int8_runs
from densepass.models.inputs import check_position_limit, forward_in_pieces, piece_tokens, position_limit, text_list
from densepass.models.kinds import loading_weights, quiet_loading
from densepass.models.packing import packable, packed_forward
from densepass.models.quantize import quantized_linear_copy
from densepass.numerics import refuse_nonfinite_weights
from densepass.prefetch import prefetched

DEFAULT_MAX_LENGTH = 256
# how a cross-encoder reads a titled passage, "title text", wherever it meets one: in training, reranking, teacher
# scores for distillation and the negatives filters (a teacher scoring a format it never trained on scores less well)
PASSAGE_SEP = " "
TOKENIZE_CHUNK = 8192  # pairs tokenised per call when scoring
IDENTITY = "torch.nn.modules.linear.Identity"  # sentence-transformers' activation: keep the raw logits


def _logits(model: torch.nn.Module, tokens: dict[str, torch.Tensor]) -> torch.Tensor:
    """One float32 logit per tokenised pair of a one-logit sequence-classification model."""
    return model(**tokens).logits.float().squeeze(-1)


# The head over the last layer's first position, per architecture whose classifier reads only that position.
_FIRST_POSITION_HEADS = {
    "BertForSequenceClassification": lambda m, first: m.classifier(m.dropout(m.bert.pooler(first))),
    "RobertaForSequenceClassification": lambda m, first: m.classifier(first),
    "XLMRobertaForSequenceClassification": lambda m, first: m.classifier(first),
    "ElectraForSequenceClassification": lambda m, first: m.classifier(first),
}


def reads_first_position(model: torch.nn.Module) -> bool:
    """Whether ``first_position_logits`` knows ``model``: a BERT, RoBERTa, XLM-R or ELECTRA classifier (their
    heads read only the first position) with absolute positions, an encoder (not a decoder), in eval mode."""
    config = model.config
    return (
        type(model).__name__ in _FIRST_POSITION_HEADS
        and not model.training
        and not config.is_decoder
        and getattr(config, "position_embedding_type", "absolute") == "absolute"
    )


def first_position_logits(model: torch.nn.Module, tokens: dict[str, torch.Tensor]) -> torch.Tensor:
    """``_logits(model, tokens)`` computed with the last layer on the first position only (where the
    classifier reads), for the architectures ``reads_first_position`` accepts.

    The classification head reads the last layer's first position alone, and that position depends on every
    position of the layer below only through the last layer's keys and values. So the layers below run as
    usual (a view of the base model that shares its modules, without the last layer), and the last layer
    projects keys and values for every position, and the query, attention output and feed-forward for the
    first position only: of a layer's 12 h^2 multiply-adds per token (query, key, value and output 4 h^2,
    feed-forward 8 h^2) it keeps the 2 h^2 of the keys and values, about 14% of a 6-layer model's products.
    The result equals the full forward up to float rounding (tests/test_cross_encoder.py, every architecture).
    """
    base = model.base_model
    below = copy.copy(base.encoder)  # shares its modules with ``base``; nothing in the model changes
    below._modules = {**below._modules, "layer": torch.nn.ModuleList(list(base.encoder.layer)[:-1])}
    trunk = copy.copy(base)
    trunk._modules = {**trunk._modules, "encoder": below}
    if "pooler" in trunk._modules:
        trunk._modules["pooler"] = None
    hidden = trunk(**tokens).last_hidden_state
    last = base.encoder.layer[-1]
    attention = last.attention.self
    rows, width, _ = hidden.shape
    heads, size = attention.num_attention_heads, attention.attention_head_size
    first = hidden[:, :1]
    query = attention.query(first).view(rows, 1, heads, size).transpose(1, 2)
    key = attention.key(hidden).view(rows, width, heads, size).transpose(1, 2)
    value = attention.value(hidden).view(rows, width, heads, size).transpose(1, 2)
    mask = tokens["attention_mask"].bool()[:, None, None, :]
    context = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask)
    state = last.attention.output(context.transpose(1, 2).reshape(rows, 1, heads * size), first)
    return _head_logits(model, last.feed_forward_chunk(state))


def fused_first_position_logits(model: torch.nn.Module, tokens: dict[str, torch.Tensor]) -> torch.Tensor:
    """``first_position_logits`` of a cross-encoder's bf16 copy for the CPU whose encoder runs fused layers, the
    last on the first position only (``models.copies.bf16_copy(model, fuse=True, first_position=True)``)."""
    return _head_logits(model, model.base_model(**tokens, first_position=True).last_hidden_state)


def fused_int8_logits(model: torch.nn.Module, tokens: dict[str, torch.Tensor]) -> torch.Tensor:
    """The logits of a cross-encoder's int8 copy (``models.copies.int8_copy``): its encoder's int8
    layers on every token (they have no first-position shortcut), the head on the first position."""
    return _head_logits(model, model.base_model(**tokens).last_hidden_state[:, :1])


def packed_logits(model: torch.nn.Module, tokens: dict[str, torch.Tensor]) -> torch.Tensor:
    """``_logits(model, tokens)`` computed on the pairs' tokens packed back to back without padding
    (``models.packing``; padding-free training): the encoder on the tokens alone, the head on each pair's first
    position; for the classifiers ``packing_refusal`` accepts."""
    out, packing = packed_forward(
        model.base_model, tokens["input_ids"], tokens["attention_mask"], token_type_ids=tokens.get("token_type_ids")
    )
    return _head_logits(model, packing.first(out.last_hidden_state[0])[:, None])


def packing_refusal(model: torch.nn.Module) -> str | None:
    """Why ``packed_logits`` cannot run ``model`` (None where it can): its head must read the first position
    alone (``_FIRST_POSITION_HEADS``) and its encoder be one ``models.packing`` packs."""
    if type(model).__name__ not in _FIRST_POSITION_HEADS or not packable(model.base_model):
        return (
            f"train.packing: the cross-encoder is a {type(model).__name__}; padding-free training runs BERT, "
            "RoBERTa and XLM-R sequence classifiers (set reranker.train.packing: false)"
        )
    return None


def _head_logits(model: torch.nn.Module, first: torch.Tensor) -> torch.Tensor:
    """The one-logit head of a ``reads_first_position`` classifier on its last layer's first position
    [rows, 1, width]: float32 [rows]."""
    return _FIRST_POSITION_HEADS[type(model).__name__](model, first).float().squeeze(-1)


def _fp32_linear(module: torch.nn.Linear, args: tuple, output: torch.Tensor) -> torch.Tensor:
    """Forward hook: the layer's output recomputed in float32 (outside autocast) from its input, where it ran in
    lower precision (under autocast; an int8 copy's quantised layer computes in float32 already)."""
    if output.dtype == torch.float32:
        return output
    with torch.autocast(output.device.type, enabled=False):
        bias = None if module.bias is None else module.bias.float()
        return torch.nn.functional.linear(args[0].float(), module.weight.float(), bias)


def fp32_logit_layer(model: torch.nn.Module) -> torch.nn.Module:
    """Make the output layer of a one-logit sequence-classification model (the ``Linear`` outside the base model
    with one output) compute in float32 under autocast too; nothing saved changes. Returns ``model``."""
    base = getattr(model, model.base_model_prefix, None)
    inside = {id(m) for m in base.modules()} if base is not None else set()
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.out_features == 1 and id(module) not in inside:
            if _fp32_linear not in module._forward_hooks.values():
                module.register_forward_hook(_fp32_linear)
    return model


def _load(path: str, name: str, **kwargs):
    """(model, loading info) of a sequence-classification model, or a one-line ConfigError."""
    try:
        with loading_weights(path), quiet_loading():  # missing weights: reported by the caller, in one line
            return AutoModelForSequenceClassification.from_pretrained(path, output_loading_info=True, **kwargs)
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError(f"cannot load cross-encoder {name!r}: {str(err).strip().splitlines()[0]}") from None


def _pad_like_the_head(model, tokenizer: PreTrainedTokenizerBase, source: str | None) -> None:
    """Make the tokenizer pad with the id the model's head knows as padding. A decoder's sequence-classification
    head (Llama, Qwen2, ...) scores each pair at its last token that is not ``config.pad_token_id``: with no pad
    token it refuses batches of more than one pair, and with another id than the batches are padded with it would
    score a padding position. A tokenizer without a pad token pads with its EOS (as decoder rerankers do)."""
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token is None:
            raise ConfigError(
                f"{source or 'this model'}'s tokenizer has neither a padding token nor an EOS to pad with"
            )
        tokenizer.pad_token = tokenizer.eos_token
    if getattr(model.config, "pad_token_id", None) != tokenizer.pad_token_id:
        model.config.pad_token_id = tokenizer.pad_token_id


def length_sorted_batches(encoded, scorer: CrossEncoder) -> list[tuple[np.ndarray, dict[str, torch.Tensor]]]:
    """``(rows, tensors)`` batches of ``scorer.batch_size`` unpadded encodings, longest first, each padded to its
    longest member (a multiple of 8 on GPU, for tensor cores), in pinned memory on GPU."""
    ids = encoded["input_ids"]
    types = encoded.get("token_type_ids")
    lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    order = np.argsort(-lengths, kind="stable")
    cuda = scorer.device.type == "cuda"
    pad, left = scorer.tokenizer.pad_token_id, scorer.tokenizer.padding_side == "left"  # set: _pad_like_the_head
    batches = []
    for start in range(0, len(order), scorer.batch_size):
        rows = order[start : start + scorer.batch_size]
        width = int(lengths[rows[0]])
        if cuda:  # rounded up, never past the positions the model reads (a limit that is no multiple of 8)
            width = max(width, min(-(-width // 8) * 8, scorer.max_length))
        tensors = {"input_ids": np.full((len(rows), width), pad), "attention_mask": np.zeros((len(rows), width))}
        if types is not None:
            tensors["token_type_ids"] = np.zeros((len(rows), width))
        for j, r in enumerate(rows):
            span = slice(width - lengths[r], width) if left else slice(0, lengths[r])
            tensors["input_ids"][j, span] = ids[r]
            tensors["attention_mask"][j, span] = 1
            if types is not None:
                tensors["token_type_ids"][j, span] = types[r]
        tensors = {k: torch.from_numpy(v.astype(np.int64)) for k, v in tensors.items()}
        batches.append((rows, {k: v.pin_memory() for k, v in tensors.items()} if cuda else tensors))
    return batches


class CrossEncoder:
    """A (query, passage) -> relevance scorer; ``model`` is the trainable ``transformers`` module."""

    def __init__(
        self,
        model,
        tokenizer: PreTrainedTokenizerBase,
        max_length: int | None = None,
        batch_size: int = 64,
        device: torch.device | None = None,
        precision: str = "auto",
        source: str | None = None,
    ) -> None:
        if getattr(model.config, "num_labels", None) != 1:
            raise ConfigError(
                f"a cross-encoder needs a one-logit head; {source or 'this model'} has "
                f"{getattr(model.config, 'num_labels', 'no')} labels"
            )
        limit = (position_limit(model.config) or (DEFAULT_MAX_LENGTH,))[0]
        if max_length is None:
            saved = getattr(tokenizer, "model_max_length", None) or DEFAULT_MAX_LENGTH
            max_length = min(saved, limit) if saved < 100_000 else min(DEFAULT_MAX_LENGTH, limit)
        if max_length < 8 or batch_size < 1:
            raise ConfigError(
                f"cross-encoder max_length must be >= 8 and batch_size >= 1, got {max_length}, {batch_size}"
            )
        check_position_limit(model.config, {"cross-encoder max_length": max_length}, "the model")
        _pad_like_the_head(model, tokenizer, source)
        self.model, self.tokenizer = fp32_logit_layer(model.float()), tokenizer
        self.max_length, self.batch_size, self.source = max_length, batch_size, source
        self.device = device or default_device()
        self.precision = resolve_precision(precision, self.device)  # what score_pairs runs in (module docstring)
        self.model.to(self.device).eval()
        self.new_parameters: set[str] = set()  # names of the parameters ``new`` initialised (a fresh head)

    @classmethod
    def from_pretrained(cls, name_or_path: str, **options) -> CrossEncoder:
        """Load a trained cross-encoder (a sequence-classification model with one trained label) from a
        directory or name; a model whose head would be newly initialised is a one-line ConfigError."""
        from densepass.models.biencoder import resolve_model_path

        path = resolve_model_path(name_or_path)
        model, info = _load(path, name_or_path)
        missing = sorted(info.get("missing_keys") or ())
        if missing:
            raise ConfigError(
                f"{name_or_path} has no trained relevance head ({', '.join(missing[:2])} missing): it is an "
                "encoder, not a cross-encoder; train one first (reranker.train in a run config)"
            )
        refuse_nonfinite_weights(model, str(path), saving=False)
        return cls(model, AutoTokenizer.from_pretrained(path), source=str(path), **options)

    @classmethod
    def new(cls, name_or_path: str, seed: int = 13, **options) -> CrossEncoder:
        """A cross-encoder to train from the encoder ``name_or_path``: its one-logit head when it has one, else a
        fresh one (seeded); truncation at ``max_length`` tokens (default 256, or the model's positions)."""
        from densepass.models.biencoder import resolve_model_path

        path = resolve_model_path(name_or_path)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model, info = _load(path, name_or_path, num_labels=1, ignore_mismatched_sizes=True)
        if options.get("max_length") is None:
            options["max_length"] = min(DEFAULT_MAX_LENGTH, (position_limit(model.config) or (DEFAULT_MAX_LENGTH,))[0])
        out = cls(model, AutoTokenizer.from_pretrained(path), source=str(path), **options)
        mismatched = {m[0] if isinstance(m, tuple) else m for m in info.get("mismatched_keys") or ()}
        out.new_parameters = set(info.get("missing_keys") or ()) | mismatched
        return out

    def head_parameters(self) -> set[str]:
        """Names of the parameters between the encoder's states and a newly initialised logit: the new head
        and, where the classifier reads it, the base model's pooler (a sentence-embedding checkpoint never
        trained it: all-MiniLM-L6-v2's pooled outputs are near zero, so a fresh head there barely learns)."""
        if not self.new_parameters:
            return set()
        prefix = f"{self.model.base_model_prefix}.pooler."
        return self.new_parameters | {n for n, _ in self.model.named_parameters() if n.startswith(prefix)}

    def tokenize(
        self, queries: Sequence[str], passages: Sequence[str], tokenizer: PreTrainedTokenizerBase | None = None
    ) -> dict[str, torch.Tensor]:
        """Padded pair tensors ``[CLS] query [SEP] passage [SEP]``, the longer side truncated first (as
        ``transformers`` and ``sentence_transformers`` do); ``tokenizer``: a private copy for a worker thread."""
        return (tokenizer or self.tokenizer)(
            list(queries),
            list(passages),
            truncation=True,
            max_length=self.max_length,
            padding=True,
            return_tensors="pt",
        )

    def logits(self, tokens: dict[str, torch.Tensor]) -> torch.Tensor:
        """One logit per tokenised pair, float32 [n] (with the graph when the model trains)."""
        return _logits(self.model, tokens)

    def int8_fuses(self) -> bool:
        """Whether int8 scoring runs ``models.fused``'s int8 layers (module docstring): on the CPU, for a classifier
        whose head reads the first position alone and whose encoder they run (``models.fused.int8_runs``)."""
        base = fusable_base(self.model)
        fits = self.device.type == "cpu" and reads_first_position(self.model)
        return fits and base is not None and int8_runs(base)

    def quantized_model(self) -> torch.nn.Module:
        """The int8 copy of ``model`` that int8 scoring runs (module docstring: ``int8_fuses``, a bf16 copy whose
        encoder runs the int8 layers, else dynamic quantisation): made at the first call and reused while the
        model's weights stay the same (a training step or a load makes a new one)."""
        fuses = self.int8_fuses()
        make = partial(int8_copy if fuses else quantized_linear_copy, self.model)
        return reused_copy(self.model, ("int8", fuses), make)

    def fused_model(self) -> torch.nn.Module:
        """The bf16 copy of ``model`` that bf16 scoring runs on the CPU (module docstring): its encoder with fused
        layers, the last on the first position only; made at the first call and reused while the weights stay."""
        return reused_copy(self.model, "bf16", lambda: bf16_copy(self.model, fuse=True, first_position=True))

    @torch.inference_mode()
    def score_pairs(self, queries: Sequence[str], passages: Sequence[str], precision: str | None = None) -> np.ndarray:
        """One relevance logit per pair ``(queries[i], passages[i])``, float32, in ``precision`` (None: the
        scorer's own; else a setting as ``device.resolve_precision`` reads it).

        Pairs are tokenised a chunk at a time in one call (the fast tokenizer's threads share the work),
        in a worker thread one chunk ahead of the model; each chunk is cut into batches of equal token
        length, longest first, padded only to their own longest pair (on the CPU, a batch runs in pieces of
        ``CPU_PIECE_TOKENS``: ``models.inputs.forward_in_pieces``); in fp32 and bf16 the last layer runs on
        the first position only where the architecture allows (``first_position_logits``)."""
        queries, passages = text_list(queries, "score_pairs (queries)"), text_list(passages, "score_pairs (passages)")
        if len(queries) != len(passages):
            raise ConfigError(f"{len(queries)} queries but {len(passages)} passages")
        precision = self.precision if precision is None else resolve_precision(precision, self.device)
        was_training = self.model.training
        if was_training:  # (eval() walks every module: a serving call's fixed cost)
            self.model.eval()
        try:
            shortcut = reads_first_position(self.model)
            fused = (
                precision == "bf16" and self.device.type == "cpu" and shortcut and fusable_base(self.model) is not None
            )
            if precision == "int8" and self.int8_fuses():
                forward = partial(fused_int8_logits, self.quantized_model())
            elif precision == "int8":  # one activation scale a batch: no shortcut (its batches round otherwise)
                forward = partial(_logits, self.quantized_model())
            elif fused:
                forward = partial(fused_first_position_logits, self.fused_model())
            else:
                forward = partial(first_position_logits if shortcut else _logits, self.model)
            out = np.empty(len(queries), dtype=np.float32)
            chunks = [range(s, min(s + TOKENIZE_CHUNK, len(queries))) for s in range(0, len(queries), TOKENIZE_CHUNK)]
            # a worker thread tokenises while this one scores. With several chunks it gets its own tokenizer (a
            # fast tokenizer's truncation settings are shared state); with one, this thread just waits, and a copy
            # would be a large fixed cost of a small call (a one-document /rerank request: docs/benchmarks.md,
            # "/rerank against infinity-emb").
            tokenizer = self.tokenizer if len(chunks) == 1 else copy.deepcopy(self.tokenizer)

            def prepare(chunk: range) -> list[tuple[np.ndarray, dict[str, torch.Tensor]]]:
                encoded = tokenizer(
                    [queries[i] for i in chunk],
                    [passages[i] for i in chunk],
                    truncation=True,
                    max_length=self.max_length,
                )
                return [(chunk.start + rows, tokens) for rows, tokens in length_sorted_batches(encoded, self)]

            for batches in prefetched(chunks, prepare):
                for rows, tokens in batches:
                    tokens = {k: v.to(self.device, non_blocking=v.is_pinned()) for k, v in tokens.items()}
                    with autocast_context(self.device, precision == "bf16" and not fused):  # a fused copy is bf16
                        out[rows] = forward_in_pieces(forward, tokens, piece_tokens(self.device)).cpu().numpy()
        finally:  # a call that fails (a bad input, an interruption) leaves a model in training as it was
            if was_training:
                self.model.train()
        return out

    def describe(self) -> dict:
        """JSON-able facts about the reranker."""
        return {
            "kind": "cross-encoder",
            "model": self.source,
            "max_length": self.max_length,
            "precision": self.precision,
        }

    def save(self, path: str | Path) -> None:
        """Write the model atomically as a Hugging Face directory that ``AutoModelForSequenceClassification``
        and ``sentence_transformers.CrossEncoder`` load with the same scores (raw logits, same truncation)."""
        config = self.model.config
        config.sentence_transformers = {
            **(getattr(config, "sentence_transformers", None) or {}),
            "activation_fn": IDENTITY,
        }
        refuse_nonfinite_weights(self.model, str(path), saving=True)
        previous = self.tokenizer.model_max_length
        self.tokenizer.model_max_length = self.max_length
        try:
            with atomic_directory(path) as tmp:
                self.model.save_pretrained(tmp, safe_serialization=True)
                self.tokenizer.save_pretrained(tmp)
        finally:
            self.tokenizer.model_max_length = previous
