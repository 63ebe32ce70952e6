"""What the bundled trainer does when the Protector decides (trainguard.protect): the few things the
library cannot do itself, registered as its `Callbacks`. The decisions and the mechanics shared by every
loop (which checkpoint, what a rollback keeps, the stop marker, the cost summary) are the library's.

- validate: the validation loss over the same batches every time, judged for a checkpoint's stability;
- skip_data: after a rollback the data position stays where it was; this reports how much was skipped;
- scale_lr: the LR schedule warms up again (the cut itself, `TrainState.lr_scale`, the loop applies);
- cut_micro_batch: the throttled micro-batch needs more gradient accumulation for the same batch;
- saved: the `corrupt-checkpoint` fault, on a checkpoint just written.
"""

from __future__ import annotations

from typing import Callable

from trainguard.protect import Callbacks
from trainguard.trainer.data import ShardLoader
from trainguard.trainer.faults import FaultInjector
from trainguard.trainer.step import LRSchedule


def trainer_callbacks(*, schedule: LRSchedule, train_data: ShardLoader, faults: FaultInjector,
                      batch_size: int, block_size: int, validate: Callable[[], float]) -> Callbacks:
    def skip_data(saved: dict) -> dict:
        windows = train_data.consumed - int(saved["consumed"])
        return {"data_windows_skipped": windows, "tokens_skipped": windows * block_size}

    def scale_lr(factor: float, scale: float, rewarmup_steps: int) -> None:
        schedule.rewarm_now(rewarmup_steps)

    def cut_micro_batch(size: int) -> dict:
        return {"grad_accum_steps": grad_accum_steps(batch_size, size)}

    def saved(step: int, path, wait: Callable[[], None]) -> None:
        faults.after_checkpoint(step, path, wait=wait)

    return Callbacks(validate=validate, skip_data=skip_data, scale_lr=scale_lr,
                     cut_micro_batch=cut_micro_batch, saved=saved)


def grad_accum_steps(batch_size: int, micro_batch: int) -> int:
    return -(-batch_size // micro_batch)
