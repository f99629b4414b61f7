"""Dropout on the CPU with counter-based masks instead of PyTorch's own, drawn again in the backward pass.

Why: PyTorch's CPU Bernoulli kernel draws with MKL's vectorised generator on Intel CPUs only; elsewhere (AMD, ARM)
it draws one element at a time under a lock, and the dropout masks of a training step (every hidden state, and
every attention probability: heads x L x L per text) become a large share of a bf16 step there
(``benchmarks/bench_train.py --profile`` shows it; docs/history/benchmarks-log.md has the profile).

**The draws.** A call draws one seed from PyTorch's CPU generator; element ``e`` of its tensor (flat, row-major)
gets the 16-bit part ``e % 4`` of word ``e // 4``, word ``w`` being SplitMix64's output for the counter ``w + 1``
(``seed + (w + 1) golden``, then SplitMix64's finaliser; ``draws``). An element is kept when its draw is below
``round((1 - p) 2^16)`` and kept elements are scaled by the inverse of that probability, so the masks follow
``torch.nn.Dropout``'s distribution to 2^-16 and every output keeps its expectation; only the random stream
differs. An element's draw depends on its index alone, so the backward pass draws its forward pass's mask again
instead of keeping it (no mask in memory between the passes), and threads draw their parts independently.

**Where they run.** Where densepass's CPU kernels load (``models.cpu_kernels.trains``), dropout runs there, and the
attention of a step (bf16 under autocast, or float32) computes softmax(scale QK^T + mask), its dropout and its
backward pass in one kernel a row at a time (``softmax_dropout``) instead of a chain of torch operations over the
whole score tensor (scale, mask, softmax, dropout, and each one's backward pass);
elsewhere NumPy draws the same masks (the same stream, tested) and torch applies them. The seeds follow
``torch.manual_seed``, are saved and restored with its state in checkpoints (bit-exact resume), and repeat under
``device.RandomState`` (gradient caching replays a forward pass).

``use_cpu_dropout(model, device)`` switches a model that trains on the CPU: its ``nn.Dropout`` modules, and the
attention-probability dropout of Hugging Face models that attend through SDPA (an attention function registered
with transformers' ``AttentionInterface``: with dropout on, attention computed as SDPA's math path computes it,
softmax(QK^T scale + mask) V, with this dropout on the probabilities; otherwise SDPA itself). Nothing of it is
saved: weights and configs are those of the model.

>>> import torch
>>> from densepass.models.dropout import CpuDropout
>>> torch.manual_seed(0)  # doctest: +ELLIPSIS
<torch._C.Generator object at ...>
>>> out = CpuDropout(0.1)(torch.ones(100_000))
>>> round(float((out == 0).float().mean()), 2), round(float(out.max()), 4)
(0.1, 1.1111)
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from densepass.models import cpu_kernels

BITS = 16  # each element's draw: a 16-bit integer
ATTENTION = "densepass-cpu-dropout"  # the attention implementation ``cpu_dropout`` switches SDPA models to
_GOLDEN, _MIX1, _MIX2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_CHUNK = 1 << 15  # words NumPy draws at a time (its temporaries stay in cache)


def draws(seed: int, count: int, first: int = 0) -> np.ndarray:
    """The 16-bit draws (uint16) of elements ``first`` .. ``first + count - 1`` of a call seeded by ``seed``
    (module docstring): SplitMix64 over word counters, each word cut into four draws, in NumPy's wrapping uint64
    arithmetic, a chunk at a time."""
    start, stop = first // 4, (first + count + 3) // 4
    words = np.empty(stop - start, dtype=np.uint64)
    steps = np.arange(1, _CHUNK + 1, dtype=np.uint64) * _GOLDEN
    shifted = np.empty(_CHUNK, dtype=np.uint64)
    for at in range(0, len(words), _CHUNK):
        z, t = words[at : at + _CHUNK], shifted[: min(_CHUNK, len(words) - at)]
        np.add(steps[: len(z)], np.uint64((seed + (start + at) * int(_GOLDEN)) % 2**64), out=z)
        for shift, multiplier in ((30, _MIX1), (27, _MIX2)):
            np.right_shift(z, np.uint64(shift), out=t)
            z ^= t
            z *= multiplier
        np.right_shift(z, np.uint64(31), out=t)
        z ^= t
    return words.view(np.uint16)[first % 4 : first % 4 + count]


def keep_threshold(p: float) -> tuple[int, float]:
    """Dropout with probability ``p``: the threshold a draw must be below to keep its element, and the scale of
    kept elements (the inverse of the keep probability; 0 where nothing is kept)."""
    threshold = round((1.0 - p) * (1 << BITS))
    return threshold, (1 << BITS) / threshold if threshold else 0.0


def _seed() -> int:
    """One draw from PyTorch's CPU generator: the seed of one dropout call."""
    return int(torch.randint(0, 2**62, (1,)))


def keep_mask(seed: int, shape: torch.Size, threshold: int) -> torch.Tensor:
    """The boolean keep-mask of a call seeded by ``seed`` over a tensor of ``shape``: its elements whose draws
    (``draws``) are below ``threshold``."""
    return torch.from_numpy(draws(seed, shape.numel()) < threshold).view(shape)


