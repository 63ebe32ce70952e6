"""NCCL's RAS client output (`ncclras`, NCCL 2.24+) as health_check events: which ranks of the job stopped
answering, which processes RAS considers dead, which communicators report errors. Pure: text in, events out.

RAS (NCCL docs, troubleshooting/ras.rst) is a thread in every NCCL process; `ncclras` (or `echo verbose status |
nc localhost 28028`) asks it for the whole job's state. A node keeps what a cron job saved
(`ncclras -v > /var/lib/nccl/ras.txt`, or `ncclras -f json` from 2.28.7) and the agent reads it
(agent/collectors/health_reports.py). The formats, from NVIDIA/nccl src/ras/client_support.cc (2.24.3 at
6aae37927840b2bd7b7d42d2f0050e75f88ee97f; the current one at 5067397c2676d5aed50042fc39e5c8ee96eb0027):

- text: ``NCCL version %s compiled with CUDA %s``, ``CUDA runtime version %d, driver version %d``; ``Job summary``
  (nodes, processes per node, GPUs per process, processes, GPUs; or the per-node distribution when they differ,
  ending with its ``(total)`` row); ``Communicators... (%.3fs)`` and the group table (``%5d  %8d  %8d  %8s  %8d
  %8d  %8s  %6s``: group, comms in group, nodes per comm, ranks per node, ranks per comm, ranks in group, status,
  errors); ``Errors``: ``INCOMPLETE`` (job processes that sent no data, each ``Process %d on node %s managing
  GPU[s] %s``), ``DEAD`` (processes RAS gave up on), ``#%d-%d (%016lx) INCOMPLETE`` (a communicator's missing
  ranks: ``Rank %d -- GPU %s managed by process %d on node %s``; 2.24 printed ``The missing rank[s]: %s``),
  ``#%d-%d (%016lx) ERROR`` (``Initialization``/``Asynchronous error[s] on %d rank[s]``, ``%d ranks reported %s``,
  ``Rank %d reported %s -- ...``); ``Warnings``: ``TIMEOUT``, ``#%d-%d (%016lx) MISMATCH`` (status or operation
  counts that differ between ranks).
- JSON (``-f json``, 2.28.7+; rasDumpCommsToJSON): ``nccl_version``, ``timestamp``, ``communicators`` with
  ``hash``, ``size``, ``ranks`` (``rank``, ``host``, ``pid``, ``cuda_dev``, ``nvml_dev``, ``status``:
  ``init_state``, ``async_error``, ...) and ``missing_ranks`` (``status``: ``unresponsive``,
  ``considered_dead``), ``ras``: ``collection_time_sec``, ``timeouts_count``.

- monitoring mode (``ncclras -m``, 2.29+; rasClientsNotifyEvent): a log of one line per event as it happens,
  ``[%s] %s: %s %s`` (local time ``%F %T``, the event type, the peer as ``Process %d on node %s managing GPU[s]
  %s`` (peers.cc rasPeerInfoToString) or ``host<port>`` (ncclSocketToString), the details), after a banner
  ``RAS Monitor Mode - watching for peer changes (Ctrl+C to exit)...``. Event types from peers.cc and rasnet.cc:
  PEER_DEAD, PEER_TIMEOUT_DEAD (``peer failed to respond for %lds, declaring dead``), PEER_UNRESPONSIVE (``peer
  not responding for %lds (...)``), PEER_SEND_STUCK, PEER_INIT_TIMEOUT, PEER_DISCONNECTED; PEER_NEW,
  PEER_CONNECTING and PEER_RETRY are the job's normal life and are passed over.

Nodes are named by IP address (ncclSocketToHost: no DNS), so each finding says which `host` it is about; whether
that host is this node is the reader's to say (the collector matches its own addresses).

Events (``tool: "nccl ras"``): ``process_missing`` and ``process_dead`` (fail), ``ranks_missing`` (a
communicator's ranks not responding, fail), ``rank_errors`` (fail), ``mismatch`` and ``timeout`` (warn), and a
``summary`` last (the job's size, the communicators' count, the worst status). A monitor log's events are
``peer_dead``, ``peer_timeout_dead`` (fail), ``peer_unresponsive``, ``peer_send_stuck``, ``peer_init_timeout``,
``peer_disconnected`` (warn), one per line.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Iterable

from trainguard import event_types

TOOL = "nccl ras"
PASS, WARN, FAIL = "pass", "warn", "fail"
MAX_RANKS = 64            # ranks listed in one event; the count says how many there were
MAX_DETAIL_LINES = 16     # lines of a MISMATCH / ERROR block kept as text


class RasError(ValueError):
    """Text that is not an NCCL RAS client report (names what was expected)."""


@dataclass
class RasRank:
    """A rank or process a RAS block names; `host` is the node's IP address as RAS prints it."""

    rank: int | None = None
    gpu: str | None = None            # CUDA device ("5", or "5 (NVML 3)" when they differ); a list for a process
    pid: int | None = None
    host: str | None = None
    reported: str | None = None       # the error or status the line gives it

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in (("rank", self.rank), ("gpu", self.gpu), ("pid", self.pid), ("host", self.host),
                                  ("reported", self.reported)) if v is not None}


