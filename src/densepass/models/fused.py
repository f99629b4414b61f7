"""BERT-layered encoders (BERT, RoBERTa, XLM-R) for bf16 inference on the CPU, through oneDNN's fused linear kernels.

On the CPU, ``transformers``' eager BERT layer in bf16 runs each linear layer as oneDNN's matrix product with the
bias copied into the output first (one more pass), GELU as a pass of its own over the 1,536-wide feed-forward
activations, and each residual add as another (``benchmarks/bench_encode.py --unfused --profile`` shows where the
time goes; docs/history/benchmarks-log.md has a profile). A fused layer computes the same thing in fewer passes:

    qkv = x Wqkv^T + bqkv                       one product for the query, key and value projections
    a   = attention(q, k, v)                    scaled dot-product attention, per head
    h   = LayerNorm(x + a Wo^T + bo)            oneDNN adds the bias and the residual (binary post-op)
    f   = GELU(h Wi^T + bi)                     bias and GELU fused into the product (exact, erf GELU)
    out = LayerNorm(h + f Wf^T + bf)            bias and residual fused

with each weight reordered once into oneDNN's blocked layout (into AMX tiles on the kernels' path). Where
``cpu_kernels`` runs (bf16 on a CPU with AMX or AVX512-BF16, heads of 32 or 64), the layers take the tokens packed
without padding: the products run on tokens alone, the query, key and value product and attention are one
``cpu_kernels`` kernel (``cpu_kernels.SelfAttention``: whole sequences at a time), and so is all that follows them
(``cpu_kernels.AfterAttention``: the output product, the feed-forward and both layer norms, a block of tokens at a
time); elsewhere (float32, other CPUs) they take padded batches, attention is SDPA, and the inputs are
padded to a multiple of 16 tokens where that adds little (``LENGTH_MULTIPLE``). The maths is the eager layer's (same
attention scale, same GELU): in bf16 the two agree to bf16 rounding, in float32 to float32 rounding (tests). Used for
the bf16 inference copies on the CPU (``models.copies.bf16_copy``): a bi-encoder's towers, ColBERT's encoder and
SPLADE's MLM encoder (the model under its head); BERT, RoBERTa and XLM-R encoders only (``fusable``: MiniLM, BERT,
BGE / E5 / GTE, multilingual E5), everything else runs the ``transformers`` model as it is.

With ``int8`` (the ``int8`` precision of bi-encoder towers where ``cpu_kernels`` runs), the four products of each
layer run on int8 (``cpu_kernels.Int8Linear``: each token quantised over its own range, the weights with a scale
per output row; GELU in the feed-forward product's epilogue), attention and the layer norms on bf16 as above:
faster than the bf16 layers on a CPU whose int8 peak is twice its bf16 one (AVX512-VNNI beside AVX512-BF16,
without AMX), ranking as fp32 does within int8's rounding (docs/benchmarks.md).
"""

from __future__ import annotations

import functools
import platform
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F
from transformers.modeling_outputs import BaseModelOutput

from densepass.models import cpu_kernels

FUSABLE_TYPES = ("bert", "roberta", "xlm-roberta")  # RoBERTa and XLM-R run BERT's layers
LENGTH_MULTIPLE = 16
PAD_SHARE = 8
"""On padded batches (SDPA's path), inputs are padded to a multiple of ``LENGTH_MULTIPLE`` tokens (masked as keys,
cut from the output) where that adds at most 1 / ``PAD_SHARE`` of their length. SDPA's CPU flash kernel splits
queries into blocks of 32 rows and runs its bf16 products on AMX tiles of 16: a ragged tail of queries or keys costs
nearly a whole tile. A padded
position costs the products as much as a token, so padding pays where it adds little: passages gain, while short
queries padded from 9 to 16 tokens would encode slower (``bench_encode.py --length-multiples 1`` measures it;
docs/history/benchmarks-log.md, "Inputs padded to whole tiles")."""


