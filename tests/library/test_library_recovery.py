"""The Protector's recovery (protect/recovery.py, docs/library.md "Recovery"): the switch, snapshots of the
states it knows taken by `after_step` and loaded by `begin` on top of the checkpoint resumed from, cleared
by `finish`; the Transformers / Lightning notice; and the documented loop's in-process restart on two real
processes over gloo (this file's one multi-process test)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.servers import free_port
from tests.trainer.helpers import events, step_records
from trainguard import event_types, policy as policy_mod
from trainguard.decide import snapshot_pace
from trainguard.protect import Protector, RNGState
from trainguard.protect.recovery import LoopRecovery, settings_of
from trainguard.runtime import cordon_key

ROOT = Path(__file__).resolve().parents[2]
TIMINGS = {"step_time_seconds": 0.01}


def private_dir(tmp_path: Path) -> Path:
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700, exist_ok=True)
    return shm


def protector(tmp_path: Path, *, seed: int = 0, **options) -> tuple[Protector, torch.nn.Module]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 1)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    options.setdefault("recovery", {"snapshot_every": 5, "snapshot_dir": str(private_dir(tmp_path))})
    return Protector(tmp_path / "run", states={"model": model, "optim": optim, "rng": RNGState()},
                     checkpoint_every=10, **options), model


def steps(p: Protector, model: torch.nn.Module, until: int) -> None:
    optim = p.states["optim"]
    while p.state.step < until:
        step = p.state.step + 1
        x = torch.randn(8, 4)
        loss = model(x).pow(2).mean()
        loss.backward()
        verdict = p.check(step, loss, torch.tensor(1.0))
        optim.step()
        optim.zero_grad()
        p.after_step(verdict, tokens=32, samples=8, timings=TIMINGS)


# ------------------------------------------------------------------------------------------- the switch
def test_the_switch_is_the_policys_section_and_recovery_is_set_over_it():
    policy = policy_mod.Policy()
    assert settings_of(None, policy) == policy.recovery and policy.recovery.mode == "in_process"
    assert settings_of("restart", policy).mode == "restart"
    assert settings_of({"snapshot_every": 3}, policy) == policy_mod.RecoveryPolicy(snapshot_every=3)
    assert settings_of(False, policy) is None
    with pytest.raises(policy_mod.PolicyError, match=r"Protector\(recovery=...\): recovery.snapshot_evry: unknown key"):
        settings_of({"snapshot_evry": 3}, policy)
    with pytest.raises(policy_mod.PolicyError, match=r"recovery.mode: .*'in_proces'"):
        settings_of("in_proces", policy)
    with pytest.raises(policy_mod.PolicyError, match="not int"):
        settings_of(5, policy)


def test_restart_mode_takes_no_snapshot(tmp_path):
    p, model = protector(tmp_path, recovery="restart")
    p.begin()
    steps(p, model, 6)
    p.close()
    assert not p.recovery.in_process and p.recovery.component.snapshots is None
    assert events(tmp_path / "run", event_types.SNAPSHOT_SAVED) == []
    assert not list(private_dir(tmp_path).iterdir())


# ------------------------------------------------------------------------ snapshots and the restart path
def test_a_restarted_loop_resumes_from_the_snapshot_on_top_of_its_checkpoint_and_a_finish_clears(tmp_path):
    run = tmp_path / "run"
    first, model = protector(tmp_path)
    assert first.begin().snapshot is None
    steps(first, model, 17)            # checkpoint 10; snapshots 5, 10, 15
    first.recovery.settle()
    at_15 = torch.load(first.recovery.component.store.path(15, ".snap"), weights_only=True)["model"]
    first.close()                      # the process ends without finish(): its snapshots stay for the restart
    saved = [(e["step"], e["bytes"] > 0, e["blocking_seconds"] >= 0) for e in events(run, event_types.SNAPSHOT_SAVED)]
    assert saved == [(5, True, True), (10, True, True), (15, True, True)]

    again, model = protector(tmp_path, seed=1)          # other weights: only the restore can bring step 15's
    begun = again.begin()
    assert (begun.resumed_from, begun.snapshot, again.state.step) == (10, 15, 15)
    assert all(torch.equal(value, at_15[name]) for name, value in model.state_dict().items())
    (restored,) = events(run, event_types.SNAPSHOT_RESTORED)
    assert (restored["restored_step"], restored["from_step"]) == (15, 10)
    assert again.state.last_saved_step == 10            # the durable checkpoint is still the one of step 10
    steps(again, model, 22)
    again.finish()
    again.close()
    assert not list(private_dir(tmp_path).rglob("snapshot-*"))     # a completed run clears its snapshots
    assert events(run, event_types.RUN_END)[-1]["step"] == 22


def test_snapshots_that_cost_more_than_their_budget_are_taken_less_often(tmp_path):
    """Rank 0 measures what its snapshots cost against its steps' time (trainguard/decide/snapshot_pace.py)
    and, once it has enough of both, stretches the interval (a `snapshot_paced` event with its inputs); the
    interval goes to every rank in the step's sync, and the snapshots follow it. A budget of 0.1% of 10 ms
    steps: any snapshot (a torch.save and a SHA-256) costs more than that every 5 steps."""
    p, model = protector(tmp_path, recovery={"snapshot_every": 5, "snapshot_budget": 0.001,
                                             "snapshot_dir": str(private_dir(tmp_path))})
    p.begin()
    steps(p, model, 60)
    p.close()
    (paced,) = events(tmp_path / "run", event_types.SNAPSHOT_PACED)
    assert paced["given"] == 5 and paced["budget"] == 0.001 and paced["step_seconds"] == 0.01
    # ceil(cost / (budget x step)) up to a multiple of 5, from a cost the event rounds to the microsecond
    assert 5 < paced["snapshot_every"] == pytest.approx(paced["cost_seconds"] / (0.001 * 0.01), abs=5)
    assert paced["snapshot_every"] % 5 == 0
    taken = [e["step"] for e in events(tmp_path / "run", event_types.SNAPSHOT_SAVED)]
    before = [step for step in taken if step <= paced["step"]]
    assert before == list(range(5, paced["step"] + 1, 5))[:len(before)] and len(before) >= snapshot_pace.MIN_SAMPLES
    assert all(step % paced["snapshot_every"] == 0 for step in taken if step > paced["step"])
    assert p.snapshot_every == paced["snapshot_every"]


def test_a_rollback_deletes_the_snapshots_of_the_abandoned_steps(tmp_path):
    p, model = protector(tmp_path)
    p.begin()
    steps(p, model, 17)
    p.restore(rollback=False)          # back to the checkpoint of step 10 (as a replica mismatch's restore does)
    steps(p, model, 11)
    p.recovery.settle()
    assert p.recovery.component.store.steps() == [10]     # 15 was of the abandoned timeline
    p.close()


def test_a_snapshot_directory_that_is_not_private_turns_snapshots_off_loudly(tmp_path):
    shared = private_dir(tmp_path) / f"trainguard-{os.geteuid()}"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)                # others may read it: refused, never used
    p, model = protector(tmp_path)
    assert p.begin().snapshot is None
    steps(p, model, 6)
    p.close()
    (skipped,) = events(tmp_path / "run", event_types.SNAPSHOT_SKIPPED)
    assert skipped["reason"] == "unavailable" and "mode 755" in skipped["why"]
    assert events(tmp_path / "run", event_types.SNAPSHOT_SAVED) == [] and list(shared.iterdir()) == []


def test_a_rank_without_snapshots_still_takes_part_in_the_resume_agreement(tmp_path, monkeypatch):
    """On several ranks, one whose snapshot directory was refused brings nothing to the exchange instead of
    skipping it (the others would wait in their all_gather); the ranks that hold one fall back, loudly."""
    from trainguard.runtime.resilience import restore

    exchanged = []

    def exchange(value, world_size):      # rank 0 without snapshots, rank 1 holding the one of step 15
        exchanged.append(value)
        return [value, {"local": [15], "held": {}}] if len(exchanged) == 1 else [value, value]
    p, model = protector(tmp_path)
    p.begin()
    steps(p, model, 17)                   # checkpoint 10; snapshots 10 and 15 (on top of it)
    p.recovery.settle()
    monkeypatch.setattr(restore, "_exchange", exchange)
    assert restore.after_resume(p, None, resumed_from=10, device="cpu", world_size=2) is None
    assert exchanged == [None]
    other = p.recovery.component.store
    exchanged.clear()
    monkeypatch.setattr(restore, "_exchange", lambda value, world_size: [None, value])   # seen from rank 1
    assert restore.after_resume(p, other, resumed_from=10, device="cpu", world_size=2) is None
    (fallback,) = events(tmp_path / "run", event_types.SNAPSHOT_FALLBACK)
    assert "rank(s) [0]" in fallback["why"]
    p.close()


# ------------------------------------------------------------------------------- where it is not possible
class Log:
    def __init__(self):
        self.lines = []

    def warning(self, message, **fields):
        self.lines.append((message, fields))


def test_a_framework_that_owns_the_loop_is_said_once_and_only_under_in_process(tmp_path):
    said = {}
    for mode in ("in_process", "restart"):
        p, _ = protector(tmp_path, recovery=mode)
        p.log = Log()
        for _ in range(2):
            p.recovery.not_in_process("the Transformers Trainer", "it holds the process group")
        said[mode] = p.log.lines
        p.close()
    assert said["restart"] == []
    ((message, fields),) = said["in_process"]
    assert "no in-process restart under the Transformers Trainer (it holds the process group)" in message
    assert "restart path" in message and fields == {"framework": "the Transformers Trainer", "snapshots": "on"}


def test_without_groups_a_failure_is_given_back_for_the_restart_path(tmp_path):
    p, _ = protector(tmp_path)
    failing = p.recovery.recoverable(lambda: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"):
        failing()
    assert p.recovery.recoverable(lambda: 7)() == 7
    off = LoopRecovery.build(p, False, None, sharded=False)
    with pytest.raises(ValueError):
        off.recover(ValueError("given back"))
    p.close()


# ------------------------------------------------------------------------- two processes, in-process restart
@pytest.mark.slow
@pytest.mark.timeout(480)
def test_the_documented_loop_recovers_a_rank_failure_in_process_on_two_ranks(tmp_path):
    run, shm, steps_, fail_at = tmp_path / "run", private_dir(tmp_path), 12, 8
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump({"recovery": {"snapshot_every": 5, "snapshot_dir": str(shm)}}))
    key, where = cordon_key.signing_key(None, create=True)      # one key for both ranks, made before they start
    assert key is not None, where
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": "2",
           "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-m", "tests.library.recovering_loop", str(run), str(steps_),
                               str(fail_at), str(policy), str(tmp_path / f"out-{rank}.json")],
                              env={**env, "RANK": str(rank)}, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for rank in range(2)]
    try:                               # generous: two interpreters importing torch on a loaded machine
        outputs = [proc.communicate(timeout=400)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert [proc.returncode for proc in procs] == [0, 0], "\n".join(out[-3000:] for out in outputs)

    results = [json.loads((tmp_path / f"out-{rank}.json").read_text()) for rank in range(2)]
    assert [r["pid"] for r in results] == [proc.pid for proc in procs]     # the same processes, start to end
    assert results[0]["weights"] == results[1]["weights"]                   # the replicas agree after it
    for rank in range(2):
        (restart,) = events(run, event_types.IN_PROCESS_RESTART, rank=rank)
        assert restart["failed_rank"] == 1 and f"injected failure at step {fail_at}" in restart["cause"]
        assert (restart["source"], restart["restored_step"], restart["generation"]) == ("snapshot", 5, 1)
        assert restart["steps_lost"] == restart["from_step"] - 5
        assert not events(run, event_types.SNAPSHOT_FALLBACK, rank=rank)
        assert events(run, event_types.RUN_END, rank=rank)[-1]["step"] == steps_
    # Rank 0 was in step 8's sync when rank 1 failed: its records run to 7, then from the snapshot again,
    # and the replayed steps are the same steps (the snapshot held the weights the loss was computed with).
    records = step_records(run)
    trained = [r["step"] for r in records]
    assert trained == list(range(1, fail_at)) + list(range(6, steps_ + 1))
    first, replayed = records[5:7], records[fail_at - 1:fail_at + 1]
    assert [r["metrics"]["loss"] for r in first] == [r["metrics"]["loss"] for r in replayed]
    assert not list(shm.rglob("snapshot-*"))                                # the completed run cleared them
