"""Helpers shared by the tests: loopback addresses, bounded waits, a raw MQTT client, the CLI.

Free ports are the demo's (`imexd.demo.brokers.free_port`), the Mosquitto launcher is
tests/brokers.py's. Everything here talks to 127.0.0.0/8 only, and every wait is bounded
in time.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import inspect
import itertools
import os
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import aiomqtt

from tests.brokers import Mosquitto

if TYPE_CHECKING:
    import pytest

IMEXD = str(Path(sys.executable).with_name("imexd"))
"""The `imexd` console script of the test's environment."""


def imexd(
    *args: str, env: Mapping[str, str] | None = None, timeout: float = 60.0
) -> subprocess.CompletedProcess[str]:
    """`imexd ARGS` as a shell or a Slurm prolog runs it: the installed script, its output
    as text, its exit status returned rather than raised, at most `timeout` seconds.

    The environment is this process's without its `IMEXD_*` variables (a developer's own
    would change what the test checks), plus `env`: the settings the test means. A test
    whose event loop serves what the command asks runs it in a thread
    (`asyncio.to_thread`)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("IMEXD_")}
    return subprocess.run(
        [IMEXD, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=clean | dict(env or {}),
        check=False,
    )


_addr_counter = itertools.count(1)


def loopback_address() -> str:
    """A fresh 127.x.y.z address, distinct per test and per concurrent pytest process."""
    n = next(_addr_counter)
    second = 10 + os.getpid() % 240
    return f"127.{second}.{n // 250 % 250}.{n % 250 + 2}"


def describe(predicate: Callable[[], object]) -> str:
    """What a wait waited for, from its predicate: a named function's name, or a lambda's
    own source text (`lambda: node.ready()`), with where it was written."""
    code = getattr(predicate, "__code__", None)
    where = f" ({Path(code.co_filename).name}:{code.co_firstlineno})" if code else ""
    name = getattr(predicate, "__qualname__", repr(predicate))
    if getattr(predicate, "__name__", "") != "<lambda>":
        return name + where
    try:
        lines, _ = inspect.getsourcelines(predicate)
    except (OSError, TypeError):
        return "a lambda" + where
    text = textwrap.dedent("".join(lines))
    for source in (text, f"({text.strip().rstrip(',')})"):
        with contextlib.suppress(SyntaxError):
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.Lambda):
                    segment = ast.get_source_segment(source, node) or ""
                    return " ".join(segment.split()) + where
    return " ".join(lines[0].split()) + where


def _shown(value: object, limit: int = 600) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


class Waiting:
    """One bounded wait: polls a predicate, keeps what it saw last, and fails with a
    message that names what was awaited and that last observation."""

    def __init__(
        self,
        predicate: Callable[[], object],
        *,
        timeout: float,
        what: str | None,
        seen: Callable[[], object] | None,
    ) -> None:
        self.predicate = predicate
        self.timeout = timeout
        self.what = what or describe(predicate)
        self.seen = seen
        self.last: object = None
        self.deadline = time.monotonic() + timeout

    def done(self) -> bool:
        """Whether the predicate holds now; raises once the deadline has passed."""
        self.last = self.predicate()
        if self.last:
            return True
        if time.monotonic() > self.deadline:
            raise AssertionError(self.failure())
        return False

    def failure(self) -> str:
        if self.seen is None:
            last = _shown(self.last)
        else:
            try:
                last = _shown(self.seen(), limit=2000)
            except Exception as exc:
                last = f"(could not observe: {exc!r})"
        return f"not within {self.timeout:g} s: {self.what}; last seen: {last}"


def spy_calls(
    monkeypatch: pytest.MonkeyPatch, cls: type, *names: str
) -> list[tuple[str, tuple[Any, ...]]]:
    """Record every call of the async methods `names` of `cls`, in order, as (name, its
    positional arguments), and still make it: what a command did, round trip by round
    trip, without changing what it does."""
    calls: list[tuple[str, tuple[Any, ...]]] = []
    for name in names:
        real = getattr(cls, name)

        async def spied(self: object, *args: Any, _real: Any = real, _name: str = name) -> Any:
            calls.append((_name, args))
            return await _real(self, *args)

        monkeypatch.setattr(cls, name, spied)
    return calls


POLL_MAX_S: Final = 0.25
"""The longest pause between two looks of a wait: a wait that lasts polls less often
(each look at an agent is an HTTP request or a file read that it pays for too)."""


def _pauses(first: float) -> Iterator[float]:
    """Pauses between the looks of a wait: `first`, then half as long again each time,
    up to POLL_MAX_S (or `first` when longer). Endless: the wait's deadline ends it."""
    pause, longest = first, max(first, POLL_MAX_S)
    while True:
        yield pause
        pause = min(pause * 1.5, longest)


