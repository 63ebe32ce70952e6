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
import io
import operator
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator

import msgspec
import numpy as np

from trainguard.decide import replica as decide_replica
from trainguard.decide.batch import Block
from trainguard.replay import columns, source
from trainguard.replay.picking import Picked, Picker

ONE_PROCESS_ENV = "TRAINGUARD_REPLAY_ONE_PROCESS"   # set (to 1): the merged stream, as the reference


class NotExact(Exception):
    """These inputs need the merged stream: what the parallel read cannot decide alone (the reason)."""


def fits(stream) -> bool:
    """Whether `stream` goes this way: a source.Stream of typed records that is not one plain file
    (columns.py's), unless the environment asks for the one-process path."""
    if os.environ.get(ONE_PROCESS_ENV, "") not in ("", "0") or not isinstance(stream, source.Stream):
        return False
    return not stream.full and bool(stream.files) and not columns.fits(stream)


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


# The marks of the events replay's recorded pass reads (timeline.recorded_actions), and the replica checks
# (replica.py): the workers, which hold the bytes, hand over the lines naming them, so the recorded pass
# reads no file again and the replica pass only the files that hold a check.
MARKS = (b'"run_start"', b'"alert"', b'"action"', b'"' + decide_replica.CHECK_EVENT.encode() + b'"')
_MARKED_TYPES = frozenset(mark.strip(b'"').decode() for mark in MARKS)


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


def _blocks_of(path: str, start: int, end: int | None, problems: source.Problems,
               fast) -> Iterator[tuple[list, Callable[[bool], list]]]:
    """The piece's decoded blocks, each with a function that, told whether the block names a marked event,
    gives its marked lines ((line within the piece, raw line): searched for only in a block with such an
    event or a malformed line, and only there are line numbers counted). A compressed file's are not
    searched here (`_decode` does, in the whole file: its line numbers are its own)."""
    if end is None:      # compressed: as the merged stream reads it
        for records, _ in source._typed_chunks(Path(path), problems):
            yield records, _none
        return
    with open(path, "rb") as handle:
        handle.seek(start)
        data = handle.read(end - start)
    whole = _whole(data, fast)          # the usual case: the span at once, one call
    if whole is not None:
        yield whole, functools.partial(_marked_in, data)
        return
    offset = 0
    for block in source.line_blocks(io.BytesIO(data)):
        def line_of(at: int = offset) -> int:
            return data.count(b"\n", 0, at) + 1

        found = problems.count
        records = source.decode_block(block, line_of, path, problems, fast)
        troubled = problems.count != found

        def marked(flagged: bool, block: bytes = block, line_of=line_of, troubled: bool = troubled) -> list:
            return list(source._marked(block, MARKS, line_of())) if flagged or troubled else []

        yield records, marked
        offset += len(block)


def _none(flagged: bool) -> list:
    return []


def _whole(data: bytes, fast) -> list | None:
    """Every line of the span typed in one call (the fast decoder, then the plain one), or None when some
    line is refused (then `_blocks_of` goes block by block, isolating it)."""
    for decoder in (source._typed,) if fast is None else (fast, source._typed):
        try:
            return decoder.decode_lines(data)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            pass
    return None


def _marked_in(data: bytes, flagged: bool) -> list:
    return list(source._marked(data, MARKS, 1)) if flagged else []


def _names_marked(records: list) -> bool:
    return any(record.event is not None and record.event.type in _MARKED_TYPES for record in records)


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
        for records, marked_lines in _blocks_of(path, start, end, problems, fast):
            summed = _summed(records, lead, with_gpus) if summing and records else None
            if summed is not None:      # no step, decision or GPU count of the lead rank's: counts only
                last_step = _add(picker, summed, last_step)
                times.append(np.full(len(records), summed[5]))
                ordinal += len(records)
                flagged = summed[6]
            else:
                entries, ordinal, last_step = source.entries_of(records, None, 0, ordinal, last_step)
                picked.extend(picker.take(entries))
                times.append(np.fromiter((entry[0] for entry in entries), np.float64, len(entries)))
                flagged = _names_marked(records)
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


