"""Checkpoint directories on disk: hashed while written, atomic, durable; verified while read.

A checkpoint is written into ``RUN/checkpoints/.tmp-step_<N>-<host>-<pid>/``; every file is hashed on
its way to disk, fsynced, the manifest is written last, the directory is fsynced and renamed to
``step_<N>``, and the parent is fsynced. A crash at any point leaves either the old state or the new
one under the final name, never a partial checkpoint. Deletion is the same in reverse: rename out of
the way first, then remove.

Reading: a file is opened once, hashed and compared with the manifest, then loaded with
``torch.load(..., weights_only=True)`` through the same descriptor, and its ctime checked again after
the load, so a file swapped or rewritten between the check and the load cannot slip through.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import re
import shutil
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

from trainguard.trainer.checkpoint import manifest as mf
from trainguard.trainer.checkpoint.manifest import CheckpointError, FileEntry, VerifyResult
from trainguard.trainer.checkpoint.state import tensor_bytes

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


def _pool() -> ThreadPoolExecutor:
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
                hashing = _pool().submit(self._sha.update, view)
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
            shutil.copyfile(source / name, tmp / name)
            with open(tmp / name, "rb+") as handle:
                os.fsync(handle.fileno())
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


# --------------------------------------------------------------------------------- reading, verifying

class _SizeChanged(Exception):
    pass


def _read_hashed(handle: IO[bytes], size: int) -> str:
    """SHA-256 of exactly `size` bytes of `handle`, read into one scratch buffer while the hash thread
    digests the other (or inline, where PARALLEL_HASH is off)."""
    if not PARALLEL_HASH:   # one small buffer, reused (two fresh 8 MiB ones per file cost ~9 ms each)
        digest = hashlib.file_digest(handle, "sha256")
        if handle.tell() != size:
            raise _SizeChanged
        return digest.hexdigest()
    sha = hashlib.sha256()
    scratch = [memoryview(bytearray(min(CHUNK, size) or 1)) for _ in range(2)]
    pending, pos, turn = None, 0, 0
    while pos < size:
        view = scratch[turn % 2][:min(CHUNK, size - pos)]
        got = handle.readinto(view)
        if pending is not None:
            pending.result()
        if not got:
            break
        if PARALLEL_HASH:
            pending = _pool().submit(sha.update, view[:got])
        else:
            sha.update(view[:got])
        pos, turn = pos + got, turn + 1
    if pending is not None:
        pending.result()
    if pos != size or handle.read(1):
        raise _SizeChanged
    return sha.hexdigest()


def _check_handle(handle: IO[bytes], entry: FileEntry, deep: bool) -> tuple[str, str] | None:
    size = os.fstat(handle.fileno()).st_size
    if size != entry.bytes:
        return mf.SIZE_MISMATCH, (f"{entry.name} has {size} bytes, the manifest says {entry.bytes} "
                                  "(truncated or extended)")
    if not deep:
        return None
    try:
        digest = _read_hashed(handle, size)
    except _SizeChanged:
        return mf.SIZE_MISMATCH, f"{entry.name} changed size while it was read"
    if digest != entry.sha256:
        return mf.HASH_MISMATCH, (f"{entry.name} has sha256 {digest[:12]}…, the manifest says "
                                  f"{entry.sha256[:12]}… (content changed)")
    return None


def _missing(entry: FileEntry) -> tuple[str, str]:
    return mf.MISSING_FILE, f"{entry.name} is listed in the manifest but not there"


def _check_file(path: Path, entry: FileEntry, deep: bool) -> tuple[str, str] | None:
    try:
        with open(path, "rb", buffering=0) as handle:
            return _check_handle(handle, entry, deep)
    except FileNotFoundError:
        return _missing(entry)


def read_manifest(path: Path) -> dict:
    try:
        data = (path / mf.MANIFEST_NAME).read_bytes()
    except FileNotFoundError:
        raise CheckpointError("no manifest.json (a save that never finished, or not a trainguard checkpoint)",
                              code=mf.MISSING_MANIFEST, path=path) from None
    except OSError as exc:
        raise CheckpointError(f"manifest.json: {exc.strerror}", code=mf.UNREADABLE_MANIFEST, path=path) from None
    try:
        return mf.parse(data)
    except ValueError as exc:
        raise CheckpointError(f"manifest.json: {exc}", code=mf.UNREADABLE_MANIFEST, path=path) from None


def verify_dir(path: Path, key: bytes, key_id: str, *, deep: bool = True) -> VerifyResult:
    """Manifest, signature, step and every file's size; when `deep`, every file's SHA-256 and a
    ``weights_only`` load of everything in it. The one verification: `checkpoint verify`, `restore` and
    the trainer all come through here (the trainer through `verify_and_load`, keeping what it loaded)."""
    return verify_and_load(path, key, key_id, deep=deep)[0]


def verify_and_load(path: Path, key: bytes, key_id: str, *, deep: bool = True, into: dict | None = None,
                    map_location: Any = "cpu", agree: Any = None,
                    process_group: Any = None) -> tuple[VerifyResult, dict | None]:
    """`verify_dir`, and the state it loaded while checking (None unless `deep` and ok).

    `into`: a format-/2 checkpoint is loaded into this state dict in place through DCP, resharded to its
    layout (a collective over `process_group` when given: every rank calls). `agree(ok) -> all_ok` lets
    the ranks of such a load agree that every rank's files verified before any of them loads.
    """
    step = mf.step_of_dir(path.name)
    try:
        manifest = read_manifest(path)
    except CheckpointError as exc:
        return VerifyResult.refused(path, exc.code, str(exc), step), None
    problem = mf.check_signature(manifest, key, key_id) or mf.check_step(manifest, path.name)
    for entry in mf.entries(manifest) if problem is None else ():
        problem = _check_file(path / entry.name, entry, deep=False)
        if problem:
            break
    if problem is None and not deep:
        return VerifyResult(path, True, mf.OK, "ok", manifest["step"], manifest), None
    state = None
    if problem is None:
        try:
            state = _load_checked(path, manifest, into, map_location, agree, process_group)
        except CheckpointError as exc:
            problem = (exc.code, _detail(exc, path))
    elif agree is not None:
        agree(False)
    if problem:
        return VerifyResult.refused(path, *problem, step), None
    return VerifyResult(path, True, mf.OK, "ok", manifest["step"], manifest), state


def _detail(exc: CheckpointError, path: Path) -> str:
    """The reason without the directory and code prefix load_verified puts in front (refused adds them)."""
    text = str(exc)
    for prefix in (f"{path}: ", f"{exc.code.replace('_', ' ')}: "):
        text = text.removeprefix(prefix)
    return text


def _load_checked(path: Path, manifest: dict, into: dict | None, map_location: Any, agree: Any,
                  process_group: Any) -> dict:
    from trainguard.trainer.checkpoint import compress, sharded, sharded_load, state as state_mod

    entries = mf.entries(manifest)
    layout = mf.layout(manifest)
    if not layout:   # format /1: each file hashed and loaded through one descriptor
        if agree is not None and not agree(True):
            raise CheckpointError("another rank could not verify its files", code="peer_refused")
        return state_mod.join({e.name: load_verified(path / e.name, e, map_location) for e in entries})
    stats: dict[str, os.stat_result] = {}
    try:
        meta_entry = next((e for e in entries if e.name == sharded.METADATA), None)
        if meta_entry is None:
            raise CheckpointError(f"{sharded.METADATA} is not in the manifest", code=mf.MISSING_FILE, path=path)
        stats[meta_entry.name], kept = _hash_checked(path / meta_entry.name, meta_entry, keep=True)
        metadata = sharded_load.read_metadata_bytes(kept or b"")   # refused here, with its reason, before DCP sees it
        # Only the files this rank's load reads are hashed (a whole load: every shard); DCP can open no
        # other (`sharded_load.SafeReader` refuses a file whose stat was not taken here).
        reads = sharded_load.files_read(into, metadata)
        for entry in entries:
            if entry.name not in (state_mod.EXTRA_FILE, sharded.METADATA) and (reads is None or entry.name in reads):
                stats[entry.name], _ = _hash_checked(path / entry.name, entry, keep=False)
    except CheckpointError:
        if agree is not None:
            agree(False)
        raise
    if agree is not None and not agree(True):
        raise CheckpointError("another rank could not verify its files", code="peer_refused")
    extra_entry = next((e for e in entries if e.name == state_mod.EXTRA_FILE), None)
    extra = load_verified(path / extra_entry.name, extra_entry, map_location) if extra_entry else {}
    extensions = compress.reader_registry()
    try:
        if into is None:
            tensors = sharded_load.load_full(path, metadata, stats, int_key_paths=layout.get("int_key_paths", []),
                                             extensions=extensions)
        else:
            sharded_load.load_into(path, into, metadata, stats, process_group=process_group,
                                   distributed=process_group is not None, extensions=extensions)
            tensors = into
    except OSError as exc:
        raise CheckpointError(f"could not read it ({exc})", code="load_failed", path=path) from None
    if into is None:
        tensors = compress.restore_dtypes(tensors, layout.get("dtypes", {}))
    return {**tensors, **extra}


def _hash_checked(path: Path, entry: FileEntry, keep: bool) -> tuple[os.stat_result, bytes | None]:
    """Hash one file against its entry; its stat (for the load to check again) and, when `keep`, its bytes."""
    try:
        handle = open(path, "rb", buffering=0)
    except FileNotFoundError:
        raise CheckpointError(_missing(entry)[1], code=mf.MISSING_FILE, path=path) from None
    with handle:
        seen = os.fstat(handle.fileno())
        if keep:
            data = handle.read()
            digest = hashlib.sha256(data).hexdigest()
            if len(data) != entry.bytes:
                raise CheckpointError(f"{entry.name} has {len(data)} bytes, the manifest says {entry.bytes} "
                                      "(truncated or extended)", code=mf.SIZE_MISMATCH, path=path)
            if digest != entry.sha256:
                raise CheckpointError(f"{entry.name} has sha256 {digest[:12]}…, the manifest says "
                                      f"{entry.sha256[:12]}… (content changed)", code=mf.HASH_MISMATCH, path=path)
            return seen, data
        problem = _check_handle(handle, entry, deep=True)
        if problem:
            raise CheckpointError(problem[1], code=problem[0], path=path)
        return seen, None


def load_verified(path: Path, entry: FileEntry, map_location: Any) -> Any:
    """Hash the file, then ``torch.load(weights_only=True)`` it through the same descriptor; nothing else loads.

    One descriptor means a file renamed over this one in between is not what gets loaded; a write into
    this very file in between changes its ctime, which is compared after the load. Either way, weights_only
    means nothing in the file is ever executed.
    """
    import torch

    def refuse(code: str, detail: str) -> CheckpointError:
        return CheckpointError(f"{path.parent}: {code.replace('_', ' ')}: {detail}", code=code, path=path)

    try:
        handle = open(path, "rb", buffering=0)
    except FileNotFoundError:
        raise refuse(*_missing(entry)) from None
    with handle:
        before = os.fstat(handle.fileno())
        problem = _check_handle(handle, entry, deep=True)
        if problem:
            raise refuse(*problem)
        handle.seek(0)
        try:
            state = torch.load(handle, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise refuse(mf.UNSAFE_CONTENT, f"{entry.name}: torch.load(weights_only=True) refused it "
                                            f"({_why_refused(exc)})") from None
        after = os.fstat(handle.fileno())
    if (after.st_size, after.st_mtime_ns, after.st_ctime_ns) != (before.st_size, before.st_mtime_ns,
                                                                 before.st_ctime_ns):
        raise refuse(mf.HASH_MISMATCH, f"{entry.name} was written to while it was being loaded")
    return state


def _why_refused(exc: Exception) -> str:
    """The line of torch's long weights_only message that names what was refused."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(exc).splitlines()]
    lines = [line for line in lines if line]
    named = [line for line in lines if "GLOBAL" in line or "Unsupported" in line or "WeightsUnpickler" in line]
    return (named or lines or [type(exc).__name__])[0]
