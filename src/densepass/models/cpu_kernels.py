"""bf16 kernels of the fused BERT layers on x86 CPUs with AMX or AVX512-BF16: the query, key and value product with
attention, and all that follows it, in C++ (on AMX tiles, or on AVX-512 registers with ``vdpbf16ps``); and the
training kernels (dropout, attention's softmax with its dropout) on those CPUs and on AVX2-only ones.

SDPA's CPU flash-attention kernel ran MiniLM's attention (12 heads of 32 dimensions over rows of under a hundred
tokens) far below the rate of the layer's products, and was the largest single part of a fused layer's time, with
torch's bf16 layer norm next (``benchmarks/bench_layer_parts.py``; the measurement: docs/history/benchmarks-log.md,
"A 2-core Intel Xeon with AMX (2026-11-26)").
``self_attention`` computes, per sequence and head,

    S = Q K^T                 on AMX tiles (bf16 in, float32 out), 16 queries x 16 keys a tile
    P = exp(scale (S - max))  in float32 (AVX-512), per query row, rounded to bf16
    O = P V / sum(P)          on AMX tiles, divided and rounded to bf16

(the AVX512-BF16 build: both products with ``vdpbf16ps``, 8 queries x 32 keys or dimensions at a time, from the
same key and value layouts)

as SDPA does in bf16 (float32 scores and softmax, bf16 probabilities for P V), over sequences packed one after the
other without padding: a layer's products run on the tokens alone, and the kernel reads queries, keys and values
where the one query/key/value product left them and writes the context where the output product reads it (no permute
or copy on either side). It takes heads of 32 or 64 dimensions (MiniLM, BERT-base and -large, BGE, E5, GTE).
``SelfAttention`` computes that product and the attention as one kernel, whole sequences at a time, their queries,
keys and values in a thread's cache instead of memory (what the fused layers run). ``AfterAttention`` computes the
rest of the layer (output product, feed-forward, both layer norms) as one kernel, a block of tokens at a time
through all of it, with its own products on AMX tiles and the biases, residuals, GELU and layer norms applied as the
products' results come off the tiles. ``layer_norm_`` normalises bf16 rows in place, in float32, the residual added
on the way (what the layers run where ``AfterAttention`` does not fit); ``embed`` computes the first layer's input
vectors of packed tokens from their ids, positions and types (the lookups, sums and layer norm in one pass).

``Int8Linear`` computes a linear layer through int8 products (each token quantised over its own range, a scale
per weight row): on AVX512-VNNI (``vpdpbusd``: twice the multiply-adds per instruction of ``vdpbf16ps``), and in
the ``amx`` build on AMX tiles (``tdpbusd``) where the depth is a multiple of 64
(``benchmarks/bench_int8_products.py``): what ``models.fused``'s int8 layers run (the ``int8`` precision).

For training (``trains``): ``dropout`` applies dropout with counter-based masks (``models.dropout`` defines the
draws; the backward pass draws the mask again), and ``softmax_dropout`` computes attention's probabilities with
their dropout from bf16 or float32 scores a row at a time, with its backward pass (``softmax_dropout_backward``):
what a training step on the CPU runs instead of torch's chain of operations over the whole score tensor.

Three builds (``KINDS``), chosen at run time by the CPU's flags, best first; two from one source
(``csrc/cpu_kernels.cpp``), the layers' kernels and the training kernels:
``amx`` (Intel Sapphire Rapids and later: the products and attention's two products on AMX tiles) and
``avx512_bf16`` (AMD Zen 4 and 5, Intel Cooper Lake, Ice Lake with BF16, or a Sapphire Rapids VM that hides AMX:
the same kernels with the products on AVX-512 registers, ``vdpbf16ps`` on pairs of bf16 along the depth, 8 rows x
32 columns of float32 accumulators at a time, the weights in the same ``tile_layout``, which is also the operand
layout ``vdpbf16ps`` takes). Each kind is built without the other's instructions (no ``-mamx-*`` for
``avx512_bf16``) under a library name of its own. The third, ``avx2`` (CPUs without AVX512-BF16: AMD Zen 2 and 3,
Intel Skylake and Cascade Lake Xeons, Intel client parts), holds the training kernels alone, from a source of their
own in plain C++ (``csrc/cpu_train_kernels.cpp``, vectorised by the compiler for AVX2, FMA and F16C): the same draws
and results, so that a float32 step there draws its dropout masks in parallel C++ instead of in NumPy on one thread,
and attends through the fused softmax and dropout. The builds are made with the system's C++ compiler on first use,
into a cache keyed by the source, the flags and the compiler (``$DENSEPASS_KERNEL_CACHE``, else
``~/.cache/densepass/kernels``), and loaded with ``ctypes``. Where no build of
``LAYER_KINDS`` runs (``usable``, ``layer_kind``: an AVX2-only CPU, no compiler found, or the builds failed, with a
warning once), the fused layers run SDPA and torch's layer norm on padded batches, as they do in float32; where none
runs at all, dropout draws its masks in NumPy. ``$DENSEPASS_CPU_KERNELS=0`` turns the kernels off (to compare);
``$DENSEPASS_CPU_KERNEL_KIND`` (one of ``KINDS``, read once per process) takes that kind alone, where the CPU has it
(an AMX CPU runs the AVX512-BF16 kernels to compare them).

densepass loads no native code it did not build for this user. The cache is private to its user: a directory (made 0700)
that the user owns and group and others cannot write to, below directories only the user or root can change; a cache
shared by several users is not supported. Each library (0700) has a manifest beside it (``cpu_kernels-<key>.json``,
``cpu_kernels_avx512bf16-<key>.json``, ``cpu_train_kernels_avx2-<key>.json``: its size and sha256, the compiler's
version, the flags, the source's digest), and
is loaded only where both are the user's plain files (no link followed), the library's digest, taken from the descriptor
it is then loaded through (``/proc/self/fd/N``), matching the manifest. A damaged entry of the user's is built again;
where the cache directory or an entry in it is not the user's alone (another user's file, a link, a directory others can
write to), nothing is loaded from it: a one-line warning, and the kernels are built for the process alone in a private
temporary directory.

    >>> import torch
    >>> qkv = torch.randn(8 + 5, 3 * 12 * 32).bfloat16()  # two sequences of 8 and 5 tokens, 12 heads of 32
    >>> offsets = torch.tensor([0, 8, 13])
    >>> self_attention(qkv, offsets, heads=12).shape if usable(qkv, 32) else torch.Size([13, 384])
    torch.Size([13, 384])
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import hashlib
import json
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from densepass.device import cpuinfo_words, env_switch
from densepass.errors import ConfigError
from densepass.io import atomic_write_text

SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.cpp"
TRAIN_SOURCE = Path(__file__).with_name("csrc") / "cpu_train_kernels.cpp"
"""The ``avx2`` build's source: the training kernels alone, in plain C++ that the compiler vectorises."""
SIZES = (32, 64)
"""Head sizes ``self_attention`` takes (one or two 32-deep tile steps)."""
MAX_NORM_WIDTH = 2048
"""The widest row ``layer_norm_`` and ``AfterAttention`` take (a row of float32 values on a thread's stack)."""
ENV = "DENSEPASS_CPU_KERNELS"
"""Set to 0 to run the fused layers without these kernels (SDPA and torch's layer norm); 1 or unset: with them
where they run."""
CACHE_ENV = "DENSEPASS_KERNEL_CACHE"
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl",
         "-mavx512dq", "-mavx512bf16", "-mavx512vnni", "-mfma", "-mamx-tile", "-mamx-bf16", "-mamx-int8")  # fmt: skip
