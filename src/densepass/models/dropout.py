"""Dropout on the CPU with masks drawn by NumPy's PCG64 generator instead of PyTorch's own.

Why: PyTorch's CPU Bernoulli kernel draws with MKL's vectorised generator on Intel CPUs only; elsewhere (AMD, ARM)
it draws one element at a time under a lock, and the dropout masks of a training step (every hidden state, and
every attention probability: heads x L x L per text) become a large share of a bf16 step there
(``benchmarks/bench_train.py --profile`` shows it; docs/history/benchmarks-log.md has the profile). NumPy's PCG64
draws 16-bit integers several times faster. The masks follow the same distribution up to 2^-16: each element is kept
when its 16-bit draw is below round((1 - p) 2^16), and kept elements are scaled by the inverse of that probability, so
every output keeps its expectation; only the random stream differs from ``torch.nn.Dropout``'s.

Each mask's generator is seeded by one draw from PyTorch's CPU generator, so the masks follow ``torch.manual_seed``,
are saved and restored with its state in checkpoints (bit-exact resume), and repeat under ``device.RandomState``
(gradient caching replays a forward pass).

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

BITS = 16  # each element's draw: a 16-bit integer
ATTENTION = "densepass-cpu-dropout"  # the attention implementation ``cpu_dropout`` switches SDPA models to


def dropout_mask(shape: torch.Size, p: float) -> tuple[torch.Tensor, float]:
    """A boolean keep-mask of ``shape`` (each element kept with probability 1 - ``p``, to 2^-16) and the scale of
    the kept elements (the inverse of that probability), from a PCG64 generator seeded by PyTorch's CPU generator."""
    threshold = round((1.0 - p) * (1 << BITS))
    seed = int(torch.randint(0, 2**62, (1,)))
    n = shape.numel()
    # the generator's raw 64-bit outputs cut into four 16-bit draws each: half the time of ``integers``
    draws = np.random.PCG64(seed).random_raw(-(-n // 4)).view(np.uint16)[:n]
    keep = torch.from_numpy(draws < threshold).view(shape)
    return keep, (1 << BITS) / threshold if threshold else 0.0


class _MaskedScale(torch.autograd.Function):
    """x * keep * scale, with the same mask on the way back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, p: float) -> torch.Tensor:
        keep, scale = dropout_mask(x.shape, p)
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return _apply(x, keep, scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (keep,) = ctx.saved_tensors
        return _apply(grad, keep, ctx.scale), None


def _apply(x: torch.Tensor, keep: torch.Tensor, scale: float) -> torch.Tensor:
    """``x * keep * scale`` by a select, not a product: multiplying by a boolean tensor first converts the whole
    mask to ``x``'s dtype."""
    return torch.where(keep, x, 0).mul_(scale)


def cpu_dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """Dropout of ``x`` with probability ``p`` (module docstring); ``x`` itself when not training, with ``p`` 0, or
    off the CPU (where ``torch.nn.functional.dropout`` is fast)."""
    if not training or p == 0.0 or x.device.type != "cpu":
        return torch.nn.functional.dropout(x, p, training)
    return _MaskedScale.apply(x, p)


class CpuDropout(torch.nn.Dropout):
    """``torch.nn.Dropout`` whose masks come from ``dropout_mask`` on the CPU."""

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
    scores = torch.matmul(query, key.transpose(-1, -2)) * (query.shape[-1] ** -0.5 if scaling is None else scaling)
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
