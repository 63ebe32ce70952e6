"""Megatron-LM's and Megatron-DeepSpeed's training logs (megatron/training.py `training_log`), as they print them:

     [2024-05-01 10:00:00] iteration      120/  500000 | consumed samples:        61440 | elapsed time per
     iteration (ms): 812.3 | learning rate: 2.999988E-04 | global batch size:   512 | lm loss: 2.365713E+00 |
     loss scale: 1.0 | grad norm: 0.412 | number of skipped iterations:   0 | number of nan iterations:   0 |

(one line; the bracketed time only in newer Megatron; behind a launcher's rank tag or a timestamp, see
metric_lines.py). Each ` key: value |` field of an iteration line is read by the table `FIELDS`: `lm loss`
(DeepSpeed's `lm-loss`), `grad norm`, `learning rate`, `elapsed time per iteration (ms)` or `(s)`,
`consumed samples`, `consumed tokens`, `global batch size`, `samples per second`, `TFLOPs`, `loss scale`,
and the skipped and nan iteration counts. A field the table does not name is passed over and counted.

What a line does not say is read as Megatron means it:
- no `lm loss`: Megatron prints the average loss of the interval only `if avg > 0.0`, so a NaN or infinite
  loss is left out. When some iterations of the interval were applied (`number of skipped iterations` below
  the interval), the missing loss is NaN. When all were skipped by the loss scaler (fp16's search for a
  scale at the start, an overflow), there was no loss to print: the record has none, and its
  `skipped_iterations` equals its `iterations`.
- DeepSpeed prints `grad norm: 0.000` and `loss scale: -1.0` as placeholders (it keeps them itself): not read.
- DeepSpeed's `OVERFLOW! Rank 0 Skipping step` (or `Overflow detected. Skipping step`) lines before an
  iteration line are skipped steps of that iteration (`skipped_iterations`; DeepSpeed's Megatron prints 0
  there); the grad norm printed for an iteration whose every step was skipped is the last applied step's
  (stale): the record holds `grad_norm` inf, what the scaler found (a finite loss beside a non-finite
  gradient norm is the scaler's overflow to the guard).
- `validation loss at iteration N | lm loss value: ... |` is an `evaluation` event (`val_loss`).

Time: a line's own timestamp; else the last timestamp the log printed before its first iteration (DeepSpeed's
`[2022-10-28 22:57:01,575]` lines) or 0, advanced by each line's `elapsed time per iteration` times the
iterations it covers (`notes.clock` "elapsed" when nothing anchored it); else, with neither, the step for
order only (`notes.clock` NO_CLOCK). An iteration line that cannot be read is `Unmapped` with its line number.
"""

from __future__ import annotations

import math
import os
import re
from typing import Iterator

from trainguard import event_types, tls
from trainguard.formats import CLOCK_KEY, NO_CLOCK, Item, Notes, Unmapped, metric_lines, step_of

ITERATION = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|")
ITERATION_BYTES = re.compile(rb"\biteration\s+\d+\s*/\s*\d+\s*\|[^\n]*\|")
VALIDATION = re.compile(r"validation loss at (?:iteration\s+(\d+)|[^|]*?)\s*\|")
OVERFLOW = re.compile(r"OVERFLOW! Rank \d+ Skipping step|Overflow detected\. Skipping step")

