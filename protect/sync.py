"""The step's single device-to-host sync: everything the host needs this step, in one float64 vector.

    [loss / W, non-finite count, control code, control line, timestamp, checkpoint interval, snapshot every,
     checkpoint clock, grad_norm / W, layer norms / W ...]

With more than one rank it is all-reduced with SUM: the loss becomes the global mean, the non-finite
count the number of ranks that saw NaN/Inf, and rank 0's control request, clock, checkpoint interval,
snapshot interval in steps (the autopilot's, decided on rank 0) and checkpoint clock (when its last checkpoint
was taken, the time base of a checkpoint by time) reach every rank (the others contribute zeros). Gradient norms are taken after the gradients were averaged, so every rank
holds the same values; summing value/W keeps them identical on every rank to the bit. Then one
``.tolist()``: the guard, the control channel and telemetry all read from that list.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

HOST_SLOTS = 6   # control code, control line, timestamp, checkpoint interval, snapshot every, checkpoint clock: rank 0's


@dataclass
class Health:
    """The host's view of a step, read from the one synced vector."""

    loss: float
    nonfinite_ranks: int
    control_code: int
    control_line: int
    timestamp: float
    checkpoint_interval: float      # rank 0's applied checkpoint interval in seconds (0: none given)
    snapshot_every: int             # rank 0's applied snapshot interval in steps (0: none given)
    checkpoint_clock: float         # rank 0's clock at its last checkpoint (0: not started yet)
    grad_norm: float
    layer_norms: list[float]


def _scalar(value, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().double().reshape(1)
    return torch.tensor([float(value)], dtype=torch.float64, device=device)


class HealthSync:
    """Builds, reduces and reads the step's vector (see the module docstring)."""

    def __init__(self, world_size: int, rank: int, device: torch.device):
        self.world, self.rank, self.device = world_size, rank, torch.device(device)
        # Host values reach the device through a pinned buffer and a non-blocking copy: a plain copy from
        # pageable memory would synchronise the stream.
        self.host = torch.zeros(HOST_SLOTS, dtype=torch.float64, pin_memory=self.device.type == "cuda")
        self.no_layers = torch.zeros(0, dtype=torch.float64, device=self.device)

    def sync(self, loss, grad_norm, layer_norms: torch.Tensor | None, control: tuple[int, int],
             checkpoint_interval: float = 0.0, snapshot_every: int = 0, checkpoint_clock: float = 0.0) -> Health:
        now = time.time()
        loss, grad_norm = _scalar(loss, self.device), _scalar(grad_norm, self.device)
        layers = self.no_layers if layer_norms is None else layer_norms.detach().double().reshape(-1)
        nonfinite = (~torch.isfinite(loss)).to(torch.float64)
        if self.world == 1:
            values = torch.cat([loss, nonfinite, grad_norm, layers]).tolist()
            return self._read(values[:2] + [control[0], control[1], now, checkpoint_interval, snapshot_every,
                                            checkpoint_clock] + values[2:])
        if self.rank == 0:   # the other ranks contribute the zeros the buffer was made with
            self.host[0], self.host[1], self.host[2] = control[0], control[1], now
            self.host[3], self.host[4], self.host[5] = checkpoint_interval, snapshot_every, checkpoint_clock
        host = self.host.to(self.device, non_blocking=True)
        scale = 1.0 / self.world
        vector = torch.cat([loss * scale, nonfinite, host, grad_norm * scale, layers * scale])
        dist.all_reduce(vector, op=dist.ReduceOp.SUM)
        return self._read(vector.tolist())

    @staticmethod
    def _read(values: list[float]) -> Health:
        return Health(loss=values[0], nonfinite_ranks=int(values[1]) if math.isfinite(values[1]) else 1,
                      control_code=int(values[2]), control_line=int(values[3]), timestamp=values[4],
                      checkpoint_interval=values[5], snapshot_every=int(values[6]), checkpoint_clock=values[7],
                      grad_norm=values[8], layer_norms=values[9:])
