"""TensorBoard event files (`events.out.tfevents.*`), read with TensorBoard's own reader (the `tensorboard`
package; `pip install tensorboard`).

Scalar summaries become TLS step metrics, one record per step, by tag: `DEFAULT_MAP` holds the tags of the
Hugging Face Trainer (`train/loss`, ...), Megatron-LM (`lm loss`, `grad-norm`, `learning-rate`) and plain
`loss`/`grad_norm`/`lr`; `--map TAG=FIELD` (trainguard convert) adds or overrides one. Each record is timed
by the first wall time among its step's events. A scalar with a tag the map does not name is reported once
per tag (its first event and how many there were); non-scalar events (graphs, histograms, images) are
reported the same way; the file-version header is not data.
"""

from __future__ import annotations

import os
from typing import Iterator

from trainguard import tls
from trainguard.formats import Item, Unmapped

MAGIC = b"brain.Event:"
DEFAULT_MAP = {
    "loss": "loss", "train/loss": "loss", "train_loss": "loss", "lm loss": "loss", "train/lm loss": "loss",
    "grad_norm": "grad_norm", "train/grad_norm": "grad_norm", "grad-norm": "grad_norm",
    "lr": "learning_rate", "learning_rate": "learning_rate", "train/learning_rate": "learning_rate",
    "learning-rate": "learning_rate",
}


def looks_like(head: bytes) -> bool:
    return MAGIC in head[:128]


def read(path: str | os.PathLike, tag_map: dict[str, str] | None = None) -> Iterator[Item]:
    try:
        from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
        from tensorboard.util import tensor_util
    except ImportError:
        yield Unmapped(str(path), 0, unit="file", error="a TensorBoard event file: reading it needs `pip install tensorboard`")
        return
    mapping = {**DEFAULT_MAP, **(tag_map or {})}
    steps: dict[int, dict] = {}
    unmapped: dict[str, list] = {}
    for index, event in enumerate(EventFileLoader(str(path)).Load()):
        if not event.HasField("summary"):
            if not event.HasField("file_version"):
                unmapped.setdefault(f"a {event.WhichOneof('what')} event", [index, 0])[1] += 1
            continue
        for value in event.summary.value:
            field = mapping.get(value.tag)
            scalar = _scalar(value, tensor_util)
            if field is None or scalar is None:
                what = f"tag {value.tag!r}" + ("" if scalar is not None else " (not a scalar)")
                unmapped.setdefault(what, [index, 0])[1] += 1
                continue
            entry = steps.setdefault(event.step, {"timestamp": event.wall_time, "metrics": {}})
            entry["metrics"][field] = scalar
    for step in sorted(steps):
        yield tls.make_record(step=step, timestamp=steps[step]["timestamp"], metrics=steps[step]["metrics"])
    for what, (first, count) in unmapped.items():
        yield Unmapped(str(path), first, f"{what}: {count} event(s) not mapped to a TLS field "
                                           "(trainguard convert --map TAG=FIELD)", "event")


def _scalar(value, tensor_util) -> float | None:
    kind = value.WhichOneof("value")
    if kind == "simple_value":
        return float(value.simple_value)
    if kind == "tensor":
        array = tensor_util.make_ndarray(value.tensor)
        return float(array) if array.size == 1 and array.dtype.kind in "fiu" else None
    return None