@dataclass
class RasBlock:
    """One entry of the Errors / Warnings sections."""

    kind: str                          # INCOMPLETE, DEAD, ERROR, MISMATCH, TIMEOUT
    communicator: str | None = None    # "#0-0": group and communicator within it
    comm_hash: str | None = None
    count: int | None = None           # the number the first line gives (ranks, processes, timeouts)
    ranks: list[RasRank] = field(default_factory=list)
    lines: list[str] = field(default_factory=list)
    not_found: int = 0                 # ranks or processes listed without their process information


@dataclass
class RasReport:
    version: str | None = None
    job: dict[str, int] = field(default_factory=dict)       # nodes, processes, gpus (totals) and per-node shape
    groups: list[dict[str, Any]] = field(default_factory=list)
    blocks: list[RasBlock] = field(default_factory=list)
    collection_seconds: float | None = None
    complete: bool = True              # False: the text ends before its Warnings section (cut off, or still writing)


_VERSION = re.compile(r"^NCCL version (\S+)")
_COMMS = re.compile(r"^Communicators\.\.\.(?: \((\d+(?:\.\d+)?)s\))?")
_GROUP_ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+(\d+(?:-\d+)?)\s+(\d+)\s+(\d+)\s+([A-Z]+)\s+([A-Z,]+)\s*$")
_NUMBERS = re.compile(r"^\s*\d+(?:\s+\d+)*\s*$")
_COMM_HEAD = re.compile(r"^#(\d+-\d+) \(([0-9a-fA-F]+)\) (INCOMPLETE|ERROR|MISMATCH)\s*$")
_PROCESS = re.compile(r"^\s+Process (\d+) on node (\S+) managing GPUs? (.+?)\s*$")
_RANK = re.compile(r"^\s+Rank (\d+)(?: (has status|reported|has launched up to operation|has not launched any "
                   r"operations)(?: (.+?))?)? -- "
                   r"(?:GPU (.+?) managed by process (\d+) on node (\S+)|\[process information not found\])\s*$")
_MISSING_LIST = re.compile(r"^\s+The missing ranks?: ([\d,]+)\s*$")       # 2.24
_COUNT = re.compile(r"(\d+)")
_NOT_FOUND = re.compile(r"^\s+\[could not find information on (\d+) process")
_SECTION_TITLES = {"Job summary", "Errors", "Warnings"}


def parse(data: bytes | str) -> RasReport:
    """A saved `ncclras` answer, text or JSON (`-f json`), as a RasReport; RasError when it is neither."""
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    if "\x00" in text:
        raise RasError("NCCL RAS report: binary data (NUL bytes), not the client's text")
    stripped = text.lstrip()
    if stripped.startswith("{"):
        try:
            document = json.loads(stripped)
        except json.JSONDecodeError as exc:
            raise RasError(f"NCCL RAS report (JSON): {exc.msg} at line {exc.lineno}") from None
        except RecursionError:
            raise RasError("NCCL RAS report (JSON): nested too deeply") from None
        return from_json(document)
    return from_text(text)


