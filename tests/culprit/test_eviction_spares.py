"""The eviction verdict with hot spares waiting (trainguard/decide/culprit.py `eviction`, pure): a spare keeps
the world size whole, so a job that cannot shrink may keep the culprit's node out; every other refusal
stands."""

from __future__ import annotations

import pytest

from trainguard.decide.culprit import CulpritVerdict, Job, eviction

NAMED = CulpritVerdict([1], "n2", 0.9, [])
FIXED = Job(("n1", "n2"), min_nodes=2, max_nodes=2)          # --nnodes 2:2
FIXED_WITH_SPARE = Job(("n1", "n2"), min_nodes=2, max_nodes=2, spares=1)


def test_a_job_that_cannot_shrink_keeps_the_culprit_out_when_a_spare_waits():
    action, why = eviction(NAMED, FIXED_WITH_SPARE, "auto", 2)
    assert action == "evict"
    assert "keep n2 out; a hot spare takes its place (1 waiting): the job re-forms on 2 node(s)" == why


def test_without_a_spare_a_job_that_cannot_shrink_restores_in_place():
    action, why = eviction(NAMED, FIXED, "auto", 2)
    assert action == "restore" and why == "the job is not elastic (--nnodes 2:2) and no hot spare waits"
    action, why = eviction(NAMED, FIXED, "on", 2)
    assert action == "restore" and why == "evicting n2 would leave 1 node(s) and 0 hot spare(s), below the minimum 2"


def test_evict_on_with_a_spare_keeps_the_culprit_out():
    assert eviction(NAMED, FIXED_WITH_SPARE, "on", 2)[0] == "evict"


def test_one_spare_does_not_fill_two_places_below_the_minimum():
    action, why = eviction(NAMED, Job(("n1", "n2"), 3, 3, spares=1), "on", 2)     # a job already one short
    assert action == "restore" and "leave 1 node(s) and 1 hot spare(s), below the minimum 3" in why


def test_a_single_node_job_with_a_spare_may_replace_its_only_node():
    action, why = eviction(NAMED, Job(("n2",), 1, 1, spares=1), "auto", 2)
    assert action == "evict" and why.endswith("re-forms on 1 node(s)")


def test_an_elastic_job_with_a_spare_says_the_spare_takes_the_place_rather_than_a_shrink():
    action, why = eviction(NAMED, Job(("n1", "n2", "n3"), 2, 3, spares=2), "auto", 2)
    assert action == "evict" and why == ("keep n2 out; a hot spare takes its place (2 waiting): "
                                         "the job re-forms on 3 node(s)")
    action, why = eviction(NAMED, Job(("n1", "n2", "n3"), 2, 3), "auto", 2)
    assert action == "evict" and why == "keep n2 out; the job re-forms on 2 node(s)"


@pytest.mark.parametrize("verdict,job,setting,why", [
    (NAMED, FIXED_WITH_SPARE, "off", "restore.evict is off"),
    (CulpritVerdict([], None, 0.8, []), FIXED_WITH_SPARE, "auto", "no culprit node to keep out"),
    (CulpritVerdict([1, 2], None, 0.8, []), FIXED_WITH_SPARE, "on", "no culprit node to keep out"),
    (CulpritVerdict([1], "n9", 0.9, []), FIXED_WITH_SPARE, "auto", "the culprit's node n9 is not in the job"),
    (NAMED, Job(("n1", "n2"), 2, 2, evictions_last_hour=2, spares=1), "auto",
     "2 eviction(s) in the last hour: the limit is 2"),
], ids=["off", "no-culprit", "no-single-node", "not-in-the-job", "hourly-limit"])
def test_a_spare_lifts_no_other_refusal(verdict, job, setting, why):
    assert eviction(verdict, job, setting, 2) == ("restore", why)
