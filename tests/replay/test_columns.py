"""The columnar fast path (trainguard.replay.columns) replays a log exactly as the entry-by-entry path.

One plain file goes the columnar way: chunks decoded and picked in worker processes, decided as arrays.
Everything `trainguard replay` reports must be what the general path (merged stream, picked here,
decided as lists) reports for the same file: actions with their detail, the live run's recorded
decisions, counts, first and last times, cost, malformed lines with their line numbers, lead rank.
The chunks are made tiny here so that a small log is cut in many places: mid-run, between a step-less
record and the step it follows, before the first GPU count, around malformed lines.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import signal

import pytest

from trainguard import tls
from trainguard.policy import CostPolicy, CostTiers, Policy
from trainguard.replay import columns, engine, source
from trainguard.replay.picking import Picker

T0 = 1_710_512_538.0
LAYERS = ("embed", "h.0", "h.1", "ln_f")


def trainer_records(count: int, *, seed: int = 3, faults: bool = True):
    """A trainer's log (layer norms, monotonic clock, GPU count) with spikes, NaN, explosions, a rollback
    and a restart, other ranks' copies, hardware samples and recorded decisions."""
    rng = random.Random(seed)
    step, when, clock = 0, T0, 5000.0
    for i in range(count):
        step += 1
        when += 0.5
        clock += 0.5
        if faults and i == count // 2:
            step -= 40                       # rollback: the steps go back
        if faults and i == count // 3:
            clock = 10.0                     # a restart: a new monotonic clock
        loss = 3.0 + rng.gauss(0, 0.02)
        grad = 0.8 + rng.random() * 0.1
        norms = {name: 0.1 + rng.random() * 0.05 for name in LAYERS}
        if faults and rng.random() < 0.01:
            loss = rng.choice([math.nan, 90.0])
        if faults and rng.random() < 0.005:
            grad = 400.0
        if faults and rng.random() < 0.005:
            norms["h.1"] = 300.0
        record = {"timestamp": when, "step": step, "rank": 0, "node": "node-a",
                  "metrics": {"loss": loss, "grad_norm": grad, "grad_norm_by_layer": norms, "mfu": 0.4},
                  "system": {"monotonic_seconds": clock, **({"gpu_count": 8} if i > 20 else {})}}
        yield record
        if faults and i % 97 == 5:
            yield {**record, "rank": 1}                                         # another rank's copy
        if faults and i % 151 == 7:
            yield {"timestamp": when, "node": "node-a", "hardware": {"gpus": [{"index": 0}, {"index": 1}]}}
        if faults and i % 211 == 9:
            yield {"timestamp": when, "rank": 0, "step": step,
                   "event": {"type": "skip_step", "reason": "loss_spike"}}


def write(path, records, *, bad_every: int = 0, truncate: bool = False):
    """Records as trainguard's writer encodes them; after every `bad_every`-th a malformed line; optionally
    a last line cut short, as a log copied while it was written."""
    lines = []
    for i, record in enumerate(records):
        lines.append(tls.encode(record))
        if bad_every and i % bad_every == bad_every - 1:
            lines.append(b'{"timestamp": "yesterday", "step": 1}\n' if i % 2 else b"{not json\n")
    if truncate:
        lines.append(b'{"timestamp": 1710512538.0, "step": 99999, "metrics": {"loss": 2')
    path.write_bytes(b"".join(lines))
    return path


def outcome_of(path, policy: Policy, *, columnar: bool, chunk_bytes: int = 0, workers: int = 1):
    stream = source.Stream([path])
    if columnar:
        assert columns.fits(stream)
        totals = Picker()
        decider = engine._Decider(engine.Guard(policy.guard), engine.CostMeter(policy.cost), [])
        for chunk in columns.read(stream, totals, chunk_bytes=chunk_bytes or None, workers=workers):
            decider.decide(chunk)
        picker, meter, actions = totals, decider.meter, decider.found
    else:   # the baseline: merged entries, each decided as it comes (a do-nothing observer), as lists
        decider = engine._Decider(engine.Guard(policy.guard), engine.CostMeter(policy.cost), [])
        picker, meter, actions = engine._replay_entries(stream, decider, lambda entry: None), decider.meter, decider.found
    return {
        "actions": [(a.action, a.step, a.timestamp, a.reason, a.source, engine.finite_or_text(a.detail)) for a in actions],
        "recorded": list(picker.recorded),
        "counts": (picker.records, picker.steps, picker.duplicates, picker.partial, picker.first, picker.last),
        "cost": dataclasses.asdict(meter.state),
        "problems": (stream.problems.count, [str(m) for m in stream.problems.kept]),
        "lead": stream.lead_rank,
        "guard": decider.guard.state_dict(),
    }


