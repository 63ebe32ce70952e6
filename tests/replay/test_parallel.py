"""A run directory replays on every CPU (trainguard.replay.parallel) to the very JSON of the merged stream.

The merged stream (one process, `TRAINGUARD_REPLAY_ONE_PROCESS=1`) is the reference: every document here
is `trainguard replay --json`'s, made both ways and compared as text. The run directories (run_dirs.py) are built to
hold what the merged order decides (parallel.py's docstring): rank logs beside node logs that say other GPU
counts at other times, lead steps that say no GPU count of their own (a CPU run), rotated and compressed
parts of the lead rank's log, malformed and step-less lines, files whose times go back, equal times
across files, recorded decisions (trainer events, the agents' alerts and actions, the control file), a
hang (the stall watchdog), and several runs' directories at once. Where only the merged stream can decide
(lead files that overlap in time, lead-rank steps in a node log), the run is handed over to it: same JSON.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.replay.run_dirs import LAYERS, T0, both_ways, build_run, document, rank_records, write_lines
from trainguard import event_types, tls
from trainguard.replay import columns, parallel, timeline

CASES = {
    "ranks and a node log": dict(),
    "rotated gz parts of the lead rank's log": dict(rotate=2),
    "rotated zst parts": dict(rotate=3, compress=".zst"),
    "lead steps without a GPU count of their own (a CPU run)": dict(own_gpus=False, nodes=2, rotate=1),
    "... with node records at the very times of steps": dict(own_gpus=False, nodes=2, faults=False),
    "a hang the stall watchdog sees": dict(hang=True, nodes=2),
    "a rank whose clock steps back a minute, in a CPU run": dict(own_gpus=False, clock_back=True, ranks=2,
                                                                  steps=500),
    "lead steps billed from the lead rank's own samples, in a CPU run": dict(own_gpus=False, samples=7, rotate=1),
    "many ranks, healthy": dict(ranks=8, nodes=2, faults=False, bad=0.0, gap=False),
    "every lead step says its GPUs (the other ranks' records only counted)": dict(gap=False, ranks=4, rotate=1),
    "malformed lines everywhere": dict(bad=0.2),
}


@pytest.mark.parametrize("case", CASES)
def test_a_run_directory_replays_on_every_cpu_to_the_same_json(tmp_path, monkeypatch, case):
    monkeypatch.setattr(columns, "CHUNK_BYTES", 16_000)      # many pieces per file, read by two workers
    monkeypatch.setattr(columns, "available_cpus", lambda: 2)
    run = build_run(tmp_path / "run", seed=len(case), **CASES[case])
    found = json.loads(both_ways([run], monkeypatch))
    assert found["steps"] and found["duplicate_steps"] and found["lead_rank"] == 0
    if CASES[case].get("faults", True):
        assert found["actions"] and found["recorded_actions"] and found["recorded_alerts"]
    if CASES[case].get("bad", 0.01):
        assert found["malformed"]
    if CASES[case].get("hang"):
        assert any(a["source"] == "stall" for a in found["actions"])


def test_several_runs_directories_at_once(tmp_path, monkeypatch):
    """Two runs one after the other: the second run's rank-0 log follows the first's in time."""
    first = build_run(tmp_path / "a", seed=1, rotate=1)
    second = build_run(tmp_path / "b", seed=2, start=T0 + 10_000, own_gpus=False)
    both_ways([first, second], monkeypatch)


def test_what_only_the_merged_stream_decides_is_handed_to_it(tmp_path, monkeypatch):
    """Two runs at the same time (their lead logs overlap), and a node log holding the lead rank's steps."""
    runs = [build_run(tmp_path / "a", seed=1), build_run(tmp_path / "b", seed=2, start=T0 + 30)]
    both_ways(runs, monkeypatch, side_by_side=False)
    joined = build_run(tmp_path / "joined", seed=3)
    node = joined / "tls" / "node-n0.jsonl"
    node.write_bytes(node.read_bytes() + tls.encode({"timestamp": T0 + 99, "rank": 0, "step": 5,
                                                    "metrics": {"loss": 1.0, "grad_norm": 1.0}}))
    both_ways([joined], monkeypatch, side_by_side=False)


def test_a_lead_rank_decision_in_another_file_is_recorded_in_its_place(tmp_path, monkeypatch):
    """A node log that carries one of rank 0's decision events (no step of it): read apart all the same,
    the event among the recorded decisions where the merged order puts it."""
    run = build_run(tmp_path / "run", seed=4, gap=False, ranks=2)
    node = run / "tls" / "node-n0.jsonl"
    node.write_bytes(node.read_bytes() + tls.encode({"timestamp": T0 + 20.0, "rank": 0, "step": 33,
                                                    "event": {"type": "rollback", "reason": "repeated_nan"}}))
    found = json.loads(both_ways([run], monkeypatch))
    assert {"action": "rollback", "step": 33} in [{k: a[k] for k in ("action", "step")} for a in found["recorded_actions"]]


