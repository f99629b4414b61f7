"""Weight-space ensembling of a fine-tuned model with the weights it started from (wise-ft).

    θ(α) = (1 − α) · θ_start + α · θ_fine-tuned

α = 1 is the fine-tuned model, α = 0 the starting one. wise-ft finds that an intermediate α keeps most of
the fine-tuning gain in domain while recovering much of the starting model's robustness out of domain;
for a retriever fine-tuned on one collection, "out of domain" is every other collection. Only floating
parameters and buffers are mixed; integer buffers (BERT's position ids) are taken from the fine-tuned model.

Usage (a fine-tuned run's model with its starting weights)::

    start = BiEncoder.from_pretrained("all-MiniLM-L6-v2")
    model = BiEncoder.from_pretrained("outputs/main/model")
    interpolate_weights(model, snapshot(start), alpha=0.5).save("outputs/main/model-wise-ft-0.5")
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from densepass.errors import ConfigError


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of ``model``'s weights (the θ_start of a later interpolation)."""
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


def interpolate_weights(model: nn.Module, start: Mapping[str, torch.Tensor], alpha: float) -> nn.Module:
    """Replace ``model``'s weights by ``(1 - alpha) * start + alpha * model`` in place and return it.

    ``start`` must hold the same parameter names and shapes (a one-line error otherwise, before anything
    changes)."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0.0 <= alpha <= 1.0:
        raise ConfigError(f"the interpolation weight alpha must be a number in [0, 1], got {alpha!r}")
    tuned = model.state_dict()
    missing, extra = sorted(tuned.keys() - start.keys()), sorted(start.keys() - tuned.keys())
    if missing or extra:
        raise ConfigError(
            f"cannot interpolate: the starting weights lack {missing[:3]} and have {extra[:3]} that the model "
            "does not (a different architecture?)"
        )
    for name, tensor in tuned.items():
        if start[name].shape != tensor.shape:
            raise ConfigError(
                f"cannot interpolate {name}: shape {tuple(start[name].shape)} in the starting weights, "
                f"{tuple(tensor.shape)} in the model"
            )
    done: set[int] = set()  # a module registered twice (one encoder for both towers) is mixed once
    with torch.no_grad():
        for name, tensor in tuned.items():
            if tensor.is_floating_point() and tensor.data_ptr() not in done:
                done.add(tensor.data_ptr())
                mixed = torch.lerp(start[name].to(tensor.device, torch.float32), tensor.float(), float(alpha))
                tensor.copy_(mixed.to(tensor.dtype))
    return model
