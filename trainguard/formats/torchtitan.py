"""torchtitan's metric lines (torchtitan/components/metrics.py `MetricsProcessor.log`, through the
`[titan] %(asctime)s - %(name)s - %(levelname)s - %(message)s` logger of torchtitan/tools/logging.py):

    [titan] 2025-04-01 10:00:00,123 - root - INFO - step: 10  loss:  7.8213  grad_norm:  1.2345  memory: ...
    tps: 12,345  tflops: 123.45  mfu: 40.12%

(one line, with ANSI colour codes between the fields, which are removed first). `step`, `loss`,
`grad_norm`, `tps` and `mfu` become the TLS metrics `loss`, `grad_norm`, `tokens_per_second`, `mfu`; the
log time is taken as UTC (without one, the step as seconds). Other lines are passed over; a `step:` line
without a readable loss is reported with its line number. The reading is `metric_lines.py`'s; this is
the table.
"""

from __future__ import annotations

import os
import re
from typing import Iterator

from trainguard.formats import Item, metric_lines
from trainguard.formats.metric_lines import LineFormat, Metric

ANSI = re.compile(r"\x1b\[[0-9;,]*m")
MARK = re.compile(rb"\[titan\][^\n]*step:\s*\d+")
FIELDS = {"loss": "loss", "grad_norm": "grad_norm", "tps": "tokens_per_second", "mfu": "mfu"}

FORMAT = LineFormat(
    clean=lambda line: ANSI.sub("", line),
    is_record=lambda line: "step:" in line and "[titan]" in line,
    line=re.compile(r"(?:\[titan\]\s+(?P<time>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)(?:,\d+)?\s.*?-\s+)?"
                    r"step:\s*(?P<step>\d+)\s+(?P<fields>.*)$"),
    field=re.compile(r"([a-z_]+):\s*([-+0-9.,eEinfaN]+)%?"),
    metrics=tuple(Metric(name, (key,)) for key, name in FIELDS.items()),
    required=("loss",),
    misshapen="a step line in a shape torchtitan does not print",
    missing="no loss in a step line",
    number=lambda text: float(text.replace(",", "")),   # tps: 12,345
)


def looks_like(head: bytes) -> bool:
    return MARK.search(ANSI.sub("", head.decode("utf-8", "replace")).encode()) is not None


def read(path: str | os.PathLike) -> Iterator[Item]:
    return metric_lines.read(FORMAT, path)


def record_of(line: str) -> dict:
    return metric_lines.record_of(FORMAT, line)
