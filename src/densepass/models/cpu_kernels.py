"""bf16 kernels of the fused BERT layers on x86 CPUs with AMX: the query, key and value product with attention, and
all that follows it, on AMX tiles, in C++.

SDPA's CPU flash-attention kernel ran MiniLM's attention (12 heads of 32 dimensions over rows of about 90 tokens)
at 61 G multiply-adds/s on a 2-core Xeon with AMX, against 0.5-1.6 T for the layer's products, and took a third of
a fused layer's time; torch's bf16 layer norm another 8% (``benchmarks/bench_layer_parts.py``, docs/benchmarks.md).
``self_attention`` computes, per sequence and head,

    S = Q K^T                 on AMX tiles (bf16 in, float32 out), 16 queries x 16 keys a tile
    P = exp(scale (S - max))  in float32 (AVX-512), per query row, rounded to bf16
    O = P V / sum(P)          on AMX tiles, divided and rounded to bf16

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

The kernels (``csrc/cpu_kernels.cpp``) are built with the system's C++ compiler on first use, into a cache keyed
by the source, the flags and the compiler (``$DENSEPASS_KERNEL_CACHE``, else ``~/.cache/densepass/kernels``), and
loaded with ``ctypes``. Where the CPU has no AMX, no compiler is found or the build fails (a warning, once), the
fused layers run SDPA and torch's layer norm on padded batches, as they do in float32. ``$DENSEPASS_CPU_KERNELS=0``
turns the kernels off (to compare).

    >>> import torch
    >>> qkv = torch.randn(8 + 5, 3 * 12 * 32).bfloat16()  # two sequences of 8 and 5 tokens, 12 heads of 32
    >>> offsets = torch.tensor([0, 8, 13])
    >>> self_attention(qkv, offsets, heads=12).shape if usable(qkv, 32) else torch.Size([13, 384])
    torch.Size([13, 384])
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch
from torch import nn

from densepass.device import cpuinfo_words, env_switch

SOURCE = Path(__file__).with_name("csrc") / "cpu_kernels.cpp"
SIZES = (32, 64)
"""Head sizes ``self_attention`` takes (one or two 32-deep tile steps)."""
MAX_NORM_WIDTH = 2048
"""The widest row ``layer_norm_`` and ``AfterAttention`` take (a row of float32 values on a thread's stack)."""
ENV = "DENSEPASS_CPU_KERNELS"
"""Set to 0 to run the fused layers without these kernels (SDPA and torch's layer norm); 1 or unset: with them
where they run."""
CACHE_ENV = "DENSEPASS_KERNEL_CACHE"
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl",
         "-mavx512dq", "-mavx512bf16", "-mfma", "-mamx-tile", "-mamx-bf16")  # fmt: skip
"""Compiler flags: the instruction sets the kernels use, not ``-march=native`` (a cache shared by machines of
other CPUs stays valid). OpenMP resolves to the ``libgomp`` torch has loaded, so the kernels share its threads."""
REQUIRED = frozenset({"amx_tile", "amx_bf16", "avx512_bf16", "avx512bw", "avx512vl", "avx512dq"})
"""The CPU flags (/proc/cpuinfo) the kernels need: Intel Sapphire Rapids and later."""


def usable(x: torch.Tensor, size: int) -> bool:
    """Whether the kernels run the layers of ``x`` (bf16 on the CPU) with heads of ``size``: a head size in
    ``SIZES``, the kernels not turned off (``ENV``), and built and loaded on this CPU."""
    switched_off = env_switch(ENV) is False  # a value other than 0 or 1 fails on any input
    return (
        x.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and size in SIZES
        and not switched_off
        and _library() is not None
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
    depths side by side ([out / 16, in / 32, 16, 16, 2]: AMX's layout for the right operand of a bf16 product)."""
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
    their own for each (GELU's post-op cost 12% of a layer). The layer norms run row by row as soon as a row's sums
    are complete, interleaved with the next rows' product. GELU is the exact (erf) GELU by a quartic on each of 32
    intervals, within 1.2e-6 of it; the layer norms are two-pass in float32 (the shifted-data algorithm). Built from
    the layer's modules where ``fits``, from a copy of their parameters (the weights in ``tile_layout``): the layer as
    it was built, as the inference copies it is made for are (``models.copies``); the weights' other layout is
    ``untiled(self.tiles[name])``. Each of torch's threads keeps its buffers from call to call: 256 x (12 x width +
    2 x inner width) bytes (2 MB for MiniLM, 5 MB for BERT-large).

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
    """The kernels, built and loaded once per process; None where this machine cannot run them."""
    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    if not REQUIRED <= cpuinfo_words():
        return None
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        return None
    try:
        library = _loaded(compiler)
    except (OSError, subprocess.SubprocessError, ValueError) as error:
        lines = (getattr(error, "stderr", "") or str(error)).strip().splitlines() or [type(error).__name__]
        warnings.warn(f"densepass's CPU kernels did not build, SDPA runs instead: {lines[-1]}", stacklevel=1)
        return None
    if library.densepass_request_amx() != 0:  # Linux refused the tile state (before 5.16)
        return None
    pointer, size, number = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    library.densepass_attention.argtypes = [*[pointer] * 4, *[size] * 3, number, ctypes.c_int]
    library.densepass_layer_norm.argtypes = [*[pointer] * 4, *[size] * 2, number, ctypes.c_int]
    library.densepass_after_attention.argtypes = [pointer, pointer, size, ctypes.POINTER(_LayerWeights), pointer,
                                                  ctypes.c_int]  # fmt: skip
    library.densepass_embed.argtypes = [*[pointer] * 3, size, *[pointer] * 5, number, size, pointer, ctypes.c_int]
    library.densepass_qkv_attention.argtypes = [*[pointer] * 3, size, pointer, pointer, size, size, number, pointer,
                                                ctypes.c_int]  # fmt: skip
    library.densepass_gelu.argtypes, library.densepass_gelu.restype = [pointer, pointer, size], None
    return library


def _loaded(compiler: str) -> ctypes.CDLL:
    """The library from the cache, built by ``compiler`` where it is missing, or again where what the cache holds
    does not load (a damaged or foreign file: what ``_built`` writes is complete)."""
    target = _built(compiler)
    try:
        return ctypes.CDLL(str(target))
    except OSError:
        target.unlink(missing_ok=True)
        return ctypes.CDLL(str(_built(compiler)))


def _built(compiler: str) -> Path:
    """The shared library built from ``SOURCE`` by ``compiler``, from the cache or compiled into it (atomically:
    a library is complete under its final name, and builds in parallel leave the same file), readable by every
    user of a shared cache."""
    run = functools.partial(subprocess.run, capture_output=True, text=True, errors="replace", check=True)
    version = run([compiler, "--version"]).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(FLAGS), version]).encode()).hexdigest()[:16]
    cache = Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "densepass" / "kernels")
    target = cache / f"cpu_kernels-{key}.so"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        handle, partial = tempfile.mkstemp(dir=cache, prefix=target.name, suffix=".tmp")
        os.close(handle)
        try:
            run([compiler, *FLAGS, str(SOURCE), "-o", partial])
            if Path(partial).stat().st_size == 0:
                raise OSError(f"{compiler} wrote no library")
            os.chmod(partial, 0o755)  # mkstemp's file is private to its owner
            os.replace(partial, target)
        finally:
            Path(partial).unlink(missing_ok=True)
    return target
