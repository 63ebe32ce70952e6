"""Rank 0's view of progress: a one-line bar on an interactive terminal, a structured log line every
`log_every` steps otherwise (no dependency beyond structlog)."""

from __future__ import annotations

import math
import sys
import time

from trainguard import terminal

BAR_WIDTH = 24
REDRAW_SECONDS = 0.1


class Progress:
    def __init__(self, total: int, log_every: int, log, stream=None):
        self.total, self.log_every, self.log = total, max(1, log_every), log
        # the bar's carriage return must reach the terminal as one: past the escaping of run-directory
        # text (trainguard/terminal.py); the bar prints numbers only
        self.stream = terminal.unwrapped(stream or sys.stderr)
        self.tty = self.stream.isatty()
        self._drawn = 0.0

    def update(self, step: int, loss: float, lr: float, tokens_per_second: float) -> None:
        if self.tty:
            now = time.monotonic()
            if now - self._drawn >= REDRAW_SECONDS or step == self.total:
                self._drawn = now
                self._draw(step, loss, lr, tokens_per_second)
        elif step % self.log_every == 0 or step == self.total:
            self.log.info("step", step=step, loss=round(loss, 4) if math.isfinite(loss) else loss,
                          lr=float(f"{lr:.3g}"), tokens_per_second=round(tokens_per_second))

    def _draw(self, step: int, loss: float, lr: float, tokens_per_second: float) -> None:
        done = min(1.0, step / self.total) if self.total else 1.0
        filled = int(done * BAR_WIDTH)
        bar = "#" * filled + "." * (BAR_WIDTH - filled)
        self.stream.write(f"\r[{bar}] step {step}/{self.total}  loss {loss:.4f}  lr {lr:.2e}  "
                          f"{tokens_per_second / 1e3:.1f}k tok/s ")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = 0.0
