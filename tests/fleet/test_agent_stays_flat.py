"""Nothing an agent keeps or reads per update grows with the cluster.

On a shared run directory of N nodes x 8 ranks, the training collector of one node holds the same memory
at 1,000 nodes as at 1 (tracemalloc of what its follower, node-file selection and registrations allocated
and still hold), and an update opens and stats only its own node's files. Without timing: the CPU and RSS
side is measured by bench/bench_fleet.py --updates.
"""

from __future__ import annotations

import builtins
import gc
import json
import os
import pathlib
import re
import time
import tracemalloc
from pathlib import Path

import pytest
from trainguard import rundir
from trainguard.agent import node_files, tail
from trainguard.agent.collector import Context
from trainguard.agent.collectors import training
from trainguard.agent.collectors.training import TrainingCollector

from tests.fleet.synthetic import append_steps, fast_dir, node_name, register_rank, step_line, write_fleet

FLAT_BYTES = 64 << 10          # held at 1,000 nodes less held at 1 node
OURS = range(8)                # node-0000's ranks
MODULES = (tail.__file__, node_files.__file__, rundir.__file__, training.__file__, pathlib.__file__,
           json.decoder.__file__)
OTHER_RANK_FILE = re.compile(r"rank-(\d+)\.json")


def collector(run_dir: Path) -> TrainingCollector:
    return TrainingCollector(Context(run_dir=run_dir, node=node_name(0), options={"save_every_seconds": 0.0}))


def held_after_updates(run_dir: Path, updates: int = 3) -> tuple[int, TrainingCollector]:
    """Bytes still held, after catching up and `updates` updates of node 0's ranks (a few other nodes
    writing too), that the collector's reading code allocated, or json and pathlib for it (a Path interns
    its names). One frame a trace: a deeper stack costs the catch-up 5x more time."""
    mine = [tracemalloc.Filter(True, module) for module in MODULES]
    gc.collect()
    tracemalloc.start(1)
    try:
        before = tracemalloc.take_snapshot().filter_traces(mine)
        agent = collector(run_dir)
        agent.update()
        for step in range(updates):
            append_steps(run_dir, range(8, 8 * 4), "elsewhere", step=100 + step)   # a few other nodes too
            append_steps(run_dir, OURS, node_name(0), step=100 + step)
            agent.update()
        gc.collect()
        after = tracemalloc.take_snapshot().filter_traces(mine)
    finally:
        tracemalloc.stop()
    return sum(stat.size_diff for stat in after.compare_to(before, "filename")), agent


def steps_of(agent: TrainingCollector) -> dict[int, float]:
    return {int(s.labels["rank"]): s.value for f in agent.update().families for s in f.samples
            if s.name == "trainguard_training_steps_total"}


@pytest.mark.slow
def test_an_agent_reads_only_its_node_and_holds_the_same_memory_at_a_thousand_nodes_as_at_one(tmp_path):
    with fast_dir(tmp_path) as base:
        for name, nodes in (("warm-up", 1), ("run-1", 1), ("run-1000", 1000)):
            write_fleet(base / name, nodes=nodes, ranks_per_node=8, steps=2)
        held_after_updates(base / "warm-up", updates=1)    # the first collector of the process fills caches
        one, _ = held_after_updates(base / "run-1")
        thousand, agent = held_after_updates(base / "run-1000")
        assert sorted(agent.follower.positions) == sorted(f"rank-{r}.jsonl" for r in OURS)
        assert steps_of(agent) == dict.fromkeys(OURS, 5)    # 2 + its 3 (the lines of step 100.. elsewhere: not)
        saved = json.loads(rundir.offsets_path(base / "run-1000", node_name(0)).read_text())
        assert sorted(saved["files"]) == sorted(f"rank-{r}.jsonl" for r in OURS)
    grown = thousand - one
    print(f"held at 1 node {one} B, at 1,000 nodes {thousand} B: {grown:+d} B")
    assert grown < FLAT_BYTES, f"{grown} bytes more at 1,000 nodes than at 1"