def fusable(encoder: nn.Module) -> bool:
    """Whether ``encoder`` is a ``transformers`` BERT, RoBERTa or XLM-R encoder (``FUSABLE_TYPES``) that the fused
    layers compute exactly (absolute positions, exact GELU, no cross-attention), on an x86-64 CPU whose torch has
    oneDNN's fused linear kernels (Arm builds route oneDNN through the Arm Compute Library, which TorchInductor does
    not fuse into either); in bf16, only where oneDNN runs bf16 products on this CPU (AVX-512 or AVX-NE-CONVERT:
    not on AVX2-only CPUs, where the ``transformers`` model runs in bf16 as it is)."""
    config = getattr(encoder, "config", None)
    return (
        config is not None
        and hasattr(encoder, "embeddings")  # the encoder itself, not a model with a head on it
        and hasattr(getattr(encoder, "encoder", None), "layer")
        and getattr(config, "model_type", None) in FUSABLE_TYPES
        and (encoder.embeddings.word_embeddings.weight.dtype != torch.bfloat16 or _onednn_bf16())
        and config.hidden_act == "gelu"
        and getattr(config, "position_embedding_type", "absolute") == "absolute"
        and not config.is_decoder
        and not config.add_cross_attention
        and platform.machine().lower() in ("x86_64", "amd64")
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


@functools.cache
def _onednn_bf16() -> bool:
    """Whether this torch's oneDNN runs bf16 products on this CPU (its fused linear kernels refuse bf16 elsewhere)."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def int8_runs(encoder: nn.Module) -> bool:
    """Whether the fused layers can run ``encoder`` (``fusable``; in bf16, as a copy of it) on int8 products:
    ``cpu_kernels`` runs its heads on this CPU, and its widths suit ``cpu_kernels.Int8Linear`` (multiples of 32)."""
    if not fusable(encoder):
        return False
    config = encoder.config
    probe = torch.zeros(1, dtype=torch.bfloat16)
    return (
        cpu_kernels.usable(probe, config.hidden_size // config.num_attention_heads)
        and config.hidden_size % 32 == 0
        and config.intermediate_size % 32 == 0
    )


def packed(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` ([out, in]) reordered once into oneDNN's blocked layout for ``_linear_pointwise``."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def int8_products(layer: nn.Module) -> dict[str, cpu_kernels.Int8Linear]:
    """A BERT layer's four products on int8 (``cpu_kernels.Int8Linear``): the query, key and value projections as
    one (``qkv``), the attention output (``out``), the feed-forward's first with its GELU (``inner``) and its
    second (``ffn``)."""
    attention = layer.attention.self
    qkv = (attention.query, attention.key, attention.value)
    joined = nn.Linear(qkv[0].in_features, sum(linear.out_features for linear in qkv), dtype=qkv[0].weight.dtype)
    joined.weight.data = torch.cat([linear.weight.detach() for linear in qkv])
    joined.bias.data = torch.cat([linear.bias.detach() for linear in qkv])
    return {
        "qkv": cpu_kernels.Int8Linear(joined),
        "out": cpu_kernels.Int8Linear(layer.attention.output.dense),
        "inner": cpu_kernels.Int8Linear(layer.intermediate.dense, gelu=True),
        "ffn": cpu_kernels.Int8Linear(layer.output.dense),
    }


class FusedBertLayer(nn.Module):
    """One BERT layer (``transformers``' ``BertLayer``, or RoBERTa's and XLM-R's copies of it, in eval mode) as
    four fused products and attention: SDPA on padded batches (``forward``), ``cpu_kernels`` on packed tokens
    (``packed_tokens``); ``int8``: on packed tokens only, its products on int8 (``cpu_kernels.Int8Linear``)."""

    def __init__(self, layer: nn.Module, first_position: bool = False, int8: bool = False) -> None:
        super().__init__()
        attention = layer.attention.self
        self.heads = attention.num_attention_heads
        qkv = (attention.query, attention.key, attention.value)
        self.int8 = int8_products(layer) if int8 else None
        if int8:  # nothing else runs: no bf16 copies of the weights are kept
            self.qkv_bias = self.attention = self.after = self.kv = self.query = None
            self.attention_norm, self.output_norm = layer.attention.output.LayerNorm, layer.output.LayerNorm
            self._products = {}
            return
        self.qkv_bias = torch.cat([linear.bias for linear in qkv]).detach()
        # ``first_position`` needs the keys and values on their own, the query as it is (last layers only)
        self.kv = packed(torch.cat([attention.key.weight, attention.value.weight])) if first_position else None
        self.query = attention.query if first_position else None
        linears = {"out": layer.attention.output.dense, "inner": layer.intermediate.dense, "ffn": layer.output.dense}
        self.out_bias, self.inner_bias, self.ffn_bias = (linear.bias for linear in linears.values())
        self.attention_norm = layer.attention.output.LayerNorm
        self.output_norm = layer.output.LayerNorm
        after = (linears["out"], self.attention_norm, linears["inner"], linears["ffn"], self.output_norm)
        kernels = cpu_kernels.usable(self.qkv_bias, attention.attention_head_size)
        # on the kernels' path the query, key and value product with attention is one kernel, and all that follows
        # another (their weights in AMX tiles); oneDNN's layout of those weights is made from the tiles the first
        # time another path runs (``products``)
        fits = kernels and cpu_kernels.SelfAttention.fits(*qkv, self.heads)
        self.attention = cpu_kernels.SelfAttention(*qkv, self.heads) if fits else None
        self.after = cpu_kernels.AfterAttention(*after) if kernels and cpu_kernels.AfterAttention.fits(*after) else None
        self._products = {} if self.attention else {"qkv": packed(torch.cat([linear.weight for linear in qkv]))}
        if self.after is None:
            self._products.update({name: packed(linear.weight) for name, linear in linears.items()})

    def products(self, name: str) -> torch.Tensor:
        """The weight of the query, key and value product (``qkv``: theirs one after the other), of the output
        product (``out``), or of the feed-forward's (``inner``, ``ffn``), in oneDNN's blocked layout."""
        if name not in self._products:
            tiles = self.attention.tiles if name == "qkv" else self.after.tiles[name]
            self._products[name] = packed(cpu_kernels.untiled(tiles))
        return self._products[name]

    def forward(self, hidden: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """``hidden`` [batch, length, width] -> the same shape; ``keep`` [batch, 1, 1, length]: True where a key
        is a token, False at padding."""
        batch, length, width = hidden.shape
        x = hidden.reshape(-1, width)
        qkv = torch.ops.mkldnn._linear_pointwise(x, self.products("qkv"), self.qkv_bias, "none", [], "")
        q, k, v = qkv.view(batch, length, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        return self._after_attention(q, k, v, keep, x).view(batch, length, width)

    def packed_tokens(
        self, x: torch.Tensor, offsets: torch.Tensor, keys: torch.Tensor, workspace: dict | None = None
    ) -> torch.Tensor:
        """The layer over sequences packed one after the other (``cpu_kernels.SelfAttention``): ``x`` [tokens,
        width], sequence ``b`` in rows ``offsets[b]`` to ``offsets[b + 1]``, its first ``keys[b]`` the tokens
        attended to; returns the same shape. ``workspace``: buffers for int8 layers (``int8_packed_tokens``)."""
        if self.int8 is not None:
            return self.int8_packed_tokens(x, offsets, keys, {} if workspace is None else workspace)
        if self.attention is not None:
            context = self.attention(x, offsets, keys)
        else:
            qkv = torch.ops.mkldnn._linear_pointwise(x, self.products("qkv"), self.qkv_bias, "none", [], "")
            context = cpu_kernels.self_attention(qkv, offsets, self.heads, keys)
        return self._after_context(context, x, kernels=True)

    def int8_packed_tokens(
        self, x: torch.Tensor, offsets: torch.Tensor, keys: torch.Tensor, workspace: dict
    ) -> torch.Tensor:
        """``packed_tokens`` on int8 products: each product's output in a buffer of ``workspace`` (by the product's
        name: made at first use, reused by the layers after, as fresh memory the size of a piece's activations
        costs page faults at every write: docs/benchmarks.md), the layer's output in ``workspace["ffn"]`` (where
        the input may be: it is read before)."""

        def into(name: str) -> torch.Tensor:
            size = len(x) * self.int8[name].shape[0]
            if name not in workspace or workspace[name].numel() < size:
                workspace[name] = torch.empty(size, dtype=torch.bfloat16)
            return workspace[name]

        products = self.int8
        context = cpu_kernels.self_attention(products["qkv"](x, into("qkv")), offsets, self.heads, keys)
        h = cpu_kernels.layer_norm_(products["out"](context, into("out")), self.attention_norm, x)
        y = products["ffn"](products["inner"](h, into("inner")), into("ffn"))
        return cpu_kernels.layer_norm_(y, self.output_norm, h)

    def first_position(self, hidden: torch.Tensor, keep: torch.Tensor, kernels: bool = False) -> torch.Tensor:
        """The layer's output at the first position only, [batch, 1, width]: keys and values of every position,
        the query, attention output and feed-forward of the first (a cross-encoder's last layer, whose head reads
        that position alone: ``models.cross_encoder.first_position_logits``); ``kernels``: what follows attention
        by ``cpu_kernels`` (``_after_context``)."""
        batch, length, width = hidden.shape
        size = width // self.heads
        if self.query is None:  # ``kv`` is packed alongside
            raise ValueError("this layer was fused without first_position=True")
        linear = torch.ops.mkldnn._linear_pointwise
        kv = linear(hidden.reshape(-1, width), self.kv, self.qkv_bias[width:], "none", [], "")
        k, v = kv.view(batch, length, 2, self.heads, size).permute(2, 0, 3, 1, 4)
        first = hidden[:, 0]
        q = self.query(first).view(batch, self.heads, 1, size)
        return self._after_attention(q, k, v, keep, first, kernels).view(batch, 1, width)

    def _after_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        keep: torch.Tensor,
        x: torch.Tensor,
        kernels: bool = False,
    ) -> torch.Tensor:
        """Attention of the queries ``q`` [batch, heads, rows, size] over ``k``, ``v``, then the output projection,
        residual ``x`` [batch x rows, width], layer norms and feed-forward: [batch x rows, width]."""
        context = F.scaled_dot_product_attention(q, k, v, attn_mask=keep).transpose(1, 2).reshape(x.shape)
        return self._after_context(context, x, kernels)

    def _after_context(self, context: torch.Tensor, x: torch.Tensor, kernels: bool = False) -> torch.Tensor:
        """The output projection of the attention ``context`` [batch x rows, width], residual ``x``, layer norms
        and feed-forward: [batch x rows, width]. ``kernels``: all of it one ``cpu_kernels.AfterAttention`` where the
        layer was built for it, else oneDNN's products with the residuals added by ``cpu_kernels.layer_norm_`` (one
        pass fewer than oneDNN's add post-op); otherwise oneDNN's products, the residuals added by them."""
        if kernels and self.after is not None:
            return self.after(context, x)
        linear = torch.ops.mkldnn._linear_pointwise
        out, inner, ffn = (self.products(name) for name in ("out", "inner", "ffn"))
        if kernels:
            attended = linear(context, out, self.out_bias, "none", [], "")
            h = cpu_kernels.layer_norm_(attended, self.attention_norm, x)
            f = linear(h, inner, self.inner_bias, "gelu", [], "none")
            return cpu_kernels.layer_norm_(linear(f, ffn, self.ffn_bias, "none", [], ""), self.output_norm, h)
        h = self.attention_norm(linear.binary(context, x, out, self.out_bias, "add"))
        f = linear(h, inner, self.inner_bias, "gelu", [], "none")
        return self.output_norm(linear.binary(f, h, ffn, self.ffn_bias, "add"))


class FusedBertEncoder(nn.Module):
    """A ``transformers`` BERT-layered encoder (``fusable``) for inference with fused layers: called like the model
    (``input_ids`` or ``inputs_embeds``, ``attention_mask``), it returns ``last_hidden_state`` (no pooler).
    It keeps the model's embeddings and layer norms; the products' weights are packed copies. ``padding_outputs``:
    hidden states at the padding positions too, as ``transformers`` computes them (ColBERT reads its queries'
    [MASK] padding); False, where only the tokens' are read (a bi-encoder's pooling), zeros there, and the
    ``cpu_kernels`` path runs the layers on the tokens alone. ``int8``: the layers' products on int8
    (``FusedBertLayer``), where ``cpu_kernels`` runs (``int8_runs``), without ``first_position``.

        >>> from transformers import AutoModel, AutoTokenizer
        >>> from densepass.models.biencoder import resolve_model_path
        >>> path = resolve_model_path("all-MiniLM-L6-v2")
        >>> bert = AutoModel.from_pretrained(path).eval()  # float32 here; bf16 where oneDNN runs bf16
        >>> tokens = AutoTokenizer.from_pretrained(path)(["audio editor", "a tar archiver for tapes"], padding=True,
        ...                                            return_tensors="pt")
        >>> FusedBertEncoder(bert)(tokens["input_ids"], tokens["attention_mask"]).last_hidden_state.shape
        torch.Size([2, 8, 384])
    """

    def __init__(
        self, encoder: nn.Module, first_position: bool = False, padding_outputs: bool = True, int8: bool = False
    ) -> None:
        super().__init__()
        if not fusable(encoder):
            raise ValueError(f"not a BERT encoder the fused layers compute: {type(encoder).__name__}")
        bf16 = encoder.embeddings.word_embeddings.weight.dtype == torch.bfloat16
        if int8 and (first_position or not bf16 or not int8_runs(encoder)):
            raise ValueError("int8 layers run bf16 encoders on densepass's CPU kernels, without first_position")
        self.config = encoder.config
        self.head_size = encoder.config.hidden_size // encoder.config.num_attention_heads
        self.padding_outputs = padding_outputs
        self.int8 = int8
        self.embeddings = encoder.embeddings
        last = len(encoder.encoder.layer) - 1
        self.layers = nn.ModuleList(
            FusedBertLayer(layer, first_position and i == last, int8) for i, layer in enumerate(encoder.encoder.layer)
        )
        self.pooler = getattr(encoder, "pooler", None)  # what a BERT classifier's head reads (not run here)
        self.eval().requires_grad_(False)

    def _packed(self, inputs: Callable[[torch.Tensor], torch.Tensor], kept: torch.Tensor, first_position: bool):
        """The layers with ``cpu_kernels``' attention over the inputs of each sequence's positions one after the
        other (``inputs(rows)``: the layers' input vectors [rows, width] at the positions ``rows`` of the flattened
        [batch, length] grid), its kept tokens (``kept`` [batch, length]) first as the keys, then the positions
        that only query: every position where ``padding_outputs``, none otherwise (zeros at padding), the first for
        ``first_position`` (whose last layer reads the first position's query, a token or not). Returns the last
        layer's output [batch, length, width]."""
        (batch, length), width = kept.shape, self.config.hidden_size
        counts = kept.sum(1)
        wanted = torch.ones_like(kept) if self.padding_outputs and not first_position else kept.clone()
        if first_position:
            wanted[:, 0] = True
        order = torch.argsort((~kept).to(torch.int8), dim=1, stable=True)  # kept first, each part in order
        rows = (order + torch.arange(batch)[:, None] * length)[wanted.gather(1, order)]
        offsets = F.pad(wanted.sum(1).cumsum(0), (1, 0))
        in_place = len(rows) == batch * length and bool((rows == torch.arange(len(rows))).all())
        x, workspace = inputs(rows), {}
        for layer in self.layers[:-1] if first_position else self.layers:
            x = layer.packed_tokens(x, offsets, counts, workspace)
        out = x if in_place else x.new_zeros(batch * length, width).index_copy_(0, rows, x)
        out = out.view(batch, length, width)
        return self.layers[-1].first_position(out, kept[:, None, None, :], kernels=True) if first_position else out

    def _positions(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The position of each token in the model's table, [batch, length], as its embeddings number them: BERT
        from 0, RoBERTa and XLM-R from the padding id + 1, over the tokens that are not padding."""
        if hasattr(self.embeddings, "padding_idx"):  # RoBERTa's and XLM-R's embeddings
            return self.embeddings.create_position_ids_from_input_ids(input_ids, self.embeddings.padding_idx)
        return torch.arange(input_ids.shape[1]).expand_as(input_ids)  # past the table: ``cpu_kernels.embed`` says so

    def get_input_embeddings(self) -> nn.Module:
        """The token-embedding table (as ``transformers`` models expose it)."""
        return self.embeddings.word_embeddings

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        first_position: bool = False,
        **unused,
    ) -> BaseModelOutput:
        """The last layer's hidden states [batch, length, width] of ``input_ids`` (or ``inputs_embeds``);
        ``attention_mask`` [batch, length], 1 at tokens and 0 at padding (default: no padding); ``token_type_ids``
        the segments (default: all 0); ``first_position`` (an encoder built with ``first_position=True``): the
        last layer's output at the first position only, [batch, 1, width]. Where ``cpu_kernels`` runs, the layers
        run on the sequences packed one after the other (without their padding where not ``padding_outputs``, the
        output zero there), their input vectors from ids by ``cpu_kernels.embed`` (the packed tokens alone);
        elsewhere on the inputs padded to a multiple of ``LENGTH_MULTIPLE`` tokens where that adds at most 1 /
        ``PAD_SHARE`` and the position table allows. Other arguments a ``transformers`` head
        passes its encoder are accepted where they change nothing (``return_dict``, None, False) and refused
        otherwise (``position_ids``, ``encoder_hidden_states`` ...)."""
        refused = sorted(k for k, v in unused.items() if k != "return_dict" and v is not None and v is not False)
        if refused:
            raise ValueError(f"the fused encoder does not compute {', '.join(refused)}")
        given = input_ids if input_ids is not None else inputs_embeds
        batch, length = given.shape[:2]
        if attention_mask is None:
            attention_mask = torch.ones((batch, length), dtype=torch.bool, device=given.device)
        if cpu_kernels.usable(self.embeddings.word_embeddings.weight, self.head_size):
            kept = attention_mask.bool()
            if inputs_embeds is not None:  # token vectors (taken over ids, as the embeddings take them): the
                # embeddings of the whole grid, then its rows
                grid = self.embeddings(inputs_embeds=inputs_embeds, token_type_ids=token_type_ids).flatten(0, 1)
                return BaseModelOutput(last_hidden_state=self._packed(lambda rows: grid[rows], kept, first_position))
            input_ids = input_ids.long()  # int32 ids too, as the embeddings take them
            positions, types = self._positions(input_ids), token_type_ids
            types = torch.zeros_like(input_ids) if types is None else types.long().expand_as(input_ids)
            flat = input_ids.flatten(), positions.flatten(), types.flatten()

            def inputs(rows: torch.Tensor) -> torch.Tensor:
                return cpu_kernels.embed(self.embeddings, *(index[rows] for index in flat))

            return BaseModelOutput(last_hidden_state=self._packed(inputs, kept, first_position))
        if self.int8:
            raise ValueError(f"int8 layers run on densepass's CPU kernels, which are off here ({cpu_kernels.ENV}=0)")
        extra = -length % LENGTH_MULTIPLE
        if 0 < extra * PAD_SHARE <= length and length + extra <= self.config.max_position_embeddings:
            pad_id = self.config.pad_token_id or 0  # RoBERTa numbers its positions from the non-pad tokens
            if input_ids is not None:
                input_ids = F.pad(input_ids, (0, extra), value=pad_id)
            else:
                inputs_embeds = F.pad(inputs_embeds, (0, 0, 0, extra))
            attention_mask = F.pad(attention_mask, (0, extra))
            if token_type_ids is not None:
                token_type_ids = F.pad(token_type_ids, (0, extra))
        hidden = self.embeddings(input_ids=input_ids, inputs_embeds=inputs_embeds, token_type_ids=token_type_ids)
        keep = attention_mask.bool()[:, None, None, :]
        for layer in self.layers[:-1] if first_position else self.layers:
            hidden = layer(hidden, keep)
        if first_position:  # built with first_position=True
            return BaseModelOutput(last_hidden_state=self.layers[-1].first_position(hidden, keep))
        return BaseModelOutput(last_hidden_state=hidden[:, :length])
