"""The culprit verdict (trainguard/decide/culprit.py) on synthetic evidence: every branch, and eviction."""

from __future__ import annotations

import pytest

from trainguard.decide import culprit
from trainguard.decide.culprit import Job, NodeSignals, RankEvidence, CulpritVerdict, decide, eviction

WAITING = '''Thread 100 (idle): "MainThread"
    _engine_run_backward (torch/autograd/graph.py:979)
    backward (torch/autograd/__init__.py:395)
    forward_backward (trainer/step.py:91)
Thread 101 (idle): "flight-recorder-dump"
    Event.wait (threading.py:629)
'''
IN_ALL_REDUCE = '''Thread 100 (idle): "MainThread"
    all_reduce (torch/distributed/distributed_c10d.py:2950)
    wrapper (torch/distributed/c10d_logger.py:81)
    HealthSync.sync (trainer/step.py:130)
'''
SLEEPING = '''Thread 200 (idle): "MainThread"
    FaultInjector.process_faults (trainer/faults.py:138)
    Trainer.train_step (trainer/loop.py:170)
Thread 201 (idle): "flight-recorder-dump"
    all_reduce (torch/distributed/distributed_c10d.py:2950)
'''


def fr(*groups: tuple[str, int]) -> dict:
    """A Flight Recorder dump with each group's last enqueued collective."""
    return {"version": "2.10", "entries": [],
            "pg_status": {g: {"last_enqueued_collective": str(s), "last_completed_collective": str(s - 1)}
                          for g, s in groups}}


def entries_only(seq: int) -> dict:
    return {"version": "2.4", "entries": [{"pg_id": 0, "collective_seq_id": s, "is_p2p": False}
                                          for s in range(1, seq + 1)]}


def ranks(*items) -> list[RankEvidence]:
    return [RankEvidence(rank, node, dump, stack) for rank, node, dump, stack in items]


def test_the_rank_behind_the_wavefront_is_the_culprit_and_its_stacks_raise_confidence():
    verdict = decide(ranks((0, "n1", fr(("0", 58)), WAITING), (1, "n2", fr(("0", 57)), SLEEPING)), [])
    assert verdict.culprit == {"rank": 1, "node": "n2", "ranks": [1]}
    assert verdict.confidence == culprit.WAVEFRONT_AND_STACKS
    assert any("rank 1 at #57" in r and "behind the wavefront" in r for r in verdict.reasons)


def test_wavefront_alone_names_the_rank_with_less_confidence():
    verdict = decide(ranks((0, "n1", fr(("0", 9)), None), (1, "n1", fr(("0", 9)), None),
                           (2, "n2", fr(("0", 8)), None), (3, "n2", fr(("0", 9)), None)), [])
    assert verdict.ranks == [2] and verdict.node == "n2" and verdict.confidence == culprit.WAVEFRONT_ONLY


def test_old_dumps_without_pg_status_are_read_from_their_entries():
    verdict = decide(ranks((0, "n1", entries_only(5), None), (1, "n2", entries_only(4), None)), [])
    assert verdict.ranks == [1]


def test_each_process_group_has_its_own_front():
    dumps = [fr(("0", 10), ("1", 4)), fr(("0", 10), ("1", 3)), fr(("0", 10))]
    verdict = decide(ranks(*[(r, f"n{r}", d, None) for r, d in enumerate(dumps)]), [])
    assert verdict.ranks == [1] and verdict.node == "n1"      # rank 2 is not in group 1: not counted behind


def test_stacks_name_the_rank_elsewhere_when_the_dumps_agree():
    verdict = decide(ranks((0, "n1", fr(("0", 5)), IN_ALL_REDUCE), (1, "n2", fr(("0", 5)), SLEEPING)), [])
    assert verdict.ranks == [1] and verdict.confidence == culprit.STACKS_ONLY


def test_side_threads_in_a_collective_do_not_count_only_the_main_thread():
    assert culprit.stack_class(SLEEPING) == culprit.ELSEWHERE
    assert culprit.stack_class(WAITING) == culprit.IN_COLLECTIVE
    assert culprit.stack_class(IN_ALL_REDUCE) == culprit.IN_COLLECTIVE
    assert culprit.stack_class(None) == culprit.UNKNOWN and culprit.stack_class("  \n") == culprit.UNKNOWN


