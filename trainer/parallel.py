"""How the bundled trainer spreads its model over ranks: ``run.parallel: ddp | fsdp2``.

- ``ddp``: every rank holds the whole model; DistributedDataParallel averages the gradients.
- ``fsdp2``: ``torch.distributed.fsdp.fully_shard`` on every transformer block and on the root: each rank
  holds a shard of every parameter and of the optimizer state (DTensors); gloo on CPU, NCCL on GPU.
  One rank (``--nproc 1``) trains the plain model: there is nothing to shard.

Checkpoints go through `train_state` / `load_train_state` (or the `ModelState` / `OptimizerState` the
trainer checkpoints), torch's distributed state-dict API: keys are parameter names (not the optimizer's
integer ids) and tensors are DTensors under FSDP2, so torch.distributed.checkpoint writes each rank's
shard and reshards on load into any world size.
"""

from __future__ import annotations

from typing import Any

import torch

DDP, FSDP2 = "ddp", "fsdp2"
MODES = (DDP, FSDP2)


def wrap(model: torch.nn.Module, mode: str, world_size: int, device: torch.device) -> torch.nn.Module:
    """The module the training step calls. FSDP2 shards `model` in place (its parameters become DTensors)
    and returns it; DDP returns a wrapper; one rank returns `model` itself."""
    if world_size == 1:
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


def local_shards(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """Each parameter's storage on this rank: its shard under FSDP2 (the same memory the optimizer
    updates), the parameter itself otherwise."""
    return [p.to_local().detach() if hasattr(p, "to_local") else p for p in params]


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "module", model) if isinstance(model, torch.nn.parallel.DistributedDataParallel) \
        else model


class ModelState:
    """The model as a checkpointed state under FSDP2: its shards by parameter name (DTensors), loaded back
    through `set_model_state_dict`, which also takes whole tensors (a checkpoint of one process)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.model)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.model, state)


class OptimizerState:
    """The optimizer as a checkpointed state: `by_name` (FSDP2) saves its state keyed by parameter name,
    the shards as DTensors, so it reshards; otherwise the optimizer's own `state_dict` (by index, as every
    DDP checkpoint has it). Either kind loads back: a run resumes a checkpoint of the other layout."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, by_name: bool):
        self.model, self.optimizer, self.by_name = model, optimizer, by_name

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def state_dict(self) -> dict[str, Any]:
        if not self.by_name:
            return self.optimizer.state_dict()
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        fresh = not self.optimizer.state
        state = get_optimizer_state_dict(self.model, self.optimizer)
        if fresh:
            # torch filled a fresh optimizer's moments (a step at LR 0) to have a layout to load into:
            # the tensors stay in `state` as that target, the optimizer stays as it was (its first real
            # step must be its first step, or Adam's bias correction drifts from an unsharded run's).
            self.optimizer.state.clear()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if _by_index(state):
            self.optimizer.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        set_optimizer_state_dict(self.model, self.optimizer, state)


def _by_index(state: dict[str, Any]) -> bool:
    """An optimizer state dict keyed by parameter index (torch's own) rather than by name."""
    groups = state.get("param_groups") or [{}]
    return all(isinstance(param, int) for group in groups for param in group.get("params", []))


def replica_check_conflict(mode: str, policy_path: str) -> str | None:
    """Pure FSDP2 sharding has no replicas to compare: a policy file that asks for the replica check
    (guard.replica_check_every above 0) under it is refused rather than silently ignored. The default
    policy's check is off under FSDP2 (docs/checkpoints.md)."""
    if mode != FSDP2 or not policy_path:
        return None
    import yaml

    from trainguard import safe_read

    try:
        raw = safe_read.read_yaml(policy_path, what="policy file") or {}
    except (OSError, ValueError, yaml.YAMLError):
        return None   # the policy's own validation reports it
    every = (raw.get("guard") or {}).get("replica_check_every", 0) if isinstance(raw, dict) else 0
    if isinstance(every, int) and every > 0:
        return (f"{policy_path}: guard.replica_check_every: {every} needs replicas, but run.parallel: fsdp2 "
                "shards every parameter over the ranks (none holds a whole copy to compare); set it to 0, "
                "or train with run.parallel: ddp")
    return None