def from_text(text: str) -> RasReport:
    """The text the client prints (STATUS or VERBOSE STATUS)."""
    lines = text.splitlines()
    report = RasReport()
    if not any(line.startswith("Job summary") or _COMMS.match(line) for line in lines):
        raise RasError("NCCL RAS report: no 'Job summary' or 'Communicators...' section (not `ncclras` output)")
    section, block, seen_warnings = "", None, False
    numbers: list[list[int]] = []
    for line in lines:
        stripped = line.strip()
        found = _VERSION.match(line)
        if found:
            report.version = found.group(1)
            continue
        found = _COMMS.match(line)
        if found:
            section, block = "communicators", None
            report.collection_seconds = float(found.group(1)) if found.group(1) else None
            continue
        if stripped in _SECTION_TITLES:
            section, block = stripped, None
            seen_warnings = seen_warnings or stripped == "Warnings"
            continue
        if not stripped or set(stripped) == {"="}:
            continue
        if section == "Job summary":
            if _NUMBERS.match(line):
                numbers.append([int(n) for n in line.split()])
        elif section == "communicators":
            found = _GROUP_ROW.match(line)
            if found:
                report.groups.append(_group(found))
        elif section in ("Errors", "Warnings"):
            block = _block_line(report, block, line)
    report.job = _job(numbers)
    report.complete = seen_warnings
    return report


def _group(found: re.Match[str]) -> dict[str, Any]:
    g = found.groups()
    return {"group": int(g[0]), "comms": int(g[1]), "nodes_per_comm": int(g[2]), "ranks_per_node": g[3],
            "ranks_per_comm": int(g[4]), "ranks_in_group": int(g[5]), "status": g[6], "errors": g[7].split(",")}


def _job(rows: list[list[int]]) -> dict[str, int]:
    """The job summary's numbers: one row of five when the job is regular, else the per-node distribution
    rows and a last row of three totals (nodes, processes, GPUs)."""
    if not rows:
        return {}
    if len(rows) == 1 and len(rows[0]) == 5:
        nodes, per_node, gpus_per_process, processes, gpus = rows[0]
        return {"nodes": nodes, "processes_per_node": per_node, "gpus_per_process": gpus_per_process,
                "processes": processes, "gpus": gpus}
    if len(rows[-1]) == 3:
        nodes, processes, gpus = rows[-1]
        return {"nodes": nodes, "processes": processes, "gpus": gpus}
    return {}


def _block_line(report: RasReport, block: RasBlock | None, line: str) -> RasBlock | None:
    if not line.startswith(" "):                         # a block's title line
        found = _COMM_HEAD.match(line)
        if found:
            block = RasBlock(found.group(3), communicator=f"#{found.group(1)}", comm_hash=found.group(2).lower())
        else:
            block = RasBlock(line.strip().split()[0])     # INCOMPLETE, DEAD, TIMEOUT (the job-wide ones)
        report.blocks.append(block)
        return block
    if block is None:
        return None                                       # a detail line of no block: passed over
    found = _PROCESS.match(line)
    if found:
        block.ranks.append(RasRank(pid=int(found.group(1)), host=found.group(2), gpu=found.group(3)))
        return block
    found = _RANK.match(line)
    if found:
        rank, verb, said, gpu, pid, host = found.groups()
        reported = "not launched" if verb and verb.startswith("has not") else said
        block.ranks.append(RasRank(rank=int(rank), reported=reported, gpu=gpu,
                                   pid=int(pid) if pid else None, host=host))
        block.not_found += pid is None
        return block
    found = _MISSING_LIST.match(line)
    if found:
        block.ranks += [RasRank(rank=int(r)) for r in found.group(1).split(",") if r]
        return block
    found = _NOT_FOUND.match(line)
    if found:
        block.not_found += int(found.group(1))
        return block
    if block.count is None and not block.lines:
        counted = _COUNT.search(line)
        block.count = int(counted.group(1)) if counted else None
    if len(block.lines) < MAX_DETAIL_LINES:
        block.lines.append(line.strip())
    return block


