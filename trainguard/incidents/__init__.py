"""``RUN/incidents/<id>/``: one incident's verdict and the evidence it was decided on.

The layout is a contract (docs/incidents.md)::

    RUN/incidents/<id>/incident.json     {"id", "kind", "detected_at", "detected_by",
                                          "culprit": {"rank", "node"} | null, "confidence",
                                          "reasons": [...], "action"}
    RUN/incidents/<id>/rank-<r>.stack.txt  a rank's Python stacks (py-spy)
    RUN/incidents/<id>/rank-<r>.fr.json    a rank's Flight Recorder dump
    RUN/incidents/<id>/node-<host>.json    the node's signals at that moment

Why it is written this way:

- The run directory is shared by every node, and each node adds its own evidence to the same incident,
  so every file is written on its own, atomically (a temporary name, fsync, rename): a reader sees a
  whole file or none, never half of one, and two nodes never write the same name.
- Evidence is bounded, and no bound is shared by the nodes (so none is used up by the first ones, and
  a write lists nothing: a thousand nodes write ~17,000 files into one incident). Each bound protects
  one thing:

  - ``MAX_FILE_BYTES`` per file (cut, saying so at the cut): the readers, which take a file whole into
    memory (the verdict, ``trainguard incidents``), from a stack dump of a thousand threads;
  - ``MAX_WRITER_BYTES`` per writer and incident (a node's agent, a rank's Flight Recorder dump), counted
    in the writer's memory (:class:`Budget`), refused past it: one runaway writer takes no more than
    what a whole incident could hold before, whatever the others wrote;
  - the filesystem's free space, asked of the OS on each write (``os.statvfs``): evidence that would
    leave less than ``MIN_FREE_BYTES`` (or ``MIN_FREE_FRACTION`` of the filesystem, the larger) free is
    refused, so evidence never fills the disk of the run it is meant to help (its checkpoints and
    logs), however many nodes, writers, incidents or agent restarts there are.
- Anyone who can write the run directory can write a file here, so a node's evidence is signed by the
  agent that gathered it (:func:`sign_node`): with a key of its host, derived from the run's checkpoint
  key, over the file's fields, bound to the incident and the host. The reader takes the host from the
  file's name and checks the signature with that host's key (:func:`check_node`): a file a stranger
  dropped, one changed since, one copied to another host's name or another incident's folder is not
  evidence — the verdict ignores it, names it and counts it. The signed file also holds the digest of
  every rank file the agent gathered (``files``): a stack or Flight Recorder file that is not the one
  it vouched for is not used either.
- Reading is strict: an
  ``incident.json`` that does not match the layout is an :class:`IncidentError` naming the file and
  the field, never a crash of ``trainguard incidents`` and never trusted by whoever acts on it.

Pure of torch; files only. The verdict itself is decided elsewhere (``trainguard.decide``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

from trainguard import rundir, safe_read, signed
from trainguard.exits import BadInput

KINDS = ("hang", "slow", "crash", "sdc")
MAX_FILE_BYTES = 4 * 2**20
MAX_WRITER_BYTES = 64 * 2**20      # one writer's share of one incident (it once was all of one incident)
MIN_FREE_BYTES = 2**30              # evidence leaves the run at least this much of its filesystem free,
MIN_FREE_FRACTION = 0.02            # or this share of it, the larger
BLOCK_BYTES = 4096                  # a file is charged at least a block: a writer's file count is bounded too
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_EVIDENCE = re.compile(r"^(rank-\d+\.(stack\.txt|fr\.json)|node-[A-Za-z0-9._-]{1,253}\.json|[a-z0-9_-]{1,64}\.(json|txt))$")
TRUNCATED = b"\n... [trainguard: cut at %d bytes]\n"


class IncidentError(BadInput):
    """An incident directory or file that does not match the layout; the message names file and field."""


@dataclass
class Incident:
    id: str
    kind: str
    detected_at: float
    detected_by: str
    culprit: dict | None = None           # {"rank": int | None, "node": str | None}
    confidence: float = 0.0
    reasons: list[str] = field(default_factory=list)
    action: str | None = None
    extra: dict = field(default_factory=dict)    # anything else a verdict records (kept, written flat)

    def to_json(self) -> dict:
        data = asdict(self)
        extra = data.pop("extra")
        return {**extra, **data}


def incidents_dir(run_dir: str | os.PathLike) -> Path:
    return rundir.incidents_dir(run_dir)


def new_id(kind: str, when: float | None = None) -> str:
    """``20261201T192300Z-hang-3fa2``: sorts by time, says what it is, unique across nodes."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(time.time() if when is None else when))
    return f"{stamp}-{kind}-{secrets.token_hex(2)}"


