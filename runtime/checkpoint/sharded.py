"""Writing sharded checkpoints through torch.distributed.checkpoint (DCP), with trainguard's guarantees kept.

Every rank writes its own shard files through DCP's ``FileSystemWriter``; the file system under it hashes
each file once DCP has written and fsynced it, reading it back from the page cache in the thread that
wrote it (`HashingFileSystem`), so a rank knows the SHA-256 and size of every file it wrote. The
coordinator's ``.metadata`` is hashed the same way. (Hashing DCP's many small writes as they passed cost
more: docs/checkpoints.md, "Hashing beside the writer".) The caller (`saving.Saver`) gathers those
entries to rank 0, which signs the manifest and renames the directory.

Also here, for both directions: DCP's errors turned into their real cause (`dcp_errors`). Reading the
shards back, verified and resharded, is `sharded_load.py`.
"""

from __future__ import annotations

import hashlib
import io
import os
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from trainguard import safe_read
from trainguard.runtime.checkpoint.manifest import CheckpointError, FileEntry

METADATA = ".metadata"
# DCP warns at every single-process save or load ("assuming the intent is to save in a single process"),
# also from its async upload thread, where a catch_warnings around the call does not reach: that is our
# intent, so this one message is ignored process-wide.
warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled|unavailable)")


def dcp():
    """torch.distributed.checkpoint, imported when first used (the package loads without torch)."""
    import torch.distributed.checkpoint as checkpoint

    return checkpoint


# ------------------------------------------------------------------------------------------- writing

class _WrittenStream(io.RawIOBase):
    """A file being written by DCP. Keeps the first real write error (torch.save, which DCP calls per
    tensor, masks ENOSPC with its own "unexpected pos"), so it can be reported instead."""

    def __init__(self, path: Path, errors: list[OSError]):
        super().__init__()
        self._raw = open(path, "xb")
        self._path, self._errors = path, errors
        self.hashing: Any = None   # the hash of the finished file, started when DCP asks to fsync it

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        try:
            return self._raw.write(data)
        except OSError as exc:
            self._errors.append(exc)
            raise

    def tell(self) -> int:
        return self._raw.tell()

    def fileno(self) -> int:
        # DCP asks for the descriptor to fsync the file it has finished writing: the bytes are all in the
        # page cache now, so they are hashed (a thread, GIL-free) while the fsync waits for the disk.
        if self.hashing is None:
            self._raw.flush()
            from trainguard.runtime.checkpoint import store

            self.hashing = store.hash_pool().submit(hash_written, self._path)
        return self._raw.fileno()

    def entry(self) -> FileEntry:
        """The file's entry once closed: the hash begun at the fsync if the file has not grown since (DCP
        writes each file front to back, so the same size is the same bytes), else hashed now."""
        if self.hashing is not None:
            early = self.hashing.result()
            if early.bytes == os.stat(self._path).st_size:
                return early
        return hash_written(self._path)

    def flush(self) -> None:
        if not self._raw.closed:
            self._raw.flush()

    def close(self) -> None:
        if not self.closed:
            try:
                self._raw.close()
            except OSError as exc:
                self._errors.append(exc)
                raise
        super().close()


def hash_written(path: Path) -> FileEntry:
    """SHA-256 and size of a file just written and fsynced, read back (from the page cache): the bytes
    the kernel holds for the disk, not the buffers they were written from. One pass over the whole file
    costs less than hashing DCP's many small writes as they pass (bench/bench_checkpoint.py)."""
    with safe_read.open_file(path, what="checkpoint file", buffering=0) as handle:
        digest = hashlib.file_digest(handle, "sha256")
        size = os.fstat(handle.fileno()).st_size
    return FileEntry(path.name, digest.hexdigest(), size)


def _filesystem_class():
    from torch.distributed.checkpoint.filesystem import FileSystem

    class HashingFileSystem(FileSystem):
        """DCP's local file system; every file it creates is hashed once DCP has written and fsynced it
        (`entries`), in the thread that wrote it (DCP's writer threads, its upload thread when async)."""

        def __init__(self) -> None:
            super().__init__()
            self.entries: dict[str, FileEntry] = {}
            self.errors: list[OSError] = []
            self._lock = threading.Lock()

        @contextmanager
        def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
            if "w" not in mode:
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            stream = _WrittenStream(Path(path), self.errors)
            try:
                yield stream   # DCP writes, flushes and (sync_files) fsyncs inside this block
            finally:
                stream.close()
            entry = stream.entry()
            with self._lock:
                self.entries[entry.name] = entry

        def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
            # DCP writes `.metadata.tmp` and renames it; the entry follows the file.
            super().rename(path, new_path)
            with self._lock:
                entry = self.entries.pop(Path(path).name, None)
                if entry is not None:
                    name = Path(new_path).name
                    self.entries[name] = FileEntry(name, entry.sha256, entry.bytes)

    return HashingFileSystem


def make_writer(folder: Path, *, thread_count: int = 1, extensions: list | None = None):
    """A DCP FileSystemWriter into `folder` whose files are hashed while written (`writer.fs.entries`)."""
    from torch.distributed.checkpoint import FileSystemWriter

    writer = FileSystemWriter(folder, sync_files=True, thread_count=thread_count, overwrite=False,
                              _extensions=extensions)
    writer.fs = _filesystem_class()()
    return writer


