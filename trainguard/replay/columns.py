"""Replay's fast path: one plain TLS file, decoded on every CPU, its training steps as columns.

Decoding JSON is most of a replay's cost (bench/bench_replay.py). A plain file can be cut at line ends
into chunks that worker processes decode and pick side by side (`_read_chunk`: the stream's own decoder
and the engine's own picking rules, picking.py), each handing back its steps as arrays that the guard and
the meter decide a chunk at a time (`trainguard.decide.batch`, as `block_of` makes them). The main process
only decides and stitches; memory stays flat, with at most two chunks per worker in flight.

A chunk read apart cannot know three things, so it leaves them open and `read` fills them in file order:
the number of its first line (its malformed lines are counted from 1), the step a step-less training
record follows (the seed example form: such steps are numbered from UNKNOWN_STEP), and the GPU count
before its first record that says one (0).

Small files are read the same way in this process: no workers to start for a log of a few chunks.
"""

from __future__ import annotations

import gc
import io
import multiprocessing
import os
from collections import deque
from dataclasses import dataclass
from itertools import chain
from typing import TYPE_CHECKING, Iterator

import msgspec
import numpy as np

from trainguard import safe_read
from trainguard.decide.batch import Block
from trainguard.replay import source
from trainguard.replay.picking import Action, Picked, Picker

if TYPE_CHECKING:
    from concurrent.futures import Future

CHUNK_BYTES = 8 << 20       # ~12,000 trainer records: enough to pay for a hand-off, small enough to stay flat
IN_FLIGHT = 2               # chunks per worker decoded ahead of the decider
UNKNOWN_STEP = -(1 << 62)   # step-less training records before a chunk's first step: numbered from here
COMPRESSED = (".gz", ".zst")


@dataclass
class Chunk:
    """What a worker hands back: the steps and everything the stream's totals need."""

    steps: Block
    picker: Picker                  # records, first and last time, counts, recorded events of the chunk
    problems: source.Problems       # malformed lines, numbered from the chunk's first line
    lines: int
    last_step: int                  # numbering state where the chunk ended (maybe from UNKNOWN_STEP)
    error: str | None = None        # the file could not be read here: it ends before this chunk
    marked: list | None = None      # (line within the chunk, raw line) of the lines naming a source.MARKS event


def fits(stream) -> bool:
    """Whether `stream` can go the columnar way: a source.Stream of one plain file, typed records only."""
    if not isinstance(stream, source.Stream) or stream.full or len(stream.files) != 1:
        return False
    return not str(stream.files[0]).endswith(COMPRESSED)


def read(stream: source.Stream, totals: Picker, *, chunk_bytes: int | None = None,
         workers: int | None = None, event_lines: dict[str, list] | None = None) -> Iterator[Block]:
    """The training steps of `stream`'s one file, a chunk at a time in file order; its malformed lines go
    to `stream.problems`, each chunk's counts into `totals` (`Picker.absorb`), and the lines naming a
    source.MARKS event ((line number, raw line)) into `event_lines[file]` when given, so the passes after
    the replay (recorded actions, replica checks) need not read the file again. Opens the stream (it is
    read once), setting lead_rank."""
    stream.claim()
    path = str(stream.files[0])
    lead, layer_names = source.head(path)
    stream.lead_rank = lead
    line_base, step_base, gpus = 0, 0, 0
    chunk_bytes = chunk_bytes or CHUNK_BYTES
    marked = None if event_lines is None else event_lines.setdefault(path, [])
    for chunk in _chunks(path, (lead, layer_names), chunk_bytes, available_cpus() if workers is None else workers):
        _count_problems(stream.problems, chunk.problems, path, line_base)
        if chunk.error is not None:
            stream.problems.add(path, line_base + 1, f"unreadable after line {line_base} ({chunk.error})")
            return
        steps = chunk.steps
        step_base = _number(chunk, step_base)
        gpus = _carry_gpus(steps.gpus, chunk.picker.gpus, gpus)
        totals.absorb(chunk.picker)
        if marked is not None and chunk.marked:
            marked.extend((line_base + number, raw) for number, raw in chunk.marked)
        line_base += chunk.lines
        yield steps


def _count_problems(problems: source.Problems, found: source.Problems, path: str, line_base: int) -> None:
    for malformed in found.kept:
        problems.add(path, line_base + malformed.line, malformed.error)
    problems.count += found.count - len(found.kept)


