"""End to end through `trainguard train`: two simulated nodes x two ranks on loopback (tests/culprit/cluster.py's
launchers and rendezvous store, an agent beside each node), an exception in one rank of the second node, recovered
in-process: no rank's process ends, every rank restores the same in-memory snapshot, nothing past it is lost;
then a SIGKILL of another rank of that node, whose warm standby takes its place (runtime/resilience/standby.py):
no healthy rank's process ends, every rank restores the next snapshot, and the run completes. The agents
watch it all (their stall watchdog, the training collector) and take no action: a recovery in seconds is not
a stall, and nothing is restored or ended behind the ranks' backs."""

from __future__ import annotations

import pytest
import yaml

from tests.culprit.cluster import Cluster
from trainguard import event_types, tls

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

STEPS, EVERY, FAULT_STEP, FAILING_RANK = 21, 5, 13, 3
CHECKPOINT_STEP = 20     # after both recoveries: a save's collectives on the re-formed checkpoint group
CRASH_STEP, KILLED_RANK = 18, 2


def rank_events(run_dir, rank):
    return [r["event"] for r in tls.read_records(run_dir / "tls" / f"rank-{rank}.jsonl") if r.get("event")]


def test_an_exception_in_one_rank_recovers_in_process_on_two_nodes(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "tls").mkdir(parents=True)
    shm = tmp_path / "shm"
    shm.mkdir(mode=0o700)
    policy_path = tmp_path / "policy.yaml"
    policy_path.write_text(yaml.safe_dump({"recovery": {"mode": "in_process", "snapshot_every": EVERY,
                                                        "snapshot_dir": str(shm), "barrier_seconds": 60}}))
    c = Cluster(tmp_path, run_dir, policy_path)
    try:
        c.start_store()
        c.wait_store()
        for node in ("n1", "n2"):
            c.start_agent(node)
        for node in ("n1", "n2"):
            c.wait_agent(node)
        args = ("--steps", str(STEPS), "--checkpoint-every", str(CHECKPOINT_STEP), "--device", "cpu",
                "--inject", f"error@{FAULT_STEP}:{FAILING_RANK}", "--inject", f"crash@{CRASH_STEP}:{KILLED_RANK}")
        launchers = [c.launch(node, *args, nnodes="2", nproc=2) for node in ("n1", "n2")]
        codes = [launcher.wait(timeout=240) for launcher in launchers]
        assert codes == [0, 0], c.diagnostics()
    finally:
        c.stop()

    restarts, takeovers = [], []
    for rank in range(4):
        seen = rank_events(run_dir, rank)
        starts = [e for e in seen if e["type"] == event_types.RUN_START]
        # No launcher restart: the killed rank's standby started in the same attempt (restart_count 0);
        # every other rank is one process from start to end: no healthy rank ended.
        assert [s["restart_count"] for s in starts] == [0] * (2 if rank == KILLED_RANK else 1), (rank, starts)
        first, second = [e for e in seen if e["type"] == event_types.IN_PROCESS_RESTART]
        restarts.append(first)
        assert first["failed_rank"] == FAILING_RANK and "InjectedError" in first["cause"]
        assert first["source"] == "snapshot"
        # Nothing lost past the newest snapshot before the fault: the one of step 10.
        assert first["restored_step"] == (FAULT_STEP - 1) // EVERY * EVERY == 10
        assert first["from_step"] in (FAULT_STEP - 1, FAULT_STEP)   # ranks that finished step 13's record or not
        restored = [e["restored_step"] for e in seen if e["type"] == event_types.SNAPSHOT_RESTORED]
        assert restored == [10, 15]
        # The kill: every rank restores the snapshot of step 15, the killed rank's standby included.
        assert second["source"] == "snapshot" and second["restored_step"] == 15 and second["generation"] == 2
        if rank == KILLED_RANK:
            assert second["standby"] is True and second["replaced_rank"] == KILLED_RANK
            takeovers.append(second)
        else:
            assert second["from_step"] in (CRASH_STEP - 1, CRASH_STEP) and "standby" not in second
        assert not [e for e in seen if e["type"] in (event_types.SNAPSHOT_FALLBACK, event_types.SNAPSHOT_INVALID)]
        assert seen[-1] == {"type": event_types.RUN_END, "reason": "completed", "step": STEPS}
        # Every snapshot is also held by the same local rank of the other node (runtime/resilience/replicate.py).
        replicated = [e for e in seen if e["type"] == event_types.SNAPSHOT_REPLICATED]
        assert {e["step"] for e in replicated} >= {5, 10} and {e["peer_rank"] for e in replicated} == {(rank + 2) % 4}
        assert not [e for e in seen if e["type"] in (event_types.SNAPSHOT_REPLICA_FAILED, event_types.REPLICA_REFUSED)]
    assert {r["generation"] for r in restarts} == {1} and len(takeovers) == 1
    # A checkpoint after the standby's takeover: every rank, the standby included, saves on the checkpoint
    # manager's group formed again with the default group (it hung on the old one's connections).
    saved = [e["step"] for e in rank_events(run_dir, 0) if e["type"] == event_types.CHECKPOINT_SAVED]
    assert CHECKPOINT_STEP in saved, saved
    for node in ("n1", "n2"):   # the agents beside watched (their node log) and did nothing
        assert c.records(f"node-{node}.jsonl"), node
        acted = c.events(f"node-{node}-actions.jsonl", event_types.ACTION) + \
            c.events(f"node-{node}-actions.jsonl", event_types.SHADOW_ACTION)
        assert acted == [], (node, acted)
    fired = [e for e in rank_events(run_dir, KILLED_RANK) if e["type"] == event_types.FAULT_INJECTED]
    assert [e["kind"] for e in fired] == ["crash"], fired
    assert list(shm.glob("*/*/rank-*")) == []        # a completed run clears its snapshots
    assert list(shm.glob("*/*/replica-*")) == []     # and the replicas each rank held
