"""Structured logging: one `configure_logging` entry point over structlog.

Log events are key-value pairs. When the output stream is not a terminal (systemd's
journal, a container runtime, a test) each event is one JSON line; on a terminal it is
a readable console line. `format` forces either.

Every line the agent writes goes through one formatter, so that in JSON mode every line
is one JSON object (`jq` stops at the first that is not):
- structlog events are handed to the stdlib logger `imexd` and rendered by structlog's
  `ProcessorFormatter`, on one handler of the root logger (one lock, one write per line);
- records of other libraries' stdlib loggers (paho, asyncio) reach that same
  handler and get `level`, `timestamp` and `logger` fields; they are kept from `warning`
  up, since their info lines are not the agent's story;
- `warnings` and uncaught exceptions (main thread and threads) become events too;
- the event loop's exception handler (`install_loop_handler`) turns "Task exception was
  never retrieved" and failed callbacks into one `asyncio.error` event.
A traceback is a string field, `exception`, of the event it belongs to, never raw lines.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
from types import TracebackType
from typing import Any, TextIO

import structlog

from imexd.settings import LogFormat

LOGGER_NAME = "imexd"
"""The stdlib logger that carries structlog's events to the shared handler."""

_LOOP_CONTEXT_FIELDS = ("future", "task", "handle", "protocol", "transport", "socket")
"""Keys of an asyncio exception context that are shown (as their repr) in `asyncio.error`."""


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    """The root handler installed by `configure_logging` (recognised to replace it)."""


class _ForeignLevel(logging.Filter):
    """Pass the agent's own events as they come; others' records from `threshold` up."""

    def __init__(self, threshold: int) -> None:
        super().__init__()
        self.threshold = threshold

    def filter(self, record: logging.LogRecord) -> bool:
        own = record.name == LOGGER_NAME or record.name.startswith(LOGGER_NAME + ".")
        return own or record.levelno >= self.threshold


def configure_logging(
    level: str = "info", fmt: LogFormat = "auto", *, stream: TextIO | None = None
) -> None:
    """Route every event at `level` or above to `stream` (stderr by default), one per line.

    Calling it again replaces the previous configuration (handler included).
    """
    out = stream if stream is not None else sys.stderr
    if fmt == "auto":
        fmt = "console" if out.isatty() else "json"
    levelno = logging.getLevelNamesMapping()[level.upper()]
    renderer: Any
    tail: list[Any]
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer(sort_keys=False)
        tail = [structlog.processors.format_exc_info, renderer]
    else:
        # The console renderer draws exc_info itself (and warns when it finds it rendered)
        renderer = structlog.dev.ConsoleRenderer(colors=out.isatty())
        tail = [renderer]
    timestamper = structlog.processors.TimeStamper(fmt="iso", utc=True)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            timestamper,
            structlog.processors.StackInfoRenderer(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(levelno),
        logger_factory=_own_logger,
        cache_logger_on_first_use=False,
    )
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.stdlib.add_logger_name,
            timestamper,
        ],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *tail],
    )
    handler = _Handler(out)
    handler.setFormatter(formatter)
    handler.addFilter(_ForeignLevel(max(levelno, logging.WARNING)))
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    if root.level > logging.WARNING or root.level == logging.NOTSET:
        root.setLevel(logging.WARNING)
    own = logging.getLogger(LOGGER_NAME)
    own.setLevel(levelno)
    own.propagate = True
    logging.captureWarnings(True)
    sys.excepthook = _log_uncaught
    threading.excepthook = _log_uncaught_in_thread


def _own_logger(*_args: Any) -> logging.Logger:
    """structlog's logger factory: every event goes to the `imexd` stdlib logger."""
    return logging.getLogger(LOGGER_NAME)


def get_logger(component: str, **bound: Any) -> structlog.typing.FilteringBoundLogger:
    """A logger bound to one component (`bus`, `daemon`, `membership`, ...)."""
    logger: structlog.typing.FilteringBoundLogger = structlog.get_logger(component=component)
    return logger.bind(**bound) if bound else logger


def log_exception(
    log: structlog.typing.FilteringBoundLogger, event: str, exc: BaseException, **fields: Any
) -> None:
    """Log `exc` as one error event: `error` (type: message) and the `exception` traceback."""
    log.error(event, error=f"{type(exc).__name__}: {exc}", exc_info=exc, **fields)


def install_loop_handler(loop: asyncio.AbstractEventLoop | None = None) -> None:
    """Make `loop` (the running one by default) report its unhandled errors as events.

    asyncio's default handler writes "Task exception was never retrieved" and failed
    callbacks as multi-line text; this one logs one `asyncio.error` event with asyncio's
    `message`, the task or callback (repr) and the traceback as a field.
    """
    target = loop if loop is not None else asyncio.get_running_loop()
    target.set_exception_handler(_loop_exception_handler)


def _loop_exception_handler(_loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    log = get_logger("asyncio")
    exc = context.get("exception")
    fields = {key: repr(context[key]) for key in _LOOP_CONTEXT_FIELDS if key in context}
    message = str(context.get("message") or "unhandled error in the event loop")
    if isinstance(exc, BaseException):
        log_exception(log, "asyncio.error", exc, message=message, **fields)
    else:
        log.error("asyncio.error", message=message, **fields)


def _log_uncaught(
    exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
) -> None:
    """sys.excepthook: the exception that ends the process is one `uncaught` event."""
    if issubclass(exc_type, KeyboardInterrupt):
        sys.__excepthook__(exc_type, exc, tb)
        return
    log_exception(get_logger("process"), "process.uncaught", exc.with_traceback(tb))


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    """threading.excepthook: an exception that ends a thread is one `thread.uncaught` event."""
    exc = args.exc_value
    if exc is None:
        return
    thread = args.thread.name if args.thread is not None else None
    log_exception(
        get_logger("process"),
        "thread.uncaught",
        exc.with_traceback(args.exc_traceback),
        thread=thread,
    )
