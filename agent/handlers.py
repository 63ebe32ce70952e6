"""The agent's side of the action table: what carrying out each remote action means on this node.

Every remote action the ledger lets through is first a request, signed with the run's checkpoint key and
appended to ``RUN/control/actions.jsonl`` (the ranks act on those with a control ``code`` in the same step,
runtime/control.py, and their handlers in protect/handlers.py). An action the table gives to the agent
(``carried_by`` AGENT: ``restore``) does more here, in its handler, registered with ``@handles(NAME)`` as
``handler(node, verdict, result)``; `node` (a `NodeActions`, agent/dispatch.py) is what the handler may act
on: this node's run directory, host, restore settings and refusal counts. ``gathers_evidence``: a handler
that ends processes waits for the incident's evidence first (agent/evidence_first.py), unless the embedded
watchdog gathered it before deciding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from trainguard.actions import RESTORE
from trainguard.agent import recover_in_process, restore

if TYPE_CHECKING:
    from trainguard.agent.dispatch import NodeActions
    from trainguard.decide.ledger import NoticeVerdict

HandlerFunction = Callable[["NodeActions", "NoticeVerdict", dict], None]


@dataclass(frozen=True)
class Handler:
    carry_out: HandlerFunction
    gathers_evidence: bool = False


HANDLERS: dict[str, Handler] = {}


def handles(action: str, *, gathers_evidence: bool = False) -> Callable[[HandlerFunction], HandlerFunction]:
    """Register the agent's handler of `action` (a row of trainguard/actions.py carried by AGENT)."""
    def register(function: HandlerFunction) -> HandlerFunction:
        if action in HANDLERS:
            raise ValueError(f"two agent handlers for {action!r}")
        HANDLERS[action] = Handler(function, gathers_evidence)
        return function
    return register


def gathers_evidence(action: str | None) -> bool:
    """Whether carrying out `action` ends processes whose evidence an incident needs first."""
    handler = HANDLERS.get(action or "")
    return handler is not None and handler.gathers_evidence


@handles(RESTORE, gathers_evidence=True)
def restore_ranks(node: NodeActions, verdict: NoticeVerdict, result: dict) -> None:
    """Under `recovery.mode: in_process`, first ask the job's ranks to recover in their own processes
    (agent/recover_in_process.py); when they do not (or it is not tried), end this node's proven ranks that
    started before the alert, so torch's elastic launcher starts them again from the latest verified
    checkpoint (agent/restore.py); a launcher with no restarts left pages."""
    why = recover_in_process.why_not(node, verdict)
    if why is None:
        outcome = recover_in_process.recover(node, verdict)
        result["in_process"] = outcome.record
        if outcome.recovered:
            result.update(recovery=recover_in_process.IN_PROCESS, ended=[], skipped=[], refused=[])
            return
    elif node.recovery is not None and node.recovery.mode == recover_in_process.IN_PROCESS:
        result["in_process"] = {"result": "not_tried", "why": why}
    if "in_process" in result:
        result["recovery"] = "restart"      # said where in-process was the policy's choice
    result.update(restore.end_local_ranks(node.run_dir, node.host, started_before=verdict.notice.starts_at,
                                          grace_seconds=node.grace, trust=node.trust()))
    for refusal in result["refused"]:
        node.count_refusal(refusal["reason"])
    if "paged" in result:
        node.count_refusal("no_restarts_left")
