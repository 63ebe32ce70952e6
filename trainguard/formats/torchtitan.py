"""torchtitan's metric lines (torchtitan/components/metrics.py `MetricsProcessor.log`, through the
`[titan] %(asctime)s - %(name)s - %(levelname)s - %(message)s` logger of torchtitan/tools/logging.py):

    [titan] 2025-04-01 10:00:00,123 - root - INFO - step: 10  loss:  7.8213  grad_norm:  1.2345  memory: ...
    tps: 12,345  tflops: 123.45  mfu: 40.12%

(one line, with ANSI colour codes between the fields, which are removed first). `step`, `loss`,
`grad_norm`, `tps` and `mfu` become the TLS metrics `loss`, `grad_norm`, `tokens_per_second`, `mfu`; the
log time is taken as UTC (without one, the step as seconds). Other lines are passed over; a `step:` line
without a readable loss is reported with its line number.
"""

from __future__ import annotations

import os
import re
from datetime import datetime, timezone
from typing import Iterator

from trainguard import tls
from trainguard.formats import Item, Unmapped

ANSI = re.compile(r"\x1b\[[0-9;,]*m")
MARK = re.compile(rb"\[titan\][^\n]*step:\s*\d+")
_LINE = re.compile(r"(?:\[titan\]\s+(?P<time>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)(?:,\d+)?\s.*?-\s+)?"
                   r"step:\s*(?P<step>\d+)\s+(?P<fields>.*)$")
_FIELD = re.compile(r"([a-z_]+):\s*([-+0-9.,eEinfaN]+)%?")
FIELDS = {"loss": "loss", "grad_norm": "grad_norm", "tps": "tokens_per_second", "mfu": "mfu"}


def looks_like(head: bytes) -> bool:
    return MARK.search(ANSI.sub("", head.decode("utf-8", "replace")).encode()) is not None


def read(path: str | os.PathLike) -> Iterator[Item]:
    source = str(path)
    with open(path, "r", encoding="utf-8", errors="replace") as handle:
        for lineno, raw in enumerate(handle, 1):
            line = ANSI.sub("", raw).rstrip("\n")
            if "step:" not in line or "[titan]" not in line:
                continue
            try:
                yield record_of(line)
            except ValueError as exc:
                yield Unmapped(source, lineno, str(exc))


def record_of(line: str) -> dict:
    match = _LINE.search(line)
    if match is None:
        raise ValueError("a step line in a shape torchtitan does not print")
    fields = dict(_FIELD.findall(match["fields"]))
    metrics = {}
    for key, field in FIELDS.items():
        if key in fields:
            try:
                metrics[field] = float(fields[key].replace(",", ""))
            except ValueError:
                raise ValueError(f"{key}: {fields[key]!r} is not a number") from None
    if "loss" not in metrics:
        raise ValueError("no loss in a step line")
    step = int(match["step"])
    when = (datetime.strptime(match["time"], "%Y-%m-%d %H:%M:%S").replace(tzinfo=timezone.utc).timestamp()
            if match["time"] else float(step))
    return tls.make_record(step=step, timestamp=when, metrics=metrics)
