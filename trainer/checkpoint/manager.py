"""CheckpointManager: the component a training loop calls to save, keep and restore checkpoints.

    manager = CheckpointManager(run_dir, async_save=True, on_event=emit)
    manager.save(step, {"model": ..., "optim": ..., "sched": ..., "data": ..., "rng": ...}, stable=ok)
    found = manager.load_latest()            # (Checkpoint, state) of the newest one that verifies, or None

One save is in flight at a time. With `async_save` the state is copied off the device (to CPU memory)
on the caller's thread, and a worker thread writes it while training goes on; the checkpoint appears
under its final name only once it is durable, and a failure surfaces on the next `save()` or `wait()`.
"""

from __future__ import annotations

import platform
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import trainguard
from trainguard import log as tglog
from trainguard.tls import format_timestamp
from trainguard.trainer.checkpoint import keys, store
from trainguard.trainer.checkpoint import manifest as mf
from trainguard.trainer.checkpoint import state as state_mod
from trainguard.trainer.checkpoint.manifest import CheckpointError, VerifyResult

SUPERSEDED = "superseded"
EventSink = Callable[..., None]


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


class SaveHandle:
    """A save in progress (async) or done (sync). `error` is set when it failed."""

    def __init__(self, step: int, path: Path, stable: bool):
        self.step, self.path, self.stable = step, path, stable
        self.started_at = time.time()
        self.blocking_seconds = 0.0
        self.seconds: float | None = None
        self.bytes: int | None = None
        self.error: CheckpointError | None = None
        self._done = threading.Event()

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the save is durable or failed; False on timeout."""
        return self._done.wait(timeout)


def versions() -> dict[str, str]:
    import torch

    return {"torch": torch.__version__, "trainguard": trainguard.__version__,
            "python": platform.python_version()}


class CheckpointManager:
    def __init__(self, run_dir: str | Path, *, key_file: str | Path | None = None, keep_last: int = 3,
                 async_save: bool = False, on_error: str = "raise", on_event: EventSink | None = None,
                 log: Any = None, world_size: int | None = None, inspect_only: bool = False):
        """`inspect_only`: for tools beside a live run (the CLI) — never create the key or the checkpoints
        directory, never remove another process's temporaries."""
        if keep_last < 1:
            raise ValueError(f"keep_last must be at least 1, got {keep_last}")
        if on_error not in ("raise", "warn"):
            raise ValueError(f"on_error must be 'raise' or 'warn', got {on_error!r}")
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / "checkpoints"
        if not inspect_only:
            self.root.mkdir(parents=True, exist_ok=True)
        self.key_path = keys.resolve_key_path(key_file)
        self._key = keys.load_key(self.key_path, create=not inspect_only)
        self._key_id = keys.key_id(self._key)
        self.keep_last, self.async_save, self.on_error = keep_last, async_save, on_error
        self._on_event, self._world_size = on_event, world_size
        self._log = log or tglog.get("checkpoint")
        self._lock = threading.RLock()  # directory changes (publish, retention) against scans
        self._pending: tuple[SaveHandle, threading.Thread] | None = None
        self._stager = state_mod.Stager()
        for path in () if inspect_only else store.clean_stale(self.root):
            self._log.info("checkpoint_stale_removed", path=str(path))

    # ------------------------------------------------------------------------------------------ save

    def save(self, step: int, state: dict, *, stable: bool, meta: dict | None = None) -> SaveHandle:
        """Save `state` as step_<step>. Sync: returns when durable. Async: returns once the state is copied
        off the device. Raises CheckpointError (on_error="raise") for this save or a failed earlier one."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        self._finish_pending()
        began = time.perf_counter()
        parts = state_mod.split(state)
        for name, obj in parts.items():
            state_mod.check_loadable(obj, name)
        meta = dict(meta or {})
        try:
            mf.canonical(meta)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"meta must be JSON-serialisable: {exc}", code="bad_state") from None
        handle = SaveHandle(step, self.root / f"step_{step}", bool(stable))
        if not self.async_save:
            self._write(handle, parts, meta, began)
            self._surface(handle)
            return handle
        parts = self._stager.stage(parts)
        handle.blocking_seconds = time.perf_counter() - began
        worker = threading.Thread(target=self._write, args=(handle, parts, meta, began),
                                  name=f"trainguard-checkpoint-{step}")
        self._pending = (handle, worker)
        worker.start()
        return handle

    def wait(self) -> None:
        """Block until any async save is durable; raise its error (on_error="raise")."""
        self._finish_pending()

    def close(self) -> None:
        self.wait()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _finish_pending(self) -> None:
        if self._pending is None:
            return
        handle, worker = self._pending
        worker.join()
        self._pending = None
        self._surface(handle)

    def _surface(self, handle: SaveHandle) -> None:
        if handle.error is not None and self.on_error == "raise":
            raise handle.error

    def _write(self, handle: SaveHandle, parts: dict[str, Any], meta: dict, began: float) -> None:
        """Write, sign, publish, prune. Runs on the worker thread for async saves."""
        tmp = store.private_dir(self.root, store.TMP, handle.path.name)
        try:
            tmp.mkdir()
            # A sync save has the host to itself: its files are written at once. An async one runs
            # beside training and takes one thread.
            files = store.save_files(tmp, parts, concurrent=not self.async_save)
            body = mf.build(step=handle.step, files=files, stable=handle.stable,
                            world_size=self._get_world_size(), created_at=format_timestamp(time.time()),
                            versions=versions(), meta=meta)
            signed = mf.encode(mf.sign(body, self._key, self._key_id))
            store.write_bytes(tmp / mf.MANIFEST_NAME, signed)
            with self._lock:
                store.publish(tmp, handle.path)
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            self._failed(handle, exc)
            if not isinstance(exc, Exception):
                raise
            return
        handle.seconds = time.perf_counter() - began
        handle.bytes = sum(f.bytes for f in files) + len(signed)
        if not self.async_save:
            handle.blocking_seconds = handle.seconds
        handle._done.set()
        self._log.info("checkpoint_saved", step=handle.step, path=str(handle.path), stable=handle.stable,
                       bytes=handle.bytes, seconds=round(handle.seconds, 3))
        self._emit("checkpoint_saved", step=handle.step, path=str(handle.path), stable=handle.stable,
                   bytes=handle.bytes, seconds=handle.seconds, blocking_seconds=handle.blocking_seconds,
                   started_at=handle.started_at, **{"async": self.async_save})
        self._retain_quietly()

    def _failed(self, handle: SaveHandle, exc: BaseException) -> None:
        try:
            newest = next((path.name for _, path in self._step_dirs()), None)
        except OSError:
            newest = None
        kept = f"the newest checkpoint on disk is still {newest}" if newest else "no earlier checkpoint exists"
        cause = f"{type(exc).__name__}: {exc}" if not isinstance(exc, CheckpointError) else str(exc)
        handle.error = CheckpointError(
            f"checkpoint {handle.path.name} was not saved ({cause}); its temporary files were removed and "
            f"{kept}", code="write_failed", path=handle.path)
        handle.error.__cause__ = exc
        handle._done.set()
        self._log.error("checkpoint_save_failed", step=handle.step, error=str(handle.error),
                        on_error=self.on_error)
        self._emit("checkpoint_failed", step=handle.step, path=str(handle.path), reason=str(handle.error))

    def _get_world_size(self) -> int:
        if self._world_size is None:
            import torch.distributed as dist

            self._world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        return self._world_size

    # ------------------------------------------------------------------------------------ retention

    def _retain_quietly(self) -> None:
        # Pruning old checkpoints must never turn a successful save into a failure.
        try:
            with self._lock:
                self._retain()
        except OSError as exc:
            self._log.warning("checkpoint_retention_failed", error=str(exc))

    def _retain(self) -> None:
        """Keep the newest `keep_last` checkpoints that check out, plus the newest stable one. Older ones
        go; a broken one newer than everything kept stays for inspection."""
        dirs = list(self._step_dirs())
        good = [(path, result.manifest["stable"]) for _, path in dirs
                if (result := self._verify(path, deep=False)).ok]
        keep = {path for path, _ in good[:self.keep_last]}
        newest_stable = next((path for path, stable in good if stable), None)
        if newest_stable is not None:
            keep.add(newest_stable)
        if not keep:
            return
        newest_kept = max(mf.step_of_dir(path.name) for path in keep)
        for step, path in dirs:
            if path not in keep and step < newest_kept:
                store.remove_dir(path)
                self._log.info("checkpoint_deleted", step=step, path=str(path), reason="retention")
                self._emit("checkpoint_deleted", step=step, path=str(path), reason="retention")
        superseded = self.root / SUPERSEDED
        if superseded.is_dir():
            newest_first = sorted(superseded.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
            for path in newest_first[self.keep_last:]:
                shutil.rmtree(path, ignore_errors=True)

    def supersede_after(self, step: int) -> list[Path]:
        """Move every checkpoint newer than `step` to checkpoints/superseded/ (after a rollback to `step`,
        or to pin a restore), so the next restore cannot pick a checkpoint from the abandoned timeline."""
        self._finish_pending()
        moved = []
        with self._lock:
            target = self.root / SUPERSEDED
            for newer, path in self._step_dirs():
                if newer <= step:
                    continue
                target.mkdir(exist_ok=True)
                destination = target / f"{path.name}-{time.time_ns()}"
                path.rename(destination)
                moved.append(destination)
                self._emit("checkpoint_superseded", step=newer, path=str(destination), kept_step=step)
            if moved:
                store.fsync_dir(self.root)
                store.fsync_dir(target)
        return moved

    def import_checkpoint(self, ckpt: Checkpoint) -> Checkpoint:
        """Copy a verified checkpoint (of another run) into this run as its newest, and verify the copy:
        a run started on this run directory resumes from it."""
        self._finish_pending()
        with self._lock:
            final = self.root / ckpt.path.name
            store.copy_dir(ckpt.path, [mf.MANIFEST_NAME, *ckpt.manifest["files"]], final)
            self.supersede_after(ckpt.step)
            result = self._verify(final, deep=True)
        if not result.ok:
            raise CheckpointError(f"{final}: the copy does not verify: {result.reason}", code=result.code,
                                  path=final)
        return Checkpoint.of(result)

    # -------------------------------------------------------------------------------- find and load

    def _step_dirs(self) -> Iterator[tuple[int, Path]]:
        """(step, path) of every step_<N> directory, newest first."""
        found = []
        for path in self.root.iterdir() if self.root.is_dir() else ():
            step = mf.step_of_dir(path.name)
            if step is not None and path.is_dir():
                found.append((step, path))
        return iter(sorted(found, reverse=True))

    def _verify(self, path: Path, *, deep: bool) -> VerifyResult:
        return store.verify_dir(path, self._key, self._key_id, deep=deep)

    def _skipped(self, path: Path, code: str, reason: str) -> None:
        self._log.warning("checkpoint_skipped", path=str(path), code=code, reason=reason)
        self._emit("checkpoint_invalid", step=mf.step_of_dir(path.name), path=str(path), code=code, reason=reason)

    def steps(self) -> list[int]:
        """Steps that have a step_<N> directory, oldest first (verified or not)."""
        return sorted(step for step, _ in self._step_dirs())

    def verify_step(self, step: int, *, deep: bool = True) -> VerifyResult:
        return self._verify(self.root / f"step_{step}", deep=deep)

    def latest_verified(self, *, stable_only: bool = False) -> Checkpoint | None:
        """The newest checkpoint whose signature and every hash verify; each one skipped is logged (and
        emitted as `checkpoint_invalid`) with its reason."""
        with self._lock:
            for _, path in self._step_dirs():
                result = self._verify(path, deep=True)
                if not result.ok:
                    self._skipped(path, result.code, result.reason)
                elif result.manifest["stable"] or not stable_only:
                    return Checkpoint.of(result)
        return None

    def load(self, ckpt: Checkpoint, map_location: Any = "cpu") -> dict:
        """The state saved in `ckpt`, each file hash-checked as read and loaded with weights_only=True."""
        try:
            return self._load(ckpt, map_location)
        except CheckpointError as exc:
            self._skipped(ckpt.path, exc.code, str(exc))
            raise

    def load_latest(self, *, stable_only: bool = False,
                    map_location: Any = "cpu") -> tuple[Checkpoint, dict] | None:
        """Restore in one pass: the newest checkpoint whose manifest verifies and whose files hash right
        and load safely, with its state. Each file is read once (hashed on the way in)."""
        with self._lock:
            for _, path in self._step_dirs():
                result = self._verify(path, deep=False)
                if not result.ok:
                    self._skipped(path, result.code, result.reason)
                    continue
                if stable_only and not result.manifest["stable"]:
                    continue
                ckpt = Checkpoint.of(result)
                try:
                    return ckpt, self._load(ckpt, map_location)
                except CheckpointError as exc:
                    self._skipped(path, exc.code, str(exc))
        return None

    def _load(self, ckpt: Checkpoint, map_location: Any) -> dict:
        began = time.perf_counter()
        parts = {entry.name: store.load_verified(ckpt.path / entry.name, entry, map_location)
                 for entry in mf.entries(ckpt.manifest)}
        seconds = time.perf_counter() - began
        self._log.info("checkpoint_restored", step=ckpt.step, path=str(ckpt.path), seconds=round(seconds, 3))
        self._emit("checkpoint_restored", step=ckpt.step, path=str(ckpt.path), stable=ckpt.stable,
                   seconds=seconds)
        return state_mod.join(parts)

    def list(self, *, deep: bool = True) -> list[CheckpointInfo]:
        """Every step_<N> directory, oldest first, with its verification status and reason."""
        rows = []
        with self._lock:
            for step, path in reversed(list(self._step_dirs())):
                result = self._verify(path, deep=deep)
                rows.append(info_of(step, path, result))
        return rows

    def _emit(self, kind: str, **fields: Any) -> None:
        if self._on_event is None:
            return
        try:
            self._on_event(kind, **fields)
        except Exception as exc:  # a broken telemetry sink must not break checkpointing
            self._log.warning("checkpoint_event_sink_failed", kind=kind, error=repr(exc))


def info_of(step: int, path: Path, result: VerifyResult) -> CheckpointInfo:
    size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    manifest = result.manifest
    if manifest is None:
        try:
            manifest = store.read_manifest(path)  # unverified, only to show what it claims
        except CheckpointError:
            manifest = None
    return CheckpointInfo(step, path, manifest.get("stable") if manifest else None, size,
                          manifest.get("created_at") if manifest else None, result.ok, result.code, result.reason)
