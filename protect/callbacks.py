"""What a decision asks of the loop, and what the library does when the loop has not said.

Every field is optional. The library itself always updates `TrainState` (step, micro-batch, LR scale,
evaluation pause) and its own states (guard, cost meter); a loop that reads those numbers from the state
needs no callback for them. What a callback returns (a dict) is added to the decision's TLS event.

| callback          | called                                  | default                                       |
|-------------------|-----------------------------------------|-----------------------------------------------|
| `validate()`      | before each checkpoint (stability)      | none: stable = the guard saw no trouble        |
| `reload(parts)`   | resume and rollback, with the states to load | `load_state_dict` of each of the loop's states |
| `skip_data(saved)`| rollback; `saved` = the checkpoint's `data` state | keep the data position (nothing re-read) |
| `scale_lr(factor, scale, rewarmup_steps)` | rollback, after `TrainState.lr_scale *= factor` | every optimizer's param groups: the checkpoint's `lr` times `scale` over the checkpoint's scale |
| `cut_micro_batch(size)` | cost_throttle, after `TrainState.micro_batch = size` | nothing more (the loop reads the state)  |
| `pause()`         | cost_warn, after `TrainState.eval_paused = True` | nothing more                            |
| `saved(step, path, wait)` | rank 0, after a checkpoint was written (`wait()`: until durable) | nothing |
| `stop(reason)`    | before the guard's stop or a cost stop ends the run | nothing (the loop ends on `StepOutcome.stop`) |
| `checkpoint_meta()` | every rank, before a checkpoint (may run a collective); a dict joins the manifest's `meta`, None refuses the save | nothing added |
| `rebuild()`       | after an in-process restart (the group re-formed, the state restored, the gradients cleared) | nothing more: a loop with DDP must wrap the model again (its reducer holds the old group) |
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch


@dataclass
class Callbacks:
    validate: Callable[[], float] | None = None
    reload: Callable[[dict[str, Any]], None] | None = None
    skip_data: Callable[[Any], dict | None] | None = None
    scale_lr: Callable[[float, float, int], dict | None] | None = None
    cut_micro_batch: Callable[[int], dict | None] | None = None
    pause: Callable[[], dict | None] | None = None
    saved: Callable[[int, Path, Callable[[], None]], None] | None = None
    stop: Callable[[str], None] | None = None
    checkpoint_meta: Callable[[], dict | None] | None = None   # the replica check's (trainer/replica_check.py)
    rebuild: Callable[[], None] | None = None     # after an in-process restart (protect/recovery.py)


def load_states(states: dict[str, Any], parts: dict[str, Any]) -> None:
    """Each state that the checkpoint holds gets its part back (a state the checkpoint lacks keeps its own:
    a checkpoint written before that state was tracked)."""
    for key, part in parts.items():
        if key in states:
            states[key].load_state_dict(part)


def scale_optimizers(states: dict[str, Any], factor: float) -> None:
    for obj in states.values():
        if isinstance(obj, torch.optim.Optimizer):
            for group in obj.param_groups:
                group["lr"] *= factor
