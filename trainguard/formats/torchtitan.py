"""torchtitan's metric lines (torchtitan/components/metrics.py `MetricsProcessor.log` and `log_validation`),
through torchtitan's `[titan] %(asctime)s - %(name)s - %(levelname)s - %(message)s` logger, another logger
that puts its own time and place first (ezpz's `[2025-09-11 14:09:46,954794][I][components/metrics:437:log] `),
and any launcher prefix (metric_lines.py):

    [titan] 2025-04-01 10:00:00,123 - root - INFO - step: 10  loss:  7.8213  grad_norm:  1.2345  memory:
    31.25GiB(39.47%)  tps: 12,345  tflops: 123.45  mfu: 40.12%
    [titan] 2025-04-01 10:05:00,456 - root - INFO - validate step: 10  loss:  7.5012  memory: ...

(one line each, ANSI colours between the fields, removed first). `loss`, `grad_norm`, `tps` (older: `wps`),
`tflops`, `mfu` and `memory` become the TLS metrics `loss`, `grad_norm`, `tokens_per_second`, `tflops`,
`mfu` (printed in percent; TLS holds a ratio: 40.12% is 0.4012) and `mem_peak_bytes` (torchtitan prints its
peak reserved GiB). A `validate step:` line is an `evaluation` event (`val_loss`). Several ranks printing the
same step into one file are one step: the first rank's lines are read (rank tags), and an untagged line
repeating the step just read is a copy; both counted in the notes. The log time is taken as UTC; without
one, the step orders the records (`notes.clock` NO_CLOCK). A step line without a readable loss is reported
with its line number.
"""

from __future__ import annotations

import math
import os
import re
from typing import Iterator

from trainguard import event_types, tls
from trainguard.formats import CLOCK_KEY, NO_CLOCK, Item, Notes, Unmapped, metric_lines, step_of

ANSI = metric_lines.ANSI
STEP = re.compile(r"(?<![\w])(validate step|step):\s*(\d+)\s+")
FIELD = re.compile(r"([A-Za-z_]+):\s*([-+]?(?:[0-9][0-9,]*(?:\.[0-9]*)?(?:[eE][-+]?\d+)?|nan|inf))(GiB|%)?",
                   re.IGNORECASE)
MARK = re.compile(rb"step:\s*\d+\s+loss:\s*\S+[^\n]*?\b(?:tps|wps|mfu|memory|grad_norm):")
# log key -> (TLS metric, multiply by)
FIELDS = {"loss": ("loss", 1.0), "grad_norm": ("grad_norm", 1.0), "tps": ("tokens_per_second", 1.0),
          "wps": ("tokens_per_second", 1.0), "tflops": ("tflops", 1.0), "mfu": ("mfu", 0.01),
          "memory": ("mem_peak_bytes", float(1 << 30))}


def looks_like(head: bytes) -> bool:
    return looks_like_text(head)


def looks_like_text(block: bytes) -> bool:
    if b"step:" not in block:
        return False
    return MARK.search(ANSI.sub("", block.decode("utf-8", "replace")).encode()) is not None


def read(path: str | os.PathLike, notes: Notes | None = None) -> Iterator[Item]:
    notes = notes if notes is not None else Notes()
    source = str(path)
    ranks = metric_lines.Ranks()
    last_step: int | None = None
    repeats = repeats_at = 0
    timed = untimed = 0
    for lineno, text in metric_lines.segments(path):
        if "step:" not in text:
            continue
        match = STEP.search(text)
        if match is None:
            continue
        prefix = metric_lines.prefix_of(text[:match.start()])
        if not ranks.keep(prefix.rank, lineno):
            continue
        step = step_of(int(match.group(2)))
        if step is None:
            yield Unmapped(source, lineno, f"step {match.group(2)}: beyond a 64-bit step")
            continue
        try:
            metrics = _metrics(text[match.end():])
        except ValueError as exc:
            yield Unmapped(source, lineno, str(exc))
            continue
        if "loss" not in metrics:
            yield Unmapped(source, lineno, "no loss in a step line")
            continue
        when = prefix.time if prefix.time is not None else float(step)
        timed, untimed = timed + (prefix.time is not None), untimed + (prefix.time is None)
        if match.group(1) == "validate step":
            record = tls.event(event_types.EVALUATION, step=step, timestamp=when, val_loss=metrics["loss"])
        elif step == last_step and prefix.rank is None:
            repeats, repeats_at = repeats + 1, repeats_at or lineno
            continue
        else:
            last_step = step
            record = tls.make_record(step=step, timestamp=when, metrics=metrics)
        if prefix.time is None:
            record[CLOCK_KEY] = NO_CLOCK
        yield record
    ranks.note(notes, "step lines")
    if repeats:
        notes.skip("step lines repeating the step just read (other ranks' copies)", repeats_at, count=repeats)
    notes.clock = NO_CLOCK if untimed and not timed else "wall"


def _metrics(text: str) -> dict:
    metrics = {}
    for key, value, unit in FIELD.findall(text):
        mapped = FIELDS.get(key)
        if mapped is None or mapped[0] in metrics:
            continue
        try:
            number = metric_lines.number(value) * mapped[1]
        except ValueError:
            raise ValueError(f"{key}: {value!r} is not a number") from None
        if key == "memory" and unit != "GiB" or key == "mfu" and unit != "%":
            number = metric_lines.number(value)           # printed without the unit: taken as it is
        metrics[mapped[0]] = float(f"{number:.12g}")     # 20.69% is 0.2069, not 0.20690000000000003
    if "mem_peak_bytes" in metrics and math.isfinite(metrics["mem_peak_bytes"]):
        metrics["mem_peak_bytes"] = round(metrics["mem_peak_bytes"])
    return metrics
