"""The Protector's recovery (docs/library.md "Recovery"): in-memory snapshots of the states it knows, their
use on resume, and the in-process restart of a plain torch loop.

    groups = init_process_group("gloo")          # instead of dist.init_process_group: a re-formable group
    protector = Protector(run, states=..., rank=r, world_size=w, process_groups=groups,
                          callbacks=Callbacks(rebuild=wrap_ddp_again))
    step = protector.recovery.recoverable(train_step)
    protector.begin()
    while protector.state.step < steps:
        outcome = step()                         # None: a failure was recovered in-process
        ...

The mechanics are the bundled trainer's (runtime/resilience/: `component.Recovery` takes the snapshots,
restores and re-forms the group); this is the library's side of them:

- the switch: the policy's `recovery` section, or the Protector's `recovery=` over it (a mode, a mapping of
  the section's keys, or False when the loop runs runtime/resilience itself, as the bundled trainer does);
- the Protector's three points call it (`begin`: the snapshot taken on top of the checkpoint it resumed
  from; `after_step`: a snapshot when due; `finish`/`close`: settled, and cleared when the run completed);
- the in-process restart, for a loop that formed its group with `init_process_group` and handed it over:
  `recoverable(step_fn)` catches a rank's failure, re-forms the group, restores the newest snapshot all
  ranks verify (else the checkpoint), clears the gradients and calls `Callbacks.rebuild` (DDP must be
  wrapped again: its reducer holds the group that was torn down);
- where the framework owns the loop and the group (the Transformers Trainer, a Lightning Strategy),
  `not_in_process` says once, in the log, why a failure takes the restart path there.
"""

from __future__ import annotations

import dataclasses
import os
from datetime import timedelta
from typing import Any, Callable, Mapping

from trainguard import log as tglog
from trainguard import policy as policy_mod
from trainguard.runtime.resilience.component import IN_PROCESS, RESTART, Recovery
from trainguard.runtime.resilience.inprocess import ProcessGroups

__all__ = ["IN_PROCESS", "RESTART", "LoopRecovery", "init_process_group", "settings_of"]
# The collective timeout of a group formed here: torch's default for gloo. An in-process restart does not
# wait for it (the abort releases a blocked collective at once); it bounds a hang nobody reports.
DEFAULT_TIMEOUT = timedelta(minutes=30)


def init_process_group(backend: str = "gloo", *, rank: int | None = None, world_size: int | None = None,
                       timeout: timedelta = DEFAULT_TIMEOUT) -> ProcessGroups:
    """The default process group, formed so that it can be re-formed in-process (what
    ``torch.distributed.init_process_group(backend, init_method="env://")`` does, on the job's store under
    a generation's prefix). Hand the result to `Protector(process_groups=...)`. `rank`, `world_size`: by
    default RANK and WORLD_SIZE from the environment (torchrun sets them, with MASTER_ADDR and MASTER_PORT)."""
    rank = int(os.environ["RANK"]) if rank is None else rank
    world_size = int(os.environ["WORLD_SIZE"]) if world_size is None else world_size
    settings = policy_mod.RecoveryPolicy()
    # the barrier's bound and the log are the Protector's once it holds the groups (LoopRecovery.build)
    groups = ProcessGroups.from_env(backend, rank, world_size, timeout=timeout,
                                    barrier_seconds=settings.barrier_seconds,
                                    log=tglog.get("protect.recovery", rank=rank))
    groups.form()
    return groups


def settings_of(recovery: Any, policy: policy_mod.Policy) -> policy_mod.RecoveryPolicy | None:
    """The recovery settings the Protector runs with: the policy's section (`recovery=None`), its `mode`
    replaced ("in_process" or "restart"), some of its keys replaced (a mapping, checked as the policy file's
    keys are: PolicyError names the bad one), a `RecoveryPolicy` as it is; None for False (the loop runs
    runtime/resilience itself: the Protector takes no snapshot and restarts nothing)."""
    if recovery is False:
        return None
    if recovery is None:
        return policy.recovery
    if isinstance(recovery, policy_mod.RecoveryPolicy):
        return recovery
    if isinstance(recovery, str):
        recovery = {"mode": recovery}
    if not isinstance(recovery, Mapping):
        modes = " or ".join(map(repr, policy_mod.RECOVERY_MODES))
        raise policy_mod.PolicyError(f"Protector(recovery=...): expected None, False, {modes}, a mapping of the "
                                     f"policy's recovery keys or a RecoveryPolicy, not {type(recovery).__name__}")
    section = {**dataclasses.asdict(policy.recovery), **recovery}
    return policy_mod.from_mapping({"recovery": section}, "Protector(recovery=...)").recovery


