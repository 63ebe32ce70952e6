"""An agent's request that the job's ranks recover in-process, and the rank's side of it.

    RUN/control/recovery/<id>.json             {"id", "run", "by", "issued_at", "reason", "culprit_rank",
                                                "key_id", "signature"}
    RUN/control/recovery/<id>.rank-<r>.ack     {"request", "rank", "at"}: rank r's watcher took the request

The agent (agent/recover_in_process.py), on a `restore` (a hang whose culprit's node is not evicted, or an
Alertmanager restore) under `recovery.mode: in_process`, writes the request instead of ending the ranks:
signed with the run's checkpoint key (trainguard/signed.py, purpose ``recovery-request/1``), bound to the
run's name and to its own file name. Every rank's watcher thread (inprocess.py) reads the directory every
`REQUEST_SECONDS`. A request that checks, was issued after this process began to watch and after its last
in-process recovery, is taken: the watcher acknowledges it (the ack file, a `recovery_request` event), writes
the job's fault key in the store as a failing rank would, and aborts the group, which releases every rank
blocked in a collective. A request that does not check (unsigned, signed with another key, changed since,
copied under another name, not JSON) is refused loudly: an error in the log and a `recovery_request_refused`
event, once per file; no rank acts on it.

A rank stuck outside any collective (a deadlock in Python, the `hang` fault's endless sleep) is not
released by an abort: its watcher interrupts the main thread (`MainThreadInterrupt`: a signal to the main
thread whose handler raises `RecoveryInterrupted`, an exception the training loop recovers like any other).
A rank stuck where Python never runs again (inside a C call that does not return) does not arrive: the
barrier's bound (`recovery.barrier_seconds`) fails the recovery, and the agent ends the ranks as before.

No torch here: the agent imports this module.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

from trainguard import event_types, rundir, safe_read, signed

PURPOSE = "recovery-request/1"
REQUEST_SECONDS = 0.5         # how often a rank's watcher reads the request directory
INTERRUPT_SECONDS = 1.0       # a main thread not in the recovery this long after the abort is interrupted
INTERRUPT_SIGNAL = signal.SIGUSR2
MAX_FILES = 256               # request files a rank looks at per read (older ones are long served)
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@-]{0,150}")
_ACK = ".rank-"


class RecoveryInterrupted(Exception):
    """Raised in a rank's main thread, stuck outside any collective, so that it joins an in-process recovery."""


# ------------------------------------------------------------------------------------------ the files

def check_id(request_id: str) -> str:
    if not _ID.fullmatch(request_id) or request_id.endswith(".json") or _ACK in request_id:
        raise ValueError(f"not a recovery request id: {request_id!r}")
    return request_id


def request_path(run_dir: rundir.PathLike, request_id: str) -> Path:
    return rundir.recovery_requests_dir(run_dir) / f"{check_id(request_id)}.json"


def ack_path(run_dir: rundir.PathLike, request_id: str, rank: int) -> Path:
    return rundir.recovery_requests_dir(run_dir) / f"{check_id(request_id)}{_ACK}{int(rank)}.ack"


def sign(key: bytes, run_dir: rundir.PathLike, request_id: str, *, by: str, reason: str = "",
         culprit_rank: int | None = None, issued_at: float | None = None, key_id: str | None = None) -> dict:
    """The request, signed with the run's key and bound to this run's name and to `request_id`."""
    record = {"id": check_id(request_id), "run": rundir.run_name(run_dir), "by": by, "reason": reason[:500],
              "culprit_rank": culprit_rank, "issued_at": time.time() if issued_at is None else issued_at}
    return signed.sign(key, PURPOSE, record, key_id=key_id)


def check(key: bytes | None, record: Any, run_dir: rundir.PathLike, request_id: str) -> str | None:
    """None when `record` is a request signed with `key` for this run under the name `request_id`; else
    why not (trainguard/signed.py's reasons)."""
    return signed.check(key, PURPOSE, record, {"run": rundir.run_name(run_dir), "id": request_id})


def write(run_dir: rundir.PathLike, record: dict) -> bool:
    """Write the signed request under its id, whole or not at all; False when one of that id is there
    already (another node's agent asked first: both wait for the same recovery)."""
    path = request_path(run_dir, record["id"])
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.urandom(8).hex()}.tmp")
    with os.fdopen(_create(temporary), "w") as handle:
        json.dump(record, handle, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    try:
        os.link(temporary, path)       # exclusive and atomic: a reader never sees half a request
        return True
    except FileExistsError:
        return False
    finally:
        os.unlink(temporary)


def read(run_dir: rundir.PathLike, request_id: str) -> Any:
    """The request file's JSON (bounded, a regular file only); raises OSError or ValueError."""
    return safe_read.read_json(request_path(run_dir, request_id), safe_read.CONTROL_BYTES, "recovery request")


def acknowledge(run_dir: rundir.PathLike, request_id: str, rank: int, at: float) -> None:
    """Rank `rank` took the request (one ack per rank and request; one already there stands)."""
    try:
        fd = _create(ack_path(run_dir, request_id, rank))
    except FileExistsError:
        return
    with os.fdopen(fd, "w") as handle:
        handle.write(json.dumps({"request": request_id, "rank": rank, "at": at}))


def _create(path: Path) -> int:
    """A new file, never through a link planted under a predictable name (raises FileExistsError)."""
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)


def acknowledged(run_dir: rundir.PathLike, request_id: str) -> set[int]:
    """The ranks whose watcher took the request (an ack proves nothing to anyone: the agent only waits
    longer for the ranks' own `in_process_restart` records when they are there)."""
    prefix = f"{check_id(request_id)}{_ACK}"
    try:
        names = os.listdir(rundir.recovery_requests_dir(run_dir))
    except OSError:
        return set()
    return {int(name[len(prefix):-4]) for name in names
            if name.startswith(prefix) and name.endswith(".ack") and name[len(prefix):-4].isdigit()}


