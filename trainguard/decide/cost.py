"""The cost meter: steps and time in, budget tiers out.

Cost per 1000 steps = GPU-hours spent over the recent window x price / steps done in it x 1000
(`cost_per_1k_steps`, the one place that arithmetic is written). The overrun is that over the budget,
minus one; crossing a tier of the policy (warn, throttle, stop) yields its action once. The same numbers
are the recording rules behind the `CostBudget*` alerts, so whichever path sees a tier first acts, and
the executor de-duplicates the other.

Two more dimensions, each off until its budget is set, judged against the same tiers (the strongest
overrun of the three acts, and the decision names its `basis`): dollars per million tokens, cumulative
(`cost.token_basis`: every token processed, or only the useful ones, whose updates were kept), and kWh per
1000 steps over the window from NVML's energy counter (`cost.energy_budget_kwh_per_1k_steps`). Their
inputs come from the step records (`usage_of`); the trainer and the agent feed them.

Pure: time comes from the records, so a replay of a log meters exactly what the live run metered.
Replay meters its blocks of records with the meter's own screen beside this loop (`CostMeter.screen`,
`metered_block`; trainguard/decide/batch.py drives them); it meters steps only (the token and energy
budgets are the live meters': replay says so).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence, TypeVar

from trainguard.actions import COST_STOP, COST_THROTTLE, COST_WARN
from trainguard.config import WINDOW, Choice, above, at_least, key
from trainguard.decide.decision import Decision

@dataclass(frozen=True)
class CostTiers:
    """Cost tiers: the overrun of cost per 1000 steps over the budget at which each cost action is taken."""

    warn: float = key(0.30, above(0, 1000), "overrun over the budget that warns (cost_warn)")
    throttle: float = key(0.60, above(0, 1000), "overrun that throttles (cost_throttle)")
    stop: float = key(1.00, above(0, 1000), "overrun that stops the run (cost_stop)")

    def cross_check(self, where: str) -> str | None:
        if self.warn <= self.throttle <= self.stop:
            return None
        return f"{where}: expected warn <= throttle <= stop, got {self}"


@dataclass(frozen=True)
class CostPolicy:
    """The cost meter: price, budget and the window it judges the spend over."""

    price_per_gpu_hour: float = key(2.0, above(0), "USD per GPU-hour")
    budget_per_1k_steps: float = key(120.0, above(0), "USD per 1000 steps")
    tiers: CostTiers = field(default_factory=CostTiers)
    # Cost per 1000 steps is judged over this many recent steps, so start-up does not trip a tier.
    window_steps: int = key(50, WINDOW, "recent steps the cost per 1000 steps is judged over")
    min_steps: int = key(20, at_least(1, 10**6), "steps needed in the window before any tier may act")
    # CPU-only runs (demo, tests) report no GPUs and are billed as this many devices.
    gpu_count_override: int = key(0, at_least(0, 10**7), "billable devices when not 0; else the GPU count from "
                                  "the records")
    # Tiers on tokens and on energy (docs/alerts.md): the same tiers act on the overrun over these budgets.
    budget_per_million_tokens: float = key(0.0, at_least(0), "USD per million tokens counted on token_basis "
                                           "(cumulative); 0: off")
    token_basis: str = key("useful_tokens", Choice(("tokens", "useful_tokens")), "tokens: every token processed; "
                           "useful_tokens: only those of kept updates (rollbacks and restarts undo the rest)")
    energy_budget_kwh_per_1k_steps: float = key(0.0, at_least(0), "kWh per 1000 steps over the window, from NVML's "
                                                "energy counter in the step records; 0: off")


TIER_ACTIONS = ((COST_WARN, "warn"), (COST_THROTTLE, "throttle"), (COST_STOP, "stop"))
Clock = tuple[Any, float]  # (source, monotonic seconds) of a record: the clock is comparable within one source only
Number = TypeVar("Number")      # a float, or a numpy array of them (batch.py meters columns with these)


def gpu_cost(seconds: Number, gpus: Any, price_per_gpu_hour: float) -> Number:
    """USD for `gpus` devices over `seconds` at the policy's price (elementwise on arrays)."""
    return seconds * gpus * (price_per_gpu_hour / 3600.0)  # type: ignore[no-any-return]


def cost_per_1k_steps(seconds: Number, gpus: Any, price_per_gpu_hour: float, steps: Any) -> Number:
    """USD per 1000 steps when `steps` steps took `seconds` on `gpus` devices (elementwise on arrays)."""
    return gpu_cost(seconds, gpus, price_per_gpu_hour) / steps * 1000.0  # type: ignore[no-any-return]