"""Compiler flags: the instruction sets the kernels use, not ``-march=native`` (a cache shared by machines of
other CPUs stays valid). OpenMP resolves to the ``libgomp`` torch has loaded, so the kernels share its threads."""
REQUIRED = frozenset(
    {"amx_tile", "amx_bf16", "amx_int8", "avx512_bf16", "avx512_vnni", "avx512bw", "avx512vl", "avx512dq"}
)
"""The CPU flags (/proc/cpuinfo) the AMX kernels need: Intel Sapphire Rapids and later."""
AVX512_FLAGS = tuple(flag for flag in FLAGS if not flag.startswith("-mamx"))
"""Compiler flags of the AVX512-BF16 build: the AMX build's without AMX (the source takes the tile path where the
compiler defines ``__AMX_TILE__``)."""
AVX512_REQUIRED = frozenset({"avx512f", "avx512_bf16", "avx512_vnni", "avx512bw", "avx512vl", "avx512dq", "fma"})
"""The CPU flags the AVX512-BF16 kernels need: AMD Zen 4 and later, Intel Cooper Lake, Sapphire Rapids."""
AVX2_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-fno-trapping-math", "-mavx2", "-mfma", "-mf16c")
"""Compiler flags of the ``avx2`` build (``TRAIN_SOURCE``): ``-fno-trapping-math`` lets the compiler compute both
sides of a select (dropout's kept and dropped elements) and so vectorise its loops; no ``-ffast-math``, whose
finite-only arithmetic would break the masked keys' -inf."""
AVX2_REQUIRED = frozenset({"avx2", "fma", "f16c"})
"""The CPU flags the ``avx2`` build needs: x86-64 CPUs since Intel Haswell and AMD Zen."""
KINDS = ("amx", "avx512_bf16", "avx2")
"""The builds of the kernels, best first."""
LAYER_KINDS = ("amx", "avx512_bf16")
"""The builds that hold the fused layers' kernels (``usable``); ``avx2`` holds the training kernels alone."""
KIND_ENV = "DENSEPASS_CPU_KERNEL_KIND"
"""Set to one of ``KINDS`` to take that build alone (where the CPU has it); unset: the best it has."""
_LIBRARY_NAMES = {"amx": "cpu_kernels", "avx512_bf16": "cpu_kernels_avx512bf16", "avx2": "cpu_train_kernels_avx2"}
_KIND_NUMBERS = {"amx": 1, "avx512_bf16": 2, "avx2": 3}  # what each build's densepass_kind() returns
_FLAGS = {"amx": FLAGS, "avx512_bf16": AVX512_FLAGS, "avx2": AVX2_FLAGS}


def kinds(words: frozenset[str] | None = None) -> list[str]:
    """The builds of the kernels this CPU runs (``words``: its /proc/cpuinfo words, default this machine's), best
    first: ``amx`` where it has ``REQUIRED``, ``avx512_bf16`` where it has ``AVX512_REQUIRED``; only the one
    ``$DENSEPASS_CPU_KERNEL_KIND`` names where it is set (a one-line ``ConfigError`` for another value)."""
    wanted = os.environ.get(KIND_ENV, "").strip()
    if wanted not in ("", *KINDS):
        raise ConfigError(f"${KIND_ENV} must be one of {', '.join(KINDS)}, got {wanted!r}")
    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return []
    words = cpuinfo_words() if words is None else words
    runs = {"amx": REQUIRED <= words, "avx512_bf16": AVX512_REQUIRED <= words, "avx2": AVX2_REQUIRED <= words}
    return [kind for kind in KINDS if runs[kind] and wanted in ("", kind)]


def kind() -> str | None:
    """The build of the kernels this process runs (``KINDS``), None where none runs."""
    library = _library()
    return None if library is None else library.kind


def layer_kind() -> str | None:
    """The build that runs the fused layers' kernels in this process (``kind`` where it is one of
    ``LAYER_KINDS``), None where torch's operations run them (no build, or ``avx2``'s training kernels alone)."""
    built = kind()
    return built if built in LAYER_KINDS else None


def usable(x: torch.Tensor, size: int) -> bool:
    """Whether the kernels run the layers of ``x`` (bf16 on the CPU) with heads of ``size``: a head size in
    ``SIZES``, the kernels not turned off (``ENV``), and a build of ``LAYER_KINDS`` loaded on this CPU."""
    switched_off = env_switch(ENV) is False  # a value other than 0 or 1 fails on any input
    return (
        x.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and size in SIZES
        and not switched_off
        and layer_kind() is not None
    )


def self_attention(
    qkv: torch.Tensor, offsets: torch.Tensor, heads: int, keys: torch.Tensor | None = None
) -> torch.Tensor:
    """Multi-head scaled dot-product attention (scale 1 / sqrt(size)) of each sequence's tokens over its keys.

    ``qkv`` [tokens, 3 x heads x size] bf16: per token its query, key and value side by side (one product of the
    three projections), the sequences' tokens one after the other, sequence ``b`` in rows ``offsets[b]`` to
    ``offsets[b + 1]`` (``offsets`` int64, [sequences + 1]); ``keys`` (int64, [sequences], default: all): how many
    of a sequence's first tokens are its keys (the rest, e.g. padding whose output is read, only query). Returns
    the context [tokens, heads x size], zero for a sequence without keys. Call where ``usable``."""
    tokens, triple = qkv.shape
    size = triple // 3 // heads
    if qkv.dtype != torch.bfloat16 or triple != 3 * heads * size or size not in SIZES:
        raise ValueError(f"qkv {tuple(qkv.shape)} {qkv.dtype} is not bf16 [tokens, 3 x {heads} heads x 32 or 64]")
    offsets, keys = _checked_sequences(offsets, keys, tokens)
    qkv = qkv.contiguous()
    out = torch.empty((tokens, heads * size), dtype=torch.bfloat16)
    attention = _library().densepass_attention
    pointers = qkv.data_ptr(), offsets.data_ptr(), keys.data_ptr(), out.data_ptr()
    status = attention(*pointers, len(keys), heads, size, size**-0.5, torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"the attention kernel refused its input (status {status})")
    return out


