"""What a protected loop keeps between steps, as objects with `state_dict` / `load_state_dict`, so they are
checkpointed beside the model and the optimizer (``states={...}``, as torchtitan does).

`TrainState` is the loop's progress and the decisions taken about it. The `Protector` writes the fields a
decision changes (the loop reads them from here: no callback is needed for that), and a rollback rewinds
only the progress: a cut micro-batch, a paused evaluation or a lowered LR were decided about the run, not
about the steps that were undone, so they stand.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

PROGRESS = ("step", "tokens_trained", "best_val")   # what a rollback rewinds to the checkpoint's values


@dataclass
class TrainState:
    step: int = 0                       # optimizer steps taken (skipped ones included: they consumed data)
    tokens_trained: int = 0             # tokens of applied updates, this rank's
    micro_batch: int = 0                # rows per forward/backward; a cost throttle cuts it
    best_val: float = math.inf          # best validation loss at a checkpoint (what "stable" is judged by)
    lr_scale: float = 1.0               # product of the rollbacks' LR factors
    eval_paused: bool = False           # a cost warning pauses work that is not training
    trouble_since_checkpoint: bool = False   # a skip or rollback since the last checkpoint: not stable
    last_saved_step: int | None = None  # the step of the newest checkpoint this run saved or restored
    last_checkpoint_time: float | None = None   # rank 0's clock then (so every rank agrees on time)

    def state_dict(self) -> dict:
        # `micro_batch_size`: the key checkpoints of the bundled trainer have always used
        return {"step": self.step, "tokens_trained": self.tokens_trained, "best_val": self.best_val,
                "micro_batch_size": self.micro_batch, "lr_scale": self.lr_scale, "eval_paused": self.eval_paused}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.tokens_trained = int(state["step"]), int(state["tokens_trained"])
        self.best_val, self.micro_batch = float(state["best_val"]), int(state["micro_batch_size"])
        self.lr_scale = float(state.get("lr_scale", 1.0))
        self.eval_paused = bool(state.get("eval_paused", False))

    def rewound_to(self, saved: dict) -> dict:
        """This state with only its progress taken from `saved` (a checkpoint's): what a rollback loads."""
        return {**self.state_dict(), **{key: saved[key] for key in PROGRESS}}


class RNGState:
    """The random generators (torch, Python's, CUDA's when in use), as a checkpointable object."""

    def state_dict(self) -> dict:
        state = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state["torch"])
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])