class FileAccess:
    """Every path opened, stat-ed or listed through os and builtins while active (no strace)."""

    def __init__(self, monkeypatch):
        self.opened: list[str] = []
        self.stated: list[str] = []
        self.listed: list[str] = []
        for module, name, seen in ((os, "open", self.opened), (builtins, "open", self.opened),
                                   (os, "stat", self.stated), (os, "scandir", self.listed)):
            monkeypatch.setattr(module, name, self._recording(getattr(module, name), seen))

    @staticmethod
    def _recording(real, seen: list):
        def call(path, *args, **kwargs):
            seen.append(os.fspath(path) if isinstance(path, (str, os.PathLike)) else str(path))
            return real(path, *args, **kwargs)
        return call

    def clear(self) -> None:
        self.opened.clear(), self.stated.clear(), self.listed.clear()

    def other_nodes_files(self) -> list[str]:
        """The rank logs and registrations of ranks not on node 0 that were touched."""
        return [path for path in self.opened + self.stated
                if (m := OTHER_RANK_FILE.fullmatch(os.path.basename(path)) or
                    re.fullmatch(r"rank-(\d+)\.jsonl", os.path.basename(path))) and int(m.group(1)) not in OURS]


def test_an_update_opens_and_stats_only_this_nodes_files(tmp_path, monkeypatch):
    """Steady state on 50 nodes: no listing, and nothing of another node touched; of a change of the
    registrations, only the new or rewritten files are read; a new rank file elsewhere is not opened."""
    for racy in (tail.Follower, rundir.RankFiles):
        monkeypatch.setattr(racy, "RACY_SECONDS", 0.2)      # instead of waiting 2 s for each change to settle
    with fast_dir(tmp_path) as run_dir:
        write_fleet(run_dir, nodes=50, ranks_per_node=8, steps=2)
        settled(run_dir)
        agent = collector(run_dir)
        agent.update()
        time.sleep(0.3)
        agent.update()                              # listed again (racy just now), then settled
        access = FileAccess(monkeypatch)
        append_steps(run_dir, OURS, node_name(0), step=3)
        access.clear()                              # (the appends above are the test's own)
        agent.update()
        assert access.listed == [] and access.other_nodes_files() == []
        assert sorted(os.path.basename(p) for p in access.opened if p.endswith(".jsonl")) == \
            [f"rank-{r}.jsonl" for r in OURS]
        append_steps(run_dir, range(8, 400), "elsewhere", step=3)     # every other node writes
        access.clear()
        agent.update()
        assert access.listed == [] and access.other_nodes_files() == []
        register_rank(run_dir, 123, node_name(15))                    # a rank of node 15 restarted
        register_rank(run_dir, 400, node_name(50))                    # a node joins
        (rundir.tls_dir(run_dir) / "rank-400.jsonl").write_bytes(step_line(1, 400, node_name(50)))
        access.clear()
        agent.update()
        assert sorted(access.other_nodes_files()) == [str(rundir.rank_file(run_dir, r)) for r in (123, 400)]
        assert sorted(agent.follower.positions) == [f"rank-{r}.jsonl" for r in OURS]


def settled(run_dir: Path) -> None:
    """The directories changed last now, after every file in them (their racy window then passes)."""
    time.sleep(0.3)
    os.utime(rundir.tls_dir(run_dir))
    os.utime(rundir.ranks_dir(run_dir))


def test_a_listing_that_did_not_change_opens_no_unregistered_file_again(tmp_path, monkeypatch):
    """Files nobody registered are judged by their first record; the listing's fingerprint (not its
    names) tells that the same files are there, so a directory change of other files opens none again."""
    write_fleet(tmp_path, nodes=20, ranks_per_node=8, steps=1, register=False)
    agent = collector(tmp_path)
    agent.update()
    assert sorted(agent.follower.positions) == sorted(f"rank-{r}.jsonl" for r in OURS)
    access = FileAccess(monkeypatch)
    (rundir.tls_dir(tmp_path) / "node-0007.jsonl").write_bytes(b"")    # another node's node log appears
    agent.update()
    assert access.listed and access.other_nodes_files() == []
    (rundir.tls_dir(tmp_path) / "rank-160.jsonl").write_bytes(b"")     # a new rank file: judged again
    access.clear()
    agent.update()
    assert "rank-160.jsonl" in {os.path.basename(p) for p in access.opened}
    assert "rank-160.jsonl" not in agent.follower.positions           # no first record yet: not ours yet