class SelfAttention:
    """A BERT layer's query, key and value product and its attention over packed tokens, as one kernel: a thread
    takes whole sequences of up to 256 tokens at a time, computes their queries, keys and values on AMX tiles (the
    weights in ``tile_layout``) into a buffer of its own, and their attention from there while it is in its cache,
    as ``self_attention`` computes it from ``x Wqkv^T + b`` rounded to bf16; a separate product wrote a piece's
    queries, keys and values to memory, where attention's loads of them stalled it. Built from the layer's
    ``query``, ``key`` and ``value`` linear layers (copies of their parameters) where ``fits``.

        >>> linear = lambda: nn.Linear(64, 64).bfloat16()
        >>> attention = SelfAttention(linear(), linear(), linear(), heads=2)
        >>> x, offsets = torch.randn(13, 64).bfloat16(), torch.tensor([0, 8, 13])
        >>> attention(x, offsets).shape if usable(x, 32) else torch.Size([13, 64])
        torch.Size([13, 64])
    """

    def __init__(self, query: nn.Linear, key: nn.Linear, value: nn.Linear, heads: int) -> None:
        if not self.fits(query, key, value, heads):
            raise ValueError("the attention kernel takes bf16 query, key and value layers with biases, of one width "
                             f"in heads of {' or '.join(map(str, SIZES))}")  # fmt: skip
        linears = (query, key, value)
        self.heads, self.size = heads, query.weight.shape[0] // heads
        self.tiles = tile_layout(torch.cat([linear.weight.detach() for linear in linears]))
        self.bias = torch.cat([linear.bias.detach() for linear in linears]).contiguous()

    @staticmethod
    def fits(query: nn.Linear, key: nn.Linear, value: nn.Linear, heads: int) -> bool:
        """Whether the kernel computes these layers: bf16 square weights of one width with biases, in heads of a
        size in ``SIZES``."""
        linears, width = (query, key, value), query.weight.shape[0]
        parameters = [p for linear in linears for p in (linear.weight, linear.bias)]
        return (
            all(p is not None and p.dtype == torch.bfloat16 for p in parameters)
            and all(linear.weight.shape == (width, width) for linear in linears)
            and width % heads == 0
            and width // heads in SIZES
        )

    def __call__(self, x: torch.Tensor, offsets: torch.Tensor, keys: torch.Tensor | None = None) -> torch.Tensor:
        """The attention context [tokens, width] bf16 of ``x`` [tokens, width] (bf16), sequences packed by ``offsets``
        with ``keys`` as ``self_attention`` takes them. Call where ``usable``."""
        width = self.heads * self.size
        if x.dtype != torch.bfloat16 or x.shape != (x.shape[0], width):
            raise ValueError(f"x must be bf16 [tokens, {width}], got {tuple(x.shape)} {x.dtype}")
        offsets, keys = _checked_sequences(offsets, keys, x.shape[0])
        x = x.contiguous()
        out = torch.empty_like(x)
        pointers = x.data_ptr(), offsets.data_ptr(), keys.data_ptr()
        status = _library().densepass_qkv_attention(*pointers, len(keys), self.tiles.data_ptr(), self.bias.data_ptr(),
                                                    self.heads, self.size, self.size**-0.5, out.data_ptr(),
                                                    torch.get_num_threads())  # fmt: skip
        if status != 0:
            raise RuntimeError(f"the attention kernel refused its input (status {status})")
        return out


def _checked_sequences(offsets: torch.Tensor, keys: torch.Tensor | None, tokens: int) -> tuple[torch.Tensor, ...]:
    """``offsets`` (int64 [sequences + 1], from 0 to ``tokens``, not decreasing) and ``keys`` (int64 [sequences],
    default: each sequence's length), contiguous; a one-line error where they are not."""
    malformed = offsets.dtype != torch.int64 or offsets.dim() != 1 or len(offsets) == 0
    if malformed or int(offsets[0]) != 0 or int(offsets[-1]) != tokens:
        raise ValueError(f"offsets must be int64 [sequences + 1], from 0 to the {tokens} tokens")
    lengths = offsets.diff()
    if bool((lengths < 0).any()):
        raise ValueError("offsets must not decrease")
    keys = lengths if keys is None else keys
    if keys.dtype != torch.int64 or keys.shape != lengths.shape:
        raise ValueError(f"keys must be int64 [{len(lengths)}], one count per sequence")
    return offsets.contiguous(), keys.contiguous()


def layer_norm_(x: torch.Tensor, norm: nn.LayerNorm, residual: torch.Tensor | None = None) -> torch.Tensor:
    """``norm(x + residual)`` (or ``norm(x)``) written over ``x`` [rows, width] (contiguous bf16) and returned,
    the sum taken in float32, where the kernel takes it: bf16 weight, bias and residual (of ``x``'s shape), a
    width that is a multiple of 16 up to ``MAX_NORM_WIDTH``; elsewhere ``norm(x + residual)``. Call where
    ``usable``."""
    width = x.shape[-1]
    weight, bias = norm.weight, norm.bias
    if not (
        x.dtype == weight.dtype == torch.bfloat16
        and bias is not None
        and bias.dtype == torch.bfloat16
        and x.is_contiguous()
        and (residual is None or (residual.dtype == torch.bfloat16 and residual.shape == x.shape))
        and tuple(norm.normalized_shape) == (width,)
        and width % 16 == 0
        and width <= MAX_NORM_WIDTH
    ):
        return norm(x if residual is None else x + residual)
    rows = x.numel() // width
    added = None if residual is None else residual.contiguous()
    pointers = x.data_ptr(), None if added is None else added.data_ptr(), weight.data_ptr(), bias.data_ptr()
    status = _library().densepass_layer_norm(*pointers, rows, width, norm.eps, torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"the layer norm kernel refused its input (status {status})")
    return x