@pytest.mark.parametrize("compress", [".gz", ".zst"])
def test_a_rotated_part_cut_short_keeps_what_was_read(tmp_path, monkeypatch, compress):
    """A compressed part copied while it was written: its lines before the cut (gzip: then one malformed line;
    a zstd frame cut short just ends, as tls.open_log reads it)."""
    run = build_run(tmp_path / "run", seed=8, rotate=1, compress=compress, gap=False)
    part = run / "tls" / f"rank-0.jsonl.1{compress}"
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])
    found = json.loads(both_ways([run], monkeypatch))
    assert found["steps"] and any(m["file"] == str(part) for m in found["malformed_lines"]) is (compress == ".gz")


def test_one_compressed_log_and_files_without_records(tmp_path, monkeypatch):
    log = tmp_path / "rank-0.jsonl.zst"
    rng = random.Random(5)
    write_lines(log, rank_records(0, 400, rng, world=2, own_gpus=True, start=T0, faults=True, hang_at=None),
                rng, bad=0.02)
    both_ways([log], monkeypatch)
    (tmp_path / "empty.jsonl").write_bytes(b"")
    (tmp_path / "junk.jsonl").write_bytes(b"{not json\n" * 3)
    both_ways([log, tmp_path / "empty.jsonl", tmp_path / "junk.jsonl"], monkeypatch)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), ranks=st.integers(1, 4), nodes=st.integers(0, 2), rotate=st.integers(0, 2),
       compress=st.sampled_from([".gz", ".zst"]), own_gpus=st.booleans(), faults=st.booleans(),
       bad=st.sampled_from([0.0, 0.02, 0.3]), hang=st.booleans(), chunk=st.sampled_from([2_000, 9_000, 1 << 20]),
       gap=st.booleans())
def test_any_run_directory_replays_to_the_same_json(tmp_path_factory, monkeypatch, seed, ranks, nodes, rotate,
                                                    compress, own_gpus, faults, bad, hang, chunk, gap):
    monkeypatch.setattr(columns, "CHUNK_BYTES", chunk)       # pieces in this process: the pool is columns'
    monkeypatch.setattr(columns, "available_cpus", lambda: 1)
    run = build_run(tmp_path_factory.mktemp("run"), seed, ranks=ranks, nodes=nodes, rotate=rotate,
                    compress=compress, own_gpus=own_gpus, faults=faults, bad=bad, hang=hang, steps=120, gap=gap)
    reference = document([run], one_process=True, monkeypatch=monkeypatch)
    assert document([run], one_process=False, monkeypatch=monkeypatch) == reference


def test_the_cli_takes_the_parallel_way_and_prints_the_same(tmp_path):
    run = build_run(tmp_path / "run", seed=9, rotate=1, nodes=2)
    command = [str(Path(sys.executable).with_name("trainguard")), "replay", str(run), "--json"]
    env = {k: v for k, v in os.environ.items() if k != parallel.ONE_PROCESS_ENV}
    found = subprocess.run(command, capture_output=True, env=env, timeout=120)
    reference = subprocess.run(command, capture_output=True, env={**env, parallel.ONE_PROCESS_ENV: "1"}, timeout=120)
    assert found.returncode == reference.returncode == 0, found.stderr
    assert found.stdout == reference.stdout and json.loads(found.stdout)["steps"]


def test_the_workers_hand_over_every_line_the_recorded_pass_reads():
    """The recorded pass (timeline.recorded_actions) reads the lines naming its marks from what the
    workers found (parallel.MARKS): it must name no mark they do not look for."""
    assert {timeline._RESTART_MARK, *timeline._AGENT_MARKS} <= set(parallel.MARKS)


def test_replica_checks_in_a_run_directory_replay_alike(tmp_path, monkeypatch):
    """The replica pass reads only the files the workers saw naming a check: the same verdicts (a rollback
    at the check whose replicas disagree, written in a rotated part, compressed)."""
    from trainguard.decide import replica

    assert timeline.replica.MARK in parallel.MARKS
    run = build_run(tmp_path / "run", seed=6, gap=False, ranks=2, rotate=1)
    good, bad = 0x1111, 0x2222
    log = run / "tls" / "rank-0.jsonl"
    for step, weights in ((10, (good, good, good)), (20, (good, bad, good))):
        check = replica.ReplicaCheck(step, T0 + step, weights, gradients=(7, 7, 7), recomputed=weights,
                                     nodes=("a", "b", "c"))
        log.write_bytes(log.read_bytes() + tls.encode(
            {"timestamp": T0 + 600 + step, "rank": 0, "step": step,
             "event": {"type": event_types.REPLICA_CHECK, "step": step, **replica.check_fields(check)}}))
    found = json.loads(both_ways([run], monkeypatch))
    assert ("rollback", 20, "replica_mismatch") in [(a["action"], a["step"], a["reason"]) for a in found["actions"]]


