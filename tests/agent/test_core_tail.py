"""The follower: partial lines, rotation, truncation, new files, overlong lines, restarts from saved state."""

from __future__ import annotations

import os

from trainguard.agent.tail import Follower, load_json, save_json_atomic


def lines(follower: Follower) -> list[tuple[str, int, bytes]]:
    return [(os.path.basename(c.source), c.lineno, c.data) for c in follower.poll()]


def append(path, data: bytes) -> None:
    with open(path, "ab") as handle:
        handle.write(data)


def test_partial_last_line_waits_for_its_newline(tmp_path):
    log = tmp_path / "rank-0.jsonl"
    append(log, b'{"a":1}\n{"b":')
    follower = Follower(tmp_path, "rank-*.jsonl")
    assert lines(follower) == [("rank-0.jsonl", 1, b'{"a":1}')]
    assert lines(follower) == []
    append(log, b'2}\n\n{"c":3}\n')
    assert lines(follower) == [("rank-0.jsonl", 2, b'{"b":2}'), ("rank-0.jsonl", 4, b'{"c":3}')]


def test_new_files_are_picked_up_and_others_ignored(tmp_path):
    follower = Follower(tmp_path, "rank-*.jsonl")
    assert lines(follower) == []
    append(tmp_path / "rank-1.jsonl", b"x\n")
    append(tmp_path / "node-a.jsonl", b"not mine\n")
    assert lines(follower) == [("rank-1.jsonl", 1, b"x")]


def test_rotation_reads_the_rest_of_the_old_file_first(tmp_path):
    log = tmp_path / "rank-0.jsonl"
    append(log, b"1\n2\n")
    follower = Follower(tmp_path, "rank-*.jsonl")
    assert [d for _, _, d in lines(follower)] == [b"1", b"2"]
    append(log, b"3\n")                       # written after our last read, before the rename
    os.rename(log, tmp_path / "rank-0.jsonl.1")
    append(log, b"4\n")
    assert lines(follower) == [("rank-0.jsonl.1", 3, b"3"), ("rank-0.jsonl", 1, b"4")]
    assert follower.events == [f"rotated {log}"]


def test_renamed_away_without_successor_is_drained_then_forgotten(tmp_path):
    log = tmp_path / "rank-0.jsonl"
    append(log, b"1\n")
    follower = Follower(tmp_path, "rank-*.jsonl")
    lines(follower)
    append(log, b"2\n")
    os.rename(log, tmp_path / "old-rank-0")
    assert lines(follower) == [("old-rank-0", 2, b"2")]
    assert follower.positions == {}


def test_truncation_restarts_from_the_top(tmp_path):
    log = tmp_path / "rank-0.jsonl"
    append(log, b"1\n2\n3\n")
    follower = Follower(tmp_path, "rank-*.jsonl")
    lines(follower)
    with open(log, "wb") as handle:          # copytruncate-style: same inode, shorter
        handle.write(b"9\n")
    assert lines(follower) == [("rank-0.jsonl", 1, b"9")]
    assert follower.events[-1].startswith("truncated")


def test_rewritten_file_longer_than_before_is_read_from_the_top(tmp_path):
    log = tmp_path / "rank-0.jsonl"
    append(log, b"old\n")
    follower = Follower(tmp_path, "rank-*.jsonl")
    lines(follower)
    with open(log, "r+b") as handle:         # same inode, different first bytes, longer than our offset
        handle.write(b"new-first-line\nsecond\n")
    assert [d for _, _, d in lines(follower)] == [b"new-first-line", b"second"]


def test_overlong_line_is_reported_once_and_skipped(tmp_path):
    log = tmp_path / "rank-0.jsonl"
    append(log, b"a\n" + b"x" * 100)
    follower = Follower(tmp_path, "rank-*.jsonl", max_read_bytes=64, max_line_bytes=32)
    first = list(follower.poll())
    assert [(c.lineno, c.overlong) for c in first] == [(1, False)]
    chunks = []
    for _ in range(5):
        chunks += list(follower.poll())
    append(log, b"x" * 10 + b"\nb\n")
    for _ in range(5):
        chunks += list(follower.poll())
    assert [(c.lineno, c.overlong, len(c.data)) for c in chunks] == [(2, True, 32), (3, False, 1)]


def test_restart_from_saved_state_loses_and_repeats_nothing(tmp_path):
    log = tmp_path / "tls" / "rank-0.jsonl"
    log.parent.mkdir()
    state_file = tmp_path / "offsets.json"
    written = [f"{i}".encode() for i in range(1, 101)]
    seen: list[bytes] = []
    follower = Follower(log.parent, "rank-*.jsonl")
    for index, line in enumerate(written):
        append(log, line + b"\n")
        if index % 7 == 3:  # the agent reads now and then, saves, and is restarted from the saved state
            seen += [c.data for c in follower.poll()]
            save_json_atomic(state_file, {"files": follower.state()})
            follower = Follower(log.parent, "rank-*.jsonl")
            follower.restore(load_json(state_file)["files"])
        if index == 50:     # rotated while the agent is down
            os.rename(log, log.with_name("rank-0.jsonl.1"))
    seen += [c.data for c in follower.poll()]
    assert seen == written


def test_state_saved_before_a_kill_replays_the_unsaved_lines_exactly_once(tmp_path):
    log = tmp_path / "rank-0.jsonl"
    append(log, b"1\n2\n")
    follower = Follower(tmp_path, "rank-*.jsonl")
    lines(follower)
    saved = follower.state()
    append(log, b"3\n")
    lines(follower)                            # read, but killed before the state was saved
    restarted = Follower(tmp_path, "rank-*.jsonl")
    restarted.restore(saved)
    assert lines(restarted) == [("rank-0.jsonl", 3, b"3")]


def test_save_json_atomic_leaves_no_temporary_file(tmp_path):
    target = tmp_path / "agent" / "offsets.json"
    save_json_atomic(target, {"a": 1})
    save_json_atomic(target, {"a": 2})
    assert load_json(target) == {"a": 2}
    assert [p.name for p in target.parent.iterdir()] == ["offsets.json"]
    assert load_json(tmp_path / "missing.json") is None
