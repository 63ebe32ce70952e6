"""CheckpointManager: the component a training loop calls to save, keep and restore checkpoints.

    manager = CheckpointManager(run_dir, async_save=True, on_event=emit)
    manager.save(step, {"model": ..., "optim": ..., "sched": ..., "data": ..., "rng": ...}, stable=ok)
    found = manager.load_latest()            # (Checkpoint, state) of the newest one that verifies, or None

It composes the parts, each a module with one job:

    saving.py     write, sign, publish: sync, or staged and written beside training (one save in flight)
    status.py     what became of each save: the log, the event, RUN/checkpoints/status.json, failures in a row
    retention.py  keep the newest that verify (and the newest stable one); move aside, never delete, the rest
    restore.py    the newest checkpoint that verifies, and its state (resharded into `into` when given)
    archive.py    what the commands do beside it: set aside foreign checkpoints, import one, export one
    directory.py  RUN/checkpoints/: the step directories, each verified (verification.verify_dir)
    group.py      the ranks a distributed manager saves and loads with (its own gloo group)

With `distributed=True` every rank calls `save` and writes its own shards (FSDP2 DTensors, or its share of
replicated DDP tensors); `load(..., into=state)` reshards into any world size. Without it (the default),
rank 0 alone saves and any rank can load the whole state. `engine="files"` writes the old format /1
(whole .pt files); both formats verify and restore. A failed save surfaces (on_error="raise") on that
`save()` when sync, on the next `save()` or `wait()` when async.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Callable

from trainguard import log as tglog
from trainguard import rundir
from trainguard.runtime.checkpoint import compress as compress_mod
from trainguard.runtime.checkpoint import keys, store
from trainguard.runtime.checkpoint.directory import INVALID, STATUS_FILE, SUPERSEDED, CheckpointDirs, KeyMismatchError
from trainguard.runtime.checkpoint.events import EventSink, Events
from trainguard.runtime.checkpoint.group import RankGroup
from trainguard.runtime.checkpoint.manifest import VerifyResult
from trainguard.runtime.checkpoint.restore import Checkpoint, CheckpointInfo, Restorer, info_of
from trainguard.runtime.checkpoint.retention import Retention
from trainguard.runtime.checkpoint.saving import ENGINES, TENSOR_PARTS, SaveHandle, Saver, versions
from trainguard.runtime.checkpoint.status import (EXIT_NO_DURABLE_CHECKPOINT, SaveReport, final_checkpoint_code,
                                                  read_status)

# What the trainer, the library and the tests import from here (each defined in the part that owns it).
__all__ = ["CheckpointManager", "Checkpoint", "CheckpointInfo", "SaveHandle", "KeyMismatchError", "info_of",
           "versions", "final_checkpoint_code", "read_status", "EXIT_NO_DURABLE_CHECKPOINT", "TENSOR_PARTS",
           "ENGINES", "INVALID", "SUPERSEDED", "STATUS_FILE", "EventSink"]


class CheckpointManager:
    def __init__(self, run_dir: str | Path, *, key_file: str | Path | None = None, keep_last: int = 3,
                 async_save: bool = False, on_error: str = "raise", on_event: EventSink | None = None,
                 log: Any = None, world_size: int | None = None, inspect_only: bool = False,
                 engine: str = "dcp", compress: str = compress_mod.NONE, distributed: bool = False,
                 check_key: bool = False):
        """`inspect_only`: for tools beside a live run (the CLI) — never create the key or the checkpoints
        directory, never remove another process's temporaries.

        `distributed`: every rank of the default process group constructs this manager and calls `save`
        (and `load(..., into=)`) together; the manager runs them on a gloo group of its own.
        `check_key`: refuse (KeyMismatchError) a run directory whose checkpoints carry another key id.
        """
        _check_options(keep_last, on_error, engine, compress)
        self.run_dir = Path(run_dir)
        self.root = rundir.checkpoints_dir(self.run_dir)
        if not inspect_only:
            self.root.mkdir(parents=True, exist_ok=True)
        self.key_path = keys.resolve_key_path(key_file)
        self._key = keys.load_key(self.key_path, create=not inspect_only)
        self.keep_last, self.async_save, self.on_error = keep_last, async_save, on_error
        self.engine, self.compress = engine, compress
        self.events = Events(on_event, log or tglog.get("checkpoint"))
        lock = threading.RLock()  # directory changes (publish, retention) against scans
        self._group = RankGroup(distributed)
        self.rank = self._group.rank
        self._dirs = CheckpointDirs(self.root, self._key, keys.key_id(self._key))
        self._saver = Saver(self.root, self._key, self.key_id, self._group, engine=engine, compress=compress,
                            async_save=async_save, world_size=world_size, lock=lock, finished=self._save_ended)
        # what became of the saves: `report.failures` (consecutive failed saves, 0 after a durable one),
        # `report.durable_step` (the newest step this manager made durable)
        self.report = SaveReport(self.root, self.rank, self.events, async_save=async_save, on_error=on_error)
        self._retention = Retention(self._dirs, keep_last, self.events, lock)
        self._restorer = Restorer(self._dirs, self._group, self.events, lock)
        self._lock = lock
        if check_key and not inspect_only:
            self.check_key()
        for path in () if inspect_only or self.rank != 0 else store.clean_stale(self.root):
            self.events.log.info("checkpoint_stale_removed", path=str(path))

    # ------------------------------------------------------------------------------------------ save

    def save(self, step: int, state: dict, *, stable: bool, meta: dict | None = None) -> SaveHandle:
        """Save `state` as step_<step>. Sync: returns when durable. Async: returns once the state is copied
        off the device. Raises CheckpointError (on_error="raise") for this save or a failed earlier one.
        With `distributed`, every rank calls this with its own (sharded) state."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        self._finish_pending()
        handle = self._saver.start(step, state, stable=stable, meta=dict(meta or {}))
        if not self.async_save and handle.error is not None and self.on_error == "raise":
            raise handle.error
        return handle

    def _save_ended(self, handle: SaveHandle, error: BaseException | None, bytes_needed: int) -> None:
        """The saver's `finished`: report the outcome; after a durable save, keep what retention keeps."""
        if error is not None:
            self.report.failed(handle, error, bytes_needed, newest=self._dirs.newest_name())
            return
        self.report.durable(handle)
        if self.rank == 0:
            self._retention.retain_quietly()

    def wait(self) -> None:
        """Block until any async save is durable; raise its error (on_error="raise")."""
        self._finish_pending()

    def close(self) -> None:
        self.wait()

    def _finish_pending(self) -> None:
        """The save in flight, finished; its error raised (on_error="raise")."""
        handle = self._saver.finish_pending()
        if handle is not None and handle.error is not None and self.on_error == "raise":
            raise handle.error

    # ---------------------------------------------------------------------------------------- verify

    def verify_step(self, step: int, *, deep: bool = True) -> VerifyResult:
        return self._dirs.verify(self._dirs.path_of(step), deep=deep)

    def steps(self) -> list[int]:
        """Steps that have a step_<N> directory, oldest first (verified or not)."""
        return sorted(step for step, _ in self._dirs.newest_first())

    def list(self, *, deep: bool = True, progress: Any = None) -> list[CheckpointInfo]:
        """Every step_<N> directory, oldest first, with its verification status and reason (`progress`: a
        trainguard.progress.Progress, told of each checkpoint)."""
        return self._restorer.list(deep=deep, progress=progress)

    @property
    def key_id(self) -> str:
        """The fingerprint of the key in use (the `key_id` a manifest it signs carries)."""
        return self._dirs.key_id

    def check_key(self) -> None:
        """Refuse to train on checkpoints signed under another key (KeyMismatchError says what to do)."""
        self._dirs.check_key(self.key_path)

    # ------------------------------------------------------------------------------------------ keep

    def supersede_after(self, step: int, *, pinned: bool = False) -> list[Path]:
        """Move every checkpoint newer than `step` to checkpoints/superseded/ (after a rollback to `step`,
        or to pin a restore), so the next restore cannot pick a checkpoint from the abandoned timeline.
        `pinned`: a person's restore; what it sets aside is never deleted (retention.py)."""
        self._finish_pending()
        return self._retention.supersede_after(step, pinned=pinned) if self.rank == 0 else []

    # --------------------------------------------------------------------------------------- restore

    def latest_verified(self, *, stable_only: bool = False) -> Checkpoint | None:
        """The newest checkpoint that verifies in full; each one skipped is logged with its reason."""
        return self._restorer.latest_verified(stable_only=stable_only)

    def load(self, ckpt: Checkpoint, map_location: Any = "cpu", *, into: dict | None = None) -> dict:
        """The state saved in `ckpt`, every file hash-checked and loaded with weights_only (`into`: in
        place through DCP, resharded; with `distributed`, every rank calls together)."""
        return self._restorer.load(ckpt, map_location, into=into)

    def load_latest(self, *, stable_only: bool = False, map_location: Any = "cpu",
                    into: dict | Callable[[], dict] | None = None) -> tuple[Checkpoint, dict] | None:
        """Restore in one pass: the newest checkpoint that verifies, with its state (`Restorer.load_latest`:
        with `distributed` every rank calls; `into` may be a function that builds the target)."""
        return self._restorer.load_latest(stable_only=stable_only, map_location=map_location, into=into)


def _check_options(keep_last: int, on_error: str, engine: str, compress: str) -> None:
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, got {keep_last}")
    if on_error not in ("raise", "warn"):
        raise ValueError(f"on_error must be 'raise' or 'warn', got {on_error!r}")
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if compress not in compress_mod.MODES:
        raise ValueError(f"compress must be one of {compress_mod.MODES}, got {compress!r}")
    if compress == compress_mod.FP16_ZLIB:
        raise ValueError("compress fp16-zlib is lossy: it is only for exports (export_checkpoint), "
                         "never for the checkpoints a run resumes from; use none or lossless")
