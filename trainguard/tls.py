"""The Training Log Standard (TLS) v1: one JSON object per line, shared by the trainer, the agent and replay.

Writing is strict and fast (msgspec, one `os.write` per record so a reader never sees half a line from
a live writer). Reading is lenient where real logs are: unit strings such as ``"78%"``, ``"18GB/s"`` or
``"512MiB"`` are normalised, RFC 3339 or Unix timestamps are both accepted, and the ``NaN``/``Infinity``
literals that Python's ``json`` writes are read as floats. A line that cannot be read raises
:class:`TLSError` naming the file, the line and the field; nothing is dropped silently.

Decoded records are plain dicts: ``timestamp`` becomes Unix seconds (float), numeric fields become
numbers, unknown keys are kept as they are.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any, Callable, Iterable, Iterator

import msgspec

from trainguard.exits import BadInput

SCHEMA_ID = "tls/1"
SCHEMA_PATH = Path(__file__).with_name("schema") / "tls-v1.schema.json"

SECTIONS = ("metrics", "hardware", "system", "event")

# Fields whose values are numbers; strings with units are normalised for these only, so a free-text
# field that happens to look like "5%" is never rewritten.
NUMERIC_FIELDS: dict[str, frozenset[str]] = {
    "metrics": frozenset({
        "loss", "grad_norm", "learning_rate", "tokens_per_second", "samples_per_second",
        "step_time_seconds", "data_wait_seconds", "forward_backward_seconds", "optimizer_seconds",
        "comm_seconds", "mfu", "tokens_trained", "tokens_loaded", "val_loss",
        "mem_allocated_bytes", "mem_reserved_bytes", "mem_peak_bytes", "rss_bytes",
    }),
    "hardware": frozenset({
        "gpu_util", "mem_util", "gpu_temp_c", "gpu_power_w", "mem_allocated_bytes", "mem_reserved_bytes",
        "mem_peak_bytes", "disk_await_ms", "mem_used_bytes", "mem_total_bytes", "rss_bytes",
        "cpu_percent", "sm_clock_mhz", "mem_clock_mhz", "power_limit_w",
    }),
    "system": frozenset({"data_throughput", "gpu_count", "world_size", "cost_usd", "checkpoint_age_seconds"}),
}
INT_FIELDS = frozenset({"tokens_trained", "tokens_loaded", "gpu_count", "world_size"})

_BYTE_UNITS = {
    "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "pb": 1e15,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "pib": 2**50,
}
_TIME_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "min": 60.0, "h": 3600.0}


@functools.cache
def _quantity() -> re.Pattern[str]:
    """Compiled at the first quantity written as text (a command that reads none does not compile it), then
    kept: the lenient decoder calls this per field."""
    return re.compile(r"^\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*([A-Za-zµ%]*)(/s)?\s*$")


class TLSError(BadInput):
    """A record that cannot be read. ``str()`` names source, line and field when known."""

    def __init__(self, message: str, source: str | None = None, line: int | None = None,
                 field: str | None = None):
        self.message, self.source, self.line, self.field = message, source, line, field
        where = ":".join(str(p) for p in (source, line) if p is not None)
        what = f"{field}: {message}" if field else message
        super().__init__(f"{where}: {what}" if where else what)

    def at(self, source: str | None, line: int | None) -> "TLSError":
        return TLSError(self.message, source, line, self.field)


# ---------------------------------------------------------------------------------------------- values

def parse_quantity(value: Any, field: str) -> float:
    """A number, or a string with a unit, in the field's base unit (bytes, seconds, percent, ms)."""
    if isinstance(value, bool):
        raise TLSError(f"expected a number, got {value!r}", field=field)
    if isinstance(value, (int, float)):
        return value
    if not isinstance(value, str):
        raise TLSError(f"expected a number, got {value!r}", field=field)
    lowered = value.strip().lower()
    if lowered in ("nan", "inf", "+inf", "-inf", "infinity", "+infinity", "-infinity"):
        return float(lowered.replace("infinity", "inf"))
    match = _quantity().match(value)
    if not match:
        raise TLSError(f"expected a number or a number with a unit, got {value!r}", field=field)
    number, unit, per_second = float(match.group(1)), match.group(2), match.group(3)
    key = unit.lower()
    if unit in ("", "%"):
        return number
    if key in _BYTE_UNITS:
        return number * _BYTE_UNITS[key]
    if unit in _TIME_UNITS and not per_second:
        seconds = number * _TIME_UNITS[unit]
        return seconds * 1e3 if field.endswith("_ms") else seconds
    if key in ("w", "c", "mhz", "tok", "tokens"):
        return number
    raise TLSError(f"unknown unit {unit!r} in {value!r}", field=field)