def check_id(incident_id: str) -> str:
    if not _ID.match(incident_id or ""):
        raise IncidentError(f"incident id {incident_id!r}: letters, digits, '.', '_' and '-' only")
    return incident_id


class Budget:
    """One writer's account of the evidence it wrote, per incident, kept in its own memory.

    A node's agent is one writer (its ranks' stacks, its signals), each rank is one (its Flight Recorder
    dump): a process has one (:func:`writer`). Counting here instead of listing the incident's folder
    keeps a write's cost flat however many nodes wrote beside it. A file written again under the same
    name is charged once (its new size). The newest `keep` incidents are remembered; a writer that comes
    back to an older one, or restarts, starts its account again (the free-space bound still holds).
    """

    def __init__(self, max_bytes: int = MAX_WRITER_BYTES, keep: int = 16):
        import threading      # here, not at import: most users of this module never write evidence

        self.max_bytes, self.keep = max_bytes, keep
        self._lock = threading.Lock()     # a rank's dump thread and an agent's investigations write at once
        self._written: dict[str, dict[str, int]] = {}     # incident folder -> {file name: bytes charged}
        self._totals: dict[str, int] = {}

    def used(self, directory: str | os.PathLike) -> int:
        return self._totals.get(os.path.abspath(directory), 0)

    def take(self, directory: Path, name: str, size: int) -> int:
        """Charge `size` bytes for `name`; returns what the name held before (for `give_back`).
        :class:`IncidentError` when it would take this writer past its share."""
        key, cost = os.path.abspath(directory), max(size, BLOCK_BYTES)
        with self._lock:
            files = self._written.pop(key, None)
            if files is None:
                files = {}
                self._totals[key] = 0
            self._written[key] = files                  # the newest last
            self._forget_past_keep()
            before = files.get(name, 0)
            total = self._totals[key] - before + cost
            if total > self.max_bytes:
                raise IncidentError(f"{directory}: evidence past this writer's {self.max_bytes} bytes refused "
                                    f"({name}, {size} bytes; {self._totals[key]} already written)")
            files[name], self._totals[key] = cost, total
            return before

    def give_back(self, directory: Path, name: str, before: int) -> None:
        """The write of `name` failed: its charge is undone (`before`: what `take` returned)."""
        key = os.path.abspath(directory)
        with self._lock:
            files = self._written.get(key)
            if files is None or name not in files:
                return
            self._totals[key] += before - files[name]
            if before:
                files[name] = before
            else:
                del files[name]

    def _forget_past_keep(self) -> None:
        while len(self._written) > self.keep:
            oldest = next(iter(self._written))
            del self._written[oldest], self._totals[oldest]


_writer: Budget | None = None


def writer() -> Budget:
    """This process's account (one node's agent, or one rank)."""
    global _writer
    if _writer is None:
        _writer = Budget()
    return _writer


def check_room(directory: Path, name: str, size: int) -> None:
    """:class:`IncidentError` when writing `size` bytes would leave the filesystem less free than the
    run's reserve (one ``statvfs``: no listing; with many writers at once, the reserve is crossed by at
    most one file per writer). Quotas are not seen here: the OS's EDQUOT or ENOSPC comes as ``OSError``."""
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    reserve = max(MIN_FREE_BYTES, int(st.f_blocks * st.f_frsize * MIN_FREE_FRACTION))
    if free - size < reserve:
        raise IncidentError(f"{directory}: evidence refused ({name}, {size} bytes): {free} bytes free on its "
                            f"filesystem, and evidence leaves at least {reserve} to the run")


