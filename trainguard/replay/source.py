"""Replay input: TLS files and run directories as one stream of records in time order.

A file is read in blocks of whole lines and each block is decoded by msgspec straight into typed
structs holding only the fields the guard and the cost meter read (the fast path: no dicts, unknown
keys skipped in C). A block the typed decoder refuses is split in halves until the refused lines are
alone; those lines go through `trainguard.tls.decode_line`, the lenient reference reader (unit strings,
``NaN`` literals, Unix or RFC 3339 times), and what that reader refuses is a malformed line: counted,
kept with its file and line, never fatal. With ``full=True`` (the alert-rule path needs every field)
every line goes through the lenient reader, which checks every field, and the stream carries the
whole record dict beside the typed struct. So without ``--rules`` a bad value in a field replay does
not read (say ``"gpu_temp_c": "hot"``) is not counted as malformed; with ``--rules`` it is.

Several files are merged by time with a heap over one open reader per file, so memory stays flat
however long the logs: at most one block per file is in memory.

Records without ``step``: a record that carries training metrics (``loss`` or ``grad_norm``) but no
step, as the seed example form, is given the step after the last one seen in the same file (1 for the
first); every other record without a step (hardware samples, events) is not a training step and keeps
``step = None``.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import os
import zlib
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Callable, Iterable, Iterator, Union

import msgspec
import zstandard

from trainguard import event_types, formats, safe_read, tls
from trainguard.exits import BadInput
from trainguard.formats import discover

BLOCK_BYTES = 1 << 16          # one block of lines per decode call: ~300 trainer records
MAX_MALFORMED_KEPT = 1000      # details kept; every malformed line is counted
# A folder without TLS logs: the logs of other tools it may hold (trainguard.formats, detected by content).
# A record whose timestamp is its step (a trainer_state.json, converted): the first line of such a file says so.
CLOCKLESS_MARK = formats.CLOCKLESS_MARK


# ----------------------------------------------------------------------------------------- records

class Metrics(msgspec.Struct, kw_only=True, gc=False):
    loss: Union[float, None] = None
    grad_norm: Union[float, None] = None
    # null: how msgspec writes a NaN nested below a section (trainguard.tls.encode checks only the top)
    grad_norm_by_layer: Union[dict[str, Union[float, None]], None] = None


class Hardware(msgspec.Struct, kw_only=True, gc=False):
    # Only counted (GPUs seen, when gpu_count is absent): each left undecoded (Raw, any JSON value, as Any
    # takes), not made into the dicts of a node log's 8 GPUs' readings.
    gpus: Union[list[msgspec.Raw], None] = None


class System(msgspec.Struct, kw_only=True, gc=False):
    gpu_count: Union[int, None] = None
    monotonic_seconds: Union[float, None] = None     # the cost meter's clock (trainguard.decide.cost)


class Event(msgspec.Struct, kw_only=True, gc=False):
    type: str
    reason: Any = None          # free-form in TLS: read as whatever the log holds
    alertname: Any = None


_AwareTime = Annotated[datetime, msgspec.Meta(tz=True)]
# Steps and ranks become int64 columns: a larger one is refused here, and named by the lenient reader
# (tls.normalise) as a malformed line, instead of overflowing numpy after the decode.
_Int64 = Annotated[int, msgspec.Meta(ge=tls.INT64_MIN, le=tls.INT64_MAX)]


class Record(msgspec.Struct, kw_only=True, gc=False):
    """The fields replay reads; unknown keys are skipped. `timestamp` is Unix seconds once streamed."""

    timestamp: Union[float, _AwareTime]
    step: Union[_Int64, None] = None
    rank: Union[_Int64, None] = None
    node: Union[str, None] = None
    metrics: Union[Metrics, None] = None
    hardware: Union[Hardware, None] = None
    system: Union[System, None] = None
    event: Union[Event, None] = None


_typed = msgspec.json.Decoder(Record)


def unix_seconds(when: float | datetime) -> float:
    """A record's `timestamp` as Unix seconds (typed records hold a float or an aware datetime)."""
    return when if when.__class__ is float else when.timestamp()


