"""Replay of several files (a run directory: every rank's log, the agents' node logs, rotated and
compressed parts) on every CPU, exactly as the merged stream replays them.

The merged stream (source.Stream.blocks) reads every file in one process and picks from the records in
merged order: by time, then the file's place among the inputs, then its order within the file. Here each
file is decoded apart, in worker processes (a plain file cut in chunks, a compressed one whole), and the
main process puts together what the merged order decides. Picking depends on it in three ways:

1. **GPUs.** A lead step bills the GPU count of the latest record in merged order that says one, in ANY
   file (a node log says 8, a rank log the world's count). A step whose own record says one bills that:
   nothing else can come between. The others (a CPU run's gpu_count 0: the GPUs come from a node log)
   are resolved once every file is read: each file's records that say a count, at their place in merged
   order, searched for the latest before each such step (`_Unresolved`). Their steps are held until then.
2. **Duplicates.** A lead-rank step from another file than the last decided one is a duplicate when its
   step is not past the last decided step. The lead rank's files (its log and the rotated parts of it)
   are read first, one after the other in merged order; a file's leading steps up to the last decided
   step are its duplicates. A lead-rank step in any other file, or lead files that overlap in time, need
   the real merge: the run is handed to the merged stream (`NotExact`), which reads it again.
3. **Recorded decisions** are put in merged order by their place.

A record's place in merged order: heapq.merge takes the smallest head of the files, so a record that is
earlier than one before it in its file waits behind that one. Its place is therefore (the latest time of
its file up to it, the file's index, its line's ordinal): the merged stream's order, not only where
every file is in time order (tests/replay/test_parallel.py holds the two to the same JSON).

Counts, first and last times and malformed lines (kept in input order: source.Problems) are the sums
and extremes of each file's. Memory stays flat: at most IN_FLIGHT chunks per worker are in flight; what
is held beyond that is the recorded decisions and, only when some lead steps need the merged GPU
count, those steps' columns.
"""

from __future__ import annotations

import functools
import gc
import operator
import os
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path
from typing import Callable, Iterator, NamedTuple, Sequence

import msgspec
import numpy as np
import zstandard

from trainguard import safe_read
from trainguard.decide.batch import Block
from trainguard.replay import columns, source
from trainguard.replay.picking import Picked, Picker

ONE_PROCESS_ENV = "TRAINGUARD_REPLAY_ONE_PROCESS"   # set (to 1): the merged stream, as the reference


class NotExact(Exception):
    """These inputs need the merged stream: what the parallel read cannot decide alone (the reason)."""


def fits(stream) -> bool:
    """Whether `stream` goes this way: a source.Stream of typed records that is not one plain file
    (columns.py's), unless the environment asks for the one-process path."""
    if one_process_asked() or not isinstance(stream, source.Stream):
        return False
    return not stream.full and bool(stream.files) and not columns.fits(stream)


def one_process_asked() -> bool:
    """Whether the environment asks for the one-process path (ONE_PROCESS_ENV), the reference."""
    return os.environ.get(ONE_PROCESS_ENV, "") not in ("", "0")


# ----------------------------------------------------------------------------------------- a worker

@dataclass
class Piece:
    """A stretch of one file, decoded and picked (in a worker): columns.Chunk, and where things are."""

    index: int                      # the file's place among the inputs
    chunk: columns.Chunk
    step_ordinals: np.ndarray       # ordinal (from 1, within the piece) of each picked step
    step_latest: np.ndarray         # the file's latest time up to each step, within the piece
    gpu_ordinals: np.ndarray        # records that say a GPU count: ordinal, latest time, count
    gpu_latest: np.ndarray
    gpu_counts: np.ndarray
    recorded_latest: list[float]    # beside chunk.picker.recorded
    recorded_ordinals: list[int]
    records: int
    start: int                      # the piece's first byte in its file (0: a compressed file, whole)
    marked: list                    # (line within the piece, raw line) of the lines naming a mark


MARKS, _MARKED_TYPES = source.MARKS, source.MARKED_TYPES      # the lines the workers hand over (source.py says why)


