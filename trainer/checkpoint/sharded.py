"""Sharded checkpoints through torch.distributed.checkpoint (DCP), with trainguard's guarantees kept.

Writing: every rank writes its own shard files through DCP's ``FileSystemWriter``; the file system under
it hashes each file once DCP has written and fsynced it, reading it back from the page cache in the thread
that wrote it (`HashingFileSystem`), so a rank knows the SHA-256 and size of every file it wrote. The
coordinator's ``.metadata`` is hashed the same way. (Hashing DCP's many small writes as they passed cost
more: docs/checkpoints.md, "Hashing beside the writer".) The caller
(the manager) gathers those entries to rank 0, which signs the manifest and renames the directory.

Reading: nothing here trusts a byte that was not verified first. `SafeReader` unpickles ``.metadata``
with an allowlist (DCP itself uses a bare ``pickle.load``), opens each shard only if its size and times
are still those that were hashed, and the planners load non-tensor items with ``weights_only=True``
(DCP's default planner uses ``weights_only=False``). Tensor items are loaded by DCP with
``weights_only=True`` already.
"""

from __future__ import annotations

import hashlib
import io
import os
import pickle
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from trainguard.trainer.checkpoint.manifest import CheckpointError, FileEntry

METADATA = ".metadata"
# DCP warns at every single-process save or load ("assuming the intent is to save in a single process"),
# also from its async upload thread, where a catch_warnings around the call does not reach: that is our
# intent, so this one message is ignored process-wide.
warnings.filterwarnings("ignore", message=r"torch\.distributed is (disabled|unavailable)")
SHARD_SUFFIX = ".distcp"


def _dcp():
    import torch.distributed.checkpoint as dcp

    return dcp


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
            from trainguard.trainer.checkpoint import store

            self.hashing = store._pool().submit(hash_written, self._path)
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
    with open(path, "rb", buffering=0) as handle:
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
    with _dcp_errors(writer):
        _dcp().save(state, storage_writer=writer, process_group=process_group, no_dist=not distributed)
    return written_entries(writer)


