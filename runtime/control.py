"""The control channel: requests the agent appends to ``RUN/control/actions.jsonl``.

    {"id": "a1", "action": "cost_throttle", "alertname": "CostBudgetThrottle", "reason": "...", "issued_at": ...}

Every request is signed with the run's checkpoint key by whoever issued it (the agent's executor, or a
human's command; `rundir.sign_request`), as cordons and claims are: anyone who can write the run directory
can append a line, and a line that can roll the run back or stop it must prove who wrote it. A request
that is not signed, signed with another key, changed since, or copied from a run of another name is refused:
never acted on, logged, counted, and recorded as a ``control_refused`` TLS event (its line, reason and the
running count) that `trainguard status` shows.

Rank 0 looks at the file once per step with a single ``os.stat`` and reads only bytes it has not seen.
A new request becomes two numbers (action code, line number) in the vector the step already
all-reduces, so every rank learns of it in the same step and acts together; ranks other than 0 then read
that one line to acknowledge it with its ``id``. Handled ids are kept in ``RUN/control/acked.jsonl`` so a
restarted run does not act on a request twice.

Each rank also describes itself in ``RUN/control/ranks/rank-<r>.json`` (pid, host, start time): the agent's
``restore`` ends those processes and torch's elastic launcher starts them again.
"""

from __future__ import annotations

import json
import os
import time
from collections import deque
from pathlib import Path

from trainguard import event_types, rundir, signed
from trainguard.node import node_name
from trainguard import actions
from trainguard.actions import CODES


class ControlChannel:
    """Rank 0's end of RUN/control/actions.jsonl (the agent's end is `rundir.append_request`)."""

    def __init__(self, run_dir: str | os.PathLike, rank: int, log=None, *, key: bytes | None = None,
                 key_where: str = "", on_event=None):
        """`key`: the run's checkpoint key (None: no request can be checked, so none is acted on; `key_where`
        says why); `on_event(kind, **fields)` records a TLS event (a refused request)."""
        self.run_dir = Path(run_dir)
        self.requests = rundir.Requests(run_dir)
        self.path = self.requests.path
        self.rank, self.log = rank, log
        self.key, self.key_where, self.on_event = key, key_where, on_event
        self.pending: deque[tuple[int, dict]] = deque()
        self.verified: dict[int, dict] = {}       # line -> the signed request read there (rank 0 acts on these)
        self.refused: dict[str, int] = {}         # refused requests by reason
        self.acked = rundir.read_acked(run_dir, key) if rank == 0 else set()

    def poll(self) -> tuple[int, int]:
        """(code, line number) of the next request to act on, or (0, 0). Rank 0 only; one stat a step."""
        for lineno, raw in self.requests.new_lines():
            request = self._parse(raw, lineno)
            if request is not None:
                self.pending.append((lineno, request))
        if not self.pending:
            return 0, 0
        lineno, request = self.pending.popleft()
        return CODES[request["action"]], lineno

    def _parse(self, raw: bytes, lineno: int) -> dict | None:
        """A request to act on, or None (blank, already handled, not ours, or malformed: logged)."""
        if not raw.strip():
            return None
        try:
            request = json.loads(raw)
            action, request_id = request["action"], str(request["id"])
        except (ValueError, KeyError, TypeError) as exc:
            self._warn("control request ignored", where=f"{self.path}:{lineno}", error=repr(exc))
            return None
        row = actions.of(action) if isinstance(action, str) else None
        if request_id in self.acked or row is not None and row.carried_by == actions.AGENT:
            return None     # handled already, or carried out by the agent (a restore): not the ranks'
        if action not in CODES:
            self._warn("control request ignored", where=f"{self.path}:{lineno}",
                       error=f"unknown action {action!r}")
            return None
        reason = rundir.check_request(self.key, request, self.run_dir)
        if reason is not None:
            self._refuse(request, lineno, reason)
            return None
        self.verified[lineno] = request
        return request

    def _refuse(self, request: dict, lineno: int, reason: str) -> None:
        """A request that does not prove who wrote it: never acted on; logged, counted, recorded."""
        self.refused[reason] = self.refused.get(reason, 0) + 1
        why = signed.refusal_message(reason, f"control request {self.path}:{lineno}")
        if reason == signed.NO_KEY:
            why += f" ({self.key_where})"
        fields = {"line": lineno, "id": str(request.get("id")), "action": str(request.get("action")),
                  "reason": reason, "by": str(request.get("by") or ""), "key_id": request.get(signed.KEY_ID),
                  "refused_total": sum(self.refused.values()), "why": why}
        self._warn("control request refused: not acted on", **fields)
        if self.on_event is not None:
            self.on_event(event_types.CONTROL_REFUSED, **fields)

    def request_at(self, lineno: int) -> dict:
        """The request on line `lineno` (1-based): how ranks other than 0 learn the id to acknowledge. Rank 0
        answers with the signed request it checked; another rank checks the line it reads (the action itself
        is rank 0's, through the all-reduce): a line changed since is named, never trusted for its ids."""
        if lineno in self.verified:
            return self.verified[lineno]
        try:
            request = self.requests.at(lineno)
        except (OSError, ValueError, LookupError):    # gone or garbage since: rank 0's action stands regardless
            request = None
        reason = rundir.check_request(self.key, request, self.run_dir)
        if reason is None:
            return request
        self._warn("control request changed since rank 0 checked it", where=f"{self.path}:{lineno}", reason=reason)
        return {"id": f"line-{lineno}", "alertname": "", "reason": f"line {lineno} refused: {reason}"}

    def ack(self, request: dict, step: int) -> None:
        """Remember that the request was handled (rank 0), so a restart does not handle it again."""
        if self.rank != 0:
            return
        self.acked.add(str(request["id"]))
        rundir.append_ack(self.run_dir, str(request["id"]), request["action"], step, self.key)

    def _warn(self, message: str, **fields) -> None:
        if self.log is not None:
            self.log.warning(message, **fields)


