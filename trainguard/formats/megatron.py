"""Megatron-LM's training log lines (megatron/training/training.py `training_log`), as it prints them:

     [2024-05-01 10:00:00] iteration      120/  500000 | consumed samples:        61440 | elapsed time per
     iteration (ms): 812.3 | learning rate: 2.999988E-04 | global batch size:   512 | lm loss: 2.365713E+00 |
     loss scale: 1.0 | grad norm: 0.412 | number of skipped iterations:   0 | number of nan iterations:   0 |

(one line). Every ` key: value |` field is read; `lm loss` (or `loss`), `grad norm`, `learning rate`,
`consumed samples`, `global batch size` and `elapsed time per iteration (ms)` become the TLS metrics
`loss`, `grad_norm`, `learning_rate`, `consumed_samples`, `global_batch_size`, `step_time_seconds`. The
bracketed time is taken as UTC; a line without one (older Megatron) is timed by its iteration (seconds).
Other lines of the log (arguments, timers, memory reports) are not training records and are passed over;
a line that starts as an iteration line but cannot be read is reported with its line number.
The reading is `metric_lines.py`'s; this is the table.
"""

from __future__ import annotations

import os
import re
from typing import Iterator

from trainguard.formats import Item, metric_lines
from trainguard.formats.metric_lines import LineFormat, Metric

ITERATION = re.compile(rb"\biteration\s+(\d+)/\s*(\d+)\s*\|")
LOSS_KEYS = ("lm loss", "loss")

FORMAT = LineFormat(
    is_record=lambda line: "iteration" in line and ITERATION.search(line.encode()) is not None,
    line=re.compile(r"^\s*(?:\[(?P<time>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?)\])?"
                    r"\s*iteration\s+(?P<step>\d+)/\s*\d+\s*\|(?P<fields>.*)$"),
    field=re.compile(r"\s*([^|:]+?):\s*([^|]*?)\s*\|"),
    metrics=(Metric("loss", LOSS_KEYS),
             Metric("grad_norm", ("grad norm",)),
             Metric("learning_rate", ("learning rate",)),
             Metric("consumed_samples", ("consumed samples",)),
             Metric("global_batch_size", ("global batch size",)),
             Metric("step_time_seconds", ("elapsed time per iteration (ms)",), per=1000.0)),
    required=("loss", "grad_norm"),
    misshapen="an iteration line in a shape Megatron does not print",
    missing="no loss and no grad norm in an iteration line",
)


def looks_like(head: bytes) -> bool:
    return ITERATION.search(head) is not None and b"consumed samples:" in head


def read(path: str | os.PathLike) -> Iterator[Item]:
    return metric_lines.read(FORMAT, path)


def record_of(line: str) -> dict:
    return metric_lines.record_of(FORMAT, line)
