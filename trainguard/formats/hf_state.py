"""Hugging Face `trainer_state.json` (what `Trainer` writes into each `checkpoint-N` folder): its
`log_history`, one entry per `Trainer.log` call.

- A training entry (`loss` or `grad_norm`, with `step`) is a step record: `loss`, `grad_norm`,
  `learning_rate`, `epoch`, TRL's `num_tokens` as `tokens_trained`, its other numbers by their own names.
- An evaluation entry is an `evaluation` event: `eval_loss` as `val_loss` and the other `eval_*` numbers
  without the prefix; with several evaluation datasets (`eval_dataset` a dict) the Trainer logs
  `eval_<name>_loss` and `eval_<name>_*`: an event per dataset, with `dataset: <name>`.
- A `predict_*` entry (`Trainer.predict` metrics a script logged; the Trainer gives them no `step`) is a
  `prediction` event at the last step logged before it.
- The closing summary (`train_runtime`, `train_loss`) is a `run_summary` event; any other entry with a
  step and numbers (a callback's own `log`) a `trainer_log` event.
- An entry that is not an object, has no usable `step` (0 .. 2^63-1) or a mapped value that is not a number
  is `Unmapped` at its index; a file that is not JSON, too deep, too large or without a `log_history` list
  is one `Unmapped` for the file. Logging every `logging_steps` (sparse steps) is the format, not a gap.

The file holds no clock: each record's `timestamp` is its step, for order only, and the record carries
``"clock": "none"`` (`notes.clock` NO_CLOCK): replay runs no rule that needs time on it (stall, cost,
time-based alerts), and nothing here pretends a step is a second.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Iterator

from trainguard import event_types, safe_read, tls
from trainguard.formats import CLOCK_KEY, NO_CLOCK, Item, Notes, Unmapped, step_of

MAX_BYTES = 1 << 30             # a trainer_state.json of 5M logged steps is ~1 GB; larger is not one
TRAINING = {"loss": "loss", "grad_norm": "grad_norm", "learning_rate": "learning_rate", "epoch": "epoch",
            "num_tokens": "tokens_trained"}
EVAL_LOSS = re.compile(r"^eval_(?:(?P<dataset>.+)_)?loss$")


def looks_like(head: bytes) -> bool:
    text = head.lstrip()
    return text.startswith(b"{") and b'"log_history"' in head and not _one_record_per_line(text)


def _one_record_per_line(text: bytes) -> bool:
    """TLS: the first line is a whole JSON object with a `timestamp`. trainer_state.json is indented (its
    first line is `{`), or one object without a timestamp."""
    first = text.split(b"\n", 1)[0].strip()
    return first != b"{" and first.endswith(b"}") and b'"timestamp"' in first


def read(path: str | os.PathLike, notes: Notes | None = None) -> Iterator[Item]:
    notes = notes if notes is not None else Notes()
    notes.clock = NO_CLOCK
    source = str(path)
    history = _history(path, source)
    if isinstance(history, Unmapped):
        yield history
        return
    last_step: int | None = None
    for index, entry in enumerate(history):
        try:
            records = _records_of(entry, last_step, notes, index)
        except ValueError as exc:
            yield Unmapped(source, index, unit="entry", error=str(exc))
            continue
        for record in records:
            record[CLOCK_KEY] = NO_CLOCK
            last_step = record.get("step", last_step)
            yield record


def _history(path, source: str) -> list | Unmapped:
    try:
        state = json.loads(safe_read.read_bytes(path, MAX_BYTES, "trainer_state.json"))
    except RecursionError:
        return Unmapped(source, 0, "not a trainer_state.json: nested too deep to be one", "file")
    except (OSError, ValueError) as exc:
        return Unmapped(source, 0, f"not a trainer_state.json: {exc}", "file")
    history = state.get("log_history") if isinstance(state, dict) else None
    if not isinstance(history, list):
        return Unmapped(source, 0, f"not a trainer_state.json: `log_history` is {type(history).__name__}, "
                                   "not a list", "file")
    return history


def _records_of(entry, last_step: int | None, notes: Notes, index: int) -> list[dict]:
    if not isinstance(entry, dict):
        raise ValueError(f"an entry that is a {type(entry).__name__}, not an object")
    numbers = _numbers(entry, notes, index)
    if any(key.startswith("predict_") for key in numbers):
        step = step_of(entry["step"]) if "step" in entry else last_step
        at = step if step is not None else 0
        return [tls.event(event_types.PREDICTION, step=step, timestamp=float(at),
                          **{key[len("predict_"):]: v for key, v in numbers.items() if key.startswith("predict_")})]
    step = step_of(entry.get("step"))
    if step is None:
        raise ValueError(f"step: {entry.get('step')!r} is not a step (an integer 0 .. 2^63-1)"
                         if "step" in entry else "an entry without a step")
    numbers.pop("step", None)
    if "loss" in entry or "grad_norm" in entry:
        for key in ("loss", "grad_norm"):
            if key in entry and key not in numbers:
                raise ValueError(f"{key}: {entry[key]!r} is not a number")
        metrics = {TRAINING.get(key, key): value for key, value in numbers.items()}
        if "tokens_trained" in metrics:
            tokens = metrics["tokens_trained"]
            if math.isfinite(tokens) and 0 <= tokens < 2 ** 63:
                metrics["tokens_trained"] = int(tokens)
            else:
                del metrics["tokens_trained"]
        return [tls.make_record(step=step, timestamp=float(step), metrics=metrics)]
    evaluations = _evaluations(entry, numbers, step)
    if evaluations:
        return evaluations
    if "train_runtime" in entry or "train_loss" in entry:
        return [tls.event(event_types.RUN_SUMMARY, step=step, timestamp=float(step), **numbers)]
    if numbers:
        return [tls.event(event_types.TRAINER_LOG, step=step, timestamp=float(step), **numbers)]
    raise ValueError("an entry with a step and no numbers")


def _evaluations(entry: dict, numbers: dict, step: int) -> list[dict]:
    datasets = []
    for key in entry:
        match = EVAL_LOSS.match(key)
        if match:
            if key not in numbers:
                raise ValueError(f"{key}: {entry[key]!r} is not a number")
            datasets.append(match["dataset"])
    events = []
    for dataset in datasets:
        prefix = "eval_" if dataset is None else f"eval_{dataset}_"
        values = {key[len(prefix):]: value for key, value in numbers.items()
                  if key.startswith(prefix) and (dataset is not None or not _another_dataset(key, datasets))}
        values["val_loss"] = values.pop("loss")
        if "epoch" in numbers:
            values["epoch"] = numbers["epoch"]
        named = {"dataset": dataset} if dataset is not None else {}
        events.append(tls.event(event_types.EVALUATION, step=step, timestamp=float(step), **named, **values))
    return events


def _another_dataset(key: str, datasets: list) -> bool:
    return any(name is not None and key.startswith(f"eval_{name}_") for name in datasets)


def _numbers(entry: dict, notes: Notes, index: int) -> dict[str, float]:
    numbers = {}
    for key, value in entry.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            if key != "step":
                notes.skip(f"log_history values that are not numbers (e.g. {key!r})", index, "entry")
            continue
        try:
            numbers[key] = float(value)
        except OverflowError:                   # an int past a float: as large as a float says
            numbers[key] = math.copysign(math.inf, value)
    if "step" in entry:
        numbers["step"] = entry["step"]
    return numbers
