"""A `restore` carried out in-process: the job's ranks asked to recover in their own processes, not ended.

Under `recovery.mode: in_process` (the policy the agent reads: its own, or the run's signed one) the restore
handler (agent/handlers.py) first writes a signed recovery request (runtime/resilience/request.py) instead
of ending this node's ranks: every rank's watcher takes it, the ranks abort their process group (a rank
blocked in a collective is released; one stuck outside any collective is interrupted), meet in the job's
store, re-form the group and restore the newest state every rank verifies (docs/recovery.md). The agent
waits for each of this node's ranks to record its `in_process_restart` naming the request. The evidence of
the incident was gathered before the handler runs, as for any restore (agent/evidence_first.py, or the
stall watchdog's investigation).

When the ranks do not recover, the restart path follows, as before the request, with the same proof
(agent/restore.py `end_local_ranks`): no rank took the request within `ACK_SECONDS` (they are not
watching: `restart` in the trainer's policy, an older trainer), or not every rank of this node recorded
its recovery within `recovery.barrier_seconds` + `RESULT_GRACE_SECONDS` (a rank that never met the others
fails the recovery on every rank: they exit, the launcher restarts them, and the agent ends what is left).

Not tried, the restart path at once: a world of one rank (no group to re-form), no key to sign the
request with, and a job with a cordoned node (an eviction under way: the culprit node is kept out, which
in-process cannot do; agent/culprit.py).

One request per stall: its id is the stall's key (agent/culprit.py `stall_key`: the run's newest step and
launcher attempt, the same on every node), so the agents of several nodes that restore the same stall
wait on one recovery; each records the result for its own node's ranks.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainguard import event_types, incidents, rundir, safe_read
from trainguard import log as tglog
from trainguard.agent import culprit, evict, restore
from trainguard.runtime import cordon_key
from trainguard.runtime.checkpoint import keys
from trainguard.runtime.resilience import request as requests

if TYPE_CHECKING:
    from trainguard.agent.dispatch import NodeActions
    from trainguard.decide.ledger import NoticeVerdict

IN_PROCESS = "in_process"
ACK_SECONDS = 10.0            # a watcher reads requests every 0.5 s: ten seconds is a loaded machine's margin
RESULT_GRACE_SECONDS = 30.0   # past the barrier's bound: re-forming the group and restoring the state
POLL_SECONDS = 0.2
READ_LIMIT = 8 * 1024 * 1024  # of a rank's log written since the request (steps after the recovery too)


@dataclass(frozen=True)
class Outcome:
    recovered: bool
    record: dict              # the action record's `in_process` field


def why_not(node: NodeActions, verdict: NoticeVerdict) -> str | None:
    """Why this restore is not tried in-process (None: it is)."""
    settings = node.recovery
    if settings is None or settings.mode != IN_PROCESS:
        return "recovery.mode is restart"
    infos, _ = restore.read_ranks(node.run_dir)
    attempt = max((culprit.restart_count(info) for info in infos), default=0)
    current = [info for info in infos if culprit.restart_count(info) == attempt]   # not an earlier attempt's
    if len(current) < 2:
        return "a world of one rank: no process group to re-form"
    kept_out = set(evict.cordoned(node.run_dir, node.checkpoint_key_file)) & {info.host for info in current}
    if kept_out:
        return f"an eviction is under way ({', '.join(sorted(kept_out))} kept out): the restart path re-forms the job"
    if not node.live(verdict):
        return "no live rank of this node to recover"
    return None


def recover(node: NodeActions, verdict: NoticeVerdict, *, sleep=time.sleep) -> Outcome:
    """Ask for the in-process recovery (or join the one asked for this stall) and wait for this node's ranks."""
    log = tglog.get("agent.recover_in_process", node=node.node)
    key, where = cordon_key.signing_key(node.checkpoint_key_file)
    if key is None:
        return Outcome(False, {"result": "not_tried", "why": f"no checkpoint key to sign the request ({where})"})
    live = node.live(verdict)
    offsets = {info.rank: _size(rundir.rank_log(node.run_dir, info.rank)) for info in live}
    began = node.clock()
    request_id, asked = _ask(node, verdict, key, began)
    record: dict[str, Any] = {"request": request_id, "asked": asked, "ranks": sorted(offsets)}
    log.warning("asking the ranks to recover in-process", request=request_id, asked=asked, ranks=sorted(offsets))
    deadline = time.monotonic() + node.recovery.barrier_seconds + RESULT_GRACE_SECONDS
    ack_deadline = time.monotonic() + ACK_SECONDS
    done: dict[int, dict] = {}
    while True:
        for info in live:
            if info.rank not in done and (event := _recovered(node.run_dir, info.rank, offsets[info.rank],
                                                             request_id)) is not None:
                done[info.rank] = event
        if len(done) == len(live):
            record.update(result="recovered", seconds=round(node.clock() - began, 3),
                          restored_step=min(e.get("restored_step", 0) for e in done.values()),
                          steps_lost=max(e.get("steps_lost", 0) for e in done.values()),
                          generation=max(e.get("generation", 0) for e in done.values()))
            log.warning("recovered in-process", **record)
            return Outcome(True, record)
        now = time.monotonic()
        gone = [info.rank for info in live if info.rank not in done and restore.live_process(info) is None]
        why = None
        if gone:
            why = f"rank(s) {gone} ended before recovering (the recovery failed; their launcher restarts them)"
        elif now > ack_deadline and not requests.acknowledged(node.run_dir, request_id):
            # one rank's watcher taking it is enough: it writes the job's fault, which every rank watches
            why = f"no rank took the request within {ACK_SECONDS:g} s (the ranks do not watch for requests)"
        elif now > deadline:
            why = (f"rank(s) {sorted(set(offsets) - set(done))} did not record the recovery within "
                   f"recovery.barrier_seconds + {RESULT_GRACE_SECONDS:g} s")
        if why is not None:
            record.update(result="failed", why=why, recovered_ranks=sorted(done),
                          seconds=round(node.clock() - began, 3))
            log.error("the in-process recovery failed: ending the ranks (the restart path)", **record)
            return Outcome(False, record)
        sleep(POLL_SECONDS)