# log key -> (TLS metric, divide by); a metric's first key present on a line is read
FIELDS = {
    "lm loss": ("loss", 1.0), "lm-loss": ("loss", 1.0), "loss": ("loss", 1.0),
    "grad norm": ("grad_norm", 1.0), "grad-norm": ("grad_norm", 1.0),
    "learning rate": ("learning_rate", 1.0), "learning-rate": ("learning_rate", 1.0),
    "elapsed time per iteration (ms)": ("step_time_seconds", 1000.0),
    "elapsed time per iteration (s)": ("step_time_seconds", 1.0),
    "consumed samples": ("consumed_samples", 1.0),
    "consumed tokens": ("tokens_trained", 1.0),
    "global batch size": ("global_batch_size", 1.0),
    "samples per second": ("samples_per_second", 1.0),
    "tokens per second": ("tokens_per_second", 1.0),
    "TFLOPs": ("tflops", 1.0),
    "throughput per GPU (TFLOP/s/GPU)": ("tflops", 1.0),
    "loss scale": ("loss_scale", 1.0),
    "number of skipped iterations": ("skipped_iterations", 1.0),
    "number of nan iterations": ("nan_iterations", 1.0),
    "num zeros": ("grad_num_zeros", 1.0),
    "params norm": ("param_norm", 1.0),
}
INTEGERS = frozenset({"tokens_trained", "consumed_samples", "global_batch_size", "skipped_iterations",
                      "nan_iterations"})
VALIDATION_FIELDS = {"lm loss value": "val_loss", "lm loss PPL": "val_ppl"}


def looks_like(head: bytes) -> bool:
    return looks_like_text(head)


def looks_like_text(block: bytes) -> bool:
    """An iteration line with its fields anywhere in `block` (Megatron's own, behind any prefix)."""
    return b"iteration" in block and ITERATION_BYTES.search(block) is not None


class _Clock:
    """The time of each record (see the module's doc)."""

    def __init__(self) -> None:
        self.anchor: float | None = None      # the log's last printed time before its first iteration
        self.now: float | None = None
        self.kind = NO_CLOCK

    def at(self, step: int, printed: float | None, elapsed: float | None, iterations: int) -> float:
        if printed is not None:
            self.now, self.kind = printed, "wall"
        elif elapsed is not None and math.isfinite(elapsed) and 0 <= elapsed < 1e7:
            start = self.now if self.now is not None else (self.anchor or 0.0)
            self.now = start + elapsed * iterations
            if self.kind == NO_CLOCK:
                self.kind = "wall" if self.anchor is not None else "elapsed"
        elif self.now is None:
            return float(step)
        return self.now


def read(path: str | os.PathLike, notes: Notes | None = None) -> Iterator[Item]:
    notes = notes if notes is not None else Notes()
    source = str(path)
    clock, ranks = _Clock(), metric_lines.Ranks()
    previous: int | None = None           # the last iteration read (the interval a line covers)
    overflows = 0                         # DeepSpeed's skipped steps since the last iteration line
    stale_norms, placeholders = [0, 0], [0, 0]       # count, first line
    for lineno, text in metric_lines.segments(path):
        if "iteration" not in text:
            if ("OVERFLOW" in text or "Overflow" in text) and OVERFLOW.search(text):
                overflows += 1
            elif previous is None and "-" in text:
                clock.anchor = metric_lines.time_of(text) or clock.anchor   # the log's time before its first step
            continue
        match = ITERATION.search(text)
        if match is None:
            if "validation loss" in text:
                yield from _validation(text, lineno, previous, clock, source)
            continue
        prefix = metric_lines.prefix_of(text[:match.start()])
        if not ranks.keep(prefix.rank, lineno):
            continue
        step = step_of(int(match.group(1)))
        if step is None:
            yield Unmapped(source, lineno, f"iteration {match.group(1)}: beyond a 64-bit step")
            continue
        try:
            fields, unknown = _fields(text[match.end():])
        except ValueError as exc:
            yield Unmapped(source, lineno, str(exc))
            continue
        for key in unknown:
            notes.skip(f"iteration-line field {key!r} (TLS has no name for it)", lineno)
        iterations = step - previous if previous is not None and step > previous else None
        metrics = _metrics(fields, iterations, overflows)
        if "grad_norm" in metrics and fields.get("loss_scale") == -1.0 and metrics["grad_norm"] == 0.0:
            del metrics["grad_norm"]                  # DeepSpeed's placeholder
            _count(placeholders, lineno)
        if overflows and metrics.get("skipped_iterations", 0) >= (iterations or 1) and "grad_norm" in metrics:
            metrics["grad_norm"] = math.inf           # the overflow; the norm printed is the last applied step's
            _count(stale_norms, lineno)
        overflows = 0
        if not ({"loss", "grad_norm", "skipped_iterations"} & metrics.keys()):
            yield Unmapped(source, lineno, "an iteration line with no loss, no grad norm and no skipped count")
            continue
        when = clock.at(step, prefix.time, fields.get("step_time_seconds"), iterations or 1)
        previous = step
        record = tls.make_record(step=step, timestamp=when, metrics=metrics)
        yield _marked(record, clock)
    ranks.note(notes, "iteration lines")
    if placeholders[0]:
        notes.skip("DeepSpeed placeholder grad norms (`grad norm: 0.000` beside `loss scale: -1.0`)",
                   placeholders[1], count=placeholders[0])
    if stale_norms[0]:
        notes.skip("stale grad norms printed for iterations DeepSpeed's loss scaler skipped (read as inf: the "
                   "overflow)", stale_norms[1], count=stale_norms[0])
    notes.clock = clock.kind