def write_file(run_dir: str | os.PathLike, incident_id: str, name: str, content: bytes | str,
               *, max_bytes: int = MAX_FILE_BYTES, budget: Budget | None = None) -> Path:
    """One evidence file (or ``incident.json``), atomically; cut at `max_bytes`. Returns its path.

    Charged to `budget` (default: this process's, :func:`writer`). Raises :class:`IncidentError` for a
    bad id or name, past the writer's share or the disk's reserve, and ``OSError`` (ENOSPC, EDQUOT named
    by the OS) when the disk or quota is full — callers log it and go on. Its cost does not depend on
    what else the incident holds: a mkdir, a statvfs, the write.
    """
    check_id(incident_id)
    if name != "incident.json" and not _EVIDENCE.match(name):
        raise IncidentError(f"evidence file name {name!r} is not one of the layout's")
    data = content.encode() if isinstance(content, str) else bytes(content)
    if len(data) > max_bytes:
        data = data[:max_bytes] + TRUNCATED % max_bytes
    directory = incidents_dir(run_dir) / incident_id
    directory.mkdir(parents=True, exist_ok=True)
    budget = budget or writer()
    before = budget.take(directory, name, len(data))
    try:
        check_room(directory, name, len(data))
        return _write_atomically(directory, name, data)
    except BaseException:
        budget.give_back(directory, name, before)
        raise


def _write_atomically(directory: Path, name: str, data: bytes) -> Path:
    path = directory / name
    tmp = directory / f".{name}.{os.getpid()}.{secrets.token_hex(3)}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, path)
    _fsync_dir(directory)
    return path


VERDICT_PURPOSE = "incident-verdict/1"


def write_incident(run_dir: str | os.PathLike, incident: Incident, key: bytes | None = None,
                   key_id: str | None = None) -> Path:
    """The verdict, ``incident.json`` (replaced whole if the incident is decided again); signed with the run's
    checkpoint key when `key` is given (the agent's verdict: other agents act on it only when it checks)."""
    data = validate(incident.to_json(), f"incident {incident.id}")
    if key is not None:
        data = signed.sign(key, VERDICT_PURPOSE, json.loads(json.dumps(data)), key_id=key_id)
    body = json.dumps(data, indent=1, sort_keys=True, allow_nan=False)
    return write_file(run_dir, incident.id, "incident.json", body + "\n")


def check_verdict(key: bytes | None, incident_id: str, verdict: Any) -> str | None:
    """None when `verdict` (read from `incident_id`'s incident.json) was signed with `key` for that incident;
    else why not. Only a verdict that checks is acted on (agent/culprit.py); `trainguard incidents` shows it."""
    return signed.check(key, VERDICT_PURPOSE, verdict, {"id": incident_id})


def write_json(run_dir: str | os.PathLike, incident_id: str, name: str, data: Any) -> Path:
    return write_file(run_dir, incident_id, name, json.dumps(data, indent=1, sort_keys=True, default=str) + "\n")


# ------------------------------------------------------------------------------ signed node evidence

NODE_PURPOSE = "node-evidence/1"
FILES = "files"        # a signed node file's digests of the rank files it vouches for: name -> sha256


def host_key(key: bytes, host: str) -> bytes:
    """The key one host's agent signs its evidence with, derived from the run's key: a signature proves the
    host it was made for (a file renamed to another host's name does not check). Whoever holds the run's
    key can derive any host's; a stranger, who holds none, can derive none."""
    return hmac.new(key, b"trainguard-evidence-host/1\0" + host.encode(), hashlib.sha256).digest()


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def node_file(host: str) -> str:
    return f"node-{host}.json"


def sign_node(key: bytes, incident_id: str, host: str, signals: dict, files: dict[str, str],
              key_id: str | None = None) -> dict:
    """`signals` as the signed content of ``node-<host>.json``: bound to the incident and the host, with the
    digests of the rank files the agent gathered."""
    body = json.loads(json.dumps({**signals, "node": host, "incident": incident_id, FILES: files}, default=str))
    return signed.sign(host_key(key, host), NODE_PURPOSE, body, key_id=key_id)


