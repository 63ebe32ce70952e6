"""Who leads: the rule over a claim as one agent finds it. Pure: the agent reads the claim and keeps the clock.

A job-level action (agent/executor.py) and a stall's incident (agent/culprit.py) are each claimed by one
agent of the job, in a signed claim that names its claimant: host, agent pid and the agent's start time
(agent/claims.py). Another agent that finds a valid claim decides from it:

- **its own claim** (same host): it leads, again if its agent restarted since (another pid or start time)
  -- unless the claim was taken over meanwhile (a later generation exists): then that one decides;
- **done**, or **renewed within the timeout** as this agent saw it: the claimant stands, follow it;
- **neither**: the claimant is gone (it stopped renewing: died, or restarted and never came back to it):
  take over, that is race for the next generation's name, which exactly one agent creates.

"Renewed" is judged on the reader's own clock, from when it saw the renewal count change, never from a
time written in the claim: the claimant's clock is not the reader's.
"""

from __future__ import annotations

from dataclasses import dataclass

LEAD, FOLLOW, TAKE_OVER, NEXT = "lead", "follow", "take_over", "next"


@dataclass(frozen=True)
class Claimant:
    host: str
    pid: int | None = None
    started_at: float | None = None     # the agent process's start time (pids are reused)


def restarted(claimant: Claimant, me: Claimant) -> bool:
    """The claim is this host's, made by an earlier life of its agent."""
    return claimant.host == me.host and (claimant.pid, claimant.started_at) != (me.pid, me.started_at)


def renewed_within(seen_since: float, now: float, timeout: float) -> bool:
    """The claim's renewal count last changed, as this agent saw it, less than `timeout` ago."""
    return now - seen_since < timeout


def standing(*, mine: bool, done: bool, renewed: bool, taken_over_since: bool) -> str:
    """What an agent does with a valid claim it found: LEAD, FOLLOW, TAKE_OVER, or NEXT (look at the next
    generation: this agent's old claim was taken over while it was away)."""
    if mine and not done and taken_over_since:
        return NEXT
    if mine:
        return LEAD
    if done or renewed:
        return FOLLOW
    return TAKE_OVER