# ------------------------------------------------------------------------ the counting, against the Picker

def _record_line(draw, rank: int, step: int, when: float) -> bytes:
    """One record the way a rank or an agent writes it, with the unusual things a block may hold."""
    record: dict = {"timestamp": draw(st.sampled_from([when, tls.format_timestamp(when)]))}
    if draw(st.integers(0, 9)):
        record["rank"] = draw(st.sampled_from([rank] * 8 + [0, rank + 1, None]))
    if draw(st.integers(0, 9)):
        record["step"] = step
    shape = draw(st.sampled_from(["both"] * 6 + ["loss", "grad", "neither", "none"]))
    if shape != "none":
        record["metrics"] = {k: v for k, v in (("loss", 3.0), ("grad_norm", 0.8)) if shape in ("both", k[:4])}
    gpus = draw(st.sampled_from(["count"] * 4 + ["zero", "listed", "empty", "absent"]))
    if gpus != "absent":
        record["system"] = {"gpu_count": 8 if gpus == "count" else 0}
        record["hardware"] = {"gpus": [{"gpu": 0}] if gpus == "listed" else []}
    if not draw(st.integers(0, 19)):
        record["event"] = {"type": draw(st.sampled_from(["skip_step", "alert", "checkpoint_saved"]))}
    return tls.encode(record)


ODDITIES = {       # one record of a rank's block changed in one way
    "the lead rank": lambda r: r.update(rank=0), "another rank": lambda r: r.update(rank=r["rank"] + 1),
    "no rank": lambda r: r.pop("rank"), "no step": lambda r: r.pop("step"), "an event": lambda r: r.update(
        event={"type": "alert"}), "loss only": lambda r: r["metrics"].pop("grad_norm"),
    "grad_norm only": lambda r: r["metrics"].pop("loss"),
    "no metrics": lambda r: r.pop("metrics"), "Unix seconds": lambda r: r.update(timestamp=T0),
    "no GPU count": lambda r: r.pop("system"), "GPUs listed": lambda r: r.update(system={"gpu_count": 0},
                                                                                hardware={"gpus": [{}]}),
}


@st.composite
def blocks(draw):
    rank, start = draw(st.integers(0, 5)), T0 + draw(st.integers(0, 100))
    count = draw(st.integers(1, 40))
    # as a rank writes them (the passes in C count them), the same with one record of another kind (where
    # the passes must give the block up), or any records
    kind = draw(st.sampled_from(["usual", "one odd", "any"]))
    odd = draw(st.one_of(st.just(count - 1), st.integers(0, count - 1)))      # the last one: the block's last step
    oddity = draw(st.sampled_from(sorted(ODDITIES)))
    gpus = draw(st.sampled_from([8, 0]))          # a GPU run's records say the count, a CPU run's 0
    lines = []
    for i in range(count):
        when = start + i * 0.25 - (5.0 if draw(st.integers(0, 7)) == 0 else 0.0)    # a clock stepped back
        if kind == "any":
            lines.append(_record_line(draw, rank, i + 1, when))
            continue
        record = {"timestamp": tls.format_timestamp(when), "rank": rank, "step": i + 1,
                  "metrics": {"loss": 3.0, "grad_norm": 0.8}, "system": {"gpu_count": gpus}}
        if kind == "one odd" and i == odd:
            ODDITIES[oddity](record)
        lines.append(tls.encode(record))
    return b"".join(lines)


def _cpu_run_block(*extra: dict) -> bytes:
    """Records of a CPU run's rank 3 (gpu_count 0), then `extra` ones."""
    usual = [{"timestamp": T0 + i, "rank": 3, "step": i, "metrics": {"loss": 3.0, "grad_norm": 0.8},
              "system": {"gpu_count": 0}} for i in range(1, 4)]
    return b"".join(map(tls.encode, usual + list(extra)))


@settings(max_examples=300, deadline=None)
@example(data=_cpu_run_block({"timestamp": T0 + 5, "rank": 3, "step": 5, "metrics": {"loss": 3.0, "grad_norm": 0.8},
                              "hardware": {"gpus": [{"gpu": 0}]}}), with_gpus=True, before=0)    # one lists its GPUs
