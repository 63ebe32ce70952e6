"""The one decision type shared by the guard, the cost meter and the alert ledger."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Decision:
    """What the guard, the cost meter or the ledger decided at one step: an action (or none) and why."""

    action: str | None          # an action from trainguard.actions, "stop", or None for "carry on"
    reason: str = ""
    step: int | None = None
    timestamp: float | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return self.action is not None

    def as_event(self) -> dict[str, Any]:
        """The TLS `event` section that records this decision."""
        event: dict[str, Any] = {"type": self.action, "reason": self.reason}
        if self.step is not None:
            event["step"] = self.step
        event.update(self.detail)
        return event


CARRY_ON = Decision(None)
