"""What became of each save: counted on every rank; logged, emitted and written to status.json on rank 0.

A failed save is reported once per run of failures (log, `checkpoint_failed` event) with the path and the
bytes it needed, recorded in ``RUN/checkpoints/status.json`` (read by `trainguard status`) and retried at
the next interval; `durable_step` tells a trainer whether the run ends on a durable checkpoint, and
`final_checkpoint_code` turns "it did not" into the exit status EXIT_NO_DURABLE_CHECKPOINT.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainguard import event_types, rundir, safe_read
from trainguard.tls import format_timestamp
from trainguard.runtime.checkpoint.directory import STATUS_FILE
from trainguard.runtime.checkpoint.events import Events
from trainguard.runtime.checkpoint.manifest import CheckpointError

if TYPE_CHECKING:
    from trainguard.runtime.checkpoint.manager import CheckpointManager
    from trainguard.runtime.checkpoint.saving import SaveHandle

EXIT_NO_DURABLE_CHECKPOINT = 4   # a run that ends without a durable final checkpoint (RUN/checkpoints/status.json)
read_status = rundir.read_checkpoint_status   # the reading end lives with the run directory's paths


class SaveReport:
    """Settles each save's handle (which wakes whoever waits on it) and says what became of it."""

    def __init__(self, root: Path, rank: int, events: Events, *, async_save: bool, on_error: str):
        self.root, self.rank, self.events = root, rank, events
        self.async_save, self.on_error = async_save, on_error
        self.status = SaveStatus(root / STATUS_FILE)
        self.failures = 0                    # consecutive failed saves (0 after a durable one)
        self.durable_step: int | None = None  # newest step this manager made durable

    def durable(self, handle: "SaveHandle") -> None:
        recovered = self.failures
        self.failures, self.durable_step = 0, handle.step
        handle.settle()
        if self.rank != 0:
            return
        log = self.events.log
        log.info("checkpoint_saved", step=handle.step, path=str(handle.path), stable=handle.stable,
                 bytes=handle.bytes, seconds=round(handle.seconds, 3))
        if recovered:
            log.warning("checkpoint_save_recovered", step=handle.step, failed_saves=recovered)
        self.events.emit(event_types.CHECKPOINT_SAVED, step=handle.step, path=str(handle.path), stable=handle.stable,
                         bytes=handle.bytes, seconds=handle.seconds, blocking_seconds=handle.blocking_seconds,
                         started_at=handle.started_at, **{"async": self.async_save})
        self.status.write(ok=True, step=handle.step, path=str(handle.path), durable_step=handle.step)

    def failed(self, handle: "SaveHandle", exc: BaseException, needed: int, newest: str | None) -> None:
        """`needed`: about the bytes the save needed; `newest`: the newest checkpoint still on disk."""
        free = _free_bytes(self.root)
        handle.settle(self._error(handle, exc, needed, free, newest))
        self.failures += 1
        if self.rank != 0:
            return
        if self.failures == 1:   # reported once per run of failures; each is still counted and recorded
            self.events.log.error("checkpoint_save_failed", step=handle.step, path=str(handle.path),
                                  bytes_needed=needed, bytes_free=free, error=str(handle.error),
                                  on_error=self.on_error)
            self.events.emit(event_types.CHECKPOINT_FAILED, step=handle.step, path=str(handle.path),
                             reason=str(handle.error), bytes_needed=needed, bytes_free=free)
        else:
            self.events.log.info("checkpoint_save_failed_again", step=handle.step, failed_saves=self.failures)
        self.status.write(ok=False, step=handle.step, path=str(handle.path), error=str(handle.error),
                          bytes_needed=needed, bytes_free=free, failed_saves=self.failures,
                          durable_step=self.durable_step)

    def _error(self, handle: "SaveHandle", exc: BaseException, needed: int, free: int | None,
               newest: str | None) -> CheckpointError:
        kept = f"the newest checkpoint on disk is still {newest}" if newest else "no earlier checkpoint exists"
        cause = f"{type(exc).__name__}: {exc}" if not isinstance(exc, CheckpointError) else str(exc)
        space = f"; it needs about {needed} bytes, {free} are free under {self.root}" if free is not None else ""
        error = CheckpointError(
            f"checkpoint {handle.path.name} was not saved ({cause}){space}; its temporary files were removed "
            f"and {kept}; the next checkpoint interval tries again", code="write_failed", path=handle.path)
        error.__cause__ = exc
        error.bytes_needed = needed
        return error


def _free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


class SaveStatus:
    """``RUN/checkpoints/status.json``: the last save's outcome. The file is created with room to spare
    while there is space and rewritten in place, so a full disk can still be recorded in it."""

    SIZE = 4096

    def __init__(self, path: Path):
        self.path = path

    def write(self, **fields: Any) -> None:
        data = json.dumps({**fields, "time": format_timestamp(time.time())}, default=str).encode()
        data = data[:self.SIZE - 1] if len(data) >= self.SIZE else data
        try:
            fd = safe_read.open_rw_fd(self.path, os.O_RDWR | os.O_CREAT, "checkpoint status")
        except OSError:
            return
        try:
            if os.fstat(fd).st_size < self.SIZE:
                os.posix_fallocate(fd, 0, self.SIZE) if hasattr(os, "posix_fallocate") else None
            os.pwrite(fd, data + b" " * (self.SIZE - len(data)), 0)
            if not fields.get("ok", False):
                # a failure must survive a crash to be reported; a success is the checkpoint itself
                # (durable already), so it costs the save no fsync of its own
                os.fsync(fd)
        except OSError:
            pass  # the log and the event carry it; a status file must never fail a save
        finally:
            os.close(fd)


def final_checkpoint_code(manager: "CheckpointManager", step: int, code: int, rank: int = 0) -> int:
    """The trainer's exit code once it has ended at `step`: EXIT_NO_DURABLE_CHECKPOINT (rank 0) when it
    completed but no durable checkpoint of that step exists (its saves failed: status.json says why)."""
    if (code != 0 or rank != 0 or manager.report.durable_step == step
            or manager.verify_step(step, deep=False).ok):   # a durable checkpoint of `step` under its final name
        return code
    manager.events.log.error("run_ended_without_a_durable_checkpoint", step=step,
                             exit_code=EXIT_NO_DURABLE_CHECKPOINT, status=str(manager.root / STATUS_FILE))
    return EXIT_NO_DURABLE_CHECKPOINT
