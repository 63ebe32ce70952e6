"""The in-process restart's parts, one process: which state a rank restores (restore.py), the meeting in the
job's store (inprocess.py), and the switch (component.py, the policy). The whole path, ranks and all, is
test_recovery_e2e.py."""

from __future__ import annotations

import io
import json
import os
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from trainguard import event_types, policy
from trainguard.protect import TrainState
from trainguard.runtime.resilience import restore, sockets
from trainguard.runtime.resilience.component import Recovery
from trainguard.runtime.resilience.inprocess import ProcessGroups, RecoveryFailed
from trainguard.runtime.resilience.snapshot import SnapshotStore

KEY = b"k" * 32


class Log:
    def __getattr__(self, name):
        return lambda *args, **kwargs: None


class FakeProtector:
    """What restore.py asks of the Protector: its state, events, the durable restore, loading states."""

    def __init__(self, step: int, last_saved_step: int | None, checkpoint_step: int | None = None):
        self.state = TrainState(step=step, last_saved_step=last_saved_step)
        self.events: list[tuple[str, dict]] = []
        self.loaded: dict | None = None
        self.checkpoint_step = checkpoint_step
        self.log = Log()

    def event(self, kind, **fields):
        self.events.append((kind, fields))

    def kinds(self) -> list[str]:
        return [kind for kind, _ in self.events]

    def restore(self, *, rollback, source="resume", **fields):
        if self.checkpoint_step is not None:
            self.state.step = self.checkpoint_step
        return self.checkpoint_step

    def load_states(self, parts):
        self.loaded = parts
        self.state.step = parts["trainer"]["step"]
        return self.state.step


def store_with(tmp_path, *steps: int, base_step=None) -> SnapshotStore:
    (tmp_path / "shm").mkdir(exist_ok=True)
    store = SnapshotStore(tmp_path / "shm", tmp_path / "run", rank=0, world_size=1, key=KEY, key_id="kid")
    assert store.prepare() is None
    for step in steps:
        buffer = io.BytesIO()
        torch.save({"trainer": {"step": step}}, buffer)
        store.write(step, buffer.getvalue(), base_step=base_step)
    return store


def test_after_a_failure_the_newest_snapshot_at_or_after_the_checkpoint_is_restored(tmp_path):
    protector = FakeProtector(step=23, last_saved_step=20, checkpoint_step=20)
    store = store_with(tmp_path, 15, 20)
    loaded = restore.after_failure(protector, store, device="cpu", world_size=1)
    assert loaded["source"] == restore.SNAPSHOT and loaded["restored_step"] == 20
    assert protector.kinds() == [event_types.SNAPSHOT_RESTORED]


def test_a_checkpoint_newer_than_every_snapshot_wins_quietly(tmp_path):
    protector = FakeProtector(step=23, last_saved_step=20, checkpoint_step=20)
    loaded = restore.after_failure(protector, store_with(tmp_path, 15), device="cpu", world_size=1)
    assert loaded["source"] == restore.CHECKPOINT and loaded["restored_step"] == 20
    assert protector.loaded is None and protector.kinds() == []


def test_a_snapshot_that_does_not_verify_falls_back_to_the_checkpoint_loudly(tmp_path):
    protector = FakeProtector(step=23, last_saved_step=10, checkpoint_step=10)
    store = store_with(tmp_path, 20)
    store.path(20, ".snap").write_bytes(b"not what was hashed")
    loaded = restore.after_failure(protector, store, device="cpu", world_size=1)
    assert loaded == {**loaded, "source": restore.CHECKPOINT, "restored_step": 10}
    assert protector.kinds() == [event_types.SNAPSHOT_INVALID, event_types.SNAPSHOT_FALLBACK]
    assert protector.events[0][1]["reason"] == "size" and protector.loaded is None


def test_nothing_to_restore_hands_the_failure_to_the_launcher(tmp_path):
    with pytest.raises(LookupError):
        restore.after_failure(FakeProtector(step=3, last_saved_step=None), None, device="cpu", world_size=1)


def test_a_standby_takes_the_survivors_unsaved_decisions(tmp_path, monkeypatch):
    """A standby's process starts with no record of the last save or of the guard's trouble since it (no
    snapshot holds them); after the restore every rank holds those of the lowest rank that lived through
    the failure, so the next checkpoint is judged stable, and the next snapshot based, the same way."""
    survived = {"last_saved_step": 20, "trouble_since_checkpoint": True}

    calls: list = []

    def exchange(value, world_size):      # a 2-rank all_gather: rank 0 is the standby, rank 1 survived
        calls.append(value)
        if len(calls) == 3:               # listings, refusals, then the decisions (the standby brings none)
            return [value, survived]
        return [value, value]             # both hold the same snapshot and refuse nothing


    monkeypatch.setattr(restore, "_exchange", exchange)
    standby = FakeProtector(step=0, last_saved_step=None)
    loaded = restore.after_failure(standby, store_with(tmp_path, 25, base_step=20), device="cpu", world_size=2,
                                   standby=True)
    assert loaded["restored_step"] == 25
    assert (standby.state.last_saved_step, standby.state.trouble_since_checkpoint) == (20, True)
    assert calls[2] is None
    calls.clear()
    survivor = FakeProtector(step=27, last_saved_step=20, checkpoint_step=20)
    survivor.state.trouble_since_checkpoint = True
    restore.after_failure(survivor, store_with(tmp_path, 25, base_step=20), device="cpu", world_size=2)
    assert (survivor.state.last_saved_step, survivor.state.trouble_since_checkpoint) == (20, True)


