"""Where the checkpoint components report what they did: the structured log and the trainer's event sink.

Each component (saving's outcome, retention, restore) holds one `Events` and calls `emit(kind, **fields)`
for the TLS events the trainer records (`checkpoint_saved`, `checkpoint_deleted`, ...) and `log` for the
lines an operator reads. A broken sink is logged, never raised: telemetry must not break checkpointing.
"""

from __future__ import annotations

from typing import Any, Callable

EventSink = Callable[..., None]


class Events:
    def __init__(self, sink: EventSink | None, log: Any):
        self._sink, self.log = sink, log

    def emit(self, kind: str, **fields: Any) -> None:
        if self._sink is None:
            return
        try:
            self._sink(kind, **fields)
        except Exception as exc:  # a broken telemetry sink must not break checkpointing
            self.log.warning("checkpoint_event_sink_failed", kind=kind, error=repr(exc))