def write_rank_file(run_dir: str | os.PathLike, rank: int, **extra) -> Path:
    """``RUN/control/ranks/rank-<r>.json``: this rank's registration (atomic replace).

    What the agent's `restore` needs to prove the process is this rank before it ends it (agent/restore.py
    `prove_rank`; every field is described in docs/agent.md): pid, host, uid, the process's start time as
    psutil sees it (``create_time``, compared to the clock tick), its launcher (``launcher_pid``,
    ``launcher_create_time``) and how many restarts that launcher has left (from the elastic agent's
    ``TORCHELASTIC_MAX_RESTARTS`` and ``TORCHELASTIC_RESTART_COUNT``; 0 when no launcher restarts it).
    Any training loop registers by calling this (or writing the same JSON) once per process start.
    """
    info = {"rank": rank, "pid": os.getpid(), "host": node_name(), "started_at": time.time(),
            **process_identity(), **restarts_of_launcher(), **extra}
    return rundir.write_rank_file(run_dir, rank, info)


def process_identity() -> dict:
    """This process's uid and start time, and its launcher's (its parent under torchrun), as psutil reads
    them. A rank forked by its supervisor (runtime/resilience/standby.py: the process torchrun started)
    names the supervisor's parent as its launcher, and the supervisor as `supervisor_pid`."""
    import psutil

    from trainguard.runtime.resilience.standby import SUPERVISOR_ENV

    me = psutil.Process()
    identity = {"uid": os.getuid(), "create_time": me.create_time()}
    try:
        parent = psutil.Process(os.getppid())
        if os.environ.get(SUPERVISOR_ENV) == str(parent.pid):
            identity.update(supervisor_pid=parent.pid, supervisor_create_time=parent.create_time())
            parent = parent.parent()
        if parent is not None:
            identity.update(launcher_pid=parent.pid, launcher_create_time=parent.create_time())
    except psutil.Error:
        pass
    # the boot time psutil added to those start times (the kernel's btime: the wall clock less the uptime): the
    # agent compares start times since boot, so a wall clock stepped since (NTP, a VM's resume) does not
    # make this process look like another with a reused pid (agent/procfs.py `registered_start`)
    identity["boot_time"] = psutil.boot_time()
    return identity


def restarts_of_launcher(environ=os.environ) -> dict:
    """``max_restarts`` and ``restarts_left`` of the elastic launcher that started this process (0 without one)."""
    try:
        allowed = int(environ.get("TORCHELASTIC_MAX_RESTARTS", 0))
        used = int(environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    except ValueError:
        allowed, used = 0, 0
    if "TORCHELASTIC_RUN_ID" not in environ:
        allowed = used = 0
    return {"max_restarts": allowed, "restarts_left": max(0, allowed - used)}
