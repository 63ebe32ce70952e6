"""Hot spares in the run directory: the places they may take, their claims, and their signed adverts.

A hot spare (trainer/spare.py) waits outside the job's rendezvous and takes the place of a node of the job
whose cordon is honoured (a *vacancy*), claiming it once (``RUN/control/spares/<node>.<tag>.json``). While
it waits it also says so, so that the agent's eviction verdict (trainguard/decide/culprit.py) knows that a
node it keeps out will be replaced and the world size stays whole:

    RUN/control/spares-waiting/<host>.json
        {"host", "run", "pid", "waiting_since", "heartbeat_at", "key_id", "signature"}

**An advert can make an agent evict, so it proves itself.** Believing a forged "a spare waits" would let
whoever can write the run directory shrink a ``--nnodes 2:2`` job to one node, which then waits in the
rendezvous for ever. So an advert is signed (trainguard/signed.py, purpose ``spare-advert/1``) with the
run's checkpoint key, the key that signs cordons and that the spare already holds to check them, and is
refused (`Advert.refused`) unless it is

- signed with the reader's key, bound to its file name's host and to the run directory's name (a copy
  under another host's name, or a live advert of another run that has the same key and another directory
  name, is refused: ``not_bound``);
- fresh: its ``heartbeat_at`` is rewritten every ``REFRESH_SECONDS`` while the spare waits and is refused
  ``STALE_SECONDS`` after (a spare that died, or an old copy put back, counts for nothing; the bound is on
  the two nodes' clocks, as a cordon's expiry is);
- of a spare still waiting: not itself cordoned (honoured) and not the spare of a claim (it joined).

The spare withdraws its advert when it joins, is cordoned, or exits; one killed outright goes stale.
`available` is what the agent counts: the waiting spares, less the vacancies they would fill first.

No clock of its own (callers pass `now`), no torch; files only through trainguard/safe_read.py.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard import cordon, rundir, safe_read, signed

PURPOSE = "spare-advert/1"
REFRESH_SECONDS = 2.0                  # a waiting spare rewrites its advert this often
STALE_SECONDS = 3 * REFRESH_SECONDS    # ... and an advert not rewritten for this long counts for nothing

# Why an advert is refused besides trainguard/signed.py's reasons.
STALE = "stale"            # not refreshed for STALE_SECONDS (or from further ahead than that: a clock)
CORDONED = "cordoned"      # the spare itself is cordoned: it never joins
CLAIMED = "claimed"        # the spare claimed a place: it is joining, not waiting
REASONS = (*signed.REASONS, STALE, CORDONED, CLAIMED)


# --------------------------------------------------------------------------------- the vacancies

@dataclass(frozen=True)
class Vacancy:
    """A node of the job with an honoured cordon: the place a spare takes."""
    node: str
    cordon_id: str
    reason: str
    cordoned_at: float


def job_nodes(run_dir: Path, me: str | None = None) -> set[str]:
    """The nodes that joined the job (their launcher files), other than `me`."""
    out = set()
    for path in sorted(rundir.launchers_dir(run_dir).glob("*.json")):
        try:
            data = safe_read.read_json(path, safe_read.CONTROL_BYTES, "launcher file")
            host = str(data["host"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if host != me:
            out.add(host)
    return out


def claim_path(run_dir: Path, vacancy: Vacancy) -> Path:
    """One claim per cordon (its id hashed: a round-2 id holds a signature's characters)."""
    tag = hashlib.sha256(vacancy.cordon_id.encode()).hexdigest()[:16]
    return rundir.spare_claims_dir(run_dir) / f"{cordon.check_host(vacancy.node)}.{tag}.json"


def vacancies(run_dir: Path, me: str | None, checker: cordon.CordonKey) -> list[Vacancy]:
    """Honoured cordons of the job's nodes that no spare has claimed, the oldest first."""
    nodes = job_nodes(run_dir, me)
    out = []
    for host, found in cordon.read_all(run_dir, checker).items():
        if host not in nodes or not found.honoured:
            continue
        at = found.record.get("cordoned_at")
        vacancy = Vacancy(host, found.ident, str(found.record.get("reason") or ""),
                          float(at) if isinstance(at, (int, float)) else 0.0)
        if not claim_path(run_dir, vacancy).exists():
            out.append(vacancy)
    return sorted(out, key=lambda v: (v.cordoned_at, v.node))


def claimants(run_dir: Path) -> set[str]:
    """The spares named by a claim. Claims are not signed: one only takes a spare out of the count."""
    out = set()
    for path in sorted(rundir.spare_claims_dir(run_dir).glob("*.json")):
        try:
            out.add(str(safe_read.read_json(path, safe_read.CONTROL_BYTES, "spare claim")["spare"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return out


# ----------------------------------------------------------------------------------- the adverts

def run_name(run_dir: Path) -> str:
    """What binds an advert to its run: the run directory's name (the same on every node, whatever the
    mount point: a spare and an agent in different containers may see RUN under different parents)."""
    return Path(os.path.abspath(run_dir)).name


def advertise(run_dir: Path, host: str, key: bytes, *, now: float, waiting_since: float,
              key_id: str | None = None) -> Path:
    """Write (atomic) this spare's signed advert with a heartbeat of `now`."""
    path = rundir.spare_advert_path(run_dir, cordon.check_host(host))
    record = signed.sign(key, PURPOSE, {"host": host, "run": run_name(run_dir), "pid": os.getpid(),
                                        "waiting_since": waiting_since, "heartbeat_at": now}, key_id=key_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{host}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, path)
    return path


def withdraw(run_dir: Path, host: str) -> bool:
    """Remove this spare's advert; False when there was none."""
    try:
        rundir.spare_advert_path(run_dir, cordon.check_host(host)).unlink()
        return True
    except FileNotFoundError:
        return False


@dataclass(frozen=True)
class Advert:
    host: str
    path: Path
    record: dict
    refused: str | None        # None: a spare that waits now, proven
    detail: str = ""

    @property
    def counted(self) -> bool:
        return self.refused is None

    def why_refused(self) -> str:
        assert self.refused is not None
        what = f"the spare advert {self.path}"
        if self.refused in (STALE, CORDONED, CLAIMED):
            return f"{what}: {self.detail}"
        return signed.refusal_message(self.refused, what)


def read_adverts(run_dir: Path, checker: cordon.CordonKey | bytes | None, now: float) -> list[Advert]:
    """Every advert in the run directory, each checked (counted, or why not), by host."""
    checker = cordon.as_checker(checker)
    directory = rundir.spare_adverts_dir(run_dir)
    if not directory.is_dir():
        return []
    claimed = claimants(run_dir)
    out = []
    for path in sorted(directory.glob("*.json")):
        host = path.name[: -len(".json")]
        try:
            cordon.check_host(host)
        except ValueError:
            continue
        out.append(_check(run_dir, host, path, checker, claimed, now))
    return out


def _check(run_dir: Path, host: str, path: Path, checker: cordon.CordonKey, claimed: set[str],
           now: float) -> Advert:
    try:
        record: Any = safe_read.read_json(path, safe_read.CONTROL_BYTES, "spare advert")
    except (OSError, ValueError):
        return Advert(host, path, {}, signed.UNREADABLE)
    refused = signed.check(checker.key, PURPOSE, record, {"host": host, "run": run_name(run_dir)})
    if refused is not None:
        return Advert(host, path, record if isinstance(record, dict) else {}, refused)
    beat = record.get("heartbeat_at")
    if not isinstance(beat, (int, float)) or isinstance(beat, bool) or abs(now - beat) > STALE_SECONDS:
        age = f"{now - beat:.1f} s" if isinstance(beat, (int, float)) else "unknown"
        return Advert(host, path, record, STALE, f"its heartbeat is {age} old; a waiting spare refreshes it "
                                                 f"every {REFRESH_SECONDS:g} s (stale after {STALE_SECONDS:g} s)")
    own = cordon.read_one(run_dir, host, checker, now)
    if own is not None and own.honoured:
        return Advert(host, path, record, CORDONED, f"spare {host} is cordoned: it never joins")
    if host in claimed:
        return Advert(host, path, record, CLAIMED, f"spare {host} claimed a place: it is joining")
    return Advert(host, path, record, None)


def available(run_dir: Path, checker: cordon.CordonKey | bytes | None, job_hosts: set[str],
              now: float) -> tuple[int, list[Advert]]:
    """(spares waiting that a new vacancy would get, every advert checked). A counted spare that is a node
    of the job (it joined) is not waiting; and the vacancies no spare claimed yet (an honoured cordon of a
    node of the job) take the waiting spares first, the oldest first, as trainer/spare.py takes them."""
    checker = cordon.as_checker(checker)
    adverts = read_adverts(run_dir, checker, now)
    waiting = sum(1 for a in adverts if a.counted and a.host not in job_hosts)
    return max(0, waiting - len(vacancies(run_dir, None, checker))), adverts
