"""A skipped step leaves the LR schedule where it was, as Megatron does for a skipped iteration.

The Transformers Trainer and Lightning call `optimizer.step()` on every step and step their LR schedulers
after it. A step the guard skips clears the gradients, so that optimizer step changes nothing, but the
schedulers would still advance: after N skips the schedule would run N steps ahead of the updates made.

    held = HeldSchedule.take(schedulers)     # before the skipped optimizer step
    ...                                      # the loop steps its optimizer (no-op) and its schedulers
    held.put_back()                          # each scheduler's state and its optimizer's param-group LRs

Each scheduler's `state_dict` (deep-copied: some hold lists the next `step` may change in place) and the LR
of each of its optimizer's param groups (a scheduler's `step` writes them) are taken and put back.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class HeldSchedule:
    schedulers: tuple[Any, ...]
    states: tuple[dict, ...]
    rates: tuple[tuple[float, ...], ...]

    @classmethod
    def take(cls, schedulers) -> HeldSchedule:
        schedulers = tuple(schedulers)
        return cls(schedulers, tuple(copy.deepcopy(s.state_dict()) for s in schedulers),
                   tuple(tuple(group["lr"] for group in s.optimizer.param_groups) for s in schedulers))

    def put_back(self) -> None:
        for scheduler, state, rates in zip(self.schedulers, self.states, self.rates):
            scheduler.load_state_dict(copy.deepcopy(state))
            for group, rate in zip(scheduler.optimizer.param_groups, rates):
                group["lr"] = rate
