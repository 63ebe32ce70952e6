"""Progress of long offline work on a terminal: one line on stderr, redrawn in place, erased at the end.

    with progress.Progress("report") as shown:
        for path in files:
            shown.file(path, index, len(files))
            for line in shown.counted(tls.iter_lines(path)):
                ...

The line appears only when stderr is a terminal (nothing when piped or redirected, so scripts, CI and
`--json` readers see exactly what they saw before), after the work has run `delay` seconds (a quick
command prints nothing), at most every `interval` seconds. `TRAINGUARD_PROGRESS=0` turns it off,
`=1` on even without a terminal. Cost when hidden: a counter and, every 4096 items, a clock read.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import IO, Iterable, Iterator, TypeVar

from trainguard import terminal

T = TypeVar("T")
ENV = "TRAINGUARD_PROGRESS"
CHECK_EVERY = 4096           # items between two looks at the clock


def wanted(stream: IO[str]) -> bool:
    setting = os.environ.get(ENV, "").strip()
    if setting in ("0", "1"):
        return setting == "1"
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Progress:
    """`what` names the command (`replay`, `report`, ...); `total` is the number of units (files,
    checkpoints) when known."""

    def __init__(self, what: str, total: int | None = None, unit: str = "files", *, stream: IO[str] | None = None,
                 delay: float = 1.0, interval: float = 0.2, enabled: bool | None = None):
        self.what, self.total, self.unit = what, total, unit
        # its own carriage returns must reach the terminal, so it writes under trainguard.terminal's escaping
        # stream and escapes what it shows from the run directory (file names) itself
        self.stream = terminal.unwrapped(stream or sys.stderr)
        self.enabled = wanted(self.stream) if enabled is None else enabled
        self.delay, self.interval = delay, interval
        self.began = time.monotonic()
        self.next_draw = self.began + delay
        self.done, self.items, self.note = 0, 0, ""
        self.drawn = False

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def step(self, done: int | None = None, note: str | None = None) -> None:
        """A unit finished (`done`: how many so far, else one more); `note` says what is being worked on."""
        self.done = self.done + 1 if done is None else done
        if note is not None:
            self.note = note
        self._maybe_draw()

    def file(self, path: str | os.PathLike, index: int, count: int) -> None:
        """Reading file `index` (from 0) of `count`."""
        self.total = count
        self.step(index, Path(path).name)

    def counted(self, items: Iterable[T]) -> Iterator[T]:
        """`items`, counted as records read (shown beside the units)."""
        for item in items:
            self.items += 1
            if self.enabled and self.items % CHECK_EVERY == 0:
                self._maybe_draw()
            yield item

    def line(self) -> str:
        parts = [f"{self.what}:"]
        if self.note:
            parts.append(terminal.escape(self.note))
        if self.total:
            parts.append(f"({self.done} of {self.total} {self.unit}, {100 * self.done // self.total}%)")
        if self.items:
            parts.append(f"{self.items:,} records")
        parts.append(f"{time.monotonic() - self.began:.0f} s")
        return " ".join(parts)

    def _maybe_draw(self) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now < self.next_draw:
            return
        self.next_draw = now + self.interval
        width = _columns() - 1
        self.stream.write("\r" + self.line()[:width].ljust(width))
        self.stream.flush()
        self.drawn = True

    def heartbeat(self) -> "Progress":
        """Redraw (the elapsed time) from a thread while work that reports nothing runs (replay's passes)."""
        if self.enabled:
            import threading

            self._beating = threading.Event()

            def beat() -> None:
                while not self._beating.wait(self.interval):
                    self._maybe_draw()
            self._beat = threading.Thread(target=beat, name="progress", daemon=True)
            self._beat.start()
        return self

    def close(self) -> None:
        """Erase the line, so what the command prints next starts on a clean one."""
        if getattr(self, "_beating", None) is not None:
            self._beating.set()
            self._beat.join()          # its last draw comes before the erase, never after
        if self.drawn:
            self.stream.write("\r" + " " * (_columns() - 1) + "\r")
            self.stream.flush()
            self.drawn = False


def _columns() -> int:
    try:
        return max(20, os.get_terminal_size(sys.stderr.fileno()).columns)
    except (OSError, ValueError):
        return 80