def wait_for(
    predicate: Callable[[], object],
    *,
    timeout: float = 10.0,
    interval: float = 0.05,
    what: str | None = None,
    seen: Callable[[], object] | None = None,
) -> None:
    """Poll `predicate` until it is truthy; after `timeout` seconds an AssertionError that
    names what was awaited (`what`, else the predicate's own source) and what was seen
    last (`seen()`, else the predicate's last value)."""
    waiting = Waiting(predicate, timeout=timeout, what=what, seen=seen)
    for pause in _pauses(interval):
        if waiting.done():
            return
        time.sleep(pause)


async def until(
    predicate: Callable[[], object],
    *,
    within: float = 30.0,
    interval: float = 0.05,
    what: str | None = None,
    seen: Callable[[], object] | None = None,
) -> None:
    """`wait_for` for a test that runs an event loop: sleeps without blocking it."""
    waiting = Waiting(predicate, timeout=within, what=what, seen=seen)
    for pause in _pauses(interval):
        if waiting.done():
            return
        await asyncio.sleep(pause)


def during(
    seconds: float,
    check: Callable[[], str | None],
    interval: float = 0.25,
    *,
    ends_when: Callable[[], bool] | None = None,
) -> list[str]:
    """Run `check` for `seconds`, or with `ends_when` until that holds (then the run ends,
    and `ends_when` not holding within `seconds` fails); every distinct complaint `check`
    returned, in order."""
    seen: list[str] = []
    deadline = time.monotonic() + seconds
    while True:
        problem = check()
        if problem is not None and problem not in seen:
            seen.append(problem)
        if ends_when is not None and ends_when():
            return seen
        if time.monotonic() >= deadline:
            assert ends_when is None, f"not within {seconds} s: {describe(ends_when)}"
            return seen
        time.sleep(interval)


@contextlib.asynccontextmanager
async def raw_client(
    broker: Mosquitto,
    *,
    wait_s: float = 10.0,
    tls_params: aiomqtt.TLSParameters | None = None,
    username: str | None = None,
    password: str | None = None,
    identifier: str | None = None,
    keepalive: int = 60,
) -> AsyncIterator[aiomqtt.Client]:
    """A plain MQTT 5 client, as a control plane in another language would use; entering
    and leaving it take at most `wait_s` seconds each (also its operations' timeout)."""
    async with asyncio.timeout(wait_s):
        c = aiomqtt.Client(
            broker.host,
            broker.port,
            username=username,
            password=password,
            identifier=identifier or f"test-{uuid.uuid4().hex[:8]}",
            protocol=aiomqtt.ProtocolVersion.V5,
            tls_params=tls_params,
            keepalive=keepalive,
            timeout=wait_s,
        )
        await c.__aenter__()
    try:
        yield c
    finally:
        async with asyncio.timeout(wait_s):
            await c.__aexit__(None, None, None)


async def cancel_and_wait(task: asyncio.Task[None], within: float = 10.0) -> None:
    """Cancel `task` and wait until it ended, cancelling again while it runs on.

    Python 3.11's `asyncio.wait_for` returns its inner future's result when that comes
    at the moment the task is cancelled, and the cancel is lost (gh-86296): a fake agent
    cancelled as aiomqtt's wait for a PUBACK completed went back to waiting for messages,
    and awaiting it hung the test (seen once in a full run). Bounded by `within`.
    """
    deadline = asyncio.get_running_loop().time() + within
    while not task.done():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{task.get_name()} did not end within {within} s of its cancel")
        task.cancel()
        await asyncio.wait({task}, timeout=0.1)
    if not task.cancelled() and (error := task.exception()) is not None:
        raise error
