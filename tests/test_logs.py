"""Logging: one configure_logging, JSON lines off a terminal, console on one."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator

import pytest
import structlog

from imexd.logs import configure_logging, get_logger


@pytest.fixture(autouse=True)
def _restore_structlog() -> Iterator[None]:
    yield
    structlog.reset_defaults()


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