def read_piece(path: str, index: int, start: int, end: int | None, lead, layer_names, with_gpus: bool,
               lead_files: tuple = ()) -> Piece:
    """Decode and pick path[start:end] (end None: a compressed file, whole). `with_gpus`: keep where the
    records that say a GPU count are (needed only when some lead step does not say its own)."""
    enabled = gc.isenabled()
    gc.disable()        # as columns._read_chunk: many short-lived objects, no cycles
    try:
        return _decode(path, index, start, end, lead, layer_names, with_gpus, lead_files)
    finally:
        if enabled:
            gc.enable()


# A span is decoded DECODE_BYTES at a time (its records counted, then freed, before the next): the records
# of a few hundred lines stay in the CPU's caches while they are made, read and freed, where those of a
# whole 8 MiB span (~12,000 records, ~8 MB of objects) do not (bench/bench_replay_rundir.py --decode-bytes).
DECODE_BYTES = 1 << 16


def blocks_of(path: str, start: int, end: int | None, problems: source.Problems,
               fast) -> Iterator[tuple[list, Callable[[bool], list]]]:
    """The piece's decoded blocks, each with a function that, told whether the block names a marked event,
    gives its marked lines ((line within the piece, raw line): searched for only in a block with such an
    event or a malformed line, and only there are line numbers counted). A compressed file's are not
    searched here (`_decode` does, in the whole file: its line numbers are its own)."""
    if end is None:      # compressed: as the merged stream reads it
        for records, _ in source._typed_chunks(Path(path), problems):
            yield records, _none
        return
    with safe_read.open_file(path, what="log file") as handle:
        handle.seek(start)
        data = handle.read(end - start)
    view = memoryview(data)
    for begin, stop in _line_spans(data, DECODE_BYTES):
        records = _typed(view[begin:stop], fast)       # the usual case: no copy, one call
        troubled = records is None
        if troubled:            # some line is refused: block by block, isolating it (and counting lines)
            found = problems.count
            records = source.decode_block(data[begin:stop], functools.partial(_line_at, data, begin), path,
                                          problems, fast)
            troubled = problems.count != found
        yield records, functools.partial(_marked_between, data, begin, stop, troubled)


def _line_spans(data: bytes, size: int) -> Iterator[tuple[int, int]]:
    """(begin, end) of stretches of whole lines of about `size` bytes (a longer line: alone, whole)."""
    begin, total = 0, len(data)
    while begin < total:
        stop = data.rfind(b"\n", begin, begin + size) + 1 if begin + size < total else total
        if stop <= begin:
            stop = data.find(b"\n", begin + size) + 1 or total
        yield begin, stop
        begin = stop


def _typed(view: memoryview, fast) -> list | None:
    """Every line of the stretch typed in one call (the fast decoder, then the plain one), or None when some
    line is refused."""
    for decoder in (source._typed,) if fast is None else (fast, source._typed):
        try:
            return decoder.decode_lines(view)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            pass
    return None


def _line_at(data: bytes, at: int) -> int:
    return data.count(b"\n", 0, at) + 1


def _marked_between(data: bytes, begin: int, stop: int, troubled: bool, flagged: bool) -> list:
    if not (flagged or troubled):
        return []
    return list(source._marked(data[begin:stop], MARKS, _line_at(data, begin)))


def _none(flagged: bool) -> list:
    return []