@given(data=blocks(), with_gpus=st.booleans(), before=st.integers(0, 50))
def test_a_block_of_other_ranks_is_counted_as_the_picker_counts_it(data, with_gpus, before):
    """parallel._summed (the passes in C, the loop for any other block) against picking.Picker.take over the
    same records: the counts, the times, the last step, the GPU places; or None (the Picker's to take)."""
    from trainguard.replay import source
    from trainguard.replay.picking import Picker

    summed = parallel._summed(source._typed.decode_lines(data), 0, with_gpus)
    records = source._typed.decode_lines(data)
    entries, _, last_step = source.entries_of(records, None, 1, 0, before)
    picker = Picker(0, track=True)
    picked = picker.take(entries)
    if summed is None:
        return
    assert (summed.records, summed.copies, summed.partial) == (picker.records, picker.duplicates, picker.partial)
    assert len(picked) == 0 and not picker.recorded
    assert (summed.first, summed.latest) == (picker.first, picker.last)
    assert (before if summed.last_step is None else summed.last_step) == last_step
    assert summed.flagged == source.names_marked(records)
    if with_gpus:
        assert [p + 1 for p in summed.gpu_positions] == picker.tracked.gpu_ordinals
        assert list(summed.gpu_counts) == picker.tracked.gpu_counts
        if len(summed.gpu_positions):
            assert summed.times.tolist() == [entry[0] for entry in entries]


@pytest.mark.parametrize("with_gpus", [False, True])
def test_a_piece_counted_without_the_picker_is_the_picked_piece(tmp_path, monkeypatch, with_gpus):
    """read_piece of another rank's log, its blocks counted (parallel._summed) against the same piece taken
    by the Picker throughout (the file named a lead file): the same Piece, GPU places and all."""
    monkeypatch.setattr(parallel, "DECODE_BYTES", 3_000)          # many blocks, usual and not
    rng = random.Random(3)
    path = tmp_path / "rank-2.jsonl"
    write_lines(path, rank_records(2, 300, rng, world=4, own_gpus=True, start=T0, faults=True, hang_at=None,
                                   clock_back=False), rng, bad=0.02)
    size = path.stat().st_size
    start = size // 3 + 1           # a piece from the middle of the file: numbered from UNKNOWN_STEP
    start = path.read_bytes().index(b"\n", start) + 1
    ways = []
    in_c = parallel._summed_in_c
    monkeypatch.setattr(parallel, "_summed_in_c", lambda *a: ways.append(found := in_c(*a)) or found)
    counted = parallel.read_piece(str(path), 1, start, size, 0, LAYERS, with_gpus)
    assert parallel._UNUSUAL in ways and len(ways) > ways.count(parallel._UNUSUAL) > 0      # both ways taken
    picked = parallel.read_piece(str(path), 1, start, size, 0, LAYERS, with_gpus, lead_files=(1,))
    for name in ("step_ordinals", "step_latest", "gpu_ordinals", "gpu_latest", "gpu_counts"):
        assert getattr(counted, name).tolist() == getattr(picked, name).tolist(), name
    assert (counted.records, counted.marked, counted.recorded_ordinals) == (picked.records, picked.marked, picked.recorded_ordinals)
    one, other = counted.chunk.picker, picked.chunk.picker
    assert (one.records, one.duplicates, one.partial, one.first, one.last) == \
        (other.records, other.duplicates, other.partial, other.first, other.last)
    assert counted.chunk.last_step == picked.chunk.last_step
    assert (len(counted.gpu_ordinals) > 100) if with_gpus else not len(counted.gpu_ordinals)


def test_the_usual_block_is_counted_in_c():
    """A rank's block as the trainer writes it takes the passes in C (not the loop): the path that counts 63
    of 64 ranks' records, with and without the GPU places."""
    from trainguard.replay import source

    data = b"".join(tls.encode({"timestamp": tls.format_timestamp(T0 + i), "rank": 3, "step": i,
                                "metrics": {"loss": 3.0, "grad_norm": 0.8}, "system": {"gpu_count": 8}})
                    for i in range(1, 50))
    for with_gpus in (False, True):
        summed = parallel._summed_in_c(source._typed.decode_lines(data), 0, with_gpus)
        assert summed is not parallel._UNUSUAL and summed.copies == 49 and summed.last_step == 49
        assert len(summed.gpu_positions) == (49 if with_gpus else 0)


def test_a_node_record_read_leniently_keeps_its_gpus(tmp_path):
    """hardware.gpus is left undecoded (msgspec.Raw) when bytes are typed; a line only the lenient reader
    takes (a step written as a string) keeps its GPUs as the dicts they are, and is a record, not malformed,
    on every path (--rules reads every line that way)."""
    log = tmp_path / "node-a.jsonl"
    log.write_bytes(b'{"timestamp": 1710512538.0, "node": "a", "step": "5", "hardware": {"gpus": [{"gpu": 0}, {"gpu": 1}]}}\n')
    found = timeline.replay_logs([log]).to_json()
    assert (found["records"], found["malformed"]) == (1, 0)
