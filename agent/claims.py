"""Which agent of the job carries out a job-level action: a claim in the run directory that proves itself.

A job-level alert (ledger.job_level) reaches every agent of the job; one must act. Each claims it in
``RUN/control/claims/`` with O_EXCL (atomic on local filesystems and NFSv3+): the creator acts, the others
record ``claimed``. A claim is a signed record (trainguard/signed.py, purpose ``claim/1``) with the secret
every agent behind the job's Alertmanager route already shares, the webhook token, and bound to its
request id and generation:

    RUN/control/claims/<request id>                          generation 0
    RUN/control/claims/<request id>.takeover-<g>-<tag>       generation g >= 1 (tag: HMAC of the token)

    {"request_id", "generation", "node", "claimed_at", ["done_at"], "signature"}

- **A forged claim is ignored.** One that is not signed with the token, or was signed for another request
  or generation (copied), is no claim: it is logged once, counted (``trainguard_claims_refused_total
  {reason}``) and the agents go on to the next generation, whose name a stranger cannot compute ahead of
  time. So someone who can write the run directory, but does not hold the token, cannot stop the action.
- **A claimant at work renews its claim; one that stops renewing is taken over, once.** While it acts,
  the claimant rewrites its claim every ``claim_timeout_seconds / 4`` with a higher ``renewals`` count
  (signed, so bound to request id + generation like the claim), and with ``done_at`` once the action is
  carried out. An agent that found another's claim looks again ``claim_timeout_seconds`` after it last saw
  the claim change, on its own clock (the claimant's may differ): neither done nor renewed meanwhile, the
  claimant is taken to have died and the agents race for the next generation's name with O_EXCL: exactly
  one takes over. A claimant merely slower than the timeout is never taken over.
- **An agent restarted after recording ``claimed``** watches that claim again (agent/executor.py
  ``recover``); one restarted after claiming finds its own claim (``mine``) and acts.

    {"request_id", "generation", "node", "pid", "started_at", "claimed_at", "renewals", "renewed_at",
     ["done_at"], [the caller's fields, e.g. "incident"], "signature"}

- **A claim names its claimant**: the host (``node``), the agent's pid and the agent process's start time,
  so an agent that finds its own host's claim knows whether an earlier life of it made it. The rule over
  a found claim (lead, follow, take over) is trainguard/decide/leader.py; a stall's incident is led the
  same way (agent/culprit.py), with the incident id among the claim's fields.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import psutil

from trainguard import rundir, safe_read, signed
from trainguard.decide import leader

PURPOSE = "claim/1"
DEFAULT_TIMEOUT_SECONDS = 60.0
MAX_GENERATIONS = 16      # forged or abandoned claims skipped per request before acting regardless
READ_ATTEMPTS = 20        # a claim created but not written yet (its creator between open and write)
RENEWALS_PER_TIMEOUT = 4  # a claimant at work rewrites its claim this often per timeout
# The record's own fields; any other signed field is the caller's (Claim.fields).
RECORD_FIELDS = frozenset({"request_id", "generation", "node", "pid", "started_at", "claimed_at", "renewals",
                           "renewed_at", "done_at", signed.SIGNATURE, signed.KEY_ID})


def this_agent(host: str) -> leader.Claimant:
    """This process as a claimant: its host, pid and start time (as psutil reads it; pids are reused)."""
    try:
        started = psutil.Process().create_time()
    except psutil.Error:
        started = None
    return leader.Claimant(host, os.getpid(), started)


@dataclass(frozen=True)
class Claim:
    node: str             # the agent that carries the action out
    generation: int
    claimed_at: float
    done: bool
    mine: bool            # this agent is that one (it made the claim now, or before a restart)
    renewals: int = 0     # how often its claimant renewed it while at work
    request_id: str = ""
    fields: dict = field(default_factory=dict, compare=False)   # the caller's (agent/culprit.py: "incident")
    restarted: bool = False   # mine, made by an earlier life of this host's agent


class Claims:
    def __init__(self, run_dir: str | os.PathLike, node: str, secret: bytes | None, *,
                 timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS, log: Any = None,
                 sleep: Callable[[float], None] = time.sleep):
        self.run_dir, self.node, self.secret = Path(run_dir), node, secret
        self.timeout = timeout_seconds
        self.log, self.sleep = log, sleep
        self.me = this_agent(node)
        self.refused: dict[str, int] = {reason: 0 for reason in signed.REASONS}
        self.taken_over = 0
        self._reported: set[tuple[str, str]] = set()     # (file, reason): each forged file logged once
        # (request id, generation) -> (renewals, when this agent saw that count first, its own clock)
        self._seen: dict[tuple[str, int], tuple[int, float]] = {}

    # ------------------------------------------------------------------------------------- names
    def path(self, request_id: str, generation: int) -> Path:
        if generation == 0:
            return rundir.claim_path(self.run_dir, request_id)
        assert self.secret is not None
        tag = signed.tag(self.secret, PURPOSE, f"{request_id}/{generation}")
        return rundir.takeover_claim_path(self.run_dir, request_id, generation, tag)

    # ------------------------------------------------------------------------------------- claim
    def take(self, request_id: str, now: float, fields: dict | None = None) -> Claim:
        """The claim that decides who acts on `request_id`, made by this agent where none stands (with the
        caller's `fields`, signed with it; a claim found carries its maker's).

        Standing: a valid claim that is done, or that its claimant renewed within the timeout as this
        agent saw it. A valid claim neither done nor renewed for the timeout, or any claim that does not
        prove itself, does not stand: the next generation is tried.
        """
        if self.secret is None:      # nothing to sign with: never let an unprovable file stop the action
            return Claim(self.node, 0, now, False, True, 0, request_id, dict(fields or {}))
        for generation in range(MAX_GENERATIONS):
            path = self.path(request_id, generation)
            if self._create(path, request_id, generation, now, fields or {}):
                if generation > 0:
                    self.taken_over += 1
                    self._say("warning", "took over a job-level action its claimant did not carry out",
                              id=request_id, generation=generation)
                return Claim(self.node, generation, now, False, True, 0, request_id, dict(fields or {}))
            record = self._read(path)
            reason = signed.check(self.secret, PURPOSE, record,
                                  {"request_id": request_id, "generation": generation})
            if reason is not None:
                self._refuse(path, reason)
                continue
            assert isinstance(record, dict)
            found = self._found(record, generation)
            rule = leader.standing(
                mine=found.mine, done=found.done,
                renewed=not (found.mine or found.done) and self._at_work(request_id, found, now),
                taken_over_since=found.mine and not found.done and self.path(request_id, generation + 1).exists())
            if rule == leader.NEXT:
                continue     # this agent's, from before a restart, and taken over since: the next one decides
            if rule in (leader.LEAD, leader.FOLLOW):
                if found.restarted and not found.done:
                    self._say("warning", "an earlier life of this agent made this claim: leading it again",
                              id=request_id, generation=generation, pid=record.get("pid"))
                return found
            self._say("warning", "a job-level action's claimant neither renewed nor finished it in time",
                      id=request_id, claimant=found.node, generation=generation, claimed_at=found.claimed_at,
                      renewals=found.renewals, timeout_seconds=self.timeout)
        self._say("error", "every claim of a job-level action was forged or abandoned; acting regardless",
                  id=request_id, generations=MAX_GENERATIONS)
        return Claim(self.node, MAX_GENERATIONS, now, False, True, 0, request_id)

    def hold(self, request_id: str, claim: Claim) -> "Hold":
        """This agent's claim, renewed while it acts (`Hold.done` when carried out, `Hold.stop` when not)."""
        return Hold(self, request_id, claim)

    def check_after(self, claim: Claim, now: float) -> float:
        """Seconds until another's claim, not done, may be taken over: the timeout after it last changed."""
        _, since = self._seen.get((claim.request_id, claim.generation), (claim.renewals, now))
        return max(0.0, since + self.timeout - now) + 0.05

    def _found(self, record: dict, generation: int) -> Claim:
        renewals = record.get("renewals")
        mine = record.get("node") == self.node
        pid, started = record.get("pid"), record.get("started_at")
        claimant = leader.Claimant(str(record.get("node")), pid if isinstance(pid, int) else None,
                                   float(started) if isinstance(started, (int, float)) else None)
        return Claim(str(record.get("node")), generation, float(record.get("claimed_at") or 0.0),
                     record.get("done_at") is not None, mine,
                     renewals if isinstance(renewals, int) and not isinstance(renewals, bool) else 0,
                     str(record.get("request_id")), {k: v for k, v in record.items() if k not in RECORD_FIELDS},
                     mine and leader.restarted(claimant, self.me))

    def _at_work(self, request_id: str, found: Claim, now: float) -> bool:
        """Its claimant renewed it within the timeout, as this agent saw it. A claim seen for the first time
        counts as renewed now: the claimant's clock is not this agent's, so only a change seen here tells."""
        key = (request_id, found.generation)
        seen = self._seen.get(key)
        if seen is None or seen[0] != found.renewals:
            self._seen[key] = (found.renewals, now)
            return True
        return leader.renewed_within(seen[1], now, self.timeout)

    def _rewrite(self, request_id: str, claim: Claim, **fields: Any) -> None:
        """Replace this agent's claim atomically (a reader sees the old record or the new, whole)."""
        path = self.path(request_id, claim.generation)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_bytes(self._body(request_id, claim.generation, claim.claimed_at, **{**claim.fields, **fields}))
        os.replace(tmp, path)

    # ---------------------------------------------------------------------------------- the files
    def _body(self, request_id: str, generation: int, claimed_at: float, **extra: Any) -> bytes:
        assert self.secret is not None
        record = signed.sign(self.secret, PURPOSE, {"request_id": request_id, "generation": generation,
                                                    "node": self.node, "claimed_at": claimed_at, "renewals": 0,
                                                    **extra, "pid": self.me.pid, "started_at": self.me.started_at})
        return json.dumps(record).encode()

    def _create(self, path: Path, request_id: str, generation: int, now: float, fields: dict) -> bool:
        # Whole or not at all: a claim another agent read half written would look forged to it, and it
        # would go on to the next generation and act too.
        return rundir.create_whole(path, self._body(request_id, generation, now, **fields), 0o644)

    def _read(self, path: Path) -> Any:
        for _ in range(READ_ATTEMPTS):
            try:
                return safe_read.read_json(path, safe_read.CONTROL_BYTES, "claim")
            except FileNotFoundError:
                return None
            except (OSError, ValueError):
                self.sleep(0.05)
        return None

    def _refuse(self, path: Path, reason: str) -> None:
        if (path.name, reason) in self._reported:
            return
        self._reported.add((path.name, reason))
        self.refused[reason] += 1
        self._say("error", "claim refused: it does not prove itself; the action goes on without it",
                  path=str(path), reason=reason, why=signed.refusal_message(reason, f"the claim {path.name}"))

    def _say(self, level: str, message: str, **fields: Any) -> None:
        if self.log is not None:
            getattr(self.log, level)(message, **fields)