class LoopRecovery:
    """The recovery a Protector holds (`protector.recovery`). Without settings (recovery=False) every hook
    does nothing."""

    def __init__(self, protector: Any, settings: policy_mod.RecoveryPolicy | None, component: Recovery | None,
                 groups: ProcessGroups | None):
        self.protector, self.settings, self.component, self.groups = protector, settings, component, groups
        self.mode = settings.mode if settings is not None else None
        self.snapshot_step: int | None = None     # the snapshot `begin` loaded on top of the checkpoint
        self._completed = False
        self.said: set[str] = set()      # the frameworks said once (not_in_process)

    @classmethod
    def build(cls, protector: Any, recovery: Any, groups: ProcessGroups | None, *, sharded: bool) -> "LoopRecovery":
        """For `protector` (its policy, key, states and telemetry), from `recovery=` and the loop's groups.
        The in-process restart needs several ranks and the groups of `init_process_group`: without them a
        failure takes the restart path (the snapshots still serve the restarted workers)."""
        settings = settings_of(recovery, protector.policy)
        if settings is None:
            return cls(protector, None, None, None)
        in_process = settings.mode == IN_PROCESS and groups is not None and protector.world > 1
        if in_process:
            groups.barrier_seconds, groups.log = settings.barrier_seconds, protector.log
        component = Recovery.build(settings, protector, run_dir=protector.run_dir, rank=protector.rank,
                                   world_size=protector.world, device=protector.device,
                                   groups=groups if in_process else None, log=protector.log, sharded=sharded)
        if in_process and not sharded:
            groups.watch()            # another rank's failure aborts this rank's group (runtime/resilience)
        elif in_process:
            component.groups = None
            protector.log.warning("in-process restart is off with sharded checkpoints (FSDP2: its device mesh is "
                                  "not rebuilt in-process); a failure takes the restart path")
        return cls(protector, settings, component, groups)

    # --------------------------------------------------------------------- the Protector's three points
    def after_begin(self, resumed_from: int | None) -> int | None:
        """After the resume: the newest snapshot every rank holds that was taken on top of the checkpoint
        resumed from (or, with none, of this job), loaded; its step, or None."""
        if self.component is None:
            return None
        loaded = self.component.after_begin(resumed_from)
        self.snapshot_step = loaded["restored_step"] if loaded else None
        return self.snapshot_step

    def after_step(self) -> None:
        """After `after_step` carried out its decisions and its checkpoint: a snapshot when one is due (a
        rollback's lower step first deletes the snapshots of the abandoned steps)."""
        if self.component is not None:
            self.component.after_step()

    def settle(self) -> None:
        """Before a `run_end`: the snapshot being written is done and said."""
        if self.component is not None:
            self.component.settle()

    def finish(self) -> None:
        """The loop ran to its end (`Protector.finish`): `close` clears this rank's snapshots."""
        self.settle()
        self._completed = True

    def close(self) -> None:
        """A completed run clears its snapshots (the final checkpoint holds that state); any other end keeps
        them for the restart. Stops the watcher."""
        if self.component is not None:
            self.component.close(completed=self._completed)

    # ----------------------------------------------------------------------------- in-process restart
    @property
    def in_process(self) -> bool:
        """Whether a failure of this rank's step is recovered in the same process."""
        return self.component is not None and self.component.groups is not None

    def recoverable(self, step_fn: Callable[..., Any]) -> Callable[..., Any]:
        """`step_fn` (one step of the loop, ending in `after_step`), wrapped: what it returns, or None when
        it failed and the failure was recovered in-process (the state is then the restored step's:
        `protector.state.step`). What cannot be recovered so is raised as it was (restart mode, one rank,
        the budget spent, a failed save under `checkpoint_on_error: raise`) or as RecoveryFailed (the ranks
        did not meet, nothing to restore): the process ends and the launcher restarts the workers."""
        def step(*args: Any, **kwargs: Any) -> Any:
            try:
                return step_fn(*args, **kwargs)
            except Exception as failure:
                self.recover(failure)
                return None
        step.__wrapped__ = step_fn     # type: ignore[attr-defined]
        return step

    def recover(self, failure: BaseException) -> dict:
        """Recover `failure` in-process (for a loop that writes its own ``except``): the group re-formed,
        the state restored, the gradients cleared, `Callbacks.rebuild` called; the `in_process_restart`
        event's record. Raises as `recoverable` says when it cannot."""
        if self.component is None:
            raise failure
        return self.component.recover(failure, rebuild=self._rebuild)

    def _rebuild(self) -> None:
        """What held the old group or the failed step's work: the gradients of the failed step (every
        optimizer in `states`), then the loop's own (`Callbacks.rebuild`: DDP wrapped again)."""
        import torch

        for obj in self.protector.states.values():
            if isinstance(obj, torch.optim.Optimizer):
                obj.zero_grad(set_to_none=True)
        if self.protector.callbacks.rebuild is not None:
            self.protector.callbacks.rebuild()

    def not_in_process(self, framework: str, why: str) -> None:
        """Said once in the log, when the policy asks for in_process: `framework` owns the loop and the
        process group, so a failure takes the restart path (the snapshots serve the restarted workers)."""
        if self.mode != IN_PROCESS or framework in self.said:
            return
        self.said.add(framework)
        snapshots = "on" if self.component is not None and self.component.snapshots is not None else "off"
        self.protector.log.warning(
            f"recovery.mode in_process: no in-process restart under {framework} ({why}); a failure takes the "
            "restart path: the restarted workers resume from the newest verified checkpoint and the in-memory "
            "snapshot taken on top of it", framework=framework, snapshots=snapshots)
