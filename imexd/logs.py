"""Structured logging: one `configure_logging` entry point over structlog.

Log events are key-value pairs. When the output stream is not a terminal (systemd's
journal, a container runtime, a test) each event is one JSON line; on a terminal it is
a readable console line. `format` forces either.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, Literal, TextIO

import structlog

LogFormat = Literal["auto", "json", "console"]

LEVELS = ("debug", "info", "warning", "error", "critical")


def configure_logging(
    level: str = "info", fmt: LogFormat = "auto", *, stream: TextIO | None = None
) -> None:
    """Route every structlog event at `level` or above to `stream` (stderr by default)."""
    out = stream if stream is not None else sys.stderr
    if fmt == "auto":
        fmt = "console" if out.isatty() else "json"
    renderer: Any
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer(sort_keys=False)
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=out.isatty())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping()[level.upper()]
        ),
        logger_factory=structlog.PrintLoggerFactory(out),
        cache_logger_on_first_use=False,
    )


def get_logger(component: str, **bound: Any) -> structlog.typing.FilteringBoundLogger:
    """A logger bound to one component (`bus`, `daemon`, `membership`, ...)."""
    logger: structlog.typing.FilteringBoundLogger = structlog.get_logger(component=component)
    return logger.bind(**bound) if bound else logger