def _decode(path: str, index: int, start: int, end: int | None, lead, layer_names, with_gpus: bool,
            lead_files: tuple) -> Piece:
    problems, picker, picked = source.Problems(), Picker(lead, track=True), Picked()
    fast = source.layers_decoder(layer_names) if layer_names and end is not None else None
    last_step = 0 if start == 0 else columns.UNKNOWN_STEP
    ordinal = 0
    times = []
    marked: list = []
    flagged_any = False
    error = None
    summing = index not in lead_files
    try:
        for records, marked_lines in blocks_of(path, start, end, problems, fast):
            summed = _summed(records, lead, with_gpus) if summing and records else None
            if summed is not None:      # no step, decision or GPU count of the lead rank's: counts only
                last_step = _add(picker, summed, last_step, ordinal)
                times.append(np.full(len(records), summed.latest) if summed.times is None else summed.times)
                ordinal += len(records)
                flagged = summed.flagged
            else:
                entries, ordinal, last_step = source.entries_of(records, None, 0, ordinal, last_step)
                picked.extend(picker.take(entries))
                times.append(np.fromiter((entry[0] for entry in entries), np.float64, len(entries)))
                flagged = source.names_marked(records)
            marked += marked_lines(flagged)
            flagged_any = flagged_any or flagged
    except OSError as exc:
        error = f"{type(exc).__name__}: {exc}"
    if end is None and (flagged_any or problems.count):   # a compressed file with any: searched whole again
        marked = list(source.lines_naming(path, MARKS))
    latest = np.maximum.accumulate(np.concatenate(times)) if times else np.zeros(0)
    tracked = picker.tracked
    step_ordinals = np.array(tracked.steps, np.int64)
    gpu_ordinals = np.array(tracked.gpu_ordinals, np.int64)
    gpu_counts = np.array(tracked.gpu_counts, np.int64)
    if not with_gpus:       # only whether the steps said their own: the ones that did not need them all
        keep = np.isin(gpu_ordinals, step_ordinals)
        gpu_ordinals, gpu_counts = gpu_ordinals[keep], gpu_counts[keep]
    picker.tracked = None
    chunk = columns.Chunk(columns.block_of(picked, layer_names), picker, problems, 0, last_step, error)
    return Piece(index, chunk, step_ordinals, latest[step_ordinals - 1], gpu_ordinals, latest[gpu_ordinals - 1],
                 gpu_counts, [float(latest[o - 1]) for o in tracked.recorded], list(tracked.recorded), ordinal,
                 start, marked)


class Summed(NamedTuple):
    """A block of records nothing in which is the lead rank's: what Picker.take would count of it."""

    records: int
    copies: int                     # training records (a loss, with or without grad_norm): other ranks' copies
    partial: int                    # records with a grad_norm but no loss
    last_step: int | None           # the step of the block's last record that has one
    first: float                    # the first record's time, and the latest
    latest: float
    flagged: bool                   # some record names a marked event (MARKS)
    gpu_positions: Sequence[int] = ()   # with_gpus: the records that say a GPU count (from 0), their counts,
    gpu_counts: Sequence[int] = ()      # and every record's time (None when no record says one)
    times: np.ndarray | None = None


_rank, _event, _metrics, _step = (operator.attrgetter(name) for name in ("rank", "event", "metrics", "step"))
_timestamp, _system, _hardware = (operator.attrgetter(name) for name in ("timestamp", "system", "hardware"))
_loss, _grad_norm, _gpu_count, _gpus = (operator.attrgetter(name) for name in ("loss", "grad_norm", "gpu_count", "gpus"))
_seconds = source.unix_seconds


def _summed(records: list, lead, with_gpus: bool) -> Summed | None:
    """A block's counts when nothing in it is the lead rank's (Picker.take's, without the Picker); None when
    the block needs the Picker (a lead-rank step or event, a step-less training record, times of two
    kinds; with `with_gpus`, a record that says a GPU count in a block `_summed_in_c` does not take).

    Most records of a run directory are other ranks' copies, and this is their cost: the usual block (one
    rank not the lead's, every record a training step with a step and both numbers, no event) is counted by
    passes in C (`_summed_in_c`), any other by one plain loop (`_summed_by_loop`), the reference."""
    found = _summed_in_c(records, lead, with_gpus)
    return _summed_by_loop(records, lead, with_gpus) if found is _UNUSUAL else found


_UNUSUAL = object()     # not the usual block: counted by the loop


def _summed_in_c(records: list, lead, with_gpus: bool):
    n = len(records)
    ranks = list(map(_rank, records))
    if ranks[0] == lead or ranks.count(ranks[0]) != n:
        return _UNUSUAL
    events = list(map(_event, records))
    metrics = list(map(_metrics, records))
    steps = list(map(_step, records))
    if events.count(None) != n or None in metrics or None in steps:
        return _UNUSUAL
    if None in map(_loss, metrics) or None in map(_grad_norm, metrics):
        return _UNUSUAL
    stamps = list(map(_timestamp, records))
    try:
        latest = max(stamps)
    except TypeError:       # Unix seconds and RFC 3339 in one block: the Picker's way
        return None
    gpus = _gpus_said(records, n) if with_gpus else ((), ())
    if gpus is None:
        return _UNUSUAL
    times = seconds_of(stamps) if len(gpus[0]) else None
    return Summed(n, n, 0, steps[-1], _seconds(stamps[0]), _seconds(latest), False, *gpus, times)