POLICY = Policy(cost=CostPolicy(budget_per_1k_steps=1.2, tiers=CostTiers(warn=0.3, throttle=0.6, stop=1.0)))


@pytest.mark.parametrize("chunk_bytes, workers", [(0, 1), (3000, 1), (20_000, 2)])
def test_a_trainer_log_with_faults_replays_exactly_as_the_entry_path(tmp_path, chunk_bytes, workers):
    log = write(tmp_path / "rank-0.jsonl", trainer_records(1500), bad_every=173, truncate=True)
    general = outcome_of(log, POLICY, columnar=False)
    assert general["actions"] and general["recorded"] and general["problems"][0] >= 9
    assert {a[3] for a in general["actions"]} >= {"nan", "loss_spike", "grad_explosion", "cost_overrun_warn"}
    assert outcome_of(log, POLICY, columnar=True, chunk_bytes=chunk_bytes, workers=workers) == general


def test_step_less_records_are_numbered_across_chunks(tmp_path):
    """The seed example form: training records without `step` follow the file's last step, even when the
    record holding that step is in the chunk before."""
    records = []
    for i, record in enumerate(trainer_records(600, faults=False)):
        if i % 50 >= 10:                     # ten records with their step, then forty without
            record = {key: value for key, value in record.items() if key != "step"}
        records.append(record)
    log = write(tmp_path / "seed.jsonl", records)
    general = outcome_of(log, Policy(), columnar=False)
    assert general["counts"][1] == 600
    for chunk_bytes in (2000, 7000):
        assert outcome_of(log, Policy(), columnar=True, chunk_bytes=chunk_bytes) == general


def test_the_gpu_count_carries_into_the_next_chunk(tmp_path):
    records = list(trainer_records(400, faults=False))
    for record in records[50:]:
        record["system"].pop("gpu_count", None)     # said once, early: every later chunk bills 8 GPUs
    log = write(tmp_path / "gpus.jsonl", records)
    general = outcome_of(log, POLICY, columnar=False)
    assert general["cost"]["gpu_count"] == 8 and general["actions"]
    assert outcome_of(log, POLICY, columnar=True, chunk_bytes=2500) == general


def test_layer_groups_that_change_are_decided_step_by_step(tmp_path):
    records = list(trainer_records(500, faults=False))
    for record in records[200:260]:
        record["metrics"]["grad_norm_by_layer"]["extra"] = 5.0
    records[300]["metrics"]["grad_norm_by_layer"]["h.0"] = None     # a null norm
    log = write(tmp_path / "ragged.jsonl", records)
    general = outcome_of(log, Policy(), columnar=False)
    assert outcome_of(log, Policy(), columnar=True, chunk_bytes=4000) == general


def test_layer_groups_listed_in_another_order_decide_the_same(tmp_path):
    """The worker decodes layer norms into a struct made for the file's first groups, which keeps no key
    order: a record listing them otherwise, with two layers exploding at once, must still replay as the
    general path does (the guard names the layer furthest over its threshold, whatever the order)."""
    records = list(trainer_records(400, faults=False))
    for record in records[200:]:
        record["metrics"]["grad_norm_by_layer"] = dict(reversed(record["metrics"]["grad_norm_by_layer"].items()))
    records[300]["metrics"]["grad_norm_by_layer"].update({"embed": 30.0, "h.1": 90.0})
    log = write(tmp_path / "reordered.jsonl", records)
    general = outcome_of(log, Policy(), columnar=False)
    assert [a[5].get("layer") for a in general["actions"]] == ["h.1"]
    assert outcome_of(log, Policy(), columnar=True, chunk_bytes=5000) == general


def test_lines_longer_than_a_block(tmp_path):
    """A record longer than a decode block (64 KiB: a long event message, a big config dump) is cut
    neither by the chunking nor by the blocks within a chunk."""
    records = list(trainer_records(300, faults=False))
    records[120]["event"] = {"type": "note", "message": "x" * 200_000}
    records[121]["run_config"] = {"dump": "y" * 70_000}
    log = write(tmp_path / "long.jsonl", records, bad_every=97)
    general = outcome_of(log, Policy(), columnar=False)
    assert general["counts"][0] == 300 and general["problems"][0] == 3
    for chunk_bytes in (1000, 100_000):
        assert outcome_of(log, Policy(), columnar=True, chunk_bytes=chunk_bytes, workers=2) == general


