"""On a shared run directory an agent follows only its own node's rank files (issue 21).

The ownership comes from RUN/control/ranks/ (the host each rank registered) and, for a file nobody
registered, from its first record's `node`; records written by another node are skipped. The cost of
an update not growing with the number of nodes is measured by bench/bench_fleet.py, not asserted here.
"""

from __future__ import annotations

import gc
import json
import tracemalloc

import pytest
from trainguard import rundir
from trainguard.agent import restore
from trainguard.agent.collector import Context
from trainguard.agent.collectors.training import TrainingCollector
from trainguard.trainer.control import write_rank_file

from tests.fleet.synthetic import (
    append_steps,
    fast_dir,
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


@pytest.mark.slow
def test_thousand_nodes_agent_reads_only_its_eight_ranks(tmp_path):
    with fast_dir(tmp_path) as run_dir:
        thousand_nodes(run_dir)


def thousand_nodes(tmp_path):
    write_fleet(tmp_path, nodes=1000, ranks_per_node=8, steps=2)
    mine = range(42 * 8, 43 * 8)
    agent = collector(tmp_path, node_name(42))
    sample = agent.update()
    assert sorted(agent.follower.positions) == sorted(f"rank-{r}.jsonl" for r in mine)
    steps = exported(sample, "trainguard_training_steps_total")
    assert sorted(int(dict(k)["rank"]) for k in steps) == list(mine) and set(steps.values()) == {2}
    assert sorted(dict(k)["file"] for k in exported(sample, "trainguard_tls_records_total")) == \
        sorted(f"rank-{r}.jsonl" for r in mine)
    # Appends by every node: this agent reads only its own node's new lines.
    append_steps(tmp_path, range(8000), "elsewhere", step=3)
    append_steps(tmp_path, mine, node_name(42), step=4)
    steps = exported(agent.update(), "trainguard_training_steps_total")
    assert set(steps.values()) == {3}    # its own step 4 (the lines for step 3 name another node)
    saved = json.loads((tmp_path / "agent" / f"offsets-{node_name(42)}.json").read_text())
    assert sorted(saved["files"]) == sorted(f"rank-{r}.jsonl" for r in mine)


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


def held_by_rank_files(run_dir, nodes: int) -> int:
    """Bytes a RankFiles of node 0 holds after reading `nodes` x 8 registrations (written here if missing)."""
    for rank in range(nodes * 8):
        if not rundir.rank_file(run_dir, rank).exists():
            register_rank(run_dir, rank, node_name(rank // 8))
    gc.collect()
    # Only what the code that reads registrations allocated: the whole process's traced memory also
    # counts the threads an earlier test of this worker left winding down (seen under pytest -n 2).
    mine = [tracemalloc.Filter(True, restore.__file__), tracemalloc.Filter(True, rundir.__file__)]
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot().filter_traces(mine)
        files = restore.RankFiles(run_dir, {node_name(0)})
        assert [info.rank for info in files.read()] == list(range(8))
        gc.collect()
        after = tracemalloc.take_snapshot().filter_traces(mine)
        held = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    finally:
        tracemalloc.stop()
    assert files.registered_elsewhere(nodes * 8 - 1) and not files.problems
    return held


def test_an_agent_holds_and_reads_only_its_own_registrations_at_a_thousand_nodes(tmp_path, monkeypatch):
    """Issue 21: memory stays flat as the cluster grows, and a restart storm does not read every file at
    every change. Another node's registration costs its packed fingerprint and rank (24 bytes), not the
    ~1 KiB of a RankInfo with its path and strings; a replaced file is the only one read again."""
    with fast_dir(tmp_path) as run_dir:
        small = held_by_rank_files(run_dir, nodes=10)
        large = held_by_rank_files(run_dir, nodes=1000)
        per_other_rank = (large - small) / (990 * 8)
        assert per_other_rank <= 32, f"{per_other_rank:.0f} bytes per other node's rank"
        files = restore.RankFiles(run_dir, {node_name(0)})
        files.read()
        reads = []
        real = rundir.read_rank_file
        monkeypatch.setattr(rundir, "read_rank_file", lambda path: reads.append(path.name) or real(path))
        register_rank(run_dir, 4321, node_name(0))          # a rank of node 540 restarted here
        assert 4321 in [info.rank for info in files.read()] and reads == ["rank-4321.json"]
        assert not files.registered_elsewhere(4321)
        print(f"RankFiles holds {per_other_rank:.1f} bytes per other node's rank")
