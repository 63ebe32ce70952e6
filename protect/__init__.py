"""Protection for any training loop: the guard's skip and rollback, verified checkpoints, the cost
meter and the agent's control channel behind one object, `Protector`. User guide: docs/library.md.

This package sits outside `trainguard/` (the core imports neither torch nor the trainer at import time)
because it composes torch-side parts of the runtime (runtime/): step telemetry, the control channel
and the checkpoint store. The bundled trainer (trainguard.trainer.loop) is built on it, through this
public API only.
"""

from trainguard.protect.callbacks import Callbacks
from trainguard.protect.protector import (EXIT_OK, EXIT_STOPPED, KEPT_ON_ROLLBACK, Begun, StepOutcome, Protector,
                                          StepVerdict)
from trainguard.protect.recovery import init_process_group
from trainguard.protect.state import RNGState, TrainState

__all__ = ["Begun", "Callbacks", "EXIT_OK", "EXIT_STOPPED", "KEPT_ON_ROLLBACK", "StepOutcome", "Protector",
           "RNGState", "TrainState", "StepVerdict", "init_process_group"]
