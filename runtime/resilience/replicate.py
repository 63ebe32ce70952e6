"""Snapshot replication: every snapshot a rank takes is also held by a rank on another node.

    replicator = Replicator.build(local_store, job_store, rank=r, world_size=w, local_world_size=l, ...)
    replicator.start()                           # listen, publish the address in the job's store
    snaps = Snapshotter(local_store, states, ..., replicator=replicator)   # sends after each local write
    replicator.held                              # the SnapshotStore of the replicas this rank holds

Who holds whose: rank r's snapshots go to the same local rank on the next node, ``(r + L) mod W`` (L ranks
a node, W in all), so losing one node loses no snapshot: its ranks' replicas live on the node after it,
and the replicas it held are of the node before it, which still has its own. With one node (L >= W) there
is no other node: no replica, said once in the log.

How: beside training, on a thread of its own started once the local copy is committed
(runtime/resilience/snapshot.py): the rank connects to its holder's listener (its address published in the job's
c10d store under ``trainguard/replica/<rank>``, overwritten by each new process of that rank) and streams the signed manifest, then the
payload, then waits for the holder's answer. Neither the step nor the next snapshot waits for it: one is
in flight per rank (memory: one payload), and a snapshot that finds the previous one still being sent is
not replicated (said). A plain TCP stream rather than the process group:
it does not take part in the group's abort and re-forming (runtime/resilience/inprocess.py), does not
need the ranks in lockstep, and a dead peer is a refused connection, not a collective that hangs.

The holder trusts nothing it receives. Its listener reads the manifest bounded (safe_read's CONTROL_BYTES),
checks its signature with the run's key and its binding to the ORIGIN rank (the one rank whose replicas this
rank holds), the run, the world size, the job's snapshots and the step, and the size against
`snapshot_max_bytes` and the free room, before it reads a byte of payload; then it streams the payload into
a private temporary file (0600, O_NOFOLLOW) in its own 0700 directory
``<snapshot_dir>/trainguard-<uid>/<tag>/replica-<origin>/`` while hashing it, and commits (rename, then the
manifest) only when the SHA-256 is the manifest's. Anything else is refused loudly (`replica_refused`, an
error in the log) and nothing is kept. What it keeps is read back like a local snapshot (SnapshotStore.load:
signed manifest, size, SHA-256, weights_only), by the peer recovery (runtime/resilience/peer.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import struct
import threading
import time
from pathlib import Path
from typing import Any, Callable

from trainguard import event_types, safe_read
from trainguard.runtime.resilience.snapshot import (DATA, HEADROOM_BYTES, MANIFEST, TMP_PREFIX, SnapshotRefused,
                                                    SnapshotStore, _remove, _write_new)

PREFIX = "trainguard/replica"
MAGIC = b"trainguard-replica/1\n"
CHUNK = 1 << 20
TIMEOUT_SECONDS = 60.0        # a peer that sends or answers nothing for this long is given up on
LENGTH = struct.Struct(">Q")


def peer_of(rank: int, world_size: int, local_world_size: int) -> int | None:
    """The rank that holds `rank`'s replicas: the same local rank on the next node; None with one node."""
    if local_world_size <= 0 or local_world_size >= world_size or world_size % local_world_size:
        return None
    return (rank + local_world_size) % world_size


def origin_of(rank: int, world_size: int, local_world_size: int) -> int | None:
    """The rank whose replicas `rank` holds (peer_of's inverse); None with one node."""
    if peer_of(rank, world_size, local_world_size) is None:
        return None
    return (rank - local_world_size) % world_size


def held_store(local: SnapshotStore, origin: int) -> SnapshotStore:
    """Where this rank keeps `origin`'s replicas: its own directory beside its snapshots, bound to `origin`."""
    held = SnapshotStore(local.base.parent.parent, Path(local.run), rank=origin, world_size=local.world,
                         key=local.key, key_id=local.key_id, keep=local.keep, max_bytes=local.max_bytes,
                         directory=f"replica-{origin}")
    held.job = local.job
    return held


def advertised_address(master_addr: str | None) -> str:
    """This host's address as the job's other nodes reach it: the interface that routes to the store's
    host (no packet is sent: a UDP socket's connect only picks the route)."""
    target = master_addr or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((target, 9))
            return probe.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


