"""Hot spare nodes, and a cordoned node that leaves the job's rendezvous for good.

`trainguard train ... --nnodes MIN:MAX --spare` starts a node that does NOT enter the job's rendezvous
while the job has its nodes. It cannot: torch's elastic agent restarts its whole worker group whenever a
node waits in the rendezvous (``SimpleElasticAgent._invoke_run``: a HEALTHY group with
``rdzv_handler.num_nodes_waiting() > 0`` is restarted), so a spare waiting inside it would restart the job
every monitor interval while the job is below MAX nodes. (At MAX nodes torch >= 2.7 parks a late node in
the rendezvous's ``redundancy_list`` instead, which ``num_nodes_waiting`` does not count; that list takes
any node's place, for any reason, and holds no cordon; nothing here relies on it.)

So the spare waits in the run directory instead: every ``POLL_SECONDS`` it reads the job's launcher files
(``RUN/control/launchers/<node>.json``, the nodes that joined) and the cordons (``RUN/control/cordon/``),
each checked as the launcher checks its own (trainguard/cordon: signed with the run's checkpoint key, not
revoked, not expired). When a node of the job has an honoured cordon, the spare claims its place (one file
per cordon, created once: of two spares one takes it), writes its launcher file and a ``spare_joined`` event
(the node it replaces) and enters the rendezvous at once, so that the re-rendezvous that follows the
cordoned node's leaving forms the job with the spare in its place: the same number of nodes, the same world
size. While it waits, the spare also advertises itself (``RUN/control/spares-waiting/<node>.json``, signed
with the same key, its heartbeat rewritten every ``spares.REFRESH_SECONDS``; trainguard/spares.py), so that
the agent's verdict on a hang may keep the culprit's node out even of a job that cannot shrink: a spare
takes its place. It withdraws the advert when it joins, is cordoned or exits; a spare killed outright is
not counted once its heartbeat is stale. An unsigned, forged, revoked or expired cordon wakes no spare; a
spare that is itself cordoned exits as a cordoned node does (4); a spare whose job completed exits 0
without joining.

The other half, for every node of a multi-node job: the launcher's rendezvous is torch's c10d one behind
``GuardedRendezvous``, which checks this node's cordon before each (re-)rendezvous and, when it is
honoured, leaves the rendezvous (its exit operation, so the others need not wait out its keep-alive) and
ends the launcher (EXIT_CORDONED). Without it a drained node's launcher, which restarts its workers like
every other node's as soon as they stop, would rejoin the next round before its agent ended it.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from trainguard import cordon, event_types, log, rundir, safe_read, spares, tls
from trainguard.runtime.checkpoint import keys
# The vacancies live in the core (trainguard/spares.py): the agent's eviction verdict reads them too.
from trainguard.spares import Vacancy, claim_path, job_nodes, vacancies  # noqa: F401  (this module's API)

POLL_SECONDS = 0.5            # a spare reads the run directory this often; the cordon -> join delay
BACKEND = "trainguard-c10d"   # torch's c10d rendezvous behind GuardedRendezvous (registered once per process)
TAIL_BYTES = 64 << 10         # of rank 0's log, read for the job's completion


class Cordoned(RuntimeError):
    """This node is cordoned (honoured): it does not enter the rendezvous again."""


def claim(run_dir: Path, vacancy: Vacancy, me: str) -> bool:
    """Take `vacancy` for this node; False when another spare took it first."""
    body = json.dumps({"spare": me, "replaces": vacancy.node, "cordon_id": vacancy.cordon_id,
                       "claimed_at": time.time()}).encode()
    return rundir.create_whole(claim_path(run_dir, vacancy), body, 0o644)


def job_completed(run_dir: Path, since: float) -> bool:
    """Rank 0's log ends the run as completed after `since` (a spare then has nothing left to join)."""
    path = rundir.rank_log(run_dir, 0)
    try:
        size = path.stat().st_size
        with safe_read.open_file(path, what="log file") as handle:
            handle.seek(max(0, size - TAIL_BYTES))
            tail = handle.read(TAIL_BYTES)
    except OSError:
        return False
    for line in reversed(tail.splitlines()[1:] if size > TAIL_BYTES else tail.splitlines()):
        try:
            record = tls.decode(line)
        except tls.TLSError:
            continue
        event = record.get("event") if isinstance(record, dict) else None
        if isinstance(event, dict) and event.get("type") == event_types.RUN_END:
            stamp = record.get("timestamp")
            return (event.get("reason") == "completed" and isinstance(stamp, (int, float))
                    and stamp >= since)
    return False


