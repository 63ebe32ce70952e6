"""The recovery component of a training loop: snapshots beside the steps, and the in-process restart.

    recovery = Recovery.build(policy.recovery, protector, run_dir=..., rank=r, world_size=w, device=d,
                              groups=groups, log=log)          # groups: None unless in-process
    begun = protector.begin(); recovery.after_begin(begun.resumed_from)
    while ...:
        try:
            ...one step...; recovery.after_step()
        except Exception as exc:
            recovery.recover(exc, rebuild=lambda: ...)     # re-raises what cannot be recovered in-process
    recovery.close(completed=...)

`recovery.mode: restart` builds a component that does nothing: today's path (torchrun restarts every
worker, which resume from the newest verified checkpoint). `in_process` takes snapshots every
`snapshot_every` steps and, with a world of several ranks, recovers a failure in-process.
"""

from __future__ import annotations

import os
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from trainguard import event_types
from trainguard.runtime.resilience import restore
from trainguard.runtime.resilience.inprocess import ProcessGroups, RecoveryFailed
from trainguard.runtime.resilience.replicate import Replicator
from trainguard.runtime.resilience.request import RequestWatch
from trainguard.runtime.resilience.snapshot import SnapshotStore, Snapshotter

IN_PROCESS, RESTART = "in_process", "restart"