@dataclass
class CostState:
    """What the cost meter knows now: spend, recent cost per 1000 steps, overrun and tier."""

    cost_usd: float = 0.0              # spent since the meter started (all time, rollbacks included)
    cost_per_1k_steps: float = 0.0     # over the recent window
    overrun_ratio: float = 0.0         # cost_per_1k_steps / budget - 1; 0.3 means 30% over budget
    tier: str = "ok"                   # ok | warn | throttle | stop
    gpu_count: int = 0
    steps_in_window: int = 0
    tokens: float = 0.0                # every token processed since the meter started (the job's)
    useful_tokens: float = 0.0         # tokens of kept updates, as the latest record counts them
    usd_per_million_tokens: float = 0.0        # on the policy's token_basis
    token_overrun_ratio: float = 0.0
    kwh_per_1k_steps: float = 0.0
    energy_overrun_ratio: float = 0.0


@dataclass(frozen=True)
class Usage:
    """What a step record says beyond its time: the job's tokens of this step, its useful tokens so far,
    its GPUs' energy counter (joules, cumulative; None without one)."""

    step_tokens: float = 0.0
    useful_tokens: float | None = None
    energy_joules: float | None = None


def _number(section: Any, key: str) -> float | None:
    value = section.get(key) if isinstance(section, dict) else None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        return None
    return float(value)


def usage_of(record: dict[str, Any], gpus: int | None = None) -> Usage:
    """A step record's `Usage`: tokens/s x step time x world size; tokens_trained x world size (every rank
    trains as many); the rank's GPU energy counter (hardware.energy_joules) x the GPU count."""
    metrics, system = record.get("metrics"), record.get("system")
    world = _number(system, "world_size") or 1.0
    step_tokens = (_number(metrics, "tokens_per_second") or 0.0) * (_number(metrics, "step_time_seconds") or 0.0)
    useful = _number(metrics, "tokens_trained")
    joules = _number(record.get("hardware"), "energy_joules")
    return Usage(step_tokens * world, None if useful is None else useful * world,
                 None if joules is None else joules * max(gpus or 1, 1))

def clock_of(record: dict[str, Any]) -> Clock | None:
    """A TLS record's monotonic clock, (node, system.monotonic_seconds), when it carries one."""
    system = record.get("system")
    seconds = system.get("monotonic_seconds") if isinstance(system, dict) else None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        return None
    return (record.get("node"), float(seconds))


