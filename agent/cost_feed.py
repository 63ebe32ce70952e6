"""The run's cost, metered by the agent: one rank's steps into the cost meter, its tier decisions out.

The meter (trainguard/decide/cost.py) is the pure state machine replay runs too; what the agent adds is
which steps feed it. The run is metered once, from the lowest rank whose steps this agent reads (rank 0
on its node), and a step without a GPU count is billed for the rank files the agent follows. Each tier
decision is logged and handed to `decide` (the agent's decision handlers: the executor, when the
embedded path is on; see agent/app.py).
"""

from __future__ import annotations

from typing import Callable

from trainguard.decide.cost import CostMeter, clock_of, usage_of
from trainguard.decide.decision import Decision


class CostFeed:
    def __init__(self, meter: CostMeter, decide: Callable[[Decision], None] | None, log):
        self.meter, self.decide, self.log = meter, decide, log
        self.rank: int | None = None     # the rank whose steps feed the meter; None: no step seen yet

    def observe(self, record: dict, rank: int, gpus: int) -> None:
        """A step `record` of `rank`, on `gpus` billable GPUs (metered when `rank` is the lead rank)."""
        if self.rank is None or rank < self.rank:
            self.rank = rank
        if rank != self.rank:
            return   # the run's cost is metered once, from one rank's steps
        for decision in self.meter.observe(step=record["step"], timestamp=record["timestamp"], gpu_count=gpus,
                                           clock=clock_of(record), usage=usage_of(record, self.meter.gpus(gpus))):
            self.log.warning("cost decision", action=decision.action, reason=decision.reason, step=decision.step)
            if self.decide is not None:
                self.decide(decision)

    @property
    def metering(self) -> CostMeter | None:
        """The meter once it meters the run (what the cost families render), else None."""
        return None if self.rank is None else self.meter

    def state_dict(self) -> dict:
        return {"cost_rank": self.rank, "cost": self.meter.state_dict()}

    def load_state_dict(self, saved: dict) -> None:
        if saved.get("cost"):
            self.meter.load_state_dict(saved["cost"])
        self.rank = saved.get("cost_rank")
