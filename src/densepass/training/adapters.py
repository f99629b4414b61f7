"""LoRA adapters for any training task (``peft``): train low-rank updates of a transformer's linear layers instead
of its weights, then merge them in.

LoRA (Hu et al. 2021) adds to a frozen weight ``W`` a trainable product ``(alpha / r) B A`` of rank ``r``; a few
hundred thousand parameters train instead of the model's millions, which is what makes 0.5B+ embedders trainable
on one machine. ``Adapters`` injects them (``peft.inject_adapter_in_model``) into the backbone of every Hugging Face
transformer the task trains (``base_model``: the encoder of a ``...ForSequenceClassification``, whose head stays
fully trained, as every head outside a transformer does), with peft's default target layers for the architecture
unless ``lora_targets`` names them. The backbone's own weights are frozen.

Callbacks (validation, re-mining, a best model saved) run on the merged model (``merged``), whose layers are plain
again (so the fused inference kernels apply), with the frozen weights restored exactly after them.
Checkpoints keep the model as it was before LoRA (the frozen weights, written by the task as usual: ``plain()``
swaps each adapted layer back to its base layer while it is written or read) and the adapters' tensors beside it
(``state_dict``), so a run resumes exactly. When training ends, ``merge`` folds each update into its weight and
removes the adapters: the trained model is a plain model of its architecture, loadable anywhere.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from densepass.config import OptimConfig
from densepass.errors import ConfigError
from densepass.models.freeze import backbones


def _inject(backbone: nn.Module, optim: OptimConfig) -> None:
    """peft's LoRA layers in ``backbone`` (its default targets for the architecture unless ``lora_targets``)."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(
        r=optim.lora_rank,
        lora_alpha=optim.lora_alpha,
        lora_dropout=optim.lora_dropout,
        target_modules=list(optim.lora_targets) if optim.lora_targets else None,
    )
    try:
        inject_adapter_in_model(config, backbone)
    except ValueError as err:  # no layer matches lora_targets, or no default for the architecture
        first = (str(err).strip().splitlines() or ["no target layer"])[0]
        raise ConfigError(f"lora_targets: {first}") from None


def check_adapters(network: nn.Module, optim: OptimConfig) -> None:
    """``Adapters``' one-line errors (no transformer, ``lora_targets`` matching no layer, an architecture peft has
    no default targets for) without touching ``network``: the adapters go into a copy of each backbone built on
    the meta device (no memory, no weights), so a run refuses them before mining rather than when training starts."""
    found = backbones(network)
    if not found:
        raise ConfigError("lora_rank: the model holds no transformer to put adapters in")
    for backbone in found:
        with torch.device("meta"):
            skeleton = type(backbone)(backbone.config)
        _inject(skeleton, optim)


def check_adapters_of(folder: str, optim: OptimConfig) -> None:
    """``check_adapters`` for the transformer saved in ``folder`` (its config alone is read)."""
    from transformers import AutoConfig, AutoModel

    try:
        with torch.device("meta"):
            skeleton = AutoModel.from_config(AutoConfig.from_pretrained(folder))
    except ValueError:  # a model_type without a plain AutoModel: left to the adapters when training starts
        return
    _inject(skeleton, optim)