def written_entries(writer: Any) -> list[FileEntry]:
    return sorted(writer.fs.entries.values(), key=lambda entry: entry.name)


def first_os_error(writer: Any) -> OSError | None:
    """The first real write error (ENOSPC, EIO) behind a failed DCP save, if any."""
    errors = getattr(getattr(writer, "fs", None), "errors", None)
    return errors[0] if errors else None


def save(folder: Path, state: dict, *, process_group: Any = None, distributed: bool = False,
         thread_count: int = 1, extensions: list | None = None) -> list[FileEntry]:
    """DCP-save `state` into `folder` (every rank of `process_group` when `distributed`); the entries of
    the files this rank wrote (the coordinator's include ``.metadata``)."""
    writer = make_writer(folder, thread_count=thread_count, extensions=extensions)
    with dcp_errors(writer):
        dcp().save(state, storage_writer=writer, process_group=process_group, no_dist=not distributed)
    return written_entries(writer)


def async_save(folder: Path, state: dict, *, process_group: Any, distributed: bool,
               extensions: list | None = None, stager: Any = None) -> tuple[Any, Any]:
    """DCP's async_save (its staging into host memory — `stager`, a `cached_stager()` kept from one save
    to the next — and its upload thread): (future, writer). The entries are in `written_entries(writer)`
    once the future is done."""
    writer = make_writer(folder, extensions=extensions)
    with dcp_errors(writer):
        response = dcp().async_save(state, storage_writer=writer, process_group=process_group,
                                     no_dist=not distributed, async_stager=stager)
    future = getattr(response, "upload_completion", response)
    return future, writer


def cached_stager() -> Any:
    """DCP's blocking stager that keeps its host copy of the state from one async save to the next (DCP's
    own cache pins the memory, which needs a GPU: pinned here only where there is one). Allocating and
    first touching a state's worth of fresh memory at every save costs several times the copy itself
    (bench/bench_checkpoint.py: the copy floor). A state of another layout gets a fresh copy."""
    import torch
    from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
    from torch.distributed.checkpoint.staging import BlockingAsyncStager

    class CachedStager(BlockingAsyncStager):
        def __init__(self) -> None:
            super().__init__(cache_staged_state_dict=True)
            self._layout: Any = None

        def stage(self, state_dict: Any) -> Any:
            layout = _layout_of(state_dict)
            if self.state_dict_cache is None or layout != self._layout:
                self.state_dict_cache = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
                self._layout = layout
            return _copy_state_dict(state_dict, self.state_dict_cache)   # non-tensor values: fresh

    return CachedStager()


def _layout_of(obj: Any) -> Any:
    """The shape of a state: its keys and, for each tensor, its class, shape and dtype."""
    if isinstance(obj, dict):
        return tuple((key, _layout_of(value)) for key, value in obj.items())
    if isinstance(obj, (list, tuple)):
        return tuple(_layout_of(value) for value in obj)
    shape = getattr(obj, "shape", None)
    return (type(obj).__name__, tuple(shape), str(obj.dtype)) if shape is not None else type(obj).__name__


@contextmanager
def dcp_errors(writer: Any = None) -> Iterator[None]:
    """DCP raises CheckpointException (a BaseException, not an Exception) wrapping each rank's error:
    turn it into the real cause — the first OSError a writer saw (ENOSPC), our own CheckpointError from
    inside a reader or planner, or a CheckpointError naming DCP's message."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with _quiet():
            yield
    except (Exception, CheckpointException) as exc:
        if first_os_error(writer) is not None:
            raise first_os_error(writer) from None
        if isinstance(exc, (CheckpointError, OSError)):
            raise
        raise as_checkpoint_error(exc) from None


def as_checkpoint_error(exc: BaseException) -> CheckpointError | OSError:
    causes = list(getattr(exc, "failures", {}).values()) or [exc]
    causes = [cause[0] if isinstance(cause, tuple) else cause for cause in causes]   # (exception, traceback)
    for cause in causes:
        seen = cause
        while seen is not None:
            if isinstance(seen, (CheckpointError, OSError)):
                return seen
            seen = seen.__cause__ or seen.__context__
    text = "; ".join(str(cause) for cause in causes)[:400]
    code = "unsafe_content" if "weights_only" in text or "not allowed" in text or "refused" in text \
        else "load_failed"
    return CheckpointError(f"torch.distributed.checkpoint failed: {text}", code=code)


@contextmanager
def _quiet() -> Iterator[None]:
    # DCP warns on every single-process save/load ("assuming the intent is..."); that is our intent.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled|unavailable)")
        yield


def int_key_paths(state: Any, path: tuple = ()) -> list[list[str]]:
    """Paths of the dicts in `state` whose keys are all ints: DCP turns such keys into strings. Empty
    dicts are listed too, since DCP's flattening drops them (an SGD optimizer without momentum has an
    empty `state`, which `load_state_dict` requires)."""
    found = []
    if isinstance(state, dict):
        if all(isinstance(k, int) and not isinstance(k, bool) for k in state):
            found.append([str(p) for p in path])
        for key, value in state.items():
            found.extend(int_key_paths(value, (*path, key)))
    elif isinstance(state, (list, tuple)):
        for index, value in enumerate(state):
            found.extend(int_key_paths(value, (*path, index)))
    return found