def from_json(document: Any) -> RasReport:
    """`ncclras -f json` (2.28.7+): every communicator's ranks and missing ranks, raw (rasDumpCommsToJSON)."""
    if not isinstance(document, dict) or not isinstance(document.get("communicators"), list):
        raise RasError("NCCL RAS report (JSON): expected an object with a 'communicators' list")
    report = RasReport(version=_text(document.get("nccl_version")))
    ras: dict[str, Any] = document["ras"] if isinstance(document.get("ras"), dict) else {}
    if isinstance(ras.get("collection_time_sec"), (int, float)):
        report.collection_seconds = float(ras["collection_time_sec"])
    hosts: set[str] = set()
    processes: set[tuple[str, int]] = set()
    for index, comm in enumerate(document["communicators"]):
        if not isinstance(comm, dict):
            raise RasError(f"NCCL RAS report (JSON): communicators[{index}]: expected an object")
        name = f"#{index}"
        comm_hash = _text(comm.get("hash"))
        ranks, missing = _dicts(comm.get("ranks")), _dicts(comm.get("missing_ranks"))
        for rank in ranks + missing:
            if isinstance(rank.get("host"), str):
                hosts.add(rank["host"])
                if isinstance(rank.get("pid"), int):
                    processes.add((rank["host"], rank["pid"]))
        if missing:
            dead = [r for r in missing if _status(r).get("considered_dead") is True]
            block = RasBlock("INCOMPLETE", communicator=name, comm_hash=comm_hash, count=len(missing))
            block.ranks = [_json_rank(r, "dead" if r in dead else "unresponsive"
                                      if _status(r).get("unresponsive") else None) for r in missing]
            report.blocks.append(block)
        errors = [r for r in ranks if _error_code(r, "init_state") or _error_code(r, "async_error")]
        if errors:
            block = RasBlock("ERROR", communicator=name, comm_hash=comm_hash, count=len(errors))
            block.ranks = [_json_rank(r, _json_error(r)) for r in errors]
            report.blocks.append(block)
    timeouts = ras.get("timeouts_count")
    if isinstance(timeouts, int) and timeouts > 0:
        report.blocks.append(RasBlock("TIMEOUT", count=timeouts))
    report.job = {"nodes": len(hosts), "processes": len(processes)} if hosts else {}
    report.groups = [{"communicators": len(document["communicators"])}]
    return report


_NCCL_IN_PROGRESS = 7     # ncclInProgress: a rank still initialising (ras.rst: init_state 0 or 7 is no error)


def _status(rank: dict[str, Any]) -> dict[str, Any]:
    return rank["status"] if isinstance(rank.get("status"), dict) else {}


def _error_code(rank: dict[str, Any], key: str) -> int:
    value = _status(rank).get(key)
    return value if isinstance(value, int) and value not in (0, _NCCL_IN_PROGRESS) else 0


def _json_error(rank: dict[str, Any]) -> str:
    parts = [f"{key} {_error_code(rank, key)}" for key in ("init_state", "async_error") if _error_code(rank, key)]
    return ", ".join(parts)


def _json_rank(rank: dict[str, Any], reported: str | None) -> RasRank:
    gpu = rank.get("cuda_dev")
    nvml = rank.get("nvml_dev")
    shown = None if not isinstance(gpu, int) else str(gpu) if nvml in (None, gpu) else f"{gpu} (NVML {nvml})"
    return RasRank(rank=rank.get("rank") if isinstance(rank.get("rank"), int) else None, gpu=shown,
                   pid=rank.get("pid") if isinstance(rank.get("pid"), int) else None,
                   host=rank.get("host") if isinstance(rank.get("host"), str) else None, reported=reported)


def _dicts(value: Any) -> list[dict[str, Any]]:
    """The objects of a JSON list; nothing from a field of another type (the rest of the report still reads)."""
    return [item for item in value if isinstance(item, dict)] if isinstance(value, list) else []


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


# ------------------------------------------------------------------------------------------------ events

_TESTS = {"INCOMPLETE": ("process_missing", "ranks_missing", FAIL), "DEAD": ("process_dead", None, FAIL),
          "ERROR": (None, "rank_errors", FAIL), "MISMATCH": (None, "mismatch", WARN),
          "TIMEOUT": ("timeout", None, WARN)}


