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
"""

from __future__ import annotations

import os
import re
from datetime import datetime, timezone
from typing import Iterator

from trainguard import tls
from trainguard.formats import Item, Unmapped

ITERATION = re.compile(rb"\biteration\s+(\d+)/\s*(\d+)\s*\|")
_LINE = re.compile(r"^\s*(?:\[(?P<time>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?)\])?\s*iteration\s+(?P<step>\d+)/\s*\d+\s*\|"
                   r"(?P<fields>.*)$")
_FIELD = re.compile(r"\s*([^|:]+?):\s*([^|]*?)\s*\|")
LOSS_KEYS = ("lm loss", "loss")


def looks_like(head: bytes) -> bool:
    return ITERATION.search(head) is not None and b"consumed samples:" in head


def read(path: str | os.PathLike) -> Iterator[Item]:
    source = str(path)
    with open(path, "r", encoding="utf-8", errors="replace") as handle:
        for lineno, line in enumerate(handle, 1):
            if "iteration" not in line or not ITERATION.search(line.encode()):
                continue
            try:
                yield record_of(line)
            except ValueError as exc:
                yield Unmapped(source, lineno, str(exc))


def record_of(line: str) -> dict:
    match = _LINE.match(line.rstrip("\n"))
    if match is None:
        raise ValueError("an iteration line in a shape Megatron does not print")
    fields = {key.strip(): value for key, value in _FIELD.findall(match["fields"])}
    step = int(match["step"])
    when = (datetime.strptime(match["time"][:19], "%Y-%m-%d %H:%M:%S").replace(tzinfo=timezone.utc).timestamp()
            if match["time"] else float(step))
    loss = next((number(fields[k], k) for k in LOSS_KEYS if k in fields), None)
    metrics = {"loss": loss, "grad_norm": number(fields.get("grad norm"), "grad norm"),
               "learning_rate": number(fields.get("learning rate"), "learning rate"),
               "consumed_samples": number(fields.get("consumed samples"), "consumed samples"),
               "global_batch_size": number(fields.get("global batch size"), "global batch size")}
    elapsed = number(fields.get("elapsed time per iteration (ms)"), "elapsed time per iteration (ms)")
    if elapsed is not None:
        metrics["step_time_seconds"] = elapsed / 1000.0
    if loss is None and metrics["grad_norm"] is None:
        raise ValueError("no loss and no grad norm in an iteration line")
    return tls.make_record(step=step, timestamp=when, metrics={k: v for k, v in metrics.items() if v is not None})


def number(text: str | None, field: str) -> float | None:
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{field}: {text!r} is not a number") from None
    return value