def _count(counter: list, lineno: int) -> None:
    counter[0] += 1
    counter[1] = counter[1] or lineno


def _marked(record: dict, clock: _Clock) -> dict:
    if clock.kind == NO_CLOCK:
        record[CLOCK_KEY] = NO_CLOCK
    return record


def _fields(text: str) -> tuple[dict[str, float], list[str]]:
    """The `key: value |` fields after the iteration number: the mapped ones by TLS name (first key wins),
    and the keys the table does not name. ValueError names a mapped field whose value is not a number."""
    fields: dict[str, float] = {}
    unknown = []
    for part in text.split("|"):
        key, sep, value = part.partition(":")
        key = key.strip()
        if not sep or not key:
            continue
        mapped = FIELDS.get(key)
        if mapped is None:
            unknown.append(key)
            continue
        name, per = mapped
        if name in fields:
            continue
        try:
            fields[name] = metric_lines.number(value) / per
        except ValueError:
            raise ValueError(f"{key}: {value.strip()!r} is not a number") from None
    return fields, unknown


def _metrics(fields: dict[str, float], iterations: int | None, overflows: int) -> dict:
    metrics = {}
    for name, value in fields.items():
        if name in INTEGERS:
            if not math.isfinite(value) or value < 0 or value > 2 ** 63:
                continue
            value = int(value)
        metrics[name] = value
    if metrics.get("loss_scale") == -1.0:
        del metrics["loss_scale"]                     # DeepSpeed's placeholder: it keeps the scale itself
    if overflows:
        metrics["skipped_iterations"] = max(metrics.get("skipped_iterations", 0), min(overflows, iterations or overflows))
    if iterations is not None:
        metrics["iterations"] = iterations
    if "loss" not in metrics:
        skipped = metrics.get("skipped_iterations", 0)
        covered = iterations if iterations is not None else (None if skipped else 1)
        if covered is not None and skipped < covered:
            metrics["loss"] = math.nan                # Megatron leaves out a loss that is not > 0: NaN or inf
    return metrics


def _validation(text: str, lineno: int, previous: int | None, clock: _Clock, source: str) -> Iterator[Item]:
    match = VALIDATION.search(text)
    if match is None:
        return
    step = step_of(int(match.group(1))) if match.group(1) else previous
    values = {}
    for part in text[match.end():].split("|"):
        key, sep, value = part.partition(":")
        name = VALIDATION_FIELDS.get(key.strip())
        if sep and name:
            try:
                values[name] = metric_lines.number(value)
            except ValueError:
                yield Unmapped(source, lineno, f"{key.strip()}: {value.strip()!r} is not a number")
                return
    if "val_loss" not in values:
        yield Unmapped(source, lineno, "a validation line without `lm loss value`")
        return
    when = clock.now if clock.now is not None else float(step or 0)
    yield _marked(tls.event(event_types.EVALUATION, step=step, timestamp=when, **values), clock)