def embed(embeddings: nn.Module, ids: torch.Tensor, positions: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
    """A BERT encoder's input vectors of tokens one after the other, [tokens, width] bf16: ``LayerNorm(word[ids] +
    position[positions] + type[types])`` from ``embeddings`` (``transformers``' ``BertEmbeddings`` or RoBERTa's, in
    eval mode: its dropout does nothing), each token's position and type given (int64 [tokens] each). One pass,
    the sum taken in float32, where ``transformers`` rounds each sum to bf16 and takes a pass for each lookup, sum
    and the norm; where the kernel does not take the tables (bf16, a width that is a multiple of 16 up to
    ``MAX_NORM_WIDTH``), the eager sum. An index outside its table is an error. Call where ``usable``."""
    tables = [embeddings.word_embeddings.weight, embeddings.position_embeddings.weight]
    tables.append(embeddings.token_type_embeddings.weight)
    indices = [ids, positions, types]
    for name, index, table in zip(("token id", "position", "token type"), indices, tables):
        if index.dtype != torch.int64 or index.shape != ids.shape or index.dim() != 1:
            raise ValueError(f"{name}s must be int64 [tokens], one per token")
        if len(index) and not 0 <= int(index.min()) <= int(index.max()) < len(table):
            raise ValueError(f"a {name} is outside the model's table of {len(table)}")
    norm = embeddings.LayerNorm
    width = tables[0].shape[1]
    parameters = [*tables, norm.weight, norm.bias]
    if not (
        all(p is not None and p.dtype == torch.bfloat16 and p.is_contiguous() for p in parameters)
        and tuple(norm.normalized_shape) == (width,)
        and width % 16 == 0
        and width <= MAX_NORM_WIDTH
    ):
        return norm(tables[0][ids] + tables[2][types] + tables[1][positions])
    out = torch.empty((len(ids), width), dtype=torch.bfloat16)
    indices = [index.contiguous() for index in indices]  # held until the kernel returns
    pointers = [index.data_ptr() for index in indices], [p.data_ptr() for p in parameters]
    status = _library().densepass_embed(*pointers[0], len(ids), *pointers[1], norm.eps, width, out.data_ptr(),
                                        torch.get_num_threads())  # fmt: skip
    if status != 0:
        raise RuntimeError(f"the embedding kernel refused its input (status {status})")
    return out


def tile_layout(weight: torch.Tensor) -> torch.Tensor:
    """A linear layer's weight [out, in] (both multiples of 32) in the order the products read it from memory:
    per 16 output columns, its tiles of 32 input depths one after the other, each 16 rows of the 16 columns' two
    depths side by side ([out / 16, in / 32, 16, 16, 2]: AMX's layout for the right operand of a bf16 product, and
    the AVX512-BF16 build's: each 64-byte row is the 16 columns' pair that one ``vdpbf16ps`` multiplies with a
    broadcast pair of an input row)."""
    if weight.dim() != 2 or weight.shape[0] % 32 or weight.shape[1] % 32:
        raise ValueError(f"tile_layout takes a weight [out, in] of multiples of 32, got {tuple(weight.shape)}")
    out, depth = weight.shape
    return weight.detach().reshape(out // 16, 16, depth // 32, 16, 2).permute(0, 2, 3, 1, 4).contiguous()


def untiled(tiles: torch.Tensor) -> torch.Tensor:
    """The weight [out, in] that ``tile_layout`` made ``tiles`` of."""
    blocks, steps = tiles.shape[:2]
    return tiles.permute(0, 3, 1, 2, 4).reshape(blocks * 16, steps * 32)


class _LayerWeights(ctypes.Structure):
    """``LayerWeights`` of csrc/cpu_kernels.cpp: what ``AfterAttention`` hands its kernel."""

    _fields_ = [  # noqa: RUF012 (ctypes reads the class attribute)
        *[(name, ctypes.c_void_p) for name in ("out", "out_bias", "norm1_weight", "norm1_bias", "inner",
                                               "inner_bias", "ffn", "ffn_bias", "norm2_weight", "norm2_bias")],
        ("eps1", ctypes.c_float), ("eps2", ctypes.c_float), ("width", ctypes.c_int64), ("inner_width", ctypes.c_int64),
    ]  # fmt: skip


class AfterAttention:
    """What follows the attention in a BERT layer, as one kernel over packed tokens:

        h   = LayerNorm(x + context Wo^T + bo)
        out = LayerNorm(h + GELU(h Wi^T + bi) Wf^T + bf)

    A thread takes 256 tokens at a time through all of it, so ``h`` and the 4x wider GELU output stay in its caches
    instead of going through memory. The products run on AMX tiles, with the weights in ``tile_layout``: the tiles
    of a block of 32 tokens x 32 columns, then its bias, residual or GELU applied to the float32 result as it comes
    off the tiles (interleaved with the next block's tile instructions), where oneDNN's products take a pass of
    their own for each (GELU's post-op a whole pass over the 4x wider output). The layer norms run row by row as soon as
    a row's sums are complete, interleaved with the next rows' product. GELU is the exact (erf) GELU by a quartic on
    each of 32 intervals, within 1.2e-6 of it; the layer norms are two-pass in float32 (the shifted-data algorithm).
    Built from the layer's modules where ``fits``, from a copy of their parameters (the weights in ``tile_layout``): the
    layer as it was built, as the inference copies it is made for are (``models.copies``); the weights' other layout is
    ``untiled(self.tiles[name])``. Each of torch's threads keeps its buffers from call to call: 256 x (12 x width + 2 x
    inner width) bytes (2 MB for MiniLM, 5 MB for BERT-large).

        >>> linear, norm = lambda i, o: nn.Linear(i, o).bfloat16(), lambda: nn.LayerNorm(64).bfloat16()
        >>> kernel = AfterAttention(linear(64, 64), norm(), linear(64, 256), linear(256, 64), norm())
        >>> x = torch.randn(10, 64).bfloat16()
        >>> kernel(x, x).shape if usable(x, 32) else torch.Size([10, 64])
        torch.Size([10, 64])
    """

    def __init__(
        self, out: nn.Linear, attention_norm: nn.LayerNorm, inner: nn.Linear, ffn: nn.Linear, output_norm: nn.LayerNorm
    ) -> None:
        if not self.fits(out, attention_norm, inner, ffn, output_norm):
            raise ValueError(
                "the after-attention kernel takes bf16 layers with biases, widths and inner widths in multiples of 32 "
                f"(widths up to {MAX_NORM_WIDTH}), and layer norms over the width with a weight and a bias"
            )
        linears = {"out": out, "inner": inner, "ffn": ffn}
        self.tiles = {name: tile_layout(linear.weight) for name, linear in linears.items()}
        biases = [linear.bias.detach().clone() for linear in linears.values()]
        norms = [p.detach().clone() for norm in (attention_norm, output_norm) for p in (norm.weight, norm.bias)]
        # what the kernel reads: copies, held here (the layer as it was built, whatever later happens to its modules)
        self._tensors = [self.tiles["out"], biases[0], *norms[:2], self.tiles["inner"], biases[1], self.tiles["ffn"],
                         biases[2], *norms[2:]]  # fmt: skip
        pointers = [tensor.data_ptr() for tensor in self._tensors]
        width, inner_width = out.weight.shape[0], inner.weight.shape[0]
        self._weights = _LayerWeights(*pointers, attention_norm.eps, output_norm.eps, width, inner_width)

    @staticmethod
    def fits(
        out: nn.Linear, attention_norm: nn.LayerNorm, inner: nn.Linear, ffn: nn.Linear, output_norm: nn.LayerNorm
    ) -> bool:
        """Whether the kernel computes this layer: bf16 weights and biases, a width (a multiple of 32, at most
        ``MAX_NORM_WIDTH``) and an inner width (a multiple of 32) the products take in whole tiles, layer norms over
        the width with a weight and a bias."""
        width, inner_width = out.weight.shape[0], inner.weight.shape[0]
        tensors = [out.weight, out.bias, inner.weight, inner.bias, ffn.weight, ffn.bias]
        tensors += [attention_norm.weight, attention_norm.bias, output_norm.weight, output_norm.bias]
        return (
            all(tensor is not None and tensor.dtype == torch.bfloat16 for tensor in tensors)
            and out.weight.shape == (width, width)
            and inner.weight.shape == (inner_width, width)
            and ffn.weight.shape == (width, inner_width)
            and width % 32 == 0
            and width <= MAX_NORM_WIDTH
            and inner_width % 32 == 0
            and tuple(attention_norm.normalized_shape) == tuple(output_norm.normalized_shape) == (width,)
        )

    def __call__(self, context: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The layer's output [tokens, width] (bf16) from the attention ``context`` and the layer's input ``x``,
        both [tokens, width] bf16. Call where ``usable``."""
        width = self._weights.width
        if not (context.dtype == x.dtype == torch.bfloat16 and context.shape == x.shape == (x.shape[0], width)):
            raise ValueError(f"context and x must be bf16 [tokens, {width}], got {tuple(context.shape)} and "
                             f"{tuple(x.shape)}")  # fmt: skip
        context, x = context.contiguous(), x.contiguous()
        out = torch.empty_like(x)
        kernel = _library().densepass_after_attention
        status = kernel(context.data_ptr(), x.data_ptr(), x.shape[0], ctypes.byref(self._weights), out.data_ptr(),
                        torch.get_num_threads())  # fmt: skip
        if status != 0:
            raise RuntimeError(f"the after-attention kernel refused its input (status {status})")
        return out


def vnni_layout(weight: torch.Tensor) -> torch.Tensor:
    """An int8 weight [out, in] (``out`` a multiple of 32, ``in`` of 16) in the order ``Int8Linear``'s products read
    it: per 16 output columns, the depth four at a time, each 64-byte row the 16 columns' four bytes ([out / 16,
    in / 4, 16, 4]: what one ``vpdpbusd`` multiplies with an input row's four bytes, broadcast)."""
    if weight.dtype != torch.int8 or weight.dim() != 2 or weight.shape[0] % 32 or weight.shape[1] % 16:
        raise ValueError(f"vnni_layout takes an int8 weight [out, in] (multiples of 32, 16), got {tuple(weight.shape)}")
    out, depth = weight.shape
    return weight.reshape(out // 16, 16, depth // 4, 4).permute(0, 2, 1, 3).contiguous()


def quantized_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear layer's weight [out, in] as int8 with a scale per output row (max |w| / 127; 1 for a row of
    zeros): (int8 weight, float32 scales)."""
    w = weight.detach().float()
    top = w.abs().amax(dim=1)
    scale = torch.where(top > 0, top / 127, torch.ones_like(top))
    return torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8), scale


class Int8Linear:
    """A linear layer through int8 products (``vpdpbusd`` on AVX512-VNNI; AMX tiles' ``tdpbusd`` in the ``amx``
    build where ``in`` is a multiple of 64: the same exact integer sums), for bf16 inputs:

        q_i = round((x_i - l_i) / s_i)     each input row (token) over its own range: l_i = min_k x_ik,
                                           s_i = (max_k x_ik - l_i) / 255, q_i in [0, 255]
        y_ij = t_j (s_i sum_k q_ik W_jk + l_i sum_k W_jk) + b_j     W int8 with a scale t_j per output row

    the integer sums exact (int32), rounded once to bf16 (after GELU, ``gelu=True``: the feed-forward's first
    product). A scale per token keeps what dynamic int8 with one scale for a whole batch loses, and the offset per
    token (all 256 levels over the row's range, however skewed: hidden states of BERT-style models have a few large
    features of one sign) leaves less error than a symmetric scale (``benchmarks/encode_quality.py`` measures it:
    docs/benchmarks.md, "int8 encoding on an AMD EPYC"). The weights are quantised once (``quantized_weight``), in
    ``vnni_layout``. Call where ``usable``.

        >>> layer = Int8Linear(nn.Linear(64, 96))
        >>> x = torch.randn(5, 64).bfloat16()
        >>> layer(x).shape if usable(x, 32) else torch.Size([5, 96])
        torch.Size([5, 96])
    """

    def __init__(self, linear: nn.Linear, gelu: bool = False) -> None:
        out, depth = linear.weight.shape
        if out % 32 or depth % 16:
            raise ValueError(f"Int8Linear takes layers of multiples of 32 outputs and 16 inputs, got {depth} -> {out}")
        weight, self.scale = quantized_weight(linear.weight)
        self.sums = weight.sum(dim=1, dtype=torch.int32).float()  # exact: |sum| <= 127 x depth < 2^24
        self.layout = vnni_layout(weight)
        self.bias = None if linear.bias is None else linear.bias.detach().bfloat16().clone()
        self.gelu = gelu
        self.shape = (out, depth)

    @property
    def weight(self) -> torch.Tensor:
        """The int8 weight [out, in] (read back from ``layout``, for references)."""
        out, depth = self.shape
        return self.layout.permute(0, 2, 1, 3).reshape(out, depth)

    def __call__(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` [rows, in] bf16 through the layer: [rows, out] bf16, written into ``out`` where given (a
        contiguous bf16 tensor of at least that many values: a buffer reused across calls, which spares a large
        output the page faults of fresh memory)."""
        width, depth = self.shape
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != depth:
            raise ValueError(f"Int8Linear takes bf16 [rows, {depth}], got {x.dtype} {tuple(x.shape)}")
        x = x.contiguous()
        if out is None:
            y = torch.empty(x.shape[0], width, dtype=torch.bfloat16)
        elif out.dtype != torch.bfloat16 or not out.is_contiguous() or out.numel() < x.shape[0] * width:
            raise ValueError(f"Int8Linear writes into a contiguous bf16 buffer of >= {x.shape[0] * width} values")
        else:
            y = out.view(-1)[: x.shape[0] * width].view(x.shape[0], width)
        bias = 0 if self.bias is None else self.bias.data_ptr()
        status = _library().densepass_int8_linear(x.data_ptr(), x.shape[0], depth, self.layout.data_ptr(),
                                                  self.scale.data_ptr(), self.sums.data_ptr(), bias, width,
                                                  int(self.gelu), y.data_ptr(), torch.get_num_threads())  # fmt: skip
        if status != 0:
            raise RuntimeError(f"the int8 product refused its input (status {status})")
        return y


def trains() -> bool:
    """Whether dropout and attention's probabilities run through these kernels while training on the CPU
    (``dropout``, ``softmax_dropout``): the kernels not turned off (``ENV``), and built and loaded on this CPU."""
    return env_switch(ENV) is not False and _library() is not None


def dropout(x: torch.Tensor, seed: int, threshold: int, scale: float) -> torch.Tensor:
    """``x`` (float32 or bf16, CPU) times ``scale`` where dropout's draws under ``seed`` keep an element (its 16-bit
    draw below ``threshold``; ``models.dropout`` defines the draws), else 0, as a new tensor. The backward pass
    calls it on the gradient with the same seed: the mask is drawn again, never kept. Call where ``trains``."""
    if x.dtype not in (torch.float32, torch.bfloat16) or x.device.type != "cpu":
        raise ValueError(f"dropout takes float32 or bf16 CPU tensors, got {x.dtype} on {x.device}")
    x = x.contiguous()
    out = torch.empty_like(x)
    _library().densepass_dropout(x.data_ptr(), out.data_ptr(), x.numel(), int(x.dtype == torch.bfloat16), seed,
                                 threshold, scale, torch.get_num_threads())  # fmt: skip
    return out


def softmax_dropout(
    scores: torch.Tensor, mask: torch.Tensor | None, scale: float, seed: int, threshold: int, keep_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention's probabilities with dropout in one pass: ``scores`` [batch, heads, queries, keys] bf16 or float32
    -> (out, probs), both of that dtype and shape: probs = softmax(scale x scores) over the keys ``mask`` keeps (bool,
    broadcastable to ``scores``; None: all), in float32, kept for the backward pass; out = probs x ``keep_scale``
    where dropout's draws (``dropout``'s, element by element of ``scores``) keep an element, else 0. A row
    without keys: uniform out, zero probs (a zero gradient, as ``masked_fill``'s). Call where ``trains``."""
    if scores.dtype not in (torch.bfloat16, torch.float32) or scores.dim() != 4 or scores.device.type != "cpu":
        raise ValueError(f"softmax_dropout takes bf16 or float32 [batch, heads, queries, keys] CPU scores, got "
                         f"{scores.dtype} {tuple(scores.shape)}")  # fmt: skip
    scores = scores.contiguous()
    batch, heads, queries, keys = scores.shape
    strides, pointer = (0, 0, 0), 0
    if mask is not None:
        if mask.dtype != torch.bool:
            raise ValueError(f"softmax_dropout takes a bool mask, got {mask.dtype}")
        mask = mask.expand(batch, heads, queries, keys)
        if mask.stride(3) != 1:
            mask = mask.contiguous()
        strides, pointer = mask.stride()[:3], mask.data_ptr()
    out, probs = torch.empty_like(scores), torch.empty_like(scores)
    _library().densepass_softmax_dropout(scores.data_ptr(), pointer, *strides, batch, heads, queries, keys, scale,
                                         seed, threshold, keep_scale, probs.data_ptr(), out.data_ptr(),
                                         int(scores.dtype == torch.bfloat16), torch.get_num_threads())  # fmt: skip
    return out, probs


def softmax_dropout_backward(
    grad: torch.Tensor, probs: torch.Tensor, scale: float, seed: int, threshold: int, keep_scale: float
) -> torch.Tensor:
    """``softmax_dropout``'s backward pass: the gradient of its out (``grad``) -> the gradient of its scores (of
    ``probs``' dtype), scale x P (dP - sum_j dP_j P_j) with dP = ``grad`` x ``keep_scale`` where the same draws keep
    an element, else 0, per row of keys in float32. Call where ``trains``."""
    grad = grad.to(probs.dtype).contiguous()
    out = torch.empty_like(probs)
    keys = max(probs.shape[-1], 1)  # no keys: no rows to compute either
    bf16 = int(probs.dtype == torch.bfloat16)
    _library().densepass_softmax_dropout_backward(grad.data_ptr(), probs.data_ptr(), probs.numel() // keys, keys,
                                                  scale, seed, threshold, keep_scale, out.data_ptr(), bf16,
                                                  torch.get_num_threads())  # fmt: skip
    return out


def dropout_draws(seed: int, count: int, first: int = 0) -> torch.Tensor:
    """The kernels' dropout draws of elements ``first`` .. ``first + count - 1`` under ``seed`` (uint16, as int32:
    for tests, which check them against ``models.dropout.draws``). Call where ``trains``."""
    out = torch.empty(count, dtype=torch.int16)
    _library().densepass_dropout_draws(seed, first, count, out.data_ptr())
    return out.to(torch.int32) & 0xFFFF


def gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU as ``AfterAttention`` computes it, of float32 ``x`` (its count a multiple of 16; for tests). Call where
    ``usable``."""
    x = x.contiguous()
    if x.dtype != torch.float32 or x.numel() % 16 != 0:
        raise ValueError("gelu takes float32 values, a multiple of 16 of them")
    out = torch.empty_like(x)
    _library().densepass_gelu(x.data_ptr(), out.data_ptr(), x.numel())
    return out


@functools.cache
def _library() -> ctypes.CDLL | None:
    """The kernels, built and loaded once per process: the first of ``kinds()`` that builds and loads (a warning for
    each that does not); None where this machine runs none."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    candidates = kinds()
    if compiler is None or not candidates:
        return None
    for number, candidate in enumerate(candidates):
        instead = "SDPA runs" if number + 1 == len(candidates) else f"the {candidates[number + 1]} kernels are tried"
        try:
            library = _loaded(compiler, candidate)
        except (OSError, subprocess.SubprocessError, ValueError) as error:
            lines = (getattr(error, "stderr", "") or str(error)).strip().splitlines() or [type(error).__name__]
            warnings.warn(f"densepass's CPU kernels ({candidate}) did not build, {instead} instead: {lines[-1]}",
                          stacklevel=1)  # fmt: skip
            continue
        if library.densepass_kind() != _KIND_NUMBERS[candidate]:
            warnings.warn(f"densepass's CPU kernels ({candidate}) built as another kind, {instead} instead",
                          stacklevel=1)  # fmt: skip
            continue
        if library.densepass_request_amx() != 0:  # Linux refused the tile state (before 5.16)
            continue
        library.kind = candidate
        pointer, size, number_ = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
        seed, count = ctypes.c_uint64, ctypes.c_uint32
        library.densepass_dropout.argtypes = [pointer, pointer, size, ctypes.c_int, seed, count, number_,
                                              ctypes.c_int]  # fmt: skip
        library.densepass_softmax_dropout.argtypes = [pointer, pointer, *[size] * 7, number_, seed, count, number_,
                                                      pointer, pointer, ctypes.c_int, ctypes.c_int]  # fmt: skip
        library.densepass_softmax_dropout_backward.argtypes = [pointer, pointer, size, size, number_, seed, count,
                                                               number_, pointer, *[ctypes.c_int] * 2]  # fmt: skip
        library.densepass_dropout_draws.argtypes = [seed, size, size, pointer]
        library.densepass_dropout_draws.restype = None
        if candidate not in LAYER_KINDS:  # the training kernels alone
            return library
        library.densepass_attention.argtypes = [*[pointer] * 4, *[size] * 3, number_, ctypes.c_int]
        library.densepass_layer_norm.argtypes = [*[pointer] * 4, *[size] * 2, number_, ctypes.c_int]
        library.densepass_after_attention.argtypes = [pointer, pointer, size, ctypes.POINTER(_LayerWeights),
                                                      pointer, ctypes.c_int]  # fmt: skip
        library.densepass_embed.argtypes = [*[pointer] * 3, size, *[pointer] * 5, number_, size, pointer,
                                            ctypes.c_int]  # fmt: skip
        library.densepass_qkv_attention.argtypes = [*[pointer] * 3, size, pointer, pointer, size, size, number_,
                                                    pointer, ctypes.c_int]  # fmt: skip
        library.densepass_gelu.argtypes, library.densepass_gelu.restype = [pointer, pointer, size], None
        library.densepass_int8_linear.argtypes = [
            pointer,
            size,
            size,
            *[pointer] * 4,
            size,
            ctypes.c_int,
            pointer,
            ctypes.c_int,
        ]
        return library
    return None


def _loaded(compiler: str, kind: str = "amx") -> ctypes.CDLL:
    """The library of ``kind`` (``KINDS``) built by ``compiler`` from the cache (``_cache_path``), verified and
    loaded (``_verified_load``), compiled into it where it is missing or damaged. Where the cache directory or its
    entry is not this user's alone (``_Refused``), nothing is loaded from it: a one-line warning, and the library is
    built for this process alone in a private temporary directory (removed once it is loaded); where that fails too,
    the error."""
    inputs = _inputs(compiler, kind)
    try:
        return _load_from(_private_directory(_cache_path(), create=True), compiler, inputs)
    except _Refused as refused:
        warnings.warn(f"densepass's CPU kernels are not loaded from their cache: {refused}; built for this process "
                      "in a private temporary directory instead", stacklevel=2)  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="densepass-kernels-") as private:
        return _load_from(_private_directory(Path(private)), compiler, inputs)


def _load_from(cache: Path, compiler: str, inputs: dict) -> ctypes.CDLL:
    """The library in ``cache``, built where needed and loaded; built again once where another process replaced it
    between the build and the load."""
    try:
        return _verified_load(_built(compiler, cache, inputs), inputs)
    except _Damaged:
        return _verified_load(_built(compiler, cache, inputs), inputs)


def _cache_path() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "densepass" / "kernels")


def _inputs(compiler: str, kind: str = "amx") -> dict:
    """What a library of ``kind`` (``KINDS``) is built from, as its manifest records it: the kind, the cache key (of
    the source, the flags and the compiler's version), the compiler's version, the flags (``FLAGS``,
    ``AVX512_FLAGS`` or ``AVX2_FLAGS``) and the source's digest."""
    if kind not in KINDS:
        raise ValueError(f"no such build of the kernels: {kind!r}")
    flags = _FLAGS[kind]
    run = functools.partial(subprocess.run, capture_output=True, text=True, errors="replace", check=True)
    version = run([compiler, "--version"]).stdout
    source = _source(kind).read_bytes()
    key = hashlib.sha256(b"\0".join([source, " ".join(flags).encode(), version.encode()])).hexdigest()[:16]
    source_digest = hashlib.sha256(source).hexdigest()
    return {"kind": kind, "key": key, "compiler_version": version, "flags": list(flags), "source_sha256": source_digest}


def _source(kind: str) -> Path:
    """The source a build of ``kind`` compiles: ``TRAIN_SOURCE`` for ``avx2``, else ``SOURCE``."""
    return TRAIN_SOURCE if kind == "avx2" else SOURCE


def _built(compiler: str, cache: Path | None = None, inputs: dict | None = None) -> Path:
    """The shared library built from its kind's source (``SOURCE``; ``TRAIN_SOURCE`` for ``avx2``) by ``compiler``
    in ``cache`` (default: the private cache directory, ``_Refused`` where it is not private), where a verified one
    is there already (``_verified``), else compiled into it: under a lock on the directory (parallel builds build
    once), owner-only (0700), its manifest ``<library name>-<key>.json`` (the library's size and sha256, the build's
    inputs) written atomically before the library is renamed to its final name. An entry that is not
    this user's plain file is ``_Refused``, never replaced."""
    inputs = _inputs(compiler) if inputs is None else inputs
    cache = _private_directory(_cache_path(), create=True) if cache is None else cache
    target = cache / f"{_LIBRARY_NAMES[inputs['kind']]}-{inputs['key']}.so"
    with contextlib.suppress(_Damaged):
        os.close(_verified(target, inputs))
        return target
    run = functools.partial(subprocess.run, capture_output=True, text=True, errors="replace", check=True)
    with _directory_lock(cache):
        with contextlib.suppress(_Damaged):
            os.close(_verified(target, inputs))  # built by another process while this one waited
            return target
        handle, partial = tempfile.mkstemp(dir=cache, prefix=target.name, suffix=".tmp")
        os.close(handle)
        try:
            run([compiler, *inputs["flags"], str(_source(inputs["kind"])), "-o", partial])
            fd = os.open(partial, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            try:  # the compiler's file (a linker writes a new one, its mode from the umask)
                info = os.fstat(fd)
                if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
                    raise _Refused(f"{partial} is not a file of this user's")
                if info.st_size == 0:
                    raise OSError(f"{compiler} wrote no library")
                os.fchmod(fd, 0o700)
                size, digest = _digest(fd)
            finally:
                os.close(fd)
            manifest = {"library": target.name, "size": size, "sha256": digest, "compiler": compiler, **inputs}
            atomic_write_text(_manifest_path(target), json.dumps(manifest, indent=1) + "\n")
            os.chmod(_manifest_path(target), 0o600)  # its mode came from the umask (group-writable under 002)
            os.replace(partial, target)
        finally:
            Path(partial).unlink(missing_ok=True)
    return target


def _verified_load(target: Path, inputs: dict) -> ctypes.CDLL:
    """The library ``target`` loaded from the very file ``_verified`` checked: opened once (no link followed), its
    digest taken from that descriptor, and ``dlopen``ed as ``/proc/self/fd/N``, so a file swapped in under its name
    after the check is never the one loaded. The descriptor stays open (``_HELD``)."""
    fd = _verified(target, inputs)
    try:
        library = ctypes.CDLL(f"/proc/self/fd/{fd}")
    except BaseException:
        os.close(fd)
        raise
    _HELD.append(fd)
    return library


_HELD: list[int] = []
"""The descriptors the libraries were loaded through, open as long as the process runs: ``dlopen`` knows a library
by the name it was opened under, and would take a later ``/proc/self/fd/N`` of a reused N for the first library."""


class _Damaged(OSError):
    """A cache entry of this user's that is missing, incomplete or does not match its manifest: built again."""


class _Refused(OSError):
    """A cache directory or entry that is not this user's alone (a link, not a plain file, another user's, open to
    others' writes): nothing is loaded from it and it is left as it is."""


def _manifest_path(target: Path) -> Path:
    return target.with_suffix(".json")


def _verified(target: Path, inputs: dict) -> int:
    """A descriptor of ``target``, open for reading, where it and its manifest are this user's plain files (not
    links, not writable by group or others) and the manifest records the library's size and sha256 (taken from the
    descriptor) and ``inputs``; ``_Damaged`` where either is missing, does not match or is open to others' writes
    (a file this user owns, replaced by the next build), ``_Refused`` where either is not this user's plain file."""
    fd = _opened(_manifest_path(target))
    try:
        text = os.read(fd, 1 << 20)
    finally:
        os.close(fd)
    try:
        manifest = json.loads(text)
    except ValueError as error:
        raise _Damaged(f"{_manifest_path(target)} is not a manifest") from error
    fd = _opened(target)
    try:
        size, digest = _digest(fd)
        expected = {"library": target.name, "size": size, "sha256": digest, **inputs}
        if not isinstance(manifest, dict) or any(manifest.get(name) != value for name, value in expected.items()):
            raise _Damaged(f"{target} does not match its manifest")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _opened(path: Path) -> int:
    """A read-only descriptor of ``path`` where it is this user's plain file, not writable by group or others; no
    link is followed and a pipe does not block the open."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError as error:
        raise _Damaged(f"{path} is missing") from error
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise _Refused(f"{path} is a symbolic link") from error
        raise _Refused(f"{path} cannot be opened ({error.strerror})") from error
    try:
        info, uid = os.fstat(fd), os.getuid()
        if not stat.S_ISREG(info.st_mode):
            raise _Refused(f"{path} is not a regular file")
        if info.st_uid != uid:
            raise _Refused(f"{path} belongs to uid {info.st_uid}, not this user ({uid})")
        if info.st_mode & 0o022:
            raise _Damaged(f"{path} is writable by group or others")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _digest(fd: int) -> tuple[int, str]:
    """The size and sha256 of the file open as ``fd``, read from its start."""
    digest, size, offset = hashlib.sha256(), 0, 0
    while chunk := os.pread(fd, 1 << 20, offset):
        digest.update(chunk)
        size, offset = size + len(chunk), offset + len(chunk)
    return size, digest.hexdigest()


def _private_directory(path: Path, create: bool = False) -> Path:
    """``path`` with its links resolved, where it is a directory of this user's that group and others cannot write
    to, below directories only this user or root can change (a directory others may write to only where it is
    sticky, as /tmp): no other user can put a file in it or swap it for another. ``create``: made where missing
    (mode 0700). ``_Refused`` (naming the problem) otherwise; an existing directory's mode is not changed."""
    if create and not os.path.lexists(path):
        try:
            for folder in [*reversed(Path(path).parents), Path(path)]:  # each one made 0700, whatever the umask
                if not os.path.lexists(folder):
                    with contextlib.suppress(FileExistsError):
                        os.mkdir(folder, 0o700)
        except OSError as error:
            raise _Refused(f"{path} cannot be made ({error.strerror})") from error
    real, uid = Path(os.path.realpath(path)), os.getuid()
    try:
        info = os.lstat(real)
    except OSError as error:
        raise _Refused(f"{real} cannot be read ({error.strerror})") from error
    if not stat.S_ISDIR(info.st_mode):
        raise _Refused(f"{real} is not a directory")
    if info.st_uid != uid:
        raise _Refused(f"{real} belongs to uid {info.st_uid}, not this user ({uid})")
    if info.st_mode & 0o022:
        raise _Refused(f"{real} is writable by group or others (chmod 700 it to use it)")
    for parent in real.parents:
        info = os.lstat(parent)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid not in (uid, 0):
            raise _Refused(f"{real} is inside {parent}, which belongs to uid {info.st_uid}, not this user or root")
        if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
            raise _Refused(f"{real} is inside {parent}, which group or others can write to")
    return real


@contextlib.contextmanager
def _directory_lock(directory: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``directory`` itself for the block (none where the file system has no such locks:
    a second build then writes the same library)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock
