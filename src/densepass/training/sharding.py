"""Fully sharded data parallel training (FSDP2: ``torch.distributed.fsdp.fully_shard``) for the training engine.

With ``fsdp: true`` under torchrun each process holds 1/N of every weight, of its gradient and of AdamW's two
moments instead of a whole copy (float32 AdamW keeps 16 bytes a weight: weight, gradient and two moments), for models
whose training state does not fit one device. The step does not change: every process embeds its share of the global
batch and contrasts the gathered batch (``training.distributed``); FSDP all-gathers a block's weights just before its
forward and backward and frees them after, and reduce-scatters the gradients *summed* (every process's loss is
already the global batch's, as the engine's all-reduce sums them without FSDP), so an update equals one process's on
the whole batch up to float rounding.

Units: the blocks of every Hugging Face model in the task's network (its ``_no_split_modules``: the embeddings and each
transformer layer, the blocks accelerate's FSDP wrapping uses), each such model, then the whole network; weights
outside them (a loss head of the objective) stay whole on every process and their gradients are all-reduced.

Checkpoints: every process writes its shards of the weights and of AdamW's state with torch.distributed.checkpoint
(DCP) into the checkpoint's ``sharded/``, in safetensors files whose shard offsets are JSON in the files' headers
(``HuggingFaceStorageWriter`` / ``Reader``: nothing is unpickled on resume); rank 0 writes the rest as for any run
(schedule, random states, the optimiser's hyperparameters, the task's state). At the end the full weights are gathered
on every process and the network is made a plain module again (``unshard``), so the trained model is saved, loaded,
copied and run as after any run.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from densepass import distributed
from densepass.errors import ConfigError

SHARDS = "sharded"  # a checkpoint's folder of DCP shards


def _dtensor():
    from torch.distributed.tensor import DTensor

    return DTensor


def _units(network: nn.Module) -> list[nn.Module]:
    """The modules ``shard`` wraps, each after every unit inside it: blocks, Hugging Face models, the network."""
    from transformers import PreTrainedModel

    models = [m for m in network.modules() if isinstance(m, PreTrainedModel)]
    blocks: list[nn.Module] = []
    for model in models:
        names = set(getattr(model, "_no_split_modules", None) or ())
        blocks += [m for m in model.modules() if type(m).__name__ in names and m is not model]
    if not blocks:
        raise ConfigError("fsdp: the model holds no Hugging Face transformer blocks to shard")
    units: dict[int, nn.Module] = {}
    for unit in (*blocks, *reversed(models), network):  # models in reverse order: an inner model before its wrapper
        units.setdefault(id(unit), unit)
    return list(units.values())


def shard(network: nn.Module, device: torch.device) -> None:
    """Shard ``network`` over the processes of torch.distributed (module docstring), gradients reduced by sum."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (distributed.world_size(),))
    units = _units(network)
    for unit in units:
        fully_shard(unit, mesh=mesh)
    for unit in units:
        unit.set_gradient_divide_factor(1.0)  # a sum: each process's loss is the global batch's
        unit.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no pre-multiplied sum)


def is_sharded(network: nn.Module) -> bool:
    """Whether ``shard`` sharded ``network`` (and ``unshard`` has not undone it)."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in network.modules())


def whole_parameters(parameters: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters FSDP does not hold (their gradients are all-reduced by the engine)."""
    dtensor = _dtensor()
    return [p for p in parameters if not isinstance(p, dtensor)]


def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over sharded and whole parameters together: the squares of every process's
    shards are summed over processes, those of whole gradients (the same on every process) added once; every
    gradient is scaled by min(1, max_norm / (norm + 1e-6)), as torch does. Returns the total norm (the same on every
    process)."""
    dtensor = _dtensor()
    grads = [p.grad for p in parameters if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    squares = torch.zeros((), dtype=torch.float32, device=distributed.collective_device())
    for grad in grads:
        if isinstance(grad, dtensor):
            squares += torch.linalg.vector_norm(grad.to_local().float()).square().to(squares.device)
    if distributed.is_distributed():
        dist.all_reduce(squares)
    squares = squares.to(device)
    for grad in grads:
        if not isinstance(grad, dtensor):
            squares = squares + torch.linalg.vector_norm(grad.float()).square()
    norm = squares.sqrt()
    coefficient = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for grad in grads:
        (grad.to_local() if isinstance(grad, dtensor) else grad).mul_(coefficient.to(grad.dtype))
    return norm


def full_weights(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``named`` with sharded weights gathered whole, one at a time (collective: every process, in the same order)."""
    dtensor = _dtensor()
    for name, weight in named:
        yield name, weight.full_tensor() if isinstance(weight, dtensor) else weight


