"""Which state every rank loads after a failure, the same on every rank: the newest in-memory snapshot
that every rank holds and verifies, else the durable checkpoint, loudly.

Two moments ask:

- after an in-process restart (`after_failure`): any snapshot of this timeline at or after the newest
  durable checkpoint's step (a rollback deleted the abandoned ones: runtime/resilience/snapshot.py);
- after torchrun restarted the workers (`after_resume`): the Protector has resumed from the newest verified
  checkpoint; a snapshot newer than it that was taken *on top of that very checkpoint* (its signed
  `base_step`) continues it; with no checkpoint yet, only a snapshot of the same job (torchrun's run id)
  does, and what an earlier job left is deleted.

Agreement: every rank lists the snapshots whose signed manifests check, the ranks exchange the lists
(one all_gather_object on the re-formed group), and the newest step all hold is chosen; each rank then
verifies its payload whole (size, SHA-256) and loads it weights_only. If any rank refuses its copy, no rank
loads a snapshot: `snapshot_invalid` on that rank, `snapshot_fallback` on every rank, and the durable
checkpoint (Protector.restore) for all, so ranks never step from different states.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from trainguard import event_types
from trainguard.runtime.resilience import peer
from trainguard.runtime.resilience.snapshot import SnapshotRefused, SnapshotStore

SNAPSHOT, CHECKPOINT, PEER = "snapshot", "checkpoint", peer.PEER


def after_failure(protector: Any, store: SnapshotStore | None, *, device: Any, world_size: int,
                  held: SnapshotStore | None = None, fingerprint: Callable | None = None,
                  standby: bool = False) -> dict[str, Any]:
    """Load the state to go on from after an in-process restart; what was loaded ({"source", "restored_step",
    "restore_seconds"}). None restored (no snapshot, no checkpoint) raises LookupError: the caller hands
    the failure to the launcher. `standby`: this process took a killed rank's place (standby.py)."""
    durable = protector.state.last_saved_step
    loaded = _agreed_snapshot(protector, store, world_size, device,
                              accept=lambda step, manifest: durable is None or step >= durable,
                              held=held, fingerprint=fingerprint)
    if loaded is None:
        began = time.perf_counter()
        step = protector.restore(rollback=False, source=event_types.IN_PROCESS_RESTART)
        if step is None:
            raise LookupError("no verified snapshot or checkpoint to restore after the failure")
        loaded = {"source": CHECKPOINT, "restored_step": step, "restore_seconds": time.perf_counter() - began,
                  "bytes_received": 0}
    _align_decisions(protector, world_size, standby)
    return loaded


# TrainState's decisions that no snapshot or checkpoint holds (protect/state.py): what was saved last and
# whether the guard saw trouble since. The ranks that lived through the failure agree on them (every
# decision came from the step's sync); a standby's process started with none.
UNSAVED_DECISIONS = ("last_saved_step", "trouble_since_checkpoint")


def _align_decisions(protector: Any, world_size: int, standby: bool) -> None:
    """Every rank takes the unsaved decisions of the lowest rank that is not a standby (one
    all_gather_object): a standby that kept its own would mark a checkpoint stable that the others would
    not, or count the next snapshot from another checkpoint."""
    state = protector.state
    mine = None if standby else {name: getattr(state, name) for name in UNSAVED_DECISIONS}
    survivor = next((held for held in _exchange(mine, world_size) if held is not None), None)
    if survivor is not None:
        for name, value in survivor.items():
            setattr(state, name, value)


def after_resume(protector: Any, store: SnapshotStore | None, *, resumed_from: int | None, device: Any,
                 world_size: int, held: SnapshotStore | None = None,
                 fingerprint: Callable | None = None) -> dict[str, Any] | None:
    """After `Protector.begin` on a worker torchrun started: a fresher snapshot of the same timeline, loaded
    (what was loaded, as `after_failure`), or None (the checkpoint's state stands). Every rank the policy
    gives snapshots calls it, also one whose snapshots could not be set up (`store` None: no private
    directory on its node): it brings no candidate to the exchange, so the others fall back loudly, where
    skipping the exchange would leave them waiting in it."""
    if store is not None and resumed_from is None:
        # No checkpoint yet: only this job's own snapshots continue it (a worker it restarted before the
        # first checkpoint); what an earlier job left under this directory's name is deleted.
        store.discard_other_jobs()
        if held is not None:
            held.discard_other_jobs()
    return _agreed_snapshot(protector, store, world_size, device,
                            accept=lambda step, manifest: step > (resumed_from or 0)
                            and manifest.get("base_step") == resumed_from
                            and (resumed_from is not None or manifest.get("job") == store.job),
                            held=held, fingerprint=fingerprint)