def check_node(key: bytes | None, incident_id: str, host: str, record: Any) -> str | None:
    """None when `record` (read from ``node-<host>.json`` of `incident_id`) was signed for that host and
    incident; else why not (trainguard/signed.py's reasons)."""
    if not isinstance(record, dict):
        return signed.UNREADABLE
    return signed.check(None if key is None else host_key(key, host), NODE_PURPOSE, record,
                        {"node": host, "incident": incident_id})


def validate(data: Any, where: str) -> dict:
    """The verdict's fields, checked; an :class:`IncidentError` naming `where` and the field otherwise."""
    if not isinstance(data, dict):
        raise IncidentError(f"{where}: not a JSON object")
    for key, kind in (("id", str), ("kind", str), ("detected_by", str), ("reasons", list)):
        if not isinstance(data.get(key), kind):
            raise IncidentError(f"{where}: field {key!r} missing or not a {kind.__name__}")
    check_id(data["id"])
    if data["kind"] not in KINDS:
        raise IncidentError(f"{where}: field 'kind' is {data['kind']!r}, not one of {', '.join(KINDS)}")
    if not isinstance(data.get("detected_at"), (int, float)) or isinstance(data["detected_at"], bool):
        raise IncidentError(f"{where}: field 'detected_at' missing or not Unix seconds")
    confidence = data.get("confidence")
    if not isinstance(confidence, (int, float)) or not 0.0 <= confidence <= 1.0:
        raise IncidentError(f"{where}: field 'confidence' must be a number from 0 to 1")
    culprit = data.get("culprit")
    if culprit is not None:
        if not isinstance(culprit, dict) or set(culprit) - {"rank", "node", "ranks"}:
            raise IncidentError(f"{where}: field 'culprit' must be null or {{\"rank\", \"node\"}}")
        rank = culprit.get("rank")
        if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 0):
            raise IncidentError(f"{where}: field 'culprit.rank' must be a rank number or null")
        listed = culprit.get("ranks")
        if listed is not None and (not isinstance(listed, list) or not all(
                isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in listed)):
            raise IncidentError(f"{where}: field 'culprit.ranks' must be a list of rank numbers")
        if culprit.get("node") is not None and not isinstance(culprit["node"], str):
            raise IncidentError(f"{where}: field 'culprit.node' must be a host name or null")
    if not all(isinstance(reason, str) for reason in data["reasons"]):
        raise IncidentError(f"{where}: field 'reasons' must be a list of strings")
    if data.get("action") is not None and not isinstance(data["action"], str):
        raise IncidentError(f"{where}: field 'action' must be an action name or null")
    return data


def read(run_dir: str | os.PathLike, incident_id: str) -> dict:
    """One incident's verdict, validated. :class:`IncidentError` names the file when it is bad."""
    path = incidents_dir(run_dir) / check_id(incident_id) / "incident.json"
    try:
        raw = safe_read.read_bytes(path, MAX_FILE_BYTES, "verdict")
    except FileNotFoundError:
        raise IncidentError(f"{path}: no such incident") from None
    except OSError as exc:      # a FIFO, /dev/zero, a directory, too large: never read (safe_read names it)
        raise IncidentError(str(exc)) from None
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise IncidentError(f"{path}: not JSON ({exc})") from None
    return validate(data, str(path))


def evidence(run_dir: str | os.PathLike, incident_id: str) -> list[Path]:
    """The evidence files beside the verdict, by name."""
    directory = incidents_dir(run_dir) / check_id(incident_id)
    if not directory.is_dir():
        return []
    return sorted(p for p in directory.iterdir()
                  if p.is_file() and p.name != "incident.json" and not p.name.startswith("."))


def scan(run_dir: str | os.PathLike) -> Iterator[tuple[str, dict | None, str | None]]:
    """(id, verdict or None, problem or None) for every incident directory, oldest first.

    An incident still gathering evidence (no verdict yet) comes with neither; a bad one with its problem.
    """
    root = incidents_dir(run_dir)
    if not root.is_dir():
        return
    for directory in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")):
        if not _ID.match(directory.name):
            yield directory.name, None, f"{directory}: not an incident id"
            continue
        if not (directory / "incident.json").exists():
            yield directory.name, None, None
            continue
        try:
            yield directory.name, read(run_dir, directory.name), None
        except IncidentError as exc:
            yield directory.name, None, str(exc)


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