@functools.lru_cache(maxsize=8)
def layer_struct(names: tuple[str, ...]) -> type:
    """A struct for `grad_norm_by_layer` holding exactly these layer groups, each a number.

    What the trainer writes, step after step, decodes into it a third faster than into a dict (no keys
    to make). A record with other groups, or a null norm, does not fit it (unknown fields are refused,
    every field is required): its block is decoded the usual way (`decode_block`)."""
    fields = [(f"l{i}", float, msgspec.field(name=name)) for i, name in enumerate(names)]
    return msgspec.defstruct("LayerNorms", fields, forbid_unknown_fields=True, gc=False)


@functools.lru_cache(maxsize=8)
def layers_decoder(names: tuple[str, ...]) -> msgspec.json.Decoder:
    """`Record`'s decoder with `grad_norm_by_layer` as `layer_struct(names)`."""
    metrics = msgspec.defstruct("Metrics", [("loss", Union[float, None], None),
                                            ("grad_norm", Union[float, None], None),
                                            ("grad_norm_by_layer", Union[layer_struct(names), None], None)],
                                bases=(Metrics,), kw_only=True, gc=False)
    record = msgspec.defstruct("Record", [("metrics", Union[metrics, None], None)], bases=(Record,),
                               kw_only=True, gc=False)
    return msgspec.json.Decoder(record)


@dataclass(frozen=True)
class Malformed:
    file: str
    line: int
    error: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.error}"


# An entry of the merged stream: (timestamp, file index, ordinal in file, typed record, dict or None).
Entry = tuple


class Problems:
    """Malformed lines: all counted, the first MAX_MALFORMED_KEPT kept with file and line.

    "First" in the order of the inputs (`order`: a file's position among them), then of the lines, not in
    the order they were found: several files are read interleaved (the merge) or side by side (parallel.py),
    and both must list the same lines. A file `order` does not name (another tool's log, as converted)
    comes first, in the order its problems were added."""

    def __init__(self, order: dict[str, int] | None = None) -> None:
        self.count = 0
        self.order = order or {}
        self._heap: list[tuple] = []        # the kept ones, largest key on top (keys negated)
        self._sorted: list[Malformed] | None = []

    def add(self, file: str, line: int, error: str) -> None:
        self.count += 1
        position = self.order.get(file, -1)
        key = (-position, -line if position >= 0 else 0, -self.count)
        if len(self._heap) < MAX_MALFORMED_KEPT:
            heapq.heappush(self._heap, (key, Malformed(file, line, error)))
        elif key > self._heap[0][0]:
            heapq.heapreplace(self._heap, (key, Malformed(file, line, error)))
        else:
            return
        self._sorted = None

    @property
    def kept(self) -> list[Malformed]:
        if self._sorted is None:
            self._sorted = [malformed for _, malformed in sorted(self._heap, reverse=True)]
        return self._sorted


# The marks of the events replay's recorded pass reads (timeline.recorded_actions), and the replica checks
# (replica.py): the readers that hold the bytes (parallel.py's workers, columns.py's) hand over the lines
# naming them, so the recorded pass reads no file again and the replica pass only the files holding a check.
MARKS = tuple(b'"%s"' % kind.encode() for kind in (event_types.RUN_START, event_types.ALERT, event_types.ACTION,
                                                    event_types.REPLICA_CHECK))
MARKED_TYPES = frozenset(mark.strip(b'"').decode() for mark in MARKS)


def names_marked(records: list) -> bool:
    """Whether a record among `records` is an event of a MARKS type (its block's marked lines are wanted)."""
    return any(record.event is not None and record.event.type in MARKED_TYPES for record in records)


# ------------------------------------------------------------------------------------------- inputs

class InputError(BadInput):
    pass