def _agreed_snapshot(protector: Any, store: SnapshotStore | None, world_size: int, device: Any,
                     accept: Callable[[int, dict], bool], held: SnapshotStore | None = None,
                     fingerprint: Callable | None = None) -> dict[str, Any] | None:
    """`held`: the replicas this rank holds of another rank's snapshots (runtime/resilience/peer.py: a rank
    without the chosen step receives it from its holder)."""
    began = time.perf_counter()
    mine = peer.listing(_candidates(store, accept, protector), held, accept, lambda step, exc: protector.event(
        event_types.SNAPSHOT_INVALID, snapshot_step=step, reason=exc.reason, why=str(exc))) \
        if store is not None else None
    listings = _exchange(mine, world_size)
    if store is None:
        return None
    everyone = [listed["local"] if listed is not None else [] for listed in listings]
    # a rank without snapshots (None) takes part in nothing after this exchange: no plan includes it
    chosen = peer.plan(listings, max_bytes=store.max_bytes) if None not in listings else None
    if chosen is None:
        # No rank holding one is the ordinary case (no snapshot since the checkpoint); some ranks holding
        # one and others not (a refused manifest, a snapshot not written) is a fallback, said loudly.
        missing = [rank for rank, steps in enumerate(everyone) if not steps]
        if len(missing) < len(everyone):
            why = (f"rank(s) {missing} hold no verified snapshot that continues this state" if missing
                   else "the ranks hold no snapshot of the same step")
            _fallback(protector, why)
        return None
    step, received = chosen.step, 0
    try:
        _, parts, received = peer.fetch(chosen, store, held, device=device, rank=store.rank)
        refusal = None
    except SnapshotRefused as exc:
        parts, refusal = None, exc
        protector.event(event_types.SNAPSHOT_INVALID, snapshot_step=step, reason=exc.reason, why=str(exc))
        protector.log.error("in-memory snapshot refused", snapshot_step=step, reason=exc.reason, why=str(exc))
    verdicts = _exchange(None if refusal is None else refusal.reason, world_size)
    refused = {rank: reason for rank, reason in enumerate(verdicts) if reason is not None}
    if refused:
        _fallback(protector, f"the snapshot of step {step} did not verify on rank(s) {refused}")
        return None
    if chosen.sources and (why := peer.fingerprints_differ(parts, fingerprint, lambda v: _exchange(v, world_size))):
        _fallback(protector, f"step {step}, received from a peer by rank(s) {sorted(chosen.sources)}: {why}")
        return None
    from_step = protector.state.step
    protector.load_states(parts)
    seconds = time.perf_counter() - began
    source = PEER if received else SNAPSHOT
    protector.event(event_types.SNAPSHOT_RESTORED, restored_step=protector.state.step, from_step=from_step,
                    seconds=round(seconds, 6), path=str(store.path(step, ".snap")), source=source,
                    bytes_received=received, peer_rank=chosen.sources.get(store.rank))
    protector.log.info("restored from the in-memory snapshot", step=protector.state.step, seconds=seconds,
                       source=source, bytes_received=received)
    return {"source": source, "restored_step": protector.state.step, "restore_seconds": seconds,
            "bytes_received": received}


def _candidates(store: SnapshotStore, accept: Callable[[int, dict], bool], protector: Any) -> list[int]:
    """This rank's snapshot steps whose signed manifests check and that `accept` takes, newest first."""
    found = []
    for step in store.steps():
        try:
            manifest = store.manifest(step)
        except SnapshotRefused as exc:
            protector.event(event_types.SNAPSHOT_INVALID, snapshot_step=step, reason=exc.reason, why=str(exc))
            continue
        if accept(step, manifest):
            found.append(step)
    return found


def _exchange(value: Any, world_size: int) -> list[Any]:
    """Every rank's `value`, in rank order (on the current default group)."""
    if world_size == 1:
        return [value]
    import torch.distributed as dist

    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, value)
    return out


def _fallback(protector: Any, why: str) -> None:
    protector.event(event_types.SNAPSHOT_FALLBACK, why=why)
    protector.log.error("no in-memory snapshot to restore: the durable checkpoint instead", why=why)
