"""Peer recovery: a rank without its own snapshot receives it from the rank of another node holding its replica.

restore.py asks, on every rank at once (collectives on the current default group):

    mine = peer.listing(local_steps, held, accept, refused)   # what this rank holds: its own, its origin's
    chosen = peer.plan(_exchange(mine), max_bytes)            # the same answer on every rank (pure)
    record, parts, received = peer.fetch(chosen, local, held, device=..., world_size=...)   # P2P, verified
    why = peer.fingerprints_differ(parts, fingerprint, chosen, world_size)   # before anything is loaded

The choice: the newest step that every rank can have, from its own snapshot or from a replica another
rank holds (runtime/resilience/replicate.py). A rank that lacks it locally (a replaced process, a node that
came back with an empty /dev/shm, a spare with the same rank numbers) receives the holder's copy over the
process group (one isend/irecv pair per rank that needs one, all at once) and verifies it as if it had
read it from its own tmpfs: the manifest's signature and its binding to THIS rank, the run, the world size
and the step (a replica of another rank's state is refused), the size, the SHA-256, then
``torch.load(weights_only=True)``; it keeps the verified copy as its own snapshot for the next failure.

Then, before any rank loads anything, the restored weights are compared bit for bit across the ranks with
the replica fingerprint (trainer/fingerprint.py through the `fingerprint` callable the loop passes;
decide/replica.py's rules name the odd ranks): data-parallel replicas at the same step hold identical
weights, so a received state whose weights differ from the others' is refused and every rank falls back
to the durable checkpoint, loudly; a rank never steps on state that differs from its replicas.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Callable

from trainguard import safe_read
from trainguard.decide.replica import agree, minority
from trainguard.runtime.resilience.snapshot import DATA, MANIFEST, SnapshotRefused, SnapshotStore, decode

PEER = "peer"
MODEL = "model"      # the part of a rank's state that every data-parallel replica holds identically


@dataclass(frozen=True)
class Plan:
    """The step every rank restores, and for each rank that lacks it locally the rank that sends it."""

    step: int
    sources: dict[int, int] = field(default_factory=dict)     # receiver -> holder
    sizes: dict[int, tuple[int, int]] = field(default_factory=dict)   # receiver -> (manifest, payload) bytes


def listing(local_steps: list[int], held: SnapshotStore | None, accept: Callable[[int, dict], bool],
            refused: Callable[[int, SnapshotRefused], None]) -> dict[str, Any]:
    """What this rank can give: its own verified-manifest steps, and the replicas it holds of its origin,
    each with its manifest's and payload's sizes (what the receiver allocates)."""
    offered: dict[int, list[int]] = {}
    for step in held.steps() if held is not None else ():
        try:
            record = held.manifest(step)
            manifest = safe_read.read_bytes(held.path(step, MANIFEST), safe_read.CONTROL_BYTES, "replica manifest")
        except SnapshotRefused as exc:
            refused(step, exc)
            continue
        except OSError:
            continue
        if accept(step, record):
            offered[step] = [len(manifest), record["bytes"]]
    return {"local": list(local_steps), "held": {held.rank: offered} if held is not None and offered else {}}


def plan(listings: list[dict[str, Any]], *, max_bytes: int) -> Plan | None:
    """The newest step every rank has locally or from a holder (the lowest-numbered one), or None. Pure:
    every rank computes it from the same gathered listings. A holder's offer over this rank's bounds is
    not taken."""
    world = len(listings)
    offers: dict[int, dict[int, tuple[int, int, int]]] = {rank: {} for rank in range(world)}   # step -> ...
    for holder in reversed(range(world)):       # the lowest holder's offer written last, so it stands
        for origin, steps in listings[holder].get("held", {}).items():
            origin = int(origin)
            if origin == holder or not 0 <= origin < world:
                continue
            for step, (manifest_bytes, payload_bytes) in steps.items():
                if 0 < manifest_bytes <= safe_read.CONTROL_BYTES and 0 < payload_bytes <= max_bytes:
                    offers[origin][int(step)] = (holder, manifest_bytes, payload_bytes)
    reachable = [set(listings[rank]["local"]) | set(offers[rank]) for rank in range(world)]
    common = set.intersection(*reachable) if reachable else set()
    if not common:
        return None
    step = max(common)
    sources, sizes = {}, {}
    for rank in range(world):
        if step not in listings[rank]["local"]:
            holder, manifest_bytes, payload_bytes = offers[rank][step]
            sources[rank], sizes[rank] = holder, (manifest_bytes, payload_bytes)
    return Plan(step, sources, sizes)


def fetch(chosen: Plan, local: SnapshotStore, held: SnapshotStore | None, *, device: Any,
          rank: int) -> tuple[dict, dict, int]:
    """(manifest, state, bytes received) of snapshot `chosen.step` for this rank: from its own tmpfs, or
    received from its holder and verified. Every rank calls it: holders send whatever the others need
    first, and a send always goes out at the announced size (a copy gone since the listing goes out as
    zeros, which the receiver refuses), so no rank waits on another's failure. SnapshotRefused says why
    this rank's copy is refused."""
    import torch
    import torch.distributed as dist

    # NCCL moves device tensors only: the bytes travel through this rank's GPU there, as they are on gloo
    nccl = bool(chosen.sources) and dist.is_initialized() and dist.get_backend() == "nccl"
    wire = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    pending, inbox = [], None
    for receiver, holder in sorted(chosen.sources.items()):
        if holder == rank:
            outgoing = torch.frombuffer(bytearray(_replica_bytes(held, receiver, chosen)), dtype=torch.uint8)
            pending.append(dist.isend(outgoing.to(wire), dst=receiver))
    if rank in chosen.sources:
        inbox = torch.empty(sum(chosen.sizes[rank]), dtype=torch.uint8, device=wire)
        pending.append(dist.irecv(inbox, src=chosen.sources[rank]))
    for work in pending:
        work.wait()
    if inbox is None:
        record, state = local.load(chosen.step, map_location=device)
        return record, state, 0
    manifest_bytes, _ = chosen.sizes[rank]
    received = inbox.cpu().numpy().tobytes()
    manifest, payload = received[:manifest_bytes], received[manifest_bytes:]
    where = f"snapshot {chosen.step} received from rank {chosen.sources[rank]}"
    try:
        record = json.loads(manifest)
    except ValueError:
        raise SnapshotRefused("unreadable", f"{where}: the manifest is not JSON") from None
    record = local.check_record(chosen.step, record, where)     # signed, bound to THIS rank and step
    state = decode(record, payload, where, map_location=device)
    try:
        local.commit(chosen.step, payload, manifest)              # this rank's own copy again
    except OSError:
        pass       # not kept: the next failure looks for it on the peer again
    return record, state, len(received)


