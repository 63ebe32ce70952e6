"""One optimizer step's arithmetic: learning rate, forward/backward over micro-batches, gradient norms.

The step's single device-to-host sync (loss, norms, control request, clock in one vector) is the
protection library's (`trainguard.protect.sync`), called through `Protector.check`.
"""

from __future__ import annotations

import math
import sys
from contextlib import nullcontext
from typing import Any

import torch

from trainguard.trainer.config import OptimConfig


class LRSchedule:
    """Linear warm-up then cosine decay to min_lr (nanoGPT's), over optimizer *updates*.

    A skipped step applies no update, so it does not advance the schedule. After a rollback the LR is
    warmed up again over `rewarm` updates; the rollbacks' cumulative factor is `TrainState.lr_scale`,
    which the loop passes in as `scale`.
    """

    def __init__(self, optim: OptimConfig, total_steps: int):
        self.base, self.min_lr = optim.lr, optim.min_lr
        self.warmup = optim.warmup_steps
        self.decay = optim.decay_steps or total_steps
        self.updates = 0          # optimizer updates applied so far
        self.rewarm_from = 0      # `updates` at the last rollback
        self.rewarm = 0

    def lr(self, scale: float = 1.0) -> float:
        n = self.updates + 1
        if n <= self.warmup:
            lr = self.base * n / self.warmup
        elif n >= self.decay:
            lr = self.min_lr
        else:
            progress = (n - self.warmup) / max(1, self.decay - self.warmup)
            lr = self.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (self.base - self.min_lr)
        since = n - self.rewarm_from
        if self.rewarm and since <= self.rewarm:
            lr *= since / self.rewarm
        return lr * scale

    def rewarm_now(self, rewarm: int) -> None:
        self.rewarm_from, self.rewarm = self.updates, rewarm

    def state_dict(self) -> dict:
        return {"updates": self.updates, "rewarm_from": self.rewarm_from, "rewarm": self.rewarm}

    def load_state_dict(self, state: dict) -> None:
        self.updates = int(state["updates"])
        self.rewarm_from, self.rewarm = int(state["rewarm_from"]), int(state["rewarm"])


def forward_backward(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, micro_batch: int, *,
                     autocast, loss_factor: float = 1.0, grad_factor: float = 1.0) -> torch.Tensor:
    """Backward over micro-batches of `micro_batch` rows; returns the batch's mean loss (detached).

    Each micro-batch's loss is weighted by its share of the rows, so the gradient equals the full batch's
    whatever the split (the last micro-batch may be smaller). DDP all-reduces only on the last one.
    """
    rows = x.size(0)
    starts = list(range(0, rows, micro_batch))
    total = torch.zeros((), device=x.device)
    for i, start in enumerate(starts):
        end = min(start + micro_batch, rows)
        last = i == len(starts) - 1
        sync_ctx = nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
        with sync_ctx:
            with autocast:
                _, loss = model(x[start:end], y[start:end])
            loss = loss * ((end - start) / rows * loss_factor)
            (loss * grad_factor).backward()
        total += loss.detach()
    return total


class GradNorms:
    """Per-layer and global L2 norms of the gradients, computed on the device (no host sync).

    Under FSDP2 each rank holds a shard of every gradient (DTensors): the squares of its shards are summed
    over the ranks (one all-reduce of a vector of one float per parameter), so every rank gets the norms
    of the whole gradients, equal to a DDP run's up to the order of float additions.
    """

    def __init__(self, params: list[torch.nn.Parameter], owners: list[int], layer_names: list[str]):
        self.params, self.names = params, layer_names
        self.owners = torch.tensor(owners, device=params[0].device)
        self.group = shard_group(params)

    def compute(self) -> tuple[torch.Tensor, torch.Tensor]:
        squares = local_squares([p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params])
        if self.group is not None:
            import torch.distributed as dist

            dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=self.group)
        layers = torch.zeros(len(self.names), device=squares.device).index_add_(0, self.owners, squares)
        return squares.sum().sqrt(), layers.sqrt()


def shard_group(tensors: list[torch.Tensor]) -> Any:
    """The process group the tensors are sharded over (FSDP2's DTensors), or None for whole tensors."""
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is None:   # never imported, so no DTensor exists (importing it costs seconds at a restart)
        return None
    first = next((t for t in tensors if isinstance(t, dtensor.DTensor)), None)
    return first.device_mesh.get_group() if first is not None else None


def local_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The squared L2 norm of each tensor, of this rank's shard when it is a DTensor (float32, on device)."""
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    return torch.stack(torch._foreach_norm(local)).float() ** 2


def global_norm(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The L2 norm of all the tensors together, whole even when they are sharded over ranks (FSDP2)."""
    squares = local_squares(tensors).sum()
    group = shard_group(tensors)
    if group is not None:
        import torch.distributed as dist

        dist.all_reduce(squares, op=dist.ReduceOp.SUM, group=group)
    return squares.sqrt()