class Hold:
    """This agent's claim while it acts: renewed every timeout / RENEWALS_PER_TIMEOUT on a thread of its
    own (the action may block: a slow disk, a lock held by the trainer), so the others see it at work;
    then marked done, or left (`stop`: the action failed; a retry, or another agent after the timeout,
    carries it out). Without a secret, or past the last generation, there is no claim to renew."""

    def __init__(self, claims: Claims, request_id: str, claim: Claim):
        self.claims, self.request_id, self.claim = claims, request_id, claim
        self.renewals = claim.renewals
        self._stopped = threading.Event()
        self._lock = threading.Lock()          # a renewal never lands after `done`
        self._active = claims.secret is not None and claim.mine and claim.generation < MAX_GENERATIONS
        if self._active:
            threading.Thread(target=self._renew, name=f"claim-renewal-{request_id}", daemon=True).start()

    def done(self, now: float) -> None:
        """Mark the claim done (nobody takes it over after this) and stop renewing it."""
        with self._lock:
            self._stopped.set()
            if self._active:
                self.claims._rewrite(self.request_id, self.claim, renewals=self.renewals, done_at=now)

    def stop(self) -> None:
        with self._lock:
            self._stopped.set()

    def _renew(self) -> None:
        while not self._stopped.wait(self.claims.timeout / RENEWALS_PER_TIMEOUT):
            with self._lock:
                if self._stopped.is_set():
                    return
                try:
                    self.claims._rewrite(self.request_id, self.claim, renewals=self.renewals + 1,
                                         renewed_at=time.time())
                    self.renewals += 1
                except OSError as exc:     # not renewed: after the timeout another agent takes over
                    self.claims._say("error", "could not renew a job-level claim", id=self.request_id,
                                     error=str(exc))
