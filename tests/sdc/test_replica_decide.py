"""The replica verdict, fingerprints in and decisions out (trainguard/decide/replica.py)."""

from __future__ import annotations

from trainguard.decide.replica import (ARBITRATION, GRADIENTS, MISMATCH, WEIGHTS, ReplicaCheck, ReplicaMonitor,
                                       ReplicaPolicy, check_fields, check_from_event, minority, replay)

NODES3 = ("n0", "n1", "n2")


def check(step, weights, gradients=(), recomputed=(), nodes=NODES3, t=None):
    return ReplicaCheck(step, float(step if t is None else t), tuple(weights), tuple(gradients),
                        tuple(recomputed), nodes[:len(weights)])


def test_agreeing_replicas_raise_nothing():
    monitor = ReplicaMonitor()
    assert monitor.observe(check(50, [7, 7, 7], [3, 3, 3])) is None
    assert monitor.observe(check(100, [7, 7], [3, 3], nodes=("a", "b"))) is None


def test_three_replicas_name_the_minority_and_roll_back():
    verdict = ReplicaMonitor().observe(check(50, [7, 9, 7], [3, 3, 3], recomputed=[7, 9, 7]))
    assert (verdict.kind, verdict.what, verdict.ranks, verdict.nodes, verdict.action) == \
        (MISMATCH, WEIGHTS, (1,), ("n1",), "rollback")
    assert verdict.confidence > 0.5 and "majority" in verdict.reasons[-1]


def test_gradients_that_differ_are_told_apart_from_weights():
    # a gradient corrupted after the all-reduce moves that rank's weights too: the gradients are the cause
    verdict = ReplicaMonitor().observe(check(50, [7, 7, 8], [3, 3, 4], recomputed=[7, 7, 8]))
    assert (verdict.what, verdict.ranks) == (GRADIENTS, (2,))


def test_no_strict_majority_names_nobody():
    assert minority((1, 2, 3)) is None and minority((1, 1, 2, 2)) is None and minority((1, 2)) is None
    verdict = ReplicaMonitor().observe(check(50, [1, 2, 3], recomputed=[1, 2, 3]))
    assert verdict.ranks == () and verdict.action == "rollback" and verdict.confidence == 0.0


def test_an_unstable_re_computation_names_the_rank_even_with_two_replicas():
    verdict = ReplicaMonitor().observe(check(50, [7, 9], recomputed=[7, 11], nodes=("a", "b")))
    assert verdict.ranks == (1,) and "different fingerprint when asked again" in verdict.reasons[-1]


def test_two_replicas_gradients_arbitrated_by_the_replay():
    monitor = ReplicaMonitor()
    first = monitor.observe(check(50, [7, 9], [3, 4], recomputed=[7, 9], nodes=("a", "b"), t=1000))
    assert first.kind == MISMATCH and first.ranks == () and first.action == "rollback"
    assert monitor.observe(check(40, [5, 5], [2, 2], nodes=("a", "b"))) is None     # replaying, agreeing
    second = monitor.observe(check(50, [7, 7], [4, 4], nodes=("a", "b"), t=2000))     # the replay: rank 1 was right
    assert (second.kind, second.what, second.ranks, second.nodes, second.action) == \
        (ARBITRATION, GRADIENTS, (0,), ("a",), None)
    assert second.timestamp == 1000            # the incident of the first mismatch is the one it names
    assert any("cannot tell" in r for r in second.reasons)   # the mismatch's reasons kept in front


def test_two_replicas_weights_cannot_be_attributed():
    monitor = ReplicaMonitor()
    verdict = monitor.observe(check(50, [7, 9], [3, 3], recomputed=[7, 9], nodes=("a", "b")))
    assert verdict.ranks == () and verdict.action == "rollback" and monitor.pending is None
    assert "cannot be attributed" in verdict.reasons[-1]