# The times RFC 3339 can write (years 1 to 9999): a number outside them is not a time any reader can format.
_EARLIEST, _LATEST = -62135596800.0, 253402300799.999999


def parse_timestamp(value: Any) -> float:
    """RFC 3339 string (fractions and offsets allowed) or Unix seconds, as Unix seconds."""
    if isinstance(value, bool):
        raise TLSError(f"expected RFC 3339 or Unix seconds, got {value!r}", field="timestamp")
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or not _EARLIEST <= value <= _LATEST:
            raise TLSError(f"not a time between the years 1 and 9999: {value!r}", field="timestamp")
        return float(value)
    if isinstance(value, str):
        text = value.strip()
        try:
            number = float(text)
        except ValueError:
            pass
        else:
            return parse_timestamp(number)   # "nan" and "1e400" are no more a time as strings than as numbers
        try:
            parsed = datetime.fromisoformat(text[:-1] + "+00:00" if text[-1:] in "Zz" else text)
        except ValueError:
            raise TLSError(f"not an RFC 3339 time: {value!r}", field="timestamp") from None
        if parsed.tzinfo is None:  # RFC 3339 requires an offset; a bare time is read as UTC.
            parsed = parsed.replace(tzinfo=timezone.utc)
        return parsed.timestamp()
    raise TLSError(f"expected RFC 3339 or Unix seconds, got {value!r}", field="timestamp")


_second_prefix: tuple[int, str] = (-1, "")   # the last whole second formatted (one per second, not per call)


def format_timestamp(seconds: float) -> str:
    """Unix seconds as RFC 3339 UTC with microseconds: ``2024-03-15T14:22:18.250000Z``."""
    global _second_prefix
    whole = int(seconds)
    micros = int(round((seconds - whole) * 1e6))
    if micros == 1_000_000:
        whole, micros = whole + 1, 0
    cached_whole, prefix = _second_prefix
    if cached_whole != whole:
        prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole))
        _second_prefix = (whole, prefix)
    return f"{prefix}.{micros:06d}Z"


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def _normalise_section(name: str, section: Any) -> dict[str, Any]:
    if not isinstance(section, dict):
        raise TLSError(f"expected an object, got {type(section).__name__}", field=name)
    numeric = NUMERIC_FIELDS.get(name)
    if not numeric:
        return section
    out = dict(section)
    for key, value in section.items():
        if key in numeric and value is not None:
            number = parse_quantity(value, f"{name}.{key}")
            out[key] = int(number) if key in INT_FIELDS and math.isfinite(number) else number
    if name == "hardware" and isinstance(out.get("gpus"), list):
        out["gpus"] = [_normalise_section("hardware", gpu) for gpu in out["gpus"]]
    return out


def normalise(raw: Any) -> dict[str, Any]:
    """Validate and normalise one decoded JSON value into a TLS record (raises TLSError)."""
    if not isinstance(raw, dict):
        raise TLSError(f"a record is a JSON object, got {type(raw).__name__}")
    if "timestamp" not in raw:
        raise TLSError("missing required field", field="timestamp")
    record = dict(raw)
    record["timestamp"] = parse_timestamp(raw["timestamp"])
    for key in ("step", "rank"):
        value = raw.get(key)
        if value is None:
            continue
        try:
            number = parse_quantity(value, key)
        except TLSError:
            raise TLSError(f"expected an integer, got {value!r}", field=key) from None
        if not math.isfinite(number) or number != int(number):
            raise TLSError(f"expected an integer, got {value!r}", field=key)
        if not INT64_MIN <= int(number) <= INT64_MAX:
            # every reader keeps steps and ranks in int64 columns (numpy, Prometheus labels as numbers)
            raise TLSError(f"{value!r} is outside a 64-bit integer", field=key)
        record[key] = int(number)
    for name in SECTIONS:
        if name in raw and raw[name] is not None:
            record[name] = _normalise_section(name, raw[name])
    event = record.get("event")
    if event is not None and not isinstance(event.get("type"), str):
        raise TLSError("an event needs a string 'type'", field="event.type")
    return record


# --------------------------------------------------------------------------------------------- decode

_decoder = msgspec.json.Decoder()