class Replicator:
    """Sends this rank's snapshots to its peer and keeps the replicas its origin sends it."""

    def __init__(self, local: SnapshotStore, held: SnapshotStore, job_store: Any, *, rank: int, peer: int,
                 origin: int, emit: Callable[..., Any], log: Any, host: str = "127.0.0.1"):
        self.local, self.held, self.job_store = local, held, job_store
        self.rank, self.peer, self.origin = rank, peer, origin
        self.emit, self.log = emit, log
        self.host = host
        self.lock = threading.Lock()           # the listener commits while a restore lists and reads
        self.sent = 0
        self._closed = threading.Event()
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._sender: threading.Thread | None = None

    @classmethod
    def build(cls, local: SnapshotStore, job_store: Any, *, rank: int, world_size: int, local_world_size: int,
              emit: Callable[..., Any], log: Any) -> "Replicator | None":
        """None with one node (said in the log) or when the holder's directory is unusable (said loudly)."""
        peer = peer_of(rank, world_size, local_world_size)
        origin = origin_of(rank, world_size, local_world_size)
        if peer is None or origin is None:
            log.info("snapshot replication off: one node (no other node to hold a replica)",
                     world_size=world_size, local_world_size=local_world_size)
            return None
        held = held_store(local, origin)
        if (why := held.prepare()) is not None:
            emit(event_types.SNAPSHOT_SKIPPED, reason="unavailable", why=f"replicas: {why}")
            log.error("snapshot replication off: the replicas' directory is unusable", why=why)
            return None
        return cls(local, held, job_store, rank=rank, peer=peer, origin=origin, emit=emit, log=log,
                   host=advertised_address(os.environ.get("MASTER_ADDR")))

    # ----------------------------------------------------------------------------------- the listener
    def start(self) -> None:
        """Listen for the origin's replicas and publish the address in the job's store."""
        self._listener = socket.create_server((self.host, 0))
        self._listener.settimeout(0.5)
        port = self._listener.getsockname()[1]
        self.job_store.set(self._key(self.rank), f"{self.host}:{port}")
        self._thread = threading.Thread(target=self._serve, name="trainguard-replica-listen", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        assert self._listener is not None
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return                         # closed
            with conn:
                answer = self._receive(conn)
                try:
                    conn.sendall(answer.encode() + b"\n")
                except OSError:
                    pass

    def _receive(self, conn: socket.socket) -> str:
        """One replica off the connection, verified and committed: "ok", or "refused <reason>"."""
        conn.settimeout(TIMEOUT_SECONDS)
        step: Any = None
        try:
            if _read_exact(conn, len(MAGIC)) != MAGIC:
                raise SnapshotRefused("unreadable", "not a trainguard replica stream")
            size = LENGTH.unpack(_read_exact(conn, LENGTH.size))[0]
            if size > safe_read.CONTROL_BYTES:
                raise SnapshotRefused("too_large", f"a manifest of {size} bytes (at most {safe_read.CONTROL_BYTES})")
            manifest = _read_exact(conn, size)
            try:
                record = json.loads(manifest)
            except ValueError:
                raise SnapshotRefused("unreadable", "the manifest is not JSON") from None
            step = record.get("step") if isinstance(record, dict) else None
            if not isinstance(step, int) or step < 0:
                raise SnapshotRefused("unreadable", "the manifest names no step")
            where = f"replica of rank {self.origin}'s snapshot {step}"
            self.held.check_record(step, record, where)      # signed, bound to the origin, sized
            payload_size = LENGTH.unpack(_read_exact(conn, LENGTH.size))[0]
            if payload_size != record["bytes"]:
                raise SnapshotRefused("size", f"{where}: {payload_size} bytes sent, the manifest says {record['bytes']}")
            if (free := self.held.free_bytes()) < payload_size + HEADROOM_BYTES:
                raise SnapshotRefused("no_room", f"{where}: {payload_size} bytes, {free} free on {self.held.dir}")
            self._commit(conn, step, record, manifest, where)
        except SnapshotRefused as exc:
            self.emit(event_types.REPLICA_REFUSED, origin_rank=self.origin, snapshot_step=step, reason=exc.reason,
                      why=str(exc))
            self.log.error("a snapshot replica refused", origin_rank=self.origin, snapshot_step=step,
                           reason=exc.reason, why=str(exc))
            return f"refused {exc.reason}"
        except (OSError, ConnectionError) as exc:
            self.log.warning("a snapshot replica not received", origin_rank=self.origin, snapshot_step=step,
                             error=str(exc))
            return "refused unreadable"
        return "ok"

    def _commit(self, conn: socket.socket, step: int, record: dict, manifest: bytes, where: str) -> None:
        """The payload streamed into a private temporary file while hashed; renamed, then the manifest
        written (the commit point), only when its SHA-256 is the manifest's."""
        final = self.held.path(step, DATA)
        tmp = final.with_name(f"{TMP_PREFIX}{final.name}.{os.getpid()}.tmp")
        digest = hashlib.sha256()
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            left = record["bytes"]
            while left:
                chunk = conn.recv(min(CHUNK, left))
                if not chunk:
                    raise ConnectionError(f"{where}: the connection closed with {left} bytes to come")
                digest.update(chunk)
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view):]
                left -= len(chunk)
        except BaseException:
            os.close(fd)
            _remove(tmp)
            raise
        os.close(fd)
        if digest.hexdigest() != record["sha256"]:
            _remove(tmp)
            raise SnapshotRefused("hash", f"{where}: its SHA-256 is not the manifest's")
        with self.lock:
            os.replace(tmp, final)
            _write_new(self.held.path(step, MANIFEST), manifest)
            self.held.retain()

    # -------------------------------------------------------------------------------------- sending
    def submit(self, step: int, payload: bytes) -> None:
        """Send snapshot `step` on a thread of its own: neither the step nor the next snapshot waits for a
        slow or stopped peer. One in flight (memory: one payload); a snapshot that finds the previous one
        still being sent is not replicated, said as a `snapshot_replica_failed`."""
        if self._sender is not None and self._sender.is_alive():
            why = "the previous snapshot's replica is still being sent"
            self.emit(event_types.SNAPSHOT_REPLICA_FAILED, step=step, peer_rank=self.peer, why=why, seconds=0.0)
            self.log.warning("snapshot not replicated: losing this node would lose it", step=step,
                             peer_rank=self.peer, why=why)
            return
        self._sender = threading.Thread(target=self.send, args=(step, payload), daemon=True,
                                        name=f"trainguard-replicate-{step}")
        self._sender.start()

    def wait(self, timeout: float | None = None) -> None:
        """Until the replica being sent is held (or failed)."""
        if self._sender is not None:
            self._sender.join(timeout)

    def send(self, step: int, payload: bytes) -> bool:
        """Stream this rank's snapshot `step` (just committed locally) to its holder; whether it holds it
        now. Runs on `submit`'s thread (a test or a bench may call it directly), never on the step's."""
        began = time.perf_counter()
        try:
            manifest = safe_read.read_bytes(self.local.path(step, MANIFEST), safe_read.CONTROL_BYTES,
                                            "snapshot manifest")
            host, _, port = self._address(self.peer).rpartition(":")
            with socket.create_connection((host, int(port)), timeout=TIMEOUT_SECONDS) as conn:
                conn.sendall(MAGIC + LENGTH.pack(len(manifest)) + manifest + LENGTH.pack(len(payload)))
                view = memoryview(payload)
                for start in range(0, len(view), CHUNK):
                    conn.sendall(view[start:start + CHUNK])
                answer = _read_line(conn)
        except Exception as exc:    # a replica that cannot be sent never stops training: the local copy stands
            answer = f"unreachable {type(exc).__name__}: {exc}"
        seconds = time.perf_counter() - began
        if answer != "ok":
            self.emit(event_types.SNAPSHOT_REPLICA_FAILED, step=step, peer_rank=self.peer, why=answer,
                      seconds=round(seconds, 6))
            self.log.warning("snapshot not replicated: losing this node would lose it", step=step,
                             peer_rank=self.peer, why=answer)
            return False
        self.sent += 1
        self.emit(event_types.SNAPSHOT_REPLICATED, step=step, bytes=len(payload), peer_rank=self.peer,
                  seconds=round(seconds, 6))
        return True

    def _address(self, rank: int) -> str:
        key = self._key(rank)
        if not self.job_store.check([key]):
            raise LookupError(f"rank {rank} has not published its replica address ({key})")
        found = self.job_store.get(key)
        return found.decode() if isinstance(found, bytes) else str(found)

    def _key(self, rank: int) -> str:
        return f"{PREFIX}/{rank}"

    # ------------------------------------------------------------------------------------ retention
    def discard_after(self, step: int) -> list[int]:
        """A rollback's abandoned steps: the origin rolled back too (every rank does)."""
        with self.lock:
            return self.held.discard_after(step)

    def close(self, *, completed: bool) -> None:
        """Stop listening; a completed run clears the replicas this rank holds (as its own snapshots)."""
        self.wait(TIMEOUT_SECONDS)
        self._closed.set()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)    # wakes the accept at once (Linux)
            except OSError:
                pass
            self._listener.close()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        if completed:
            with self.lock:
                self.held.clear(directories=True)


def _read_exact(conn: socket.socket, size: int) -> bytes:
    parts, left = [], size
    while left:
        chunk = conn.recv(min(CHUNK, left))
        if not chunk:
            raise ConnectionError(f"the connection closed with {left} of {size} bytes to come")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def _read_line(conn: socket.socket, most: int = 4096) -> str:
    found = b""
    while not found.endswith(b"\n") and len(found) < most:
        chunk = conn.recv(1)
        if not chunk:
            break
        found += chunk
    return found.decode(errors="replace").strip()
