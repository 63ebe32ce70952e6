"""What the text formats (megatron.py, torchtitan.py) share: how a launcher wraps a log line, and reading
a file's lines through it.

A line the tool printed arrives behind whatever the launcher and the logger put before it: a rank tag
(`[default7]: ` torch.distributed.run's `--tee`, `[rank3]:` its `--local-ranks-filter` form, `[host:3]: `,
`0: ` srun's `--label`), a timestamp (`[2024-05-01 10:00:00]`, `2024-05-01T10:00:00.123Z`, the logging
module's `2024-05-01 10:00:00,123`), ANSI colours, and tqdm's carriage returns (a progress bar redrawn on the
same line before the text). So a reader finds its record text anywhere in a line (each `\\r` segment on its
own), and reads the rank and the time from what precedes it (`Prefix`). Several ranks printing the same
steps into one file are one run: `Ranks` keeps the first rank's lines and counts the others' copies.
"""

from __future__ import annotations

import io
import os
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Iterator

from trainguard import safe_read

ANSI = re.compile(r"\x1b\[[0-9;,?]*[A-Za-z]")
TIME = re.compile(r"(\d{4})-(\d\d)-(\d\d)[ T](\d\d):(\d\d):(\d\d)(?:[.,](\d{1,9}))?(Z|[+-]\d\d:?\d\d)?")
RANK_TAGS = (re.compile(r"\[(?:default|rank|Rank )(\d+)\]"),      # [default7]: / [rank3]: / [Rank 3]
             re.compile(r"\[[\w.-]+:(\d+)\]"),                    # [host:3]:
             re.compile(r"^\s*(\d+):\s"))                         # 0: (srun --label)
MAX_LINE = 1 << 20      # a line longer than this (a binary blob, a log without newlines) is read in pieces


@dataclass(frozen=True)
class Prefix:
    time: float | None      # Unix seconds (a time without a zone is UTC)
    rank: int | None


def prefix_of(text: str) -> Prefix:
    """The rank and the time a launcher or logger wrote before a record's text."""
    rank = None
    for pattern in RANK_TAGS:
        match = pattern.search(text)
        if match:
            rank = int(match.group(1))
            break
    return Prefix(time_of(text), rank)


def time_of(text: str) -> float | None:
    match = TIME.search(text)
    if match is None:
        return None
    year, month, day, hour, minute, second, fraction, zone = match.groups()
    try:
        when = datetime(int(year), int(month), int(day), int(hour), int(minute), int(second), tzinfo=timezone.utc)
    except ValueError:
        return None
    seconds = when.timestamp() + (int(fraction) / 10 ** len(fraction) if fraction else 0.0)
    if zone and zone != "Z":
        sign = 1 if zone[0] == "+" else -1
        digits = zone[1:].replace(":", "")
        seconds -= sign * (int(digits[:2]) * 3600 + int(digits[2:]) * 60)
    return seconds


def segments(path: str | os.PathLike) -> Iterator[tuple[int, str]]:
    """(line number, text) of each `\\r`-separated segment of each line, ANSI colours removed; a line
    longer than MAX_LINE is cut into pieces (memory stays bounded; no record line is that long)."""
    with io.TextIOWrapper(safe_read.open_file(path, what="log file"), encoding="utf-8", errors="replace",
                          newline="\n") as handle:
        lineno = 0
        while True:
            line = handle.readline(MAX_LINE)
            if not line:
                return
            lineno += 1
            if "\x1b" in line:
                line = ANSI.sub("", line)
            if "\r" in line:
                for piece in line.split("\r"):
                    if piece.strip():
                        yield lineno, piece.rstrip("\n")
            else:
                yield lineno, line.rstrip("\n")
            while len(line) >= MAX_LINE and not line.endswith("\n"):
                line = handle.readline(MAX_LINE)     # the rest of an overlong line: not a record
                if not line:
                    return


class Ranks:
    """Which rank's lines a file's records are: the first rank tag seen on a record line (a line without
    a tag is the same run's). Another rank's line is a copy of a step, counted in `copies`."""

    def __init__(self) -> None:
        self.lead: int | None = None
        self.copies: dict[int, int] = {}
        self.first_copy = 0

    def keep(self, rank: int | None, lineno: int) -> bool:
        if rank is None:
            return True
        if self.lead is None:
            self.lead = rank
        if rank == self.lead:
            return True
        self.copies[rank] = self.copies.get(rank, 0) + 1
        self.first_copy = self.first_copy or lineno
        return False

    def note(self, notes, what: str) -> None:
        if self.copies:
            others = ", ".join(str(rank) for rank in sorted(self.copies)[:8]) + (
                ", ..." if len(self.copies) > 8 else "")
            notes.skip(f"{what} printed again by other ranks ({others}; rank {self.lead}'s are read)",
                       self.first_copy, count=sum(self.copies.values()))


def number(text: str) -> float:
    """A printed number: `1.2E+01`, `nan`, `inf`, `12,345`; ValueError otherwise."""
    return float(text.replace(",", "").strip())