def test_only_whole_plain_single_files_go_the_columnar_way(tmp_path):
    plain = write(tmp_path / "a.jsonl", trainer_records(10, faults=False))
    packed = tmp_path / "b.jsonl.gz"
    write(packed, trainer_records(10, faults=False))
    assert columns.fits(source.Stream([plain]))
    assert not columns.fits(source.Stream([packed]))
    assert not columns.fits(source.Stream([plain, plain]))
    assert not columns.fits(source.Stream([plain], full=True))


def test_an_empty_or_all_malformed_file(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    junk = tmp_path / "junk.jsonl"
    junk.write_bytes(b"{nope\n" * 5 + b"\n")
    for log in (empty, junk):
        assert outcome_of(log, Policy(), columnar=True, chunk_bytes=8) == outcome_of(log, Policy(), columnar=False)


def test_replay_goes_the_columnar_way_and_reads_once(tmp_path):
    log = write(tmp_path / "rank-0.jsonl", trainer_records(50, faults=False))
    stream = source.Stream([log])
    outcome = engine.replay(stream, Policy())
    assert outcome.steps == 50 and stream.lead_rank == 0
    with pytest.raises(RuntimeError, match="read once"):
        list(columns.read(stream, Picker()))


PARENT = os.getpid()


def _dies_after_the_second_chunk(path, start, end, head):
    """columns._read_chunk, but a worker process given a chunk past the second kills itself."""
    if os.getpid() != PARENT and start > 2 * 20_000:
        os.kill(os.getpid(), signal.SIGKILL)
    return _READ_CHUNK(path, start, end, head)


_READ_CHUNK = columns._read_chunk


def test_a_worker_killed_midway_loses_nothing(tmp_path, monkeypatch):
    """A worker that dies (the OOM killer, a signal) breaks the pool: its chunk and the rest are read in
    this process instead, and the replay is the same."""
    log = write(tmp_path / "rank-0.jsonl", trainer_records(1500), bad_every=173)
    general = outcome_of(log, POLICY, columnar=False)
    monkeypatch.setattr(columns, "_read_chunk", _dies_after_the_second_chunk)
    assert outcome_of(log, POLICY, columnar=True, chunk_bytes=20_000, workers=2) == general


def marked_records(count: int):
    """The trainer's log with the events the passes after the replay read: a restart's run_start, the
    agent's alerts and actions, and a line that names "alert" only as a value."""
    for i, record in enumerate(trainer_records(count)):
        yield record
        when, step = record["timestamp"], record.get("step")
        if i % 300 == 10:
            yield {"timestamp": when, "rank": 0, "step": step, "event": {"type": "run_start", "resumed_from": step}}
        if i % 250 == 20:
            yield {"timestamp": when, "node": "node-a", "event": {
                "type": "alert", "alertname": "LossSpike", "status": "firing", "key": f"k{i}", "outcome": "act",
                "action": "rollback", "requested": "rollback", "source": "alertmanager", "reason": "LossSpike"}}
            yield {"timestamp": when, "node": "node-a", "event": {"type": "action", "id": f"r{i}",
                                                                   "action": "rollback", "outcome": "issued"}}
        if i % 400 == 30:
            yield {"timestamp": when, "rank": 0, "step": step, "metrics": {"loss": 3.0, "note": "alert"}}


@pytest.mark.parametrize("workers", [1, 2])
def test_the_passes_after_a_columnar_replay_read_no_file_again(tmp_path, monkeypatch, workers):
    """The chunks hand over the lines naming a recorded event (source.MARKS): `trainguard replay LOG` reads
    its one file once, and says exactly what the merged stream (which searches the file again) says."""
    from trainguard.replay import timeline

    log = write(tmp_path / "rank-0.jsonl", marked_records(1500), bad_every=173)
    monkeypatch.setattr(columns, "fits", lambda stream: False)
    merged = timeline.replay_logs([log], POLICY).to_json()
    assert merged["recorded_alerts"] and {r["action"] for r in merged["recorded_actions"]} >= {"restart", "rollback"}
    monkeypatch.undo()
    monkeypatch.setattr(columns, "CHUNK_BYTES", 20_000)
    monkeypatch.setattr(columns, "available_cpus", lambda: workers)

    def no_second_read(*args, **kwargs):
        raise AssertionError("a columnar replay read its file again")

    monkeypatch.setattr(source, "lines_naming", no_second_read)
    assert timeline.replay_logs([log], POLICY).to_json() == merged