def async_save(folder: Path, state: dict, *, process_group: Any, distributed: bool,
               extensions: list | None = None, stager: Any = None) -> tuple[Any, Any]:
    """DCP's async_save (its staging into host memory — `stager`, a `cached_stager()` kept from one save
    to the next — and its upload thread): (future, writer). The entries are in `written_entries(writer)`
    once the future is done."""
    writer = make_writer(folder, extensions=extensions)
    with _dcp_errors(writer):
        response = _dcp().async_save(state, storage_writer=writer, process_group=process_group,
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
def _dcp_errors(writer: Any = None) -> Iterator[None]:
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


# ------------------------------------------------------------------------------------------- reading

class _MetadataUnpickler(pickle.Unpickler):
    """DCP's `.metadata` is a pickle; only the classes that describe a checkpoint may appear in it."""

    _MODULES = {"torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem"}

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if module in self._MODULES and not name.startswith("__"):
            found = getattr(__import__(module, fromlist=[name]), name, None)
            if isinstance(found, type) or name == "_MEM_FORMAT_ENCODING":
                return found
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if (module, name) in (("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                              ("pathlib", "PurePosixPath")):
            return getattr(__import__(module, fromlist=[name]), name)
        raise pickle.UnpicklingError(f"{METADATA}: global '{module}.{name}' is not allowed in checkpoint metadata")


def read_metadata_bytes(data: bytes) -> Any:
    """The DCP metadata from verified bytes; CheckpointError("unsafe_content") for anything else."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as exc:
        raise CheckpointError(f"{METADATA}: refused ({exc})", code="unsafe_content") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"{METADATA}: not DCP metadata", code="unsafe_content")
    return metadata


def _reader_class():
    from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class VerifiedFileSystem(FileSystem):
        """Opens a shard only if the opened descriptor is still the file that was hashed (same inode,
        size, mtime and ctime: a rename over it or a write into it since shows)."""

        def __init__(self, verified: dict[str, os.stat_result]):
            super().__init__()
            self.verified = verified

        @contextmanager
        def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
            with super().create_stream(path, mode) as stream:
                _still_as_verified(Path(path), os.fstat(stream.fileno()), self.verified.get(Path(path).name))
                yield stream

    class SafeReader(FileSystemReader):
        """Reads only what was verified: `.metadata` as parsed from the verified bytes with an allowlist
        (`read_metadata_bytes`), each shard through `VerifiedFileSystem`."""

        def __init__(self, folder: Path, metadata: Any, verified: dict[str, os.stat_result],
                     extension_registry: Any = None):
            super().__init__(folder, _extension_registry=extension_registry)
            self.fs = VerifiedFileSystem(verified)
            self._metadata = metadata

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = self._metadata
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader


def _still_as_verified(path: Path, now: os.stat_result, seen: os.stat_result | None) -> None:
    if seen is None:
        raise CheckpointError(f"{path.name} is read by the checkpoint but was not verified (not in its "
                              "manifest, or not in this rank's load plan)", code="missing_file", path=path)
    if (now.st_size, now.st_mtime_ns, now.st_ctime_ns, now.st_ino) != (seen.st_size, seen.st_mtime_ns,
                                                                       seen.st_ctime_ns, seen.st_ino):
        raise CheckpointError(f"{path.name} changed after it was verified", code="hash_mismatch", path=path)


def _load_bytes_safely(value: io.BytesIO) -> Any:
    import torch

    try:
        return torch.load(value, weights_only=True)
    except pickle.UnpicklingError as exc:
        first = next((line for line in str(exc).splitlines() if "GLOBAL" in line or "Unsupported" in line),
                     type(exc).__name__)
        raise CheckpointError(f"torch.load(weights_only=True) refused an item ({first.strip()})",
                              code="unsafe_content") from None


def _planners():
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner

    class SafeLoadPlanner(DefaultLoadPlanner):
        """DCP's planner, loading non-tensor items with weights_only=True."""

        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            loaded = _load_bytes_safely(value)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    class SafeFullPlanner(_EmptyStateDictLoadPlanner):
        """Rebuilds the whole state from the metadata (no target needed), non-tensors weights_only."""

        load_bytes = SafeLoadPlanner.load_bytes

    return SafeLoadPlanner, SafeFullPlanner


def files_read(target: dict | None, metadata: Any) -> set[str] | None:
    """The shard files a load into `target` reads (DCP's own planning of this rank's reads, done ahead on a
    planner of its own, which leaves `target` as it is), or None for a whole load (every file)."""
    if target is None:
        return None
    safe, _ = _planners()
    planner = safe()
    with _dcp_errors():
        planner.set_up_planner(target, metadata, False)
        plan = planner.create_local_plan()
    return {metadata.storage_data[item.storage_index].relative_path for item in plan.items}


def load_into(folder: Path, target: dict, metadata: Any, verified: dict[str, os.stat_result], *,
              process_group: Any = None, distributed: bool = False, extensions: Any = None) -> None:
    """DCP-load into `target` in place, resharding to its layout (DTensors of any world size)."""
    safe, _ = _planners()
    reader = _reader_class()(folder, metadata, verified, extensions)
    with _dcp_errors():
        _dcp().load(target, storage_reader=reader, planner=safe(), process_group=process_group,
                    no_dist=not distributed)


def load_full(folder: Path, metadata: Any, verified: dict[str, os.stat_result], *,
              int_key_paths: list[list[str]] = (), extensions: Any = None) -> dict:
    """The whole saved state as plain tensors, in this process (no collective): any world size can read
    it. Dicts whose keys were ints when saved (an optimizer's `state`) get int keys back."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    _, full = _planners()
    reader = _reader_class()(folder, metadata, verified, extensions)
    state: dict = {}
    with _dcp_errors():
        _load_state_dict(state, storage_reader=reader, planner=full(), no_dist=True)
    for path in int_key_paths:
        _restore_int_keys(state, path)
    return state


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


def _restore_int_keys(state: Any, path: list[str]) -> None:
    holder = state
    for part in path[:-1]:
        holder = holder[int(part)] if isinstance(holder, list) else holder.setdefault(part, {})
        if not isinstance(holder, (dict, list)):
            return
    last = path[-1] if path else None
    if last is None:
        return
    if isinstance(holder, list):
        holder[int(last)] = {int(k): v for k, v in holder[int(last)].items()}
    elif isinstance(holder, dict) and isinstance(holder.setdefault(last, {}), dict):
        holder[last] = {int(k): v for k, v in holder[last].items()}
