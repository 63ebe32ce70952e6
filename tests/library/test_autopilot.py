"""The library's checkpoint autopilot: `Protector(checkpoint_every="auto")` in a plain loop, a process that
dies without `finish()` and a new one on the same run directory (a failure, as a crash and a restart look
in the log): the interval moves as the rule says, from the run's own measurements."""

from __future__ import annotations

import time

import pytest
import torch
import yaml

from tests.trainer.helpers import events, step_records
from trainguard.decide import checkpoint_interval as ci
from trainguard.policy import from_mapping
from trainguard.protect import Protector

POLICY = {"checkpoint": {"fleet_mtbf_gpu_hours": 1.0, "min_interval_seconds": 0.01}}


def steps(protector, model, optimizer, count):
    for _ in range(count):
        loss = model(torch.ones(4, 4)).square().mean()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        verdict = protector.check(protector.state.step + 1, loss.detach(), norm)
        optimizer.step()
        optimizer.zero_grad()
        protector.after_step(verdict, tokens=16, samples=4, timings={"step_time_seconds": 0.01})
        time.sleep(0.02)   # longer than the policy's minimum interval, however fast the machine: a save is due


def process(run, policy_file, count, finish=False):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    protector = Protector(run, states={"model": model, "optim": optimizer}, policy=str(policy_file),
                          checkpoint_every="auto")
    protector.begin()
    steps(protector, model, optimizer, count)
    if finish:
        protector.finish()
    protector.close()        # without finish(): no run_end, as a process killed mid-run


def test_a_failure_moves_the_interval(tmp_path):
    run, policy_file = tmp_path / "run", tmp_path / "policy.yaml"
    policy_file.write_text(yaml.safe_dump(POLICY))
    process(run, policy_file, 6)
    process(run, policy_file, 6)
    process(run, policy_file, 3, finish=True)
    changes = events(run, ci.INTERVAL_EVENT)
    assert changes[0]["reason"] == "no save measured yet"
    measured = changes[1:]
    # a change after each failure (more changes may come between, as the measured save time moves on a busy host)
    failures = [c["failures"] for c in measured]
    assert failures == sorted(failures) and failures[0] == 0 and {1, 2} <= set(failures)
    policy = from_mapping(POLICY).checkpoint
    for change in measured:
        rule = ci.recommend(ci.Measured(change["mtbf_seconds"], change["mtbf_source"], change["failures"],
                                        change["observed_seconds"], change["save_seconds"],
                                        change["restart_seconds"], change.get("snapshot_seconds"),
                                        change.get("snapshot_share", 0.0)), policy)
        if change.get("snapshot_every", 0) != change.get("previous_snapshot_every", 0) and \
                change["applied_seconds"] == change["previous_seconds"]:
            # the snapshot tier moved alone: the durable interval stays, within change_ratio of the rule's
            assert change["applied_seconds"] == pytest.approx(rule.interval_seconds, rel=policy.change_ratio)
            continue
        assert change["applied_seconds"] == pytest.approx(rule.interval_seconds, rel=1e-4, abs=1e-3)   # applied to the ms, its inputs to the µs
    # more failures in less time: a shorter MTBF (the save cost, measured on a busy host, moves the interval too)
    first_after = [next(c for c in measured if c["failures"] == n) for n in (0, 1, 2)]
    assert first_after[0]["mtbf_seconds"] > first_after[1]["mtbf_seconds"] > first_after[2]["mtbf_seconds"]
    assert step_records(run)[-1]["metrics"]["checkpoint_interval_seconds"] == measured[-1]["applied_seconds"]


def test_checkpoint_every_takes_steps_or_auto(tmp_path):
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="number of steps or 'auto'"):
        Protector(tmp_path / "run", states={"model": model}, checkpoint_every="sometimes")