def _number(chunk: Chunk, step_base: int) -> int:
    """Steps numbered from UNKNOWN_STEP get the step the file had reached; returns where it ends up."""
    def known(step: int) -> int:
        return step_base + (step - UNKNOWN_STEP) if step < UNKNOWN_STEP // 2 else step

    steps = chunk.steps.steps
    unknown = steps < UNKNOWN_STEP // 2
    if unknown.any():
        steps[unknown] += step_base - UNKNOWN_STEP
    recorded = chunk.picker.recorded
    for i, action in enumerate(recorded):
        if action.step is not None and action.step < UNKNOWN_STEP // 2:
            recorded[i] = Action(action.action, known(action.step), action.timestamp, action.reason, action.source)
    return known(chunk.last_step)


def _carry_gpus(gpus: np.ndarray, at_end: int | None, carried: int) -> int:
    """Steps before the chunk's first GPU count take the count the file had reached."""
    if carried and len(gpus) and gpus[0] == 0:
        seen = np.flatnonzero(gpus)
        gpus[:seen[0] if len(seen) else len(gpus)] = carried
    return at_end or carried


# --------------------------------------------------------------------------------------- the chunks

def available_cpus() -> int:
    """CPUs this process may run on: one worker each."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _spans(path: str, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    """(start, end) byte offsets of chunks of about chunk_bytes, each cut after a newline."""
    start = 0
    with safe_read.open_file(path, what="log file") as handle:
        size = os.fstat(handle.fileno()).st_size
        while start < size:
            end = start + chunk_bytes
            if end < size:
                handle.seek(end)
                cut_at = end
                while True:             # on to the end of the line the cut falls in
                    tail = handle.read(1 << 16)
                    cut = tail.find(b"\n")
                    if cut >= 0 or not tail:
                        end += cut + 1 if cut >= 0 else len(tail)
                        break
                    end += len(tail)
                    if end - cut_at > safe_read.MAX_LINE_BYTES:     # a chunk is bounded by the line bound
                        raise safe_read.line_too_long(path, None)
            end = min(end, size)
            yield start, end
            start = end


def _chunks(path: str, head: tuple, chunk_bytes: int, workers: int) -> Iterator[Chunk]:
    in_process = os.path.getsize(path) <= 2 * chunk_bytes
    tasks = ((path, start, end, head) for start, end in _spans(path, chunk_bytes))
    return pipelined(_read_chunk, tasks, 1 if in_process else workers)


def pipelined(work, tasks: Iterator[tuple], workers: int) -> Iterator:
    """work(*task) for each task, in order, on `workers` forked processes (in this one when fewer than two
    or where fork is missing); at most IN_FLIGHT per worker ahead of the caller, so memory stays flat.
    `tasks` is advanced only as a task is handed over: it may depend on what the caller has seen.

    A task whose worker died (the pool broken, say by the OOM killer) is done here instead: the replay
    goes on, slower, and loses nothing."""
    if workers < 2 or "fork" not in multiprocessing.get_all_start_methods():
        for task in tasks:
            yield work(*task)
        return
    # The pool's machinery (~25 ms of imports) only where a pool is made: a small log is read in this process.
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    # fork: the workers need nothing but this module, already imported, and start in milliseconds.
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        pending: deque[tuple[tuple, Future | None]] = deque()
        try:
            for task in tasks:
                try:
                    pending.append((task, pool.submit(work, *task)))
                except BrokenProcessPool:
                    pending.append((task, None))
                if len(pending) >= IN_FLIGHT * workers:
                    yield _collect(work, *pending.popleft())
            while pending:
                yield _collect(work, *pending.popleft())
        finally:
            for _, future in pending:
                if future is not None:
                    future.cancel()


def _collect(work, task: tuple, future: Future | None):
    from concurrent.futures.process import BrokenProcessPool   # imported by pipelined, which made the pool

    if future is not None:
        try:
            return future.result()
        except BrokenProcessPool:
            pass
    return work(*task)


def _read_chunk(path: str, start: int, end: int, head: tuple) -> Chunk:
    """Decode and pick the lines of path[start:end] (in a worker process). `head`: the file's lead rank and
    the layer groups of its first training records (`source.head`), which the decoder is made for.

    The collector is off meanwhile: a chunk makes a few hundred thousand short-lived objects and no
    cycles, and generation scans over them cost a quarter of the time."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _decode_and_pick(path, start, end, *head)
    finally:
        if enabled:
            gc.enable()


