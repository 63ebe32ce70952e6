"""Retention: what stays on disk once a save is durable, and what is moved aside, never deleted.

Kept: the newest `keep_last` checkpoints that verify, plus the newest stable one; older verified ones are
deleted (`store.remove_dir`: renamed out of the way first). One that does not verify is never deleted and
never counted: it is moved to checkpoints/invalid/ with its reason (`quarantine`). After a rollback,
every checkpoint newer than the step rolled back to goes to checkpoints/superseded/ (`supersede_after`),
so no restore can pick one from the abandoned timeline; only the newest `keep_last` of those a rollback set
aside are kept, each deletion a log line and a `checkpoint_deleted` event. Those a `trainguard checkpoint
restore` set aside (`pinned`, a person's choice; docs/checkpoints.md: "Nothing is deleted") are never
deleted: their names end in PINNED_SUFFIX.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

from trainguard import event_types, rundir
from trainguard.tls import format_timestamp
from trainguard.runtime.checkpoint import store
from trainguard.runtime.checkpoint.directory import INVALID, SUPERSEDED, CheckpointDirs
from trainguard.runtime.checkpoint.events import Events


PINNED_SUFFIX = "-restore"     # superseded/<name>-<ns>-restore: set aside by a pinned restore, kept


class Retention:
    def __init__(self, dirs: CheckpointDirs, keep_last: int, events: Events, lock: threading.RLock):
        self.dirs, self.keep_last, self.events = dirs, keep_last, events
        self._lock = lock   # the manager's: directory changes against scans

    def retain_quietly(self) -> None:
        # Pruning old checkpoints must never turn a successful save into a failure.
        try:
            with self._lock:
                self.retain()
        except OSError as exc:
            self.events.log.warning("checkpoint_retention_failed", error=str(exc))

    def retain(self) -> None:
        """Keep the newest `keep_last` checkpoints that verify, plus the newest stable one; delete older
        verified ones. One that does not verify is never deleted and never counted: it is moved to
        checkpoints/invalid/ with its reason."""
        good = []
        for _, path in list(self.dirs.newest_first()):
            result = self.dirs.verify(path, deep=False)
            if result.ok:
                good.append((path, result.manifest["stable"]))
            else:
                self.quarantine(path, result.code, result.reason)
        keep = {path for path, _ in good[:self.keep_last]}
        newest_stable = next((path for path, stable in good if stable), None)
        if newest_stable is not None:
            keep.add(newest_stable)
        for path, _ in good:
            if path not in keep:
                self._delete(path)
        self._prune_superseded()

    def _delete(self, path: Path) -> None:
        step = rundir.step_of_dir(path.name)
        store.remove_dir(path)
        self.events.log.info("checkpoint_deleted", step=step, path=str(path), reason="retention")
        self.events.emit(event_types.CHECKPOINT_DELETED, step=step, path=str(path), reason="retention")

    def _prune_superseded(self) -> None:
        superseded = self.dirs.root / SUPERSEDED
        if superseded.is_dir():
            by_rollback = [path for path in superseded.iterdir() if not path.name.endswith(PINNED_SUFFIX)]
            newest_first = sorted(by_rollback, key=lambda p: p.stat().st_mtime, reverse=True)
            for path in newest_first[self.keep_last:]:
                step = rundir.step_of_dir(path.name.rsplit("-", 1)[0])
                shutil.rmtree(path, ignore_errors=True)
                self.events.log.info("checkpoint_deleted", step=step, path=str(path), reason="superseded")
                self.events.emit(event_types.CHECKPOINT_DELETED, step=step, path=str(path), reason="superseded")

    def quarantine(self, path: Path, code: str, reason: str) -> Path:
        """Move a checkpoint that does not verify to checkpoints/invalid/<name>-<ns>/, with reason.json."""
        root = self.dirs.root
        target = root / INVALID
        target.mkdir(exist_ok=True)
        destination = target / f"{path.name}-{time.time_ns()}"
        path.rename(destination)
        store.fsync_dir(root)
        try:
            store.write_bytes(destination / "reason.json", json.dumps(
                {"step": rundir.step_of_dir(path.name), "code": code, "reason": reason, "key_in_use": self.dirs.key_id,
                 "moved_at": format_timestamp(time.time())}, indent=2).encode() + b"\n")
        except OSError:
            pass  # a full disk: the move is what protects it; the reason is in the log and the event
        store.fsync_dir(target)
        self.events.log.warning("checkpoint_quarantined", step=rundir.step_of_dir(path.name), path=str(destination),
                                code=code, reason=reason)
        self.events.emit(event_types.CHECKPOINT_QUARANTINED, step=rundir.step_of_dir(path.name), path=str(destination),
                         code=code, reason=reason)
        return destination

    def supersede_after(self, step: int, *, pinned: bool = False) -> list[Path]:
        """Move every checkpoint newer than `step` to checkpoints/superseded/ (after a rollback to `step`,
        or to pin a restore), so the next restore cannot pick a checkpoint from the abandoned timeline.
        `pinned` (a person's `checkpoint restore`): set aside for good, never pruned."""
        moved = []
        with self._lock:
            target = self.dirs.root / SUPERSEDED
            for newer, path in self.dirs.newest_first():
                if newer <= step:
                    continue
                target.mkdir(exist_ok=True)
                destination = target / f"{path.name}-{time.time_ns()}{PINNED_SUFFIX if pinned else ''}"
                path.rename(destination)
                moved.append(destination)
                self.events.emit(event_types.CHECKPOINT_SUPERSEDED, step=newer, path=str(destination), kept_step=step)
            if moved:
                store.fsync_dir(self.dirs.root)
                store.fsync_dir(target)
        return moved