class Recovery:
    def __init__(self, protector: Any, *, store: SnapshotStore | None, snapshots: Snapshotter | None,
                 groups: ProcessGroups | None, max_restarts: int, device: Any, world_size: int, log: Any):
        self.protector, self.store, self.snapshots, self.groups = protector, store, snapshots, groups
        self.max_restarts, self.device, self.world, self.log = max_restarts, device, world_size, log
        self.restarts = 0
        # The step the last failure happened at: the budget (max_restarts) counts failures that come back
        # before the run gets past it (a fault that repeats at the same step), not every fault of a long run.
        self.failed_at: int | None = None
        # The policy gives this rank snapshots (the same answer on every rank), whether or not its own
        # could be set up: such a rank still takes part in the resume's exchange (restore.after_resume).
        self.snapshots_wanted = snapshots is not None
        self.fingerprint: Callable[[list], int] | None = None   # a peer's state checked with it (peer.py)

    @classmethod
    def build(cls, settings: Any, protector: Any, *, run_dir: Path, rank: int, world_size: int, device: Any,
              groups: ProcessGroups | None, log: Any, sharded: bool = False,
              fingerprint: Callable[[list], int] | None = None) -> "Recovery":
        """From the policy's `recovery` section. Snapshots need the run's key (they are signed with it) and
        a private directory on the tmpfs; without either they are off, said once in the log and the TLS.
        `sharded` (FSDP2: DTensor states, a device mesh): the restart path, no snapshots (docs/recovery.md).
        `fingerprint`: the replica fingerprint of a list of tensors (trainer/fingerprint.py), which checks a
        state received from a peer against the other replicas' (runtime/resilience/peer.py)."""
        store = snapshots = None
        if settings.mode == IN_PROCESS and settings.snapshot_every and not sharded:
            from trainguard.runtime.checkpoint import keys

            why = "the run has no signing key" if protector.key is None else None
            if why is None:
                store = SnapshotStore(Path(settings.snapshot_dir), run_dir, rank=rank, world_size=world_size,
                                      key=protector.key, key_id=keys.key_id(protector.key),
                                      keep=settings.snapshot_keep, max_bytes=settings.snapshot_max_bytes)
                why = store.prepare()
            if why is None:
                replicator = None
                if settings.replicate == "on" and groups is not None:   # the job's store finds the peer
                    replicator = Replicator.build(
                        store, groups.store, rank=rank, world_size=world_size,
                        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", world_size)),
                        emit=protector.telemetry.event, log=log)
                    if replicator is not None:
                        replicator.start()
                snapshots = Snapshotter(store, protector.states, every=settings.snapshot_every,
                                        emit=protector.telemetry.event, log=log, replicator=replicator)
            else:
                store = None
                protector.event(event_types.SNAPSHOT_SKIPPED, reason="unavailable", why=why)
                log.error("in-memory snapshots are off; recovery restores the durable checkpoint", why=why)
        if groups is not None and settings.mode == IN_PROCESS and protector.key is not None:
            # the agent's signed requests (a hang, a restore) reach the ranks through the watcher
            groups.requests = RequestWatch(run_dir, protector.key, rank, log=log, emit=protector.event)
        built = cls(protector, store=store, snapshots=snapshots,
                    groups=groups if settings.mode == IN_PROCESS else None,
                    max_restarts=settings.max_in_process_restarts, device=device, world_size=world_size, log=log)
        built.fingerprint = fingerprint
        built.snapshots_wanted = settings.mode == IN_PROCESS and bool(settings.snapshot_every) and not sharded
        return built

    # ------------------------------------------------------------------------------------ the hooks
    def after_begin(self, resumed_from: int | None) -> dict | None:
        """After the Protector's resume: a fresher snapshot of the same timeline, if every rank holds one."""
        if not self.snapshots_wanted:
            return None
        return restore.after_resume(self.protector, self.store, resumed_from=resumed_from, device=self.device,
                                    world_size=self.world, held=self._held(), fingerprint=self.fingerprint)

    def after_step(self, *, last: bool = False) -> None:
        """After a completed step; `last`: the run's final step (its checkpoint follows: no snapshot)."""
        state = self.protector.state
        if self.failed_at is not None and state.step > self.failed_at:
            self.restarts, self.failed_at = 0, None    # past the step that failed: it did not come back
        if self.snapshots is not None:
            # the checkpoint autopilot's snapshot interval (docs/checkpoints.md), the same on every rank
            self.snapshots.every = self.protector.snapshot_every or self.snapshots.every
            self.snapshots.after_step(state.step, base_step=state.last_saved_step, take=not last)

    def settle(self) -> None:
        """Before the run ends (its `run_end` event): the snapshot being written is done and said."""
        if self.snapshots is not None:
            self.snapshots.wait()

    def can_recover(self, failure: BaseException | None = None) -> bool:
        """Whether `failure` is recovered in-process. Not a checkpoint that failed under
        `checkpoint_on_error: raise` (the run is told to end on it) nor bad input (it fails the same way
        again): those end the process as before."""
        from trainguard.exits import BadInput
        from trainguard.runtime.checkpoint import CheckpointError

        if isinstance(failure, (CheckpointError, BadInput)):
            return False
        return self.groups is not None and self.restarts < self.max_restarts

    def recover(self, failure: BaseException, rebuild: Callable[[], None]) -> dict:
        """Recover `failure` in-process (docs/recovery.md): re-form the group, restore, `rebuild` what held
        the old group (DDP). Re-raises `failure` when this rank may not (restart mode, a world of one, the
        budget spent); RecoveryFailed when the ranks cannot meet or no state can be restored: either way
        the process ends and the launcher restarts every worker, as the restart mode does."""
        if not self.can_recover(failure):
            raise failure
        self.restarts += 1
        state = self.protector.state
        from_step, durable_step = state.step, state.last_saved_step
        self.failed_at = from_step
        began = time.perf_counter()
        self.log.error("a rank failed: recovering in-process", step=from_step, restart=self.restarts,
                       error=f"{type(failure).__name__}: {failure}",
                       where="".join(traceback.format_tb(failure.__traceback__)[-3:]).strip()[-2000:])
        timings = self.groups.recover(failure)
        if self.snapshots is not None:
            self.snapshots.wait()
        try:
            restored = restore.after_failure(self.protector, self.store, device=self.device, world_size=self.world,
                                             held=self._held(), fingerprint=self.fingerprint)
        except LookupError as exc:
            raise RecoveryFailed(str(exc)) from failure
        rebuild()
        total = time.perf_counter() - began
        record = {**timings, **restored, "from_step": from_step, "durable_step": durable_step,
                  "steps_lost": from_step - restored["restored_step"], "restart": self.restarts,
                  "recovery_seconds": total}
        record = {key: round(value, 6) if isinstance(value, float) else value for key, value in record.items()}
        self.protector.event(event_types.IN_PROCESS_RESTART, **record)
        self.log.warning("recovered in-process", **record)
        return record

    def take_over(self, rebuild: Callable[[], None]) -> dict:
        """A standby promoted in a killed rank's place (runtime/resilience/standby.py), after the Protector's
        begin: meet the surviving ranks at their barrier, form the group with them, restore what they
        restore (the agreement is theirs: the same collectives in the same order), and `rebuild` as they
        do. RecoveryFailed when they are not there: the process ends and the launcher restarts every worker."""
        began = time.perf_counter()
        dead = self.groups.rank
        timings = self.groups.join(f"rank {dead}'s process died; a standby took its place")
        try:
            # the survivors' decisions (the checkpoint the state builds on, the guard's trouble since) come
            # with it: what the next snapshots are signed on top of and the next checkpoint is judged by
            restored = restore.after_failure(self.protector, self.store, device=self.device, world_size=self.world,
                                             held=self._held(), fingerprint=self.fingerprint, standby=True)
        except LookupError as exc:
            raise RecoveryFailed(str(exc)) from None
        rebuild()
        record = {**timings, **restored, "replaced_rank": dead, "standby": True,
                  "recovery_seconds": time.perf_counter() - began}
        record = {key: round(value, 6) if isinstance(value, float) else value for key, value in record.items()}
        self.protector.event(event_types.IN_PROCESS_RESTART, **record)
        self.log.warning("a standby took a killed rank's place", **record)
        return record

    def _held(self) -> Any:
        """The replicas this rank holds of another rank's snapshots (runtime/resilience/replicate.py)."""
        replicator = self.snapshots.replicator if self.snapshots is not None else None
        return replicator.held if replicator is not None else None

    def close(self, *, completed: bool) -> None:
        if self.snapshots is not None:
            self.snapshots.close(completed=completed)
        if self.groups is not None:
            self.groups.close()
