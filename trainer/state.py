"""What a checkpoint of the bundled trainer holds: its states, side by side, as torchtitan does.

    states = checkpoint_states(model, optimizer, schedule, train_data)
    Protector(run_dir, states=states, state=TrainState(...), ...)

The Protector adds its own beside them (``guard``, ``cost``, and the `TrainState` as ``trainer``). The
checkpoint store gives ``model`` and ``optim`` files of their own and puts the rest in ``extra.pt``;
only plain data and tensors, so ``torch.load(weights_only=True)`` reads it back.
"""

from __future__ import annotations

from typing import Any

import torch

from trainguard.protect import RNGState, TrainState
from trainguard.trainer.data import ShardLoader
from trainguard.trainer.step import LRSchedule

__all__ = ["TrainState", "checkpoint_states"]


def checkpoint_states(model: torch.nn.Module, optimizer: torch.optim.Optimizer, schedule: LRSchedule,
                      train_data: ShardLoader) -> dict[str, Any]:
    """Every state the trainer checkpoints, by the key it has always had in the checkpoint."""
    return {"model": model, "optim": optimizer, "sched": schedule, "data": train_data, "rng": RNGState()}
