"""One optimizer step's arithmetic: learning rate, forward/backward over micro-batches, gradient norms,
and the step's single device-to-host sync.

The sync carries everything the host needs this step, in one small float64 vector:

    [loss / W, non-finite count, control code, control line, timestamp, grad_norm / W, layer norms / W ...]

With more than one rank it is all-reduced with SUM: the loss becomes the global mean, the non-finite
count the number of ranks that saw NaN/Inf, and rank 0's control request and clock reach every rank
(the others contribute zeros). Gradient norms are taken after DDP has averaged the gradients, so every
rank holds the same values; summing value/W keeps them identical on every rank to the bit. Then one
``.tolist()``: the guard, the control channel and telemetry all read from that list.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainguard.trainer.config import OptimConfig

HOST_SLOTS = 3   # control code, control line, timestamp: filled on the host by rank 0


class LRSchedule:
    """Linear warm-up then cosine decay to min_lr (nanoGPT's), over optimizer *updates*.

    A skipped step applies no update, so it does not advance the schedule. A rollback multiplies the
    LR by a factor (cumulatively) and warms it up again over `rewarm` updates.
    """

    def __init__(self, optim: OptimConfig, total_steps: int):
        self.base, self.min_lr = optim.lr, optim.min_lr
        self.warmup = optim.warmup_steps
        self.decay = optim.decay_steps or total_steps
        self.updates = 0          # optimizer updates applied so far
        self.scale = 1.0          # product of rollback factors
        self.rewarm_from = 0      # `updates` at the last rollback
        self.rewarm = 0

    def lr(self) -> float:
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
        return lr * self.scale

    def after_rollback(self, factor: float, rewarm: int) -> None:
        self.scale *= factor
        self.rewarm_from, self.rewarm = self.updates, rewarm

    def state_dict(self) -> dict:
        return {"updates": self.updates, "scale": self.scale, "rewarm_from": self.rewarm_from,
                "rewarm": self.rewarm}

    def load_state_dict(self, state: dict) -> None:
        self.updates, self.scale = int(state["updates"]), float(state["scale"])
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
    """Per-layer and global L2 norms of the gradients, computed on the device (no sync)."""

    def __init__(self, params: list[torch.nn.Parameter], owners: list[int], layer_names: list[str]):
        self.params, self.names = params, layer_names
        self.owners = torch.tensor(owners, device=params[0].device)

    def compute(self) -> tuple[torch.Tensor, torch.Tensor]:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        squares = torch.stack(torch._foreach_norm(grads)).float() ** 2
        layers = torch.zeros(len(self.names), device=squares.device).index_add_(0, self.owners, squares)
        return squares.sum().sqrt(), layers.sqrt()


@dataclass
class Health:
    """The host's view of a step, read from the one synced vector."""

    loss: float
    nonfinite_ranks: int
    control_code: int
    control_line: int
    timestamp: float
    grad_norm: float
    layer_norms: list[float]


class HealthSync:
    """Builds, reduces and reads the step's vector (see the module docstring)."""

    def __init__(self, world_size: int, rank: int, device: torch.device):
        self.world, self.rank, self.device = world_size, rank, device
        # Host values reach the device through a pinned buffer and a non-blocking copy: a plain copy from
        # pageable memory would synchronise the stream.
        self.host = torch.zeros(HOST_SLOTS, dtype=torch.float64, pin_memory=device.type == "cuda")

    def sync(self, loss: torch.Tensor, grad_norm: torch.Tensor, layer_norms: torch.Tensor,
             control: tuple[int, int]) -> Health:
        now = time.time()
        nonfinite = (~torch.isfinite(loss)).to(torch.float64).reshape(1)
        if self.world == 1:
            values = torch.cat([loss.double().reshape(1), nonfinite, grad_norm.double().reshape(1),
                                layer_norms.double()]).tolist()
            return self._read(values[:2] + [control[0], control[1], now] + values[2:])
        if self.rank == 0:   # the other ranks contribute the zeros the buffer was made with
            self.host[0], self.host[1], self.host[2] = control[0], control[1], now
        host = self.host.to(self.device, non_blocking=True)
        scale = 1.0 / self.world
        vector = torch.cat([loss.double().reshape(1) * scale, nonfinite, host,
                            grad_norm.double().reshape(1) * scale, layer_norms.double() * scale])
        dist.all_reduce(vector, op=dist.ReduceOp.SUM)
        return self._read(vector.tolist())

    @staticmethod
    def _read(values: list[float]) -> Health:
        return Health(loss=values[0], nonfinite_ranks=int(values[1]) if math.isfinite(values[1]) else 1,
                      control_code=int(values[2]), control_line=int(values[3]), timestamp=values[4],
                      grad_norm=values[5], layer_norms=values[6:])