@dataclass(frozen=True)
class Outcome:
    vacancy: Vacancy | None = None       # join in its place
    cordoned: bool = False               # this spare is cordoned: it never joins
    completed: bool = False              # the job completed while the spare waited
    waited_seconds: float = 0.0


def wait_for_vacancy(run_dir: Path, me: str, checker: Callable[[], cordon.CordonKey], *,
                     poll_seconds: float = POLL_SECONDS, clock: Callable[[], float] = time.time,
                     sleep: Callable[[float], None] = time.sleep) -> Outcome:
    """Wait, outside the rendezvous, until a node of the job is cordoned (honoured) and this spare claims
    its place; or this spare is cordoned; or the job completed. `checker` is read again at every poll:
    a revocation or a new key takes effect without a restart."""
    began = clock()
    advert = Advertiser(run_dir, me, began)
    try:
        while True:
            key = checker()
            own = cordon.read_one(run_dir, me, key)
            if own is not None and own.honoured:
                return Outcome(cordoned=True, waited_seconds=clock() - began)
            for vacancy in vacancies(run_dir, me, key):
                if claim(run_dir, vacancy, me):
                    return Outcome(vacancy=vacancy, waited_seconds=clock() - began)
            if job_completed(run_dir, began):
                return Outcome(completed=True, waited_seconds=clock() - began)
            advert.refresh(key, clock())
            sleep(poll_seconds)
    finally:
        advert.withdraw()      # joining, cordoned, done, or ended: no longer a spare the verdict may count


class Advertiser:
    """This spare's signed advert (trainguard/spares.py), rewritten every ``spares.REFRESH_SECONDS`` while it
    waits, so that the agent's eviction verdict counts it (a hung node of a 2:2 job can be kept out: the
    spare takes its place). Without a key it cannot sign one: it says so once and waits unadvertised."""

    def __init__(self, run_dir: Path, me: str, began: float) -> None:
        self.run_dir, self.me, self.began = run_dir, me, began
        self.written_at: float | None = None
        self.said: str | None = None       # the last problem logged (each is said once, not every poll)

    def refresh(self, key: cordon.CordonKey, now: float) -> None:
        if self.written_at is not None and now - self.written_at < spares.REFRESH_SECONDS:
            return
        if key.key is None:
            self._say(f"no checkpoint key to sign it with ({key.where})")
            return
        try:
            spares.advertise(self.run_dir, self.me, key.key, now=now, waiting_since=self.began,
                             key_id=keys.key_id(key.key))
            self.written_at, self.said = now, None
        except OSError as exc:        # a full disk, a read-only run directory: it waits unadvertised
            self._say(str(exc))

    def _say(self, problem: str) -> None:
        if self.said != problem:
            self.said = problem
            log.get("launch").warning("spare: cannot advertise that it waits; an eviction verdict will not "
                                      "count it", host=self.me, error=problem)

    def withdraw(self) -> None:
        if self.written_at is None:
            return
        try:
            spares.withdraw(self.run_dir, self.me)
        except OSError as exc:     # it goes stale within spares.STALE_SECONDS anyway
            log.get("launch").warning("spare: could not withdraw its advert", host=self.me, error=str(exc))


def record_joined(run_dir: Path, me: str, outcome: Outcome) -> Path:
    """The ``spare_joined`` event in this node's launcher log (a node log: `status` and `replay` read it)."""
    vacancy = outcome.vacancy
    assert vacancy is not None
    record = {**tls.event(event_types.SPARE_JOINED, host=me, replaces=vacancy.node, cordon_id=vacancy.cordon_id,
                          cordon_reason=vacancy.reason, cordoned_at=vacancy.cordoned_at,
                          waited_seconds=round(outcome.waited_seconds, 3),
                          after_cordon_seconds=round(max(0.0, time.time() - vacancy.cordoned_at), 3)),
              "node": me}
    path = rundir.append_launcher_log(run_dir, me, tls.encode(record))
    log.get("launch").warning("spare joins the job", host=me, replaces=vacancy.node, cordon_reason=vacancy.reason,
                              waited_seconds=round(outcome.waited_seconds, 3))
    return path