def _writer(directory: Path):
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    return HuggingFaceStorageWriter(str(directory / SHARDS), save_distributed=True)


def _aliases(network: nn.Module) -> set[str]:
    """The names under which a weight already named is reached again (a bi-encoder's shared tower is both its query
    and its passage encoder): left out of the shards, whose files hold each tensor once. The same on every process."""
    seen: set[int] = set()
    aliases = set()
    named = (*network.named_parameters(remove_duplicate=False), *network.named_buffers(remove_duplicate=False))
    for name, tensor in named:
        if id(tensor) in seen:
            aliases.add(name)
        seen.add(id(tensor))
    return aliases


def _model_state(network: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(weights without their aliases, optimiser state) of this process's shards."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    weights, optim = get_state_dict(network, optimizer)
    aliases = _aliases(network)
    return {k: v for k, v in weights.items() if k not in aliases}, optim


def save(network: nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> dict:
    """Write this process's shards of the weights and of the optimiser's state into ``directory / SHARDS``
    (collective); returns the optimiser's hyperparameters (JSON, for rank 0's state file)."""
    import torch.distributed.checkpoint as dcp

    weights, optim = _model_state(network, optimizer)
    dcp.save({"model": weights, "optimizer": optim["state"]}, storage_writer=_writer(directory))
    return {"param_groups": optim["param_groups"]}


def load(network: nn.Module, optimizer: torch.optim.Optimizer, directory: Path, saved: dict) -> None:
    """Read back what ``save`` wrote in ``directory`` into the sharded ``network`` and ``optimizer`` (collective);
    ``saved``: the hyperparameters ``save`` returned."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    reader = HuggingFaceStorageReader(str(directory / SHARDS))
    saved_keys = set(reader.read_metadata().state_dict_metadata)
    weights, optim = _model_state(network, optimizer)  # this process's shards, the optimiser's state initialised
    # a weight that had no gradient yet has no AdamW state in the checkpoint: it gets none here either
    moments = {
        name: state
        for name, state in optim["state"].items()
        if all(f"optimizer.{name}.{key}" in saved_keys for key in state)
    }
    target = {"model": weights, "optimizer": moments}
    dcp.load(target, storage_reader=reader)
    state = {"state": target["optimizer"], "param_groups": saved["param_groups"]}
    options = StateDictOptions(strict=False)  # the aliases are left out: loading the weight loads them
    set_state_dict(network, optimizer, model_state_dict=target["model"], optim_state_dict=state, options=options)


def unshard(network: nn.Module) -> None:
    """Gather every sharded weight whole on every process (collective) and make ``network`` a plain module again:
    its FSDP hooks removed and each module's class restored, so that it is saved, copied and run in one process as
    any model. torch has no public inverse of ``fully_shard``; the hooks removed are those ``fully_shard`` registers
    (tests/test_engine.py checks the result on the torch densepass requires)."""
    from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY
    from torch.distributed.fsdp import FSDPModule

    dtensor = _dtensor()
    units = [m for m in network.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.reshard()
    whole: dict[int, nn.Parameter] = {}
    for module in network.modules():
        for name, param in list(module._parameters.items()):
            if isinstance(param, dtensor):
                if id(param) not in whole:
                    full = param.full_tensor().detach().clone()
                    whole[id(param)] = nn.Parameter(full, requires_grad=param.requires_grad)
                module._parameters[name] = whole[id(param)]
    for unit in units:
        state = unit._get_fsdp_state()
        state._pre_forward_hook_handle.remove()
        state._post_forward_hook_handle.remove()
        for group in state._fsdp_param_groups:
            handles = [
                *group._module_to_pre_save_state_dict_hook_handle.values(),
                *group._module_to_pre_load_state_dict_hook_handle.values(),
                *(p._post_load_hook_handle for p in group.fsdp_params),
            ]
            for handle in handles:
                handle.remove()
        unit.__class__ = type(unit).__bases__[1]  # fully_shard made it (FSDPModule, its class)
        for key in (STATE_KEY, REGISTRY_KEY):
            unit.__dict__.pop(key, None)
    for module in network.modules():
        for key in ("_is_fsdp_managed_module", "_fsdp_use_orig_params"):
            module.__dict__.pop(key, None)
