"""Padding-free (packed) forward passes for training: a batch's sequences back to back, no padding computed.

A padded batch [batch, length] computes every layer's products on its padding too: passages of very different
lengths pad the short ones to the longest (on the CPU a training step runs in length-sorted pieces, which leaves less
padding: ``models.inputs.forward_in_pieces``; on a GPU a step runs whole). Packed, the batch is one sequence of its
real tokens [1, tokens], each sequence's positions numbered from its own start (``position_ids``), and

    embeddings, linear layers, layer norms, feed-forward    on the packed tokens alone (no padding FLOPs)
    attention                                               per sequence: each token attends to its own
                                                            sequence's tokens only

The model is the ``transformers`` model as it is, with its own modules and weights: ``transformers`` 5 lets a model
that dispatches attention through its ``AttentionInterface`` (``_supports_attention_backend``: BERT, RoBERTa, XLM-R,
Qwen2 ...) run any registered attention function, with keyword arguments passed from the model's call down to it.
densepass registers ``packed_attention`` under ``ATTENTION``, and ``packed_forward`` passes the packing down to it
(the model's ``config._attn_implementation`` switched to it: for good by ``use_packed_attention`` when training
packed, so that gradient checkpointing's second forward attends the same way; on padded batches it attends as before).
Autograd gives the backward pass: every operation is torch's. On the CPU attention dropout draws its masks as
``models.dropout`` does.

Attention over packed sequences on the CPU: of the four ways ``benchmarks/bench_train.py --attention-variants``
times (forward and backward; docs/benchmarks.md, "Padding-free training"), SDPA over the sequences scattered into a
padded grid [sequences, longest, ...] with a key mask was the fastest, ahead of SDPA per group of equal lengths (one
call per length), per sequence, and nested jagged tensors; attention's products are a small share of a layer's at
these lengths, and one large call beats many small ones. So attention alone pads (queries, keys and values are
scattered into the grid and the output gathered back); the rest of the layer does not. On CUDA, with no attention
dropout, PyTorch's variable-length flash attention (``torch.nn.attention.varlen.varlen_attn``) takes the packed
tokens as they are where this torch has it.

Equal to the padded forward up to float rounding: outputs and every parameter's gradient are tested against it
(float32, and bf16 under autocast; tests/test_packing.py). Dropout draws other masks than the padded pass (the
tensors have other shapes), so a run with dropout trains on other random masks, not other maths.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from densepass.errors import ConfigError
from densepass.models.inputs import PADDING_OFFSET_MODELS

ATTENTION = "densepass_packed"
"""The name ``packed_attention`` is registered under in ``transformers``' attention and mask interfaces."""

PACKABLE_TYPES = ("bert", "roberta", "xlm-roberta", "qwen2")
"""Model types whose packed forward is tested equal to the padded one: absolute positions (BERT, RoBERTa's and
XLM-R's numbered after the padding id) or rotary ones (Qwen2, causal), attention through ``transformers``'
attention interface."""