# ------------------------------------------------------------------ the cordon check at each rendezvous

def guarded_rendezvous_backend(is_cordoned: Callable[[], bool]) -> str:
    """Register (once) and return the rendezvous backend whose handler checks `is_cordoned` before each round."""
    from torch.distributed.elastic.rendezvous import registry

    _GUARD["is_cordoned"] = is_cordoned
    if not _GUARD.get("registered"):
        registry.handler_registry.register(BACKEND, _create_guarded)
        _GUARD["registered"] = True
    return BACKEND


_GUARD: dict = {}


def _create_guarded(params):
    import copy

    from torch.distributed.elastic.rendezvous import registry

    plain = copy.copy(params)
    plain.backend = "c10d"
    handler = _GUARD["handler"] = make_guarded(registry.get_rendezvous_handler(plain), _GUARD["is_cordoned"])
    return handler


def leave_rendezvous() -> None:
    """The launcher was ended (SIGTERM) while cordoned: leave the rendezvous it was in, if any."""
    handler = _GUARD.get("handler")
    if handler is not None and not handler.left:
        handler.leave()


def make_guarded(inner, is_cordoned: Callable[[], bool]):
    """`inner` (torch's c10d handler) behind the cordon check; a class made here: torch is imported late."""
    from torch.distributed.elastic.rendezvous import RendezvousHandler

    class GuardedRendezvous(RendezvousHandler):
        """torch's handler, and before each round this node's cordon: honoured -> leave, raise Cordoned."""

        def __init__(self) -> None:
            self.inner, self.left = inner, False

        def get_backend(self) -> str:
            return BACKEND

        @property
        def use_agent_store(self) -> bool:
            return self.inner.use_agent_store

        def next_rendezvous(self):
            if is_cordoned():
                self.leave()
                raise Cordoned("this node is cordoned: it does not enter the rendezvous again")
            return self.inner.next_rendezvous()

        def leave(self) -> None:
            """Out of the participants now (torch's exit operation), without closing the job's rendezvous:
            the other nodes' next round need not wait for this node's keep-alive to lapse."""
            self.left = True
            stop = getattr(self.inner, "_stop_heartbeats", None)
            if stop is not None:
                stop()
            try:
                from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousExitOp

                self.inner._op_executor.run(_RendezvousExitOp(), time.monotonic() + 10.0)
            except Exception as exc:    # torch's internals moved, or the store is gone: the keep-alive lapses
                log.get("launch").warning("could not leave the rendezvous; the others wait for its keep-alive",
                                          error=f"{type(exc).__name__}: {exc}")

        def is_closed(self) -> bool:
            return self.inner.is_closed()

        def set_closed(self):
            return self.inner.set_closed()

        def num_nodes_waiting(self) -> int:
            return self.inner.num_nodes_waiting()

        def get_run_id(self) -> str:
            return self.inner.get_run_id()

        def shutdown(self) -> bool:
            # A cordoned node's leaving must not close the job's rendezvous (torch closes it for good when
            # a launcher ends on an exception): the others re-form without it.
            return True if self.left else self.inner.shutdown()

    return GuardedRendezvous()


class CordonWatch:
    """While the launcher runs, this node's cordon every `poll_seconds`: once it is honoured the launcher
    ends itself (`on_cordon`, SIGTERM to itself: torch's agent stops the workers), so a cordon a drain
    wrote while this node was already in the next round still keeps it out."""

    def __init__(self, is_cordoned: Callable[[], bool], on_cordon: Callable[[], None],
                 poll_seconds: float = POLL_SECONDS) -> None:
        self.is_cordoned, self.on_cordon, self.poll_seconds = is_cordoned, on_cordon, poll_seconds
        self.fired = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="launcher-cordon-watch", daemon=True)

    def start(self) -> "CordonWatch":
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            try:
                if self.is_cordoned():
                    self.fired = True
                    self.on_cordon()
                    return
            except Exception as exc:   # a read that failed is not a cordon; say so and look again
                log.get("launch").warning("cordon check failed", error=f"{type(exc).__name__}: {exc}")

    def stop(self) -> None:
        self._stop.set()
