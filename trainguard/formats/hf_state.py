"""Hugging Face `trainer_state.json` (what `Trainer` writes into each `checkpoint-N` folder): its
`log_history`, one entry per logging step.

A training entry (`loss` or `grad_norm`, with `step`) becomes a step record with `loss`, `grad_norm`,
`learning_rate`, `epoch`; an evaluation entry (`eval_loss`) an `evaluation` event; the closing summary
(`train_runtime`, `train_loss`) a `run_summary` event. The file holds no clock: each record is timed by its
step (seconds), so wall-clock rules have nothing to read. An entry that is none of these is reported.
"""

from __future__ import annotations

import os
from typing import Iterator

from trainguard import safe_read, tls
from trainguard.formats import Item, Unmapped

TRAINING = {"loss": "loss", "grad_norm": "grad_norm", "learning_rate": "learning_rate", "epoch": "epoch"}


def looks_like(head: bytes) -> bool:
    text = head.lstrip()
    return text.startswith(b"{") and b'"log_history"' in head and not _one_record_per_line(text)


def _one_record_per_line(text: bytes) -> bool:
    """TLS: the first line is a whole JSON object. trainer_state.json is indented: its first line is `{`."""
    first = text.split(b"\n", 1)[0].strip()
    return first != b"{" and first.endswith(b"}")


def read(path: str | os.PathLike) -> Iterator[Item]:
    source = str(path)
    try:
        state = safe_read.read_json(path, safe_read.JSON_DOCUMENT_BYTES, "trainer_state.json")
        history = state["log_history"]
    except (ValueError, KeyError, TypeError) as exc:
        yield Unmapped(source, 0, f"not a trainer_state.json: {exc}", "file")
        return
    for index, entry in enumerate(history):
        record = record_of(entry)
        yield record if record is not None else Unmapped(
            source, index, unit="entry", error=f"an entry with neither loss, eval_loss nor train_runtime: {entry}")


def record_of(entry: dict) -> dict | None:
    if not isinstance(entry, dict) or not isinstance(entry.get("step"), int):
        return None
    step = entry["step"]
    numbers = {k: float(v) for k, v in entry.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    if "loss" in entry or "grad_norm" in entry:
        metrics = {field: numbers[key] for key, field in TRAINING.items() if key in numbers}
        return tls.make_record(step=step, timestamp=float(step), metrics=metrics)
    if "eval_loss" in entry:
        return tls.event("evaluation", step=step, timestamp=float(step), val_loss=numbers["eval_loss"],
                         **{k: v for k, v in numbers.items() if k not in ("eval_loss", "step")})
    if "train_runtime" in entry:
        return tls.event("run_summary", step=step, timestamp=float(step),
                         **{k: v for k, v in numbers.items() if k != "step"})
    return None