def test_a_mismatch_the_replay_reproduces_stops_the_run():
    monitor = ReplicaMonitor()
    assert monitor.observe(check(50, [7, 9, 7], recomputed=[7, 9, 7])).action == "rollback"
    again = monitor.observe(check(50, [7, 9, 7], recomputed=[7, 9, 7]))
    assert again.action == "stop" and again.ranks == (1,) and any("not transient" in r for r in again.reasons)
    assert again.cordon == ("n1",)           # named twice: its node is cordoned too
    monitor = ReplicaMonitor()                 # two replicas: the arbitration fails, the same step again
    monitor.observe(check(50, [7, 9], [3, 4], recomputed=[7, 9], nodes=("a", "b")))
    assert monitor.observe(check(50, [7, 9], [3, 4], recomputed=[7, 9], nodes=("a", "b"))).action == "stop"


def test_a_node_named_twice_within_the_window_is_cordoned():
    monitor = ReplicaMonitor(ReplicaPolicy(cordon_window_seconds=3600))
    assert monitor.observe(check(50, [7, 9, 7], recomputed=[7, 9, 7], t=0)).cordon == ()
    assert monitor.observe(check(100, [7, 7, 9], recomputed=[7, 7, 9], t=10)).cordon == ()   # another node
    verdict = monitor.observe(check(150, [7, 9, 7], recomputed=[7, 9, 7], t=100))
    assert verdict.cordon == ("n1",) and "cordon n1" in verdict.reasons[-1]
    late = ReplicaMonitor(ReplicaPolicy(cordon_window_seconds=3600))
    late.observe(check(50, [7, 9, 7], recomputed=[7, 9, 7], t=0))
    assert late.observe(check(100, [7, 9, 7], recomputed=[7, 9, 7], t=3601)).cordon == ()


def test_the_event_round_trips_and_replay_takes_the_same_decisions():
    checks = [check(50, [7, 7, 7], [3, 3, 3]), check(100, [-5, 9, -5], [3, 3, 3], recomputed=[-5, 9, -5]),
              check(100, [11, 11, 11], [4, 4, 4])]
    fields = [check_fields(c) for c in checks]
    assert fields[0] == {"replicas": 3, "clock": 50.0, "weights": "0000000000000007", "gradients": "0000000000000003"}
    assert fields[1]["weights"][0] == "fffffffffffffffb" and fields[1]["nodes"] == list(NODES3)
    assert [check_from_event(f, c.step, c.timestamp) for f, c in zip(fields, checks)][1] == checks[1]
    records = [{"timestamp": c.timestamp, "rank": rank, "step": c.step, "event": {"type": "replica_check", **f}}
               for c, f in zip(checks, fields) for rank in (0, 1, 2)]
    live = ReplicaMonitor()
    expected = [v for v in map(live.observe, checks) if v is not None]
    assert list(replay(records)) == expected and expected[0].ranks == (1,)


def test_after_an_in_process_restore_every_rank_checks_the_steps_trained_again(tmp_path, monkeypatch):
    """The 30-minute soak's second stop: a survivor that had checked step 3650 before the failure skipped
    that check when it trained 3650 again, while the standby that took a killed rank's place (fresh) did
    not; one rank waited in the check's all_gather, the others in the next step's collectives.
    `forget()` (the trainer's rebuild after every in-process restore) makes both check it."""
    import torch

    from trainer.replica_check import ReplicaChecks

    def ranks_checks(nodes):
        checks = ReplicaChecks([torch.nn.Parameter(torch.ones(2))], ["w"], every=50, world_size=2, rank=0,
                               node="n1", run_dir=tmp_path, emit=lambda *a, **k: None, log=None, nodes=nodes)
        checked = []
        monkeypatch.setattr(checks, "check", lambda step: checked.append(step) or setattr(checks, "checked", step))
        return checks, checked

    survivor, survivor_checks = ranks_checks(("n1", "n2"))
    survivor.after_step(3650)                     # before the failure (it went on to 3676)
    standby, standby_checks = ranks_checks(("n1", "n2"))
    for checks in (survivor, standby):            # the restore to 3634, then the rebuild on every rank
        checks.forget()
    for step in range(3635, 3651):
        survivor.after_step(step)
        standby.after_step(step)
    assert survivor_checks == [3650, 3650] and standby_checks == [3650]
