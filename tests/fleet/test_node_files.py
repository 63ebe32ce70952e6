"""On a shared run directory an agent follows only its own node's rank files.

The ownership comes from RUN/control/ranks/ (the host each rank registered) and, for a file nobody
registered, from its first record's `node`; records written by another node are skipped. At 1,000 nodes
(memory) and the files an update touches: test_agent_stays_flat.py; CPU: bench/bench_fleet.py --updates.
"""

from __future__ import annotations

import os
import time

from trainguard import rundir
from trainguard.agent.collector import Context
from trainguard.agent.collectors.training import TrainingCollector
from trainguard.runtime.control import write_rank_file

from tests.fleet.synthetic import (
    append_steps,
    node_name,
    register_rank,
    step_line,
    write_fleet,
)


def collector(run_dir, node: str) -> TrainingCollector:
    return TrainingCollector(Context(run_dir=run_dir, node=node, options={"save_every_seconds": 0.0}))


def exported(sample, family: str) -> dict[tuple, float]:
    return {tuple(sorted(s.labels.items())): s.value for f in sample.families for s in f.samples
            if s.name == family}


def test_unregistered_files_judged_by_their_first_record(tmp_path):
    write_fleet(tmp_path, nodes=3, ranks_per_node=2, steps=1, register=False)
    (tmp_path / "tls" / "rank-9.jsonl").write_text('{"timestamp": 1700000000, "step": 1, "rank": 9}\n')  # no node
    agent = collector(tmp_path, node_name(1))
    agent.update()
    assert sorted(agent.follower.positions) == ["rank-2.jsonl", "rank-3.jsonl", "rank-9.jsonl"]


def test_a_file_still_empty_is_decided_when_its_first_record_arrives(tmp_path):
    (tmp_path / "tls").mkdir()
    (tmp_path / "tls" / "rank-0.jsonl").write_bytes(b"")
    agent = collector(tmp_path, node_name(1))
    agent.update()
    with open(tmp_path / "tls" / "rank-0.jsonl", "ab") as handle:
        handle.write(step_line(1, 0, node_name(0)))
    sample = agent.update()
    assert exported(sample, "trainguard_training_steps_total") == {}
    assert "rank-0.jsonl" not in agent.follower.positions or agent.follower.positions["rank-0.jsonl"].offset == 0


def test_a_rank_that_moves_here_brings_only_its_new_records(tmp_path):
    """After an elastic restart rank 1 runs on this node: what it wrote on node 0 is not this node's."""
    write_fleet(tmp_path, nodes=1, ranks_per_node=2, steps=3)
    agent = collector(tmp_path, node_name(1))
    assert exported(agent.update(), "trainguard_training_steps_total") == {}
    write_rank_file(tmp_path, 1, host=node_name(1), pid=10_000_001)
    append_steps(tmp_path, range(1, 2), node_name(1), step=4)
    steps = exported(agent.update(), "trainguard_training_steps_total")
    assert steps == {(("rank", "1"), ("run_id", "fleet")): 1}


def test_a_node_name_other_than_the_host_still_owns_what_the_host_registered(tmp_path):
    """The trainer registers socket.gethostname(); the operator may call the node otherwise (--node)."""
    import socket
    (tmp_path / "tls").mkdir()
    write_rank_file(tmp_path, 0)
    (tmp_path / "tls" / "rank-0.jsonl").write_bytes(step_line(1, 0, socket.gethostname()))
    agent = collector(tmp_path, "gpu-node-01")
    assert exported(agent.update(), "trainguard_training_steps_total")


def test_a_rank_that_moves_away_and_back_is_not_counted_twice(tmp_path):
    """A rank registered elsewhere is left alone, and keeps its position: back here, reading resumes."""
    write_fleet(tmp_path, nodes=1, ranks_per_node=2, steps=3)
    agent = collector(tmp_path, node_name(0))
    agent.update()
    read_up_to = agent.follower.positions["rank-1.jsonl"].offset
    register_rank(tmp_path, 1, node_name(1))                  # rank 1 restarted on node 1
    append_steps(tmp_path, range(1, 2), node_name(1), step=4)
    agent.update()
    assert agent.follower.positions["rank-1.jsonl"].offset == read_up_to      # not read, not forgotten
    register_rank(tmp_path, 1, node_name(0))                  # and back here
    append_steps(tmp_path, range(1, 2), node_name(0), step=5)
    steps = exported(agent.update(), "trainguard_training_steps_total")
    assert steps[(("rank", "1"), ("run_id", "fleet"))] == 4   # 3 + its step 5 here (step 4 was node 1's)


def test_a_changed_registration_is_the_only_one_read_again(tmp_path, monkeypatch):
    """A restart storm on a thousand nodes must not read every registration at every change: a file whose
    inode is older than the last read (its ctime) is as it was; only the new or rewritten ones are read."""
    monkeypatch.setattr(rundir.RankFiles, "RACY_SECONDS", 0.05)    # the files here are all seconds old
    for rank in range(40):
        register_rank(tmp_path, rank, node_name(rank // 8))
    files = rundir.RankFiles(tmp_path, {node_name(0)})
    time.sleep(0.1)
    os.utime(rundir.ranks_dir(tmp_path))                       # a change, later than every file's
    assert [info.rank for info in files.read()] == list(range(8))
    reads = []
    real = rundir.read_registration
    monkeypatch.setattr(rundir, "read_registration", lambda path: reads.append(os.path.basename(path)) or real(path))
    register_rank(tmp_path, 33, node_name(0))                  # a rank of node 4 restarted here
    assert 33 in [info.rank for info in files.read()] and reads == ["rank-33.json"]
    assert not files.registered_elsewhere(33) and files.registered_elsewhere(32)
    time.sleep(0.1)
    path = rundir.rank_file(tmp_path, 33)                      # rewritten in place, same inode: its ctime moves
    path.write_text(path.read_text().replace(node_name(0), node_name(4)))
    assert 33 not in [info.rank for info in files.read()] and reads[1:] == ["rank-33.json"]
    assert files.registered_elsewhere(33)


def test_unreadable_registrations_are_reported_and_not_read_again(tmp_path, monkeypatch):
    register_rank(tmp_path, 0, node_name(0))
    rundir.rank_file(tmp_path, 1).write_text("{not json")
    rundir.rank_file(tmp_path, 5_000_000).write_text(rundir.rank_file(tmp_path, 0).read_text()
                                                     .replace(node_name(0), node_name(9)))
    files = rundir.RankFiles(tmp_path, {node_name(0)})
    assert [info.rank for info in files.read()] == [0]
    assert len(files.problems) == 2 and "rank-1.json: JSONDecodeError" in files.problems[0]
    assert "rank 5000000 is past" in files.problems[1] and not files.registered_elsewhere(5_000_000)
    reads = []
    real = rundir.read_registration
    monkeypatch.setattr(rundir, "read_registration", lambda path: reads.append(os.path.basename(path)) or real(path))
    register_rank(tmp_path, 2, node_name(0))
    assert [info.rank for info in files.read()] == [0, 2] and reads == ["rank-2.json"]
    assert len(files.problems) == 2          # still reported, from what was read of them
