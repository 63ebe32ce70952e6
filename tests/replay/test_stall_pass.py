"""The stall watchdog over recorded logs (trainguard.replay.stall_pass): the columns read on every CPU, merged
and screened, decide the very stalls the streaming reference decides over every record."""

from __future__ import annotations

import json

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.replay.run_dirs import T0, both_ways, build_run, document
from trainguard import tls
from trainguard.decide import stall
from trainguard.replay import columns, stall_pass


@settings(max_examples=200, deadline=None)
# a run_end with a step does not move the tracker's step: the progress after it is progress
@example(records=[(0.0, 1, 0), (1.0, 10, stall_pass.ENDED), (2.0, 5, 0), (3.0, None, stall_pass.STARTED), (6.5, None, 0)],
         stall_seconds=5.0, step_first=False)
@given(records=st.lists(st.tuples(st.floats(0, 600, allow_nan=False), st.one_of(st.none(), st.integers(0, 30)),
                                  st.sampled_from([0] * 12 + [stall_pass.ENDED, stall_pass.STARTED])),
                        max_size=80),
       stall_seconds=st.sampled_from([5.0, 30.0, 60.0]), step_first=st.booleans())
def test_the_stall_screen_keeps_what_the_tracker_decides_on(records, stall_seconds, step_first):
    """stall_pass._may_matter drops records in merged order; the tracker (decide/stall) over what it keeps
    finds the very stalls it finds over all of them."""
    times = np.array([r[0] for r in records], np.float64)
    steps = np.array([0 if r[1] is None else r[1] for r in records], np.int64)
    kinds = np.array([(stall_pass.HAS_STEP if r[1] is not None else 0) | r[2] for r in records], np.int8)
    entries = [(t, s, bool(k & stall_pass.ENDED), bool(k & stall_pass.STARTED)) for t, (_, s, _), k
               in zip(times.tolist(), records, kinds.tolist())]
    kept = stall_pass._may_matter(times, steps, kinds, stall_seconds) if records else np.zeros(0, bool)
    assert stall.replay([e for e, keep in zip(entries, kept) if keep], stall_seconds) == \
        stall.replay(entries, stall_seconds)


def test_the_stall_pass_on_every_cpu_decides_as_the_one_process_stream(tmp_path):
    """stall_pass.stall_records (columns read by two workers, merged by the latest time, screened) against
    stall_pass.streamed (every record, heapq.merge, one process): the same stalls, for a run whose
    ranks hang, restart (run_start) and end (run_end) in different files, with clocks that step back."""
    run = build_run(tmp_path / "run", seed=11, ranks=3, nodes=2, hang=True, steps=600)
    log = run / "tls" / "rank-1.jsonl"
    log.write_bytes(log.read_bytes() + b"".join(tls.encode(r) for r in (
        {"timestamp": T0 + 700.0, "rank": 1, "event": {"type": "run_end"}},
        {"timestamp": T0 + 900.0, "rank": 1, "step": 3, "event": {"type": "run_start", "resumed_from": 2}},
        {"timestamp": T0 + 1000.0, "rank": 1, "step": 4, "metrics": {"loss": 1.0, "grad_norm": 1.0}},
        {"timestamp": T0 + 1100.0, "rank": 1, "hardware": {"gpu_util": 0.0}})))     # stalled since step 4
    files = sorted((run / "tls").iterdir())
    reference = stall.replay(stall_pass.streamed(files, False), 60.0)
    found = stall.replay(stall_pass.stall_records(files, 60.0, chunk_bytes=16_000, workers=2), 60.0)
    assert found == reference and len(reference) >= 2


def test_the_stall_pass_takes_the_merged_order_where_a_clock_steps_back(tmp_path):
    """A record earlier than one before it in its file waits behind it in the merged order: after the step
    at +70 s, the sample stamped +66 s (the clock stepped back) is no stall, as the tracker over the merged
    stream decides (sorted by their own times, the sample would come first, 66 s after the last step)."""
    step = {"rank": 0, "metrics": {"loss": 1.0, "grad_norm": 1.0}}
    (tmp_path / "rank-0.jsonl").write_bytes(b"".join(tls.encode(r) for r in (
        *({"timestamp": T0 + i, "step": i + 1, **step} for i in range(5)), {"timestamp": T0 + 70, "step": 6, **step},
        {"timestamp": T0 + 66, "rank": 0, "hardware": {"gpu_util": 1.0}})))
    (tmp_path / "node-a.jsonl").write_bytes(tls.encode({"timestamp": T0 + 80, "node": "a", "step": 6,
                                                       "metrics": {"loss": 1.0}}))
    files = sorted(tmp_path.iterdir())
    assert stall.replay(stall_pass.streamed(files, False), 60.0) == []
    assert stall.replay(stall_pass.stall_records(files, 60.0, workers=1), 60.0) == []




def test_a_run_larger_than_the_stall_columns_bound_streams_its_stall_pass(tmp_path, monkeypatch):
    """Past STALL_COLUMNS_MAX_RECORDS the stall pass is the streaming reference (memory flat however large
    the run directory), and the document is the same."""
    monkeypatch.setattr(columns, "CHUNK_BYTES", 16_000)
    monkeypatch.setattr(columns, "available_cpus", lambda: 2)
    run = build_run(tmp_path / "run", seed=5, hang=True, nodes=2)
    reference = both_ways([run], monkeypatch)
    columns_read = []
    original = stall_pass.stall_records
    monkeypatch.setattr(stall_pass, "stall_records", lambda *a, **k: columns_read.append(1) or original(*a, **k))
    monkeypatch.setattr(stall_pass, "STALL_COLUMNS_MAX_RECORDS", 10)
    assert document([run], one_process=False, monkeypatch=monkeypatch) == reference
    assert not columns_read
    monkeypatch.setattr(stall_pass, "STALL_COLUMNS_MAX_RECORDS", 10**9)
    assert document([run], one_process=False, monkeypatch=monkeypatch) == reference
    assert columns_read
    assert any(a["source"] == "stall" for a in json.loads(reference)["actions"])
