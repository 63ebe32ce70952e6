"""One structlog pipeline for every trainguard process: readable on a terminal, JSON lines otherwise.

Bind context once (run_id, rank, component) and every line carries it, as structlog recommends.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, TextIO

import structlog


def configure(level: str | None = None, json: bool | None = None, stream: TextIO | None = None) -> None:
    """Set up structlog; `json` defaults to JSON unless stderr is a terminal (TRAINGUARD_LOG_JSON overrides)."""
    stream = stream or sys.stderr
    level_name = (level or os.environ.get("TRAINGUARD_LOG_LEVEL", "info")).upper()
    if json is None:
        forced = os.environ.get("TRAINGUARD_LOG_JSON")
        json = forced == "1" if forced is not None else not stream.isatty()
    renderer = (structlog.processors.JSONRenderer() if json
                else structlog.dev.ConsoleRenderer(colors=stream.isatty()))
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level_name, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )


def get(component: str, **context: Any) -> Any:
    return structlog.get_logger(component=component, **context)
