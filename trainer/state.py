"""What a checkpoint of the bundled trainer holds: its states, side by side, as torchtitan does.

    states = checkpoint_states(model, optimizer, schedule, train_data)
    Protector(run_dir, states=states, state=TrainState(...), ...)

The Protector adds its own beside them (``guard``, ``cost``, and the `TrainState` as ``trainer``). The
checkpoint store gives ``model`` and ``optim`` files of their own and puts the rest in ``extra.pt``;
only plain data and tensors, so ``torch.load(weights_only=True)`` reads it back. Under FSDP2 every rank
saves its shards of ``model`` and ``optim`` (the Protector's ``sharded_checkpoints``).
"""

from __future__ import annotations

from typing import Any

import torch

from trainguard.protect import RNGState, TrainState
from trainguard.trainer import parallel
from trainguard.trainer.data import ShardLoader
from trainguard.trainer.step import LRSchedule

__all__ = ["TrainState", "checkpoint_states"]


def checkpoint_states(model: torch.nn.Module, optimizer: torch.optim.Optimizer, schedule: LRSchedule,
                      train_data: ShardLoader, *, sharded: bool = False) -> dict[str, Any]:
    """Every state the trainer checkpoints, by the key it has always had in the checkpoint. `sharded`
    (FSDP2): the model and the optimizer by parameter name, each rank's shards (trainer/parallel.py);
    either way the optimizer also loads the other layout's checkpoint."""
    model_state = parallel.ModelState(model) if sharded else model
    optim_state = parallel.OptimizerState(model, optimizer, by_name=sharded)
    return {"model": model_state, "optim": optim_state, "sched": schedule, "data": train_data, "rng": RNGState()}