@dataclass
class Packing:
    """Where a padded batch's tokens are once packed: ``rows`` [tokens], each token's index in the flattened
    [batch, length] grid, in order; ``lengths`` [batch]; ``offsets`` [batch + 1], sequence ``b`` in packed rows
    ``offsets[b]`` to ``offsets[b + 1]``; ``sequence`` [tokens], each token's sequence; ``position`` [tokens], its
    place in its sequence (from 0); ``grid`` [tokens], its index in the [batch, longest] attention grid;
    ``keep`` [batch, 1, 1, longest], True at the grid's tokens; ``shape``, the padded batch's (batch, length)."""

    rows: torch.Tensor
    lengths: torch.Tensor
    offsets: torch.Tensor
    sequence: torch.Tensor
    position: torch.Tensor
    grid: torch.Tensor
    keep: torch.Tensor
    longest: int
    shape: tuple[int, int]

    @classmethod
    def of(cls, attention_mask: torch.Tensor) -> Packing:
        """The packing of a padded batch whose ``attention_mask`` [batch, length] is 1 at tokens (padding on
        either side); a sequence without tokens is refused (nothing to pool).

        One read of device values on the host (the shortest and longest length, the token count: the packed
        tensors' shapes depend on them), where data-dependent ops would each wait for a GPU on their own
        (``nonzero``, ``repeat_interleave`` without its output size, ``int()`` of a length)."""
        kept = attention_mask.bool()
        batch, length = kept.shape
        lengths = kept.sum(1)
        shortest, longest, tokens = (
            torch.stack([lengths.min(), lengths.max(), lengths.sum()]).tolist() if batch else (1, 0, 0)
        )
        if shortest == 0:
            raise ValueError("a packed batch needs at least one token in every sequence")
        try:
            rows = torch.nonzero_static(kept.flatten(), size=tokens).squeeze(1)
        except NotImplementedError:  # a torch without it on this device: one more wait, same rows
            rows = kept.flatten().nonzero().squeeze(1)
        offsets = F.pad(lengths.cumsum(0), (1, 0))
        sequence = torch.repeat_interleave(torch.arange(batch, device=kept.device), lengths, output_size=tokens)
        position = torch.arange(tokens, device=kept.device) - offsets[sequence]
        grid = sequence * longest + position
        keep = (torch.arange(longest, device=kept.device) < lengths[:, None])[:, None, None, :]
        return cls(rows, lengths, offsets, sequence, position, grid, keep, longest, (batch, length))

    @functools.cached_property
    def offsets_int32(self) -> torch.Tensor:
        """``offsets`` as int32, variable-length attention's cumulative lengths: cast once a forward, not a layer."""
        return self.offsets.to(torch.int32)

    @property
    def tokens(self) -> int:
        """How many tokens the batch holds (its padding left out)."""
        return len(self.rows)

    def pack(self, padded: torch.Tensor) -> torch.Tensor:
        """[batch, length, ...] -> [tokens, ...]: the tokens of a padded tensor, packed."""
        return _Gather.apply(padded.flatten(0, 1), self.rows)

    def unpack(self, packed: torch.Tensor) -> torch.Tensor:
        """[tokens, ...] -> [batch, length, ...]: the padded tensor, zero at padding."""
        return _Scatter.apply(packed, self.rows, self.shape[0] * self.shape[1]).view(*self.shape, *packed.shape[1:])

    def to_grid(self, packed: torch.Tensor) -> torch.Tensor:
        """[tokens, ...] -> [batch, longest, ...], each sequence from its first row, zero after its end."""
        grid = _Scatter.apply(packed, self.grid, self.shape[0] * self.longest)
        return grid.view(self.shape[0], self.longest, *packed.shape[1:])

    def from_grid(self, grid: torch.Tensor) -> torch.Tensor:
        """[batch, longest, ...] -> [tokens, ...]: ``to_grid`` undone (the grid's rows after each end left out)."""
        return _Gather.apply(grid.flatten(0, 1), self.grid)

    def first(self, packed: torch.Tensor) -> torch.Tensor:
        """[tokens, ...] -> [batch, ...]: each sequence's first token's row (a CLS vector)."""
        return packed[self.offsets[:-1]]

    def last(self, packed: torch.Tensor) -> torch.Tensor:
        """[tokens, ...] -> [batch, ...]: each sequence's last token's row."""
        return packed[self.offsets[1:] - 1]

    def mean(self, packed: torch.Tensor) -> torch.Tensor:
        """[tokens, width] -> [batch, width] float32: each sequence's mean row (summed in float32)."""
        sums = packed.new_zeros(self.shape[0], packed.shape[1], dtype=torch.float32)
        return sums.index_add(0, self.sequence, packed.float()) / self.lengths[:, None].float()

    def max(self, packed: torch.Tensor) -> torch.Tensor:
        """[tokens, width] -> [batch, width]: each sequence's largest value per column (SPLADE's max pooling)."""
        out = packed.new_full((self.shape[0], packed.shape[1]), float("-inf"))
        index = self.sequence[:, None].expand_as(packed)
        return out.scatter_reduce(0, index, packed, "amax", include_self=False)

    def pool(self, packed: torch.Tensor, how: str) -> torch.Tensor:
        """What ``biencoder.token_pooling`` computes on the padded batch, on packed hidden states [tokens, width]:
        CLS, mean or last token, in float32."""
        if how == "cls":
            return self.first(packed).float()
        if how == "last":
            return self.last(packed).float()
        if how == "mean":
            return self.mean(packed)
        raise ConfigError(f"unknown pooling {how!r} (use 'mean', 'cls' or 'last')")


