"""L2-SP: a penalty toward the starting weights, a forgetting guard (l2-sp).

The objective gains α/2 · ‖w − w₀‖² over the anchored weights w, where w₀ are their values when training
started; its gradient α (w − w₀) is added to theirs after each step's backward pass, before clipping, so the
optimiser sees the regularised objective (Li et al. replace plain L2 decay toward 0, which forgets, by decay
toward the starting point). What is anchored (``l2sp_scope``): ``encoder``, the weights of the backbones of the
Hugging Face transformers the task trains, its heads (a projection, a cross-encoder's classifier, a loss's own
head), often new, left to plain weight decay, as the paper treats the new classifier; or ``all`` of the task
network's trainable weights.

w₀ is a float32 copy: the weights train in float32 (autocast only computes in bf16), so the penalty and its
gradient are exactly zero at step 0 and pull toward the weights as they were, not toward a bf16 rounding of
them (up to 2⁻⁹ relative: with a large α that rounding alone would move every weight). It costs one more
copy of the anchored weights in memory and in every checkpoint, which stores it so that a resumed run pulls
toward the same w₀, bit for bit, whatever the starting model's files became.
"""

from __future__ import annotations

import torch

from densepass.errors import ConfigError

STATE_KEY = "l2sp_anchor"


def anchored_parameters(network: torch.nn.Module, scope: str) -> dict[str, torch.nn.Parameter]:
    """The trainable parameters of ``network`` that L2-SP anchors, by name: those of its Hugging Face transformers'
    backbones (``scope='encoder'``: not a projection, nor a task head such as a cross-encoder's classifier, which
    may be new) or all of them (``'all'``); a tied weight once."""
    from transformers import PreTrainedModel

    if scope == "all":
        named = dict(network.named_parameters())
    else:
        inside: set[int] = set()
        for module in network.modules():
            if isinstance(module, PreTrainedModel):  # its backbone: a task head on top of it is left out
                inside.update(id(p) for p in module.base_model.parameters())
        named = {name: p for name, p in network.named_parameters() if id(p) in inside}
    return {name: p for name, p in named.items() if p.requires_grad}


def check_l2sp(optim, section: str = "train") -> None:
    """One-line errors of ``l2sp`` that need no work: not with LoRA (whose frozen weights are w₀ already and
    whose adapters start from no pretrained value) nor FSDP (whose sharded weights the penalty does not read)."""
    if not getattr(optim, "l2sp", None):
        return
    if optim.lora_rank:
        raise ConfigError(
            f"{section}.l2sp does not combine with lora_rank: LoRA keeps the weights at their start and trains "
            "adapters that have no starting value to be pulled toward"
        )
    if optim.fsdp:
        raise ConfigError(f"{section}.l2sp does not combine with fsdp yet (the penalty reads whole weights)")


class L2SP:
    """The penalty of one run: ``alpha`` and the anchored parameters with their starting values."""

    def __init__(self, alpha: float, parameters: dict[str, torch.nn.Parameter]) -> None:
        if not parameters:
            raise ConfigError("l2sp: the model has no trainable weights inside a transformer to anchor")
        self.alpha, self.names = alpha, list(parameters)
        self.parameters = [parameters[n] for n in self.names]
        self.anchor = [p.detach().float().clone() for p in self.parameters]

    def penalty(self) -> torch.Tensor:
        """α/2 · ‖w − w₀‖² (float32, on the weights' device; read without waiting for it)."""
        with torch.no_grad():
            diffs = torch._foreach_sub([p.float() for p in self.parameters], self.anchor)
            return self._value(diffs)

    def add_gradient(self, apply: bool = True) -> torch.Tensor:
        """Add α (w − w₀) to each anchored weight's gradient (only where ``apply``: under torch.distributed, the
        gradients are summed over the processes, so one process adds it) and return the penalty."""
        with torch.no_grad():
            diffs = torch._foreach_sub([p.float() for p in self.parameters], self.anchor)
            if apply:
                for p, d in zip(self.parameters, diffs):
                    if p.grad is None:
                        p.grad = (self.alpha * d).to(p.dtype)
                    else:
                        p.grad.add_(d.to(p.grad.dtype), alpha=self.alpha)
            return self._value(diffs)

    def _value(self, diffs: list[torch.Tensor]) -> torch.Tensor:
        """α/2 · Σ‖w − w₀‖², each sum of squares accumulated in float64 (a float32 sum over a
        million-weight embedding matrix loses precision), returned as float32."""
        norms = torch._foreach_norm(diffs, dtype=torch.float64)
        return (0.5 * self.alpha * torch.stack(norms).square().sum()).float()

    def state_dict(self) -> dict:
        """w₀ by parameter name (a checkpoint's extra)."""
        return {STATE_KEY: dict(zip(self.names, self.anchor))}

    def load_state_dict(self, extra: dict) -> None:
        """w₀ as a checkpoint stored it; a checkpoint without it, or of other weights, is a one-line error."""
        stored = extra.get(STATE_KEY)
        if stored is None or sorted(stored) != sorted(self.names):
            raise ConfigError(
                "l2sp: the checkpoint holds no starting weights for these parameters (written by another version "
                "or setting): run with --restart"
            )
        device = self.anchor[0].device
        self.anchor = [stored[n].to(device=device, dtype=torch.float32) for n in self.names]