def decode(line: bytes | str, source: str | None = None, lineno: int | None = None) -> dict[str, Any]:
    """One line of TLS into a normalised record; TLSError names source, line and field."""
    try:
        raw = _decoder.decode(line)
    except (msgspec.DecodeError, UnicodeDecodeError):
        # The slow path reads what msgspec refuses but Python's json writes: NaN and Infinity. (msgspec
        # raises UnicodeDecodeError, not DecodeError, for a bad byte inside a string; json names it.)
        try:
            raw = json.loads(line)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise TLSError(f"not valid JSON ({exc})", source, lineno) from None
    except RecursionError:
        raise TLSError("not valid TLS: JSON nested too deeply", source, lineno) from None
    try:
        return normalise(raw)
    except TLSError as exc:
        raise exc.at(source, lineno) from None


@dataclass(frozen=True, slots=True)
class Line:
    """One line of a TLS file: a record, or the error that stopped it being one."""

    source: str
    lineno: int
    record: dict[str, Any] | None
    error: TLSError | None = None


def open_log(path: str | os.PathLike[str]) -> IO[bytes]:
    """Open a TLS file for reading, plain, gzip or zstd by its suffix: a regular file, its decompression
    bounded (trainguard/safe_read.py; RunFileError, an OSError, naming the file otherwise)."""
    from trainguard import safe_read

    return safe_read.open_log(path)


def decode_line(raw: bytes, source: str, lineno: int) -> Line:
    """One raw line (with its newline, if it had one) into a Line; a bad line without a newline is
    reported as the truncated last line of a file a writer was still appending to."""
    try:
        return Line(source, lineno, decode(raw, source, lineno))
    except TLSError as exc:
        if not raw.endswith(b"\n"):
            exc = TLSError(f"truncated last line ({exc.message})", source, lineno)
        return Line(source, lineno, None, exc)


def iter_lines(path: str | os.PathLike[str]) -> Iterator[Line]:
    """Every non-blank line of a TLS file in order; memory stays flat however long the file."""
    source = str(path)
    lineno = 0
    if not str(source).endswith((".gz", ".zst")) and _other_format(path):
        yield from _other_format_lines(path)
        return
    from trainguard import safe_read

    with open_log(path) as handle:
        try:
            for lineno, raw in enumerate(safe_read.lines(handle, source), 1):
                if raw.strip():
                    yield decode_line(raw, source, lineno)
        except safe_read.RunFileError:
            raise       # a FIFO, a line past the bound, a decompression bomb: the file is refused, named
        except _stream_errors() as exc:
            # A corrupt or cut-off .gz/.zst (or a failing disk): what was read stands, the rest is one error.
            yield Line(source, lineno + 1, None,
                       TLSError(f"unreadable after line {lineno} ({type(exc).__name__}: {exc})", source, lineno + 1))


def _other_format(path: str | os.PathLike[str]) -> bool:
    from trainguard import formats
    return formats.detect(path) != formats.TLS


def _other_format_lines(path: str | os.PathLike[str]) -> Iterator[Line]:
    """Another tool's log (trainguard.formats: TensorBoard, trainer_state.json, Megatron, torchtitan) as the
    Lines of its TLS records; what could not be mapped is an error Line at its file and position."""
    from trainguard import formats
    source = str(path)
    for ordinal, item in enumerate(formats.read(path), 1):
        if isinstance(item, formats.Unmapped):
            yield Line(source, item.position, None, TLSError(f"{item.where}: {item.error}", source, item.position))
        else:
            yield Line(source, ordinal, decode(encode(item), source, ordinal))


def _stream_errors() -> tuple[type[BaseException], ...]:
    import zlib

    import zstandard

    return OSError, EOFError, zlib.error, zstandard.ZstdError


# A log's name in RUN/tls/; re.match compiles it at the first run directory read (and caches it).
_LOG_NAME = r"^(?P<kind>rank|node)-(?P<name>.+?)\.jsonl(?:\.(?P<n>\d+))?(?:\.gz|\.zst)?$"


@dataclass(frozen=True, slots=True)
class LogFile:
    """One TLS log of a run: ``kind`` is "rank" or "node", ``name`` the rank number or the host."""

    kind: str
    name: str
    rotation: int     # 0 for the live file, N for ``.jsonl.N[.gz|.zst]``
    path: Path


