"""Preflight results: one CheckResult per check, and the file the agent exports them from.

The last result is written to ``RUN/preflight.json`` when preflight is given a run directory, else to
``~/.cache/trainguard/preflight.json`` (``$XDG_CACHE_HOME`` honoured). This module is imported by the
agent's preflight collector, so it stays free of torch and of the checks themselves.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard import rundir, safe_read

SCHEMA = "trainguard.preflight/1"
PASS, FAIL, SKIP = "pass", "fail", "skip"


@dataclass
class CheckResult:
    name: str            # environment | nccl_env | gpus | storage | checkpoint_drill | collective
    status: str          # pass | fail | skip
    message: str         # one line a person reads; on failure, exactly what is wrong
    details: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return self.status != FAIL

    def to_dict(self) -> dict:
        return {"name": self.name, "status": self.status, "message": self.message, "details": self.details,
                "seconds": round(self.seconds, 3)}


@dataclass
class Report:
    checks: list[CheckResult]
    environment: dict[str, Any]         # the versions found on this node (lock keys)
    lock_hash: str                      # of `environment`, so nodes compare by one label
    timestamp: float = field(default_factory=time.time)
    host: str = field(default_factory=socket.gethostname)

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)

    def to_dict(self) -> dict:
        return {"schema": SCHEMA, "timestamp": self.timestamp, "host": self.host, "passed": self.passed,
                "environment": self.environment, "lock_hash": self.lock_hash,
                "checks": [check.to_dict() for check in self.checks]}


def default_path(run_dir: str | os.PathLike | None) -> Path:
    if run_dir is not None:
        return rundir.preflight_path(run_dir)
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return rundir.preflight_path(Path(cache) / "trainguard")     # no run: the same file in the user's cache


def write(report: Report, path: Path) -> None:
    """Replace `path` atomically, so the agent never reads half a result."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(report.to_dict(), indent=2, sort_keys=False) + "\n")
    os.replace(tmp, path)


class ResultError(ValueError):
    pass


def read(path: Path) -> dict:
    """The last result as written by `write`; ResultError naming the file and field when it is not one."""
    try:
        data = safe_read.read_json(path, safe_read.STATUS_BYTES, "preflight result")
    except OSError as exc:      # a FIFO, a device, too large (missing: FileNotFoundError, as before)
        if isinstance(exc, FileNotFoundError):
            raise
        raise ResultError(str(exc)) from None
    except ValueError as exc:
        raise ResultError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("schema") != SCHEMA:
        raise ResultError(f"{path}: schema: expected {SCHEMA!r}")
    for key, kind in (("timestamp", (int, float)), ("passed", bool), ("checks", list),
                      ("environment", dict), ("lock_hash", str)):
        if not isinstance(data.get(key), kind):
            raise ResultError(f"{path}: {key}: missing or of the wrong type")
    for n, check in enumerate(data["checks"]):
        if not isinstance(check, dict) or not isinstance(check.get("name"), str) \
                or check.get("status") not in (PASS, FAIL, SKIP):
            raise ResultError(f"{path}: checks[{n}]: expected an object with a name and a pass|fail|skip status")
    return data
