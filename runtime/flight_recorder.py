"""torch's Flight Recorder on every rank, and a side thread that dumps it on the agent's request.

When a stall is decided the agent asks every local rank for its Flight Recorder trace before anything
is ended (agent/evidence.py). A hung rank's main thread is blocked (in a collective, or wherever it
stopped), so the answer comes from a daemon thread of its own: it watches ``RUN/control/dump/`` (one
``os.stat`` every POLL_SECONDS) and, for each request it has not answered, writes
``RUN/incidents/<id>/rank-<r>.fr.json`` with ``torch._C._distributed_c10d._dump_fr_trace_json``. The
dump does not need the GIL-holding main thread and works for gloo on CPU as for NCCL on GPU.

    RUN/control/dump/<incident id>.json     {"incident": ID, "requested_at": ...}   (the agent's)

Recording must be on before the process group is made: ``enable()`` sets ``TORCH_FR_BUFFER_SIZE`` (torch
2.13's name for NCCL's old ``TORCH_NCCL_TRACE_BUFFER_SIZE`` too) and ``TORCH_NCCL_DUMP_ON_TIMEOUT``
unless the user already has.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from trainguard import incidents, rundir

BUFFER_ENTRIES = 2000          # collectives kept per rank; a few hundred bytes each
POLL_SECONDS = 0.5
REQUEST_MAX_AGE_SECONDS = 600  # an old request left behind is not answered by a later attempt


def enable() -> None:
    """Turn recording on for process groups created from now on (this process and its children)."""
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(BUFFER_ENTRIES))
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")


requests_dir = rundir.dump_dir


def request_dump(run_dir: str | os.PathLike, incident_id: str) -> Path:
    """Ask every rank of the run for its trace into `incident_id` (the agent's side; atomic)."""
    directory = requests_dir(run_dir)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{incidents.check_id(incident_id)}.json"
    tmp = directory / f".{incident_id}.{os.getpid()}.{threading.get_ident()}.tmp"   # one per thread too
    tmp.write_text(json.dumps({"incident": incident_id, "requested_at": time.time()}))
    os.replace(tmp, path)
    return path


def dump() -> bytes:
    """This rank's Flight Recorder trace as JSON bytes (empty entries when recording is off)."""
    from torch._C._distributed_c10d import _dump_fr_trace_json

    return _dump_fr_trace_json(includeCollectives=True)


class DumpServer:
    """The side thread: answers each dump request once, whatever the main thread is doing."""

    def __init__(self, run_dir: str | os.PathLike, rank: int, log=None):
        self.run_dir, self.rank, self.log = Path(run_dir), rank, log
        self.directory = requests_dir(run_dir)
        self.started_at = time.time()
        self.answered: set[str] = set()
        self._mtime: int | None = None
        self._stop = threading.Event()

    def start(self) -> "DumpServer":
        threading.Thread(target=self._loop, name="flight-recorder-dump", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _loop(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            try:
                self.poll()
            except Exception as exc:          # a bad request must not end the thread (nor the rank)
                if self.log is not None:
                    self.log.warning("flight recorder dump failed", error=f"{type(exc).__name__}: {exc}")

    def poll(self) -> list[str]:
        """Answer the requests not answered yet; returns their incident ids."""
        try:
            mtime = os.stat(self.directory).st_mtime_ns
        except FileNotFoundError:
            return []
        if mtime == self._mtime:
            return []
        self._mtime = mtime
        done = []
        for path in sorted(self.directory.glob("*.json")):
            incident_id = path.stem
            if incident_id in self.answered or not self._fresh(path):
                continue
            self.answered.add(incident_id)
            target = incidents.incidents_dir(self.run_dir) / incident_id / f"rank-{self.rank}.fr.json"
            if target.exists():         # answered by this rank's earlier attempt: that is the evidence
                continue
            incidents.write_file(self.run_dir, incident_id, target.name, dump())
            done.append(incident_id)
        return done

    def _fresh(self, path: Path) -> bool:
        """A request made while this process ran: a rank started after it (a restarted attempt) was not
        part of the stall, and its trace would only hide the evidence."""
        try:
            mtime = path.stat().st_mtime
        except FileNotFoundError:
            return False
        return mtime >= self.started_at and time.time() - mtime < REQUEST_MAX_AGE_SECONDS


def start(run_dir: str | os.PathLike, rank: int, log=None) -> DumpServer:
    return DumpServer(run_dir, rank, log).start()