def _ask(node: NodeActions, verdict: NoticeVerdict, key: bytes, now: float) -> tuple[str, bool]:
    """(the request's id, whether this agent wrote it): the stall's request if another node's agent asked
    for it lately (one recovery serves the job), else a new one."""
    base = "restore-" + culprit.stall_key(node.run_dir)
    fresh_for = node.recovery.barrier_seconds + RESULT_GRACE_SECONDS
    for attempt in range(100):
        request_id = base if attempt == 0 else f"{base}.{attempt}"
        record = requests.sign(key, node.run_dir, request_id, by=f"agent:{node.node}", reason=verdict.reason,
                               culprit_rank=_culprit_rank(node.run_dir, key), issued_at=now, key_id=keys.key_id(key))
        if requests.write(node.run_dir, record):
            return request_id, True
        try:
            there = requests.read(node.run_dir, request_id)
        except (OSError, ValueError):
            continue
        issued = there.get("issued_at") if isinstance(there, dict) else None
        if requests.check(key, there, node.run_dir, request_id) is None and isinstance(issued, (int, float)) \
                and now - issued <= fresh_for:
            return request_id, False
    raise OSError(f"no free recovery request name for {base} in {rundir.recovery_requests_dir(node.run_dir)}")


def _culprit_rank(run_dir: Path, key: bytes) -> int | None:
    """The newest signed incident verdict's culprit rank, when it names one (said in the ranks' logs)."""
    verdicts = [verdict for incident_id, verdict, _ in incidents.scan(run_dir)
                if isinstance(verdict, dict) and incidents.check_verdict(key, incident_id, verdict) is None]
    newest = max(verdicts, default={}, key=lambda verdict: verdict.get("detected_at") or 0)
    rank = (newest.get("culprit") or {}).get("rank")
    return rank if isinstance(rank, int) else None


def _size(path: Path) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return 0


def _recovered(run_dir: Path, rank: int, offset: int, request_id: str) -> dict | None:
    """The rank's `in_process_restart` event naming `request_id`, written since `offset` of its log."""
    try:
        with safe_read.open_file(rundir.rank_log(run_dir, rank), what="log file") as handle:
            handle.seek(offset)
            text = handle.read(READ_LIMIT)
    except OSError:
        return None
    for raw in text.splitlines():
        if event_types.IN_PROCESS_RESTART.encode() not in raw:
            continue
        try:
            event = (json.loads(raw) or {}).get("event") or {}
        except (ValueError, AttributeError):
            continue
        if event.get("type") == event_types.IN_PROCESS_RESTART and event.get("request") == request_id:
            return event
    return None
