"""Checkpoint directories on disk: hashed while written, atomic, durable.

A checkpoint is written into ``RUN/checkpoints/.tmp-step_<N>-<host>-<pid>/``; every file is hashed on
its way to disk, fsynced, the manifest is written last, the directory is fsynced and renamed to
``step_<N>``, and the parent is fsynced. A crash at any point leaves either the old state or the new
one under the final name, never a partial checkpoint. Deletion is the same in reverse: rename out of
the way first, then remove.

Reading them back, verified, is `verification.py` (its names stay importable from here too).
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

from trainguard import safe_read
from trainguard.runtime.checkpoint.manifest import FileEntry
from trainguard.runtime.checkpoint.state import tensor_bytes

CHUNK = 8 << 20
# Below this a write is hashed inline: handing it to the hash thread costs more than it saves.
PARALLEL_HASH_MIN = 1 << 20


def _usable_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


CPUS = _usable_cpus()
# A hash thread beside the writer of a file pays off when it has a core of its own. An async save runs
# beside training, so it uses one only with 4 CPUs or more (measured on a busy 2-CPU host: 17% slower
# than hashing inline); a sync save has the host to itself (`save_files(..., concurrent=True)`).
PARALLEL_HASH = CPUS >= 4
TMP, TRASH = ".tmp-", ".trash-"
_PRIVATE = re.compile(r"\A\.(tmp|trash)-(.+)-(.+)-([0-9]+)\Z")
# Private dirs of another host cannot be checked for a live owner; they are removed once this old.
FOREIGN_STALE_SECONDS = 24 * 3600

# Ask the kernel to start writing back every this many bytes, so the final fsync waits for the tail only.
WRITEBACK_EVERY = 32 << 20

_hash_pool: ThreadPoolExecutor | None = None
_sync_file_range = None


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """sync_file_range(SYNC_FILE_RANGE_WRITE): start writeback of a range without waiting (Linux; elsewhere
    a no-op and the fsync at the end does all the work)."""
    global _sync_file_range
    if _sync_file_range is None:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        function = getattr(libc, "sync_file_range", None)
        if function is not None:
            function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
        _sync_file_range = function or False
    if _sync_file_range:
        _sync_file_range(fd, offset, nbytes, 2)  # SYNC_FILE_RANGE_WRITE; a failure only loses the head start


def hash_pool() -> ThreadPoolExecutor:
    """Threads that hash while their callers write or read (one per CPU, for files written at once);
    hashlib releases the GIL."""
    global _hash_pool
    if _hash_pool is None:
        _hash_pool = ThreadPoolExecutor(max_workers=max(CPUS, 2), thread_name_prefix="trainguard-hash")
    return _hash_pool


def fsync_dir(path: Path) -> None:
    """Make a rename or a new entry in `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ------------------------------------------------------------------------------------------- writing

class HashingWriter:
    """The file object handed to ``torch.save``: each byte is hashed as it goes to disk, no second pass.

    With 4 CPUs or more, large writes (tensor storages) are hashed on the hash thread while this thread
    writes them, so the cost is close to the slower of the two rather than their sum.
    """

    def __init__(self, raw: IO[bytes], parallel: bool | None = None):
        self._raw = raw
        self._parallel = PARALLEL_HASH if parallel is None else parallel
        self._sha = hashlib.sha256()
        self.bytes = 0
        self._written_back = 0
        # torch.save masks an error raised by write() with its own "unexpected pos" error when it closes
        # the archive; the first real one (ENOSPC, EIO) is kept here to be reported instead.
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        try:
            if self._parallel and view.nbytes >= PARALLEL_HASH_MIN:
                hashing = hash_pool().submit(self._sha.update, view)
                try:
                    self._raw.write(view)
                finally:
                    hashing.result()  # torch reuses the memory once write() returns
            else:
                self._sha.update(view)
                self._raw.write(view)
        except OSError as exc:
            self.error = self.error or exc
            raise
        self.bytes += view.nbytes
        if self.bytes - self._written_back >= WRITEBACK_EVERY:
            self._raw.flush()
            _start_writeback(self._raw.fileno(), self._written_back, self.bytes - self._written_back)
            self._written_back = self.bytes
        return view.nbytes

    def flush(self) -> None:
        self._raw.flush()

    def hexdigest(self) -> str:
        return self._sha.hexdigest()


def save_file(path: Path, obj: Any, parallel_hash: bool | None = None) -> FileEntry:
    """torch.save `obj` to a new file at `path`, hashed while written, flushed and fsynced."""
    import torch

    with open(path, "xb") as raw:
        writer = HashingWriter(raw, parallel_hash)
        try:
            torch.save(obj, writer)
        except Exception:
            if writer.error is not None:
                raise writer.error from None
            raise
        raw.flush()
        os.fsync(raw.fileno())
    return FileEntry(path.name, writer.hexdigest(), writer.bytes)


def save_files(folder: Path, parts: dict[str, Any], concurrent: bool = False) -> list[FileEntry]:
    """`save_file` for each part, in `parts`' order. With `concurrent` (and more than one CPU) the files
    are written at once, largest first, each with a hash thread beside its writer: one file's hashing
    overlaps another's writing, the way to keep a verified save close to a plain one. Every writer has
    finished before this returns or raises (the first error, in `parts`' order)."""
    if not concurrent or CPUS < 2 or len(parts) < 2:
        return [save_file(folder / name, obj) for name, obj in parts.items()]
    largest_first = sorted(parts, key=lambda name: -tensor_bytes(parts[name]))
    with ThreadPoolExecutor(max_workers=len(parts), thread_name_prefix="trainguard-save") as writers:
        futures = {name: writers.submit(save_file, folder / name, parts[name], True) for name in largest_first}
    return [futures[name].result() for name in parts]


def write_bytes(path: Path, data: bytes) -> None:
    with open(path, "xb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def host_tag() -> str:
    """This host's name as it appears in private directory names (no dashes: they separate fields)."""
    return re.sub(r"[^A-Za-z0-9_.]", "_", socket.gethostname()) or "host"


def private_dir(root: Path, kind: str, name: str) -> Path:
    """A name no other process or host uses: ``.tmp-step_12-node7-4242``."""
    return root / f"{kind}{name}-{host_tag()}-{os.getpid()}"


def publish(tmp: Path, final: Path) -> None:
    """Atomically give the finished directory `tmp` its final name (replacing an older one of that name)."""
    fsync_dir(tmp)
    aside = None
    if final.exists():  # a step saved again after a rollback: move the old one out of the way first
        aside = private_dir(final.parent, TRASH, final.name)
        os.rename(final, aside)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


def copy_dir(source: Path, names: list[str], final: Path) -> None:
    """Copy the named files of a checkpoint to `final`, with the same tmp, fsync and rename as a save."""
    tmp = private_dir(final.parent, TMP, final.name)
    try:
        tmp.mkdir()
        for name in names:
            with safe_read.open_file(source / name, what="checkpoint file") as src, \
                    open(tmp / name, "xb") as out:    # a FIFO or a device in the source is refused, not copied
                shutil.copyfileobj(src, out, 1 << 20)
                out.flush()
                os.fsync(out.fileno())
        publish(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_dir(path: Path) -> None:
    """Delete a checkpoint so that a crash half-way never leaves half a checkpoint under its name."""
    aside = private_dir(path.parent, TRASH, path.name)
    os.rename(path, aside)
    fsync_dir(path.parent)
    shutil.rmtree(aside, ignore_errors=True)


def _owner_is_gone(host: str, pid: int, age: float) -> bool:
    if host != host_tag():
        return age > FOREIGN_STALE_SECONDS
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def clean_stale(root: Path) -> list[Path]:
    """Remove the temporary and half-deleted directories that crashed processes left behind."""
    removed = []
    now = time.time()
    for path in root.iterdir() if root.is_dir() else ():
        match = _PRIVATE.match(path.name)
        if not match or not path.is_dir():
            continue
        try:
            age = now - path.stat().st_mtime
        except FileNotFoundError:
            continue
        if _owner_is_gone(match.group(3), int(match.group(4)), age):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed

