"""Logging: one configure_logging, JSON lines off a terminal, console on one."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest
import structlog

from imexd import logs
from imexd.logs import configure_logging, get_logger


def reset_logging() -> None:
    """Undo `configure_logging`: structlog's defaults, our handler and hooks removed."""
    structlog.reset_defaults()
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, logs._Handler)]:
        root.removeHandler(handler)
    logging.captureWarnings(False)
    sys.excepthook = sys.__excepthook__
    threading.excepthook = threading.__excepthook__


@pytest.fixture(autouse=True)
def _restore_structlog() -> Iterator[None]:
    hooks = (sys.excepthook, threading.excepthook)
    yield
    reset_logging()
    sys.excepthook, threading.excepthook = hooks


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_auto_format_is_json_lines_off_a_terminal() -> None:
    """Events become one JSON object per line with level, timestamp and component."""
    out = io.StringIO()
    configure_logging("info", "auto", stream=out)
    get_logger("bus", node="n1").info("bus.connected", broker="mqtt://b:1883")
    event = json.loads(out.getvalue().strip())
    assert event["event"] == "bus.connected"
    assert event["component"] == "bus"
    assert event["node"] == "n1"
    assert event["level"] == "info"
    assert event["timestamp"].endswith("Z")


def test_auto_format_is_console_on_a_terminal() -> None:
    """A terminal gets readable lines, not JSON."""
    out = _Tty()
    configure_logging("info", "auto", stream=out)
    get_logger("agent").info("agent.start", incarnation=3)
    text = out.getvalue()
    assert "agent.start" in text
    assert "incarnation" in text
    assert not text.lstrip().startswith("{")


def test_format_can_be_forced() -> None:
    """`json` on a terminal and `console` off one are honoured."""
    tty = _Tty()
    configure_logging("info", "json", stream=tty)
    get_logger("x").info("e1")
    assert json.loads(tty.getvalue())["event"] == "e1"
    plain = io.StringIO()
    configure_logging("info", "console", stream=plain)
    get_logger("x").info("e2")
    assert "e2" in plain.getvalue()
    assert not plain.getvalue().startswith("{")


def test_level_filters_events() -> None:
    """Events below the configured level are dropped."""
    out = io.StringIO()
    configure_logging("warning", "json", stream=out)
    log = get_logger("x")
    log.info("quiet")
    log.warning("loud")
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [e["event"] for e in lines] == ["loud"]


_EVERYTHING_LOGS = """
import asyncio, gc, logging, warnings
from imexd.logs import configure_logging, get_logger, install_loop_handler, log_exception

configure_logging("info", "json")
logging.getLogger("paho").warning("socket error: %s", "[Errno 111] Connection refused")
logging.getLogger("aiohttp.access").info("GET /healthz 200")
logging.getLogger("asyncio").error("plain asyncio record")
log = get_logger("agent")
log.info("agent.start", incarnation=1)
try:
    raise ValueError("bad record")
except ValueError as exc:
    log.error("task.failed", exc_info=exc)
    log_exception(log, "task.failed_again", exc, task="reconcile")
warnings.warn("a library warns", UserWarning, stacklevel=1)

async def boom() -> None:
    raise RuntimeError("never retrieved")

async def main() -> None:
    install_loop_handler()
    task = asyncio.create_task(boom())
    await asyncio.sleep(0.05)
    del task
    gc.collect()
    asyncio.get_running_loop().call_soon(lambda: 1 / 0)
    await asyncio.sleep(0.05)

asyncio.run(main())
raise SystemError("the end")
"""


def test_every_stderr_line_is_one_json_object_whoever_logs() -> None:
    """stdlib loggers, asyncio's handler, warnings and a crash each give one JSON line."""
    done = subprocess.run(
        [sys.executable, "-c", _EVERYTHING_LOGS],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1
    lines = done.stderr.splitlines()
    events = [json.loads(line) for line in lines]
    assert all(isinstance(e, dict) for e in events), done.stderr
    by_event = {e["event"]: e for e in events}
    paho = by_event["socket error: [Errno 111] Connection refused"]
    assert (paho["logger"], paho["level"]) == ("paho", "warning")
    assert paho["timestamp"].endswith("Z")
    assert "GET /healthz 200" not in by_event
    assert by_event["agent.start"]["component"] == "agent"
    failed = by_event["task.failed"]
    assert "ValueError: bad record" in failed["exception"]
    assert failed["exception"].startswith("Traceback")
    again = by_event["task.failed_again"]
    assert (again["error"], again["task"]) == ("ValueError: bad record", "reconcile")
    loop_errors = [e for e in events if e["event"] == "asyncio.error"]
    assert len(loop_errors) == 2
    never, callback = loop_errors
    assert never["message"] == "Task exception was never retrieved"
    assert "RuntimeError: never retrieved" in never["exception"]
    assert "boom" in never["future"]
    assert "ZeroDivisionError" in callback["exception"]
    assert "handle" in callback
    assert any("a library warns" in e["event"] for e in events)
    crash = by_event["process.uncaught"]
    assert crash["level"] == "error"
    assert "SystemError: the end" in crash["exception"]


def test_console_mode_renders_foreign_records_and_tracebacks() -> None:
    """Console mode formats stdlib records too and draws the traceback under its event."""
    out = io.StringIO()
    configure_logging("info", "console", stream=out)
    logging.getLogger("aiohttp.server").error("handler failed")
    try:
        raise KeyError("slot")
    except KeyError as exc:
        get_logger("agent").error("task.failed", exc_info=exc)
    text = out.getvalue()
    assert "handler failed" in text
    assert "aiohttp.server" in text
    assert "task.failed" in text
    assert "KeyError" in text


def test_configuring_again_replaces_the_handler() -> None:
    """A second configure_logging does not print each record twice."""
    first, second = io.StringIO(), io.StringIO()
    configure_logging("info", "json", stream=first)
    configure_logging("info", "json", stream=second)
    logging.getLogger("paho").error("once")
    get_logger("x").info("also once")
    assert first.getvalue() == ""
    assert [json.loads(line)["event"] for line in second.getvalue().splitlines()] == [
        "once",
        "also once",
    ]