def _gpus_said(records: list, n: int) -> tuple | None:
    """(positions, counts) of the records that say a GPU count (Picker.take's rule) when every record says
    it by `system.gpu_count` or none says one at all; None otherwise (the loop's to count)."""
    systems = list(map(_system, records))
    counts = list(map(_gpu_count, filter(None, systems)))
    said = len(counts) - counts.count(None) - counts.count(0)
    if said == n:
        return range(n), counts
    if said:
        return None
    listed = list(map(_gpus, filter(None, map(_hardware, records))))
    return ((), ()) if listed.count(None) + listed.count([]) == len(listed) else None


def seconds_of(stamps: list) -> np.ndarray:
    """Times as Unix seconds (one kind in the block: `_summed_in_c` found their max)."""
    if stamps[0].__class__ is float:
        return np.array(stamps, np.float64)
    return np.fromiter(map(datetime.timestamp, stamps), np.float64, len(stamps))


def _summed_by_loop(records: list, lead, with_gpus: bool) -> Summed | None:
    copies = partial = 0
    last_step = None
    flagged = False
    for record in records:
        metrics, step, event = record.metrics, record.step, record.event
        if metrics is not None and (metrics.loss is not None or metrics.grad_norm is not None):
            if step is None or record.rank == lead:     # (a step-less one: numbered, as entries_of does)
                return None
            if metrics.loss is not None:
                copies += 1
            else:
                partial += 1
        if event is not None:
            if record.rank == lead:
                return None
            flagged = flagged or event.type in _MARKED_TYPES
        if step is not None:
            last_step = step
        if with_gpus and ((record.system is not None and record.system.gpu_count)
                          or (record.hardware is not None and record.hardware.gpus)):
            return None
    try:
        latest = max(map(_timestamp, records))
    except TypeError:
        return None
    return Summed(len(records), copies, partial, last_step, _seconds(records[0].timestamp), _seconds(latest), flagged)


def _add(picker: Picker, summed: Summed, last_step: int, ordinal: int) -> int:
    """Count a summed block into the piece's picker (its records from `ordinal` + 1 on); returns the file's
    last step after it."""
    if picker.first is None:
        picker.first = picker.last = summed.first
    picker.last = max(picker.last, summed.latest)
    picker.records += summed.records
    picker.duplicates += summed.copies
    picker.partial += summed.partial
    if len(summed.gpu_positions):
        picker.tracked.gpu_ordinals.extend(np.add(summed.gpu_positions, ordinal + 1).tolist())
        picker.tracked.gpu_counts.extend(summed.gpu_counts)
    return last_step if summed.last_step is None else summed.last_step


# ------------------------------------------------------------------------------------- putting together

@dataclass
class _File:
    """What the main process carries from piece to piece of one file."""

    path: str
    counted_to: int = 0             # the lines before this byte are counted (when a malformed line needs it)
    counted: int = 0
    step_base: int = 0
    ordinals: int = 0               # records before the piece
    latest: float = -np.inf         # the file's latest time so far
    first: float | None = None
    failed: bool = False

    def lines_before(self, start: int) -> int:
        """The number of lines before byte `start` of the (plain) file: counted only when a malformed or
        marked line needs its number, on from where the last count ended."""
        if start > self.counted_to:
            with safe_read.open_file(self.path, what="log file") as handle:
                handle.seek(self.counted_to)
                self.counted += handle.read(start - self.counted_to).count(b"\n")
            self.counted_to = start
        return self.counted


@dataclass
class _Unresolved:
    """Lead steps whose record says no GPU count, held with the latest count known before each (its place
    in merged order: time, file, ordinal), until every file is read."""

    blocks: list = field(default_factory=list)       # (block, positions in it) in decision order
    # per held stretch: the steps' times and files, and the best candidate so far for each (time, file,
    # ordinal, count of the latest record before it that says a count), filled in as the files come
    held: list = field(default_factory=list)
    _arrays: tuple | None = None

    def __bool__(self) -> bool:
        return bool(self.blocks)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        """The held steps' times and files, and the best candidates so far as arrays (made once: every
        step is held before the first file that is not the lead rank's comes in)."""
        if self._arrays is None:
            times, files, *best = (np.concatenate(column) for column in zip(*self.held))
            self._arrays = (times, files, dict(zip(("time", "file", "ordinal", "count"), best)))
        return self._arrays


