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
- **A claimant that does not finish is taken over, once.** The claimant rewrites its claim with
  ``done_at`` once the action is carried out. An agent that found another's claim checks again when
  ``claim_timeout_seconds`` have passed since it was made; if it is still not done, the claimant is taken
  to have died and the agents race for the next generation's name with O_EXCL: exactly one takes over.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from trainguard import rundir, signed

PURPOSE = "claim/1"
DEFAULT_TIMEOUT_SECONDS = 60.0
MAX_GENERATIONS = 16      # forged or abandoned claims skipped per request before acting regardless
READ_ATTEMPTS = 20        # a claim created but not written yet (its creator between open and write)


@dataclass(frozen=True)
class Claim:
    node: str             # the agent that carries the action out
    generation: int
    claimed_at: float
    done: bool
    mine: bool            # this agent is that one (it made the claim now, or before a restart)


class Claims:
    def __init__(self, run_dir: str | os.PathLike, node: str, secret: bytes | None, *,
                 timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS, log: Any = None,
                 sleep: Callable[[float], None] = time.sleep):
        self.run_dir, self.node, self.secret = Path(run_dir), node, secret
        self.timeout = timeout_seconds
        self.log, self.sleep = log, sleep
        self.refused: dict[str, int] = {reason: 0 for reason in signed.REASONS}
        self.taken_over = 0
        self._reported: set[tuple[str, str]] = set()     # (file, reason): each forged file logged once

    # ------------------------------------------------------------------------------------- names
    def path(self, request_id: str, generation: int) -> Path:
        if generation == 0:
            return rundir.claim_path(self.run_dir, request_id)
        assert self.secret is not None
        tag = signed.tag(self.secret, PURPOSE, f"{request_id}/{generation}")
        return rundir.takeover_claim_path(self.run_dir, request_id, generation, tag)

    # ------------------------------------------------------------------------------------- claim
    def take(self, request_id: str, now: float) -> Claim:
        """The claim that decides who acts on `request_id`, made by this agent where none stands.

        Standing: a valid claim that is done, or whose claimant is still within the timeout. A valid claim
        past the timeout and not done, or any claim that does not prove itself, does not stand: the next
        generation is tried.
        """
        if self.secret is None:      # nothing to sign with: never let an unprovable file stop the action
            return Claim(self.node, 0, now, False, True)
        for generation in range(MAX_GENERATIONS):
            path = self.path(request_id, generation)
            if self._create(path, request_id, generation, now):
                if generation > 0:
                    self.taken_over += 1
                    self._say("warning", "took over a job-level action its claimant did not carry out",
                              id=request_id, generation=generation)
                return Claim(self.node, generation, now, False, True)
            record = self._read(path)
            reason = signed.check(self.secret, PURPOSE, record,
                                  {"request_id": request_id, "generation": generation})
            if reason is not None:
                self._refuse(path, reason)
                continue
            assert isinstance(record, dict)
            found = Claim(str(record.get("node")), generation, float(record.get("claimed_at") or 0.0),
                          record.get("done_at") is not None, record.get("node") == self.node)
            if found.mine or found.done or now - found.claimed_at < self.timeout:
                return found
            self._say("warning", "a job-level action's claimant did not record it done in time", id=request_id,
                      claimant=found.node, generation=generation, claimed_at=found.claimed_at,
                      timeout_seconds=self.timeout)
        self._say("error", "every claim of a job-level action was forged or abandoned; acting regardless",
                  id=request_id, generations=MAX_GENERATIONS)
        return Claim(self.node, MAX_GENERATIONS, now, False, True)

    def done(self, request_id: str, claim: Claim, now: float) -> None:
        """Mark this agent's claim done (atomic rewrite): nobody takes it over after this."""
        if self.secret is None or not claim.mine or claim.generation >= MAX_GENERATIONS:
            return
        path = self.path(request_id, claim.generation)
        body = self._body(request_id, claim.generation, claim.claimed_at, done_at=now)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_bytes(body)
        os.replace(tmp, path)

    def check_after(self, claim: Claim, now: float) -> float:
        """Seconds until another's claim, not done, may be taken over."""
        return max(0.0, claim.claimed_at + self.timeout - now) + 0.05

    # ---------------------------------------------------------------------------------- the files
    def _body(self, request_id: str, generation: int, claimed_at: float, **extra: Any) -> bytes:
        assert self.secret is not None
        record = signed.sign(self.secret, PURPOSE, {"request_id": request_id, "generation": generation,
                                                    "node": self.node, "claimed_at": claimed_at, **extra})
        return json.dumps(record).encode()

    def _create(self, path: Path, request_id: str, generation: int, now: float) -> bool:
        # Whole or not at all: a claim another agent read half written would look forged to it, and it
        # would go on to the next generation and act too.
        return rundir.create_whole(path, self._body(request_id, generation, now), 0o644)

    def _read(self, path: Path) -> Any:
        for _ in range(READ_ATTEMPTS):
            try:
                return json.loads(path.read_bytes()[:65536])
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