def events(report: RasReport) -> list[dict[str, Any]]:
    """The report's findings as health_check events, then its summary."""
    out: list[dict[str, Any]] = []
    for block in report.blocks:
        job_test, comm_test, status = _TESTS.get(block.kind, (None, None, WARN))
        test = comm_test if block.communicator else job_test
        if test is None:
            continue
        fields: dict[str, Any] = {"test": test}
        if block.communicator:
            fields.update(communicator=block.communicator, comm_hash=block.comm_hash)
        if block.count is not None:
            fields["count"] = block.count
        if block.ranks:
            fields["ranks"] = [r.as_dict() for r in block.ranks[:MAX_RANKS]]
            fields["hosts"] = sorted({r.host for r in block.ranks if r.host})
        if block.not_found:
            fields["without_process_information"] = block.not_found
        if block.lines and block.kind in ("MISMATCH", "ERROR"):
            fields["message"] = "; ".join(block.lines)
        out.append(_event(status, **fields))
    worst = FAIL if any(e["status"] == FAIL for e in out) else WARN if out or not report.complete else PASS
    summary: dict[str, Any] = {"test": "summary", **report.job, "findings": len(out)}
    if report.groups:
        summary["communicators"] = sum(g.get("comms", g.get("communicators", 0)) for g in report.groups)
    if report.version:
        summary["version"] = report.version
    if not report.complete:
        summary["complete"] = False           # cut off: what is missing may be the Errors section
    out.append(_event(worst, **summary))
    return out


def not_responding(event: dict[str, Any]) -> bool:
    """A finding that ranks or processes stopped answering RAS (missing, unresponsive or dead)."""
    return event.get("tool") == TOOL and event.get("test") in ("process_missing", "process_dead", "ranks_missing",
                                                                "peer_dead", "peer_timeout_dead", "peer_unresponsive")


# ------------------------------------------------------------------------------------- monitoring mode

MONITOR_BANNER = "RAS Monitor Mode"
_MONITOR_STATUS = {"PEER_DEAD": FAIL, "PEER_TIMEOUT_DEAD": FAIL, "PEER_UNRESPONSIVE": WARN, "PEER_SEND_STUCK": WARN,
                   "PEER_INIT_TIMEOUT": WARN, "PEER_DISCONNECTED": WARN}
_MONITOR_LINE = re.compile(r"^\s*\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)\] ([A-Z_]+): ?(.*?)\s*$")
_MONITOR_PEER = re.compile(r"^Process (\d+) on node (\S+) managing GPUs? ([\d,]+(?: \(NVML [\d,]+\))?)(?: (.*))?$")
_MONITOR_ADDRESS = re.compile(r"^(\S+?)<(\d+)>(?: (.*))?$")


def monitor_events(lines: Iterable[str]) -> list[dict[str, Any]]:
    """The events of a monitoring-mode log (`ncclras -m`) that say a peer is in trouble, in order, each with
    ``line`` (1-based) and RAS's own time ``at`` (the node's local time, as RAS prints it)."""
    out: list[dict[str, Any]] = []
    for number, line in enumerate(lines, 1):
        found = _MONITOR_LINE.match(line)
        if not found or found.group(2) not in _MONITOR_STATUS:
            continue
        at, kind, rest = found.groups()
        fields: dict[str, Any] = {"test": kind.lower(), "at": at, "line": number}
        peer = _MONITOR_PEER.match(rest)
        address = None if peer else _MONITOR_ADDRESS.match(rest)
        if peer:
            fields.update(hosts=[peer.group(2)], ranks=[{"pid": int(peer.group(1)), "host": peer.group(2),
                                                         "gpu": peer.group(3)}])
            details = peer.group(4)
        elif address:
            fields.update(hosts=[address.group(1)])
            details = address.group(3)
        else:
            details = rest
        if details:
            fields["message"] = details
        out.append(_event(_MONITOR_STATUS[kind], **fields))
    return out


def _event(status: str, **fields: Any) -> dict[str, Any]:
    return {"type": event_types.HEALTH_CHECK, "tool": TOOL, "status": status, **fields}