class _Scatter(torch.autograd.Function):
    """[tokens, ...] -> [rows, ...]: row ``index[i]`` is ``source[i]``, the others zero. ``index`` holds distinct
    rows, so the backward pass is a gather (``Tensor.index_copy``'s own writes a copy of the zeros first)."""

    @staticmethod
    def forward(ctx, source: torch.Tensor, index: torch.Tensor, rows: int) -> torch.Tensor:
        ctx.save_for_backward(index)
        return source.new_zeros(rows, *source.shape[1:]).index_copy_(0, index, source)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (index,) = ctx.saved_tensors
        return grad.index_select(0, index), None, None


class _Gather(torch.autograd.Function):
    """[rows, ...] -> [tokens, ...]: ``source[index]`` for distinct rows ``index``, whose backward pass writes each
    gradient row to its place (indexing's own accumulates, for indices that might repeat, which costs more)."""

    @staticmethod
    def forward(ctx, source: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.rows = source.shape[0]
        return source.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (index,) = ctx.saved_tensors
        return grad.new_zeros(ctx.rows, *grad.shape[1:]).index_copy_(0, index, grad), None


def packable(model: nn.Module) -> bool:
    """Whether ``model`` (an encoder, or a model with a head on one) is a ``PACKABLE_TYPES`` model that runs its
    attention through ``transformers``' attention interface, without sliding windows or cross-attention."""
    config = getattr(model, "config", None)
    return (
        config is not None
        and getattr(config, "model_type", None) in PACKABLE_TYPES
        and bool(getattr(model, "_supports_attention_backend", False))
        and getattr(config, "position_embedding_type", "absolute") in ("absolute", None)
        and not getattr(config, "add_cross_attention", False)
        and not getattr(config, "use_sliding_window", False)
        and (config.model_type == "qwen2" or not getattr(config, "is_decoder", False))
    )


def check_packable(model: nn.Module, what: str) -> None:
    """One line where ``model`` cannot train packed (``packable``)."""
    if not packable(model):
        kind = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise ConfigError(
            f"train.packing: {what} is a {kind} model; padding-free training runs BERT, RoBERTa, XLM-R and Qwen2 "
            "encoders with absolute or rotary positions (set train.packing: false)"
        )


def position_ids(model: nn.Module, packing: Packing) -> torch.Tensor:
    """[1, tokens]: each packed token's position as the padded forward numbers it on densepass's right-padded
    batches (``models.inputs.pad_on_the_right``): from 0 (BERT, Qwen2), or after the padding id (RoBERTa and XLM-R:
    ``models.inputs.PADDING_OFFSET_MODELS``)."""
    config = model.config
    offset = (config.pad_token_id or 0) + 1 if config.model_type in PADDING_OFFSET_MODELS else 0
    return (packing.position + offset)[None]


def packed_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    densepass_packing: Packing | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """``transformers``' attention-function interface over packed sequences: ``query``, ``key``, ``value`` [1,
    heads, tokens, size], each token attending to its own sequence's (``densepass_packing``; causally where the
    module is causal) -> [1, tokens, heads, size]. Without a packing (a padded forward: evaluation, encoding), the
    attention the model ran before (SDPA; on the CPU, with ``models.dropout``'s masks while training)."""
    from densepass.models.dropout import _attention

    if densepass_packing is None:
        return _attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    packing = densepass_packing
    causal = bool(getattr(module, "is_causal", False))
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [tokens, heads, size]
    varlen = _varlen_attention()
    if varlen is not None and q.is_cuda and dropout == 0.0 and q.dtype in (torch.float16, torch.bfloat16):
        offsets, window = packing.offsets_int32, (-1, 0) if causal else (-1, -1)
        out = varlen(
            q, k, v, offsets, offsets, packing.longest, packing.longest, scale=scaling, window_size=window,
            enable_gqa=getattr(module, "num_key_value_groups", 1) > 1,
        )  # fmt: skip
        return out[None], None
    grid = (packing.to_grid(x).transpose(1, 2) for x in (q, k, v))  # [batch, heads, longest, size]
    mask = packing.keep
    if causal:
        mask = mask & torch.ones(packing.longest, packing.longest, dtype=torch.bool, device=mask.device).tril()
    out, _ = _attention(module, *grid, mask, dropout, scaling)  # [batch, longest, heads, size]
    return packing.from_grid(out)[None], None


def _varlen_attention():
    """``torch.nn.attention.varlen.varlen_attn`` where this torch has it, else None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def register() -> None:
    """Register ``packed_attention`` with ``transformers`` under ``ATTENTION``, with SDPA's masks (a packed forward
    passes no attention mask, so it gets none)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, packed_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def use_packed_attention(model: nn.Module) -> None:
    """Make ``model``'s ``transformers`` models attend through ``ATTENTION`` from now on: SDPA as before on padded
    batches, per sequence on packed ones. For good, not for one call: gradient checkpointing runs a layer's
    forward again in the backward pass, where a switch for one call would be over. Not saved (``transformers``
    does not write the attention implementation into a model's config)."""
    register()
    for module in model.modules():
        config = getattr(module, "config", None)
        if hasattr(config, "_attn_implementation") and config._attn_implementation != ATTENTION:
            config._attn_implementation = ATTENTION