def run_logs(tls_dir: str | os.PathLike[str]) -> list[LogFile]:
    """The TLS logs of a run's ``tls/`` directory in reading order: by kind and name, each log's rotated
    parts oldest first (highest N), then its live file. Empty when the directory does not exist."""
    root = Path(tls_dir)
    found = []
    for path in root.iterdir() if root.is_dir() else ():
        match = re.match(_LOG_NAME, path.name)
        if match and path.is_file():
            found.append(LogFile(match.group("kind"), match.group("name"), int(match.group("n") or 0), path))
    return sorted(found, key=lambda log: (log.kind, log.name, -log.rotation if log.rotation else 0))


def read_records(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """All records of a small file; raises the first TLSError (tests and tools, not hot paths)."""
    records = []
    for line in iter_lines(path):
        if line.error:
            raise line.error
        if line.record is not None:     # always, without an error
            records.append(line.record)
    return records


# --------------------------------------------------------------------------------------------- encode

_encoder = msgspec.json.Encoder()


def _has_non_finite(values: Iterable[Any]) -> bool:
    for value in values:
        cls = value.__class__
        if cls is float:
            if not math.isfinite(value):
                return True
        elif cls is dict and _has_non_finite(value.values()):   # grad_norm_by_layer and the like
            return True
    return False


def encode(record: dict[str, Any]) -> bytes:
    """One record as a line of JSON (with the trailing newline).

    A non-finite loss is the most important thing a log can say, so NaN and Infinity are written as
    Python's json writes them rather than as null.
    """
    if _has_non_finite([record.get(name) or {} for name in ("metrics", "hardware", "system", "event")]):
        return json.dumps(record, separators=(",", ":"), allow_nan=True).encode() + b"\n"
    return _encoder.encode(record) + b"\n"


class Writer:
    """Appends records to a TLS file, one `os.write` per record on an O_APPEND descriptor.

    A single write of one line keeps readers (the agent) from seeing partial records from a live
    process, and leaves nothing buffered to lose when the process is killed.

    Telemetry must never stop training: a record that cannot be written (a full disk) is dropped and
    counted (`dropped`), the partial bytes cut off again, and the failure reported once per streak through
    `on_drop` (default: a log line naming the file and the bytes needed). On open, a torn last line (a
    process killed mid-write, an old disk-full) is ended with a newline, so the next record is not glued
    onto it: the torn line stays, and readers report it as malformed by its line number.
    """

    def __init__(self, path: str | os.PathLike[str], on_drop: Callable[[str], None] | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        from trainguard import safe_read     # a FIFO in the log's place would block the writer: refused

        self._fd = safe_read.open_rw_fd(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, "log file")
        self.dropped = 0
        self._failing = False
        self.on_drop = on_drop or _log_drop
        self._end_torn_line()

    def _end_torn_line(self) -> None:
        size = os.fstat(self._fd).st_size
        if size and os.pread(self._fd, 1, size - 1) != b"\n":
            self._append(b"\n")

    def write(self, record: dict[str, Any]) -> bool:
        """True when the record is on its way to disk; False when it was dropped (and counted)."""
        return self._append(encode(record))

    def _append(self, data: bytes) -> bool:
        size = os.fstat(self._fd).st_size
        try:
            written = os.write(self._fd, data)
            if written != len(data):
                raise OSError(28, f"short write ({written} of {len(data)} bytes)")
        except OSError as exc:
            try:
                os.ftruncate(self._fd, size)     # never leave half a record for the next one to glue onto
            except OSError:
                pass
            self.dropped += 1
            if not self._failing:
                self._failing = True
                self.on_drop(f"{self.path}: {exc.strerror or exc} ({len(data)} bytes needed); "
                             "TLS records are dropped and counted until it can be written again")
            return False
        if self._failing:
            self._failing = False
            self.on_drop(f"{self.path}: writable again after {self.dropped} dropped record(s)")
        return True

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "Writer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _log_drop(message: str) -> None:
    from trainguard import log

    log.get("tls.writer").error(message)


def make_record(*, step: int | None = None, timestamp: float | None = None, **sections: Any) -> dict[str, Any]:
    """A TLS v1 record with the envelope filled in; sections passed by name (metrics=..., event=...)."""
    record: dict[str, Any] = {"schema": SCHEMA_ID,
                              "timestamp": format_timestamp(time.time() if timestamp is None else timestamp)}
    if step is not None:
        record["step"] = step
    for key, value in sections.items():
        if value is not None:
            record[key] = value
    return record


def event(kind: str, *, step: int | None = None, timestamp: float | None = None, **fields: Any) -> dict[str, Any]:
    """A TLS record carrying one event (``{"type": kind, ...}``)."""
    return make_record(step=step, timestamp=timestamp, event={"type": kind, **fields})

