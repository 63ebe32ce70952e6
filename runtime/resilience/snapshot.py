"""The in-memory snapshot tier: a rank's whole train state in host memory every `snapshot_every` steps.

    store = SnapshotStore(Path("/dev/shm"), run_dir, rank=r, world_size=w, key=key, key_id=kid)
    snaps = Snapshotter(store, protector.states, every=5, emit=telemetry.event, log=log)
    ...; snaps.after_step(step, base_step=state.last_saved_step)       # after every step
    parts = store.load(step, map_location=device)                    # verified, or SnapshotRefused

Where: ``<root>/trainguard-<uid>/<tag>/rank-<r>/snapshot-<N>.snap`` and its manifest ``snapshot-<N>.json``. The
root is a tmpfs (/dev/shm): host memory, which outlives the process, so a worker torchrun restarts on the
same node reads it without touching storage, and an in-process restart reads it at memory speed. The tag
is an HMAC of the run directory under the run's key: a stranger cannot compute the name ahead of time.
Every directory is this user's, mode 0700, and not a link; a directory that is not is refused (snapshots
off, said loudly), never used.

Taking one, as the async checkpoint does: on the step's thread, the state is copied into host buffers that
are kept from one snapshot to the next (runtime/checkpoint/state.py's `Stager`: pinned for GPU tensors,
one synchronize); that copy's time is the step's whole cost (`blocking_seconds` of the `snapshot_saved`
event). A thread serializes it (torch.save), hashes it (SHA-256), writes the payload, then the manifest
(the commit point: a payload without a manifest is no snapshot) signed with the run's key under the purpose
"snapshot/1", bound to the run, the rank, the world size and the step. Then the rank keeps its newest
`snapshot_keep` and deletes the older ones (its own files only).

Loading one: the manifest through trainguard/safe_read.py (a bounded regular file), its signature and
binding checked, the payload read bounded by the manifest's size, its SHA-256 compared, and only then
``torch.load(weights_only=True)``: a forged or changed file in /dev/shm never becomes a rank's state.

Kept, as docs/recovery.md promises: a rank's newest `snapshot_keep` snapshots from the moment they are
written until the run completes (a clean end clears them: the final checkpoint holds that state) or a
fresh start of the run directory by another job (no checkpoint to continue; torchrun's run id differs)
clears what the earlier job left.
A rollback deletes the snapshots newer than the step it went back to (an abandoned timeline).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import stat
import threading
import time
from pathlib import Path
from typing import Any, Callable

from trainguard import event_types, safe_read, signed

PURPOSE = "snapshot/1"
DIR_PURPOSE = "snapshot-dir/1"
DATA, MANIFEST = ".snap", ".json"
NAME = re.compile(r"^snapshot-(\d+)\.(snap|json)$")
TMP_PREFIX = ".snapshot-"
# Room left on the tmpfs beyond the snapshot itself: a full /dev/shm breaks NCCL and dataloader workers.
HEADROOM_BYTES = 64 * 2**20


class SnapshotRefused(Exception):
    """A snapshot that must not be loaded; `reason` is a short word (the event's), the text says why."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def snapshot_root(run_dir: Path, key: bytes, root: Path) -> Path:
    """The run's directory under the tmpfs root (per user, then a keyed tag of the run directory)."""
    tag = signed.tag(key, DIR_PURPOSE, str(Path(os.path.abspath(run_dir))))
    return Path(root) / f"trainguard-{os.geteuid()}" / tag


class SnapshotStore:
    """One rank's snapshots on the tmpfs: write, list, verify and load, keep the newest, clear."""

    def __init__(self, root: Path, run_dir: Path, *, rank: int, world_size: int, key: bytes, key_id: str,
                 keep: int = 2, max_bytes: int = 8 * 2**30, directory: str | None = None):
        """`directory`: the folder's name under the run's (default ``rank-<rank>``); a peer holding this
        rank's replicas names its own (runtime/resilience/replicate.py), bound to `rank` all the same."""
        self.run = str(Path(os.path.abspath(run_dir)))
        # The launcher's job (torchrun's rendezvous run id, the same across its restarts): a fresh start of
        # the run directory by another job does not take what an earlier job left (restore.after_resume).
        self.job = os.environ.get("TORCHELASTIC_RUN_ID", "")
        self.rank, self.world = rank, world_size
        self.key, self.key_id = key, key_id
        self.keep, self.max_bytes = keep, max_bytes
        self.base = snapshot_root(run_dir, key, root)
        self.dir = self.base / (directory or f"rank-{rank}")

    # ---------------------------------------------------------------------------------- the directory
    def prepare(self) -> str | None:
        """Create this rank's directory (0700) and check every level we own; None, or why it is unusable."""
        for level in (self.base.parent, self.base, self.dir):
            try:
                level.mkdir(mode=0o700, exist_ok=True)
            except OSError as exc:
                return f"{level}: cannot be created: {exc.strerror or exc}"
            if (problem := _not_private(level)) is not None:
                return problem
        for leftover in self.dir.iterdir():      # a write a killed process of this rank left half done
            if leftover.name.startswith(TMP_PREFIX) and not leftover.name.endswith(f".{os.getpid()}.tmp"):
                _remove(leftover)
        return None

    def steps(self) -> list[int]:
        """Steps with a manifest here (committed snapshots, not yet verified), newest first."""
        try:
            names = [entry.name for entry in os.scandir(self.dir)]
        except OSError:
            return []
        found = {int(m.group(1)) for name in names if (m := NAME.match(name)) and m.group(2) == "json"}
        return sorted(found, reverse=True)

    def path(self, step: int, suffix: str) -> Path:
        return self.dir / f"snapshot-{step}{suffix}"

    # ----------------------------------------------------------------------------------------- write
    def write(self, step: int, payload: bytes, *, base_step: int | None) -> Path:
        """The payload, then its signed manifest (the commit point). OSError when it cannot be written."""
        digest = hashlib.sha256(payload).hexdigest()
        manifest = signed.sign(self.key, PURPOSE, {
            "run": self.run, "rank": self.rank, "world_size": self.world, "step": step, "bytes": len(payload),
            "sha256": digest, "base_step": base_step, "job": self.job, "created": time.time()}, key_id=self.key_id)
        return self.commit(step, payload, json.dumps(manifest).encode())

    def commit(self, step: int, payload: bytes, manifest: bytes) -> Path:
        """The payload, then the manifest's bytes as they are (a peer's replica keeps its origin's signature)."""
        _write_new(self.path(step, DATA), payload)
        _write_new(self.path(step, MANIFEST), manifest)
        return self.path(step, DATA)

    def free_bytes(self) -> int:
        found = os.statvfs(self.dir)
        return found.f_bavail * found.f_frsize

    # ------------------------------------------------------------------------------------------ read
    def manifest(self, step: int) -> dict:
        """The manifest of the snapshot at `step`, its signature and binding checked; SnapshotRefused."""
        path = self.path(step, MANIFEST)
        try:
            record = safe_read.read_json(path, safe_read.CONTROL_BYTES, "snapshot manifest")
        except FileNotFoundError:
            raise SnapshotRefused("missing", f"{path}: no such snapshot") from None
        except (OSError, ValueError) as exc:
            raise SnapshotRefused("unreadable", f"{path}: {exc}") from None
        return self.check_record(step, record, str(path))

    def check_record(self, step: int, record: Any, where: str) -> dict:
        """A manifest's signature, its binding to this run, rank, world size and `step`, and its size."""
        if not isinstance(record, dict):
            raise SnapshotRefused("unreadable", f"{where}: not a manifest")
        bound = {"run": self.run, "rank": self.rank, "world_size": self.world, "step": step}
        if (why := signed.check(self.key, PURPOSE, record, bound)) is not None:
            raise SnapshotRefused(why, f"{where}: {signed.refusal_message(why, 'the snapshot manifest')}")
        size = record.get("bytes")
        if not isinstance(size, int) or not 0 < size <= self.max_bytes:
            raise SnapshotRefused("too_large", f"{where}: a snapshot of {size!r} bytes (at most {self.max_bytes})")
        return record

    def load(self, step: int, map_location: Any = "cpu") -> tuple[dict, dict]:
        """(manifest, state) of the snapshot at `step`, verified: signed manifest, size, SHA-256, then
        ``torch.load(weights_only=True)``. SnapshotRefused says why not."""
        record = self.manifest(step)
        path = self.path(step, DATA)
        try:
            payload = safe_read.read_bytes(path, record["bytes"], "snapshot")
        except FileNotFoundError:
            raise SnapshotRefused("missing", f"{path}: the manifest's payload is missing") from None
        except OSError as exc:
            raise SnapshotRefused("unreadable", f"{path}: {exc}") from None
        return record, decode(record, payload, str(path), map_location)

    # ----------------------------------------------------------------------------------- retention
    def retain(self) -> list[int]:
        """Delete all but the newest `keep` snapshots of this rank; the steps deleted."""
        dropped = self.steps()[self.keep:]
        for step in dropped:
            self._delete(step)
        return dropped

    def discard_other_jobs(self) -> list[int]:
        """Delete the snapshots an earlier job left (another launcher's run id, or a manifest that does not
        check); the steps deleted."""
        dropped = []
        for step in self.steps():
            try:
                mine = self.manifest(step).get("job") == self.job
            except SnapshotRefused:
                mine = False
            if not mine:
                self._delete(step)
                dropped.append(step)
        return dropped

    def discard_after(self, step: int) -> list[int]:
        """Delete the snapshots newer than `step` (a rollback abandoned them); the steps deleted."""
        dropped = [s for s in self.steps() if s > step]
        for s in dropped:
            self._delete(s)
        return dropped

    def clear(self, *, directories: bool = False) -> None:
        """Every snapshot of this rank; with `directories`, its directory too (and the run's, once no
        rank's is left)."""
        for step in self.steps():
            self._delete(step)
        for entry in list(self.dir.iterdir()) if self.dir.is_dir() else ():
            if NAME.match(entry.name) or entry.name.startswith(TMP_PREFIX):
                _remove(entry)
        if not directories:
            return
        for level in (self.dir, self.base):
            try:
                level.rmdir()
            except OSError:
                break       # not empty (another rank's, or a file we do not own): left as it is

    def _delete(self, step: int) -> None:
        _remove(self.path(step, MANIFEST))     # the commit point first: no half snapshot is ever listed
        _remove(self.path(step, DATA))


class Snapshotter:
    """Takes a snapshot of `states` (every object's `state_dict`) every `every` steps, beside training."""

    def __init__(self, store: SnapshotStore, states: dict[str, Any], *, every: int,
                 emit: Callable[..., Any], log: Any, replicator: Any = None):
        """`replicator`: sends each snapshot to a rank of another node once written
        (runtime/resilience/replicate.py); None: this node's copy only."""
        from trainguard.runtime.checkpoint.state import Stager

        self.store, self.states, self.every = store, states, every
        self.replicator = replicator
        self.emit, self.log = emit, log
        self._stager = Stager()
        self._thread: threading.Thread | None = None
        self._last_step: int | None = None
        self.taken = 0

    def after_step(self, step: int, *, base_step: int | None, take: bool = True) -> None:
        """Called after every step with the step the state is at now. A step lower than the last one
        (a rollback or restore) deletes the snapshots of the abandoned steps first."""
        if self._last_step is not None and step < self._last_step:
            self.wait()
            self.store.discard_after(step)
            if self.replicator is not None:
                self.replicator.discard_after(step)
        self._last_step = step
        if take and self.every and step % self.every == 0:
            self.take(step, base_step=base_step)

    def take(self, step: int, *, base_step: int | None) -> None:
        began = time.perf_counter()
        self.wait()                      # the previous write still reads the staged buffers
        try:
            staged = self._stager.stage({key: obj.state_dict() for key, obj in self.states.items()})
        except Exception as exc:         # a snapshot never stops training: the previous one stands
            self._skipped(step, "error", f"staging: {type(exc).__name__}: {exc}")
            return
        blocking = time.perf_counter() - began
        self._thread = threading.Thread(target=self._write, args=(step, staged, blocking, base_step),
                                        name=f"trainguard-snapshot-{step}", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Until the snapshot being written is (or failed to be) on the tmpfs."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _write(self, step: int, staged: dict, blocking: float, base_step: int | None) -> None:
        import torch

        began = time.perf_counter()
        try:
            buffer = io.BytesIO()
            torch.save(staged, buffer)
            payload = buffer.getbuffer().tobytes()
            if len(payload) > self.store.max_bytes:
                self._skipped(step, "too_large", f"{len(payload)} bytes, over recovery.snapshot_max_bytes "
                                                 f"({self.store.max_bytes})")
                return
            free = self.store.free_bytes()
            if free < len(payload) + HEADROOM_BYTES:
                self._skipped(step, "no_room", f"{len(payload)} bytes needed, {free} free on "
                                               f"{self.store.dir} (kept {HEADROOM_BYTES} spare)")
                return
            path = self.store.write(step, payload, base_step=base_step)
            self.store.retain()
        except Exception as exc:     # a snapshot that fails never stops training: the checkpoint stands
            self._skipped(step, "error", f"{type(exc).__name__}: {exc}")
            return
        self.taken += 1
        self.emit(event_types.SNAPSHOT_SAVED, step=step, bytes=len(payload), blocking_seconds=round(blocking, 6),
                  write_seconds=round(time.perf_counter() - began, 6), path=str(path))
        if self.replicator is not None:      # on a thread of its own: a slow peer holds up nothing here
            self.replicator.submit(step, payload)

    def _skipped(self, step: int, reason: str, why: str) -> None:
        self.emit(event_types.SNAPSHOT_SKIPPED, step=step, reason=reason, why=why)
        self.log.warning("in-memory snapshot not written; recovery falls back to the checkpoint", step=step,
                         reason=reason, why=why)

    def close(self, *, completed: bool) -> None:
        """At the end of this process: a completed run clears its snapshots (the final checkpoint holds
        that state); any other end keeps them for the restart."""
        self.wait()
        if self.replicator is not None:
            self.replicator.close(completed=completed)
        if completed:
            self.store.clear(directories=True)


def decode(record: dict, payload: bytes, where: str, map_location: Any = "cpu") -> dict:
    """The state in `payload` once its size and SHA-256 are the checked manifest's; weights_only."""
    if len(payload) != record["bytes"]:
        raise SnapshotRefused("size", f"{where}: {len(payload)} bytes, the manifest says {record['bytes']}")
    if hashlib.sha256(payload).hexdigest() != record["sha256"]:
        raise SnapshotRefused("hash", f"{where}: its SHA-256 is not the manifest's (changed after it was written)")
    import torch

    try:
        state = torch.load(io.BytesIO(payload), map_location=map_location, weights_only=True)
    except Exception as exc:   # hashed and signed, yet not loadable: written by another torch?
        raise SnapshotRefused("unloadable", f"{where}: torch.load refused it: {exc}") from None
    if not isinstance(state, dict):
        raise SnapshotRefused("unloadable", f"{where}: not a dict of states")
    return state


def _not_private(path: Path) -> str | None:
    """Why a snapshot directory cannot be trusted to be ours alone, or None."""
    try:
        found = os.lstat(path)
    except OSError as exc:
        return f"{path}: {exc.strerror or exc}"
    if stat.S_ISLNK(found.st_mode) or not stat.S_ISDIR(found.st_mode):
        return f"{path}: not a directory (a link or a file in its place)"
    if found.st_uid != os.geteuid():
        return f"{path}: owned by uid {found.st_uid}, not this user ({os.geteuid()})"
    if found.st_mode & 0o077:
        return f"{path}: mode {stat.S_IMODE(found.st_mode):o}: others may write or read it (expected 700)"
    return None


def _write_new(final: Path, data: bytes) -> None:
    """`data` at `final`, whole or not at all: a private temporary file, then a rename over it."""
    tmp = final.with_name(f"{TMP_PREFIX}{final.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    os.replace(tmp, final)


def _remove(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