def test_the_snapshot_interval_rank_0_applied_reaches_every_rank_through_the_sync(tmp_path, monkeypatch):
    """Issue 32's second tier: rank 0's autopilot steers recovery.snapshot_every; the step's one sync carries
    it (a slot beside the checkpoint interval) to `Protector.snapshot_every` on every rank."""
    from trainguard.protect import sync as sync_mod

    model = torch.nn.Linear(2, 2)
    on = {"checkpoint": {"autopilot": "on"}, "recovery": {"mode": "in_process", "snapshot_every": 5}}
    restart = Protector(tmp_path / "a", states={"model": model}, policy=from_mapping(
        {**on, "recovery": {"mode": "restart"}}))
    assert restart.autopilot.snapshot_every == 0                  # today's path: no snapshot tier to steer
    sharded = Protector(tmp_path / "b", states={"model": model}, policy=from_mapping(on), sharded_checkpoints=True)
    assert sharded.autopilot.snapshot_every == 0                  # FSDP2 takes no snapshots
    overridden = Protector(tmp_path / "d", states={"model": model}, policy=from_mapping(on), recovery="restart")
    assert overridden.autopilot.snapshot_every == 0               # the Protector's recovery= over the policy's
    overridden = Protector(tmp_path / "e", states={"model": model}, policy=from_mapping(on),
                           recovery={"snapshot_every": 10})
    assert overridden.autopilot.snapshot_every == 10
    protector = Protector(tmp_path / "c", states={"model": model}, policy=from_mapping(on), recovery=False)
    assert (protector.autopilot.snapshot_every, protector.snapshot_every) == (5, 0)   # the policy's stands
    protector.autopilot.snapshot_every = 9
    protector.check(1, torch.tensor(1.0), torch.tensor(0.5))
    assert protector.snapshot_every == 9

    # two ranks: rank 1 contributes zeros in rank 0's slots, the sum is what both read
    ranks = [sync_mod.HealthSync(2, rank, torch.device("cpu")) for rank in (0, 1)]
    contributed = []
    monkeypatch.setattr(sync_mod.dist, "all_reduce", lambda vector, op: contributed.append(vector.clone()))
    for rank, syncer in enumerate(ranks):
        syncer.sync(torch.tensor(2.0), torch.tensor(1.0), None, (0, 0), 120.0 if rank == 0 else 0.0,
                    7 if rank == 0 else 0)
    summed = (contributed[0] + contributed[1]).tolist()
    health = sync_mod.HealthSync._read(summed)
    assert (health.checkpoint_interval, health.snapshot_every, health.loss, health.grad_norm) == (120.0, 7, 2.0, 1.0)


def test_a_checkpoint_by_time_is_due_by_rank_0s_clock_on_every_rank(tmp_path, monkeypatch):
    """The 30-minute soak's stop: a standby that took a killed rank's place began its own count of the time
    since the last checkpoint at the takeover; at rank 0's due time the other ranks began a save and it did
    not, and each waited in another collective. The time base is rank 0's, carried in the step's sync."""
    import dataclasses

    from trainguard.protect import sync as sync_mod

    ranks = [sync_mod.HealthSync(2, rank, torch.device("cpu")) for rank in (0, 1)]
    contributed = []
    monkeypatch.setattr(sync_mod.dist, "all_reduce", lambda vector, op: contributed.append(vector.clone()))
    for rank, syncer in enumerate(ranks):
        syncer.sync(torch.tensor(2.0), torch.tensor(1.0), None, (0, 0), checkpoint_clock=1000.5 if rank == 0 else 0.0)
    assert sync_mod.HealthSync._read((contributed[0] + contributed[1]).tolist()).checkpoint_clock == 1000.5

    model = torch.nn.Linear(2, 2)
    standby = Protector(tmp_path / "run", states={"model": model}, checkpoint_every_seconds=60)
    standby.begin()
    assert standby.state.last_checkpoint_time is None          # a fresh process: no count of its own yet
    rank_0_saved_at = time.time() - 61.0
    real = standby.sync.sync
    monkeypatch.setattr(standby.sync, "sync", lambda *args, **kwargs: dataclasses.replace(
        real(*args, **kwargs), checkpoint_clock=rank_0_saved_at))
    verdict = standby.check(1, torch.tensor(1.0), torch.tensor(0.5))
    standby.after_step(verdict, tokens=4, samples=1, timings={"step_time_seconds": 0.01})
    assert [e["step"] for e in events(tmp_path / "run", "checkpoint_saved")] == [1]   # due by rank 0's clock
    monkeypatch.setattr(standby.sync, "sync", real)            # rank 0 itself: its own last save, just now
    verdict = standby.check(2, torch.tensor(1.0), torch.tensor(0.5))
    standby.after_step(verdict, tokens=4, samples=1, timings={"step_time_seconds": 0.01})
    assert [e["step"] for e in events(tmp_path / "run", "checkpoint_saved")] == [1]
    standby.close()