class CostMeter:
    def __init__(self, policy: CostPolicy | None = None):
        self.policy = policy or CostPolicy()
        self.window: deque[tuple[float, int]] = deque(maxlen=max(self.policy.window_steps, 2))
        self.state = CostState()
        self.fired: set[str] = set()
        self.last_time: float | None = None      # the latest metered time that moved the clock forward
        self.anchor: tuple[Any, float, float] | None = None   # (clock source, monotonic, metered time)
        self.min_steps = min(self.policy.min_steps, self.window.maxlen - 1)   # type: ignore[operator]
        self.tiers = sorted(((action, tier, float(getattr(self.policy.tiers, tier))) for action, tier in TIER_ACTIONS),
                            key=lambda entry: entry[2])
        self.energy: deque[tuple[int, float]] = deque(maxlen=self.window.maxlen)   # (step, job joules)

    def gpus(self, seen: int | None) -> int:
        """Billable devices: the policy's override, else what the records say."""
        if self.policy.gpu_count_override:
            return self.policy.gpu_count_override
        if seen:
            self.state.gpu_count = int(seen)
        return self.state.gpu_count

    def observe(self, step: int, timestamp: float, gpu_count: int | None = None,
                clock: Clock | None = None, usage: Usage | None = None) -> list[Decision]:
        """The decisions for one step record (a record without a clock ends the one being followed: the
        next record with one is taken at its wall time). `usage`: its tokens and energy (`usage_of`)."""
        return self.take(step, timestamp, self.metered(timestamp, clock), gpu_count, usage)

    def metered(self, timestamp: float, clock: Clock | None) -> float:
        """The record's time as the meter counts it: while records carry one monotonic clock (the same
        source, never going back), the time between two of them is the time that clock measured, so a step
        of the wall clock (NTP) is neither billed nor seen as a slowdown, and a pause of the run still is.
        A record without a clock, or with another one (another node, a reboot), is taken at its wall time."""
        if clock is None:
            self.anchor = None
            return timestamp
        source, seconds = clock
        anchor = self.anchor
        same = anchor is not None and anchor[0] == source and seconds >= anchor[1]
        when = anchor[2] + (seconds - anchor[1]) if same and anchor is not None else timestamp
        self.anchor = (source, seconds, when)
        return when

    def take(self, step: int, timestamp: float, when: float, gpu_count: int | None,
             usage: Usage | None = None) -> list[Decision]:
        """The decisions for a record whose time is already metered (`metered`) as `when`."""
        gpus = self.gpus(gpu_count)
        self._spend(when, gpus)
        window = self.window
        if window and step <= window[-1][1]:
            window.clear()          # a rollback or restart: steps went back, measure afresh
            self.energy.clear()
        window.append((when, step))
        if usage is not None:
            self._use(step, usage)
        return self._judge(step, timestamp, gpus)

    def _use(self, step: int, usage: Usage) -> None:
        state = self.state
        state.tokens += usage.step_tokens
        if usage.useful_tokens is not None:
            state.useful_tokens = usage.useful_tokens
        if usage.energy_joules is not None:
            self.energy.append((step, usage.energy_joules))

    def _other_overruns(self) -> tuple[float, str]:
        """The strongest overrun of the token and energy budgets that are set: (overrun, basis)."""
        state, policy = self.state, self.policy
        found = (-math.inf, "steps")
        if policy.budget_per_million_tokens > 0:
            tokens = state.useful_tokens if policy.token_basis == "useful_tokens" else state.tokens
            if tokens > 0:
                state.usd_per_million_tokens = state.cost_usd / tokens * 1e6
                state.token_overrun_ratio = state.usd_per_million_tokens / policy.budget_per_million_tokens - 1.0
                found = max(found, (state.token_overrun_ratio, policy.token_basis))
        energy = self.energy
        if policy.energy_budget_kwh_per_1k_steps > 0 and len(energy) >= 2 and energy[-1][0] > energy[0][0]:
            (first_step, first_joules), (step, joules) = energy[0], energy[-1]
            state.kwh_per_1k_steps = max(joules - first_joules, 0.0) / 3.6e6 / (step - first_step) * 1000.0
            state.energy_overrun_ratio = state.kwh_per_1k_steps / policy.energy_budget_kwh_per_1k_steps - 1.0
            found = max(found, (state.energy_overrun_ratio, "energy"))
        return found

    def _spend(self, when: float, gpus: int) -> None:
        """Bill the time since the last record that moved the clock forward, unless it goes back."""
        last = self.last_time
        if last is None or when >= last:
            if last is not None:
                self.state.cost_usd += gpu_cost(when - last, gpus, self.policy.price_per_gpu_hour)
            self.last_time = when

    def _judge(self, step: int, timestamp: float, gpus: int) -> list[Decision]:
        state, window, policy = self.state, self.window, self.policy
        (first_time, first_step), (when, _) = window[0], window[-1]
        state.steps_in_window = step - first_step
        if state.steps_in_window <= 0 or when <= first_time:
            return []
        state.cost_per_1k_steps = cost_per_1k_steps(when - first_time, gpus, policy.price_per_gpu_hour,
                                                    state.steps_in_window)
        overrun = state.overrun_ratio = state.cost_per_1k_steps / policy.budget_per_1k_steps - 1.0
        other, basis = self._other_overruns()
        if state.steps_in_window < self.min_steps:
            return []
        if other > overrun:
            return self.cross_tiers(step, timestamp, other, basis)
        return self.cross_tiers(step, timestamp, overrun)

    def cross_tiers(self, step: int, timestamp: float, overrun: float, basis: str = "steps") -> list[Decision]:
        """Set the highest tier `overrun` reaches; each tier's action the first time it is reached."""
        state, policy, decisions = self.state, self.policy, []
        if overrun < self.tiers[0][2]:      # (a NaN overrun neither clears nor reaches a tier)
            state.tier = "ok"
        for action, tier, threshold in self.tiers:
            if overrun >= threshold:
                state.tier = tier
                if action not in self.fired:
                    self.fired.add(action)
                    detail = {"cost_per_1k_steps": round(state.cost_per_1k_steps, 4),
                              "budget_per_1k_steps": policy.budget_per_1k_steps,
                              "overrun_ratio": round(overrun, 4), "cost_usd": round(state.cost_usd, 4)}
                    if basis != "steps":
                        detail.update(self._basis_detail(basis))
                    decisions.append(Decision(action, f"cost_overrun_{tier}", step, timestamp, detail))
        return decisions

    def _basis_detail(self, basis: str) -> dict[str, Any]:
        state, policy = self.state, self.policy
        if basis == "energy":
            return {"basis": basis, "kwh_per_1k_steps": round(state.kwh_per_1k_steps, 6),
                    "energy_budget_kwh_per_1k_steps": policy.energy_budget_kwh_per_1k_steps}
        return {"basis": basis, "usd_per_million_tokens": round(state.usd_per_million_tokens, 6),
                "budget_per_million_tokens": policy.budget_per_million_tokens}

    # ----------------------------------------------- replay's blocks of records (trainguard/decide/batch.py)
    def metered_block(self, timestamps: Any, codes: Any, seconds: Any, nodes: Sequence[Any]) -> Any:
        """`metered` over a block of records as numpy columns (codes: index into `nodes`, -1 without a clock;
        seconds: their monotonic seconds): the same times, the same anchor after them."""
        import numpy as np      # replay's: the live meter takes one record at a time and starts without numpy

        from trainguard.decide.arrays import metered_runs

        found = metered_runs(self.anchor, timestamps, codes, seconds, nodes)
        if found is None:       # clocks flapping: many short runs, the loop is the cheaper way
            return np.array([self.metered(timestamp, None if code < 0 else (nodes[code], at)) for timestamp, code, at
                             in zip(timestamps.tolist(), codes.tolist(), seconds.tolist())])
        when, self.anchor = found
        return when

    def screen(self, columns: tuple[Any, ...], start: int, end: int) -> int:
        """Takes records [start, end) of (steps, timestamps, metered times, GPU counts) into the meter in bulk,
        up to the first that might cross a tier not crossed before (or has no finite time), and returns where
        they end, leaving the state `take` would have left (tiers held already may be reached again: they
        only set the tier). Every running number is built by the loop's own operations, in its order."""
        import numpy as np      # replay's: the live meter takes one record at a time and starts without numpy

        from trainguard.decide.arrays import billable, held_samples, last_where, spent, window_after, window_starts

        policy, state = self.policy, self.state
        steps, when = columns[0][start:end], columns[2][start:end]
        gpus = billable(columns[3][start:end], policy.gpu_count_override, state.gpu_count)
        first, restarts = window_starts(self.window, steps)
        held_times, held_steps = held_samples(self.window)
        first_time = np.concatenate((held_times, when))[first]
        steps_in_window = steps - np.concatenate((held_steps, steps))[first]
        with np.errstate(all="ignore"):
            cost = cost_per_1k_steps(when - first_time, gpus, policy.price_per_gpu_hour, steps_in_window)
            overrun = cost / policy.budget_per_1k_steps - 1.0
        measured = (steps_in_window > 0) & (when > first_time)
        judged = measured & (steps_in_window >= self.min_steps)
        unfired = min((threshold for action, _, threshold in self.tiers if action not in self.fired), default=np.inf)
        doubtful = ~np.isfinite(when) | (judged & ~(overrun < unfired))
        healthy = int(doubtful.argmax()) if doubtful.any() else len(steps)
        if not healthy:
            return start
        state.cost_usd, self.last_time = spent(state.cost_usd, self.last_time, when[:healthy], gpus,
                                               policy.price_per_gpu_hour)
        cleared, samples = window_after(self.window, steps[:healthy], when[:healthy], restarts[:healthy])
        if cleared:
            self.window.clear()
        self.window.extend(samples)
        last = last_where(measured[:healthy])
        if last is not None:
            state.cost_per_1k_steps, state.overrun_ratio = float(cost[last]), float(overrun[last])
        last = last_where(judged[:healthy])
        if last is not None:    # reaches no tier not fired yet (the screen's test): sets the tier, fires nothing
            self.cross_tiers(int(steps[last]), 0.0, float(overrun[last]))
        if not policy.gpu_count_override:
            state.gpu_count = int(gpus[healthy - 1])
        state.steps_in_window = self.window[-1][1] - self.window[0][1]
        return start + healthy

    def state_dict(self) -> dict[str, Any]:
        """Plain data, so a restarted agent meters on exactly where it stopped."""
        return {"cost_usd": self.state.cost_usd, "fired": sorted(self.fired), "tier": self.state.tier,
                "tokens": self.state.tokens, "useful_tokens": self.state.useful_tokens,
                "energy": [list(sample) for sample in self.energy],
                "gpu_count": self.state.gpu_count, "last_time": self.last_time,
                "window": [list(sample) for sample in self.window],
                "clock_anchor": None if self.anchor is None else list(self.anchor)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.state.cost_usd = float(state.get("cost_usd", 0.0))
        self.fired = set(state.get("fired", []))
        self.state.tier = state.get("tier", "ok")
        self.state.gpu_count = int(state.get("gpu_count", 0))
        self.last_time = state.get("last_time")
        self.window.clear()
        self.window.extend((float(t), int(s)) for t, s in state.get("window", []))
        anchor = state.get("clock_anchor")
        self.anchor = None if not anchor else (anchor[0], float(anchor[1]), float(anchor[2]))
        self.state.tokens = float(state.get("tokens", 0.0))
        self.state.useful_tokens = float(state.get("useful_tokens", 0.0))
        self.energy.clear()
        self.energy.extend((int(s), float(j)) for s, j in state.get("energy", []))