def expand(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """Files as given; a directory stands for its logs as `trainguard.formats.discover.run_logs` finds them
    (the one discovery `report` and `diagnose` use too)."""
    files: list[Path] = []
    for given in paths:
        path = Path(given)
        if path.is_dir():
            found = [log.path for log in discover.run_logs(path)]
            if not found:
                raise InputError(f"{path}: no TLS logs (*.jsonl, *.jsonl.gz, *.jsonl.zst) or other tools' logs "
                                 f"in {discover.logs_folder(path)}")
            files.extend(found)
        elif path.is_file():
            files.append(path)
        elif path.exists():
            raise InputError(f"{path}: not a regular file (a device, FIFO or socket): replay reads log files")
        else:
            raise InputError(f"{path}: no such file or directory")
    return files


# ------------------------------------------------------------------------------------- one file

def line_blocks(handle) -> Iterator[bytes]:
    """Whole lines, about BLOCK_BYTES at a time; the last block may end without a newline.

    A line longer than a block is gathered as a list of pieces and joined once, so a 50 MB line costs
    linear time (adding each piece to the last would copy it again every time: quadratic); a line longer
    than safe_read.MAX_LINE_BYTES is a RunFileError before more of it is held (the callers read the file
    again line by line, which names the line)."""
    pending: list[bytes] = []
    held = 0
    while True:
        chunk = handle.read(BLOCK_BYTES)
        if not chunk:
            if pending:
                yield b"".join(pending)
            return
        cut = chunk.rfind(b"\n") + 1
        if cut == 0:
            pending.append(chunk)
            held += len(chunk)
            if held > safe_read.MAX_LINE_BYTES:
                raise safe_read.RunFileError(getattr(handle, "name", "<log>"),
                                             f"a line longer than {safe_read.MAX_LINE_BYTES} bytes")
            continue
        head, rest = (chunk[:cut], chunk[cut:]) if cut < len(chunk) else (chunk, b"")
        yield b"".join((*pending, head)) if pending else head
        pending = [rest] if rest else []
        held = len(rest)


class _HardwareOfDict(Hardware, kw_only=True, gc=False):
    gpus: Union[list[Any], None] = None         # a dict's readings cannot be made Raw: kept as they are


_RecordOfDict = msgspec.defstruct("Record", [("hardware", Union[_HardwareOfDict, None], None)], bases=(Record,),
                                  kw_only=True, gc=False)


def _to_typed(record: dict) -> Record:
    """The lenient reader's dict as the typed record (raises msgspec.ValidationError naming the field): a
    Record whose `hardware.gpus` is the list itself (what Raw stands for when decoding bytes)."""
    return msgspec.convert(record, _RecordOfDict)


def _refused(line: tls.Line, problems: Problems) -> None:
    error = line.error
    problems.add(line.source, line.lineno, error.message if error.field is None else f"{error.field}: {error.message}")


def _lenient(raw: bytes, source: str, lineno: int, problems: Problems) -> Record | None:
    line = tls.decode_line(raw, source, lineno)
    if line.error is not None:
        _refused(line, problems)
        return None
    try:
        return _to_typed(line.record)
    except msgspec.ValidationError as exc:
        problems.add(source, lineno, str(exc))
        return None


def decode_block(block: bytes, first_line: int | Callable[[], int], source: str, problems: Problems,
                 fast: msgspec.json.Decoder | None = None) -> list[Record]:
    """Typed decode of many lines at once (first by `fast`, if given: see `layers_decoder`); refused lines
    are isolated by halving the block. `first_line` may be a function that counts it: called only for a
    block with a refused line (counting a file's lines costs as much as a quarter of decoding it)."""
    for decoder in (_typed,) if fast is None else (fast, _typed):
        try:
            return decoder.decode_lines(block)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            pass          # nested past the recursion limit too: the lenient reader names the line
    if callable(first_line):
        first_line = first_line()
    lines = block.count(b"\n") + (0 if block.endswith(b"\n") else 1)
    if lines <= 1:
        record = _lenient(block, source, first_line, problems) if block.strip() else None
        return [] if record is None else [record]
    middle = 0
    for _ in range(lines // 2):
        middle = block.index(b"\n", middle) + 1
    return (decode_block(block[:middle], first_line, source, problems)
            + decode_block(block[middle:], first_line + lines // 2, source, problems))


# A compressed log cut short (copied while it was written) ends the file, as one malformed line, in the
# words of tls.iter_lines (the reader of the full path, which the typed path hands over to).
_UNREADABLE = (EOFError, OSError, zlib.error, zstandard.ZstdError)
UNREADABLE = _UNREADABLE      # for the other passes over the same files (replica.py)


def _typed_chunks(path: Path, problems: Problems) -> Iterator[tuple[list[Record], None]]:
    source = str(path)
    lineno = 1
    with tls.open_log(path) as handle:
        try:
            for block in line_blocks(handle):
                yield decode_block(block, lineno, source, problems), None
                lineno += block.count(b"\n")
        except _UNREADABLE:
            # A compressed log cut short: the block being read is lost with the exception, so the rest is
            # read again line by line (tls.iter_lines keeps every line before the cut, then one error).
            yield from _rest_line_by_line(path, lineno, problems)


def _rest_line_by_line(path: Path, first: int, problems: Problems) -> Iterator[tuple[list[Record], None]]:
    yield [record for record, _ in _typed_lines(path, problems, first)], None


def _typed_lines(path: Path, problems: Problems, first: int = 1) -> Iterator[tuple[Record, dict]]:
    """Each line from `first` on through the lenient reader: (typed record, whole dict); refusals counted."""
    for line in tls.iter_lines(path):       # a corrupt or cut-off .gz/.zst ends in one error Line
        if line.lineno < first:
            continue
        if line.error is not None:
            _refused(line, problems)
            continue
        try:
            yield _to_typed(line.record), line.record
        except msgspec.ValidationError as exc:
            problems.add(line.source, line.lineno, str(exc))


FULL_CHUNK = 256
MERGED_BLOCK = 1024        # entries per block once several files are merged


def _full_chunks(path: Path, problems: Problems) -> Iterator[tuple[list[Record], list[dict]]]:
    """Every line through the lenient reader; the typed record and the whole dict side by side."""
    records: list[Record] = []
    raws: list[dict] = []
    for record, raw in _typed_lines(path, problems):
        records.append(record)
        raws.append(raw)
        if len(records) == FULL_CHUNK:
            yield records, raws
            records, raws = [], []
    if records:
        yield records, raws


def _entry_blocks(path: Path, index: int, problems: Problems, full: bool) -> Iterator[list[Entry]]:
    """One file's records as lists of stream entries (a list per block keeps the per-record Python work
    to one loop here): timestamps as Unix seconds, step-less training records numbered."""
    last_step = ordinal = 0
    for records, raws in (_full_chunks if full else _typed_chunks)(path, problems):
        entries, ordinal, last_step = entries_of(records, raws, index, ordinal, last_step)
        yield entries


def entries_of(records: list[Record], raws: list[dict] | None, index: int, ordinal: int,
               last_step: int) -> tuple[list[Entry], int, int]:
    """Decoded records as stream entries, numbered on from `ordinal` and `last_step` (the step of the file's
    last record that had one); returns the entries and both numbers where they ended."""
    entries = []
    append = entries.append
    numbers = itertools.count(ordinal + 1)      # `ordinal` then carries on: its last value is returned
    for ordinal, record, raw in zip(numbers, records, raws or itertools.repeat(None)):
        when = record.timestamp
        if when.__class__ is not float:
            when = record.timestamp = when.timestamp()
        step = record.step
        if step is None:
            metrics = record.metrics
            if metrics is not None and (metrics.loss is not None or metrics.grad_norm is not None):
                step = record.step = last_step + 1
                last_step = step
        else:
            last_step = step
        append((when, index, ordinal, record, raw))
    return entries, ordinal, last_step


def head(path: str | os.PathLike) -> tuple[int | None, tuple[str, ...] | None]:
    """A file's lead rank (its first record's: `Stream.lead_rank` of that file alone) and the layer
    groups of the first training record with any in the same block (None: no such record)."""
    found = first_block(path)
    if not found:
        return None, None
    layers = next((tuple(r.metrics.grad_norm_by_layer) for r in found
                   if r.metrics is not None and r.metrics.grad_norm_by_layer), None)
    return found[0].rank, layers


def first_block(path: str | os.PathLike) -> list[Record]:
    """The records of a file's first block that holds any (plain or compressed; [] for none): the block
    `Stream.blocks` takes a file's rank from."""
    try:
        with tls.open_log(Path(path)) as handle:
            for block in line_blocks(handle):
                records = decode_block(block, 1, str(path), Problems())
                if records:
                    return records
    except _UNREADABLE:      # a compressed log cut short inside the first block: line by line, as read
        return [record for record, _ in itertools.islice(_typed_lines(Path(path), Problems()), 1)]
    return []


def head_names(path: str | os.PathLike, mark: bytes, lines: int) -> bool:
    """Whether one of the first `lines` lines of a TLS file (plain or compressed) holds `mark`: a byte check
    that passes over the files a head-of-log reader (replay.dynamics) would find nothing in."""
    try:
        with tls.open_log(Path(path)) as handle:
            head = b""          # read a block at a time (not a line: a call per line costs more than the read)
            while head.count(b"\n") < lines:
                block = handle.read(BLOCK_BYTES)
                if not block or len(head) > safe_read.MAX_LINE_BYTES:
                    break       # no more, or a line past the bound: the file's own pass refuses it
                head += block
    except _UNREADABLE:
        return True      # unreadable: the reader says so itself (True only sends the file to it)
    return any(mark in line for line in head.split(b"\n", lines)[:lines])


SCAN_BYTES = 8 << 20


def lines_naming(path: str | os.PathLike, marks: tuple[bytes, ...]) -> Iterator[tuple[int, bytes]]:
    """(line number, raw line) of each line of a TLS file (plain or compressed) holding one of `marks`.

    A byte search over blocks of whole lines (no loop over the lines in Python): a long log holds a few
    such lines, and finding them costs about a memchr over the file. A compressed log cut short ends the
    search (the file's own pass reports it)."""
    number = 1
    try:
        with tls.open_log(Path(path)) as handle:
            pending = b""
            while True:
                data = handle.read(SCAN_BYTES)
                block = pending + data
                cut = len(block) if not data else block.rfind(b"\n") + 1
                if cut == 0 and data:
                    if len(block) > safe_read.MAX_LINE_BYTES:
                        return      # a line past the bound: the file's own pass refuses it, naming it
                    pending = block
                    continue
                yield from _marked(block[:cut], marks, number)
                number += block.count(b"\n", 0, cut)
                pending = block[cut:]
                if not data:
                    return
    except _UNREADABLE:
        return


def _marked(block: bytes, marks: tuple[bytes, ...], first: int) -> Iterator[tuple[int, bytes]]:
    starts = sorted({block.rfind(b"\n", 0, at) + 1 for mark in marks for at in _all(block, mark)})
    counted, number = 0, first
    for start in starts:
        number += block.count(b"\n", counted, start)
        counted = start
        end = block.find(b"\n", start)
        yield number, block[start:] if end < 0 else block[start:end + 1]


def _all(block: bytes, mark: bytes) -> Iterator[int]:
    at = block.find(mark)
    while at >= 0:
        yield at
        at = block.find(mark, at + len(mark))


def _says_no_clock(path: Path) -> bool:
    """Whether a TLS file's first line carries CLOCKLESS_MARK (formats.says_no_clock)."""
    return formats.says_no_clock(path)


# ------------------------------------------------------------------------------ other tools' logs

@dataclass(frozen=True)
class Converted:
    """Another tool's log as a TLS file: where, how many records, and what its reader said."""
    target: Path
    written: int
    unmapped: tuple                 # formats.Unmapped: each a malformed entry of the original file
    notes: tuple[str, ...]          # passed over on purpose (formats.Notes.lines)
    clock: str                      # formats.Notes.clock: "wall", "elapsed" or NO_CLOCK


class Conversions:
    """Other tools' logs converted into TLS files in one scratch folder, each once (by its path), kept as
    long as this object lives: a replay of several runs reads each file's losses from its conversion to
    tell the runs apart, then replays the same conversion."""

    def __init__(self) -> None:
        self._scratch = None
        self._done: dict[Path, Converted] = {}

    def of(self, path: Path, kind: str | None = None) -> Converted:
        path = Path(path)
        if path not in self._done:
            if self._scratch is None:
                import tempfile
                self._scratch = tempfile.TemporaryDirectory(prefix="trainguard-replay-")
            target = Path(self._scratch.name) / f"{len(self._done)}-{path.name}.jsonl"
            notes = formats.Notes()
            with open(target, "wb") as out:
                written, unmapped = formats.write_tls(path, out, notes=notes)
            self._done[path] = Converted(target, written, tuple(unmapped), tuple(notes.lines(str(path))),
                                         notes.clock)
        return self._done[path]

    def training_losses(self, path: Path) -> dict[int, float]:
        """{step: loss} of a log's training records, read from its conversion (the typed reader: a record
        it refuses is the replay's to name, not a loss here)."""
        losses: dict[int, float] = {}
        for records, _ in _typed_chunks(self.of(path).target, Problems()):
            for record in records:
                if record.step is not None and record.metrics is not None and record.metrics.loss is not None:
                    losses.setdefault(record.step, record.metrics.loss)
        return losses


# ---------------------------------------------------------------------------------------- stream

class Stream:
    """Every record of every input, merged by time (ties: the order the files were given, then file order).

    Iterate once. `lead_rank` is the lowest rank found at the head of the inputs (None when the logs
    carry no rank): the engine follows that rank's steps so several ranks' copies count once.
    """

    def __init__(self, paths: Iterable[str | os.PathLike], *, full: bool = False,
                 conversions: "Conversions | None" = None):
        self.problems = Problems()
        # Other tools' logs as TLS: this stream's own (its scratch folder lives as long as it), or those of a
        # replay of several runs, which converted each file once to tell the runs apart (replay.sections).
        self.conversions = conversions if conversions is not None else Conversions()
        self.notes: list[str] = []              # what other tools' logs held that was passed over on purpose
        self.without_clock: list[Path] = []     # inputs whose records' times are steps (formats.NO_CLOCK)
        self.sources = expand(paths)             # the inputs as found (what a user names); `files` is what is read
        self.files = self._as_tls(self.sources)
        self.problems.order = {str(path): index for index, path in enumerate(self.files)}
        self.full = full
        self.lead_rank: int | None = None
        self._opened = False
        self._before_reading = (0, [])

    def __iter__(self) -> Iterator[Entry]:
        return itertools.chain.from_iterable(self.blocks())

    def _as_tls(self, files: list[Path]) -> list[Path]:
        """The one place other tools' logs enter replay: each file that is not TLS by its content
        (trainguard.formats) is converted into a TLS file in a scratch folder (`Conversions`), and read from
        there on; what could not be mapped is a malformed entry of the original file."""
        converted = []
        for path in files:
            kind = formats.detect(path)
            if kind == formats.TLS:
                if _says_no_clock(path):      # what `trainguard convert` wrote of one
                    self.without_clock.append(path)
                converted.append(path)
                continue
            done = self.conversions.of(path, kind)
            for problem in done.unmapped:
                self.problems.add(problem.file, problem.position, f"{problem.where}: {problem.error}")
            self.notes += done.notes
            if not done.written:
                self.notes.append(f"{path}: read as a {kind} log, and no record in it")
            if done.clock == formats.NO_CLOCK:
                self.without_clock.append(path)
            converted.append(done.target)
        return converted

    def claim(self) -> None:
        """Mark the stream as read: it is read once, here or by the columnar reader (columns.read)."""
        if self._opened:
            raise RuntimeError("a replay stream is read once")
        self._opened = True
        self._before_reading = (self.problems.count, list(self.problems._heap))

    def reread(self) -> None:
        """Read again from the start (parallel.py hands a run over to the merged stream): the problems found
        by reading are forgotten, those of converting other tools' logs kept."""
        self.problems.count, self.problems._heap = self._before_reading[0], list(self._before_reading[1])
        self.problems._sorted = None
        self.lead_rank = None
        self._opened = False

    def blocks(self) -> Iterator[list[Entry]]:
        """The same entries a list at a time (one file: its decoded blocks as they are, no merge cost)."""
        self.claim()
        heads = []
        for index, path in enumerate(self.files):
            reader = _entry_blocks(path, index, self.problems, self.full)
            first = next((block for block in reader if block), None)
            if first is not None:
                heads.append(itertools.chain((first,), reader))
                rank = first[0][3].rank
                if rank is not None and (self.lead_rank is None or rank < self.lead_rank):
                    self.lead_rank = rank
        if len(heads) == 1:
            return heads[0]
        merged = heapq.merge(*(itertools.chain.from_iterable(head) for head in heads))
        return iter(lambda: list(itertools.islice(merged, MERGED_BLOCK)), [])

    @property
    def malformed(self) -> int:
        return self.problems.count