def test_a_restarted_worker_takes_a_snapshot_only_on_top_of_the_checkpoint_it_resumed(tmp_path):
    store = store_with(tmp_path, 25, base_step=20)
    other_timeline = FakeProtector(step=10, last_saved_step=10)
    assert restore.after_resume(other_timeline, store, resumed_from=10, device="cpu", world_size=1) is None
    protector = FakeProtector(step=20, last_saved_step=20)
    loaded = restore.after_resume(protector, store, resumed_from=20, device="cpu", world_size=1)
    assert loaded["restored_step"] == 25 and protector.state.step == 25


def test_a_rank_whose_snapshots_are_off_still_meets_the_others_at_resume(tmp_path, monkeypatch):
    """A node whose snapshot directory was refused has no store; its ranks still join the exchange (the
    others wait in it), and the ranks that hold one fall back to the checkpoint, loudly."""
    exchanged: list = []

    def exchange(value, world_size):      # this rank's view of a 2-rank all_gather: the other rank has none
        exchanged.append(value)
        return [value, None]

    monkeypatch.setattr(restore, "_exchange", exchange)
    without = FakeProtector(step=20, last_saved_step=20)
    assert restore.after_resume(without, None, resumed_from=20, device="cpu", world_size=2) is None
    assert exchanged == [None] and without.kinds() == []
    holder = FakeProtector(step=20, last_saved_step=20)
    store = store_with(tmp_path, 25, base_step=20)
    assert restore.after_resume(holder, store, resumed_from=20, device="cpu", world_size=2) is None
    assert len(exchanged) == 2 and holder.kinds() == [event_types.SNAPSHOT_FALLBACK] and holder.loaded is None


def test_before_the_first_checkpoint_only_the_same_jobs_snapshots_count(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    store_with(tmp_path, 5, base_step=None)
    same_job = restore.after_resume(FakeProtector(0, None), store_with(tmp_path), resumed_from=None, device="cpu",
                                    world_size=1)
    assert same_job["restored_step"] == 5         # a worker job-a's launcher restarted
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
    later = store_with(tmp_path)
    assert restore.after_resume(FakeProtector(0, None), later, resumed_from=None, device="cpu", world_size=1) is None
    assert later.steps() == []                   # what job-a left is deleted, not resumed


# ------------------------------------------------------------------------------ meeting in the store
def groups(store, rank=0, world=2, barrier=5.0) -> ProcessGroups:
    from datetime import timedelta

    found = ProcessGroups(store, "gloo", rank, world, timeout=timedelta(seconds=5), barrier_seconds=barrier,
                          log=Log())
    found.form = lambda: None        # the group itself needs every rank: the e2e test forms it
    return found


def test_the_first_failure_reported_names_the_rank_and_everyone_meets():
    store = dist.HashStore()
    store.set("trainguard/recovery/0/fault", json.dumps({"rank": 1, "cause": "RuntimeError: boom"}))
    store.add("trainguard/recovery/0/arrived", 1)               # rank 1 is already at the barrier
    found = groups(store).recover(RuntimeError("Connection closed by peer"))
    assert found["failed_rank"] == 1 and found["cause"] == "RuntimeError: boom" and found["generation"] == 1


def test_a_rank_that_never_arrives_fails_the_recovery_within_the_bound():
    with pytest.raises(RecoveryFailed, match="1 of 2 ranks met"):
        groups(dist.HashStore(), barrier=0.2).recover(RuntimeError("boom"))


def test_restart_mode_and_a_spent_budget_give_the_failure_back():
    failure = RuntimeError("boom")
    restart = Recovery(None, store=None, snapshots=None, groups=None, max_restarts=3, device="cpu",
                       world_size=2, log=Log())
    with pytest.raises(RuntimeError) as raised:
        restart.recover(failure, rebuild=lambda: None)
    assert raised.value is failure
    spent = Recovery(None, store=None, snapshots=None, groups=SimpleNamespace(), max_restarts=0, device="cpu",
                     world_size=2, log=Log())
    assert not spent.can_recover()


def test_the_budget_counts_failures_that_come_back_before_the_run_gets_past_them():
    """A fault that repeats at the same step spends the budget (then the restart path); a long run's faults
    that each let it go on past the step that failed do not add up to it."""
    protector = FakeProtector(step=12, last_saved_step=10)
    recovery = Recovery(protector, store=None, snapshots=None, groups=SimpleNamespace(), max_restarts=2,
                        device="cpu", world_size=2, log=Log())
    recovery.restarts, recovery.failed_at = 2, 12      # failed twice at step 13 (12 completed)
    for step in (11, 12):                              # replayed up to the step that failed: not past it
        protector.state.step = step
        recovery.after_step()
        assert not recovery.can_recover()
    protector.state.step = 13                          # step 13 completed this time
    recovery.after_step()
    assert recovery.restarts == 0 and recovery.failed_at is None and recovery.can_recover()


def test_the_policy_switch_is_checked_and_defaults_to_in_process():
    assert policy.Policy().recovery.mode == "in_process"
    assert policy.from_mapping({"recovery": {"mode": "restart"}}).recovery.mode == "restart"
    with pytest.raises(policy.PolicyError, match="recovery.mode"):
        policy.from_mapping({"recovery": {"mode": "fast"}})
    with pytest.raises(policy.PolicyError, match="recovery.snapshot_keep"):
        policy.from_mapping({"recovery": {"snapshot_keep": 0}})


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="the connections are found through /proc (Linux)")
def test_an_abort_shuts_the_groups_connections_down_and_leaves_the_stores():
    """gloo's abort wakes nothing blocked; shutting its connections down does, on both ends at once."""
    group_server, store_server = socket.create_server(("127.0.0.1", 0)), socket.create_server(("127.0.0.1", 0))
    store_port = store_server.getsockname()[1]
    before = set(sockets.inodes())
    mine = socket.create_connection(group_server.getsockname())
    theirs, _ = group_server.accept()
    to_store = socket.create_connection(("127.0.0.1", store_port))
    store_side, _ = store_server.accept()
    formed = set(sockets.inodes()) - before
    try:
        assert sockets.shut_down(formed, keep_ports={store_port}) == 2
        theirs.settimeout(5)
        assert theirs.recv(1) == b""                  # the peer's blocked read returns: connection closed
        to_store.sendall(b"x")
        store_side.settimeout(5)
        assert store_side.recv(1) == b"x"             # the job's store still answers
    finally:
        for s in (mine, theirs, to_store, store_side, group_server, store_server):
            s.close()