def _replica_bytes(held: SnapshotStore | None, origin: int, chosen: Plan) -> bytes:
    """The manifest and payload of `origin`'s replica, exactly the announced size (zeros when gone)."""
    manifest_bytes, payload_bytes = chosen.sizes[origin]
    found = b""
    if held is not None and held.rank == origin:
        try:
            found = (safe_read.read_bytes(held.path(chosen.step, MANIFEST), manifest_bytes, "replica manifest")
                     + safe_read.read_bytes(held.path(chosen.step, DATA), payload_bytes, "replica"))
        except OSError:
            found = b""
    size = manifest_bytes + payload_bytes
    return found[:size].ljust(size, b"\0")


def sha_fingerprint(tensors: list[Any]) -> int:
    """A 64-bit digest of the tensors' bytes (SHA-256): the fingerprint when the loop passes none."""
    import torch

    digest = hashlib.sha256()
    for tensor in tensors:
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    return int.from_bytes(digest.digest()[:8], "big")


def fingerprints_differ(parts: dict | None, fingerprint: Callable[[list], int] | None, gather: Callable,
                        ) -> str | None:
    """Why the ranks' restored weights are not bit-identical (naming the odd ranks where a majority
    tells), or None. Every rank calls it with the state it is about to load (None: it has none)."""
    model = (parts or {}).get(MODEL)
    mine = None
    if isinstance(model, dict):
        tensors = [value for value in model.values() if hasattr(value, "detach")]
        mine = int((fingerprint or sha_fingerprint)(tensors))
    values = tuple(gather(mine))
    if None not in values and agree(values):
        return None
    spelled = ", ".join(f"rank {r}: {'none' if v is None else format(v & (2**64 - 1), '016x')}"
                        for r, v in enumerate(values))
    odd = minority(tuple(-1 if v is None else v for v in values))
    named = f"; rank(s) {list(odd)} differ from the majority" if odd else ""
    return f"the restored weights' fingerprints differ across the replicas ({spelled}){named}"
