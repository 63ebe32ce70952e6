"""The agent's stall watchdog over recorded logs: what its tracker (trainguard.decide.stall) reads of each
record, in the merged stream's order, for `timeline.stall_notices`.

Two ways, the same stalls (tests/replay/test_stall_pass.py holds them to it):

- `stall_records`: every file read again on every CPU as columns (time, the step written where the record
  has metrics, whether its event ends or starts a run), put in merged order (a stable sort of the files'
  columns by each file's latest time up to each record: heapq.merge's order) and screened exactly
  (`_may_matter`): the tracker sees only the records that can change it or be a stall. Holds ~25 bytes a
  record while it sorts, so only up to STALL_COLUMNS_MAX_RECORDS.
- `streamed`, the reference: a `heapq.merge` of each file's records, one record per file held. The
  one-process path, `--rules` (which reads every line leniently) and larger runs take it.
"""

from __future__ import annotations

import gc
import heapq
import math
import operator
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from trainguard.decide import stall as decide_stall
from trainguard.replay import columns, parallel, source

# Beyond this many records (~200 MB of columns held) the streaming reference runs instead: slower, but
# memory stays flat however large the run directory.
STALL_COLUMNS_MAX_RECORDS = 8_000_000

_timestamp, _step, _metrics, _event = (operator.attrgetter(name) for name in ("timestamp", "step", "metrics",
                                                                              "event"))


def entries(stream: source.Stream, stall_seconds: float, records: int) -> Iterable[tuple]:
    """(timestamp, step, ended, started) for the tracker, in merged order, of a stream of `records`
    records: on every CPU where that is exact and small enough, else streamed."""
    if not stream.full and not parallel.one_process_asked() and records <= STALL_COLUMNS_MAX_RECORDS:
        try:
            return stall_records(stream.files, stall_seconds)
        except parallel.NotExact:
            pass
    return streamed(stream.files, stream.full, stall_seconds)


# What the stall watchdog's tracker (trainguard.decide.stall.StallTracker.observe) reads of a record,
# as bits: a step record's step (it has metrics), an event that ends the run, one that starts it.
HAS_STEP, ENDED, STARTED = 1, 2, 4


@dataclass
class StallPiece:
    """A stretch of one file as the stall watchdog reads it: each record's time, step and kind (bits)."""

    index: int
    times: np.ndarray
    steps: np.ndarray           # 0 where the record has no step record's step (kinds & HAS_STEP unset)
    kinds: np.ndarray
    failed: bool                # the file could not be read here: it ends before this stretch (as in `take`)


def read_stall_piece(path: str, index: int, start: int, end: int | None, layer_names) -> StallPiece:
    """The records of path[start:end] (end None: a compressed file, whole) as columns (in a worker)."""
    enabled = gc.isenabled()
    gc.disable()
    columns_of: list[tuple] = []
    failed = False
    try:
        fast = source.layers_decoder(layer_names) if layer_names and end is not None else None
        for records, _ in parallel.blocks_of(path, start, end, source.Problems(), fast):
            if records:
                columns_of.append(_stall_columns(records))
    except OSError:
        failed = True
    finally:
        if enabled:
            gc.enable()
    if not columns_of:
        return StallPiece(index, np.zeros(0), np.zeros(0, np.int64), np.zeros(0, np.int8), failed)
    times, steps, kinds = (np.concatenate(part) for part in zip(*columns_of))
    return StallPiece(index, times, steps, kinds, failed)