def _decode_and_pick(path: str, start: int, end: int, lead, layer_names: tuple | None) -> Chunk:
    problems, picker, picked = source.Problems(), Picker(lead), Picked()
    fast = source.layers_decoder(layer_names) if layer_names else None
    last_step = 0 if start == 0 else UNKNOWN_STEP
    lines = 0
    marked: list = []
    try:
        with safe_read.open_file(path, what="log file") as handle:
            handle.seek(start)
            data = handle.read(end - start)
    except OSError as exc:
        return Chunk(block_of(picked), picker, problems, 0, last_step, f"{type(exc).__name__}: {exc}")
    for block in source.line_blocks(io.BytesIO(data)):
        found = problems.count
        records = source.decode_block(block, lines + 1, path, problems, fast)
        entries, _, last_step = source.entries_of(records, None, 0, 0, last_step)
        picked.extend(picker.take(entries))
        if problems.count != found or source.names_marked(records):   # searched only where one may be
            marked += source._marked(block, source.MARKS, lines + 1)
        lines += block.count(b"\n")
    return Chunk(block_of(picked, layer_names), picker, problems, lines, last_step, marked=marked)


def block_of(picked: Picked, layer_names: tuple | None = None) -> Block:
    """Picked steps as the columns the guard and the meter decide (`trainguard.decide.batch`); the layer
    norms as one array when every step carries the file's (or the first step's) layer groups."""
    codes, seconds, nodes = _clock_columns(picked.clock_nodes, picked.clock_seconds)
    gpus = picked.gpus
    grad_norms = picked.grad_norms
    absent = None in grad_norms
    out = Block(_array(picked.steps, np.int64), _array(picked.losses),
                _array([np.nan if norm is None else norm for norm in grad_norms] if absent else grad_norms),
                _array(picked.timestamps),
                _array([0 if count is None else count for count in gpus] if None in gpus else gpus, np.int64),
                codes, seconds, nodes)
    if absent:
        out.no_grad_norm = np.fromiter((norm is None for norm in grad_norms), bool, len(grad_norms))
    layers = picked.any_layers()
    if layers is not None:
        out.layer_names, out.layer_norms = _layer_matrix(layers, layer_names)
        if out.layer_names is None:
            out.layers = layers
    return out


def _array(values: list, dtype=np.float64) -> np.ndarray:
    return np.fromiter(values, dtype, len(values))


def _clock_columns(nodes: list, seconds: list) -> tuple[np.ndarray, np.ndarray, list]:
    """Codes into a table of nodes (-1: no clock) and the seconds (NaN: none); one node is the usual case."""
    n = len(seconds)
    at = _array([np.nan if at is None else at for at in seconds] if None in seconds else seconds)
    if n and nodes.count(nodes[0]) == n:
        codes = np.zeros(n, np.int64)
        table = [nodes[0]]
    else:
        index: dict = {}
        codes = _array([index.setdefault(node, len(index)) for node in nodes], np.int64)
        table = list(index)
    codes[np.isnan(at)] = -1
    return codes, at, table


def _layer_matrix(layers: list, expected: tuple | None) -> tuple[tuple | None, np.ndarray | None]:
    """(names, norms) when every step carries the same layer groups in the same order, else (None, None)
    and `layers` made dicts throughout (decided step by step).

    Flat lists, compared and converted in C: a loop over the steps costs more than the decoding did."""
    n = len(layers)
    if expected:
        struct = source.layer_struct(expected)
        kinds = set(map(type, layers))
        if kinds == {struct}:           # every step decoded into the file's layer struct
            flat = chain.from_iterable(map(msgspec.structs.astuple, layers))
            return expected, np.fromiter(flat, np.float64, n * len(expected)).reshape(n, len(expected))
        if struct in kinds:             # some blocks were not: all as dicts, in the groups' order
            layers[:] = [dict(zip(expected, msgspec.structs.astuple(norms))) if type(norms) is struct else norms
                         for norms in layers]
    names = list(layers[0] or ())
    if not names or None in layers or list(chain.from_iterable(layers)) != names * n:
        return None, None
    norms = _array(list(chain.from_iterable(map(dict.values, layers))))
    return tuple(names), norms.reshape(n, len(names))
