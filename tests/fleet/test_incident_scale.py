"""A thousand nodes' evidence in one incident (trainguard/incidents/__init__.py): every node's kept, each write's
cost the same for the first node as for the last, one writer's flood cut at its own share, and the disk's
reserve still refusing a flood (docs/incidents.md, "The evidence budget")."""

from __future__ import annotations

import os
from collections import Counter

import pytest

from tests.fleet.synthetic import fast_dir, node_name
from trainguard import incidents

INCIDENT = "20261202T020000Z-hang-1000"
NODES, RANKS = 1000, 8
STACK_BYTES = 8 * 1024        # 1,000 nodes x 8 ranks x (stack + dump) > 64 MiB, the old whole-incident bound
DUMP_BYTES = 2 * 1024


def count_filesystem_calls(monkeypatch) -> Counter:
    """Every stat-like and listing call of the process, counted by name (the real calls still run)."""
    calls: Counter = Counter()
    for name in ("stat", "lstat", "statvfs", "scandir", "listdir"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda *a, _real=real, _name=name, **k: calls.update([_name]) or _real(*a, **k))
    return calls


def write_counted(calls: Counter, seen: list, *args, **kwargs) -> None:
    before = Counter(calls)
    incidents.write_file(*args, **kwargs)
    seen.append(tuple(sorted((calls - before).items())))


def write_node(run, index: int, calls: Counter, seen: list) -> int:
    """Node `index`'s evidence as its agent and its ranks write it, each its own writer; the bytes written."""
    host, agent, written = node_name(index), incidents.Budget(), 0
    for rank in range(index * RANKS, (index + 1) * RANKS):
        stack, dump = b"s" * STACK_BYTES, b"f" * DUMP_BYTES
        write_counted(calls, seen, run, INCIDENT, f"rank-{rank}.stack.txt", stack, budget=agent)
        write_counted(calls, seen, run, INCIDENT, f"rank-{rank}.fr.json", dump, budget=incidents.Budget())
        written += len(stack) + len(dump)
    signals = b'{"node": "%s"}\n' % host.encode()
    write_counted(calls, seen, run, INCIDENT, f"node-{host}.json", signals, budget=agent)
    return written + len(signals)


@pytest.mark.slow       # 17,000 atomic writes: ~5 s alone, ~11 s at load 7 (in tmpfs)
def test_a_thousand_nodes_evidence_is_all_kept_and_a_write_costs_the_same_for_the_last_node(tmp_path, monkeypatch):
    with fast_dir(tmp_path) as run:
        calls, seen = count_filesystem_calls(monkeypatch), []
        written = sum(write_node(run, index, calls, seen) for index in range(NODES))
        monkeypatch.undo()
        # One shape of calls for all 17,000 writes: the first node's and the thousandth's cost the same,
        # and no write lists the folder (the old one stat-ed every file in it: O(nodes^2) per incident).
        # (The first write makes the folder, so its mkdir needs no stat to see it is there.)
        assert seen[0] == (("statvfs", 1),)
        assert set(seen[1:]) == {(("stat", 1), ("statvfs", 1))}
        assert written > 64 * 2**20
        with os.scandir(incidents.incidents_dir(run) / INCIDENT) as listing:
            sizes = {entry.name: entry.stat().st_size for entry in listing}
    assert len(sizes) == NODES * (2 * RANKS + 1)
    assert sum(sizes.values()) == written                   # nothing refused, nothing cut, no temporary left
    assert sizes[f"rank-{NODES * RANKS - 1}.stack.txt"] == STACK_BYTES
    assert sizes[f"node-{node_name(NODES - 1)}.json"] == len(b'{"node": "%s"}\n' % node_name(NODES - 1).encode())


def test_a_writers_flood_is_cut_at_its_own_share_and_the_next_node_still_writes(tmp_path):
    cut = incidents.MAX_FILE_BYTES + len(incidents.TRUNCATED % incidents.MAX_FILE_BYTES)
    kept = incidents.MAX_WRITER_BYTES // cut           # 15 stacks at the cut fit in 64 MiB, the 16th does not
    with fast_dir(tmp_path) as run:
        flooding = incidents.Budget()
        for rank in range(kept):
            incidents.write_file(run, INCIDENT, f"rank-{rank}.stack.txt", b"x" * (2 * cut), budget=flooding)
        with pytest.raises(incidents.IncidentError, match="past this writer's 67108864 bytes refused"):
            incidents.write_file(run, INCIDENT, f"rank-{kept}.stack.txt", b"x" * cut, budget=flooding)
        assert flooding.used(incidents.incidents_dir(run) / INCIDENT) == kept * cut      # the refused one not charged
        # written again under the same name, a file is charged once: its new size
        incidents.write_file(run, INCIDENT, "rank-0.stack.txt", b"short\n", budget=flooding)
        assert flooding.used(incidents.incidents_dir(run) / INCIDENT) == (kept - 1) * cut + incidents.BLOCK_BYTES
        # another node, after the flood: its evidence is whole (no shared bound to find used up)
        incidents.write_file(run, INCIDENT, "node-late.json", b"{}\n" * 1000, budget=incidents.Budget())
        directory = incidents.incidents_dir(run) / INCIDENT
        assert (directory / "node-late.json").stat().st_size == 3000
        assert not (directory / f"rank-{kept}.stack.txt").exists()
        assert sorted(p.name for p in directory.iterdir() if p.name.startswith(".")) == []


def test_the_disk_reserve_refuses_a_flood_of_writers_each_within_its_share(tmp_path, monkeypatch):
    """The real filesystem's free space (statvfs), with the reserve set 8 MiB under what is free now:
    writers each far inside their own share are refused once the reserve would be crossed."""
    with fast_dir(tmp_path) as run:
        directory = incidents.incidents_dir(run) / INCIDENT
        directory.mkdir(parents=True)
        st = os.statvfs(directory)
        monkeypatch.setattr(incidents, "MIN_FREE_FRACTION", 0.0)
        monkeypatch.setattr(incidents, "MIN_FREE_BYTES", st.f_bavail * st.f_frsize - 8 * 2**20)
        written, refused = [], None
        for rank in range(64):
            writer = incidents.Budget()
            try:
                incidents.write_file(run, INCIDENT, f"rank-{rank}.stack.txt", b"x" * 2**20, budget=writer)
            except incidents.IncidentError as exc:
                refused = (rank, str(exc), writer.used(directory))
                break
            written.append(rank)
        assert refused is not None, "64 MiB written past a reserve 8 MiB under the free space"
        rank, message, charged = refused
        assert 1 <= len(written) <= 16 and rank == len(written)
        assert "bytes free on its filesystem, and evidence leaves at least" in message and "rank-" in message
        assert charged == 0                                   # the refused write is not charged to its writer
        assert not (directory / f"rank-{rank}.stack.txt").exists()
        assert [p.name for p in directory.iterdir() if p.name.startswith(".")] == []