class _Run:
    def __init__(self, stream: source.Stream, totals: Picker, decide, chunk_bytes: int, workers: int):
        self.stream, self.totals, self.decide = stream, totals, decide
        self.chunk_bytes, self.workers = chunk_bytes, workers
        self.files = [_File(str(path)) for path in stream.files]
        self.recorded: list[tuple] = []
        self.event_lines: dict[str, list] = {}    # the marked lines of each file (MARKS), in file order
        self.last_step: int | None = None         # the last decided lead step, and its file
        self.last_file: int | None = None
        self.lead_latest: tuple | None = None     # the latest lead-file record saying a GPU count: (time, file, ord, n)
        self.lead_files: list[int] = []
        self.lead_tasks: int | None = None        # how many pieces the lead files are cut in (once known)
        self.lead_taken = 0
        self.unresolved = _Unresolved()
        self.previous_lead: int | None = None

    # ------------------------------------------------------------------------------------ the tasks
    def tasks(self, heads: list, lead) -> Iterator[tuple]:
        """The lead rank's files first, in merged order (the GPU counts and the duplicates follow them), then
        the others, the most work first (any order would do: the pieces of each file stay in file order),
        so that the two workers end together on the small ones."""
        others = [i for i in range(len(self.files)) if i not in self.lead_files]
        order = self.lead_files + by_work([self.files[i].path for i in others], others)
        handed = 0
        for index in order:
            if index not in self.lead_files and self.lead_tasks is None:
                self.lead_tasks = handed
            path = self.files[index].path
            layers = heads[index][1]       # no record at all: read all the same (its malformed lines)
            for start, end in spans_of(path, self.chunk_bytes):
                # GPU places are needed from the other files only if a lead step said none of its own;
                # until the lead files are all in, that is not known.
                with_gpus = index in self.lead_files or not self.lead_done or bool(self.unresolved)
                handed += 1
                yield path, index, start, end, lead, layers, with_gpus, tuple(self.lead_files)

    @property
    def lead_done(self) -> bool:
        """Every lead file's pieces are in: whether some lead step needs the merged GPU count is known."""
        return self.lead_tasks is not None and self.lead_taken == self.lead_tasks

    # ------------------------------------------------------------------------------------ a piece
    def take(self, piece: Piece) -> None:
        state = self.files[piece.index]
        if state.failed:
            return
        chunk = piece.chunk
        if chunk.problems.count or chunk.error is not None or piece.marked:
            before = state.lines_before(piece.start)
            columns._count_problems(self.stream.problems, chunk.problems, state.path, before)
            self.event_lines.setdefault(state.path, []).extend((before + n, raw) for n, raw in piece.marked)
            if chunk.error is not None:
                self.stream.problems.add(state.path, before + 1, f"unreadable after line {before} ({chunk.error})")
                state.failed = True
                return
        state.step_base = columns._number(chunk, state.step_base)
        picker = chunk.picker
        if picker.first is not None and state.first is None:
            state.first = picker.first
        self.totals.records += picker.records
        self.totals.duplicates += picker.duplicates
        self.totals.partial += picker.partial
        if picker.last is not None:
            self.totals.last = picker.last if self.totals.last is None else max(self.totals.last, picker.last)
        for action, latest, ordinal in zip(picker.recorded, piece.recorded_latest, piece.recorded_ordinals):
            self.recorded.append((max(latest, state.latest), piece.index, state.ordinals + ordinal, action))
        if piece.index in self.lead_files:
            self._lead(piece, state)
        elif len(chunk.steps):
            raise NotExact(f"{state.path} holds steps of the lead rank outside its own logs")
        elif self.unresolved:
            self._gpus_of(piece, state)
        if picker.last is not None:
            state.latest = max(state.latest, picker.last)
        state.ordinals += piece.records

    def _lead(self, piece: Piece, state: _File) -> None:
        index, block = piece.index, piece.chunk.steps
        if self.previous_lead != index:
            self._lead_file_starts(index, state)
        gpu_latest = np.maximum(piece.gpu_latest, state.latest)
        gpu_ordinals = state.ordinals + piece.gpu_ordinals
        step_ordinals = state.ordinals + piece.step_ordinals
        own = np.isin(step_ordinals, gpu_ordinals)
        start = self._duplicates(index, block.steps)
        if start:
            block, own = _tail(block, start), own[start:]
            step_ordinals, step_latest = step_ordinals[start:], np.maximum(piece.step_latest[start:], state.latest)
        else:
            step_latest = np.maximum(piece.step_latest, state.latest)
        if not own.all() or self.unresolved:
            self._hold(block, ~own, step_latest, index, step_ordinals, gpu_latest, gpu_ordinals, piece.gpu_counts)
        else:
            self.decide(block)
        if len(gpu_ordinals):
            self.lead_latest = (float(gpu_latest[-1]), index, int(gpu_ordinals[-1]), int(piece.gpu_counts[-1]))

    def _lead_file_starts(self, index: int, state: _File) -> None:
        """Lead files are read one after the other: each must lie after the one before in merged order."""
        previous = self.previous_lead
        if previous is not None and state.first is not None:
            before = self.files[previous]
            if before.latest > state.first:
                raise NotExact(f"{state.path} and {before.path} (the lead rank's logs) overlap in time")
        if state.first is not None:
            self.previous_lead = index

    def _duplicates(self, index: int, steps: np.ndarray) -> int:
        """How many leading steps are copies of decided ones (picking.Picker's rule across files); moves
        the last decided step on."""
        start = 0
        if self.last_file != index and self.last_step is not None and len(steps):
            ahead = np.flatnonzero(steps > self.last_step)
            start = int(ahead[0]) if len(ahead) else len(steps)
        self.totals.duplicates += start
        if start < len(steps):
            self.last_step, self.last_file = int(steps[-1]), index
        self.totals.steps += len(steps) - start
        return start

    def _hold(self, block: Block, needing: np.ndarray, latest, index: int, ordinals, gpu_latest, gpu_ordinals,
              gpu_counts) -> None:
        """Hold the steps of `block` that need the merged GPU count, each with the best candidate known: the
        latest record before it in its own piece that says a count, else the lead files' latest."""
        positions = np.flatnonzero(needing)
        self.unresolved.blocks.append((block, positions))
        held = ordinals[positions]
        before = np.searchsorted(gpu_ordinals, held) - 1       # the file's own, earlier in the piece
        own = before >= 0
        at = np.maximum(before, 0)
        fallback = self.lead_latest or (-np.inf, -1, -1, 0)

        def candidate(column: np.ndarray, otherwise, dtype) -> np.ndarray:
            return np.where(own, column[at], otherwise).astype(dtype) if len(column) else \
                np.full(len(held), otherwise, dtype)

        self.unresolved.held.append((np.asarray(latest)[positions].astype(np.float64), np.full(len(held), index, np.int64),
                                     candidate(gpu_latest, fallback[0], np.float64),
                                     np.where(own, index, fallback[1]).astype(np.int64),
                                     candidate(gpu_ordinals, fallback[2], np.int64),
                                     candidate(gpu_counts, fallback[3], np.int64)))

    def _gpus_of(self, piece: Piece, state: _File) -> None:
        """A file's GPU counts as candidates for the held steps: its latest one before each in merged order."""
        if not len(piece.gpu_ordinals):
            return
        wanted, files, best = self.unresolved.arrays()
        times = np.maximum(piece.gpu_latest, state.latest)
        ordinals = state.ordinals + piece.gpu_ordinals
        later_file = files > piece.index      # this file sorts first at equal times
        at = np.where(later_file, np.searchsorted(times, wanted, "right"), np.searchsorted(times, wanted, "left")) - 1
        found = at >= 0
        at = np.where(found, at, 0)
        time, ordinal = times[at], ordinals[at]
        # (time, file, ordinal) after the best so far, compared as tuples are
        later = found & ((time > best["time"]) | ((time == best["time"]) & (
            (piece.index > best["file"]) | ((piece.index == best["file"]) & (ordinal > best["ordinal"])))))
        best["time"][later], best["file"][later], best["ordinal"][later] = time[later], piece.index, ordinal[later]
        best["count"][later] = piece.gpu_counts[at][later]

    # ------------------------------------------------------------------------------------ the end
    def finish(self) -> None:
        found, i = self.unresolved, 0
        counts = found.arrays()[2]["count"] if found else None
        for block, positions in found.blocks:
            block.gpus[positions] = counts[i:i + len(positions)]
            i += len(positions)
            self.decide(block)
        self.unresolved = _Unresolved()
        self.recorded.sort(key=lambda item: item[:3])
        self.totals.recorded = [item[3] for item in self.recorded]
        firsts = [state.first for state in self.files if state.first is not None]
        self.totals.first = min(firsts) if firsts else None


