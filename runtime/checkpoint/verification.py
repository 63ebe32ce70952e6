"""Verification: the one way a checkpoint's bytes are trusted, and the only way they become state.

`verify_dir` checks a directory against its signed manifest: manifest, signature, step, every file's size;
when `deep`, every file's SHA-256 and a ``weights_only`` load of everything in it. `checkpoint verify`,
`checkpoint restore` and the trainer all come through here (the trainer through `verify_and_load`, keeping
what it loaded). A file is opened once, hashed and compared with the manifest, then loaded with
``torch.load(..., weights_only=True)`` through the same descriptor, and its ctime checked again after the
load, so a file swapped or rewritten between the check and the load cannot slip through. Format /2 shards
are hashed here and handed, with their stats, to `sharded_load` (which opens no other file).
"""

from __future__ import annotations

import hashlib
import os
import pickle
import re
from pathlib import Path
from typing import IO, Any

from trainguard import rundir, safe_read
from trainguard.runtime.checkpoint import manifest as mf
from trainguard.runtime.checkpoint import store
from trainguard.runtime.checkpoint.manifest import CheckpointError, FileEntry, VerifyResult


class _SizeChanged(Exception):
    pass


def _read_hashed(handle: IO[bytes], size: int) -> str:
    """SHA-256 of exactly `size` bytes of `handle`, read into one scratch buffer while the hash thread
    digests the other (or inline, where store.PARALLEL_HASH is off)."""
    if not store.PARALLEL_HASH:   # one small buffer, reused (two fresh 8 MiB ones per file cost ~9 ms each)
        digest = hashlib.file_digest(handle, "sha256")
        if handle.tell() != size:
            raise _SizeChanged
        return digest.hexdigest()
    sha = hashlib.sha256()
    scratch = [memoryview(bytearray(min(store.CHUNK, size) or 1)) for _ in range(2)]
    pending, pos, turn = None, 0, 0
    while pos < size:
        view = scratch[turn % 2][:min(store.CHUNK, size - pos)]
        got = handle.readinto(view)
        if pending is not None:
            pending.result()
        if not got:
            break
        if store.PARALLEL_HASH:
            pending = store.hash_pool().submit(sha.update, view[:got])
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


def _open_listed(path: Path, entry: FileEntry) -> IO[bytes]:
    """A listed file, opened through trainguard.safe_read: a FIFO or a device in its place (`extra.pt` as a
    FIFO hung every reader) is refused as not there, before a byte is read; CheckpointError either way."""
    try:
        return safe_read.open_file(path, what="checkpoint file", buffering=0)
    except FileNotFoundError:
        raise CheckpointError(_missing(entry)[1], code=mf.MISSING_FILE, path=path) from None
    except safe_read.RunFileError as exc:
        raise CheckpointError(f"{entry.name} is listed in the manifest but {exc.reason}", code=mf.MISSING_FILE,
                              path=path) from None


def check_file(path: Path, entry: FileEntry, deep: bool) -> tuple[str, str] | None:
    try:
        handle = _open_listed(path, entry)
    except CheckpointError as exc:
        return exc.code, str(exc)
    with handle:
        return _check_handle(handle, entry, deep)


def read_manifest(path: Path) -> dict:
    try:
        data = safe_read.read_bytes(path / mf.MANIFEST_NAME, safe_read.MANIFEST_BYTES, "manifest")
    except FileNotFoundError:
        raise CheckpointError("no manifest.json (a save that never finished, or not a trainguard checkpoint)",
                              code=mf.MISSING_MANIFEST, path=path) from None
    except OSError as exc:      # a FIFO or a device (never opened to block), too large, unreadable
        why = exc.reason if isinstance(exc, safe_read.RunFileError) else exc.strerror or str(exc)
        raise CheckpointError(f"manifest.json: {why}", code=mf.UNREADABLE_MANIFEST, path=path) from None
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
    step = rundir.step_of_dir(path.name)
    try:
        manifest = read_manifest(path)
    except CheckpointError as exc:
        return VerifyResult.refused(path, exc.code, str(exc), step), None
    problem = mf.check_signature(manifest, key, key_id) or mf.check_step(manifest, path.name)
    for entry in mf.entries(manifest) if problem is None else ():
        problem = check_file(path / entry.name, entry, deep=False)
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
    from trainguard.runtime.checkpoint import compress, sharded, sharded_load, state as state_mod

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
    handle = _open_listed(path, entry)
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
        handle = _open_listed(path, entry)
    except CheckpointError as exc:
        raise refuse(exc.code, str(exc)) from None
    with handle:
        before = os.fstat(handle.fileno())
        problem = _check_handle(handle, entry, deep=True)
        if problem:
            raise refuse(*problem)
        handle.seek(0)
        try:
            state = torch.load(handle, map_location=load_location(map_location), weights_only=True)
        except pickle.UnpicklingError as exc:
            raise refuse(mf.UNSAFE_CONTENT, f"{entry.name}: torch.load(weights_only=True) refused it "
                                            f"({_why_refused(exc)})") from None
        after = os.fstat(handle.fileno())
    if (after.st_size, after.st_mtime_ns, after.st_ctime_ns) != (before.st_size, before.st_mtime_ns,
                                                                 before.st_ctime_ns):
        raise refuse(mf.HASH_MISMATCH, f"{entry.name} was written to while it was being loaded")
    return state


def load_location(device: Any) -> Any:
    """`map_location` for torch.load: a CPU device with an index (`cpu:0`, what a Transformers Trainer's
    `args.device` is under torchrun) as plain "cpu". torch.load knows no `cpu:N` location and would refuse
    every checkpoint, so a run under torchrun could never resume."""
    import torch

    if isinstance(device, (str, torch.device)) and torch.device(device).type == "cpu":
        return "cpu"
    return device


def _why_refused(exc: Exception) -> str:
    """The line of torch's long weights_only message that names what was refused."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line).strip() for line in str(exc).splitlines()]
    lines = [line for line in lines if line]
    named = [line for line in lines if "GLOBAL" in line or "Unsupported" in line or "WeightsUnpickler" in line]
    return (named or lines or [type(exc).__name__])[0]