class Adapters:
    """LoRA adapters in ``network`` with ``optim``'s rank, alpha, dropout and target layers (see the module)."""

    def __init__(self, network: nn.Module, optim: OptimConfig) -> None:
        from peft.tuners.lora import LoraLayer

        found = backbones(network)
        self.requires_grad = [(p, p.requires_grad) for p in network.parameters()]  # restored by merge
        if not found:
            raise ConfigError("lora_rank: the model holds no transformer to put adapters in")
        # peft records its config on each backbone it adapts: taken off again with the adapters
        self.configured = [b for b in found if not hasattr(b, "peft_config")]
        for backbone in found:
            # the layers frozen before (train.freeze_layers): their adapters stay frozen too, or they would change
            frozen = {name.rsplit(".", 1)[0] for name, p in backbone.named_parameters() if not p.requires_grad}
            _inject(backbone, optim)
            for name, parameter in backbone.named_parameters():
                parameter.requires_grad_("lora_" in name and name.split(".lora_")[0] not in frozen)
        self.network = network
        # (parent module, attribute, adapted layer) of every layer that got an adapter
        self.layers = [
            (parent, child_name, child)
            for parent in network.modules()
            for child_name, child in parent.named_children()
            if isinstance(child, LoraLayer)
        ]
        self._refuse_tied_targets()

    def _refuse_tied_targets(self) -> None:
        """A one-line ConfigError (the adapters taken out again) for a target layer whose weight another module
        shares (SPLADE's MLM decoder is tied to the word embeddings): the adapter would change the layer alone
        while training, and merging it would change the other module too, so the saved model would not be the
        trained one."""
        owners: dict[int, list[str]] = {}  # a weight's modules (a tower shared by both sides is one module)
        for module_name, module in self.network.named_modules():
            for parameter in module.parameters(recurse=False):
                owners.setdefault(id(parameter), []).append(module_name)
        for _, child_name, layer in self.layers:
            shared = owners.get(id(getattr(layer.base_layer, "weight", None)), [])
            if len(shared) > 1:
                self.remove()
                raise ConfigError(
                    f"lora_targets: {child_name}'s weight is tied to another module's ({', '.join(shared)}); an"
                    " adapter on it would be merged into both: leave it out of lora_targets"
                )

    def trainable_count(self) -> int:
        """Adapter parameters (what trains inside the backbones)."""
        return sum(p.numel() for _, _, layer in self.layers for n, p in layer.named_parameters() if "lora_" in n)

    @contextlib.contextmanager
    def plain(self) -> Iterator[None]:
        """The network as it was before LoRA for the block (each adapted layer swapped for its base layer)."""
        for parent, name, layer in self.layers:
            setattr(parent, name, layer.base_layer)
        try:
            yield
        finally:
            for parent, name, layer in self.layers:
                setattr(parent, name, layer)

    @contextlib.contextmanager
    def merged(self) -> Iterator[None]:
        """The network with every adapter folded into its weight, as plain layers, for the block (what callbacks
        that encode, validate or save a model see); the frozen weights are restored exactly afterwards."""
        kept = [layer.base_layer.weight.detach().clone() for _, _, layer in self.layers]
        with torch.no_grad():
            for parent, name, layer in self.layers:
                layer.merge()
                setattr(parent, name, layer.base_layer)
        try:
            yield
        finally:
            with torch.no_grad():
                for (parent, name, layer), weight in zip(self.layers, kept):
                    layer.base_layer.weight.copy_(weight)  # exact: never W + BA - BA
                    layer.merged_adapters.clear()
                    setattr(parent, name, layer)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The adapters' tensors, by parameter name."""
        return {n: p.detach().clone() for n, p in self.network.named_parameters() if "lora_" in n}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore ``state_dict()`` output."""
        parameters = {n: p for n, p in self.network.named_parameters() if "lora_" in n}
        if parameters.keys() != state.keys():
            raise ConfigError("the checkpoint's LoRA adapters do not match this run's (other layers or rank)")
        with torch.no_grad():
            for name, value in state.items():
                parameters[name].copy_(value)

    def remove(self) -> None:
        """Take the adapters out unmerged (training stopped before it ended): each adapted layer is its base layer
        again, with its weight as before, and every weight trains (or not) as before."""
        for parent, name, layer in self.layers:
            setattr(parent, name, layer.base_layer)
        self._finish()

    def _finish(self) -> None:
        """The network without adapters from here on: peft's config off its backbones, every weight trainable or
        not as before."""
        self.layers = []
        for backbone in self.configured:
            vars(backbone).pop("peft_config", None)
        for parameter, requires_grad in self.requires_grad:
            parameter.requires_grad_(requires_grad)

    def merge(self) -> None:
        """Fold every adapter into its weight and remove the adapters; every weight trains (or not) as before."""
        with torch.no_grad():
            for parent, name, layer in self.layers:
                layer.merge()
                setattr(parent, name, layer.base_layer)
        self._finish()