@contextlib.contextmanager
def _attention_of(model: nn.Module) -> Iterator[None]:
    """``model`` (and its sub-models' configs) dispatching attention to ``ATTENTION`` inside the block (for good
    where ``use_packed_attention`` switched it)."""
    register()
    configs = {
        id(m.config): m.config for m in model.modules() if hasattr(getattr(m, "config", None), "_attn_implementation")
    }
    before = {key: config._attn_implementation for key, config in configs.items()}
    try:
        for config in configs.values():
            config._attn_implementation = ATTENTION
        yield
    finally:
        for key, config in configs.items():
            config._attn_implementation = before[key]


def packed_forward(
    model: nn.Module,
    input_ids: torch.Tensor | None,
    attention_mask: torch.Tensor,
    inputs_embeds: torch.Tensor | None = None,
    token_type_ids: torch.Tensor | None = None,
) -> tuple[object, Packing]:
    """``model``'s output on a padded batch (``input_ids`` or ``inputs_embeds`` [batch, length, width],
    ``attention_mask``, ``token_type_ids``) computed on its tokens packed, and their ``Packing``: the output's
    per-token tensors are [1, tokens, ...] (``last_hidden_state``, a masked-language model's ``logits``)."""
    packing = Packing.of(attention_mask)
    inputs: dict[str, torch.Tensor] = {"position_ids": position_ids(model, packing)}
    if inputs_embeds is not None:
        inputs["inputs_embeds"] = packing.pack(inputs_embeds)[None]
    else:
        inputs["input_ids"] = packing.pack(input_ids)[None]
    if token_type_ids is not None:
        inputs["token_type_ids"] = packing.pack(token_type_ids)[None]
    with _attention_of(model):
        out = model(**inputs, densepass_packing=packing)
    return out, packing


def can_pack(model: nn.Module) -> bool:
    """Whether ``enable_packing`` takes ``model`` (a retriever whose encoders are all ``packable``)."""
    encoders = getattr(model, "packed_encoders", None)
    return encoders is not None and all(packable(encoder) for encoder in encoders().values())


def enable_packing(model: nn.Module) -> None:
    """Turn padding-free training on for a retriever (``train.packing``): a bi-encoder, SPLADE or ColBERT whose
    encoders are all ``packable``; one line otherwise, before any training."""
    encoders = getattr(model, "packed_encoders", None)
    if encoders is None:
        raise ConfigError(f"train.packing: a {type(model).__name__} does not train packed (set train.packing: false)")
    for what, encoder in encoders().items():
        check_packable(encoder, what)
    for encoder in encoders().values():
        use_packed_attention(encoder)
    model.packing = True
