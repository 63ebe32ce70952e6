"""CheckpointManager: the component a training loop calls to save, keep and restore checkpoints.

    manager = CheckpointManager(run_dir, async_save=True, on_event=emit)
    manager.save(step, {"model": ..., "optim": ..., "sched": ..., "data": ..., "rng": ...}, stable=ok)
    found = manager.load_latest()            # (Checkpoint, state) of the newest one that verifies, or None

The tensors (`model`, `optim`) go through torch.distributed.checkpoint (format /2, `sharded.py`): with
`distributed=True` every rank calls `save` and writes its own shards (FSDP2 DTensors, or its share of
replicated DDP tensors), rank 0 signs the manifest of every rank's files once all are durable and only
then renames the directory to its final name; `load(..., into=state)` reshards into any world size.
Without it (the default), rank 0 alone saves and any rank can load the whole state. `engine="files"`
writes the old format /1 (whole .pt files); both formats verify and restore.

One save is in flight at a time. With `async_save` the state is staged into host memory on the caller's
thread (DCP's `async_save` staging) and written while training goes on; the checkpoint appears under its
final name only once it is durable, and a failure surfaces on the next `save()` or `wait()`.

A failed save is reported once per run of failures (log, `checkpoint_failed` event) with the path and the
bytes it needed, recorded in ``RUN/checkpoints/status.json`` (read by `trainguard status`), and retried at
the next interval; `durable_step` tells a trainer whether the run ends on a durable checkpoint.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import trainguard
from trainguard import log as tglog
from trainguard import rundir
from trainguard.tls import format_timestamp
from trainguard.trainer.checkpoint import compress as compress_mod
from trainguard.trainer.checkpoint import keys, sharded, store
from trainguard.trainer.checkpoint import manifest as mf
from trainguard.trainer.checkpoint import state as state_mod
from trainguard.trainer.checkpoint.manifest import CheckpointError, VerifyResult

SUPERSEDED = "superseded"
EXIT_NO_DURABLE_CHECKPOINT = 4   # a run that ends without a durable final checkpoint (RUN/checkpoints/status.json)
INVALID = "invalid"          # checkpoints that did not verify, moved aside by retention (never deleted)
STATUS_FILE = rundir.CHECKPOINT_STATUS_FILE  # the last save's outcome, for `trainguard status`
ENGINES = ("dcp", "files")
TENSOR_PARTS = ("model", "optim")   # through DCP; every other key goes to extra.pt (rank 0's)


class KeyMismatchError(CheckpointError):
    """The run directory holds checkpoints signed with another key and none with this one."""
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
                 log: Any = None, world_size: int | None = None, inspect_only: bool = False,
                 engine: str = "dcp", compress: str = compress_mod.NONE, distributed: bool = False,
                 check_key: bool = False):
        """`inspect_only`: for tools beside a live run (the CLI) — never create the key or the checkpoints
        directory, never remove another process's temporaries.

        `distributed`: every rank of the default process group constructs this manager and calls `save`
        (and `load(..., into=)`) together; the manager runs them on a gloo group of its own.
        `check_key`: refuse (KeyMismatchError) a run directory whose checkpoints carry another key id.
        """
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
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / "checkpoints"
        if not inspect_only:
            self.root.mkdir(parents=True, exist_ok=True)
        self.key_path = keys.resolve_key_path(key_file)
        self._key = keys.load_key(self.key_path, create=not inspect_only)
        self._key_id = keys.key_id(self._key)
        self.keep_last, self.async_save, self.on_error = keep_last, async_save, on_error
        self.engine, self.compress = engine, compress
        self._on_event, self._world_size = on_event, world_size
        self._log = log or tglog.get("checkpoint")
        self._lock = threading.RLock()  # directory changes (publish, retention) against scans
        self._pending: tuple[SaveHandle, threading.Thread] | None = None
        self._stager = state_mod.Stager()
        self._dcp_stager: Any = None   # DCP's staging buffers, kept between async saves (sharded.cached_stager)
        self._group = _Group(distributed)
        self.rank = self._group.rank
        self.failures = 0                    # consecutive failed saves (0 after a durable one)
        self.durable_step: int | None = None  # newest step this manager made durable
        if check_key and not inspect_only:
            self.check_key()
        for path in () if inspect_only or self.rank != 0 else store.clean_stale(self.root):
            self._log.info("checkpoint_stale_removed", path=str(path))

    # --------------------------------------------------------------------------------------- keys

    @property
    def key_id(self) -> str:
        """The fingerprint of the key in use (the `key_id` a manifest it signs carries)."""
        return self._key_id

    def foreign_checkpoints(self) -> list[tuple[Path, str]]:
        """(path, key id) of every checkpoint whose manifest names another signing key than ours."""
        found = []
        for _, path in self._step_dirs():
            try:
                manifest = store.read_manifest(path)
            except CheckpointError:
                continue
            if manifest["key_id"] != self._key_id:
                found.append((path, manifest["key_id"]))
        return found

    def check_key(self) -> None:
        """Refuse to train on checkpoints signed under another key: a silent restart from step 0 would
        then let retention destroy them. Raises KeyMismatchError saying what to do."""
        foreign = self.foreign_checkpoints()
        if not foreign or any(self._verify(path, deep=False).ok for _, path in self._step_dirs()):
            return
        ids = sorted({key for _, key in foreign})
        raise KeyMismatchError(
            f"{self.root}: its checkpoints ({', '.join(p.name for p, _ in foreign[:5])}) are signed with key "
            f"id {', '.join(ids)}, but the key in use ({self.key_path}) has id {self._key_id}. Point at the "
            f"key that signed them with --key-file or {keys.ENV_VAR} (its id is printed by "
            f"`trainguard checkpoint list`), or pass --start-over to set them aside under "
            f"{self.root / INVALID} and train from scratch", code=mf.WRONG_KEY, path=self.root)

    def set_aside_foreign(self) -> list[Path]:
        """--start-over: move the checkpoints signed with another key to checkpoints/invalid/ (kept)."""
        return [self._quarantine(path, mf.WRONG_KEY, f"signed with key id {key}, not {self._key_id}")
                for path, key in self.foreign_checkpoints()]

    # ------------------------------------------------------------------------------------------ save

    def save(self, step: int, state: dict, *, stable: bool, meta: dict | None = None) -> SaveHandle:
        """Save `state` as step_<step>. Sync: returns when durable. Async: returns once the state is copied
        off the device. Raises CheckpointError (on_error="raise") for this save or a failed earlier one.
        With `distributed`, every rank calls this with its own (sharded) state."""
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        self._finish_pending()
        began = time.perf_counter()
        parts = self._parts(state)
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
        staged = self._stage(handle, parts)
        handle.blocking_seconds = time.perf_counter() - began
        worker = threading.Thread(target=self._write, args=(handle, staged, meta, began),
                                  name=f"trainguard-checkpoint-{step}")
        self._pending = (handle, worker)
        worker.start()
        return handle

    def _parts(self, state: dict) -> dict[str, Any]:
        if self.engine == "files":
            parts = state_mod.split(state)
            for name, obj in parts.items():
                state_mod.check_loadable(obj, name)
            return parts
        if not isinstance(state, dict):
            raise CheckpointError(f"a checkpoint state is a dict, got {type(state).__name__}", code="bad_state")
        tensors = {key: state[key] for key in TENSOR_PARTS if key in state}
        extra = {key: value for key, value in state.items() if key not in TENSOR_PARTS}
        for key in extra:
            if not isinstance(key, str):
                raise CheckpointError(f"state keys are strings, got {key!r}", code="bad_state")
        state_mod.check_loadable(extra, "state")
        return {"tensors": tensors, "extra": extra}

    def _stage(self, handle: SaveHandle, parts: dict[str, Any]) -> dict[str, Any]:
        """Async: copy what the worker will write off the device, here on the caller's thread. Through
        DCP's own async_save for the tensors (its stager, its upload thread)."""
        if self.engine == "files":
            return self._stager.stage(parts)
        extra = self._stager.stage(parts["extra"]) if self.rank == 0 else {}
        tmp = writer = None
        try:
            tmp = self._tmp_dir(handle)
            if self._dcp_stager is None:
                self._dcp_stager = sharded.cached_stager()
            future, writer = sharded.async_save(tmp, parts["tensors"], process_group=self._group.pg,
                                                distributed=self._group.distributed,
                                                extensions=compress_mod.writer_extensions(self.compress),
                                                stager=self._dcp_stager)
        except Exception as exc:
            future, writer = _failed_future(exc), None
        return {"tmp": tmp, "future": future, "writer": writer, "extra": extra,
                "int_key_paths": sharded.int_key_paths(parts["tensors"]), "bytes": state_mod.tensor_bytes(parts)}

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

    def _tmp_dir(self, handle: SaveHandle) -> Path:
        """The private directory every rank writes into: rank 0 names and creates it."""
        tmp, error = None, None
        if self.rank == 0:
            tmp = store.private_dir(self.root, store.TMP, handle.path.name)
            try:
                tmp.mkdir()
            except OSError as exc:
                tmp, error = None, exc
        name = self._group.broadcast(str(tmp) if tmp else None)
        if name is None:
            raise error or CheckpointError(f"rank 0 could not create a directory under {self.root}",
                                           code="write_failed")
        return Path(name)

    def _write(self, handle: SaveHandle, parts: dict[str, Any], meta: dict, began: float) -> None:
        """Write, sign, publish, prune (every rank, when distributed). On the worker thread when async."""
        tmp = parts.get("tmp") if isinstance(parts.get("tmp"), Path) else None
        signed = b""
        try:
            if self.engine == "files":
                tmp = store.private_dir(self.root, store.TMP, handle.path.name)
                tmp.mkdir()
                # A sync save has the host to itself: its files are written at once. An async one runs
                # beside training and takes one thread.
                files = store.save_files(tmp, parts, concurrent=not self.async_save)
                layout = None
            else:
                if "future" not in parts:
                    tmp = self._tmp_dir(handle)
                files = self._write_shards(tmp, parts)
                layout = {"engine": "dcp", "compress": self.compress, "saved_by_ranks": self._group.size,
                          "int_key_paths": parts["int_key_paths"] if "future" in parts
                          else sharded.int_key_paths(parts["tensors"])}
            ok, error = True, None
            if self.rank == 0:   # only once every rank's shards are durable
                try:
                    if self.engine == "dcp":
                        files = sorted([*files, store.save_file(tmp / state_mod.EXTRA_FILE, parts["extra"])],
                                       key=lambda entry: entry.name)
                    body = mf.build(step=handle.step, files=files, stable=handle.stable,
                                    world_size=self._get_world_size(), created_at=format_timestamp(time.time()),
                                    versions=versions(), meta=meta, layout=layout)
                    signed = mf.encode(mf.sign(body, self._key, self._key_id))
                    store.write_bytes(tmp / mf.MANIFEST_NAME, signed)
                    with self._lock:
                        store.publish(tmp, handle.path)
                except Exception as exc:
                    ok, error = False, exc
            if not self._group.agree(ok, "publish"):
                raise error or CheckpointError("rank 0 could not sign and publish it", code="write_failed")
        except BaseException as exc:
            if self.rank == 0 and tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            self._failed(handle, exc, parts)
            if not isinstance(exc, Exception):
                raise
            return
        handle.seconds = time.perf_counter() - began
        handle.bytes = sum(f.bytes for f in files) + len(signed)
        if not self.async_save:
            handle.blocking_seconds = handle.seconds
        self._durable(handle)

    def _write_shards(self, tmp: Path, parts: dict[str, Any]) -> list:
        """Every rank's shards through DCP into `tmp`, hashed while written; every rank's entries (on rank
        0) once all ranks' files are durable (DCP returns only after the coordinator's .metadata)."""
        mine, error = [], None
        if "future" in parts:   # async: DCP staged and is uploading; wait for it here, off the caller
            try:
                parts["future"].result()
                mine = sharded.written_entries(parts["writer"])
            except BaseException as exc:   # DCP's CheckpointException is a BaseException
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                error = sharded.first_os_error(parts["writer"]) or sharded.as_checkpoint_error(exc)
        else:
            try:
                mine = sharded.save(tmp, parts["tensors"], process_group=self._group.pg,
                                    distributed=self._group.distributed,
                                    extensions=compress_mod.writer_extensions(self.compress))
            except Exception as exc:
                error = exc
        if not self._group.agree(error is None, "shards"):
            raise error or CheckpointError("another rank failed to write its shards", code="write_failed")
        everyone = self._group.gather(mine)
        return [entry for rank_files in everyone for entry in rank_files]

    def _durable(self, handle: SaveHandle) -> None:
        recovered = self.failures
        self.failures, self.durable_step = 0, handle.step
        handle._done.set()
        if self.rank != 0:
            return
        self._log.info("checkpoint_saved", step=handle.step, path=str(handle.path), stable=handle.stable,
                       bytes=handle.bytes, seconds=round(handle.seconds, 3))
        if recovered:
            self._log.warning("checkpoint_save_recovered", step=handle.step, failed_saves=recovered)
        self._emit("checkpoint_saved", step=handle.step, path=str(handle.path), stable=handle.stable,
                   bytes=handle.bytes, seconds=handle.seconds, blocking_seconds=handle.blocking_seconds,
                   started_at=handle.started_at, **{"async": self.async_save})
        self._status.write(ok=True, step=handle.step, path=str(handle.path), durable_step=handle.step)
        self._retain_quietly()

    def _failed(self, handle: SaveHandle, exc: BaseException, parts: dict[str, Any]) -> None:
        try:
            newest = next((path.name for _, path in self._step_dirs()), None)
        except OSError:
            newest = None
        kept = f"the newest checkpoint on disk is still {newest}" if newest else "no earlier checkpoint exists"
        cause = f"{type(exc).__name__}: {exc}" if not isinstance(exc, CheckpointError) else str(exc)
        needed, free = _bytes_needed(parts), _free_bytes(self.root)
        space = f"; it needs about {needed} bytes, {free} are free under {self.root}" if free is not None else ""
        handle.error = CheckpointError(
            f"checkpoint {handle.path.name} was not saved ({cause}){space}; its temporary files were removed "
            f"and {kept}; the next checkpoint interval tries again", code="write_failed", path=handle.path)
        handle.error.__cause__ = exc
        handle.error.bytes_needed = needed
        handle._done.set()
        self.failures += 1
        if self.rank != 0:
            return
        if self.failures == 1:   # reported once per run of failures; each is still counted and recorded
            self._log.error("checkpoint_save_failed", step=handle.step, path=str(handle.path),
                            bytes_needed=needed, bytes_free=free, error=str(handle.error), on_error=self.on_error)
            self._emit("checkpoint_failed", step=handle.step, path=str(handle.path), reason=str(handle.error),
                       bytes_needed=needed, bytes_free=free)
        else:
            self._log.info("checkpoint_save_failed_again", step=handle.step, failed_saves=self.failures)
        self._status.write(ok=False, step=handle.step, path=str(handle.path), error=str(handle.error),
                           bytes_needed=needed, bytes_free=free, failed_saves=self.failures,
                           durable_step=self.durable_step)

    @property
    def _status(self) -> "SaveStatus":
        if not hasattr(self, "_status_file"):
            self._status_file = SaveStatus(self.root / STATUS_FILE)
        return self._status_file

    def _get_world_size(self) -> int:
        if self._world_size is None:
            import torch.distributed as dist

            self._world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        return self._world_size

    def export_checkpoint(self, ckpt: "Checkpoint", target: Path, *, compress: str = compress_mod.FP16_ZLIB
                          ) -> "Checkpoint":
        """Write a verified checkpoint's state as an *export* under `target` (a run directory) with
        `compress` (fp16-zlib: lossy, its largest absolute and relative error in the manifest). A resume
        never picks an export."""
        state = self.load(ckpt)
        tensors = {key: state[key] for key in TENSOR_PARTS if key in state}
        extra = {key: value for key, value in state.items() if key not in TENSOR_PARTS}
        errors: dict = {}
        if compress == compress_mod.FP16_ZLIB:
            tensors = compress_mod.to_fp16(tensors, errors)
        out = CheckpointManager(target, key_file=self.key_path, log=self._log)
        final = out.root / ckpt.path.name
        tmp = store.private_dir(out.root, store.TMP, final.name)
        tmp.mkdir()
        try:
            files = sharded.save(tmp, tensors, extensions=compress_mod.writer_extensions(compress))
            files.append(store.save_file(tmp / state_mod.EXTRA_FILE, extra))
            layout = {"engine": "dcp", "compress": compress, "export": True,
                      "int_key_paths": sharded.int_key_paths(tensors), **errors}
            body = mf.build(step=ckpt.step, files=sorted(files, key=lambda f: f.name), stable=ckpt.stable,
                            world_size=1, created_at=format_timestamp(time.time()), versions=versions(),
                            meta={**ckpt.manifest.get("meta", {}), "exported_from": str(ckpt.path)},
                            layout=layout)
            store.write_bytes(tmp / mf.MANIFEST_NAME, mf.encode(mf.sign(body, out._key, out._key_id)))
            store.publish(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        result = out._verify(final, deep=True)
        if not result.ok:
            raise CheckpointError(f"{final}: the export does not verify: {result.reason}", code=result.code)
        return Checkpoint.of(result)

    # ------------------------------------------------------------------------------------ retention

    def _retain_quietly(self) -> None:
        # Pruning old checkpoints must never turn a successful save into a failure.
        try:
            with self._lock:
                self._retain()
        except OSError as exc:
            self._log.warning("checkpoint_retention_failed", error=str(exc))

    def _retain(self) -> None:
        """Keep the newest `keep_last` checkpoints that verify, plus the newest stable one; delete older
        verified ones. One that does not verify is never deleted and never counted: it is moved to
        checkpoints/invalid/ with its reason."""
        dirs = list(self._step_dirs())
        good = []
        for _, path in dirs:
            result = self._verify(path, deep=False)
            if result.ok:
                good.append((path, result.manifest["stable"]))
            else:
                self._quarantine(path, result.code, result.reason)
        keep = {path for path, _ in good[:self.keep_last]}
        newest_stable = next((path for path, stable in good if stable), None)
        if newest_stable is not None:
            keep.add(newest_stable)
        for path, _ in good:
            if path not in keep:
                step = mf.step_of_dir(path.name)
                store.remove_dir(path)
                self._log.info("checkpoint_deleted", step=step, path=str(path), reason="retention")
                self._emit("checkpoint_deleted", step=step, path=str(path), reason="retention")
        superseded = self.root / SUPERSEDED
        if superseded.is_dir():
            newest_first = sorted(superseded.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
            for path in newest_first[self.keep_last:]:
                shutil.rmtree(path, ignore_errors=True)

    def _quarantine(self, path: Path, code: str, reason: str) -> Path:
        """Move a checkpoint that does not verify to checkpoints/invalid/<name>-<ns>/, with reason.json."""
        target = self.root / INVALID
        target.mkdir(exist_ok=True)
        destination = target / f"{path.name}-{time.time_ns()}"
        path.rename(destination)
        store.fsync_dir(self.root)
        try:
            store.write_bytes(destination / "reason.json", json.dumps(
                {"step": mf.step_of_dir(path.name), "code": code, "reason": reason, "key_in_use": self._key_id,
                 "moved_at": format_timestamp(time.time())}, indent=2).encode() + b"\n")
        except OSError:
            pass  # a full disk: the move is what protects it; the reason is in the log and the event
        store.fsync_dir(target)
        self._log.warning("checkpoint_quarantined", step=mf.step_of_dir(path.name), path=str(destination),
                          code=code, reason=reason)
        self._emit("checkpoint_quarantined", step=mf.step_of_dir(path.name), path=str(destination), code=code,
                   reason=reason)
        return destination

    def supersede_after(self, step: int) -> list[Path]:
        """Move every checkpoint newer than `step` to checkpoints/superseded/ (after a rollback to `step`,
        or to pin a restore), so the next restore cannot pick a checkpoint from the abandoned timeline."""
        self._finish_pending()
        moved = []
        if self.rank != 0:
            return moved
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

    def is_durable(self, step: int) -> bool:
        """A checkpoint of `step` exists under its final name and its manifest and sizes check out."""
        return self.durable_step == step or self.verify_step(step, deep=False).ok

    def verify_step(self, step: int, *, deep: bool = True) -> VerifyResult:
        return self._verify(self.root / f"step_{step}", deep=deep)

    def latest_verified(self, *, stable_only: bool = False) -> Checkpoint | None:
        """The newest checkpoint that verifies in full (signature, every hash, a weights_only load of its
        content: `store.verify_dir`); each one skipped is logged (and emitted as `checkpoint_invalid`)
        with its reason. Exports (lossy) are never chosen."""
        with self._lock:
            for _, path in self._step_dirs():
                result = self._verify(path, deep=True)
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
            candidates = self._step_dirs() if self.rank == 0 else iter(())
            while True:
                path = self._group.broadcast(self._next_candidate(candidates, stable_only))
                if path is None:
                    return None
                into = into() if callable(into) else into
                result, state = self._verify_and_load(Path(path), map_location, into)
                if result.ok:
                    return Checkpoint.of(result), state
                self._skipped(Path(path), result.code, result.reason)

    def _next_candidate(self, candidates: Iterator[tuple[int, Path]], stable_only: bool) -> str | None:
        for _, path in candidates:
            result = self._verify(path, deep=False)
            if not result.ok:
                self._skipped(path, result.code, result.reason)
            elif _resumable(result.manifest, stable_only):
                return str(path)
        return None

    def _verify_and_load(self, path: Path, map_location: Any, into: dict | None) -> tuple[VerifyResult, Any]:
        began = time.perf_counter()
        collective = into is not None and self._group.distributed
        result, state = store.verify_and_load(
            path, self._key, self._key_id, deep=True, into=into, map_location=map_location,
            agree=(lambda ok: self._group.agree(ok, "verified")) if collective else None,
            process_group=self._group.pg if collective else None)
        if result.ok:
            seconds = time.perf_counter() - began
            self._log.info("checkpoint_restored", step=result.step, path=str(path), seconds=round(seconds, 3))
            self._emit("checkpoint_restored", step=result.step, path=str(path),
                       stable=result.manifest["stable"], seconds=seconds)
        return result, state

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


def final_checkpoint_code(manager: "CheckpointManager", step: int, code: int, rank: int = 0) -> int:
    """The trainer's exit code once it has ended at `step`: EXIT_NO_DURABLE_CHECKPOINT (rank 0) when it
    completed but no durable checkpoint of that step exists (its saves failed: status.json says why)."""
    if code != 0 or rank != 0 or manager.is_durable(step):
        return code
    manager._log.error("run_ended_without_a_durable_checkpoint", step=step, exit_code=EXIT_NO_DURABLE_CHECKPOINT,
                       status=str(manager.root / STATUS_FILE))
    return EXIT_NO_DURABLE_CHECKPOINT


def _resumable(manifest: dict, stable_only: bool) -> bool:
    return not mf.layout(manifest).get("export") and (manifest["stable"] or not stable_only)


def _failed_future(exc: Exception) -> Any:
    from concurrent.futures import Future

    future: Future = Future()
    future.set_exception(exc)
    return future


def _bytes_needed(parts: Any) -> int:
    """About what the failed save needed on disk: the bytes of its tensors."""
    if isinstance(parts, dict) and "future" in parts:
        return parts["bytes"]
    return state_mod.tensor_bytes(parts)


def _free_bytes(path: Path) -> int | None:
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


class _Group:
    """The ranks a distributed manager saves and loads with, on a gloo group of its own (async saves
    run collectives from a worker thread; they must not share a group with training's)."""

    def __init__(self, distributed: bool):
        import torch.distributed as dist

        self.distributed = distributed and dist.is_available() and dist.is_initialized() \
            and dist.get_world_size() > 1
        self.pg = dist.new_group(backend="gloo") if self.distributed else None
        self.rank = dist.get_rank() if self.distributed else 0
        self.size = dist.get_world_size() if self.distributed else 1

    def broadcast(self, value: Any) -> Any:
        if not self.distributed:
            return value
        import torch.distributed as dist

        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.pg)
        return box[0]

    def agree(self, ok: bool, what: str) -> bool:
        """True when every rank says ok."""
        if not self.distributed:
            return ok
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.pg)
        return bool(flag.item())

    def gather(self, value: Any) -> list:
        if not self.distributed:
            return [value]
        import torch.distributed as dist

        out = [None] * self.size if self.rank == 0 else None
        dist.gather_object(value, out, dst=0, group=self.pg)
        return out or []


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
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
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


read_status = rundir.read_checkpoint_status   # the reading end lives with the run directory's paths


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