def test_a_silent_rank_is_named_with_low_confidence():
    verdict = decide(ranks((0, "n1", fr(("0", 5)), IN_ALL_REDUCE), (1, "n2", None, None)), [])
    assert verdict.ranks == [1] and verdict.confidence == culprit.SILENT_RANK


def test_every_rank_in_the_same_collective_is_no_culprit():
    verdict = decide(ranks((0, "n1", fr(("0", 7)), IN_ALL_REDUCE), (1, "n2", fr(("0", 7)), WAITING)), [])
    assert verdict.culprit is None and verdict.ranks == []
    assert verdict.reasons[0].startswith("no culprit: all ranks in the same collective")


def test_thin_evidence_is_no_culprit():
    verdict = decide(ranks((0, "n1", None, None), (1, "n2", None, None)), [])
    assert verdict.culprit is None and verdict.confidence == culprit.NO_CULPRIT_THIN
    assert decide([], []).culprit is None


def test_an_xid_on_the_node_of_the_missing_rank_beats_everything():
    nodes = [NodeSignals("n2", xids=({"gpu": 0, "xid": 79},)), NodeSignals("n1")]
    verdict = decide(ranks((0, "n1", fr(("0", 7)), IN_ALL_REDUCE), (1, "n2", fr(("0", 6)), SLEEPING)), nodes)
    assert verdict.node == "n2" and verdict.ranks == [1] and verdict.confidence == culprit.HARDWARE_CONFIDENCE
    assert "XID 79 on GPU 0" in verdict.reasons[0]


def test_a_lost_gpu_names_its_node_when_the_wavefront_names_nobody():
    nodes = [NodeSignals("n1", gpus_lost=(3,))]
    verdict = decide(ranks((0, "n1", fr(("0", 7)), IN_ALL_REDUCE), (1, "n2", fr(("0", 7)), IN_ALL_REDUCE)), nodes)
    assert verdict.node == "n1" and verdict.ranks == [0] and "GPU 3 lost" in verdict.reasons[0]


def test_hardware_elsewhere_does_not_overrule_the_wavefront():
    nodes = [NodeSignals("n1", xids=({"gpu": 1, "xid": 13},))]
    verdict = decide(ranks((0, "n1", fr(("0", 7)), IN_ALL_REDUCE), (1, "n2", fr(("0", 6)), SLEEPING)), nodes)
    assert verdict.node == "n2" and verdict.confidence == culprit.WAVEFRONT_AND_STACKS


def test_culprits_on_several_nodes_name_no_node():
    verdict = decide(ranks((0, "n1", fr(("0", 7)), None), (1, "n2", fr(("0", 6)), None),
                           (2, "n3", fr(("0", 6)), None)), [])
    assert verdict.ranks == [1, 2] and verdict.node is None
    assert "no single node to keep out" in verdict.reasons[-1]


# ----------------------------------------------------------------------------------- eviction

NAMED = CulpritVerdict([1], "n2", 0.9, [])
ELASTIC = Job(("n1", "n2"), min_nodes=1, max_nodes=2)


@pytest.mark.parametrize("verdict,job,setting,limit,expected", [
    (NAMED, ELASTIC, "auto", 2, "evict"),
    (NAMED, ELASTIC, "off", 2, "restore"),                                   # eviction off
    (NAMED, Job(("n1", "n2"), 2, 2), "auto", 2, "restore"),                 # not elastic
    (NAMED, Job(("n1", "n2"), 2, 2), "on", 2, "restore"),                   # would go below MIN
    (NAMED, Job(("n1", "n2", "n3"), 2, 3), "on", 2, "evict"),
    (CulpritVerdict([], None, 0.8, []), ELASTIC, "on", 2, "restore"),              # no culprit
    (CulpritVerdict([1, 2], None, 0.8, []), ELASTIC, "on", 2, "restore"),          # no single node
    (NAMED, Job(("n1", "n2"), 1, 2, evictions_last_hour=2), "on", 2, "restore"),   # hourly limit
    (CulpritVerdict([1], "n9", 0.9, []), ELASTIC, "on", 2, "restore"),            # not in the job
    (NAMED, Job(("n2",), 1, 2), "on", 2, "restore"),                        # the last node
])
def test_eviction_only_with_a_culprit_node_above_min_and_under_the_limit(verdict, job, setting, limit, expected):
    action, why = eviction(verdict, job, setting, limit)
    assert action == expected and why
