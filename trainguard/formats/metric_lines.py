"""One reader for the logs that print a training step as a text line of `key: value` metrics.

A format is a small table (`LineFormat`): which lines are records, the regex of a record line (its step,
its time if any, its fields), the regex of one field, and which fields become which TLS metric. The
reading is the same for all: each line is cleaned (ANSI colours), a record line is matched, its fields
are read into the TLS metrics in the table's order, its time is taken as UTC (without one, the step as
seconds), and a record line that cannot be read is yielded as `Unmapped` with its line number. Every
other line (arguments, timers, memory reports) is passed over. megatron.py and torchtitan.py are tables.
"""

from __future__ import annotations

import io
import os
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Callable, Iterator

from trainguard import safe_read, tls
from trainguard.formats import Item, Unmapped

TIME_FORMAT = "%Y-%m-%d %H:%M:%S"   # the `time` group's first 19 characters


@dataclass(frozen=True)
class Metric:
    """A TLS metric and the log's names for it (the first one a line has is read)."""

    name: str
    keys: tuple[str, ...]
    per: float = 1.0     # the log's units per TLS unit: 1000 for milliseconds read as seconds


@dataclass(frozen=True)
class LineFormat:
    is_record: Callable[[str], bool]   # a cheap test of a cleaned line: one the tool prints its metrics in
    line: re.Pattern                   # a record line: groups `step`, `time` (may be absent), `fields`
    field: re.Pattern                  # one (key, value) pair of `fields`
    metrics: tuple[Metric, ...]
    required: tuple[str, ...]          # a record has at least one of these metrics
    misshapen: str                     # the problem of a record line `line` does not match
    missing: str                       # the problem of one without any `required` metric
    clean: Callable[[str], str] = lambda line: line
    number: Callable[[str], float] = float


def read(fmt: LineFormat, path: str | os.PathLike) -> Iterator[Item]:
    source = str(path)
    with io.TextIOWrapper(safe_read.open_file(path, what="log file"), encoding="utf-8", errors="replace") as handle:
        for lineno, raw in enumerate(iter(lambda: handle.readline(safe_read.MAX_LINE_BYTES), ""), 1):
            if len(raw) >= safe_read.MAX_LINE_BYTES and not raw.endswith("\n"):
                raise safe_read.line_too_long(path, lineno)
            line = fmt.clean(raw.rstrip("\n"))
            if not fmt.is_record(line):
                continue
            try:
                yield record_of(fmt, line)
            except ValueError as exc:
                yield Unmapped(source, lineno, str(exc))


def record_of(fmt: LineFormat, line: str) -> dict:
    """The TLS record of one cleaned record line; ValueError saying what is wrong with it."""
    match = fmt.line.search(line)
    if match is None:
        raise ValueError(fmt.misshapen)
    step = int(match["step"])
    when = (datetime.strptime(match["time"][:19], TIME_FORMAT).replace(tzinfo=timezone.utc).timestamp()
            if match["time"] else float(step))
    fields = {key.strip(): value for key, value in fmt.field.findall(match["fields"])}
    metrics = {}
    for metric in fmt.metrics:
        key = next((key for key in metric.keys if key in fields), None)
        if key is not None:
            metrics[metric.name] = _number(fmt, fields[key], key) / metric.per
    if not any(name in metrics for name in fmt.required):
        raise ValueError(fmt.missing)
    return tls.make_record(step=step, timestamp=when, metrics=metrics)


def _number(fmt: LineFormat, text: str, key: str) -> float:
    try:
        return fmt.number(text)
    except ValueError:
        raise ValueError(f"{key}: {text!r} is not a number") from None