def _summed(records: list, lead, with_gpus: bool) -> tuple | None:
    """A block's counts when nothing in it is the lead rank's (Picker.take's, without the Picker): (records,
    training records that are copies, partial ones, the last step, the first time, the latest time, whether it
    names a marked event); None when the block needs the Picker (a lead-rank step or event, a step-less
    training record, times of two kinds; with `with_gpus`, a record that says a GPU count: its place is
    wanted).

    One plain loop: most records of a run directory are other ranks' copies, and this is their cost."""
    copies = partial = 0
    last_step = None
    flagged = False
    for record in records:
        metrics, step, event = record.metrics, record.step, record.event
        if metrics is not None and (metrics.loss is not None or metrics.grad_norm is not None):
            if step is None or record.rank == lead:     # (a step-less one: numbered, as entries_of does)
                return None
            if metrics.loss is not None and metrics.grad_norm is not None:
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
    return len(records), copies, partial, last_step, _seconds(records[0].timestamp), _seconds(latest), flagged


_timestamp = operator.attrgetter("timestamp")


def _seconds(when) -> float:
    return when if when.__class__ is float else when.timestamp()


def _add(picker: Picker, summed: tuple, last_step: int) -> int:
    """Count a summed block into the piece's picker; returns the file's last step after it."""
    records, copies, partial, step, first, latest, _ = summed
    if picker.first is None:
        picker.first = picker.last = first
    picker.last = max(picker.last, latest)
    picker.records += records
    picker.duplicates += copies
    picker.partial += partial
    return last_step if step is None else step


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
            with open(self.path, "rb") as handle:
                handle.seek(self.counted_to)
                self.counted += handle.read(start - self.counted_to).count(b"\n")
            self.counted_to = start
        return self.counted


@dataclass
class _Unresolved:
    """Lead steps whose record says no GPU count, held with the latest count known before each (its place
    in merged order: time, file, ordinal), until every file is read."""

    blocks: list = field(default_factory=list)       # (block, positions in it) in decision order
    times: list = field(default_factory=list)
    files: list = field(default_factory=list)
    ordinals: list = field(default_factory=list)
    best: list = field(default_factory=list)         # [(time, file, ordinal, count)] per step, filled later
    _arrays: tuple | None = None

    def __bool__(self) -> bool:
        return bool(self.blocks)

    def arrays(self) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
        """The held steps' times and files, and the best candidates so far as arrays (made once: every
        step is held before the first file that is not the lead rank's comes in)."""
        if self._arrays is None:
            best = {"time": np.array([b[0] for b in self.best], np.float64),
                    "file": np.array([b[1] for b in self.best], np.int64),
                    "ordinal": np.array([b[2] for b in self.best], np.int64),
                    "count": np.array([b[3] for b in self.best], np.int64)}
            self._arrays = (np.array(self.times, np.float64), np.array(self.files, np.int64), best)
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
        order = self.lead_files + [i for i in range(len(self.files)) if i not in self.lead_files]
        handed = 0
        for index in order:
            if index not in self.lead_files and self.lead_tasks is None:
                self.lead_tasks = handed
            path = self.files[index].path
            layers = heads[index][1]       # no record at all: read all the same (its malformed lines)
            if path.endswith(columns.COMPRESSED):
                spans: Iterator = iter([(0, None)])
            else:
                spans = columns._spans(path, self.chunk_bytes)
            for start, end in spans:
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
        positions = np.flatnonzero(needing)
        self.unresolved.blocks.append((block, positions))
        for position in positions:
            ordinal = int(ordinals[position])
            before = np.searchsorted(gpu_ordinals, ordinal) - 1        # the file's own, earlier in the piece
            if before >= 0:
                best = (float(gpu_latest[before]), index, int(gpu_ordinals[before]), int(gpu_counts[before]))
            else:
                best = self.lead_latest or (-np.inf, -1, -1, 0)
            self.unresolved.times.append(float(latest[position]))
            self.unresolved.files.append(index)
            self.unresolved.ordinals.append(ordinal)
            self.unresolved.best.append(best)

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


def _tail(block: Block, start: int) -> Block:
    """The block's steps from `start` on."""
    cut = {name: getattr(block, name)[start:] for name in ("steps", "losses", "grad_norms", "timestamps", "gpus",
                                                            "clock_codes", "clock_seconds")}
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
    described = [(None, None) if not found else (found[0].rank, _layers(found)) for found in heads]
    size = sum(os.path.getsize(path) for path in stream.files)
    count = 1 if size <= 2 * run.chunk_bytes else run.workers
    for piece in columns.pipelined(read_piece, run.tasks(described, lead), count):
        run.take(piece)
        run.lead_taken += piece.index in run.lead_files
    run.finish()
    return run.event_lines


def _layers(records: list) -> tuple | None:
    return next((tuple(r.metrics.grad_norm_by_layer) for r in records
                 if r.metrics is not None and r.metrics.grad_norm_by_layer), None)


__all__ = ["NotExact", "ONE_PROCESS_ENV", "fits", "replay"]
