"""Dynamic int8 quantisation of a transformer's linear layers, for CPU inference: the ``int8`` precision of
cross-encoder scoring (``models.cross_encoder``), and of bi-encoder encoding (``models.encode``) for the towers and
CPUs that ``models.fused``'s int8 layers do not run.

``torch.ao.quantization.quantize_dynamic`` replaces each chosen ``nn.Linear`` by an int8 one: weights
quantised once with a scale per output channel, activations quantised on the fly with one scale per batch.
The feed-forward output projections (``layer.N.output.dense``) stay float32: their inputs are GELU activations with
outliers that one scale per batch resolves poorly, and quantising them moves embeddings further from fp32's
(measured in docs/history/benchmarks-log.md, "Encoding precision"). A quantised copy is worth making once and
reusing: ``weights_key`` tells when the weights it was made from have changed.
"""

from __future__ import annotations

import copy
import hashlib
import warnings
from collections.abc import Callable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook


def feed_forward_output(name: str) -> bool:
    """Whether a BERT-style linear layer is a feed-forward block's output projection (``layer.N.output.dense``)."""
    return name.endswith("output.dense") and not name.endswith("attention.output.dense")


KEY_SAMPLE = 64  # values per tensor in ``weights_key``'s sample
_steps_taken = [0]  # optimiser steps taken in this process, by any optimiser (``weights_key``)


def _count_step(*_) -> None:
    _steps_taken[0] += 1


register_optimizer_step_post_hook(_count_step)


def weights_key(module: torch.nn.Module) -> tuple:
    """What identifies ``module``'s current weights (parameters and buffers): where any parameter trains, the
    optimiser steps this process has taken (fused kernels, fused AdamW, the trainers'
    optimiser and Hugging Face's default, update in place without a version bump, and may change only a few
    rows, e.g. a word-embedding table's); each tensor's storage and version counter (an in-place change or
    ``load_state_dict`` makes a new key); and a strided sample of about ``KEY_SAMPLE`` of its values. A hand
    edit of a few values through ``.data`` that none of these see is not followed: make a new model, or load
    the weights."""
    params = list(module.parameters())
    tensors = [*params, *module.buffers()]
    sample = torch.cat([t.detach().reshape(-1)[:: max(1, t.numel() // KEY_SAMPLE)].float() for t in tensors])
    digest = hashlib.blake2b(sample.cpu().numpy().tobytes(), digest_size=16).hexdigest()
    steps = _steps_taken[0] if any(p.requires_grad for p in params) else None
    return (steps, *((t.data_ptr(), t._version) for t in tensors), digest)


def quantized_linear_copy(
    module: torch.nn.Module, keep_float: Callable[[str], bool] = feed_forward_output
) -> torch.nn.Module:
    """A copy of ``module`` for CPU inference (eval mode, no gradients) whose linear layers are dynamically
    quantised to int8 with per-channel weights, all but those whose names ``keep_float`` picks (by default the
    feed-forward output projections); ``module`` itself is left untouched."""
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    spec = {
        name: per_channel_dynamic_qconfig
        for name, layer in module.named_modules()
        if isinstance(layer, torch.nn.Linear) and not keep_float(name)
    }
    with warnings.catch_warnings():  # torch.ao.quantization announces its move to torchao
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*quantize_per_(tensor|channel).*")
        return quantize_dynamic(copy.deepcopy(module).eval(), spec, dtype=torch.qint8).requires_grad_(False)