def _stall_columns(records: list) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(times, steps, kinds) of a block: passes in C for the usual block (every record a step record, no
    event), one loop for any other. The step is the one written (a step-less training record has none:
    entries_of numbers it for the guard, not for the watchdog, which reads the record as logged)."""
    n = len(records)
    stamps = list(map(_timestamp, records))
    floats = list(map(type, stamps)).count(float)
    if floats in (0, n):
        times = parallel.seconds_of(stamps)
    else:
        times = np.fromiter(map(source.unix_seconds, stamps), np.float64, n)
    steps = list(map(_step, records))
    if None not in steps and None not in map(_metrics, records) and not any(map(_event, records)):
        return times, np.array(steps, np.int64), np.full(n, HAS_STEP, np.int8)
    kinds = np.zeros(n, np.int8)
    written = np.zeros(n, np.int64)
    for i, record in enumerate(records):
        if record.metrics is not None and record.step is not None:
            kinds[i], written[i] = HAS_STEP, record.step
        event = record.event
        if event is not None:
            kinds[i] |= (ENDED if event.type in decide_stall.ENDED_EVENTS else 0) | (STARTED if event.type in decide_stall.STARTED_EVENTS else 0)
    return times, written, kinds


def stall_records(files: list, stall_seconds: float, *, chunk_bytes: int | None = None,
                  workers: int | None = None) -> list[tuple]:
    """The (timestamp, step, ended, started) records of `files` the stall watchdog's tracker must see, in
    the merged stream's order, read on every CPU: the same verdicts as the tracker over every record
    (`streamed`, one process), from a few of them.

    Each file is read as columns (`read_stall_piece`); a record's place in merged order is (its file's
    latest time up to it, the file, its ordinal): the files' columns, in file order, sorted stably by that
    latest time. Held meanwhile: 25 bytes a record (this pass runs only where the lead rank's steps leave
    room for a stall). Raises parallel.NotExact for what the columns cannot hold (a step past 64 bits)."""
    chunk_bytes = chunk_bytes or columns.CHUNK_BYTES
    heads = [source.first_block(path) for path in files]
    paths = list(map(str, files))
    tasks = [(paths[index], index, start, end, parallel.layer_names_of(heads[index]) if heads[index] else None)
             for index in parallel.by_work(paths, list(range(len(paths)))) for start, end in parallel.spans_of(paths[index], chunk_bytes)]
    size = sum(os.path.getsize(path) for path in files)
    count = 1 if size <= 2 * chunk_bytes else (columns.available_cpus() if workers is None else workers)
    per_file: list[list] = [[] for _ in files]
    latest = [-np.inf] * len(files)
    failed = [False] * len(files)
    try:
        for piece in columns.pipelined(read_stall_piece, iter(tasks), count):
            index = piece.index
            failed[index] = failed[index] or piece.failed
            if failed[index] or not len(piece.times):
                continue
            running = np.maximum(np.maximum.accumulate(piece.times), latest[index])
            latest[index] = float(running[-1])
            per_file[index].append((running, piece.times, piece.steps, piece.kinds))
    except OverflowError as exc:
        raise parallel.NotExact(f"a step the stall columns cannot hold ({exc})") from None
    for index, pieces in enumerate(per_file):       # a file's restarts: the tracker counts from them
        if pieces:
            running, times, steps, kinds = (np.concatenate([piece[column] for piece in pieces]) for column in range(4))
            kinds[_restarts(times, steps, kinds, stall_seconds)] |= STARTED
            per_file[index] = [(running, times, steps, kinds)]
    parts = [part for pieces in per_file for part in pieces]
    if not parts:
        return []
    del per_file
    order = np.argsort(np.concatenate([part[0] for part in parts]), kind="stable")
    times, steps, kinds = (np.concatenate([part[column] for part in parts])[order] for column in (1, 2, 3))
    del parts, order        # what is held from here on: the sorted columns (17 bytes a record)
    kept = np.flatnonzero(_may_matter(times, steps, kinds, stall_seconds))
    return [(float(times[i]), int(steps[i]) if kinds[i] & HAS_STEP else None, bool(kinds[i] & ENDED),
             bool(kinds[i] & STARTED)) for i in kept]


def _may_matter(times: np.ndarray, steps: np.ndarray, kinds: np.ndarray, stall_seconds: float) -> np.ndarray:
    """The records (in merged order) that can change the tracker or be a stall; the rest it passes over
    without either, so the tracker decides the same from these alone (StallTracker.observe):

    - every event that ends or starts a run (they change its state);
    - progress: a step record's step beyond the latest since the last run start (ended records do not move it);
    - a record at least `stall_seconds` after the latest progress before it (the only ones it can fire on).
    The rest (the other ranks' copies of a step, samples while steps advance) change nothing."""
    n = len(times)
    events = (kinds & (ENDED | STARTED)) != 0
    moving = ((kinds & HAS_STEP) != 0) & ((kinds & ENDED) == 0)          # steps that can move the tracker
    floor = np.iinfo(np.int64).min
    values = np.where(moving, steps, floor)
    before = np.full(n, floor)                   # the tracker's step before each record (floor: none)
    starts = np.flatnonzero(kinds & STARTED)     # a run start forgets the step, its own counts after it
    bounds = [0, *starts.tolist(), n]
    for begin, end in zip(bounds[:-1], bounds[1:]):
        if end > begin:
            seen = np.maximum.accumulate(values[begin:end])
            before[begin + 1:end] = seen[:-1]
    progress = moving & (values > before)
    last = np.where(progress, np.arange(n), -1)
    last = np.maximum.accumulate(last)           # the latest progress at or before each record
    previous = np.concatenate(([-1], last[:-1]))
    late = (previous >= 0) & (times - times[np.maximum(previous, 0)] > stall_seconds)
    return events | progress | late


def streamed(files: list[Path], full: bool, stall_seconds: float = math.inf) -> Iterator[tuple]:
    """(timestamp, step, ended, started) of every record of `files`, in the merged stream's order: each
    file's records merged by (time, file, ordinal), as source.Stream merges them. Streams: one record per
    file is held. A file's restart after more than `stall_seconds` of silence starts a run (`_restarts`)."""
    merged = heapq.merge(*(_file_entries(path, index, full, stall_seconds) for index, path in enumerate(files)))
    return ((when, step, ended, started) for when, _, _, step, ended, started in merged)


def _file_entries(path: Path, index: int, full: bool, stall_seconds: float = math.inf) -> Iterator[tuple]:
    """What the tracker reads of each record of one file: its time, the step written where it is a step
    record (with metrics; a step-less one has none), whether its event ends or starts a run."""
    ordinal = 0
    last_time, last_step = -math.inf, None
    for records, _ in (source._full_chunks if full else source._typed_chunks)(Path(path), source.Problems()):
        for record in records:
            ordinal += 1
            event = record.event
            kind = None if event is None else event.type
            when = source.unix_seconds(record.timestamp)
            step = record.step if record.metrics is not None else None
            restart = (step is not None and last_step is not None and step <= last_step
                       and when - last_time > stall_seconds)
            yield (when, index, ordinal, step, kind in decide_stall.ENDED_EVENTS, kind in decide_stall.STARTED_EVENTS or restart)
            last_time = when
            last_step = step if step is not None else last_step


def _restarts(times: np.ndarray, steps: np.ndarray, kinds: np.ndarray, stall_seconds: float) -> np.ndarray:
    """Of one file's records, in its order: the step records whose step is not beyond the file's previous
    step record's and that come more than `stall_seconds` after the file's previous record. A run was
    restarted from an earlier checkpoint and appended to the same log (a crash, a requeue: nothing wrote
    while it was away), by a launcher that writes no ``run_start``: the tracker counts from there, as
    after a ``run_start``, and there was no hang to see. Another file's steps (a node log ahead of a
    hung rank) are no reason: only the file's own step goes back."""
    n = len(times)
    has = (kinds & HAS_STEP) != 0
    previous = np.maximum.accumulate(np.where(has, np.arange(n), -1))
    before = np.concatenate(([-1], previous[:-1]))              # the previous step record, before each
    silence = np.concatenate(([-np.inf], np.diff(times))) > stall_seconds
    return has & (before >= 0) & (steps <= steps[np.maximum(before, 0)]) & silence


__all__ = ["STALL_COLUMNS_MAX_RECORDS", "entries", "stall_records", "streamed"]