def test_the_snapshot_directory_must_be_named_from_the_root():
    assert policy.from_mapping({"recovery": {"snapshot_dir": "/mnt/shm"}}).recovery.snapshot_dir == "/mnt/shm"
    with pytest.raises(policy.PolicyError, match="recovery.snapshot_dir: expected an absolute path"):
        policy.from_mapping({"recovery": {"snapshot_dir": "shm"}})


def test_goodput_splits_an_in_process_restart_and_counts_what_the_snapshot_kept():
    from trainguard import goodput

    def step(n, ts):
        return {"timestamp": ts, "step": n, "metrics": {"step_time_seconds": 1.0}}

    records = [step(n, float(n)) for n in range(1, 13)]          # steps 1..12, one second each
    records.append({"timestamp": 16.0, "step": 10, "event": {
        "type": event_types.IN_PROCESS_RESTART, "restored_step": 10, "durable_step": 5, "source": "snapshot",
        "teardown_seconds": 0.5, "barrier_seconds": 0.5, "reform_seconds": 0.25, "restore_seconds": 0.75,
        "recovery_seconds": 3.0}})
    records += [step(n, 17.0 + n - 11) for n in range(11, 14)]   # 11, 12 again, then 13
    result = goodput.compute(records)
    bad = result.badput_seconds
    assert bad["in_process_teardown"] == pytest.approx(1.0) and bad["in_process_reform"] == pytest.approx(0.25)
    assert bad["in_process_restore"] == pytest.approx(0.75)
    # 12 -> 16 (the start of step 11 again) less the 2 s of parts, plus steps 11 and 12 trained twice
    assert bad["in_process_recovery"] == pytest.approx((16 - 12 - 2.0) + 2)
    assert result.restarts == 0 and result.in_process_restarts == 1 and result.snapshot_steps_saved == 5
    assert result.productive_seconds + sum(bad.values()) == pytest.approx(result.total_seconds)


def test_a_failure_the_run_is_told_to_end_on_is_not_retried_in_process():
    from trainguard.exits import BadInput
    from trainguard.runtime.checkpoint import CheckpointError

    recovery = Recovery(None, store=None, snapshots=None, groups=SimpleNamespace(), max_restarts=3, device="cpu",
                        world_size=2, log=Log())
    assert recovery.can_recover(RuntimeError("Connection closed by peer"))
    assert not recovery.can_recover(CheckpointError("disk full", code="write_failed"))
    assert not recovery.can_recover(BadInput("bad config"))
