"""How the bundled trainer spreads its model over ranks: ``run.parallel: ddp | fsdp2``.

- ``ddp``: every rank holds the whole model; DistributedDataParallel averages the gradients.
- ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on every transformer block and on the root: each rank
  holds a shard of every parameter and of the optimizer state (DTensors); gloo on CPU, NCCL on GPU.

Checkpoints go through `train_state` / `load_train_state`, torch's distributed state-dict API: keys are
parameter names (not the optimizer's integer ids) and tensors are DTensors under FSDP2, so
torch.distributed.checkpoint writes each rank's shard and reshards on load into any world size.
"""

from __future__ import annotations

from typing import Any

import torch

DDP, FSDP2 = "ddp", "fsdp2"
MODES = (DDP, FSDP2)


def wrap(model: torch.nn.Module, mode: str, world_size: int, device: torch.device) -> torch.nn.Module:
    """The module the training step calls. FSDP2 shards `model` in place (its parameters become DTensors)
    and returns it; DDP returns a wrapper; one rank returns `model` itself."""
    if world_size == 1 and mode == DDP:
        return model
    if mode == FSDP2:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device.type, (world_size,))
        for block in _blocks(model):
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated layers to shard one by one (GPT: transformer.h); none for a model without them."""
    blocks = getattr(getattr(model, "transformer", None), "h", None)
    return list(blocks) if blocks is not None else []


def train_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``{"model": ..., "optim": ...}`` keyed by parameter name, DTensors under FSDP2: what a checkpoint
    saves, and (freshly built on a new model) the target a checkpoint loads into."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(_unwrapped(model), optimizer)
    return {"model": model_state, "optim": optim_state}


def load_train_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Put a loaded `train_state` back into the model and the optimizer."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    set_state_dict(_unwrapped(model), optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, on every rank (a collective under FSDP2): to compare models across layouts."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(_unwrapped(model), options=StateDictOptions(full_state_dict=True))


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model) if isinstance(model, torch.nn.parallel.DistributedDataParallel) \
        else model