def spans_of(path: str, chunk_bytes: int) -> Iterator[tuple[int, int | None]]:
    """A file's pieces: a compressed one whole ((0, None)); a plain one cut at line ends into pieces of
    even size, none over about `chunk_bytes` (9.9 MB: two of 4.95, not 8 MiB and 1.9: the workers'
    shares stay even)."""
    if path.endswith(columns.COMPRESSED):
        return iter([(0, None)])
    size = os.path.getsize(path)
    pieces = max(1, -(-size // chunk_bytes))
    return columns._spans(path, -(-size // pieces) if size else chunk_bytes)


def by_work(paths: list[str], indices: list[int]) -> list[int]:
    """`indices` (of `paths`), the most bytes to decode first: a compressed file counts what it holds."""
    return [index for _, index in sorted(zip(map(_bytes_to_decode, paths), indices), key=lambda pair: -pair[0])]


def _bytes_to_decode(path: str) -> int:
    """The bytes a file decodes to: its size, or what a compressed one says it holds (gzip's trailer, the
    zstd frame's content size), else 8 times its size. Only an order of work: nothing depends on it."""
    size = os.path.getsize(path)
    try:
        with safe_read.open_file(path, what="log file") as handle:
            if path.endswith(".gz") and size >= 18:
                handle.seek(size - 4)
                return max(size, int.from_bytes(handle.read(4), "little"))
            if path.endswith(".zst"):
                found = zstandard.frame_content_size(handle.read(18))
                return found if found > 0 else 8 * size
    except (OSError, zstandard.ZstdError):
        pass
    return size if not path.endswith(columns.COMPRESSED) else 8 * size


def _tail(block: Block, start: int) -> Block:
    """The block's steps from `start` on."""
    cut = {name: getattr(block, name)[start:] for name in ("steps", "losses", "grad_norms", "timestamps", "gpus",
                                                            "clock_codes", "clock_seconds")}
    if block.no_grad_norm is not None:
        cut["no_grad_norm"] = block.no_grad_norm[start:]
    if block.layer_norms is not None:
        cut["layer_norms"] = block.layer_norms[start:]
    if block.layers is not None:
        cut["layers"] = block.layers[start:]
    return replace(block, **cut)


def replay(stream: source.Stream, totals: Picker, decide, *, chunk_bytes: int | None = None,
           workers: int | None = None) -> dict[str, list]:
    """Decode and pick every file of `stream` on `workers` processes, `decide` (a callable taking a Block)
    every lead step in merged order, and leave in `totals` the counts, times and recorded decisions the
    merged stream's Picker would; returns each file's lines naming a MARKS event ((line number, raw line),
    for timeline.recorded_actions). Opens the stream (sets lead_rank). Raises NotExact (before or after
    deciding some steps: the caller starts again) when only the merged stream can decide these inputs."""
    stream.claim()
    heads = [source.first_block(path) for path in stream.files]
    ranks = [found[0].rank for found in heads if found]
    lead = min((rank for rank in ranks if rank is not None), default=None)
    stream.lead_rank = lead
    totals.lead = lead
    run = _Run(stream, totals, decide, chunk_bytes or columns.CHUNK_BYTES,
               columns.available_cpus() if workers is None else workers)
    run.lead_files = [i for i, found in enumerate(heads) if found and found[0].rank == lead]
    described = [(None, None) if not found else (found[0].rank, layer_names_of(found)) for found in heads]
    size = sum(os.path.getsize(path) for path in stream.files)
    count = 1 if size <= 2 * run.chunk_bytes else run.workers
    for piece in columns.pipelined(read_piece, run.tasks(described, lead), count):
        run.take(piece)
        run.lead_taken += piece.index in run.lead_files
    run.finish()
    return run.event_lines


def layer_names_of(records: list) -> tuple | None:
    return next((tuple(r.metrics.grad_norm_by_layer) for r in records
                 if r.metrics is not None and r.metrics.grad_norm_by_layer), None)


__all__ = ["NotExact", "ONE_PROCESS_ENV", "blocks_of", "fits", "layer_names_of", "one_process_asked", "replay",
           "seconds_of"]