def dropout_mask(shape: torch.Size, p: float) -> tuple[torch.Tensor, float]:
    """A boolean keep-mask of ``shape`` (each element kept with probability 1 - ``p``, to 2^-16) and the scale of
    the kept elements, from a new seed: what ``cpu_dropout`` applies."""
    threshold, scale = keep_threshold(p)
    return keep_mask(_seed(), shape, threshold), scale


def _dropped(x: torch.Tensor, seed: int, threshold: int, scale: float) -> torch.Tensor:
    """``x`` times ``scale`` where the draws under ``seed`` keep an element, else 0: in the kernels where they run,
    else with NumPy's draws (the same mask). A select, not a product, on the NumPy path: multiplying by a boolean
    tensor first converts the whole mask to ``x``'s dtype."""
    if x.dtype in (torch.float32, torch.bfloat16) and cpu_kernels.trains():
        return cpu_kernels.dropout(x, seed, threshold, scale)
    return torch.where(keep_mask(seed, x.shape, threshold), x, 0).mul_(scale)


class _MaskedScale(torch.autograd.Function):
    """x * keep * scale, with the same mask drawn again on the way back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float) -> torch.Tensor:
        ctx.seed, (ctx.threshold, ctx.scale) = _seed(), keep_threshold(p)
        return _dropped(x, ctx.seed, ctx.threshold, ctx.scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _dropped(grad, ctx.seed, ctx.threshold, ctx.scale), None


class _SoftmaxDropout(torch.autograd.Function):
    """dropout(softmax(scale x scores + mask)) of bf16 or float32 attention scores, forward and backward each in one
    kernel (``cpu_kernels.softmax_dropout``): the probabilities are kept (in the scores' dtype) for the backward
    pass, the mask drawn again."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, mask: torch.Tensor | None, scale: float, p: float) -> torch.Tensor:
        ctx.seed, (ctx.threshold, ctx.keep_scale), ctx.scale = _seed(), keep_threshold(p), scale
        out, probs = cpu_kernels.softmax_dropout(scores, mask, scale, ctx.seed, ctx.threshold, ctx.keep_scale)
        ctx.save_for_backward(probs)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        (probs,) = ctx.saved_tensors
        grad_scores = cpu_kernels.softmax_dropout_backward(grad, probs, ctx.scale, ctx.seed, ctx.threshold,
                                                           ctx.keep_scale)  # fmt: skip
        return grad_scores, None, None, None


def cpu_dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """Dropout of ``x`` with probability ``p`` (module docstring); ``x`` itself when not training, with ``p`` 0, or
    off the CPU (where ``torch.nn.functional.dropout`` is fast)."""
    if not training or p == 0.0 or x.device.type != "cpu":
        return torch.nn.functional.dropout(x, p, training)
    return _MaskedScale.apply(x, p)


class CpuDropout(torch.nn.Dropout):
    """``torch.nn.Dropout`` whose masks come from ``draws`` on the CPU."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` dropped out: by ``cpu_dropout`` on the CPU, by ``torch.nn.Dropout`` elsewhere or in place."""
        if self.inplace or x.device.type != "cpu":
            return super().forward(x)
        return cpu_dropout(x, self.p, self.training)


def _attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """SDPA attention ([batch, heads, length, dim] in, [batch, length, heads, dim] out), with ``cpu_dropout`` on
    the attention probabilities of a non-causal attention on the CPU; anything else goes to SDPA itself."""
    plain = getattr(module, "is_causal", False) or getattr(module, "num_key_value_groups", 1) > 1
    if dropout == 0.0 or query.device.type != "cpu" or plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query, key.transpose(-1, -2))
    fused = attention_mask is None or attention_mask.dtype == torch.bool
    if fused and scores.dtype in (torch.bfloat16, torch.float32) and scores.dim() == 4 and cpu_kernels.trains():
        probs = _SoftmaxDropout.apply(scores, attention_mask, scale, dropout)
        return torch.matmul(probs, value.to(probs.dtype)).transpose(1, 2).contiguous(), None
    scores = scores * scale
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attention_mask, torch.finfo(scores.dtype).min)
        else:
            scores = scores + attention_mask
    probs = cpu_dropout(torch.softmax(scores, dim=-1).to(value.dtype), dropout)  # under autocast: bf16 masks
    return torch.matmul(probs, value).transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, _attention)
AttentionMaskInterface.register(ATTENTION, sdpa_mask)


def use_cpu_dropout(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """On the CPU, make ``model`` drop out with ``dropout_mask``'s masks (module docstring), in place: its
    ``nn.Dropout`` modules become ``CpuDropout`` and its SDPA transformers attend with ``ATTENTION``. Both act as
    before off the CPU and when not training, and neither changes what is saved, so the switch is never undone.
    Elsewhere (``device`` a GPU) nothing changes. Returns ``model``."""
    if device.type != "cpu":
        return model
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Dropout:
                setattr(parent, name, CpuDropout(child.p, child.inplace).train(child.training))
    for module in model.modules():
        if isinstance(module, PreTrainedModel) and module.config._attn_implementation == "sdpa":
            module.set_attn_implementation(ATTENTION)
    return model
