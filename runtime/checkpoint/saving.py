"""Saving: write a checkpoint's files, sign its manifest, publish its directory; sync, or async beside training.

    saver = Saver(dirs.root, key, key_id, group, engine="dcp", async_save=True, ..., finished=on_end)
    handle = saver.start(step, state, stable=True, meta={})   # sync: durable (or failed) on return
    saver.finish_pending()                                     # async: join the one save in flight

The tensors (`model`, `optim`) go through torch.distributed.checkpoint (format /2, `sharded.py`): with a
distributed group every rank writes its own shards, rank 0 signs the manifest of every rank's files once
all are durable and only then renames the directory to its final name. `engine="files"` writes format /1
(whole .pt files, rank 0). Everything is written into a private directory first (`store.private_dir`) and
published by one rename (`store.publish`), so a crash leaves the old checkpoint or the new one, never half.

With `async_save` the state is staged into host memory on the caller's thread (DCP's `async_save`
staging) and written on a worker thread while training goes on. `finished(handle, error, bytes_needed)` is
called once when a save ends (on the worker when async): it settles the handle and reports the outcome.
"""

from __future__ import annotations

import platform
import shutil
import threading
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable, ContextManager

import trainguard
from trainguard import rundir
from trainguard.tls import format_timestamp
from trainguard.runtime.checkpoint import compress as compress_mod
from trainguard.runtime.checkpoint import manifest as mf
from trainguard.runtime.checkpoint import sharded, store
from trainguard.runtime.checkpoint import state as state_mod
from trainguard.runtime.checkpoint.group import RankGroup
from trainguard.runtime.checkpoint.manifest import CheckpointError

ENGINES = ("dcp", "files")
TENSOR_PARTS = ("model", "optim")   # through DCP; every other key goes to extra.pt (rank 0's)


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

    def settle(self, error: CheckpointError | None = None) -> None:
        """The save is over: durable (no error) or failed with `error`; wakes whoever waits."""
        self.error = error
        self._done.set()


Finished = Callable[[SaveHandle, "BaseException | None", int], None]


def versions() -> dict[str, str]:
    import torch

    return {"torch": torch.__version__, "trainguard": trainguard.__version__,
            "python": platform.python_version()}


def split_tensors(state: dict) -> tuple[dict, dict]:
    """(the parts DCP writes, everything else: extra.pt)."""
    tensors = {key: state[key] for key in TENSOR_PARTS if key in state}
    extra = {key: value for key, value in state.items() if key not in TENSOR_PARTS}
    return tensors, extra


class Saver:
    def __init__(self, root: Path, key: bytes, key_id: str, group: RankGroup, *, engine: str, compress: str,
                 async_save: bool, world_size: int | None, lock: threading.RLock, finished: Finished):
        self.root, self.engine, self.compress, self.async_save = root, engine, compress, async_save
        self._key, self._key_id, self._group = key, key_id, group
        self._world_size, self._lock, self._finished = world_size, lock, finished
        self._pending: tuple[SaveHandle, threading.Thread] | None = None
        self._stager = state_mod.Stager()
        self._dcp_stager: Any = None   # DCP's staging buffers, kept between async saves (sharded.cached_stager)

    @property
    def rank(self) -> int:
        return self._group.rank

    def start(self, step: int, state: dict, *, stable: bool, meta: dict) -> SaveHandle:
        """Save `state` as step_<step>: written before this returns (sync), or staged off the device here
        and written on a worker thread (async). The previous save must be finished (`finish_pending`)."""
        began = time.perf_counter()
        parts = self._parts(state)
        try:
            mf.canonical(meta)
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"meta must be JSON-serialisable: {exc}", code="bad_state") from None
        handle = SaveHandle(step, self.root / rundir.step_dir_name(step), bool(stable))
        if not self.async_save:
            self._write(handle, parts, meta, began)
            return handle
        staged = self._stage(handle, parts)
        handle.blocking_seconds = time.perf_counter() - began
        worker = threading.Thread(target=self._write, args=(handle, staged, meta, began),
                                  name=f"trainguard-checkpoint-{step}")
        self._pending = (handle, worker)
        worker.start()
        return handle

    def finish_pending(self) -> SaveHandle | None:
        """Join the save in flight, if any; its (settled) handle."""
        if self._pending is None:
            return None
        handle, worker = self._pending
        worker.join()
        self._pending = None
        return handle

    # ------------------------------------------------------------------------------- what is written

    def _parts(self, state: dict) -> dict[str, Any]:
        if self.engine == "files":
            parts = state_mod.split(state)
            for name, obj in parts.items():
                state_mod.check_loadable(obj, name)
            return parts
        if not isinstance(state, dict):
            raise CheckpointError(f"a checkpoint state is a dict, got {type(state).__name__}", code="bad_state")
        tensors, extra = split_tensors(state)
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

    # ------------------------------------------------------------------------------- how it is written

    def _write(self, handle: SaveHandle, parts: dict[str, Any], meta: dict, began: float) -> None:
        """Write, sign, publish (every rank, when distributed). On the worker thread when async."""
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
                    signed = sign_and_publish(tmp, handle.path, body, self._key, self._key_id, self._lock)
                except Exception as exc:
                    ok, error = False, exc
            if not self._group.agree(ok, "publish"):
                raise error or CheckpointError("rank 0 could not sign and publish it", code="write_failed")
        except BaseException as exc:
            if self.rank == 0 and tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
            self._finished(handle, exc, _bytes_needed(parts))
            if not isinstance(exc, Exception):
                raise
            return
        handle.seconds = time.perf_counter() - began
        handle.bytes = sum(f.bytes for f in files) + len(signed)
        if not self.async_save:
            handle.blocking_seconds = handle.seconds
        self._finished(handle, None, 0)

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

    def _get_world_size(self) -> int:
        if self._world_size is None:
            import torch.distributed as dist

            self._world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        return self._world_size


def sign_and_publish(tmp: Path, final: Path, body: dict, key: bytes, key_id: str,
                     lock: ContextManager | None = None) -> bytes:
    """Sign the manifest `body`, write it last into `tmp`, and give `tmp` its final name: the signed bytes."""
    signed = mf.encode(mf.sign(body, key, key_id))
    store.write_bytes(tmp / mf.MANIFEST_NAME, signed)
    with lock or nullcontext():   # the manager's lock: a scan never sees it half published
        store.publish(tmp, final)
    return signed


def write_export(step: int, stable: bool, state: dict, meta: dict, final: Path, key: bytes, key_id: str, *,
                 compress: str) -> None:
    """Write `state` as an *export* at `final` with `compress` (fp16-zlib: lossy, its largest absolute and
    relative error in the manifest); single process, signed and published like any save."""
    tensors, extra = split_tensors(state)
    errors: dict = {}
    if compress == compress_mod.FP16_ZLIB:
        tensors = compress_mod.to_fp16(tensors, errors)
    tmp = store.private_dir(final.parent, store.TMP, final.name)
    tmp.mkdir()
    try:
        files = sharded.save(tmp, tensors, extensions=compress_mod.writer_extensions(compress))
        files.append(store.save_file(tmp / state_mod.EXTRA_FILE, extra))
        layout = {"engine": "dcp", "compress": compress, "export": True,
                  "int_key_paths": sharded.int_key_paths(tensors), **errors}
        body = mf.build(step=step, files=sorted(files, key=lambda f: f.name), stable=stable,
                        world_size=1, created_at=format_timestamp(time.time()), versions=versions(),
                        meta=meta, layout=layout)
        sign_and_publish(tmp, final, body, key, key_id)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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
