"""One structlog pipeline for every trainguard process: readable on a terminal, JSON lines otherwise.

Bind context once (run_id, rank, component) and every line carries it, as structlog recommends.

structlog (and rich, which its console renderer brings) costs a quarter of a second to import, and most
commands log nothing (`replay`, `status`, `report`: their output is the result). So `configure()` settles
the pipeline's settings (level, JSON or console, the stream of that moment) and structlog is imported and
configured with them when the first logger is asked for (`get`), or at once if it is already imported.
"""

from __future__ import annotations

import os
import sys
from typing import Any, NamedTuple, TextIO


class _Settings(NamedTuple):
    level_name: str
    json: bool
    stream: TextIO
    colors: bool        # the console renderer's, for a terminal


_pending: _Settings | None = None     # configure()'s settings, not yet handed to structlog


def configure(level: str | None = None, json: bool | None = None, stream: TextIO | None = None) -> None:
    """Set up structlog; `json` defaults to JSON unless stderr is a terminal (TRAINGUARD_LOG_JSON overrides)."""
    global _pending
    stream = stream or sys.stderr
    level_name = (level or os.environ.get("TRAINGUARD_LOG_LEVEL", "info")).upper()
    if json is None:
        forced = os.environ.get("TRAINGUARD_LOG_JSON")
        json = forced == "1" if forced is not None else not stream.isatty()
    _pending = _Settings(level_name, json, stream, colors=not json and stream.isatty())
    if "structlog" in sys.modules:    # someone may already log through it: the pipeline applies now
        _apply_pending()


def get(component: str, **context: Any) -> Any:
    import structlog

    _apply_pending()
    return structlog.get_logger(component=component, **context)


def _apply_pending() -> None:
    global _pending
    if _pending is not None:
        settings, _pending = _pending, None
        _apply(settings)


def _apply(settings: _Settings) -> None:
    import logging

    import structlog

    from trainguard import terminal

    renderer = (structlog.processors.JSONRenderer() if settings.json
                else structlog.dev.ConsoleRenderer(colors=settings.colors))
    # The console renderer writes colours of its own: it gets the terminal itself, and the values it prints
    # (which may come from the run directory) are escaped before it (trainguard/terminal.py). JSON escapes
    # every control character by itself.
    escaping = [] if settings.json else [terminal.escape_values]
    stream = settings.stream if settings.json else terminal.unwrapped(settings.stream)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            *escaping,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, settings.level_name, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