# ------------------------------------------------------------------------------------- the rank's side

class RequestWatch:
    """A rank's reader of the agent's requests (called from its watcher thread, every `REQUEST_SECONDS`)."""

    def __init__(self, run_dir: rundir.PathLike, key: bytes | None, rank: int, *, log: Any,
                 emit: Callable[..., Any] | None = None, clock: Callable[[], float] = time.time,
                 monotonic: Callable[[], float] = time.monotonic):
        self.run_dir, self.key, self.rank, self.log, self.emit = Path(run_dir), key, rank, log, emit
        self.clock, self.monotonic = clock, monotonic
        self.since = clock()            # a request issued before this process watched is another attempt's
        self.decided: set[str] = set()  # file names taken, refused or found stale: never looked at again
        self._next = 0.0

    def poll(self) -> dict | None:
        """The newest request to act on now, taken (acknowledged); None when there is none or it is not
        time to read yet. Never raises: a directory that cannot be read is tried again next time."""
        now = self.monotonic()
        if now < self._next:
            return None
        self._next = now + REQUEST_SECONDS
        try:
            names = sorted(name for name in os.listdir(rundir.recovery_requests_dir(self.run_dir))
                           if name.endswith(".json") and not name.startswith("."))[-MAX_FILES:]
        except OSError:
            return None
        fresh = []
        for name in names:
            if name in self.decided:
                continue
            record = self._checked(name)
            if record is None:
                continue
            if float(record.get("issued_at") or 0) < self.since:
                self.decided.add(name)  # served by an earlier recovery, or issued to an earlier attempt
                continue
            fresh.append((float(record["issued_at"]), name, record))
        if not fresh:
            return None
        self.decided.update(name for _, name, _ in fresh)   # the newest serves every older one
        _, _, taken = max(fresh, key=lambda found: found[:2])
        self._take(taken)
        return taken

    def settled(self) -> None:
        """After an in-process recovery: a request issued before it was done was served by it."""
        self.since = self.clock()

    def _checked(self, name: str) -> dict | None:
        request_id = name[:-len(".json")]
        try:
            record: Any = read(self.run_dir, request_id)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            return self._refuse(name, signed.UNREADABLE, str(exc))
        reason = check(self.key, record, self.run_dir, request_id)
        if reason is not None:
            return self._refuse(name, reason, signed.refusal_message(reason, f"recovery request {name}"))
        if not isinstance(record.get("issued_at"), (int, float)):
            return self._refuse(name, signed.UNREADABLE, "no issued_at")
        return record

    def _refuse(self, name: str, reason: str, why: str) -> None:
        self.decided.add(name)
        self.log.error("recovery request refused: no rank acts on it", file=name, reason=reason, why=why)
        self._emit(event_types.RECOVERY_REQUEST_REFUSED, file=name, reason=reason, why=why)
        return None

    def _take(self, record: dict) -> None:
        at = self.clock()
        try:
            acknowledge(self.run_dir, record["id"], self.rank, at)
        except OSError as exc:      # the agent then waits only for the recovery's record
            self.log.warning("cannot acknowledge the recovery request", request=record["id"], error=str(exc))
        self.log.warning("the agent asks for an in-process recovery", request=record["id"], by=record.get("by"),
                         reason=record.get("reason"), culprit_rank=record.get("culprit_rank"))
        self._emit(event_types.RECOVERY_REQUEST, request=record["id"], by=record.get("by"),
                   issued_at=record["issued_at"], culprit_rank=record.get("culprit_rank"),
                   reason=record.get("reason"))

    def _emit(self, kind: str, **fields: Any) -> None:
        if self.emit is None:
            return
        try:
            self.emit(kind, **fields)
        except Exception as exc:    # the log line above stands
            self.log.warning("cannot record the event", event=kind, error=str(exc))


class MainThreadInterrupt:
    """Interrupts the main thread of this process with `RecoveryInterrupted`, from another thread.

    The signal's handler raises only while armed (`interrupt` arms it), and not while the main thread is
    handling an exception already (it is on its way into the recovery, or in it): a stray signal, or one
    that arrives late, changes nothing. Python runs the handler between two bytecodes of the main thread;
    a sleep or a blocking read returns early for it (PEP 475)."""

    def __init__(self, signum: int = INTERRUPT_SIGNAL):
        self.signum = signum
        self.armed = False
        self.main = threading.main_thread().ident
        self.previous: Any = None         # the handler this one replaced (a loop's own use of the signal)

    @classmethod
    def install(cls, signum: int = INTERRUPT_SIGNAL) -> "MainThreadInterrupt | None":
        """The interrupt, its handler installed; None off the main thread (a handler can be set only there)."""
        if threading.current_thread() is not threading.main_thread():
            return None
        interrupt = cls(signum)
        interrupt.previous = signal.signal(signum, interrupt._handle)
        return interrupt

    def interrupt(self) -> None:
        self.armed = True
        signal.pthread_kill(self.main, self.signum)

    def disarm(self) -> None:
        self.armed = False

    def _handle(self, signum: int, frame: Any) -> None:
        if not self.armed:
            if callable(self.previous):   # not ours: the handler the loop had set before gets it
                self.previous(signum, frame)
            return
        if sys.exc_info()[1] is not None:
            return
        self.armed = False
        raise RecoveryInterrupted("interrupted by the recovery's watcher: this rank was stuck outside any "
                                  "collective while the job recovers in-process")
