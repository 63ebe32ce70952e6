"""An action on a shared run directory reads this node's registrations only (agent/restore.py `host_ranks`).

1,000 nodes x 8 ranks registered in RUN/control/ranks/. The node's stall watchdog follows the folder (as it
does every few seconds); a restore through the executor, the restore's ending of ranks and the eviction's
search for launchers then open no other node's registration (before: all 8,000, at every action)."""

from __future__ import annotations

import os
import time

import pytest

from tests.fleet.synthetic import fast_dir, node_name, register_rank
from trainguard import actions, rundir
from trainguard.agent import evict, restore
from trainguard.agent.actions_embedded import StallWatchdog
from trainguard.agent.culprit import Investigator
from trainguard.agent.executor import Executor
from trainguard.decide.ledger import Ledger, Notice
from trainguard.policy import RestorePolicy

NODES, RANKS = 1000, 8
HOST = node_name(0)


@pytest.fixture
def fleet(tmp_path, monkeypatch):
    monkeypatch.setattr(rundir.RankFiles, "RACY_SECONDS", 0.05)    # the files here are all seconds old
    with fast_dir(tmp_path) as run:
        for rank in range(NODES * RANKS):
            register_rank(run, rank, node_name(rank // RANKS))
        time.sleep(0.1)
        os.utime(rundir.ranks_dir(run))     # its last change later than every file's (past the racy window)
        time.sleep(0.1)
        yield run


def count_registration_reads(monkeypatch) -> list[str]:
    reads: list[str] = []
    real = rundir.read_registration
    monkeypatch.setattr(rundir, "read_registration", lambda path: reads.append(os.path.basename(path)) or real(path))
    return reads


def test_an_action_on_a_thousand_nodes_registrations_opens_only_this_nodes(fleet, monkeypatch):
    watchdog = StallWatchdog(fleet, 60.0, lambda notices: None, host=HOST)
    watchdog.progress()                     # the agent's catch-up: every registration once (the host is inside)
    reads = count_registration_reads(monkeypatch)
    register_rank(fleet, 3, HOST)           # this node's rank 3 restarted
    time.sleep(0.1)
    watchdog.progress()
    assert reads == ["rank-3.json"]

    executor = Executor(fleet, "n0", Ledger(), host=HOST,
                        investigator=Investigator(fleet, HOST, RestorePolicy()))   # asks for this node's live ranks first
    executor.submit([Notice(alertname="TrainingStalled", status="firing", action=actions.RESTORE, key="s@1",
                            starts_at=time.time() + 5)])
    ended = restore.end_local_ranks(fleet, HOST)
    launchers, refused = evict.proven_launchers(fleet, HOST)
    assert reads == ["rank-3.json"]         # the three actions: no registration opened, no other node's
    [done] = [e for e in executor.records.events() if e.get("type") == "action"]
    assert done["action"] == "restore" and done["ended"] == [] and len(done["skipped"]) == RANKS
    assert sorted(s["rank"] for s in ended["skipped"]) == list(range(RANKS))     # this node's, none alive
    assert {s["why"] for s in ended["skipped"]} == {"not running"} and launchers == [] and refused == []

    register_rank(fleet, 5, HOST)           # a change the watchdog has not seen yet: the action reads it
    time.sleep(0.1)
    assert [info.rank for info in restore.host_ranks(fleet, HOST)[0]] == list(range(RANKS))
    assert reads == ["rank-3.json", "rank-5.json"]
