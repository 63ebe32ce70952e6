"""Restore planning: which checkpoint a run resumes from, and its state, verified on the way in.

    restorer = Restorer(dirs, group, events, lock)
    restorer.load_latest(into=state)   # (Checkpoint, state) of the newest that verifies, or None
    restorer.latest_verified()         # the newest that verifies in full, not loaded
    restorer.list()                    # every step_<N> with whether it verifies and why not

Candidates are taken newest first. Rank 0 names each one that passes the cheap check (signature, step,
sizes); every rank then verifies in full what its load reads (every hash, a weights_only load, resharded
into `into` when given: `verification.verify_and_load`), and the ranks agree before any of them loads. One that
fails is skipped with its reason (`checkpoint_invalid`) and the next older is tried. Exports (lossy) are
never chosen.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from trainguard import event_types, rundir
from trainguard.runtime.checkpoint import manifest as mf
from trainguard.runtime.checkpoint import verification
from trainguard.runtime.checkpoint.directory import CheckpointDirs
from trainguard.runtime.checkpoint.events import Events
from trainguard.runtime.checkpoint.group import RankGroup
from trainguard.runtime.checkpoint.manifest import CheckpointError, VerifyResult

GONE = "gone"       # a row of `list()`: the checkpoint was removed between the listing and the look


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint whose manifest verified; `load` checks every file's hash again as it reads it."""

    step: int
    path: Path
    stable: bool
    manifest: dict

    @classmethod
    def of(cls, result: VerifyResult) -> "Checkpoint":
        return cls(result.manifest["step"], result.path, result.manifest["stable"], result.manifest)


@dataclass(frozen=True)
class CheckpointInfo:
    """One row of `list()`: what is on disk and whether it verifies (and if not, why)."""

    step: int
    path: Path
    stable: bool | None
    bytes: int
    created_at: str | None
    ok: bool
    code: str
    reason: str


class Restorer:
    def __init__(self, dirs: CheckpointDirs, group: RankGroup, events: Events, lock: threading.RLock):
        self.dirs, self.events = dirs, events
        self._group, self._lock = group, lock

    def latest_verified(self, *, stable_only: bool = False) -> Checkpoint | None:
        """The newest checkpoint that verifies in full (signature, every hash, a weights_only load of its
        content: `verification.verify_dir`); each one skipped is logged (and emitted as `checkpoint_invalid`)
        with its reason. Exports (lossy) are never chosen."""
        with self._lock:
            for _, path in self.dirs.newest_first():
                result = self.dirs.verify(path, deep=True)
                if not result.ok:
                    self._skipped(path, result.code, result.reason)
                elif _resumable(result.manifest, stable_only):
                    return Checkpoint.of(result)
        return None

    def load(self, ckpt: Checkpoint, map_location: Any = "cpu", *, into: dict | None = None) -> dict:
        """The state saved in `ckpt`, every file hash-checked and loaded with weights_only. `into` (format
        /2): load the tensors into this state in place through DCP, resharded to its layout; with
        `distributed`, every rank calls together."""
        result, state = self._verify_and_load(ckpt.path, map_location, into)
        if not result.ok:
            self._skipped(ckpt.path, result.code, result.reason)
            raise CheckpointError(f"{ckpt.path}: {result.reason}", code=result.code, path=ckpt.path)
        return state

    def load_latest(self, *, stable_only: bool = False, map_location: Any = "cpu",
                    into: dict | Callable[[], dict] | None = None) -> tuple[Checkpoint, dict] | None:
        """Restore in one pass: the newest checkpoint that verifies (signature, every hash, weights_only
        content), with its state. With `distributed`, every rank calls; rank 0 names each candidate and
        all ranks agree it verified everywhere before loading it. `into` may be a function that builds
        the target: it is called only once there is a candidate (building one can change a fresh
        optimizer, which a run with nothing to restore must not see)."""
        with self._lock:
            candidates = self.dirs.newest_first() if self._group.rank == 0 else iter(())
            while True:
                path = self._group.broadcast(self._next_candidate(candidates, stable_only))
                if path is None:
                    return None
                into = into() if callable(into) else into
                result, state = self._verify_and_load(Path(path), map_location, into)
                if result.ok:
                    return Checkpoint.of(result), state
                self._skipped(Path(path), result.code, result.reason)

    def list(self, *, deep: bool = True, progress: Any = None) -> list[CheckpointInfo]:
        """Every step_<N> directory, oldest first, with its verification status and reason. `progress`: a
        trainguard.progress.Progress told of each checkpoint as it is verified."""
        rows = []
        with self._lock:
            found = list(reversed(list(self.dirs.newest_first())))
            for index, (step, path) in enumerate(found):
                if progress is not None:
                    progress.file(path, index, len(found))
                try:
                    result = self.dirs.verify(path, deep=deep)
                    if not result.ok and not path.is_dir():
                        raise FileNotFoundError(path)     # refused because it went away while read
                    rows.append(info_of(step, path, result))
                except FileNotFoundError:
                    # Removed between the listing and the look (retention of a live run, in another
                    # process): it is gone, which is no failure of a checkpoint and no crash of ours.
                    rows.append(CheckpointInfo(step, path, None, 0, None, False, GONE,
                                               "removed while listed (retention of a running save)"))
        return rows

    def _next_candidate(self, candidates: Iterator[tuple[int, Path]], stable_only: bool) -> str | None:
        for _, path in candidates:
            result = self.dirs.verify(path, deep=False)
            if not result.ok:
                self._skipped(path, result.code, result.reason)
            elif _resumable(result.manifest, stable_only):
                return str(path)
        return None

    def _verify_and_load(self, path: Path, map_location: Any, into: dict | None) -> tuple[VerifyResult, Any]:
        began = time.perf_counter()
        collective = into is not None and self._group.distributed
        result, state = self.dirs.verify_and_load(
            path, into=into, map_location=map_location,
            agree=(lambda ok: self._group.agree(ok, "verified")) if collective else None,
            process_group=self._group.pg if collective else None)
        if result.ok:
            seconds = time.perf_counter() - began
            self.events.log.info("checkpoint_restored", step=result.step, path=str(path), seconds=round(seconds, 3))
            self.events.emit(event_types.CHECKPOINT_RESTORED, step=result.step, path=str(path),
                             stable=result.manifest["stable"], seconds=seconds)
        return result, state

    def _skipped(self, path: Path, code: str, reason: str) -> None:
        self.events.log.warning("checkpoint_skipped", path=str(path), code=code, reason=reason)
        self.events.emit(event_types.CHECKPOINT_INVALID, step=rundir.step_of_dir(path.name), path=str(path), code=code,
                         reason=reason)


def _resumable(manifest: dict, stable_only: bool) -> bool:
    return not mf.layout(manifest).get("export") and (manifest["stable"] or not stable_only)


def info_of(step: int, path: Path, result: VerifyResult) -> CheckpointInfo:
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    manifest = result.manifest
    if manifest is None:
        try:
            manifest = verification.read_manifest(path)  # unverified, only to show what it claims
        except CheckpointError:
            manifest = None
    return CheckpointInfo(step, path, manifest.get("stable") if manifest else None, size,
                          manifest.get("created_at") if manifest else None, result.ok, result.code, result.reason)
